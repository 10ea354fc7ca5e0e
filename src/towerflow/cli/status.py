"""``towerflow status``: a live view of a running cluster.

    towerflow status --cluster cluster.json          # refreshed every second until Ctrl-C
    towerflow status --once --json                   # one snapshot as JSON (cluster from TF_CONFIG)
    towerflow status --train-dir runs/digits-ps      # a local run of launch / train --ps

Shows every task and whether it is up, dead or suspended; per ps shard its
parameter bytes, pushes/s, bytes/s, stale and refused pushes, global step and
bounded-staleness lead; per worker its steps/s, how far behind the global
step its last push was, and its last heartbeat (as the ps sees it); then the
elastic workers that joined the job (``towerflow train --join``), ``joined``
or ``left``. It calls
the tasks as any cluster peer does, with the cluster secret
(``TOWERFLOW_SECRET_FILE`` / ``TOWERFLOW_SECRET`` or ``--secret-file``) and
TLS settings of the environment. A run of ``towerflow launch --train-dir D``
or ``towerflow train --ps`` keeps its address book and, while it runs, its
secret in its train dir: ``--train-dir D`` reads both.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from typing import Any


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``towerflow status``."""
    parser = subparsers.add_parser(
        "status",
        help="show a running cluster live: tasks up/dead/suspended, ps traffic, worker progress",
        description="Show a running cluster, refreshed live. The cluster comes from --cluster, "
        "else from TF_CONFIG, torchrun or Slurm variables.",
    )
    parser.add_argument("--cluster", help="cluster JSON file ({job: [host:port, ...]})")
    parser.add_argument("--train-dir", metavar="DIR",
                        help="the train dir of a local run (towerflow launch --train-dir, "
                        "towerflow train --ps): its cluster and secret")
    parser.add_argument("--secret-file", help="cluster secret file (default: "
                        "TOWERFLOW_SECRET(_FILE))")
    parser.add_argument("--once", action="store_true", help="print one snapshot and exit")
    parser.add_argument("--json", action="store_true", help="print snapshots as JSON (one a line)")
    parser.add_argument("--interval", type=float, default=1.0, metavar="SECONDS",
                        help="seconds between two refreshes; also the sample a single "
                        "snapshot's rates are measured over (default 1)")
    parser.add_argument("--timeout", type=float, default=2.0, metavar="SECONDS",
                        help="deadline of each call; a task that does not answer within it is "
                        "shown suspended (default 2)")
    return parser


def run(args: argparse.Namespace) -> int:
    """Show the cluster until Ctrl-C (or once); returns 0."""

    from towerflow.errors import InvalidArgumentError
    from towerflow.ps.worker.observe import ClusterObserver

    if not args.interval > 0:
        raise InvalidArgumentError(
            f"--interval {args.interval:g} is not a positive number of seconds; give how often "
            "the view is refreshed, e.g. --interval 1.")
    cluster, credentials = cluster_from_args(args.cluster, args.train_dir, args.secret_file)
    with ClusterObserver(cluster, credentials, timeout=args.timeout) as observer:
        if args.once:
            _print(observer.snapshot(sample=args.interval), args.json)
            return 0
        if args.json:
            while True:
                _print(observer.snapshot(sample=args.interval), True)
                time.sleep(args.interval)
        _live(observer, args.interval)
    return 0


def cluster_from_args(cluster_file: str | None, train_dir: str | None,
                      secret_file: str | None) -> tuple[Any, Any]:
    """``(ClusterSpec, Credentials)`` of a running cluster, for a process outside it.

    The cluster of ``--cluster``, else a local run's address book in its train dir
    (with the run's secret), else the environment (``TF_CONFIG``, torchrun,
    Slurm); the secret of ``--secret-file`` overrides.

    Raises:
        InvalidArgumentError: both or none given, or an unreadable cluster file.
    """
    from dataclasses import replace

    from towerflow.cluster import resolve_cluster
    from towerflow.cluster.transport import Credentials, read_secret_file
    from towerflow.errors import InvalidArgumentError

    credentials = Credentials.from_env()
    if train_dir and cluster_file:
        raise InvalidArgumentError(
            f"--train-dir {train_dir} and --cluster {cluster_file} both name the cluster; "
            "give one.")
    if train_dir:
        from towerflow.cluster.address_book import read_address_book

        cluster, secret = read_address_book(train_dir)
        credentials = replace(credentials, secret=secret)
    elif cluster_file:
        cluster = _cluster_file(cluster_file)
    else:
        cluster, _ = resolve_cluster(None, None, None)
    if cluster is None:
        raise InvalidArgumentError(
            "no cluster given; pass --cluster cluster.json, --train-dir DIR of a local run, "
            "or set TF_CONFIG.")
    if secret_file:
        credentials = replace(credentials, secret=read_secret_file(secret_file))
    return cluster, credentials


def _cluster_file(name: str) -> Any:
    """The cluster of a ``--cluster`` JSON file; any task of it may be "this" one."""
    from pathlib import Path

    from towerflow.cluster import ClusterSpec
    from towerflow.errors import InvalidArgumentError

    try:
        return ClusterSpec(json.loads(Path(name).read_text()))
    except (OSError, ValueError) as exc:
        raise InvalidArgumentError(
            f"--cluster {name}: cannot read a cluster JSON file ({exc}); give a file "
            'like {"ps": ["host:2222"], "worker": ["host:2223"]}.') from None


def _print(snapshot: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(snapshot), flush=True)
    else:
        from rich.console import Console

        Console().print(render(snapshot))


def _live(observer: Any, interval: float) -> None:
    from rich.live import Live

    with Live(render(observer.snapshot(sample=interval)), auto_refresh=False) as live:
        while True:
            time.sleep(interval)
            live.update(render(observer.snapshot()), refresh=True)


