"""The serving directory: a checkpoint-format directory whose metadata says what it serves.

An export is written and read with :mod:`towerflow.checkpoint`'s format, so it is
published atomically (a temporary directory, every file fsynced, one rename) and sealed
the same way (``manifest.sha256`` covers ``manifest.json``, which holds the SHA-256, size,
dtype and shape of every file)::

    exports/full-00001000/
        dense.safetensors          the dense parameters and buffers (the model's state)
        tables-00000.safetensors   a part of one table: keys (int64, sorted) and rows
        ...
        manifest.json              step, files and digests, and the serving description
        manifest.sha256

The serving description is the manifest's ``metadata["serving"]`` (:func:`describe`)::

    {"format": "towerflow.serving/1", "kind": "full" | "delta", "step": 1000,
     "base": null | {"name": "full-00000500", "step": 500, "manifest_sha256": "..."},
     "with_optimizer": false,
     "tables": {"emb": {"kind": "fixed", "num_rows": 1000, "dim": 32, "dtype": "float32",
                        "partitioner": {...}, "default": null, "rows": 1000, "removed": 0}}}

A part (the chunked group ``tables``) holds ``keys`` ``(n,)`` int64 strictly increasing,
``rows`` ``(n, dim)`` in the table's dtype and, with ``with_optimizer``, ``slot.<name>``
``(n, dim)``; a delta's part may hold instead ``removed`` ``(m,)``, the ids evicted since
the base. Its info is ``{"table": name, "shard": s, "part": i}`` (``shard``: the ps shard
the rows were read from, the table's ``partitioner`` saying which ids it owns).

A table is ``fixed`` (``num_rows`` rows, a full export holds every id in
``[0, num_rows)``) or ``dynamic`` (any int64 id; ``num_rows`` null; ``default``: the row
of an id it does not hold, a list of ``dim`` numbers, or null for zeros). A delta holds
the rows that changed since its base (new ids included) and the ids removed; a chain —
a full export, then deltas each naming the one before as its base — gives the table of
the last delta's step.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from towerflow.checkpoint import ChunkedGroup
from towerflow.checkpoint.format import write_checkpoint_dir
from towerflow.errors import (
    AlreadyExistsError,
    CheckpointError,
    DataLossError,
    InvalidArgumentError,
)

__all__ = ["DENSE_GROUP", "FORMAT", "SERVING_KEY", "TABLES_PART_GROUP", "TABLE_DTYPES",
           "check_description", "describe", "export_name", "table_entry", "write_export"]

FORMAT = "towerflow.serving/1"
#: the key of the serving description in the manifest's metadata
SERVING_KEY = "serving"
#: the group of the dense parameters
DENSE_GROUP = "dense"
#: the chunked group of the tables' parts
TABLES_PART_GROUP = "tables"
TABLE_DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
                "bfloat16": torch.bfloat16}
_KINDS = ("full", "delta")
_TABLE_KINDS = ("fixed", "dynamic")
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}")
_SHA_RE = re.compile(r"[0-9a-f]{64}")
_AGAIN = "export it again"


def export_name(kind: str, step: int) -> str:
    """The directory name of an export in a directory of exports (the hook's).

    Example:
        >>> export_name("delta", 1500)
        'delta-00001500'
    """
    return f"{kind}-{step:08d}"


def table_entry(kind: str, num_rows: int | None, dim: int, dtype: str, *,
                partitioner: Mapping[str, Any] | None = None,
                default: list[float] | None = None) -> dict[str, Any]:
    """A table's description (``rows`` and ``removed`` are counted as parts are written).

    Example:
        >>> table_entry("dynamic", None, 4, "float32")["kind"]
        'dynamic'
    """
    return {"kind": kind, "num_rows": num_rows, "dim": dim, "dtype": dtype,
            "partitioner": dict(partitioner or {}), "default": default,
            "rows": 0, "removed": 0}


def describe(kind: str, step: int, tables: Mapping[str, Mapping[str, Any]], *,
             base: Mapping[str, Any] | None = None, with_optimizer: bool = False
             ) -> dict[str, Any]:
    """The serving description of an export (checked with :func:`check_description`)."""
    description = {"format": FORMAT, "kind": kind, "step": step,
                   "base": None if base is None else dict(base),
                   "with_optimizer": bool(with_optimizer),
                   "tables": {name: dict(t) for name, t in tables.items()}}
    problem = _problem(description)
    if problem:
        raise InvalidArgumentError(f"An export cannot be described: {problem}.")
    return description


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _table_problem(name: Any, table: Any) -> str | None:
    if not isinstance(name, str) or not name:
        return f"a table's name {name!r} is not a non-empty string"
    if not isinstance(table, Mapping):
        return f"table {name!r} is not an object"
    if table.get("kind") not in _TABLE_KINDS:
        return f"table {name!r} has kind {table.get('kind')!r}, not one of {list(_TABLE_KINDS)}"
    dim, num_rows = table.get("dim"), table.get("num_rows")
    if not _is_count(dim) or dim < 1:
        return f"table {name!r} has dim {dim!r}, not a positive integer"
    if table["kind"] == "fixed" and (not _is_count(num_rows) or num_rows < 1):
        return f"fixed table {name!r} has num_rows {num_rows!r}, not a positive integer"
    if table.get("dtype") not in TABLE_DTYPES:
        return f"table {name!r} has dtype {table.get('dtype')!r}, not one of {list(TABLE_DTYPES)}"
    default = table.get("default")
    if default is not None and not (isinstance(default, list) and len(default) == dim and all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in default)):
        return f"table {name!r} has a default that is not a list of {dim} numbers"
    if not isinstance(table.get("partitioner", {}), Mapping):
        return f"table {name!r} has a partitioner that is not an object"
    if not (_is_count(table.get("rows")) and _is_count(table.get("removed"))):
        return f"table {name!r} does not count its rows and removed ids"
    return None


def _base_problem(description: Mapping[str, Any]) -> str | None:
    base = description.get("base")
    if description["kind"] == "full":
        return None if base is None else "a full export names a base"
    if not isinstance(base, Mapping):
        return "a delta names no base"
    if not (isinstance(base.get("name"), str) and _NAME_RE.fullmatch(base["name"])):
        return f"its base's name {base.get('name')!r} is not a plain directory name"
    if not _is_count(base.get("step")) or base["step"] > description["step"]:
        return f"its base's step {base.get('step')!r} is not a step at or before its own"
    if not (isinstance(base.get("manifest_sha256"), str)
            and _SHA_RE.fullmatch(base["manifest_sha256"])):
        return "its base's manifest digest is not a sha256"
    return None


def _problem(description: Any) -> str | None:
    if not isinstance(description, Mapping) or description.get("format") != FORMAT:
        return f"its serving description is not of format {FORMAT!r}"
    if description.get("kind") not in _KINDS:
        return f"its kind {description.get('kind')!r} is not one of {list(_KINDS)}"
    if not _is_count(description.get("step")):
        return "its step is not a non-negative integer"
    if not isinstance(description.get("with_optimizer"), bool):
        return "its with_optimizer is not a boolean"
    tables = description.get("tables")
    if not isinstance(tables, Mapping):
        return "its tables are not an object"
    problem = next((p for p in (_table_problem(n, t) for n, t in tables.items()) if p), None)
    return problem or _base_problem(description)


def check_description(path: Path, manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The serving description of the export at ``path`` whose manifest is ``manifest``.

    Raises:
        CheckpointError: it is not a serving export, or its description is malformed or
            disagrees with the manifest's step.
    """
    metadata = manifest.get("metadata", {})
    description = metadata.get(SERVING_KEY) if isinstance(metadata, Mapping) else None
    if description is None:
        raise CheckpointError(
            f"{str(path)!r} is a checkpoint, not a serving export; write one with "
            f"`towerflow export --train-dir <train dir> --out {path.name}-serving`.")
    problem = _problem(description)
    if problem is None and description["step"] != manifest.get("step"):
        problem = f"its step {description['step']} is not its manifest's {manifest.get('step')}"
    if problem:
        raise CheckpointError(f"Serving export {str(path / 'manifest.json')!r} is malformed: "
                              f"{problem}; {_AGAIN}.")
    return dict(description)


def _part_tensors(name: str, table: Mapping[str, Any], tensors: Mapping[str, torch.Tensor],
                  with_optimizer: bool) -> dict[str, torch.Tensor]:
    """A part's tensors, checked and with its keys sorted (rows and slots alike)."""
    dtype, dim = TABLE_DTYPES[table["dtype"]], table["dim"]
    out: dict[str, torch.Tensor] = {}
    if "removed" in tensors:
        removed = tensors["removed"]
        if removed.dtype != torch.int64 or removed.dim() != 1:
            raise InvalidArgumentError(f"Table {name!r}: removed ids must be int64 (m,).")
        out["removed"] = torch.sort(removed).values
    keys = tensors.get("keys", torch.empty(0, dtype=torch.int64))
    rows = tensors.get("rows", torch.empty((0, dim), dtype=dtype))
    if keys.dtype != torch.int64 or keys.dim() != 1 or tuple(rows.shape) != (keys.numel(), dim) \
            or rows.dtype != dtype:
        raise InvalidArgumentError(
            f"Table {name!r}: a part of keys {keys.dtype} {tuple(keys.shape)} and rows "
            f"{rows.dtype} {tuple(rows.shape)}; give int64 keys (n,) and {dtype} rows (n, {dim}).")
    order = None if _increasing(keys) else torch.argsort(keys)  # a shard's ids often are

    def pick(t: torch.Tensor) -> torch.Tensor:
        return t if order is None else t.index_select(0, order)

    if keys.numel() or "removed" not in out:
        out["keys"], out["rows"] = pick(keys), pick(rows)
        out.update({k: pick(v) for k, v in tensors.items()
                    if with_optimizer and k.startswith("slot.")})
    if order is not None and not _increasing(out["keys"]):
        raise InvalidArgumentError(f"Table {name!r}: a part holds an id twice.")
    return out


def _increasing(keys: torch.Tensor) -> bool:
    return keys.numel() < 2 or bool((keys[1:] > keys[:-1]).all())


def _counted_parts(description: dict[str, Any],
                   parts: Iterable[tuple[Mapping[str, Any], Mapping[str, torch.Tensor]]]):
    """The parts as written (info, sorted tensors), each counted into its table."""
    tables = description["tables"]
    index: dict[str, int] = {}
    for info, tensors in parts:
        name = info.get("table")
        if name not in tables:
            raise InvalidArgumentError(f"A part names table {name!r}, which the export does "
                                       f"not describe (it has {sorted(tables)}).")
        table = tables[name]
        out = _part_tensors(name, table, tensors, description["with_optimizer"])
        table["rows"] += int(out["keys"].numel()) if "keys" in out else 0
        table["removed"] += int(out["removed"].numel()) if "removed" in out else 0
        shard = int(info.get("shard", 0))
        index[name] = index.get(name, -1) + 1
        yield {"table": name, "shard": shard, "part": index[name]}, out
    short = [f"{name!r} ({t['rows']} of {t['num_rows']} rows)" for name, t in tables.items()
             if description["kind"] == "full" and t["kind"] == "fixed"
             and t["rows"] != t["num_rows"]]
    if short:
        raise DataLossError(f"The state to export does not cover its fixed tables: "
                            f"{', '.join(short)}; no export was written. Export a checkpoint "
                            "written by training with those tables.")


def write_export(out: str | Path, description: dict[str, Any],
                 dense: Mapping[str, torch.Tensor],
                 parts: Iterable[tuple[Mapping[str, Any], Mapping[str, torch.Tensor]]],
                 extra_groups: Mapping[str, Mapping[str, torch.Tensor]] | None = None) -> Path:
    """Publish an export at ``out`` atomically: nothing at ``out`` until it is complete.

    Args:
        out: the directory to create; it must not exist.
        description: from :func:`describe` (its tables' ``rows`` and ``removed`` are
            counted here, from the parts).
        dense: the dense parameters and buffers by name.
        parts: ``(info, tensors)`` with ``info["table"]`` (and ``"shard"``) and tensors
            ``keys`` + ``rows`` (+ ``slot.*`` kept with ``with_optimizer``) and/or
            ``removed``; each part's keys are sorted here. Consumed lazily, one at a time.
        extra_groups: more groups (the optimizer's state with ``with_optimizer``).

    Raises:
        AlreadyExistsError: ``out`` exists.
        InvalidArgumentError: a part is malformed or names a table not described.
    """
    out = Path(out)
    if out.exists() or out.is_symlink():
        raise AlreadyExistsError(f"{str(out)!r} exists; an export is never written over "
                                 "another: choose a new --out (or remove it first).")
    groups: dict[str, Any] = {DENSE_GROUP: dict(dense), **dict(extra_groups or {})}
    groups[TABLES_PART_GROUP] = ChunkedGroup(_counted_parts(description, parts))
    # the description's counts are final only once every part is written: the manifest
    # is encoded after the parts, so the metadata object is filled in by then
    metadata = {SERVING_KEY: description}
    return write_checkpoint_dir(out, description["step"], groups, metadata)
