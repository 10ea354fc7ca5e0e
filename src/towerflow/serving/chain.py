"""Reading exports back: one verified export, a chain of them, a table's rows at its end.

:func:`read_export` checks an export as a checkpoint is checked (the manifest's digest;
every file's size, dtypes and shapes; the dense file's SHA-256 now and each part's as it
is read; any damage names the file) and then as a serving export (its description, every
part against it). :func:`resolve_chain` turns
what a user names — a list of exports, one export (a delta finds its base by the name it
records, in its own directory) or a directory of exports (its newest) — into the chain
from a full export, each delta's base checked by step and manifest digest.
:func:`table_state` applies a table's full rows and then each delta's.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from towerflow.checkpoint import ChunkedReader
from towerflow.checkpoint.chunked import scan_chunked
from towerflow.checkpoint.data_file import SUFFIX, read_data_file, to_tensors
from towerflow.checkpoint.files import open_dir, read_regular
from towerflow.checkpoint.manifest import DIGEST_NAME, MANIFEST_NAME, load_manifest
from towerflow.errors import CheckpointError, DataLossError, InvalidArgumentError, NotFoundError
from towerflow.serving.layout import (
    DENSE_GROUP,
    TABLE_DTYPES,
    TABLES_PART_GROUP,
    check_description,
)

__all__ = ["Export", "TableState", "export_chain_names", "newest_export", "read_export", "resolve_chain",
           "table_state"]

_EXPORT_RE = re.compile(r"(full|delta)-(\d{8,})")
_AGAIN = "export it again"
DENSE_FILE = DENSE_GROUP + SUFFIX


@dataclass(slots=True)
class Export:
    """One export: its directory, description, dense tensors (verified) and parts."""

    path: Path
    description: dict[str, Any]
    dense: dict[str, torch.Tensor]
    digest: str  # the sha256 of its manifest.json
    entries: dict[str, Any]  # its parts' manifest entries, by file name

    @property
    def step(self) -> int:
        return int(self.description["step"])

    @property
    def kind(self) -> str:
        return str(self.description["kind"])

    def parts(self, table: str) -> Iterator[tuple[dict[str, Any], dict[str, torch.Tensor]]]:
        """The parts of ``table``, one at a time, each verified (SHA-256) as it is read."""
        mine = {fname: entry for fname, entry in self.entries.items()
                if entry.get("info", {}).get("table") == table}
        reader = ChunkedReader(self.path, TABLES_PART_GROUP, mine, torch.device("cpu"))
        try:
            yield from reader.parts()
        except (DataLossError, NotFoundError) as exc:
            raise _damaged(self.path, exc) from exc


def _damaged(path: Path, exc: Exception) -> CheckpointError:
    return CheckpointError(f"Serving export {str(path)!r} is damaged: {exc} The way out: "
                           f"{_AGAIN}, or load the previous one.")


def _check_parts(path: Path, description: dict[str, Any], entries: dict[str, Any]) -> None:
    """Every part names a described table with tensors of its dtype and dim, and the
    counts add up to the description's."""
    tables = description["tables"]
    counts = {name: [0, 0] for name in tables}
    for fname, entry in entries.items():
        info, tensors = entry.get("info", {}), entry.get("tensors", {})
        table = tables.get(info.get("table"))
        problem = None
        if table is None:
            problem = f"names table {info.get('table')!r}, which the manifest does not describe"
        else:
            want = {"keys": ("int64", 1), "removed": ("int64", 1),
                    "rows": (table["dtype"], 2)}
            for key, meta in tensors.items():
                dtype, rank = want.get(key, (table["dtype"], 2) if key.startswith("slot.")
                                       else (None, None))
                shape = meta.get("shape", [])
                if dtype is None or meta.get("dtype") != dtype or len(shape) != rank or (
                        rank == 2 and shape[1] != table["dim"]):
                    problem = f"holds {key!r} {meta.get('dtype')} {shape}, not of the table"
            if problem is None:
                counts[info["table"]][0] += tensors.get("keys", {}).get("shape", [0])[0]
                counts[info["table"]][1] += tensors.get("removed", {}).get("shape", [0])[0]
        if problem:
            raise CheckpointError(f"Serving export part {str(path / fname)!r} {problem}; "
                                  f"{_AGAIN}.")
    for name, (rows, removed) in counts.items():
        if [rows, removed] != [tables[name]["rows"], tables[name]["removed"]]:
            raise CheckpointError(
                f"Serving export {str(path)!r} lists {tables[name]['rows']} rows and "
                f"{tables[name]['removed']} removed ids of table {name!r} but its parts hold "
                f"{rows} and {removed}: a part is missing; {_AGAIN}.")


