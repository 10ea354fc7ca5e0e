"""``towerflow server``: run one task's gRPC server until stopped (a ps only serves).

    towerflow server --cluster cluster.json --job ps --task 0
    TF_CONFIG='{"cluster": {...}, "task": {"type": "ps", "index": 0}}' towerflow server

A ps task hosts the parameter-server shard service; any other task serves the
built-in control service. SIGTERM or Ctrl-C stops the server.
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from towerflow.cluster.transport import Credentials


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``towerflow server``."""
    parser = subparsers.add_parser(
        "server",
        help="run one task of a cluster (a ps task serves parameters and computes nothing)",
        description="Run the gRPC server of one task. The cluster and the task come from "
        "--cluster/--job/--task, else from TF_CONFIG, torchrun or Slurm variables.",
    )
    parser.add_argument("--cluster", help="cluster JSON file ({job: [host:port, ...]})")
    parser.add_argument("--job", help="this task's job, e.g. ps")
    parser.add_argument("--task", type=int, default=None, help="this task's index (default 0)")
    parser.add_argument(
        "--secret-file", help="cluster secret file (default: TOWERFLOW_SECRET(_FILE))"
    )
    parser.add_argument("--tls-cert", help="PEM certificate of this task")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    parser.add_argument("--tls-ca", help="PEM CA bundle; on a server it requires client certs")
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="allow serving a non-loopback address without secret or mutual TLS (logs a warning)",
    )
    return parser


def credentials_from_args(args: argparse.Namespace) -> Credentials:
    """Credentials from the environment, overridden by the command-line options."""
    from towerflow.cluster.transport import Credentials, TLSConfig, read_secret_file

    creds = Credentials.from_env()
    if args.secret_file:
        creds = replace(creds, secret=read_secret_file(args.secret_file))
    if args.tls_cert or args.tls_key or args.tls_ca:
        base = creds.tls or TLSConfig()
        creds = replace(
            creds,
            tls=replace(
                base,
                cert=Path(args.tls_cert) if args.tls_cert else base.cert,
                key=Path(args.tls_key) if args.tls_key else base.key,
                ca=Path(args.tls_ca) if args.tls_ca else base.ca,
            ),
        )
    return replace(creds, insecure=bool(args.insecure))


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM / SIGINT; a ps task runs the parameter-server shard service."""
    from towerflow.cluster import Server, resolve_cluster
    from towerflow.cluster.server import stop_on_signals
    from towerflow.errors import InvalidArgumentError

    cluster, task = resolve_cluster(args.cluster, args.job, args.task)
    if cluster is None or task is None:
        raise InvalidArgumentError(
            "no cluster and task given; pass --cluster cluster.json --job ps --task 0 or set "
            "TF_CONFIG."
        )
    credentials = credentials_from_args(args)
    if task.job_name == "ps":
        run_ps_task = getattr(importlib.import_module("towerflow.ps"), "run_ps_task", None)
        if run_ps_task is not None:
            return int(run_ps_task(cluster, task, credentials) or 0)
    server = Server(cluster, task.job_name, task.task_index, credentials=credentials)
    print(f"serving {task.device_name} at {server.target}", flush=True)
    with stop_on_signals(server):
        server.join()
    return 0
