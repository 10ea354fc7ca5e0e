"""Writing exports: a full one from a training checkpoint (or a live trainer's state), and
deltas on top of an earlier export.

A full export copies the checkpoint's dense parameters (its ``model`` group) and every
table's rows, part by part as the checkpoint holds them (one part in memory at a time),
each part's keys sorted, the optimizer slots dropped unless ``with_optimizer``.

A delta is computed on the checkpoint, against the rows of the export it builds on (its
chain read back): a row is in the delta when its bits differ from the base's or its id
is new; an id of the base that the checkpoint no longer holds is listed as removed. This
needs no record of which rows training touched, and is exact whatever the training mode;
it holds one table of the base in memory at a time. Dense parameters are copied whole.

The tables of a training checkpoint are the chunked group ``ps_tables`` (parts of
``ids``, ``rows`` and ``slot.*`` per ps shard) described in its metadata under
``strategy.tables`` (``num_rows``, ``dim``, ``dtype``, ``partitioner``; a dynamic table
adds ``"kind": "dynamic"`` and may declare a ``default`` row).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from towerflow.checkpoint import read_checkpoint
from towerflow.errors import InvalidArgumentError, NotFoundError
from towerflow.serving.chain import Export, TableState, resolve_chain, table_state
from towerflow.serving.layout import describe, table_entry, write_export

__all__ = ["CHECKPOINT_TABLES", "CHECKPOINT_TABLES_GROUP", "Source", "export",
           "export_source", "source_from_checkpoint", "source_from_state"]

log = logging.getLogger("towerflow.serving")

#: the training checkpoint's chunked group of table parts (the ps wing's ``TABLES_GROUP``)
CHECKPOINT_TABLES_GROUP = "ps_tables"
#: the key of the tables' descriptions in the strategy's checkpoint metadata (``TABLES_KEY``)
CHECKPOINT_TABLES = "tables"
_MODEL_GROUP = "model"
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(slots=True)
class Source:
    """What an export is written from: a training checkpoint, or a trainer's state now.

    Attributes:
        step: the global step of the state.
        dense: the dense parameters and buffers by name.
        tables: the tables' descriptions by name (``num_rows``, ``dim``, ``dtype``, ...).
        parts: ``(info, tensors)`` of the tables' rows (``ids``, ``rows``, ``slot.*``),
            one at a time; iterated once.
        other_groups: the state's other groups (the optimizer's), kept with
            ``with_optimizer``.
        origin: where it comes from, for messages.
    """

    step: int
    dense: Mapping[str, torch.Tensor]
    tables: Mapping[str, Mapping[str, Any]]
    parts: Iterable[tuple[Mapping[str, Any], Mapping[str, torch.Tensor]]]
    other_groups: Mapping[str, Mapping[str, torch.Tensor]] = field(default_factory=dict)
    origin: str = "the trainer's state"


def _tables_of(metadata: Mapping[str, Any]) -> Mapping[str, Mapping[str, Any]]:
    strategy = metadata.get("strategy", {})
    return dict(strategy.get(CHECKPOINT_TABLES, {})) if isinstance(strategy, Mapping) else {}


def source_from_checkpoint(train_dir: str | Path) -> Source:
    """The newest checkpoint of ``train_dir`` that verifies (or the checkpoint ``train_dir``).

    Raises:
        NotFoundError: no checkpoint there.
        CheckpointError: every checkpoint there is damaged.
    """
    try:
        ckpt = read_checkpoint(train_dir)
    except NotFoundError as exc:
        raise NotFoundError(f"No checkpoint to export in {str(train_dir)!r}; pass the "
                            "--train-dir a training run wrote its checkpoints to.") from exc
    if _MODEL_GROUP not in ckpt.groups:
        raise NotFoundError(f"Checkpoint {str(ckpt.path)!r} has no {_MODEL_GROUP!r} group of "
                            f"parameters (it has {sorted(ckpt.groups)}); export a checkpoint "
                            "written by training.")
    reader = ckpt.chunked.get(CHECKPOINT_TABLES_GROUP)
    return Source(ckpt.step, ckpt.groups[_MODEL_GROUP], _tables_of(ckpt.metadata),
                  reader.parts() if reader is not None else (),
                  {g: t for g, t in ckpt.groups.items() if g != _MODEL_GROUP},
                  origin=f"checkpoint {str(ckpt.path)!r}")


def source_from_state(groups: Mapping[str, Any], metadata: Mapping[str, Any]) -> Source:
    """A trainer's ``checkpoint_state()`` (groups and metadata), tables streamed from the ps."""
    chunked = groups.get(CHECKPOINT_TABLES_GROUP)
    others = {g: t for g, t in groups.items() if g not in (_MODEL_GROUP, CHECKPOINT_TABLES_GROUP)}
    return Source(int(metadata["step"]), groups[_MODEL_GROUP], _tables_of(metadata),
                  chunked if chunked is not None else (), others)


def _entries(source: Source) -> dict[str, dict[str, Any]]:
    return {name: table_entry(t.get("kind", "fixed"),
                              t.get("num_rows") if t.get("kind", "fixed") == "fixed" else None,
                              int(t["dim"]), str(t["dtype"]),
                              partitioner=t.get("partitioner"), default=t.get("default"))
            for name, t in source.tables.items()}


def _full_parts(source: Source, with_optimizer: bool
                ) -> Iterator[tuple[dict[str, Any], dict[str, torch.Tensor]]]:
    for info, tensors in source.parts:
        out = {"keys": tensors["ids"], "rows": tensors["rows"]}
        if with_optimizer:
            out.update({k: v for k, v in tensors.items() if k.startswith("slot.")})
        yield {"table": info["table"], "shard": info.get("shard", 0)}, out


