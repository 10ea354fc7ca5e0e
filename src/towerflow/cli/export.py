"""``towerflow export``: a training run's newest checkpoint as a serving export.

::

    towerflow export --train-dir runs/click --out exports/full-1            # a full export
    towerflow export --train-dir runs/click --out exports/delta-2 --since exports/full-1
    towerflow export --train-dir runs/click --out exports/full-1 --with-optimizer
    towerflow export --train-dir runs/click --out exports/live-1 --live             # a local run now
    towerflow export --train-dir /shared/run --out exports/live-1 --cluster cluster.json  # any job now

Writes the dense parameters and every table's keys (int64, sorted) and rows as
safetensors, with a manifest of the step, the tables, their dims, dtypes and partition,
and the SHA-256 of every file; ``--out`` appears complete or not at all. With
``--since`` only the rows that changed (and the ids removed) since that export, and the
dense parameters: load the chain with ``towerflow.serving.load(delta, model)``. Prints
one line: the step, what was written and its size.

With ``--cluster`` (a cluster JSON file, the secret from ``--secret-file`` or
``TOWERFLOW_SECRET(_FILE)``) or ``--live`` (the local run writing to ``--train-dir``:
its address book and secret), the export is of what the job's ps tasks hold now, read
while it trains: the dense parameters pulled from each ps task, every table streamed out
of its shards part by part (never gathered in this process). The train dir's newest
checkpoint still says what the tables are and gives the model's buffers.
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
    live = parser.add_mutually_exclusive_group()
    live.add_argument("--cluster", default=None, metavar="FILE",
                      help="export what the ps tasks of this running cluster (a JSON file "
                      "{job: [host:port, ...]}) hold now, not the checkpoint")
    live.add_argument("--live", action="store_true",
                      help="export what the ps tasks of the local run writing to --train-dir "
                      "(towerflow launch / train --ps) hold now")
    parser.add_argument("--secret-file", default=None,
                        help="with --cluster: the cluster secret file (default: "
                        "TOWERFLOW_SECRET(_FILE))")
    return parser


def _bytes(path: Path) -> int:
    return sum(entry.stat().st_size for entry in os.scandir(path) if entry.is_file())


def run(args: argparse.Namespace) -> int:
    """Write the export; print one line saying what it holds."""
    from towerflow.serving import export
    from towerflow.serving.chain import read_export

    start = time.perf_counter()
    if args.cluster or args.live:
        path = _live_export(args)
    else:
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


def _live_export(args: argparse.Namespace) -> Path:
    """The export of what the cluster's ps tasks hold now (``--cluster`` / ``--live``)."""
    from towerflow.checkpoint import read_checkpoint
    from towerflow.cli.status import cluster_from_args
    from towerflow.errors import InvalidArgumentError, NotFoundError
    from towerflow.ps.worker.live import live_state
    from towerflow.serving import export_source, source_from_state

    if args.live and args.secret_file:
        raise InvalidArgumentError("--live reads the run's own secret from --train-dir; leave "
                                   "out --secret-file (or name the cluster with --cluster).")
    cluster, credentials = cluster_from_args(args.cluster, None if args.cluster else
                                             args.train_dir, args.secret_file)
    try:
        ckpt = read_checkpoint(args.train_dir)
    except NotFoundError as exc:
        raise NotFoundError(
            f"No checkpoint in {args.train_dir!r}: a live export takes the tables' "
            "descriptions and the model's buffers from the job's newest checkpoint; wait for "
            "its first checkpoint (or point --train-dir at the job's train dir).") from exc
    strategy = ckpt.metadata.get("strategy", {})
    with live_state(cluster, credentials, strategy if isinstance(strategy, dict) else {}) \
            as (groups, metadata):
        groups["model"] = {**ckpt.groups.get("model", {}), **groups["model"]}
        hybrid = isinstance(strategy, dict) and strategy.get("dense") == "allreduce"
        if hybrid:  # the dense layers live on the workers: the checkpoint's are the newest here
            metadata["step"] = ckpt.step
            print(f"a hybrid job keeps its dense layers on its workers: this export holds those "
                  f"of its newest checkpoint (step {ckpt.step}) and the tables as its ps tasks "
                  "hold them now")
        source = source_from_state(groups, metadata)
        source.origin = (f"the dense layers of {ckpt.path} (step {ckpt.step}: a hybrid job keeps "
                         "them on its workers) and the tables its ps tasks hold now" if hybrid
                         else f"the cluster's ps tasks at step {source.step}")
        return export_source(source, args.out, since=args.since,
                             with_optimizer=args.with_optimizer)
