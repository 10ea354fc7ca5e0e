"""``towerflow server``: run one task's gRPC server until stopped (a ps only serves).

    towerflow server --cluster cluster.json --job ps --task 0
    TF_CONFIG='{"cluster": {...}, "task": {"type": "ps", "index": 0}}' towerflow server

A ps task hosts the parameter-server shard service (the services registered
for its job); any other task serves the built-in control service. A ps task
watches the chief and workers with heartbeats (every ``--heartbeat`` seconds,
``0`` to turn them off; the workers answer through their own ``Server``): a
dead or suspended worker is logged by name, and a sync step that misses its
gradient names it. SIGTERM or Ctrl-C stops the server.

A ps task ends by itself, with status 0, once every training replica has
finished (the chief after its final checkpoint); ``--serve-forever`` keeps it
serving until stopped. When every replica that has not finished is dead or
suspended, it keeps the parameters for their return for ``--idle-timeout``
seconds (default one hour), then exits with status 2 naming them. A chief that
fails before it initialised the job ends it too: the ps task tells the waiting
workers the chief's error, then exits non-zero with it. Every task
answers the standard gRPC health check (``grpc.health.v1``) without
credentials, for Kubernetes probes.

The server listens on the address its cluster spec names (``--bind 0.0.0.0``,
or ``TOWERFLOW_BIND=0.0.0.0``, to listen on every interface), refuses a non-loopback address without a
cluster secret and TLS unless ``--insecure``, and refuses a stream past
``--max-streams`` in all or ``--max-streams-per-peer`` on one connection.

The task runs its share of this host's cores in PyTorch threads: the cores
over the tasks of its cluster spec on this host, unless ``OMP_NUM_THREADS`` is
set (:mod:`towerflow.cluster.threads`).
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from towerflow.cli._serving import (
    BIND_ENV,
    add_lifecycle_arguments,
    bind_host,
    idle_timeout_from_args,
)

if TYPE_CHECKING:
    from towerflow.cluster.heartbeat import HeartbeatOptions
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
        help="allow serving a non-loopback address without a secret or without TLS (plaintext; "
        "logs a warning)",
    )
    parser.add_argument(
        "--bind",
        metavar="HOST",
        help="listen on HOST (e.g. 0.0.0.0 for every interface) with the spec's port, instead "
        f"of the address the cluster spec names (default: ${BIND_ENV}, else that address)",
    )
    parser.add_argument(
        "--max-streams",
        type=int,
        default=None,
        metavar="N",
        help="most streaming calls open at once; one past it is refused (default: 3/4 of the "
        "256 handler threads, 192)",
    )
    parser.add_argument(
        "--max-streams-per-peer",
        type=int,
        default=32,
        metavar="N",
        help="most streaming calls open at once on one connection (default 32)",
    )
    parser.add_argument(
        "--heartbeat",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="ps: ping the chief and workers every SECONDS and name a dead or suspended one "
        "(default 1; 0 turns heartbeats off)",
    )
    add_lifecycle_arguments(parser)
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


def heartbeat_from_args(args: argparse.Namespace) -> HeartbeatOptions | None:
    """``--heartbeat SECONDS`` as heartbeat options (None for 0)."""
    from towerflow.cluster.heartbeat import HeartbeatOptions
    from towerflow.errors import InvalidArgumentError

    if args.heartbeat < 0:
        raise InvalidArgumentError(
            f"--heartbeat {args.heartbeat:g} is negative; give seconds between beats, or 0 to "
            "turn heartbeats off."
        )
    return HeartbeatOptions(interval=args.heartbeat) if args.heartbeat > 0 else None


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM / SIGINT, or a ps task until its job ends; the exit status.

    Raises:
        UnavailableError: a ps task's workers stayed away past ``--idle-timeout``.
    """
    from towerflow.cluster import Server, ServerOptions, resolve_cluster
    from towerflow.cluster.server import stop_on_signals_from_now
    from towerflow.cluster.threads import apply_thread_share
    from towerflow.errors import InvalidArgumentError

    cluster, task = resolve_cluster(args.cluster, args.job, args.task)
    if cluster is None or task is None:
        raise InvalidArgumentError(
            "no cluster and task given; pass --cluster cluster.json --job ps --task 0 or set "
            "TF_CONFIG."
        )
    apply_thread_share("towerflow server", cluster, task)
    options = ServerOptions(heartbeat=heartbeat_from_args(args), bind_host=bind_host(args),
                            max_streams=args.max_streams,
                            max_streams_per_peer=args.max_streams_per_peer,
                            serve_forever=args.serve_forever,
                            idle_timeout=idle_timeout_from_args(args))
    with stop_on_signals_from_now() as bind:  # SIGTERM / Ctrl-C end it, from the start
        server = Server(cluster, task.job_name, task.task_index,
                        credentials=credentials_from_args(args), options=options)
        bind(server)
        if not any(getattr(s, "announces_serving", False) for s in server.services):
            print(f"serving {task.device_name} at {server.target}", flush=True)
        try:
            server.join(handle_signals=False)
        finally:
            server.stop(grace=1.0)
    return 0
