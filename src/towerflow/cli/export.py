"""``towerflow export``: a training run's newest checkpoint as a serving export.

::

    towerflow export --train-dir runs/click --out exports/full-1            # a full export
    towerflow export --train-dir runs/click --out exports/delta-2 --since exports/full-1
    towerflow export --train-dir runs/click --out exports/full-1 --with-optimizer

Writes the dense parameters and every table's keys (int64, sorted) and rows as
safetensors, with a manifest of the step, the tables, their dims, dtypes and partition,
and the SHA-256 of every file; ``--out`` appears complete or not at all. With
``--since`` only the rows that changed (and the ids removed) since that export, and the
dense parameters: load the chain with ``towerflow.serving.load(delta, model)``. Prints
one line: the step, what was written and its size.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``towerflow export``."""
    parser = subparsers.add_parser(
        "export", help="write a serving export (dense parameters and tables) of a checkpoint",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train-dir", "--train_dir", required=True, metavar="DIR",
                        help="the train dir (its newest checkpoint that verifies) or one "
                        "checkpoint directory")
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="the export's directory; it must not exist")
    parser.add_argument("--since", default=None, metavar="EXPORT",
                        help="write a delta on top of this earlier export (full or delta)")
    parser.add_argument("--with-optimizer", action="store_true",
                        help="keep the tables' optimizer slots and the optimizer's state "
                        "(full exports only)")
    return parser


def _bytes(path: Path) -> int:
    return sum(entry.stat().st_size for entry in os.scandir(path) if entry.is_file())


def run(args: argparse.Namespace) -> int:
    """Write the export; print one line saying what it holds."""
    from towerflow.serving import export
    from towerflow.serving.chain import read_export

    start = time.perf_counter()
    path = export(args.train_dir, args.out, since=args.since,
                  with_optimizer=args.with_optimizer)
    seconds = time.perf_counter() - start
    description = read_export(path).description
    tables = description["tables"]
    rows = sum(t["rows"] for t in tables.values())
    removed = sum(t["removed"] for t in tables.values())
    gone = f", {removed:,} removed" if removed else ""
    print(f"exported step {description['step']} ({description['kind']}: {rows:,} rows of "
          f"{len(tables)} table(s){gone}) to {path} ({_bytes(path):,} bytes, {seconds:.2f} s)",
          flush=True)
    return 0
