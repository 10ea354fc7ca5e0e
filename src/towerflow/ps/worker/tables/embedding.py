"""Sparse embedding tables on the ps tasks, seen from a worker.

A table of ``num_rows x dim`` rows is row-sharded over the ps tasks by a
:class:`~towerflow.ps.partition.Partitioner` (``id % num_ps`` by default) and
never materialised on a worker. For a batch, :class:`ShardedEmbedding`:

1. takes the batch's unique ids and each id's place among them (:func:`unique_ids`);
2. splits them by owning shard and pulls each shard's rows with one
   ``PullRows`` call per shard, the shards in parallel;
3. puts the rows in a leaf tensor that requires grad and gathers the batch
   from it with the inverse indices (``index_select``, summed or averaged per
   bag; ``F.embedding_bag`` for ``max`` bags, offsets and weights);
4. after backward, the leaf's gradient *is* the summed gradient of each
   unique row: (unique ids, row gradients) go to the owning shards with one
   ``PushRows`` call per shard, in parallel, applied there once by the
   table's row-wise optimizer (:mod:`towerflow.ps.spec.row_optimizers`). With
   ``defer_push=True`` they travel instead with the next step's pull of the
   same shard (one ``PushPullRows`` round trip per shard and step).

Bytes on the wire per step are ``unique rows x row bytes`` (+ 8 bytes per id)
each way, whatever the table's size. The requests to a ps task travel on one
long-lived stream (:mod:`towerflow.ps.worker.tables.stream`).

The strategy's mode applies to the tables as to the dense parameters
(:mod:`towerflow.ps.server.tables.aggregation`): ``async`` applies each push on
arrival; ``sync`` averages each row over the replicas that pushed it on the
step and applies that once (a push returns when its step is applied);
``ssp`` applies on arrival but holds a worker more than ``staleness`` pushes
ahead of the slowest. In sync and ssp every table pushes to every shard each
step (empty where the step touched no row), and a finished worker says so
(:meth:`SparseTables.done`) so that nobody waits for it.

Two ways in, and why both. TensorFlow 1 users write ``embedding_lookup`` on a
partitioned variable: the table is declared as sharded. The PyTorch user's
model says ``nn.Embedding(10_000_000, 32)``, which allocates the whole weight
(1.28 GB) when it is built, before any strategy sees it. So:

- :class:`ShardedEmbedding` ``(num_rows, dim, ...)`` is the explicit module: it
  owns no weight at all, so a table larger than the worker's memory can be
  declared and trained; its optimizer, initializer and partitioner are
  chosen per table.
- The ``ParameterServer`` strategy swaps every ``nn.Embedding`` /
  ``nn.EmbeddingBag`` declared ``sparse=True`` or at least
  ``sparse_threshold_bytes`` large (64 MiB by default) for a
  :class:`ShardedEmbedding` of the same shape
  (:func:`~towerflow.ps.worker.tables.swap.swap_embeddings`), which starts
  from the module's own values and uses the row-wise counterpart of the
  model's optimizer (sgd, adagrad, adam -> lazy Adam).

This module and :mod:`towerflow.ps.worker.tables.client` speak to the ps through the
generated ``tables_pb2`` messages and the cluster transport only; they import
no server module.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812 - PyTorch's own convention
from torch import nn

from towerflow.errors import FailedPreconditionError, InvalidArgumentError
from towerflow.ps.partition import ModPartitioner, Partitioner, RangePartitioner
from towerflow.ps.spec.row_optimizers import sparse_optimizer_for
from towerflow.ps.spec.tables import DEFAULT_INITIALIZER, TableConfig, describe
from towerflow.ps.worker.tables.checkpoint import ship_rows
from towerflow.ps.worker.tables.client import TableClient
from towerflow.ps.worker.tables.fusion import fuse_tables
from towerflow.ps.worker.tables.prefetch import Prefetcher, host_copy, pull_ahead, recording

__all__ = ["ShardedEmbedding", "SparseTables", "unique_ids",
           "seeded_initializer"]

log = logging.getLogger("towerflow.ps")

_BAG_MODES = ("sum", "mean", "max")
#: a lookup of at most this many values gathers its rows with ``index_select`` (whose
#: backward is an ``index_add_``); larger ones use ``F.embedding`` / ``F.embedding_bag``,
#: which sort the ids in backward but need no ``(ids, dim)`` temporary
_GATHER_LIMIT = 1 << 22


def unique_ids(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sorted unique values of 1-D int64 CPU ``ids`` and each id's index among them.

    ``torch.unique(ids, return_inverse=True)``'s result, from numpy's
    ``unique``, which is 2.5x faster on CPU (106 vs 264 us for 8,192 Zipf ids).

    Example:
        >>> u, inverse = unique_ids(torch.tensor([7, 3, 7]))
        >>> u.tolist(), inverse.tolist()
        ([3, 7], [1, 0, 1])
    """
    unique, inverse = np.unique(ids.numpy(), return_inverse=True)
    return torch.from_numpy(unique), torch.from_numpy(inverse.reshape(-1))