def _num(value: Any, unit: str = "", digits: int = 1) -> str:
    if value is None:
        return "-"
    if unit == "B":
        for scale, prefix in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
            if abs(value) >= scale:
                return f"{value / scale:.{digits}f} {prefix}"
        return f"{value:.0f} B"
    return f"{value:.{digits}f}{unit}" if isinstance(value, float) else f"{value}{unit}"


_STATE_STYLE = {"up": "green", "dead": "bold red", "suspended": "bold yellow",
                "joined": "cyan", "left": "dim"}


def render(snapshot: dict[str, Any]) -> Any:
    """The snapshot as ``rich`` tables (tasks, ps shards, workers; sparse tables, and who
    serves each shard when shards have replicas).

    What peers said (names, details, errors) is shown as plain text, never read as markup.
    """
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table

    tasks = Table(title="tasks", title_justify="left")
    for column in ("task", "address", "state", "pid", "detail"):
        tasks.add_column(column)
    for task in snapshot["tasks"]:
        style = _STATE_STYLE.get(task["state"], "red")
        tasks.add_row(task["task"], task["address"], f"[{style}]{task['state']}[/]",
                      _num(task["pid"]), escape(str(task["detail"])))
    shards = Table(title="ps shards", title_justify="left")
    for column in ("shard", "params", "step", "push/s", "bytes/s", "stale", "refused",
                   "lead/max", "mode"):
        shards.add_column(column, justify="right", min_width=len(column))
    for shard in snapshot["ps"]:
        if shard.get("error") or not shard.get("initialized", False):
            shards.add_row(str(shard["shard"]), escape(shard.get("error") or "not initialised"),
                           *["-"] * 7)
            continue
        shards.add_row(str(shard["shard"]), _num(shard["param_bytes"], "B"),
                       _num(shard["global_step"]), _num(shard["pushes_per_sec"]),
                       _num(shard["bytes_per_sec"], "B") + ("/s" if shard["bytes_per_sec"]
                                                            is not None else ""),
                       _num(shard["stale"]), _num(shard["refused"]),
                       f"{shard['lead']}/{shard['max_lead']}", escape(str(shard["mode"])))
    workers = Table(title="workers", title_justify="left")
    for column in ("replica", "task", "state", "steps", "steps/s", "behind", "last push",
                   "heartbeat"):
        workers.add_column(column, min_width=len(column))
    for worker in snapshot["workers"]:
        state = worker.get("state") or "-"
        style = _STATE_STYLE.get(state, "red")
        beat = escape(worker.get("heartbeat") or "-")
        if worker.get("last_heartbeat_age") is not None:
            beat += f", {_ago(worker['last_heartbeat_age'])}"
        workers.add_row(str(worker["replica"]), escape(_short(worker["task"])),
                        f"[{style}]{escape(state)}[/]",
                        _num(worker.get("steps")), _num(worker.get("steps_per_sec")),
                        _num(worker.get("behind")), _ago(worker.get("last_push_age")), beat)
    stamp = time.strftime("%H:%M:%S", time.localtime(snapshot["time"]))
    parts = [f"[bold]towerflow status[/] at {stamp}", tasks, shards, workers]
    if snapshot.get("tables"):
        parts.append(_tables(snapshot["tables"]))
    if any(s.get("copies") or s.get("role", "primary") != "primary" for s in snapshot["ps"]):
        parts.append(_copies(snapshot["ps"]))
    return Group(*parts)


def _copies(shards: list[dict[str, Any]]) -> Any:
    """Who serves each shard (replicas=1): each ps task's own shard and the copies it holds,
    with their role (primary, replica, deposed) and term; a promoted copy shows the switch."""
    from rich.table import Table

    table = Table(title="shard replicas", title_justify="left")
    for column in ("shard", "ps task", "role", "term", "step", "its copy"):
        table.add_column(column, justify="right")
    for view in shards:
        if view.get("error") or not view.get("initialized", False):
            continue
        table.add_row(str(view["shard"]), str(view["shard"]), str(view.get("role") or "-"),
                      _num(view.get("term")), _num(view.get("global_step")), _copy_of(view))
        for copy in view.get("copies", ()):
            table.add_row(str(copy["shard"]), str(view["shard"]), str(copy["role"]),
                          _num(copy["term"]), _num(copy["step"]), _copy_of(copy))
    return table


def _copy_of(held: dict[str, Any]) -> str:
    """Whether a shard served here has its live copy ("-": not served here)."""
    if held.get("role") != "primary":
        return "-"
    return "none: alone until its task rejoins" if held.get("alone") else "live"


def _tables(rows: list[dict[str, Any]]) -> Any:
    """Sparse tables per shard: rows held and bytes; a dynamic table's admitted, evicted and
    filtered counts."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="sparse tables", title_justify="left")
    for column in ("table", "shard", "kind", "rows", "bytes", "pushes", "admitted", "evicted",
                   "filtered"):
        table.add_column(column, justify="left" if column in ("table", "kind") else "right")
    for row in rows:
        dynamic = row["kind"] == "dynamic"
        table.add_row(escape(str(row["name"])), str(row["shard"]), escape(str(row["kind"])),
                      _num(row["rows"]), _num(row["nbytes"], "B"), _num(row["applied"]),
                      *(_num(row[k]) if dynamic else "-"
                        for k in ("admitted", "evicted", "filtered")))
    return table


def _short(task: str) -> str:
    """``/job:worker/replica:0/task:1`` as ``worker:1`` (other names as they are)."""
    found = re.fullmatch(r"/job:([^/]+)/replica:\d+/task:(\d+)", task or "")
    return f"{found.group(1)}:{found.group(2)}" if found else task


def _ago(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f} s ago"
