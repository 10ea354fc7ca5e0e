"""A worker's memory with sparse tables on the ps: unchanged by the table's size, below the table's.

Workload: ``towerflow.models.click.ClickNet`` (an unchanged ``nn.EmbeddingBag``
of ``--dim`` values per row, built on the meta device, with a linear and an
MLP head) under the ``ParameterServer`` strategy with ``sparse_threshold_bytes``
1 MiB, which swaps the table for one row-sharded over 2 ps tasks; batches of
512 examples with 16 Zipf(1.2) ids each (``sparse_embedding.py``'s), Adagrad,
async, one worker. Figures:

(a) the worker's peak resident memory (its own ``VmHWM``) with a
    ``--small-rows`` table and with a ``--large-rows`` table (10x), same
    batches: the ratio (target: unchanged within 10%);
(b) the worker under a cap on its resident memory smaller than its table
    (``--capped-rows`` rows, ``--cap`` bytes of RSS) trains ``--steps`` steps;
    the same worker with the table in its own memory (``--in-process-table``:
    the model built as it is, not swapped) goes over the cap and is stopped,
    which shows the cap bites.

The cap is on resident memory (RSS), not on address space, so it holds
whatever a torch build maps: a CUDA build's shared objects carry large private
writable segments (address space, not memory used) that ``RLIMIT_DATA`` counts,
so under an ``RLIMIT_DATA`` cap such a worker cannot even ``import torch``
("failed to map segment from shared object"); ``RLIMIT_AS`` (``prlimit --as``)
is worse still. Linux does not enforce ``RLIMIT_RSS`` (it is accepted and
ignored), and the kernel's own RSS cap, a cgroup's ``memory.max``, needs a
writable, delegated cgroup v2 subtree with the memory controller, which a test
run cannot count on (no systemd user bus to delegate one; a machine where the
memory controller is on cgroup v1, or not delegated to it). So the cap
is watched: ``run_under_rss_cap`` starts the worker from a small stdlib-only
launcher (``RSS_CAP_CODE``) that reads the worker's ``VmRSS`` every
``POLL_S`` (20 ms), kills it with SIGKILL and says why when it goes over the
cap, and reaps it with ``os.wait4``, whose ``ru_maxrss`` is the worker's peak
RSS. The launcher is the worker's parent, not this process, because a child's
``ru_maxrss`` starts from its parent's peak RSS at the fork (the kernel carries
the parent's high-water mark over ``exec``): this process has torch in it,
the launcher about 10 MiB. A peak above the cap that fell between two looks
counts as over the cap too.

Commands::

    python benchmarks/sparse_worker_memory.py
    python benchmarks/sparse_worker_memory.py --small-rows 100000 --large-rows 1000000 \\
        --capped-rows 2000000 --cap 560MiB --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from towerflow.cluster.launcher import free_ports
from towerflow.testing.processes import stop_processes

DIM = 32
#: tables of this many bytes or more are sharded on the ps tasks
THRESHOLD = 1 << 20


#: how often the launcher looks at the capped process's RSS
POLL_S = 0.02

#: the launcher ``run_under_rss_cap`` runs: ``python -c RSS_CAP_CODE SETTINGS COMMAND...``;
#: stdlib only, so that its own peak RSS (which its child's ``ru_maxrss`` starts from) is small
RSS_CAP_CODE = r"""
import json, os, select, signal, sys, time
settings, command = json.loads(sys.argv[1]), sys.argv[2:]
cap, poll = settings["cap"], settings["poll"]
deadline = time.monotonic() + settings["timeout"]
pid = os.posix_spawnp(command[0], command, os.environ)
exited = os.pidfd_open(pid)  # readable once the process has ended
stopped, over_cap = None, False
while stopped is None and not select.select([exited], [], [], poll)[0]:
    try:
        with open(f"/proc/{pid}/status") as status:
            rss = next((int(line.split()[1]) * 1024 for line in status
                        if line.startswith("VmRSS:")), 0)  # none once it has exited
    except OSError:
        rss = 0
    if rss > cap:
        over_cap, stopped = True, (f"stopped: its resident memory (RSS) {rss / 2**20:,.0f} "
                                   f"MiB went over the cap of {cap / 2**20:,.0f} MiB")
    elif time.monotonic() > deadline:
        stopped = f"stopped: still running after {settings['timeout']:g} s"
if stopped is not None:
    os.kill(pid, signal.SIGKILL)  # not reaped yet: still this process's child
_, status, usage = os.wait4(pid, 0)
with open(settings["report"], "w") as report:
    json.dump({"status": status, "peak_rss": usage.ru_maxrss * 1024, "stopped": stopped,
               "over_cap": over_cap}, report)