def read_export(path: str | Path) -> Export:
    """Open the export at ``path``: its manifest and dense tensors verified, its parts checked.

    The manifest's digest, the dense file's SHA-256 and every part's presence, size and
    header are checked now; a part's SHA-256 when it is read (:meth:`Export.parts`).

    Raises:
        NotFoundError: no directory at ``path``.
        CheckpointError: a file is missing or damaged, or the export is malformed (the
            message names the file).
    """
    path = Path(path)
    try:
        with open_dir(path) as dir_fd:
            manifest = load_manifest(dir_fd, path)
            description = check_description(path, manifest)
            entry = manifest["files"].get(DENSE_FILE)
            if entry is None:
                raise CheckpointError(f"Serving export {str(path)!r} has no {DENSE_FILE}; "
                                      f"{_AGAIN}.")
            data = read_data_file(dir_fd, path, DENSE_FILE, entry, True)
            dense = to_tensors(path / DENSE_FILE, data, torch.device("cpu"))
            del data
            scan_chunked(dir_fd, path, manifest, verify=False)
            sealed = read_regular(dir_fd, path, DIGEST_NAME, max_bytes=256, what="digest file")
    except NotFoundError as exc:
        raise NotFoundError(f"No serving export at {str(path)!r}; pass the --out of "
                            "`towerflow export`.") from exc
    except DataLossError as exc:
        if "Serving export" in str(exc):
            raise
        raise _damaged(path, exc) from exc
    entries = manifest.get("chunked", {}).get(TABLES_PART_GROUP, {})
    _check_parts(path, description, entries)
    digest = (sealed or b"")[:64].decode("ascii", "replace")
    return Export(path, description, dense, digest, dict(entries))


def newest_export(directory: Path) -> Path | None:
    """The export of the highest step in a directory of exports (a full one wins a tie)."""
    found = []
    for name in os.listdir(directory):
        match = _EXPORT_RE.fullmatch(name)
        if match and (directory / name / MANIFEST_NAME).is_file():
            found.append((int(match.group(2)), match.group(1) == "delta", name))
    return directory / sorted(found, key=lambda f: (f[0], -f[1]))[-1][2] if found else None


def _named(path_or_chain: str | Path | Sequence[str | Path]) -> list[Path] | Path:
    if isinstance(path_or_chain, str | os.PathLike):
        path = Path(path_or_chain)
        if path.is_dir() and not (path / MANIFEST_NAME).exists():
            newest = newest_export(path)
            if newest is None:
                raise NotFoundError(f"{str(path)!r} holds no serving export; pass an export "
                                    "directory (the --out of `towerflow export`).")
            return newest
        return path
    chain = [Path(p) for p in path_or_chain]
    if not chain:
        raise InvalidArgumentError("An empty chain of exports; pass a full export, then its "
                                   "deltas in order.")
    return chain


def _check_link(base: Export, delta: Export) -> None:
    want = delta.description["base"]
    if want["step"] != base.step or want["manifest_sha256"] != base.digest:
        raise InvalidArgumentError(
            f"Delta {str(delta.path)!r} was written on top of an export of step {want['step']} "
            f"({want['name']!r}) but follows {str(base.path)!r} of step {base.step}"
            f"{'' if want['step'] != base.step else ' written by another export'} in the chain; "
            "load the chain it was written on (a full export, then each delta in order).")


def resolve_chain(path_or_chain: str | Path | Sequence[str | Path]) -> list[Export]:
    """The verified chain: a full export, then deltas each on top of the one before.

    Args:
        path_or_chain: exports in order (full first); or one export (a delta's bases are
            found by the names it records, in its directory); or a directory of exports
            (its newest).

    Raises:
        InvalidArgumentError: the chain does not start with a full export, or a delta's
            base is not the export before it.
        NotFoundError / CheckpointError: as :func:`read_export`.
    """
    named = _named(path_or_chain)
    if isinstance(named, list):
        chain = [read_export(p) for p in named]
    else:
        chain = [read_export(named)]
        while chain[0].kind == "delta":
            base = chain[0].path.parent / chain[0].description["base"]["name"]
            if not base.is_dir():
                raise NotFoundError(
                    f"Delta {str(chain[0].path)!r} was written on top of {base.name!r}, which "
                    f"is not in {str(base.parent)!r}; pass the chain explicitly "
                    "(serving.load([full, delta, ...], model)).")
            chain.insert(0, read_export(base))
    if chain[0].kind != "full":
        raise InvalidArgumentError(f"The chain starts with delta {str(chain[0].path)!r}; put "
                                   "the full export it builds on first.")
    for base, delta in zip(chain, chain[1:], strict=False):
        if delta.kind != "delta":
            raise InvalidArgumentError(f"Export {str(delta.path)!r} is full but is not first "
                                       "in the chain; load it alone, or drop what is before it.")
        _check_link(base, delta)
    return chain


