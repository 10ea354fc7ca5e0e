"""Sparse tables in checkpoints: streamed out of the ps shards, re-sharded on the way back in.

A table is saved sharded, never gathered: :func:`export_tables` is a
:class:`~towerflow.checkpoint.ChunkedGroup` whose parts the checkpoint
writer asks for one at a time. Each part holds up to ``part_bytes`` of one
old shard's export (``ExportRows``, streamed in chunks: rows and slots of
one moment under the shard's lock), as the tensors

- ``ids``: int64 ``(n,)`` global ids,
- ``rows``: ``(n, dim)`` rows in the table's dtype,
- ``slot.<name>``: ``(n, dim)`` per optimizer slot,

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
from towerflow.ps.protocol import push_rows
from towerflow.ps.worker.tables.batch import decode as _decode
from towerflow.ps.worker.tables.client import TableClient
from towerflow.ps.worker.tables.config import TableConfig

__all__ = ["TABLES_GROUP", "TABLES_KEY", "PART_BYTES", "describe_tables", "export_tables",
           "import_tables", "ship_rows"]

log = logging.getLogger("towerflow.ps")

#: the checkpoint's chunked group of the sparse tables
TABLES_GROUP = "ps_tables"
#: the key of the tables' descriptions in the strategy's checkpoint metadata
TABLES_KEY = "tables"
#: bytes of rows and slots per part file (the most a save or restore holds of a table)
PART_BYTES = 64 << 20
#: bytes of rows per ExportRows message (slots add as much again each)
_EXPORT_CHUNK_BYTES = 512 << 10
_SLOT = "slot."
_RESTORE = "restore an earlier checkpoint"


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
                     "initializer": dict(c.initializer)} for c in configs}


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
    elif pending:
        tensors = {k: torch.cat([p[k] for p in pending]) for k in pending[0]}
    else:
        tensors = {"ids": torch.empty(0, dtype=torch.int64),
                   "rows": torch.empty((0, config.dim), dtype=config.dtype)}
    pending.clear()
    info = {"table": config.name, "shard": shard, "part": index,
            "rows": int(tensors["ids"].numel())}
    info.update(head)
    return info, tensors


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
    for config in configs:
        client.init_table(config)
    if saved is None:
        if configs:
            log.warning("the checkpoint holds no sparse tables (written before tables were "
                        "saved): %s start from their initializers",
                        ", ".join(repr(c.name) for c in configs))
        return
    by_name = _match(configs, saved)
    layout = _layout(reader, saved)
    keep_slots = {name: saved[name]["optimizer"].get("name") == c.optimizer.get("name")
                  for name, c in by_name.items()}
    for name, keep in keep_slots.items():
        if not keep:
            log.warning("table %r: the checkpoint's optimizer %r is not %r; its slots start "
                        "afresh", name, saved[name]["optimizer"].get("name"),
                        by_name[name].optimizer.get("name"))
    pushes = {name: _pushes_for(layout[name], client.num_shards) for name in by_name}
    sent: set[tuple[str, int]] = set()
    for info, tensors in (reader.parts() if reader is not None else ()):
        config = by_name[info["table"]]
        slots = {k.removeprefix(_SLOT): v for k, v in tensors.items() if k.startswith(_SLOT)}
        _send(client, config, tensors["ids"], tensors["rows"],
              slots if keep_slots[config.name] else None, pushes[config.name], sent)
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
        problems += [f"table {name!r} has {key}={want[key]!r} but the checkpoint's has "
                     f"{saved[name].get(key)!r}" for key in ("num_rows", "dim", "dtype")
                     if saved[name].get(key) != want[key]]
    if problems:
        raise InvalidArgumentError(
            "The checkpoint's sparse tables do not match the model's: " + "; ".join(problems)
            + ". Restore it into the model that wrote it, or train in a new directory."
        )
    return by_name


def _layout(reader: ChunkedReader | None, saved: Mapping[str, Any]
            ) -> dict[str, dict[int, dict[str, Any]]]:
    """Per table, per old shard: its rows and push records, checked complete."""
    layout: dict[str, dict[int, dict[str, Any]]] = {name: {} for name in saved}
    for info in (reader.infos if reader is not None else []):
        shards = layout.get(info.get("table"))
        if shards is None:
            raise CheckpointError(f"A part of the checkpoint's tables names table "
                                  f"{info.get('table')!r}, which its metadata does not "
                                  f"describe; {_RESTORE}.")
        shard = shards.setdefault(int(info.get("shard", -1)),
                                  {"rows": 0, "parts": 0, "expect": None, "pushes": []})
        if int(info.get("part", -1)) != shard["parts"]:
            raise CheckpointError(
                f"The checkpoint's table {info['table']!r} lists part {info.get('part')} of "
                f"shard {info.get('shard')} where part {shard['parts']} belongs; {_RESTORE}."
            )
        if "shard_rows" in info:
            shard["expect"], shard["pushes"] = int(info["shard_rows"]), info.get("pushes", [])
        shard["rows"] += int(info.get("rows", 0))
        shard["parts"] += 1
    for name, description in saved.items():
        count = int(description["partitioner"].get("num_shards", 0))
        found = layout[name]
        if sorted(found) != list(range(count)) or any(
                s["expect"] != s["rows"] for s in found.values()):
            raise CheckpointError(
                f"The checkpoint's table {name!r} is incomplete: it was saved from {count} ps "
                f"shards but its parts hold {sorted(found)} with rows "
                f"{[(s['rows'], s['expect']) for s in found.values()]}; {_RESTORE}."
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
          sent: set[tuple[str, int]], *, only_unsent: bool = False) -> None:
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
        pieces = ((shard_ids[i:i + step], shard_rows[i:i + step],
                   None if shard_slots is None else {k: v[i:i + step] for k, v in
                                                     shard_slots.items()})
                  for i in range(0, max(1, shard_ids.numel()), step))
        client.import_rows(config, shard, pieces, pushes=pushes[shard])
        sent.add((config.name, shard))


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