class ShardedEmbedding(nn.Module):
    """An embedding table held by the ps tasks, looked up row by row.

    Behaves as ``nn.Embedding(num_rows, dim)`` (``mode=None``) or
    ``nn.EmbeddingBag(num_rows, dim, mode=mode)``, but owns no weight: each
    forward pulls the batch's unique rows from the ps tasks into a leaf tensor
    that requires grad, and the strategy pushes that leaf's gradient (the
    summed gradient of each unique row) after backward. It runs under the
    ``ParameterServer`` strategy, which binds it to the cluster in
    ``prepare()``.

    Args:
        num_rows: rows of the table (ids are in ``[0, num_rows)``).
        dim: values per row.
        mode: None (one row per id), or ``sum`` / ``mean`` / ``max`` (bags).
        optimizer: the row-wise optimizer (one of ``towerflow.ps.spec``, e.g. ``SparseAdagrad()``,
            or its ``to_dict()``); None: the counterpart of the
            strategy's optimizer.
        initializer: the rows' start (``towerflow.ps.spec.UniformRows`` /
            ``NormalRows`` / ``ConstantRows`` or their dicts); default uniform in
            [-0.05, 0.05), its seed drawn from the table's name (two tables
            start apart).
        partitioner: ``mod`` (default; ``id % num_ps``, even under skewed ids)
            or ``range`` (contiguous rows, as ``tf.fixed_size_partitioner``).
        name: the table's name on the ps (default: the module's path in the model).
        dtype: ``torch.float32`` (default) or ``torch.float64``.
        defer_push: send a step's row gradients with the next pull of this
            table (one round trip per ps task and step instead of a pull and
            a push). The ps applies them before it reads
            the rows of that pull, so this worker's next lookup sees its own
            update as without deferral; the other workers see it one step
            later (when this worker's next step starts, not when its step
            ends). Each push still applies exactly once. A deferred push is
            sent alone before a later push of the same table, before an
            export or import of the table (checkpoints hold it) and when the
            strategy shuts down (before it tells the ps tasks it is done);
            an error of a deferred push is raised by the call that sends it.
            False: each step's push is sent and answered within the step.
            None (default): the strategy's mode decides: deferred in async
            mode (where no worker waits for another's update), not in sync
            and ssp (whose steps count each push).
        padding_idx: an id whose row keeps its value (no update reaches it),
            as ``nn.Embedding(padding_idx=)``.
        trainable: False: the rows are served and never updated (no row
            gradient is pushed), as a frozen ``nn.Embedding``.

    Example::

        class Click(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = towerflow.ps.ShardedEmbedding(10_000_000, 32, mode="sum")
                self.out = nn.Linear(32, 1)
            def forward(self, ids):                   # ids: (batch, ids per example)
                return self.out(self.emb(ids)).squeeze(1)
    """

    def __init__(self, num_rows: int, dim: int, *, mode: str | None = None,
                 optimizer: Any = None, initializer: Any = None, partitioner: str = "mod",
                 name: str | None = None, dtype: torch.dtype = torch.float32,
                 defer_push: bool | None = None, padding_idx: int | None = None,
                 trainable: bool = True) -> None:
        super().__init__()
        for what, value in (("num_rows", num_rows), ("dim", dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"ShardedEmbedding: {what} must be an integer >= 1, "
                                           f"got {value!r}.")
        if mode is not None and mode not in _BAG_MODES:
            raise InvalidArgumentError(f"ShardedEmbedding: mode={mode!r}; use None or one of "
                                       f"{list(_BAG_MODES)}.")
        if partitioner not in ("mod", "range"):
            raise InvalidArgumentError(f"ShardedEmbedding: partitioner={partitioner!r}; use "
                                       "'mod' or 'range'.")
        if dtype not in (torch.float32, torch.float64):
            raise InvalidArgumentError(f"ShardedEmbedding: dtype={dtype}; use torch.float32 or "
                                       "torch.float64.")
        self.num_rows, self.dim, self.mode, self.dtype = num_rows, dim, mode, dtype
        if padding_idx is not None and not (isinstance(padding_idx, int)
                                            and 0 <= padding_idx < num_rows):
            raise InvalidArgumentError(f"ShardedEmbedding: padding_idx={padding_idx!r} is not an "
                                       f"id of the table; use an id in [0, {num_rows}) or None.")
        self.optimizer = None if optimizer is None else describe(optimizer, "optimizer")
        #: None: towerflow's initializer, seeded by the table's name (make_config)
        self.initializer = None if initializer is None else describe(initializer, "initializer")
        self.partitioner_kind, self.table_name = partitioner, name
        #: None until the strategy binds the table (its mode decides, see ``defer_push``)
        self.defer_push = None if defer_push is None else bool(defer_push)
        self.padding_idx, self.trainable = padding_idx, bool(trainable)
        self._start: tuple[torch.Tensor | None, torch.Tensor] | None = None
        self._client: TableClient | None = None
        self.config: TableConfig | None = None
        self._touched: list[tuple[torch.Tensor, torch.Tensor]] = []
        #: rows pulled ahead for this forward's lookups: (ids, unique, inverse, rows) in order
        self.prefetched: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        #: called when a lookup's ids were not those pulled ahead for it
        self.on_miss: Callable[[], None] | None = None

    def start_from(self, rows: torch.Tensor, ids: torch.Tensor | None = None) -> None:
        """Rows the table starts from, shipped once when the chief creates it.

        Args:
            rows: ``(num_rows, dim)`` (``ids`` None: the whole table, e.g. a
                module's weight; kept by reference, not copied) or
                ``(len(ids), dim)``.
            ids: the ids of ``rows``; the other rows keep the initializer's values.
        """
        want = (self.num_rows if ids is None else ids.numel(), self.dim)
        if tuple(rows.shape) != want:
            raise InvalidArgumentError(f"ShardedEmbedding.start_from: rows of shape "
                                       f"{tuple(rows.shape)}, expected {want}.")
        self._start = (ids, rows)

    @property
    def holds_start(self) -> bool:
        """Whether rows given by :meth:`start_from` wait to be shipped."""
        return self._start is not None

    def take_start(self) -> tuple[torch.Tensor | None, torch.Tensor] | None:
        """The ``(ids, rows)`` of :meth:`start_from`, forgotten here (shipped or not needed)."""
        start, self._start = self._start, None
        return start

    def extra_repr(self) -> str:
        bag = "" if self.mode is None else f", mode={self.mode!r}"
        defer = "" if self.defer_push is None else f", defer_push={self.defer_push}"
        return f"{self.num_rows}, {self.dim}{bag}, partitioner={self.partitioner_kind!r}{defer}"

    @property
    def nbytes(self) -> int:
        """Bytes the whole table's rows take (on the ps tasks, not here)."""
        return self.num_rows * self.dim * torch.empty((), dtype=self.dtype).element_size()

    def make_config(self, name: str, num_shards: int, optimizer: Mapping[str, Any]) -> TableConfig:
        """The :class:`TableConfig` of this table over ``num_shards`` ps tasks."""
        part: Partitioner = (ModPartitioner(num_shards, num_rows=self.num_rows)
                             if self.partitioner_kind == "mod"
                             else RangePartitioner(self.num_rows, num_shards))
        name = self.table_name or name
        return TableConfig(name=name, partitioner=part, dim=self.dim,
                           optimizer=self.optimizer or dict(optimizer),
                           initializer=self.initializer or seeded_initializer(name),
                           dtype=self.dtype)

    def bind(self, client: TableClient, config: TableConfig) -> None:
        """Attach to the ps tasks (the strategy's ``prepare()`` does this)."""
        self._client, self.config = client, config

    @property
    def client(self) -> TableClient | None:
        """The client of the ps tasks this table is bound to (None before ``prepare()``)."""
        return self._client

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,  # noqa: A002
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        if self._client is None or self.config is None:
            raise FailedPreconditionError(
                "ShardedEmbedding is not bound to ps tasks; train the model with the "
                "ParameterServer strategy (its prepare() binds every ShardedEmbedding)."
            )
        if input.dtype not in (torch.int64, torch.int32):
            raise InvalidArgumentError(
                f"ShardedEmbedding expects integer ids, got {input.dtype}; pass ids.long()."
            )
        if self.mode is None and (offsets is not None or per_sample_weights is not None):
            raise InvalidArgumentError(
                "offsets and per_sample_weights need a bag mode; build "
                "ShardedEmbedding(..., mode='sum'|'mean'|'max')."
            )
        recorder = recording()
        if recorder is None:
            return self._lookup(input, offsets, per_sample_weights)
        recorder.site(self, input)
        recorder.suspended += 1
        try:
            out = self._lookup(input, offsets, per_sample_weights)
        finally:
            recorder.suspended -= 1
        recorder.table_output(out)
        return out

    def _ahead(self, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:  # noqa: A002
        """The (unique, inverse, rows) pulled ahead for this lookup, when its ids are those."""
        if not self.prefetched:
            return None
        ids, unique, inverse, rows = self.prefetched.pop(0)
        if ids is input or _same_ids(ids, input):
            return unique, inverse, rows
        self.prefetched.clear()
        if self.on_miss is not None:
            self.on_miss()
        return None

    def _lookup(self, input: torch.Tensor, offsets: torch.Tensor | None,  # noqa: A002
                per_sample_weights: torch.Tensor | None) -> torch.Tensor:
        ahead = self._ahead(input)
        if ahead is None:  # the ids from the batch's host copy when there is one
            host = host_copy(input)
            ids = input if host is None else host
            unique, inverse = unique_ids(ids.reshape(-1).to("cpu", torch.int64))
            rows = self._client.pull(self.config, unique)  # type: ignore[union-attr, arg-type]
        else:
            unique, inverse, rows = ahead
        rows = rows.to(input.device)
        if torch.is_grad_enabled() and self.trainable:
            rows.requires_grad_(True)
            self._touched.append((unique, rows))
        index = inverse.to(input.device).view(input.shape)
        gather = index.numel() * self.dim <= _GATHER_LIMIT
        if self.mode is None and gather:
            return rows.index_select(0, index.reshape(-1)).view(*index.shape, self.dim)
        if self.mode is None:
            return F.embedding(index, rows)
        if gather and self.mode in ("sum", "mean") and index.dim() == 2 and offsets is None \
                and per_sample_weights is None:
            picked = rows.index_select(0, index.reshape(-1)).view(*index.shape, self.dim)
            return picked.sum(1) if self.mode == "sum" else picked.mean(1)
        return F.embedding_bag(index, rows, offsets, mode=self.mode,
                               per_sample_weights=per_sample_weights)

    def take_row_grads(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(ids, row gradients) of the lookups since the last call, on the CPU; forgets them.

        Ids repeat when several lookups touched the same row (the ps sums them).
        None when no lookup had a gradient.
        """
        touched, self._touched = self._touched, []
        parts = [(ids, rows.grad.detach().cpu()) for ids, rows in touched
                 if rows.grad is not None]
        if not parts:
            return None
        ids, grads = parts[0] if len(parts) == 1 else (torch.cat([p[0] for p in parts]),
                                                       torch.cat([p[1] for p in parts]))
        if self.padding_idx is not None:  # the padding row takes no update
            keep = ids != self.padding_idx
            ids, grads = ids[keep], grads[keep]
        return ids, grads

    def forget(self) -> None:
        """Drop the lookups not pushed yet (a step that is not pushed)."""
        self._touched = []


def _same_ids(predicted: torch.Tensor, ids: torch.Tensor) -> bool:
    """Whether the ids pulled ahead (read on the host) are the lookup's ``ids``."""
    if predicted.shape != ids.shape:
        return False
    host = host_copy(ids)
    if host is not None:
        ids = host
    if predicted.device != ids.device:
        predicted = predicted.to(ids.device, non_blocking=True)
    return torch.equal(predicted, ids.to(predicted.dtype))


def seeded_initializer(name: str) -> dict[str, Any]:
    """towerflow's row initializer for table ``name``: its seed a stable hash of the name.

    Example:
        >>> seeded_initializer("a")["seed"] != seeded_initializer("b")["seed"]
        True
    """
    digest = hashlib.blake2b(name.encode(), digest_size=8).digest()
    return {**DEFAULT_INITIALIZER, "seed": int.from_bytes(digest, "little") >> 1}


class SparseTables:
    """The strategy's side of a model's sparse tables: bind, initialise, push.

    Args:
        model: the model; its :class:`ShardedEmbedding` modules are bound.
        addresses: the ps tasks' addresses.
        optimizer: the dense ``OptimizerConfig`` (tables without an optimizer
            of their own take its counterpart, :func:`~towerflow.ps.spec.row_optimizers.sparse_optimizer_for`).
        client_options: :class:`TableClient` keyword arguments (``aggregation``:
            the job's mode; in sync and ssp every table pushes every step, an
            empty push when a step looked nothing up in it).
    """

    def __init__(self, model: nn.Module, addresses: list[str], optimizer: Any,
                 **client_options: Any) -> None:
        self.modules = [(path, m) for path, m in model.named_modules()
                        if isinstance(m, ShardedEmbedding)]
        self.client: TableClient | None = None
        self.fused: list[TableConfig] = []
        self.views: dict[str, Any] = {}
        self.prefetcher: Prefetcher | None = None
        if not self.modules:
            return
        self.client = TableClient(addresses, **client_options)
        names: dict[str, str] = {}
        #: a table's learning rate over the pushed one (its weight's parameter group's)
        self.lr_scales: dict[str, float] = {}
        factor = getattr(optimizer, "lr_factor", lambda _: 1.0)
        for path, module in self.modules:
            weight = f"{path}.weight" if path else "weight"
            config = module.make_config(path, len(addresses), module.optimizer
                                        or sparse_optimizer_for(optimizer, weight))
            if factor(weight) != 1.0:
                self.lr_scales[config.name] = factor(weight)
            if config.name in names:
                raise InvalidArgumentError(
                    f"Tables {names[config.name]!r} and {path!r} are both named {config.name!r}; "
                    "give each ShardedEmbedding its own name=."
                )
            names[config.name] = path
            module.bind(self.client, config)
            module.on_miss = self._missed
            if module.defer_push is None:  # async: with the next pull; sync / ssp: in the step
                module.defer_push = not self.client.every_shard
        configs = [m.config for _, m in self.modules]
        #: tables laid end to end on the ps (:mod:`towerflow.ps.worker.tables.fusion`)
        self.fused, self.views = fuse_tables(  # tables of one rate only
            configs, [(m.defer_push, self.lr_scales.get(c.name, 1.0))
                      for (_, m), c in zip(self.modules, configs, strict=True)])
        self.client.fuse(self.views)
        for table in self.fused:
            members = [c.name for c in configs if self.views.get(c.name, (None,))[0] is table]
            log.info("tables %s share one %d-row table %r on the ps tasks (one item per ps task "
                     "and step for all of them)", ", ".join(map(repr, members)), table.num_rows,
                     table.name)
        #: pulls every table of a forward in one request per ps task (two tables and more)
        self.prefetcher = Prefetcher(model, self._prefetch) if len(self.modules) > 1 else None
        #: a dense push-and-pull per ps task for the next prefetched pull to carry, and who
        #: takes its replies (:meth:`carry`)
        self._carried: tuple[Mapping[int, bytes], Callable[[dict[int, bytes]], None]] | None = None

    def pull_ahead_always(self, model: nn.Module) -> None:
        """Pull the tables before each forward also for a single table (so that a dense push
        can travel with the pull: :meth:`carry`)."""
        if self.prefetcher is None and self.client is not None:
            self.prefetcher = Prefetcher(model, self._prefetch, min_sites=1)

    def carry(self, requests: Mapping[int, bytes],
              answer: Callable[[dict[int, bytes]], None]) -> None:
        """Have the next forward's prefetched pull carry ``requests[task]`` (a
        ``PushPullSmall`` request) in its request to each ps task, and hand the replies by
        task to ``answer`` before the forward's code runs. A forward that does not pull
        ahead leaves them here (:meth:`take_carried`)."""
        self._carried = (requests, answer)

    def take_carried(self) -> tuple[Mapping[int, bytes], Callable[[dict[int, bytes]], None]] | None:
        """The requests :meth:`carry` left that no pull has carried yet (then forgotten)."""
        carried, self._carried = self._carried, None
        return carried

    def __bool__(self) -> bool:
        return self.client is not None

    def _missed(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.missed()

    def _prefetch(self, lookups: list[tuple[nn.Module, torch.Tensor]]) -> None:
        """Pull the rows of every lookup of a forward in one request per ps task."""
        for _, module in self.modules:
            module.prefetched.clear()
        wanted = [(module, ids) for module, ids in lookups
                  if isinstance(module, ShardedEmbedding) and isinstance(ids, torch.Tensor)
                  and ids.dtype in (torch.int64, torch.int32)]  # else the lookup refuses
        carried = self.take_carried()
        if not wanted and carried is None:
            return
        try:
            replies = pull_ahead(self.client, self.views, wanted, unique_ids,
                                 None if carried is None else carried[0])
        except BaseException:
            self._carried = carried  # left to be sent again (a push applies once)
            raise
        if carried is not None:
            carried[1](replies)

    def initialize(self, *, everywhere: bool = False) -> None:
        """Create every table on every ps task (the chief; idempotent).

        A table that starts from given rows (a module's weight) ships them to
        the shards this call created (a shard that existed keeps its rows;
        ``everywhere``: to every shard, rows given after the tables were made),
        then forgets them.
        """
        fused = {t.name: [s for s, reply in enumerate(self.client.init_table(t))  # type: ignore[union-attr]
                          if reply.created] for t in self.fused}
        for _, module in self.modules:
            view = self.views.get(module.config.name)  # type: ignore[union-attr]
            if view is None:
                replies = self.client.init_table(module.config)  # type: ignore[union-attr, arg-type]
                created = [s for s, reply in enumerate(replies) if reply.created]
            else:
                created = fused[view.table.name]
            start = module.take_start()
            if start is not None and everywhere:
                created = list(range(self.client.num_shards))  # type: ignore[union-attr]
            if start is not None and created:
                ship_rows(self.client, module.config, *start, shards=created)  # type: ignore[arg-type]

    def holds_starts(self) -> bool:
        """Whether a table still holds rows to start from (given since the tables were made)."""
        return any(module.holds_start for _, module in self.modules)

    def release(self) -> None:
        """Forget the rows the tables would start from (a worker that does not initialise)."""
        for _, module in self.modules:
            module.take_start()

    def forget(self) -> None:
        """Drop lookups not pushed (start of a step)."""
        for _, module in self.modules:
            module.forget()

    def take(self) -> list[tuple[ShardedEmbedding, torch.Tensor, torch.Tensor]]:
        """The row gradients of this step, per table (sync / ssp: every table, maybe empty)."""
        out = []
        every = self.client is not None and self.client.every_shard
        for _, module in self.modules:
            grads = module.take_row_grads()
            if grads is None and every:
                grads = (torch.empty(0, dtype=torch.int64),
                         torch.empty((0, module.dim), dtype=module.dtype))
            if grads is not None:
                out.append((module, *grads))
        return out

    @staticmethod
    def nonfinite(taken: list[tuple[ShardedEmbedding, torch.Tensor, torch.Tensor]]) -> str | None:
        """The name of a table whose row gradient holds NaN / inf, or None."""
        for module, _, grads in taken:
            # the sum is finite when every value is (one reduction, no mask); a sum that
            # overflowed is checked value by value
            if grads.numel() and not bool(torch.isfinite(grads.sum())) \
                    and not bool(torch.isfinite(grads).all()):
                return f"{module.config.name} (sparse table)"  # type: ignore[union-attr]
        return None

    def push(self, taken: list[tuple[ShardedEmbedding, torch.Tensor, torch.Tensor]], *,
             lr: float, step: int) -> None:
        """Push every table's row gradients: one request per owning ps task, in parallel.

        A table built with ``defer_push=True`` keeps them for its next pull.
        """
        self.client.push_many(  # type: ignore[union-attr]
            [(module.config, ids, grads, module.defer_push) for module, ids, grads in taken],
            lr=lr, step=step, scales=self.lr_scales)

    def flush(self) -> None:
        """Send the deferred pushes of every table (before the strategy says it is done)."""
        if self.client is not None:
            self.client.flush()

    def done(self) -> None:
        """Send the deferred pushes and tell the ps tasks this worker finished.

        Sync steps and the ssp bound stop waiting for it. A worker that stopped
        on an error does not say it (:meth:`flush` only): they go on waiting.
        """
        if self.client is not None:
            self.client.done()

    def close(self) -> None:
        """Send the deferred pushes, close the client's channels and take the prefetcher's
        hooks off the model (a model prepared again gets its own)."""
        if self.prefetcher is not None:
            self.prefetcher.remove()
        if self.client is not None:
            self.client.close()
