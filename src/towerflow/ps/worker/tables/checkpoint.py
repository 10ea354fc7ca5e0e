"""Sparse tables in checkpoints: streamed out of the ps shards, re-sharded on the way back in.

A table is saved sharded, never gathered: :func:`export_tables` is a
:class:`~towerflow.checkpoint.ChunkedGroup` whose parts the checkpoint
writer asks for one at a time. Each part holds up to ``part_bytes`` of one
old shard's export (``ExportRows``, streamed in chunks: rows and slots of
one moment under the shard's lock), as the tensors

- ``ids``: int64 ``(n,)`` global ids,
- ``rows``: ``(n, dim)`` rows in the table's dtype,
- ``slot.<name>``: ``(n, dim)`` per optimizer slot,
- a dynamic table's ``versions``: int64 ``(n,)``, each row's last update step, and, in a
  shard's first part, ``counter.ids`` / ``counter.counts`` (int64 ``(m,)``): the admission
  counters of its ids not admitted yet (re-hashed to their new owners at a restore),

and an ``info`` object ``{"table", "shard", "part", "rows"}``; the first part
of a shard also carries ``shard_rows`` (the rows of the whole export) and
``pushes`` (the shard's push table: ``[worker, incarnation, seq, status]``
rows), so exactly-once survives a restart. The checkpoint's metadata
describes every table (:func:`describe_tables`: ``num_rows``, ``dim``,
``dtype``, partitioner, optimizer, initializer).

:func:`import_tables` restores them to the same or another number of ps
tasks: the tables are created (``InitTable``), then each part in turn is
split by the new partitioner and sent to its new owners (``ImportRows``), so
the chief holds one part at a time. Push tables go to the shard of the same
index when the number of shards is unchanged; otherwise every new shard takes
in every old shard's records (a retried push of the old layout is answered,
never applied twice; a worker of the old layout restarts anyway, its
partitioner no longer matching the cluster). A table's slots are restored
when its optimizer is the one that wrote them, and reset otherwise.

What a checkpoint says is checked before it is used, at restore and at
``towerflow eval`` alike (:func:`checked_parts`; each part's bytes already
passed their SHA-256): the descriptions (objects of their fields, 1 ..
:data:`MAX_SHARDS` shards), each part's ``info`` (counts, push records of
ids, incarnations and sequence numbers in range), its tensors (``ids`` int64
``(n,)``, rows and slots ``(n, dim)`` of the table's dtype, finite), and its
ids: in range, owned by the shard the part names, and rising strictly across
the shard's parts, whose rows add up to the shard's. Anything else is one
``CheckpointError`` naming the table, the part and what is wrong.

This module speaks to the ps through :class:`~towerflow.ps.worker.tables.client.TableClient`
only; it imports no server module.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from towerflow.checkpoint import ChunkedGroup, ChunkedReader
from towerflow.errors import CheckpointError, DataLossError, InvalidArgumentError
from towerflow.ps.memory import release_free_memory
from towerflow.ps.partition import Partitioner, partitioner_from_dict
from towerflow.ps.spec.tables import TableConfig
from towerflow.ps.wire.calls import FINAL, REFUSED
from towerflow.ps.wire.messages import push_rows
from towerflow.ps.wire.tensors import decode as _decode
from towerflow.ps.worker.tables.client import TableClient

__all__ = ["TABLES_GROUP", "TABLES_KEY", "FUSED_KEY", "PART_BYTES", "MAX_SHARDS",
           "describe_tables", "describe_fused",
           "export_tables", "import_tables", "ship_rows", "checked_descriptions", "checked_parts"]

log = logging.getLogger("towerflow.ps")

#: the checkpoint's chunked group of the sparse tables
TABLES_GROUP = "ps_tables"
#: the key of the tables' descriptions in the strategy's checkpoint metadata
TABLES_KEY = "tables"
#: the key of the tables that share one table on the ps (the description of each such
#: table, with its ``members``: the tables in it and their first rows)
FUSED_KEY = "fused_tables"
#: bytes of rows and slots per part file (the most a save or restore holds of a table)
PART_BYTES = 64 << 20
#: bytes of rows per ExportRows message (slots add as much again each)
_EXPORT_CHUNK_BYTES = 512 << 10
_SLOT = "slot."
_VERSIONS = "versions"
_COUNTER_IDS, _COUNTER_COUNTS = "counter.ids", "counter.counts"
_COUNTERS = (_COUNTER_IDS, _COUNTER_COUNTS)
_RESTORE = "restore an earlier checkpoint"
#: most ps shards a saved table may name
MAX_SHARDS = 1 << 16
_DTYPES = {"float32": torch.float32, "float64": torch.float64}
_DESCRIPTION_KEYS = {"num_rows", "dim", "dtype", "partitioner", "optimizer", "initializer"}
_STATUSES = (*FINAL, REFUSED)
#: what a dynamic table's description adds (:func:`_dynamic`)
_DYNAMIC_KEYS = {"kind", "store", "default"}


def describe_tables(configs: Sequence[TableConfig]) -> dict[str, dict[str, Any]]:
    """What each table is, by name, for the checkpoint's metadata.

    Example:
        >>> from towerflow.ps.partition import ModPartitioner
        >>> cfg = TableConfig("emb", ModPartitioner(2, num_rows=10), 4,
        ...                   {"name": "sgd", "hyper": {}}, {"kind": "constant", "value": 0.0})
        >>> describe_tables([cfg])["emb"]["partitioner"]
        {'kind': 'mod', 'num_shards': 2, 'num_rows': 10}
    """
    return {c.name: {"num_rows": c.num_rows, "dim": c.dim,
                     "dtype": str(c.dtype).removeprefix("torch."),
                     "partitioner": c.partitioner.to_dict(), "optimizer": dict(c.optimizer),
                     "initializer": dict(c.initializer), **_dynamic(c)} for c in configs}


def config_from_description(name: str, description: Mapping[str, Any],
                            partitioner: Partitioner) -> TableConfig:
    """The :class:`TableConfig` a checked description (:func:`checked_descriptions`) names:
    the inverse of :func:`describe_tables` for one table."""
    store = description.get("store")  # a dynamic table's
    return TableConfig(name, partitioner, int(description["dim"]),
                       dict(description["optimizer"]), dict(description["initializer"]),
                       _DTYPES[description["dtype"]], None if store is None else dict(store))


def _dynamic(config: TableConfig) -> dict[str, Any]:
    """A dynamic table's extra description: its kind, store and serving default row.

    The default (an id the table does not hold) is the initializer's value where
    that is one row for every id (a constant); None otherwise (serving answers zeros).
    """
    if config.store is None:
        return {}
    init = dict(config.initializer)
    default = [float(init.get("value", 0.0))] * config.dim if init.get("kind") == "constant" \
        else None
    return {"kind": "dynamic", "store": dict(config.store), "default": default}


def describe_fused(fused: Sequence[TableConfig], views: Mapping[str, Any]
                   ) -> dict[str, dict[str, Any]]:
    """The tables laid end to end on the ps (:mod:`~towerflow.ps.worker.tables.fusion`):
    each one's description and ``members`` (table name -> its first row there).

    Example:
        >>> from towerflow.ps.partition import ModPartitioner
        >>> from towerflow.ps.worker.tables.fusion import fuse_tables
        >>> def table(name, rows):
        ...     return TableConfig(name, ModPartitioner(2, num_rows=rows), 4,
        ...                        {"name": "sgd", "hyper": {}}, {"kind": "constant", "value": 0.0})
        >>> describe_fused(*fuse_tables([table("a", 5), table("b", 3)]))["a+1"]["members"]
        {'a': 0, 'b': 6}
    """
    out = describe_tables(fused)
    for name, (table, offset) in views.items():
        out[table.name].setdefault("members", {})[name] = int(offset)
    return out


# ----------------------------------------------------------------------------- save
def export_tables(client: TableClient, configs: Sequence[TableConfig], *,
                  part_bytes: int = PART_BYTES) -> ChunkedGroup:
    """The tables as a chunked checkpoint group, streamed from the ps shards when written.

    Args:
        client: a client of every ps task.
        configs: the tables.
        part_bytes: rows and slots per part (a part may exceed it by one
            export chunk).
    """
    if isinstance(part_bytes, bool) or not isinstance(part_bytes, int) or part_bytes < 1:
        raise InvalidArgumentError(f"part_bytes must be a positive integer, got {part_bytes!r}.")

    def parts() -> Iterator[tuple[dict[str, Any], dict[str, torch.Tensor]]]:
        for config in configs:
            for shard in range(client.num_shards):
                yield from _shard_parts(client, config, shard, part_bytes)

    return ChunkedGroup(parts())


def _chunk_tensors(config: TableConfig, chunk: Any) -> dict[str, torch.Tensor]:
    n, shape = chunk.num_ids, (chunk.num_ids, config.dim)
    tensors = {"ids": _decode(chunk.ids, torch.int64, (n,)),
               "rows": _decode(chunk.rows, config.dtype, shape)}
    for name, data in zip(chunk.slot_names, chunk.slots, strict=True):
        tensors[_SLOT + name] = _decode(data, config.dtype, shape)
    if chunk.versions:  # a dynamic table's rows: each one's last update step
        tensors[_VERSIONS] = _decode(chunk.versions, torch.int64, (n,))
    if chunk.num_counters:  # its admission counters (a shard's first chunk)
        m = chunk.num_counters
        tensors[_COUNTER_IDS] = _decode(chunk.counter_ids, torch.int64, (m,))
        tensors[_COUNTER_COUNTS] = _decode(chunk.counter_counts, torch.int64, (m,))
    return tensors


def _shard_parts(client: TableClient, config: TableConfig, shard: int, part_bytes: int
                 ) -> Iterator[tuple[dict[str, Any], dict[str, torch.Tensor]]]:
    """One old shard's parts, each of about ``part_bytes``, built from its export stream."""
    # small messages: the stream's buffered messages, not the parts, bound a save's memory
    chunk_rows = max(1, min(_EXPORT_CHUNK_BYTES, part_bytes) // config.row_bytes)
    pending: list[dict[str, torch.Tensor]] = []
    size, index, received, total = 0, 0, 0, None
    head: dict[str, Any] = {}
    for chunk in client.export_shard(config, shard, chunk_rows=chunk_rows):
        if total is None:
            total = int(chunk.total)
            head = {"shard_rows": total, "pushes": [list(r) for r in push_rows(chunk.pushes)]}
        tensors = _chunk_tensors(config, chunk)
        received += chunk.num_ids
        pending.append(tensors)
        size += sum(t.numel() * t.element_size() for t in tensors.values())
        if size >= part_bytes:
            yield _part(config, shard, index, pending, head)
            pending, size, index, head = [], 0, index + 1, {}
            release_free_memory()  # the part is written: hand its blocks back (every arena)
    if total != received:
        raise DataLossError(
            f"The export of table {config.name!r} from ps task {shard} ended after {received} of "
            f"{'?' if total is None else total} rows; no checkpoint was written. Save again."
        )
    if pending or index == 0:
        yield _part(config, shard, index, pending, head)


def _part(config: TableConfig, shard: int, index: int, pending: list[dict[str, torch.Tensor]],
          head: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    if len(pending) == 1:
        tensors = pending[0]
    elif pending:  # the counters are in a shard's first chunk only
        keys = [k for k in pending[0] if k not in _COUNTERS]
        tensors = {k: torch.cat([p[k] for p in pending]) for k in keys}
        tensors.update({k: v for k, v in pending[0].items() if k in _COUNTERS})
    else:
        tensors = {"ids": torch.empty(0, dtype=torch.int64),
                   "rows": torch.empty((0, config.dim), dtype=config.dtype)}
    pending.clear()
    info = {"table": config.name, "shard": shard, "part": index,
            "rows": int(tensors["ids"].numel())}
    info.update(head)
    return info, tensors


# ----------------------------------------------------------------------------- checks
def _count(value: Any, below: int = 1 << 63) -> bool:
    return type(value) is int and 0 <= value < below


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def checked_descriptions(saved: Any) -> dict[str, tuple[dict[str, Any], Partitioner]]:
    """The checkpoint's table descriptions, each checked, with its partitioner.

    Raises:
        CheckpointError: not an object by table name, or a description that is
            not one of a table (see the module docstring).
    """
    if not isinstance(saved, Mapping):
        raise CheckpointError(f"The checkpoint's table descriptions ({TABLES_KEY!r} of its "
                              f"metadata) are {_short(saved)}, not an object by table name; "
                              f"{_RESTORE}.")
    out = {}
    for name, d in saved.items():
        ok = (isinstance(d, Mapping) and set(d) - _DYNAMIC_KEYS == _DESCRIPTION_KEYS
              and isinstance(d.get("store", {}), Mapping) and _count(d["num_rows"])
              and _count(d["dim"], 1 << 20) and d["dim"] > 0 and d["dtype"] in _DTYPES
              and all(isinstance(d[k], Mapping) for k in ("partitioner", "optimizer",
                                                          "initializer")))
        shards = d["partitioner"].get("num_shards") if ok else None
        if not ok or not (_count(shards, MAX_SHARDS + 1) and shards > 0):
            raise CheckpointError(
                f"The checkpoint's description of table {_short(name)} is {_short(d)}, not an "
                f"object of {', '.join(sorted(_DESCRIPTION_KEYS))} with 1 .. {MAX_SHARDS} "
                f"shards; {_RESTORE}.")
        try:
            partitioner = partitioner_from_dict(d["partitioner"])
        except InvalidArgumentError as exc:
            raise CheckpointError(f"The checkpoint's table {name!r} has a partitioner that "
                                  f"cannot be: {exc} {_RESTORE}.") from None
        if (partitioner.num_rows or 0) != d["num_rows"] or (
                (partitioner.num_rows is None) != ("store" in d)):
            raise CheckpointError(f"The checkpoint's table {name!r} says {d['num_rows']} rows "
                                  f"but its partitioner {partitioner.num_rows}; {_RESTORE}.")
        out[name] = (dict(d), partitioner)
    return out


def _checked_info(info: Any, tables: Mapping[str, Any]) -> tuple[str, int, int, int]:
    """``(table, shard, part, rows)`` of a part's info, each checked."""
    table = info.get("table") if isinstance(info, Mapping) else None
    if table not in tables:
        raise CheckpointError(f"A part of the checkpoint's tables names table {_short(table)}, "
                              f"which its metadata does not describe; {_RESTORE}.")
    shards = tables[table][0]["partitioner"]["num_shards"]
    for key, below in (("shard", shards), ("part", 1 << 40), ("rows", 1 << 62)):
        if not _count(info.get(key), below):
            raise CheckpointError(
                f"The checkpoint's table {table!r} has a part whose {key} is "
                f"{_short(info.get(key))}, not an integer in 0 .. {below - 1}; {_RESTORE}.")
    if "shard_rows" in info or "pushes" in info:
        records = info.get("pushes")
        if not _count(info.get("shard_rows")) or not isinstance(records, list) or not all(
                isinstance(r, list) and len(r) == 4 and _count(r[0], 1 << 31)
                and _count(r[1], 1 << 64) and _count(r[2], 1 << 64) and r[3] in _STATUSES
                for r in records):
            raise CheckpointError(
                f"The checkpoint's table {table!r} shard {info['shard']}: its row count "
                f"{_short(info.get('shard_rows'))} or push records {_short(records)} are not "
                "a count and [worker id, incarnation, seq, status] rows; " + _RESTORE + ".")
    return table, info["shard"], info["part"], info["rows"]


def _check_tensors(table: str, shard: int, part: int, n: int, tensors: Mapping[str, Any],
                   description: Mapping[str, Any], partitioner: Partitioner,
                   after: int) -> int:
    """Check one part's tensors (see the module docstring); its last id (``after`` if none)."""
    where = f"The checkpoint's table {table!r} shard {shard} part {part}"
    dtype, dim = _DTYPES[description["dtype"]], description["dim"]
    names = set(tensors)
    if "ids" not in names or "rows" not in names or any(
            k not in ("ids", "rows", _VERSIONS, *_COUNTERS) and not k.startswith(_SLOT)
            for k in names):
        raise CheckpointError(f"{where} holds tensors {sorted(names)[:8]}, not ids, rows and "
                              f"slots; {_RESTORE}.")
    for key in ("ids", _VERSIONS):
        value = tensors.get(key, tensors["ids"])
        if value.dtype != torch.int64 or tuple(value.shape) != (n,):
            raise CheckpointError(f"{where}: its {key} are {value.dtype} {list(value.shape)}, "
                                  f"not int64 [{n}]; {_RESTORE}.")
    _check_counters(where, tensors, partitioner, shard)
    ids = tensors["ids"]
    for key in sorted(names - {"ids", _VERSIONS, *_COUNTERS}):
        value = tensors[key]
        if value.dtype != dtype or tuple(value.shape) != (n, dim):
            raise CheckpointError(f"{where}: {key} is {value.dtype} {list(value.shape)}, not "
                                  f"{description['dtype']} [{n}, {dim}]; {_RESTORE}.")
        if n and not bool(torch.isfinite(value).all()):
            raise CheckpointError(f"{where}: {key} holds NaN or infinity; {_RESTORE}.")
    if not n:
        return after
    if int(ids[0]) <= after or (n > 1 and not bool((ids[1:] > ids[:-1]).all())):
        raise CheckpointError(f"{where}: its ids do not rise strictly from the shard's earlier "
                              f"parts (an id is repeated or out of order); {_RESTORE}.")
    _check_owned(where, ids, partitioner, shard)
    return int(ids[-1])


def _check_owned(where: str, ids: torch.Tensor, partitioner: Partitioner, shard: int) -> None:
    """Every id of a part belongs to its shard (else the checkpoint is damaged)."""
    try:
        partitioner.local_index(ids, shard)
    except InvalidArgumentError as exc:
        raise CheckpointError(f"{where}: {exc} {_RESTORE}.") from None


def _check_counters(where: str, tensors: Mapping[str, Any], partitioner: Partitioner,
                    shard: int) -> None:
    """A part's admission counters, if any: int64 ids of the shard and counts >= 0, as many."""
    if _COUNTER_IDS not in tensors and _COUNTER_COUNTS not in tensors:
        return
    ids, counts = tensors.get(_COUNTER_IDS), tensors.get(_COUNTER_COUNTS)
    if ids is None or counts is None or ids.dtype != torch.int64 or \
            counts.dtype != torch.int64 or ids.dim() != 1 or ids.shape != counts.shape or \
            (counts.numel() and int(counts.min()) < 0):
        raise CheckpointError(f"{where}: its admission counters are not as many int64 ids "
                              f"and counts >= 0; {_RESTORE}.")
    _check_owned(where, ids, partitioner, shard)


def checked_parts(reader: ChunkedReader | None, saved: Any
                  ) -> Iterator[tuple[dict[str, Any], dict[str, torch.Tensor]]]:
    """The parts of ``reader``, each checked against ``saved`` (the tables' descriptions)
    before it is yielded; the layout (every shard's parts, and rows) is checked first.

    Raises:
        CheckpointError: see the module docstring.
    """
    tables = checked_descriptions(saved)
    _layout(reader, tables)
    last: dict[tuple[str, int], int] = {}
    for info, tensors in (reader.parts() if reader is not None else ()):
        table, shard, part, n = _checked_info(info, tables)
        description, partitioner = tables[table]
        last[table, shard] = _check_tensors(table, shard, part, n, tensors, description,
                                            partitioner, last.get((table, shard), -(2**63) - 1))
        yield info, tensors


# ----------------------------------------------------------------------------- restore
def import_tables(client: TableClient, configs: Sequence[TableConfig],
                  reader: ChunkedReader | None, saved: Mapping[str, Any] | None) -> None:
    """Create the tables on the ps tasks and fill them from a checkpoint's parts.

    Args:
        client: a client of every (new) ps task.
        configs: the model's tables, for the cluster as it is now.
        reader: the checkpoint's :data:`TABLES_GROUP` (None: it has none).
        saved: the tables' descriptions from the checkpoint's metadata (None:
            written before tables were saved: they start from their
            initializers, with a warning).

    Raises:
        InvalidArgumentError: a table of the model is not in the checkpoint,
            or the other way round, or has another size, dim or dtype.
        CheckpointError: the parts of a table are incomplete.
    """
    if saved is None and reader is not None:
        raise CheckpointError(
            f"The checkpoint holds sparse table parts but its metadata has no {TABLES_KEY!r} "
            f"describing them; {_RESTORE}.")
    tables = None if saved is None else checked_descriptions(saved)
    for config in configs:
        client.init_table(config)
    if saved is None:
        if configs:
            log.warning("the checkpoint holds no sparse tables (written before tables were "
                        "saved): %s start from their initializers",
                        ", ".join(repr(c.name) for c in configs))
        return
    by_name = _match(configs, saved)
    layout = _layout(reader, tables)
    keep_slots = {name: saved[name]["optimizer"].get("name") == c.optimizer.get("name")
                  for name, c in by_name.items()}
    for name, keep in keep_slots.items():
        if not keep:
            log.warning("table %r: the checkpoint's optimizer %r is not %r; its slots start "
                        "afresh", name, saved[name]["optimizer"].get("name"),
                        by_name[name].optimizer.get("name"))
    pushes = {name: _pushes_for(layout[name], client.num_shards) for name in by_name}
    sent: set[tuple[str, int]] = set()
    for info, tensors in checked_parts(reader, saved):
        config = by_name[info["table"]]
        slots = {k.removeprefix(_SLOT): v for k, v in tensors.items() if k.startswith(_SLOT)}
        _send(client, config, tensors["ids"], tensors["rows"],
              slots if keep_slots[config.name] else None, pushes[config.name], sent,
              versions=tensors.get(_VERSIONS))
        if _COUNTER_IDS in tensors:
            _send_counters(client, config, tensors[_COUNTER_IDS], tensors[_COUNTER_COUNTS])
        del tensors, slots
        release_free_memory()  # the part is sent: hand its blocks back (every arena)
    for config in by_name.values():  # shards given no row still take their push records
        empty = torch.empty(0, dtype=torch.int64)
        _send(client, config, empty, torch.empty((0, config.dim), dtype=config.dtype), None,
              pushes[config.name], sent, only_unsent=True)
    log.info("restored sparse tables %s onto %d ps task(s)", ", ".join(map(repr, by_name)),
             client.num_shards)


def _match(configs: Sequence[TableConfig], saved: Mapping[str, Any]) -> dict[str, TableConfig]:
    """The model's tables by name, each checked against the checkpoint's description."""
    by_name = {c.name: c for c in configs}
    problems = [f"table {n!r} is in the checkpoint, not in the model" for n in saved
                if n not in by_name]
    problems += [f"table {n!r} is in the model, not in the checkpoint" for n in by_name
                 if n not in saved]
    for name, config in by_name.items():
        if name not in saved:
            continue
        want = describe_tables([config])[name]
        # a dynamic table may be restored with other admission / eviction options
        problems += [f"table {name!r} has {key}={want.get(key)!r} but the checkpoint's has "
                     f"{saved[name].get(key)!r}" for key in ("num_rows", "dim", "dtype", "kind")
                     if saved[name].get(key) != want.get(key)]
    if problems:
        raise InvalidArgumentError(
            "The checkpoint's sparse tables do not match the model's: " + "; ".join(problems)
            + ". Restore it into the model that wrote it, or train in a new directory."
        )
    return by_name


def _layout(reader: ChunkedReader | None, tables: Mapping[str, Any]
            ) -> dict[str, dict[int, dict[str, Any]]]:
    """Per table, per old shard: its rows and push records, checked complete."""
    layout: dict[str, dict[int, dict[str, Any]]] = {name: {} for name in tables}
    for info in (reader.infos if reader is not None else []):
        table, index, part, rows = _checked_info(info, tables)
        shard = layout[table].setdefault(index, {"rows": 0, "parts": 0, "expect": None,
                                                 "pushes": []})
        if part != shard["parts"]:
            raise CheckpointError(
                f"The checkpoint's table {table!r} lists part {part} of shard {index} where "
                f"part {shard['parts']} belongs; {_RESTORE}.")
        if "shard_rows" in info:
            shard["expect"], shard["pushes"] = info["shard_rows"], info["pushes"]
        shard["rows"] += rows
        shard["parts"] += 1
    for name, (description, partitioner) in tables.items():
        count = description["partitioner"]["num_shards"]
        found = layout[name]
        if len(found) != count or any(
                s["expect"] != s["rows"] or (partitioner.num_rows is not None
                                             and s["rows"] != partitioner.rows_in_shard(i))
                for i, s in found.items()):
            raise CheckpointError(
                f"The checkpoint's table {name!r} is incomplete: it was saved from {count} ps "
                f"shards but its parts hold shards {sorted(found)[:16]} with rows "
                f"{[(s['rows'], s['expect']) for s in found.values()][:16]}; {_RESTORE}."
            )
    return layout


def _pushes_for(shards: Mapping[int, Mapping[str, Any]], num_shards: int
                ) -> list[list[tuple[int, int, int, str]]]:
    """The push records each new shard takes in (see the module docstring)."""
    records = {old: [(int(w), int(i), int(q), str(s)) for w, i, q, s in info["pushes"]]
               for old, info in shards.items()}
    if len(records) == num_shards:
        return [records[s] for s in range(num_shards)]
    union = [r for old in sorted(records) for r in records[old]]
    return [union for _ in range(num_shards)]


def _send(client: TableClient, config: TableConfig, ids: torch.Tensor, rows: torch.Tensor,
          slots: Mapping[str, torch.Tensor] | None, pushes: list[list[Any]],
          sent: set[tuple[str, int]], *, only_unsent: bool = False,
          versions: torch.Tensor | None = None) -> None:
    """Import ``ids``' rows (and slots) into their new owners, in pieces of a call's size."""
    step = max(1, client.max_call_bytes // max(1, config.row_bytes * (1 + len(slots or {}))))
    for shard, (positions, shard_ids) in enumerate(config.partitioner.split(ids)):
        if only_unsent and (config.name, shard) in sent:
            continue
        if not only_unsent and not shard_ids.numel():
            continue
        shard_rows = rows.index_select(0, positions)
        shard_slots = None if slots is None else {
            k: v.index_select(0, positions) for k, v in slots.items()}
        shard_versions = None if versions is None else versions.index_select(0, positions)
        pieces = ((shard_ids[i:i + step], shard_rows[i:i + step],
                   None if shard_slots is None else {k: v[i:i + step] for k, v in
                                                     shard_slots.items()},
                   None if shard_versions is None else shard_versions[i:i + step])
                  for i in range(0, max(1, shard_ids.numel()), step))
        client.import_rows(config, shard, pieces, pushes=pushes[shard])
        sent.add((config.name, shard))


def _send_counters(client: TableClient, config: TableConfig, ids: torch.Tensor,
                   counts: torch.Tensor) -> None:
    """A dynamic table's admission counters to their new owners (re-hashed)."""
    for shard, (positions, shard_ids) in enumerate(config.partitioner.split(ids)):
        if shard_ids.numel():
            empty = (torch.empty(0, dtype=torch.int64),
                     torch.empty((0, config.dim), dtype=config.dtype), None, None,
                     (shard_ids, counts.index_select(0, positions)))
            client.import_rows(config, shard, [empty])


# ----------------------------------------------------------------------------- a module's rows
def ship_rows(client: TableClient, config: TableConfig, ids: torch.Tensor | None,
              rows: torch.Tensor, *, shards: Sequence[int] | None = None,
              part_bytes: int = PART_BYTES) -> None:
    """Set a new table's rows from ``rows`` (a module's weight), streamed to their owners.

    Each shard takes its rows through the import path (``ImportRows``, slots
    reset) in streams of about ``part_bytes``, each cut into calls of the
    client's ``max_call_bytes``; only one call's rows are gathered at a time,
    so the worker holds no second copy of the table.

    Args:
        client: a client of every ps task.
        config: the table (created on the ps tasks).
        ids: the global ids of ``rows``; None: ``rows`` is the whole table.
        rows: ``(len(ids) or num_rows, dim)`` values.
        shards: the shards to fill (default: all).
        part_bytes: rows per import stream (what a ps task gathers at once).
    """
    call = max(1, client.max_call_bytes // config.row_bytes)
    per_stream = max(call, part_bytes // config.row_bytes)
    if ids is not None:
        ids = config.partitioner.check(ids.to(torch.int64))
    for shard in range(client.num_shards) if shards is None else shards:
        if ids is None:
            shard_ids, places = config.partitioner.global_ids(shard), None
        else:
            places, shard_ids = config.partitioner.split(ids)[shard]
        for start in range(0, shard_ids.numel(), per_stream):
            block = slice(start, min(start + per_stream, shard_ids.numel()))
            where = shard_ids if places is None else places
            pieces = ((shard_ids[i:i + call],
                       rows.index_select(0, where[i:i + call].to(rows.device))
                       .to("cpu", config.dtype), None)
                      for i in range(block.start, block.stop, call))
            client.import_rows(config, shard, pieces)
    log.debug("table %r: its start rows shipped to ps task(s) %s", config.name,
              list(range(client.num_shards)) if shards is None else list(shards))
