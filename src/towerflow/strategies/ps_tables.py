"""The sparse tables' part of :class:`~towerflow.strategies.parameter_server.ParameterServer`.

A model's :class:`~towerflow.ps.worker.tables.embedding.ShardedEmbedding`
modules (and its ``nn.Embedding`` / ``nn.EmbeddingBag`` modules declared
``sparse=True`` or of ``sparse_threshold_bytes`` and more, swapped for them by
:func:`~towerflow.ps.worker.tables.swap.swap_embeddings`) live on the ps tasks
as row-sharded tables. Here the strategy binds
them (:func:`attach_tables`), creates or restores them on the ps tasks before
the dense ``Init`` (:func:`start_tables`), and puts them into a checkpoint and
takes them back out (:func:`table_groups`, :func:`tables_to_restore`): the
``ps_tables`` chunked group, streamed part by part, never gathered.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from towerflow.errors import CheckpointError, InvalidArgumentError
from towerflow.ps.worker.tables.checkpoint import (
    FUSED_KEY,
    PART_BYTES,
    TABLES_GROUP,
    TABLES_KEY,
    checked_parts,
    describe_fused,
    describe_tables,
    export_tables,
    import_tables,
)
from towerflow.ps.worker.tables.sparse_tables import SparseTables
from towerflow.ps.worker.tables.swap import (
    SMALL_TABLE_BYTES,
    WHOLE_ATTRIBUTE,
    describe_swap,
    keep_small_tables,
    swap_embeddings,
)

__all__ = ["attach_tables", "start_tables", "table_groups", "table_weights", "tables_from_weights",
           "tables_to_restore"]

log = logging.getLogger("towerflow.ps")


def attach_tables(model: nn.Module, optimizer: Any, *, cluster: Any,
                  sparse_threshold: int | None, chief: bool,
                  whole_below: int | None = SMALL_TABLE_BYTES,
                  **client_options: Any) -> SparseTables:
    """Swap ``sparse=True`` and large embeddings and bind the model's tables.

    Each swapped table is announced with one warning-level line (seen with
    Python's default logging). A worker that is not the chief forgets the
    swapped modules' weights at once: only the chief ships them.

    Args:
        model: the model being prepared.
        optimizer: the dense ``OptimizerConfig`` (a table without an optimizer
            of its own takes its counterpart).
        cluster: the ``ClusterSpec``; the tables are sharded over its ps tasks.
        sparse_threshold: see ``ParameterServer(sparse_threshold_bytes=)``; None:
            only explicit ``ShardedEmbedding`` modules.
        whole_below: see ``ParameterServer(whole_table_bytes=)``; None: no
            ``sparse=True`` module travels whole.
        chief: this worker initialises the tables.
        **client_options: the :class:`~towerflow.ps.worker.tables.client.TableClient`'s.

    Returns:
        The model's tables (false when it has none).

    Raises:
        InvalidArgumentError: a parameter built on the meta device (no values)
            stays dense: only a table on the ps may start without values.
    """
    aggregation = client_options.get("aggregation")
    for line in keep_small_tables(model, optimizer, sparse_threshold, whole_below,
                                  mode=getattr(aggregation, "mode", "async")):
        log.warning("%s", line)
    swapped = swap_embeddings(model, sparse_threshold)
    _check_no_meta(model, sparse_threshold)
    addresses = [cluster.task_address("ps", i) for i in range(cluster.num_tasks("ps"))]
    tables = SparseTables(model, addresses, optimizer, **client_options)
    for path in swapped:
        log.warning("%s", describe_swap(model.get_submodule(path), len(addresses)))
    if not chief:
        tables.release()
    return tables


def _check_no_meta(model: nn.Module, sparse_threshold: int | None) -> None:
    """Refuse a parameter left on the meta device once the tables are swapped."""
    meta = [(name, p.numel() * p.element_size()) for name, p in model.named_parameters()
            if p.is_meta]
    if not meta:
        return
    listing = ", ".join(f"{name} ({size:,} bytes)" for name, size in meta[:4])
    if sparse_threshold is None:
        threshold = "sparse_threshold_bytes=None: no table is swapped"
        way_out = "Give the strategy a sparse_threshold_bytes (the default swaps sparse=True ones)"
    else:
        threshold = f"sparse_threshold_bytes is {sparse_threshold:,}"
        way_out = ("Declare it nn.Embedding(..., sparse=True), lower sparse_threshold_bytes "
                   "below its size")
    raise InvalidArgumentError(
        f"{listing} {'is' if len(meta) == 1 else 'are'} on the meta device (no values) but "
        f"stay{'s' if len(meta) == 1 else ''} on the worker as dense parameters ({threshold}): "
        "only an embedding that becomes a sparse table on the ps tasks may be built on meta. "
        f"{way_out}, or build it with values.")


def check_whole_tables(model: nn.Module, metadata: Mapping[str, Any] | None) -> None:
    """Refuse a checkpoint that holds as rows a table this run keeps whole.

    Raises:
        InvalidArgumentError: such a table, named with the way to resume it.
    """
    saved = (metadata or {}).get(TABLES_KEY) or {}
    whole = [path for path, module in model.named_modules()
             if getattr(module, WHOLE_ATTRIBUTE, False) and path in saved]
    if whole:
        raise InvalidArgumentError(
            f"The checkpoint holds {', '.join(map(repr, whole))} as rows on the ps tasks, and "
            "this run keeps them whole with the dense variables (small sparse=True tables); "
            "resume it with whole_table_bytes=None (--whole-tables off) to keep them rows.")


def start_tables(tables: SparseTables, restore: tuple[Any, Any] | None, *,
                 again: bool = False) -> None:
    """(The chief) create the tables on the ps tasks, before the dense ``Init``.

    Args:
        tables: the model's tables.
        restore: what :func:`tables_to_restore` took from a checkpoint; None:
            the tables start from their initializers (or a module's own rows).
        again: the tables were created already (when ``prepare`` returned): a
            checkpoint's rows are imported over them, and rows a module was given
            since (a checkpoint's weights) are shipped to every shard.
    """
    if restore:
        tables.release()  # the checkpoint's rows win over the modules' weights
        configs = [module.config for _, module in tables.modules]
        import_tables(tables.client, configs, *restore)
    else:
        tables.initialize(everywhere=again)


def table_groups(tables: SparseTables, part_bytes: int | None
                 ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The tables' checkpoint group and metadata: ``({"ps_tables": group}, {"tables": ...})``.

    The group is a chunked group of parts of ``part_bytes`` (default 64 MiB),
    streamed from the ps shards while the checkpoint is written.
    """
    configs = [module.config for _, module in tables.modules]
    group = export_tables(tables.client, configs, part_bytes=part_bytes or PART_BYTES)
    described: dict[str, Any] = {TABLES_KEY: describe_tables(configs)}
    if tables.fused:  # where they live on the ps, for a live export (towerflow export --cluster)
        described[FUSED_KEY] = describe_fused(tables.fused, tables.views)
    return {TABLES_GROUP: group}, described


def tables_to_restore(groups: Mapping[str, Any], metadata: Mapping[str, Any]
                      ) -> tuple[Any, Any]:
    """What :func:`start_tables` restores: the checkpoint's ``ps_tables`` group (a
    :class:`~towerflow.checkpoint.ChunkedReader`, or None) and the tables' descriptions."""
    return groups.get(TABLES_GROUP), metadata.get(TABLES_KEY)


#: a row-wise optimizer's slot and the torch.optim state it continues as
TORCH_SLOTS = {"accumulator": "sum", "m": "exp_avg", "v": "exp_avg_sq"}


def _load_dynamic(model: nn.Module, table: str, tensors: Mapping[str, torch.Tensor],
                  where: Any) -> None:
    """A dynamic table's saved rows into the model's ``towerflow.DynamicEmbedding`` (its
    one-process table; the module's path is the table's name)."""
    try:
        module = model.get_submodule(table)
    except AttributeError:
        module = None
    load = getattr(module, "load_rows", None)
    if not callable(load):
        raise CheckpointError(
            f"{where} holds dynamic table {table!r}, which is no towerflow.DynamicEmbedding of "
            f"{type(model).__name__}; load it into the model that trained it.")
    load(tensors["ids"], tensors["rows"], tensors.get("versions"))


def table_weights(groups: Mapping[str, Any], strategy_metadata: Any, model: nn.Module,
                  where: Any, slots: dict[str, torch.Tensor] | None = None
                  ) -> dict[str, torch.Tensor]:
    """The weights of the model's tables that a ps run saved sharded (``<table>.weight``).

    A table trained on the ps tasks (named by its module's path) is saved as
    parts of rows by id (``groups``' chunked ``ps_tables`` group); they are
    written into a weight of the module's shape, so that one process (``towerflow
    eval``, or a run resumed without a ps) holds the table as a plain weight.
    Empty when the checkpoint holds no such table. The weights are on the device
    the checkpoint was read onto (``towerflow eval``: the model's), whatever
    device the model's own table is on. With ``slots``, the rows'
    optimizer slots go there too, as ``<table>.weight/<torch.optim state>``
    (:data:`TORCH_SLOTS`: Adagrad's accumulator is ``sum``, lazy Adam's ``m`` and
    ``v`` are ``exp_avg`` and ``exp_avg_sq``).

    Raises:
        CheckpointError: a saved table is not a module of ``model``'s, or its
            parts do not cover its rows (``where``: the checkpoint, for messages).
    """
    reader = groups.get(TABLES_GROUP)
    if reader is None:
        return {}
    saved = strategy_metadata.get(TABLES_KEY) if isinstance(strategy_metadata, dict) else None
    if saved is None:
        raise CheckpointError(f"{where} holds sparse table parts but its metadata has no "
                              f"{TABLES_KEY!r} describing them; restore an earlier checkpoint.")
    params = dict(model.named_parameters())
    weights: dict[str, torch.Tensor] = {}
    filled: dict[str, int] = {}
    for info, tensors in checked_parts(reader, saved):
        if saved[info["table"]].get("kind") == "dynamic":
            _load_dynamic(model, info["table"], tensors, where)
            continue
        key = f"{info['table']}.weight"
        if key not in params:
            raise CheckpointError(
                f"{where} holds table {info['table']!r}, which is no table of "
                f"{type(model).__name__}; load it into the model that trained it.")
        shape = [saved[info["table"]]["num_rows"], saved[info["table"]]["dim"]]
        if list(params[key].shape) != shape:
            raise CheckpointError(
                f"{where} holds table {info['table']!r} of {shape[0]} x {shape[1]} rows, "
                f"but {type(model).__name__}'s is {list(params[key].shape)}; load it into "
                "the model that trained it.")
        if key not in weights:  # where the reader put the rows (the model's device at eval)
            weights[key] = torch.empty_like(params[key], device=tensors["rows"].device)
        weight = weights[key]
        ids = tensors["ids"].to(weight.device)
        weight.index_copy_(0, ids, tensors["rows"].to(weight.device, weight.dtype))
        for name, values in tensors.items():
            kind = TORCH_SLOTS.get(name.removeprefix("slot."))
            if slots is not None and name.startswith("slot.") and kind is not None:
                slot = slots.setdefault(f"{key}/{kind}", torch.zeros_like(weight))
                slot.index_copy_(0, ids.to(slot.device), values.to(slot.device, slot.dtype))
        filled[key] = filled.get(key, 0) + len(tensors["ids"])
    short = [f"{k} ({n} of {len(weights[k])} rows)" for k, n in filled.items()
             if n != len(weights[k])]
    if short:
        raise CheckpointError(f"{where}: the saved rows do not cover {', '.join(short)}; "
                              "restore an earlier checkpoint.")
    return weights


def tables_from_weights(tables: SparseTables, groups: Mapping[str, Any],
                        model_group: Mapping[str, Any], *, chief: bool) -> Mapping[str, Any]:
    """A checkpoint written without a ps holds the model's tables as weights: the chief's
    tables start from them (shipped to their shards when it creates them); the rest of
    ``model_group`` is returned (all of it for a checkpoint whose tables are parts)."""
    if not tables or TABLES_GROUP in groups:
        return model_group
    rest, moved = dict(model_group), []
    for path, module in tables.modules:
        weight = rest.pop(f"{path}.weight", None)
        if weight is not None:
            moved.append(path)
            if chief:
                module.start_from(weight)
    if moved and chief:
        log.warning("table(s) %s start from the checkpoint's weights on the ps tasks; their "
                    "optimizer slots start afresh (a checkpoint written without a ps keeps no "
                    "row-wise slots)", ", ".join(map(repr, moved)))
    return rest