"""


def run_under_rss_cap(command: list[str], cap: int, *, timeout: float,
                      env: dict[str, str] | None = None, poll: float = POLL_S) -> dict:
    """Run ``command`` with its resident memory capped at ``cap`` bytes; what became of it.

    The cap is watched (see the module's docstring): a launcher reads the
    process's ``VmRSS`` every ``poll`` s and SIGKILLs it when it is over ``cap``
    or still running after ``timeout`` s. The result has ``returncode`` (``-9``
    when it was stopped), ``stdout``, ``stderr``, ``peak_rss`` (bytes, its
    ``ru_maxrss``), ``stopped`` (``None``, or why it was killed) and
    ``over_cap`` (``None``, or a message naming the cap: it was stopped for
    going over it, or its peak went over it between two looks). Only
    ``command``'s own process is watched, not processes it starts.
    """
    with tempfile.TemporaryDirectory() as scratch:
        report_path = Path(scratch) / "report.json"
        settings = {"cap": cap, "poll": poll, "timeout": timeout, "report": str(report_path)}
        launcher = subprocess.Popen([sys.executable, "-c", RSS_CAP_CODE, json.dumps(settings),
                                     *command], env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    start_new_session=True)
        try:
            stdout, stderr = launcher.communicate(timeout=timeout + 60)
        except BaseException:  # the launcher is stuck or this process is interrupted
            os.killpg(launcher.pid, signal.SIGKILL)  # the launcher and the capped process
            launcher.communicate()
            raise
        if launcher.returncode != 0 or not report_path.exists():
            raise RuntimeError(f"the RSS-cap launcher failed ({launcher.returncode}):\n"
                               f"{stderr[-2000:]}")
        report = json.loads(report_path.read_text())
    over_cap = report["stopped"] if report["over_cap"] else None
    if over_cap is None and report["peak_rss"] > cap:
        over_cap = (f"over the cap: its peak resident memory (RSS) "
                    f"{report['peak_rss'] / 2**20:,.0f} MiB went over the cap of "
                    f"{cap / 2**20:,.0f} MiB between two looks")
    return {"returncode": os.waitstatus_to_exitcode(report["status"]), "stdout": stdout,
            "stderr": stderr, "peak_rss": report["peak_rss"], "stopped": report["stopped"],
            "over_cap": over_cap}


def _status(field: str) -> int:
    """A ``/proc/self/status`` figure in bytes (``VmHWM``: this process's own peak RSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def worker(args: argparse.Namespace) -> None:
    """One worker: the click model, ``--steps`` steps, a JSON report of its memory."""
    from sparse_embedding import labels_of, zipf_batches  # the same directory

    from towerflow.cluster import ClusterSpec, TaskInfo
    from towerflow.models.click import ClickNet
    from towerflow.strategies import OptimizerConfig
    from towerflow.strategies.parameter_server import ParameterServer

    torch.set_num_threads(1)
    model = ClickNet(args.rows, args.dim,
                     table_device=None if args.in_process_table else "meta")
    strategy = ParameterServer(ClusterSpec(json.loads(args.cluster)), TaskInfo("worker", 0),
                               device="cpu", server=False,
                               sparse_threshold_bytes=None if args.in_process_table else THRESHOLD)
    strategy.prepare(model, OptimizerConfig("adagrad", lr=0.1))

    def loss_fn(m: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(m(ids), labels_of(ids))

    batches = zipf_batches(args.rows, 20, seed=1)
    losses, step, start = [], 0, time.perf_counter()
    for i in range(args.steps):
        result = strategy.run_step(loss_fn, batches[i % len(batches)])
        losses.append(float(result.loss))
        step = result.global_step
    elapsed = time.perf_counter() - start
    strategy.shutdown()
    largest = max((p.numel() * p.element_size() for p in model.parameters()), default=0)
    report = {"rows": args.rows, "steps": len(losses), "global_step": step,
              "first_loss": losses[0], "last_loss": losses[-1],
              "examples_per_s": len(losses) * 512 / elapsed, "peak_rss": _status("VmHWM"),
              "data_bytes": _status("VmData"), "largest_parameter_bytes": largest}
    Path(args.report).write_text(json.dumps(report))


def run_cluster(rows: int, dim: int, steps: int, *, cap: int | None = None,
                in_process_table: bool = False, timeout: float = 600.0) -> dict:
    """2 ps tasks and one worker (its RSS capped at ``cap`` bytes); the worker's report.

    The report has ``returncode`` and, when the worker failed, the tail of its
    ``stderr``; under a cap also ``stopped`` and ``over_cap`` (``None``, or why
    the worker was stopped / found over the cap: ``run_under_rss_cap``'s) and
    ``capped_peak_rss`` (its peak RSS as its launcher measured it).
    """
    from sparse_embedding import PS_CODE  # the same directory

    ports = [f"127.0.0.1:{port}" for port in free_ports(3)]
    spec = {"ps": ports[:2], "worker": ports[2:]}
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "TOWERFLOW_SECRET": os.environ.get("TOWERFLOW_SECRET", "bench-secret")}
    ps = [subprocess.Popen([sys.executable, "-c", PS_CODE, json.dumps(spec), str(i)], env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
          for i in range(2)]
    report_path = Path(tempfile.mkdtemp()) / "worker.json"
    command = [sys.executable, __file__, "--role", "worker", "--cluster", json.dumps(spec),
               "--rows", str(rows), "--dim", str(dim), "--steps", str(steps),
               "--report", str(report_path), *(["--in-process-table"] if in_process_table else [])]
    try:
        if cap is None:
            proc = subprocess.run(command, env=env, capture_output=True, text=True,
                                  timeout=timeout)
            result = {"returncode": proc.returncode, "stderr": proc.stderr}
        else:
            capped = run_under_rss_cap(command, cap, env=env, timeout=timeout)
            result = {"returncode": capped["returncode"], "stderr": capped["stderr"],
                      "stopped": capped["stopped"], "over_cap": capped["over_cap"],
                      "capped_peak_rss": capped["peak_rss"]}
    finally:
        stop_processes(ps, grace=30)
    if (result["returncode"] != 0 or result.get("stopped") or result.get("over_cap")
            or not report_path.exists()):
        return {**result, "stderr": result["stderr"][-2000:]}
    return {**result, **json.loads(report_path.read_text())}


def byte_count(text: str) -> int:
    from towerflow.cli.train import byte_count as parse

    return parse(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small-rows", type=int, default=1_000_000)
    parser.add_argument("--large-rows", type=int, default=10_000_000)
    parser.add_argument("--capped-rows", type=int, default=6_000_000)
    parser.add_argument("--cap", type=byte_count, default=512 << 20,
                        help="the capped worker's cap on its resident memory, RSS "
                             "(default 512MiB)")
    parser.add_argument("--dim", type=int, default=DIM)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--only", choices=("growth", "cap"), default=None)
    parser.add_argument("--role", default="main")
    parser.add_argument("--cluster")
    parser.add_argument("--rows", type=int)
    parser.add_argument("--report")
    parser.add_argument("--in-process-table", action="store_true")
    args = parser.parse_args()
    if args.role == "worker":
        worker(args)
        return
    print(f"2 ps + 1 worker, {args.dim} float32 values per row, batch 512 x 16 Zipf(1.2) ids, "
          f"Adagrad, async, {args.steps} steps", flush=True)
    if args.only in (None, "growth"):
        growth(args)
    if args.only in (None, "cap"):
        capped(args)


def _check(report: dict, what: str) -> dict:
    why = report.get("over_cap") or report.get("stopped")
    if why:
        raise SystemExit(f"{what} was {why}:\n{report['stderr']}")
    if report["returncode"] != 0:
        raise SystemExit(f"{what} failed ({report['returncode']}):\n{report['stderr']}")
    return report


def growth(args: argparse.Namespace) -> None:
    """(a): the worker's peak RSS with a table 10x larger."""
    small = _check(run_cluster(args.small_rows, args.dim, args.steps), "the small table's worker")
    large = _check(run_cluster(args.large_rows, args.dim, args.steps), "the large table's worker")
    for r in (small, large):
        table = r["rows"] * args.dim * 4
        print(f"  {r['rows']:>11,} rows ({table / 2**20:,.0f} MiB table): worker peak RSS "
              f"{r['peak_rss'] / 2**20:,.0f} MiB, largest parameter "
              f"{r['largest_parameter_bytes'] / 2**10:,.1f} KiB, "
              f"{r['examples_per_s']:,.0f} examples/s", flush=True)
    ratio = large["peak_rss"] / small["peak_rss"]
    print(f"  (a) peak RSS {args.large_rows // args.small_rows}x table / 1x table = {ratio:.3f} "
          "(target: within 1.10)", flush=True)


def capped(args: argparse.Namespace) -> None:
    """(b): a worker under an RSS cap smaller than its table trains; with the table in it, it cannot."""
    table = args.capped_rows * args.dim * 4
    report = _check(run_cluster(args.capped_rows, args.dim, args.steps, cap=args.cap),
                    "the capped worker")
    print(f"  (b) {args.capped_rows:,} rows ({table / 2**20:,.0f} MiB table), worker under "
          f"an RSS cap of {args.cap / 2**20:,.0f} MiB (cap / table = {args.cap / table:.2f}): "
          f"trained {report['steps']} steps (loss {report['first_loss']:.3f} -> "
          f"{report['last_loss']:.3f}), peak RSS {report['capped_peak_rss'] / 2**20:,.0f} MiB "
          f"(address space in its data segment {report['data_bytes'] / 2**20:,.0f} MiB, "
          "not capped)", flush=True)
    control = run_cluster(args.capped_rows, args.dim, 1, cap=args.cap, in_process_table=True)
    if not control.get("over_cap"):
        if control["returncode"] == 0:
            raise SystemExit("control: the worker with the table in its own memory trained under "
                             "the cap; lower --cap or raise --capped-rows")
        raise SystemExit(f"control: the worker failed for another reason:\n{control['stderr']}")
    print("  control: the same worker with the table in its own memory under the same cap was "
          f"{control['over_cap']}", flush=True)


if __name__ == "__main__":
    main()
