"""A model's own ``nn.Embedding`` / ``nn.EmbeddingBag`` made sparse tables on the ps tasks.

Under the ``ParameterServer`` strategy a model is trained as its author wrote
it: :func:`swap_embeddings` replaces each embedding module that is declared
``sparse=True``, or whose weight has at least ``threshold_bytes``
(:data:`DEFAULT_SPARSE_THRESHOLD`, 64 MiB, unless the strategy is told
otherwise), by a :class:`~towerflow.ps.worker.tables.embedding.ShardedEmbedding`
of the same shape that starts from the module's own values:

- a module that holds a weight (``from_pretrained``, a hand-set or restored
  weight, the module's own random start) ships it to its shards once, when
  the chief creates the table; the worker then drops it;
- a module built on the ``meta`` device (no weight) starts from the module
  class's own distribution, N(0, 1), drawn per id (``NormalRows``), its
  ``padding_idx`` row zero as the module would have it; a module whose
  ``towerflow_initializer`` attribute names a row initializer (a dict such as
  ``{"kind": "uniform", "minval": -0.05, "maxval": 0.05, "seed": 0}``) starts
  from that instead;
- a frozen weight (``from_pretrained(..., freeze=True)``,
  ``requires_grad=False``) is served and never updated;
- the ``padding_idx`` row keeps its value and takes no update.

A ``sparse=True`` module whose weight is small (under
:data:`SMALL_TABLE_BYTES`, 256 KiB, or the strategy's threshold when that is
lower) is kept whole instead (:func:`keep_small_tables`): its weight travels
with the dense variables in the step's one dense push and pull, which costs
less than the rows' share of a row request (``benchmarks/sparse_default_threshold.py``:
a 64 KiB bag 1.55x and a 256 KiB one 1.72x faster whole than as rows), as
long as the optimizer updates it alike either way (sgd without momentum,
adagrad; no weight decay), and no table of its row width and optimizer is
pulled as rows anyway: there it joins that table on the ps and is looked up
with it as one (:mod:`towerflow.ps.worker.tables.groups`), cheaper than its
weight moved whole. A module that should stay dense says so with
:func:`keep_dense`; the strategy's ``sparse_threshold_bytes=None`` swaps none. ``max_norm``,
``scale_grad_by_freq`` and ``include_last_offset`` have no row-wise form and
are refused with the way out.

Each swap is announced by one warning-level line on the ``towerflow.ps``
logger (seen with Python's default logging, and by ``towerflow train``), e.g.
``'user_emb' 1,000,000 x 32 (128 MB) -> rows on 2 ps tasks, row-wise adagrad``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Hashable
from typing import Any, TypeVar

import torch
from torch import nn

from towerflow.errors import InvalidArgumentError
from towerflow.ps.spec.row_optimizers import sparse_optimizer_for, updates_untouched_rows_alike
from towerflow.ps.worker.tables.embedding import ShardedEmbedding

__all__ = ["DEFAULT_SPARSE_THRESHOLD", "DENSE_ATTRIBUTE", "INITIALIZER_ATTRIBUTE",
           "SMALL_TABLE_BYTES", "WHOLE_ATTRIBUTE", "keep_dense", "keep_small_tables", "swap_embeddings",
           "describe_swap"]

log = logging.getLogger("towerflow.ps")

#: weights of at least this many bytes become sparse tables by default. The row path wins
#: from about the bytes of the rows one batch touches (1 MiB for 8,192 ids of 128-byte rows,
#: benchmarks/sparse_default_threshold.py); this keeps a factor of 64 above that
DEFAULT_SPARSE_THRESHOLD = 64 << 20
#: a ``sparse=True`` weight below this many bytes travels whole with the dense variables:
#: below the crossover of benchmarks/sparse_default_threshold.py (about 1 MiB for a batch of
#: 8,192 ids; 0.25 MiB whole is 1.72x faster than as rows), where a table's fixed share of a
#: row request costs more than moving all its rows
SMALL_TABLE_BYTES = 256 << 10
#: the attribute :func:`keep_small_tables` sets on a module it keeps whole
WHOLE_ATTRIBUTE = "towerflow_whole"
#: the attribute :func:`keep_dense` sets on a module
DENSE_ATTRIBUTE = "towerflow_dense"
#: the attribute naming a meta-built module's row initializer
INITIALIZER_ATTRIBUTE = "towerflow_initializer"
#: ``nn.Embedding`` / ``nn.EmbeddingBag``'s own start of a weight: N(0, 1)
_MODULE_INIT = {"kind": "normal", "mean": 0.0, "std": 1.0}

M = TypeVar("M", bound=nn.Module)


def keep_dense(module: M) -> M:
    """Keep ``module`` (an embedding) a dense parameter under the ``ParameterServer``.

    Returns the module, so it can wrap its construction.

    Example:
        >>> emb = keep_dense(nn.Embedding(10, 4, sparse=True))
        >>> emb.towerflow_dense
        True
    """
    setattr(module, DENSE_ATTRIBUTE, True)
    return module


def _should_swap(module: nn.Module, threshold_bytes: int | None) -> bool:
    if threshold_bytes is None or getattr(module, DENSE_ATTRIBUTE, False):
        return False
    weight = module.weight
    return bool(module.sparse) or weight.numel() * weight.element_size() >= threshold_bytes


def _rows_kind(optimizer: Any, weight: str | None, dim: int, dtype: torch.dtype,
               own: Any = None) -> Hashable | None:
    """What a table must share with another to be looked up with it as one on the worker
    (:mod:`towerflow.ps.worker.tables.fusion`'s rule, as far as it is known before the
    tables are made); None: not known (no row-wise counterpart of the optimizer)."""
    try:
        rows = own or sparse_optimizer_for(optimizer, weight)
    except InvalidArgumentError:
        return None
    factor = getattr(optimizer, "lr_factor", lambda _: 1.0)(weight) if weight else 1.0
    return (dim, str(dtype), json.dumps(rows, sort_keys=True, default=str), factor)


def keep_small_tables(model: nn.Module, optimizer: Any, threshold_bytes: int | None,
                      whole_below: int | None = SMALL_TABLE_BYTES, mode: str = "async"
                      ) -> list[str]:
    """Keep each small ``sparse=True`` embedding whole (a dense parameter; its ``sparse``
    turned off, :data:`WHOLE_ATTRIBUTE` set) when its weight's optimizer updates it alike
    either way and no table of its kind is pulled as rows anyway; the lines that say which
    path each small table took.

    Small: under ``whole_below`` (default :data:`SMALL_TABLE_BYTES`) and under
    ``threshold_bytes``. A small table of the same row width, dtype and row optimizer as a
    table that is rows in any case (a large one, a ``ShardedEmbedding``) stays rows: it is
    fused with that table on the ps and looked up with it as one on the worker
    (:mod:`towerflow.ps.worker.tables.groups`), which costs less than its weight moved
    whole each step (``benchmarks/recsys_launch.py --workload deepfm``). Never in ``sync``
    mode: there a row is averaged over the replicas that pushed it, a dense variable over
    every replica of the step.
    """
    if threshold_bytes is None or not whole_below or mode == "sync":
        return []
    small = min(whole_below, threshold_bytes)
    names = {id(p): n for n, p in model.named_parameters()}
    candidates, rows_kinds = [], {}
    for path, module in model.named_modules():
        if isinstance(module, ShardedEmbedding):
            kind = _rows_kind(optimizer, None, module.dim, module.dtype, module.optimizer)
            rows_kinds.setdefault(kind, path)
            continue
        if not isinstance(module, nn.Embedding | nn.EmbeddingBag) \
                or getattr(module, DENSE_ATTRIBUTE, False):
            continue
        weight = module.weight
        nbytes = weight.numel() * weight.element_size()
        if not module.sparse and nbytes < threshold_bytes:
            continue  # stays a dense parameter
        name = names.get(id(weight))
        kind = _rows_kind(optimizer, name, module.embedding_dim, weight.dtype)
        if nbytes >= small or weight.is_meta or not updates_untouched_rows_alike(optimizer, name):
            rows_kinds.setdefault(kind, path)  # rows whatever its size
        else:
            candidates.append((path, module, nbytes, kind))
    lines = []
    for path, module, nbytes, kind in candidates:
        size = f"{path!r} {module.num_embeddings:,} x {module.embedding_dim} ({_size(nbytes)})"
        if kind is not None and kind in rows_kinds:
            lines.append(f"{size} -> rows: under {small / 1024:g} KiB, but looked up with "
                         f"{rows_kinds[kind]!r}, whose rows are pulled each step anyway (one "
                         "table on the ps, one lookup on the worker)")
            continue
        module.sparse = False  # its gradient a dense one, as the flat gradient buffer holds
        setattr(module, WHOLE_ATTRIBUTE, True)
        lines.append(f"{size} -> whole with the dense variables: sparse=True, but under "
                     f"{small / 1024:g} KiB its rows cost less moved whole than as a row "
                     "request (towerflow.ps.ShardedEmbedding keeps it rows)")
    return lines


def _refuse_options(path: str, module: nn.Module) -> None:
    used = [f"max_norm={module.max_norm}"] if module.max_norm is not None else []
    used += [f"{k}=True" for k in ("scale_grad_by_freq", "include_last_offset")
             if getattr(module, k, False)]
    if used:
        raise InvalidArgumentError(
            f"{path!r} ({module}) uses {', '.join(used)}, which a table sharded on the ps tasks "
            "does not have; drop the option (or use towerflow.ps.ShardedEmbedding without it), "
            "or keep the module dense with towerflow.ps.keep_dense(module)."
        )


def _table_of(path: str, module: nn.Embedding | nn.EmbeddingBag) -> ShardedEmbedding:
    """The :class:`ShardedEmbedding` that replaces ``module``, holding its weight to ship."""
    weight = module.weight
    mode = module.mode if isinstance(module, nn.EmbeddingBag) else None
    dtype = weight.dtype if weight.dtype in (torch.float32, torch.float64) else torch.float32
    meta = weight.device.type == "meta"
    table = ShardedEmbedding(module.num_embeddings, module.embedding_dim, mode=mode, name=path,
                             dtype=dtype,
                             initializer=getattr(module, INITIALIZER_ATTRIBUTE, None)
                             or (_MODULE_INIT if meta else None),
                             padding_idx=module.padding_idx,
                             trainable=weight.requires_grad)
    if meta:
        if module.padding_idx is not None:  # as nn.Embedding.reset_parameters has it
            table.start_from(torch.zeros((1, module.embedding_dim), dtype=dtype),
                             ids=torch.tensor([module.padding_idx]))
    else:
        table.start_from(weight.detach())
    return table


def swap_embeddings(model: nn.Module, threshold_bytes: int | None) -> list[str]:
    """Replace each ``nn.Embedding`` / ``nn.EmbeddingBag`` that is ``sparse=True`` or large.

    Large: a weight of ``threshold_bytes`` or more. ``threshold_bytes=None``
    replaces none; a module marked by :func:`keep_dense` is never replaced.
    The replacement is a :class:`ShardedEmbedding` of the same shape, bag
    mode, ``padding_idx`` and trainability, holding the module's weight until
    it is shipped (see the module docstring); the module is dropped.

    Returns:
        The replaced modules' paths.

    Raises:
        InvalidArgumentError: such a module uses ``max_norm``,
            ``scale_grad_by_freq`` or ``include_last_offset``.
    """
    swapped, left = [], []
    for path, module in list(model.named_modules()):
        if not isinstance(module, nn.Embedding | nn.EmbeddingBag):
            continue
        if not _should_swap(module, threshold_bytes):
            if threshold_bytes is not None and not getattr(module, DENSE_ATTRIBUTE, False):
                left.append((path, module.weight.numel() * module.weight.element_size()))
            continue
        _refuse_options(path, module)
        table = _table_of(path, module)
        parent_path, _, attr = path.rpartition(".")
        setattr(model.get_submodule(parent_path) if parent_path else model, attr, table)
        swapped.append(path)
    _say_left_dense(left, threshold_bytes)
    return swapped


def _say_left_dense(left: list[tuple[str, int]], threshold_bytes: int | None) -> None:
    """One line when the embeddings left dense, each under ``threshold_bytes``, pass it
    together: every step moves their weights whole (never silently slow)."""
    total = sum(nbytes for _, nbytes in left)
    if threshold_bytes is None or len(left) < 2 or total < threshold_bytes:
        return
    names = ", ".join(repr(path) for path, _ in left[:6]) + (", ..." if len(left) > 6 else "")
    log.warning("%d embeddings (%s) stay dense, each under the sparse threshold (%s) but %s "
                "together: every step moves them whole with the dense variables. Declare them "
                "sparse=True (or lower sparse_threshold_bytes, --sparse-threshold) to move only "
                "a batch's rows; towerflow.ps.keep_dense(module) keeps one dense without this "
                "line.", len(left), names, _size(threshold_bytes), _size(total))


def describe_swap(table: ShardedEmbedding, num_ps: int) -> str:
    """The line that announces a swapped table (after it is bound).

    Example:
        >>> t = ShardedEmbedding(1_000_000, 32, name="user_emb")
        >>> t.optimizer = {"name": "adagrad", "hyper": {}}
        >>> describe_swap(t, 2)
        "'user_emb' 1,000,000 x 32 (128 MB) -> rows on 2 ps tasks, row-wise adagrad"
    """
    config = table.config
    name = config.name if config is not None else table.table_name
    optimizer = (config.optimizer if config is not None else table.optimizer) or {}
    notes = [] if table.trainable else ["frozen"]
    notes += [] if table.padding_idx is None else [f"padding_idx {table.padding_idx} kept"]
    extra = "".join(f", {n}" for n in notes)
    return (f"{name!r} {table.num_rows:,} x {table.dim} ({_size(table.nbytes)}) -> rows on "
            f"{num_ps} ps task{'s' if num_ps != 1 else ''}, row-wise "
            f"{optimizer.get('name', '?')}{extra}")


def _size(nbytes: int) -> str:
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes} bytes"
