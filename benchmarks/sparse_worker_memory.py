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
(b) the worker under a memory cap smaller than its table (``--capped-rows``
    rows, ``--cap`` bytes) trains ``--steps`` steps; the same worker with the
    table in its own memory (``--in-process-table``: the model built as it is,
    not swapped) is refused by the cap, which shows the cap bites.

The cap is ``RLIMIT_DATA`` set in the worker before it starts (Linux counts a
process's private writable mappings against it: the heap and every anonymous
``mmap``, so torch cannot allocate past it). ``prlimit --as`` caps the address
space, which torch's and gRPC's reservations exhaust long before memory; no
systemd user bus or writable cgroup is assumed.

Commands::

    python benchmarks/sparse_worker_memory.py
    python benchmarks/sparse_worker_memory.py --small-rows 100000 --large-rows 1000000 \\
        --capped-rows 2000000 --cap 560MiB --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812
from sparse_embedding import PS_CODE, labels_of, zipf_batches  # the same directory
from torch import nn

from towerflow.cluster.launcher import free_ports
from towerflow.testing.processes import stop_processes

DIM = 32
#: tables of this many bytes or more are sharded on the ps tasks
THRESHOLD = 1 << 20


def _status(field: str) -> int:
    """A ``/proc/self/status`` figure in bytes (``VmHWM``: this process's own peak RSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def worker(args: argparse.Namespace) -> None:
    """One worker: the click model, ``--steps`` steps, a JSON report of its memory."""
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
    """2 ps tasks and one worker (under ``cap`` bytes of RLIMIT_DATA); the worker's report.

    The report has ``returncode`` and, when the worker failed, the tail of its ``stderr``.
    """
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

    def limit() -> None:  # in the child, before exec
        if cap is not None:
            resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))

    try:
        proc = subprocess.run(command, env=env, preexec_fn=limit, capture_output=True,
                              text=True, timeout=timeout)
    finally:
        stop_processes(ps, grace=30)
    if proc.returncode != 0 or not report_path.exists():
        return {"returncode": proc.returncode, "stderr": proc.stderr[-2000:]}
    return {"returncode": 0, **json.loads(report_path.read_text())}


def byte_count(text: str) -> int:
    from towerflow.cli.train import byte_count as parse

    return parse(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small-rows", type=int, default=1_000_000)
    parser.add_argument("--large-rows", type=int, default=10_000_000)
    parser.add_argument("--capped-rows", type=int, default=6_000_000)
    parser.add_argument("--cap", type=byte_count, default=512 << 20,
                        help="the capped worker's RLIMIT_DATA (default 512MiB)")
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
    """(b): a worker under a cap smaller than its table trains; with the table in it, it cannot."""
    table = args.capped_rows * args.dim * 4
    report = _check(run_cluster(args.capped_rows, args.dim, args.steps, cap=args.cap),
                    "the capped worker")
    print(f"  (b) {args.capped_rows:,} rows ({table / 2**20:,.0f} MiB table), worker under "
          f"RLIMIT_DATA {args.cap / 2**20:,.0f} MiB (cap / table = {args.cap / table:.2f}): "
          f"trained {report['steps']} steps (loss {report['first_loss']:.3f} -> "
          f"{report['last_loss']:.3f}), peak RSS {report['peak_rss'] / 2**20:,.0f} MiB, "
          f"data segment {report['data_bytes'] / 2**20:,.0f} MiB", flush=True)
    control = run_cluster(args.capped_rows, args.dim, 1, cap=args.cap, in_process_table=True)
    if control["returncode"] == 0:
        raise SystemExit("control: the worker with the table in its own memory trained under "
                         "the cap; lower --cap or raise --capped-rows")
    if not refused_by_cap(control["stderr"]):
        raise SystemExit(f"control: the worker failed for another reason:\n{control['stderr']}")
    print("  control: the same worker with the table in its own memory under the same cap "
          "cannot allocate it", flush=True)


def refused_by_cap(stderr: str) -> bool:
    """Whether a worker's ``stderr`` says an allocation was refused."""
    return "can't allocate memory" in stderr or "MemoryError" in stderr


if __name__ == "__main__":
    main()
