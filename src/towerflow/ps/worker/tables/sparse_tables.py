"""The strategy's side of a model's sparse tables: bind, fuse, pull ahead, push.

The :class:`~towerflow.ps.worker.tables.embedding.ShardedEmbedding` modules of a
model, bound to one :class:`~towerflow.ps.worker.tables.client.TableClient`; tables
the ps treats alike fused into one (:mod:`towerflow.ps.worker.tables.fusion`) and
looked up as one (:mod:`towerflow.ps.worker.tables.groups`); every lookup of a
forward pulled in one request per ps task (:mod:`towerflow.ps.worker.tables.prefetch`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from towerflow.errors import InvalidArgumentError
from towerflow.ps.spec.row_optimizers import sparse_optimizer_for
from towerflow.ps.spec.tables import TableConfig
from towerflow.ps.worker.tables.checkpoint import ship_rows
from towerflow.ps.worker.tables.client import TableClient
from towerflow.ps.worker.tables.embedding import ShardedEmbedding, unique_ids
from towerflow.ps.worker.tables.fusion import fuse_tables
from towerflow.ps.worker.tables.groups import GroupPush, host_ready, take_groups
from towerflow.ps.worker.tables.prefetch import Prefetcher, pull_ahead

__all__ = ["SparseTables"]

log = logging.getLogger("towerflow.ps")


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
        for name, view in self.views.items():  # a fused table pushes at its members' rate
            if name in self.lr_scales:
                self.lr_scales[view.table.name] = self.lr_scales[name]
        for table in self.fused:
            members = [c.name for c in configs if self.views.get(c.name, (None,))[0] is table]
            log.info("tables %s share one %d-row table %r on the ps tasks (one item per ps task "
                     "and step for all of them)", ", ".join(map(repr, members)), table.num_rows,
                     table.name)
        #: pulls every table of a forward in one request per ps task (two tables and more)
        self.prefetcher = Prefetcher(model, self._prefetch, clear=self._clear_ahead) \
            if len(self.modules) > 1 else None
        #: a dense push-and-pull per ps task for the next prefetched pull to carry, and who
        #: takes its replies (:meth:`carry`)
        self._carried: tuple[Mapping[int, bytes], Callable[[dict[int, bytes]], None]] | None = None

    def share_routes(self, routes: Sequence[Any]) -> None:
        """Route the table calls by the dense client's shard routes (``replicas=1``: one
        switch to a shard's replica serves both)."""
        if self.client is not None:
            self.client.share_routes(routes)

    def pull_ahead_always(self, model: nn.Module) -> None:
        """Pull the tables before each forward also for a single table (so that a dense push
        can travel with the pull: :meth:`carry`)."""
        if self.prefetcher is None and self.client is not None:
            self.prefetcher = Prefetcher(model, self._prefetch, min_sites=1,
                                         clear=self._clear_ahead)

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

    def _clear_ahead(self) -> None:
        for _, module in self.modules:
            module.prefetched.clear()

    def pull_later(self, lookups: list[tuple[nn.Module, torch.Tensor]],
                   submit: Callable[..., Any]) -> Any:
        """Have ``submit`` (a one-thread executor's, after the pushes it sends) pull the rows
        of a later forward's lookups: a future of ``[(module, (ids, rows))]``, which that
        forward's prefetcher leaves with the tables (:meth:`Prefetcher.feed`)."""
        wanted = [(module, ids) for module, ids in lookups
                  if isinstance(module, ShardedEmbedding) and isinstance(ids, torch.Tensor)
                  and ids.dtype in (torch.int64, torch.int32)]

        def pull() -> list[tuple[nn.Module, Any]]:
            placed: list[tuple[nn.Module, Any]] = []
            pull_ahead(self.client, self.views, wanted, unique_ids, placed=placed)
            return placed

        return submit(pull)

    def _prefetch(self, lookups: list[tuple[nn.Module, torch.Tensor]]) -> None:
        """Pull the rows of every lookup of a forward in one request per ps task."""
        self._clear_ahead()
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
        """The row gradients of this step, per table (sync / ssp: every table, maybe empty);
        a group of fused tables looked up together as one (:func:`.groups.take_groups`)."""
        out: list[tuple[Any, torch.Tensor, torch.Tensor]] = \
            take_groups([m for _, m in self.modules])  # type: ignore[assignment]
        grouped = {id(m) for push, _, _ in out for m in push.members}
        every = self.client is not None and self.client.every_shard
        for _, module in self.modules:
            if id(module) in grouped:
                continue
            grads = module.take_row_grads(wait=False)
            if grads is None and every:
                grads = (torch.empty(0, dtype=torch.int64),
                         torch.empty((0, module.dim), dtype=module.dtype))
            if grads is not None:
                out.append((module, *grads))
        host_ready()  # the gradients copied off a GPU: one wait for every table
        return out

    @staticmethod
    def nonfinite(taken: list[tuple[ShardedEmbedding, torch.Tensor, torch.Tensor]]) -> str | None:
        """The name of a table whose row gradient holds NaN / inf, or None (one sync).

        A table's sum is finite when every value is (one reduction per table, no mask);
        the tables whose sum is not (NaN, inf, or finite values that overflowed) are checked
        value by value.
        """
        sums = [grads.sum() for _, _, grads in taken if grads.numel()]
        if not sums or bool(torch.isfinite(torch.stack(sums)).all()):
            return None
        for module, _, grads in taken:
            if grads.numel() and not bool(torch.isfinite(grads).all()):
                name = module.name_of(grads) if isinstance(module, GroupPush) \
                    else module.config.name
                return f"{name} (sparse table)"
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