@dataclass(slots=True)
class TableState:
    """A table's rows at the end of a chain: ``weight`` (fixed) or ``keys`` + ``rows``."""

    description: dict[str, Any]
    weight: torch.Tensor | None = None
    keys: torch.Tensor | None = None
    rows: torch.Tensor | None = None


def _fixed(chain: list[Export], name: str, table: dict[str, Any]) -> TableState:
    dtype, num_rows = TABLE_DTYPES[table["dtype"]], table["num_rows"]
    weight = torch.empty((num_rows, table["dim"]), dtype=dtype)
    seen = torch.zeros(num_rows, dtype=torch.bool)
    for export in chain:
        for _, tensors in export.parts(name):
            if "removed" in tensors and tensors["removed"].numel():
                raise CheckpointError(f"Serving export {str(export.path)!r} removes ids of the "
                                      f"fixed table {name!r}, which has no eviction; "
                                      f"{_AGAIN}.")
            keys = tensors.get("keys")
            if keys is None or not keys.numel():
                continue
            if int(keys[0]) < 0 or int(keys[-1]) >= num_rows:
                raise CheckpointError(f"Serving export {str(export.path)!r} holds ids of table "
                                      f"{name!r} outside [0, {num_rows}); {_AGAIN}.")
            weight.index_copy_(0, keys, tensors["rows"])
            seen[keys] = True
        if export.kind == "full" and not bool(seen.all()):
            raise CheckpointError(
                f"Serving export {str(export.path)!r} holds {int(seen.sum())} of the "
                f"{num_rows} rows of table {name!r}: a part is missing; {_AGAIN}.")
    return TableState(table, weight=weight)


def _merge(keys: torch.Tensor, rows: torch.Tensor, new_keys: torch.Tensor,
           new_rows: torch.Tensor, removed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    keep = ~torch.isin(keys, torch.cat([new_keys, removed]))
    keys, rows = torch.cat([keys[keep], new_keys]), torch.cat([rows[keep], new_rows])
    order = torch.argsort(keys)
    return keys[order], rows[order]


def _dynamic(chain: list[Export], name: str, table: dict[str, Any]) -> TableState:
    dtype = TABLE_DTYPES[table["dtype"]]
    keys = torch.empty(0, dtype=torch.int64)
    rows = torch.empty((0, table["dim"]), dtype=dtype)
    for export in chain:
        parts = list(export.parts(name))
        new_keys = torch.cat([keys[:0], *(t["keys"] for _, t in parts if "keys" in t)])
        new_rows = torch.cat([rows[:0], *(t["rows"] for _, t in parts if "rows" in t)])
        removed = torch.cat([keys[:0], *(t["removed"] for _, t in parts if "removed" in t)])
        if export.kind == "full":
            keys, rows = keys[:0], rows[:0]
        keys, rows = _merge(keys, rows, new_keys, new_rows, removed)
        if keys.numel() > 1 and not bool((keys[1:] > keys[:-1]).all()):
            raise CheckpointError(f"Serving export {str(export.path)!r} holds an id of table "
                                  f"{name!r} twice; {_AGAIN}.")
    return TableState(table, keys=keys, rows=rows)


def table_state(chain: list[Export], name: str) -> TableState:
    """Table ``name`` at the end of ``chain`` (as the last export describes it).

    Raises:
        CheckpointError: a full export does not cover a fixed table, or a delta removes
            ids of a fixed table.
        InvalidArgumentError: the table changes kind, dim or dtype along the chain.
    """
    table = chain[-1].description["tables"][name]
    for export in chain:
        other = export.description["tables"].get(name)
        if other is None or any(other[k] != table[k] for k in ("kind", "num_rows", "dim",
                                                              "dtype")):
            raise InvalidArgumentError(
                f"Table {name!r} of {str(chain[-1].path)!r} is not the table of "
                f"{str(export.path)!r} in its chain; export a new full export.")
    return (_fixed if table["kind"] == "fixed" else _dynamic)(chain, name, table)



def export_chain_names(directory: Path) -> dict[str, list[str]]:
    """Each export of a directory of exports, by name, and its chain's names (oldest first).

    Read from the manifests only (no data file is hashed); an export whose manifest does
    not verify, or whose base is gone, has a chain of itself (from its base on).
    """
    from towerflow.checkpoint.manifest import read_manifest

    bases: dict[str, str | None] = {}
    for name in os.listdir(directory):
        if not _EXPORT_RE.fullmatch(name):
            continue
        try:
            description = check_description(directory / name, read_manifest(directory / name))
        except (DataLossError, NotFoundError):
            bases[name] = None
            continue
        base = description["base"]
        bases[name] = None if base is None else base["name"]
    chains: dict[str, list[str]] = {}
    for name in bases:
        chain = [name]
        while (base := bases.get(chain[0])) is not None and base in bases and base not in chain:
            chain.insert(0, base)
        chains[name] = chain
    return chains
