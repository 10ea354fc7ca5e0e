"""Sparse embedding table on the ps tasks: 2 ps + 2 workers, async, against a one-process loop.

Workload: a 1M x 32 float32 table (``ShardedEmbedding``, mode ``sum``) and a
linear layer; batches of 512 examples with 16 ids each drawn from Zipf(1.2)
over the table's rows; Adagrad (row-wise on the ps); async. Figures:

- examples/s of the 2 workers together, and of the one-process ceiling loop
  (plain torch: unique ids, ``index_select`` of the rows, ``embedding_bag``,
  backward, a row-wise Adagrad on the touched rows) measured in the same run;
- table bytes on the wire per step and direction, against unique rows x row bytes;
- each ps task's peak resident memory against its table + slot bytes.

Commands::

    python benchmarks/sparse_embedding.py                      # 1M rows, 20 s per worker
    python benchmarks/sparse_embedding.py --rows 100000 --seconds 5
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

DIM, BATCH, IDS = 32, 512, 16


def zipf_batches(rows: int, count: int, seed: int) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    return [torch.from_numpy((rng.zipf(1.2, size=(BATCH, IDS)) - 1) % rows) for _ in range(count)]


def labels_of(ids: torch.Tensor) -> torch.Tensor:
    return ((ids * 2654435761) % 1000 < 500).float().mean(1).round()


def ceiling(rows: int, seconds: float) -> float:
    """Examples/s of the one-process loop with no ps."""
    table = torch.empty(rows, DIM).uniform_(-0.05, 0.05)
    accum = torch.full((rows, DIM), 0.1)
    linear = nn.Linear(DIM, 1)
    opt = torch.optim.Adagrad(linear.parameters(), lr=0.1)
    batches = zipf_batches(rows, 50, 99)
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        ids = batches[done % len(batches)]
        unique, inverse = torch.unique(ids.reshape(-1), return_inverse=True)
        leaf = table.index_select(0, unique).requires_grad_(True)
        out = linear(F.embedding_bag(inverse.view(ids.shape), leaf, mode="sum")).squeeze(1)
        loss = F.binary_cross_entropy_with_logits(out, labels_of(ids))
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            g = leaf.grad
            acc = accum.index_select(0, unique).addcmul_(g, g)
            accum.index_copy_(0, unique, acc)
            table.index_copy_(0, unique, leaf.detach().addcmul_(g, acc.rsqrt(), value=-0.1))
        done += 1
    return done * BATCH / (time.perf_counter() - start)


def worker(args: argparse.Namespace) -> None:
    import towerflow.ps.table_client as tc
    from towerflow.cluster import ClusterSpec, TaskInfo
    from towerflow.ps.embedding import ShardedEmbedding
    from towerflow.strategies import OptimizerConfig
    from towerflow.strategies.parameter_server import ParameterServer

    wire = {"pull_sent": 0, "pull_recv": 0, "push_sent": 0, "push_recv": 0}
    plain = tc.unary

    def counting(channel, method, payload, *, timeout):  # noqa: ANN001, ANN202
        reply = plain(channel, method, payload, timeout=timeout)
        kind = "pull" if method.endswith("PullRows") else "push" if method.endswith(
            "PushRows") else None
        if kind:
            wire[f"{kind}_sent"] += len(payload)
            wire[f"{kind}_recv"] += len(reply)
        return reply

    tc.unary = counting
    cluster = ClusterSpec(json.loads(args.cluster))
    strategy = ParameterServer(cluster, TaskInfo("worker", args.index), device="cpu",
                               server=False)
    model = nn.Sequential()
    model.emb = ShardedEmbedding(args.rows, DIM, mode="sum",
                                 optimizer={"name": "adagrad",
                                            "hyper": {"initial_accumulator_value": 0.1}})
    model.out = nn.Linear(DIM, 1)
    strategy.prepare(model, OptimizerConfig("adagrad", lr=0.1))

    def loss_fn(m: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        out = m.out(m.emb(ids)).squeeze(1)
        return F.binary_cross_entropy_with_logits(out, labels_of(ids))

    batches = zipf_batches(args.rows, 50, args.index)
    unique = [torch.unique(b).numel() for b in batches]
    for b in batches[:5]:
        strategy.run_step(loss_fn, b)
    for key in wire:
        wire[key] = 0
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        strategy.run_step(loss_fn, batches[steps % len(batches)])
        steps += 1
    elapsed = time.perf_counter() - start
    strategy.shutdown()
    rows_seen = sum(unique[i % len(unique)] for i in range(steps))
    report = {"examples_per_s": steps * BATCH / elapsed, "steps": steps,
              "unique_rows_per_step": rows_seen / steps,
              **{k: v / steps for k, v in wire.items()},
              "row_bytes_per_step": rows_seen / steps * DIM * 4}
    Path(args.report).write_text(json.dumps(report))


def peak_rss(pid: int) -> int:
    """The process's peak resident memory (VmHWM), 0 once it has exited."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cluster(args: argparse.Namespace) -> dict:
    spec = {"ps": [f"127.0.0.1:{free_port()}" for _ in range(2)],
            "worker": [f"127.0.0.1:{free_port()}" for _ in range(2)]}
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "TOWERFLOW_SECRET": os.environ.get("TOWERFLOW_SECRET", "bench-secret")}
    base = [sys.executable, __file__, "--cluster", json.dumps(spec), "--rows", str(args.rows),
            "--seconds", str(args.seconds)]
    code = ("import sys, json, towerflow; from towerflow.cluster import ClusterSpec; "
            "towerflow.Server(ClusterSpec(json.loads(sys.argv[1])), 'ps', int(sys.argv[2]))"
            ".join()")
    ps = [subprocess.Popen([sys.executable, "-c", code, json.dumps(spec), str(i)], env=env)
          for i in range(2)]
    tmp = Path(tempfile.mkdtemp())
    try:
        workers = [subprocess.Popen([*base, "--role", "worker", "--index", str(i),
                                     "--report", str(tmp / f"{i}.json")], env=env)
                   for i in range(2)]
        rss = [0, 0]
        deadline = time.monotonic() + args.seconds + 300
        while any(w.poll() is None for w in workers) and time.monotonic() < deadline:
            rss = [max(r, peak_rss(p.pid)) for r, p in zip(rss, ps, strict=True)]
            time.sleep(0.5)  # sampling interval of the ps tasks' high-water marks
        if any(w.poll() != 0 for w in workers):
            raise SystemExit("a worker failed")
    finally:
        for p in ps:
            p.terminate()
            p.wait(30)
    reports = [json.loads((tmp / f"{i}.json").read_text()) for i in range(2)]
    return {"workers": reports, "ps_peak_rss": rss}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--role", default="main")
    parser.add_argument("--cluster")
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--report")
    args = parser.parse_args()
    if args.role == "worker":
        worker(args)
        return
    result = run_cluster(args)
    ceil = ceiling(args.rows, args.seconds)
    total = sum(w["examples_per_s"] for w in result["workers"])
    shard_bytes = args.rows // 2 * DIM * 4 * 2  # rows + Adagrad accumulator per ps
    print(f"2 ps + 2 workers, {args.rows} x {DIM} table, batch {BATCH} x {IDS} Zipf(1.2), "
          "Adagrad, async")
    print(f"  towerflow: {total:,.0f} examples/s; one-process ceiling {ceil:,.0f} examples/s "
          f"(ratio {total / ceil:.2f})")
    for i, w in enumerate(result["workers"]):
        row_bytes = w["row_bytes_per_step"]
        print(f"  worker {i}: {w['examples_per_s']:,.0f} examples/s, {w['unique_rows_per_step']:.0f}"
              f" unique rows/step; pull {w['pull_recv'] / row_bytes:.3f}x and push "
              f"{w['push_sent'] / row_bytes:.3f}x of unique rows x row bytes "
              f"({w['pull_sent'] + w['pull_recv'] + w['push_sent'] + w['push_recv']:,.0f} B/step)")
    for i, rss in enumerate(result["ps_peak_rss"]):
        print(f"  ps {i}: peak RSS {rss / 2**20:.0f} MiB = {rss / shard_bytes:.2f}x its table + "
              f"slot bytes ({shard_bytes / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