def _bits(rows: torch.Tensor) -> torch.Tensor:
    return rows.contiguous().view(_BITS[rows.element_size()])


def _changed(state: TableState, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Which of ``ids`` (with ``rows``) differ from the base: a new id, or other bits."""
    if state.weight is not None:
        base = state.weight.index_select(0, ids)
        return (_bits(base) != _bits(rows)).any(1)
    keys, base_rows = state.keys, state.rows
    if not keys.numel():  # type: ignore[union-attr]
        return torch.ones(ids.numel(), dtype=torch.bool)
    place = torch.searchsorted(keys, ids).clamp_(max=keys.numel() - 1)  # type: ignore[union-attr, arg-type]
    found = keys[place] == ids  # type: ignore[index]
    differ = (_bits(base_rows.index_select(0, place)) != _bits(rows)).any(1)  # type: ignore[union-attr]
    return ~found | differ


class _Delta:
    """The parts of a delta: per source part its changed rows; per dynamic table its
    removed ids after its last part."""

    def __init__(self, chain: list[Export], tables: Mapping[str, Mapping[str, Any]]) -> None:
        self.chain, self.tables = chain, tables
        self.name: str | None = None
        self.state: TableState | None = None
        self.seen: list[torch.Tensor] = []

    def _finish(self) -> Iterator[tuple[dict[str, Any], dict[str, torch.Tensor]]]:
        state, name = self.state, self.name
        if state is not None and state.keys is not None and name is not None:
            held = torch.cat([state.keys[:0], *self.seen])
            gone = state.keys[~torch.isin(state.keys, held)]
            if gone.numel():
                yield {"table": name, "shard": 0}, {"removed": gone}
        self.name, self.state, self.seen = None, None, []

    def parts(self, source: Source) -> Iterator[tuple[dict[str, Any], dict[str, torch.Tensor]]]:
        for info, tensors in source.parts:
            name = info["table"]
            if name != self.name:
                yield from self._finish()
                self.name, self.state = name, table_state(self.chain, name)
            ids, rows = tensors["ids"], tensors["rows"]
            if self.state.keys is not None:  # type: ignore[union-attr]
                self.seen.append(ids)
            changed = _changed(self.state, ids, rows)  # type: ignore[arg-type]
            if bool(changed.any()):
                yield ({"table": name, "shard": info.get("shard", 0)},
                       {"keys": ids[changed], "rows": rows[changed]})
        yield from self._finish()


def _check_same_tables(source: Source, base: Export, entries: Mapping[str, Any]) -> None:
    theirs = base.description["tables"]
    problems = [f"table {n!r} is new" for n in entries if n not in theirs]
    problems += [f"table {n!r} is gone" for n in theirs if n not in entries]
    problems += [f"table {n!r} has {k}={entries[n][k]!r}, the base {theirs[n][k]!r}"
                 for n in entries if n in theirs
                 for k in ("kind", "num_rows", "dim", "dtype") if entries[n][k] != theirs[n][k]]
    if source.step < base.step:
        problems.append(f"{source.origin} is of step {source.step}, before the base's "
                        f"{base.step}")
    if problems:
        raise InvalidArgumentError(
            f"A delta of {source.origin} cannot build on {str(base.path)!r}: "
            + "; ".join(problems) + ". Write a full export instead (leave out --since).")


def export_source(source: Source, out_dir: str | Path, *,
                  since: str | Path | list[str | Path] | None = None,
                  with_optimizer: bool = False) -> Path:
    """Write the export of ``source`` at ``out_dir`` (a delta on top of ``since`` if given).

    See :func:`export`.
    """
    entries = _entries(source)
    if since is None:
        description = describe("full", source.step, entries, with_optimizer=with_optimizer)
        parts: Iterable[Any] = _full_parts(source, with_optimizer)
        extra = {f"train.{g}": t for g, t in source.other_groups.items()} \
            if with_optimizer else {}
        return write_export(out_dir, description, source.dense, parts, extra)
    if with_optimizer:
        raise InvalidArgumentError("with_optimizer is for full exports (a delta carries rows "
                                   "only); leave out --since or --with-optimizer.")
    chain = resolve_chain(since)
    base = chain[-1]
    _check_same_tables(source, base, entries)
    description = describe("delta", source.step, entries,
                           base={"name": base.path.name, "step": base.step,
                                 "manifest_sha256": base.digest})
    return write_export(out_dir, description, source.dense, _Delta(chain, entries).parts(source))


def export(train_dir: str | Path, out_dir: str | Path, *,
           since: str | Path | list[str | Path] | None = None,
           with_optimizer: bool = False) -> Path:
    """Export the newest checkpoint of ``train_dir`` for serving, at ``out_dir``.

    Args:
        train_dir: a train dir (its newest checkpoint that verifies) or a checkpoint.
        out_dir: the export's directory; it must not exist. It appears complete or not
            at all.
        since: an earlier export (or its chain, full first): write a delta on top of it,
            holding the rows that changed and the ids removed since its step.
        with_optimizer: keep the tables' optimizer slots and the optimizer's state (full
            exports only).

    Returns:
        ``out_dir`` as a Path.

    Example::

        towerflow.export("runs/click", "exports/full-1")
        towerflow.export("runs/click", "exports/delta-2", since="exports/full-1")
    """
    path = export_source(source_from_checkpoint(train_dir), out_dir, since=since,
                         with_optimizer=with_optimizer)
    log.info("exported %s for serving at %s", train_dir, path)
    return path
