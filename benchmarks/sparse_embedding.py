"""Sparse embedding table on the ps tasks: N ps + M workers, async, against a one-process loop.

Workload: a 1M x 32 float32 table (``ShardedEmbedding``, mode ``sum``) and a
linear layer; batches of 512 examples with 16 ids each drawn from Zipf(1.2)
over the table's rows; Adagrad (row-wise on the ps); async; the table split
over ``--ps`` tasks (default 2), ``--workers`` processes (default 2) each with
its own batches (seeded by its index), started together. Figures:

- examples/s of the workers together, and of the one-process ceiling loop
  (plain torch, one thread as the workers: unique ids, ``index_select`` of the
  rows, ``embedding_bag``, backward, a row-wise Adagrad on the touched rows)
  measured in the same run;
- with ``--tf-python``: TensorFlow 1's ps runtime on the same workload
  (``sparse_embedding_tf.py``: partitioned ``get_variable``,
  ``embedding_lookup_sparse``, ``AdagradOptimizer``, ``Session(server.target)``,
  the same ps and workers), run after towerflow in the same run, and the ratio;
- table bytes on the wire per step and direction, against unique rows x row bytes;
- CPU time per step of the workers and the ps tasks, and the cluster's CPU
  seconds per example (all workers + all ps tasks; both runtimes);
- each ps task's peak resident memory against its table + slot bytes, gross
  and net of a bare ps task's (interpreter, torch, gRPC, no table) measured
  in the same run.

With ``--dynamic``, the same workload also runs on a ``DynamicEmbedding``
(``benchmarks/dynamic_tables.py``): the Zipf ranks mapped through a fixed
random 64-bit permutation (raw ids over the whole int64 range), side by side
with the fixed table in each round; then ``admit_after=2`` (stored rows
against the distinct ids seen, and the logloss of the last steps against
``admit_after=1``), ``capacity`` a tenth of the distinct ids seen (the ps
tasks' resident memory sampled through the run), and, in this process, a
store of ``--memory-rows`` rows (bytes per stored row) and one of ``capacity``
fed ten times as many distinct ids (bytes as they pass).

The table is built with ``defer_push=True`` (a step's row gradients travel
with the next step's pull, and so does its dense push: one round trip per ps
task and step); ``--no-defer-push`` measures a pull and a push per shard and
step, ``--dense-apart`` the dense push in its own request each step.

Commands::

    python benchmarks/sparse_embedding.py --tf-python /tmp/tfvenv/bin/python --repeats 2
    python benchmarks/sparse_embedding.py --rows 100000 --seconds 5
    python benchmarks/sparse_embedding.py --ps 1 --workers 8 --tf-python /tmp/tfvenv/bin/python
    python benchmarks/sparse_embedding.py --dynamic --repeats 3 --seconds 10
    python benchmarks/sparse_embedding.py --dense allreduce --seconds 10   # hybrid training
    python benchmarks/sparse_embedding.py --dense allreduce --embedding-staleness 1 --seconds 10
    python benchmarks/sparse_embedding.py --ps-replicas 1 --seconds 10   # live shard replicas
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from sparse_embedding_tf import (  # the same directory; it imports no TensorFlow
    cpu_seconds,
    peak_rss,
    window_cpu,
)
from torch import nn

from towerflow.cluster.launcher import free_ports

DIM, BATCH, IDS = 32, 512, 16
#: the measured steps whose mean loss is reported (the same steps for every table; a run
#: too short for them reports its last 100)
LOSS_STEPS = slice(300, 400)


def zipf_batches(rows: int, count: int, seed: int) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    return [torch.from_numpy((rng.zipf(1.2, size=(BATCH, IDS)) - 1) % rows) for _ in range(count)]


def labels_of(ids: torch.Tensor) -> torch.Tensor:
    return ((ids * 2654435761) % 1000 < 500).float().mean(1).round()


def ceiling(rows: int, seconds: float) -> float:
    """Examples/s of the one-process loop with no ps (one thread, as each worker)."""
    torch.set_num_threads(1)
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


def gpu_ceiling(rows: int, seconds: float, device: str) -> float:
    """Examples/s of the same model on the GPU in one process, written the plain PyTorch way."""
    torch.set_num_threads(1)
    model = nn.Sequential()
    model.emb = nn.EmbeddingBag(rows, DIM, mode="sum", sparse=True)
    model.out = nn.Linear(DIM, 1)
    with torch.no_grad():
        model.emb.weight.uniform_(-0.05, 0.05)
    model.to(device)
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1, initial_accumulator_value=0.1)
    batches = [b.to(device) for b in zipf_batches(rows, 50, 99)]
    labels = [labels_of(b) for b in batches]
    done = 0
    torch.cuda.synchronize()
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        ids = batches[done % len(batches)]
        loss = F.binary_cross_entropy_with_logits(model.out(model.emb(ids)).squeeze(1),
                                                  labels[done % len(batches)])
        opt.zero_grad()
        loss.backward()
        opt.step()
        done += 1
        if done % 50 == 0:
            loss.item()  # what a training loop's log line costs
    torch.cuda.synchronize()
    return done * BATCH / (time.perf_counter() - start)


def make_table(args: argparse.Namespace) -> nn.Module:
    """The benchmark's table: fixed (``ShardedEmbedding``) or ``DynamicEmbedding``."""
    import towerflow

    optimizer = {"name": "adagrad", "hyper": {"initial_accumulator_value": 0.1}}
    if args.table == "fixed":
        return towerflow.ShardedEmbedding(args.rows, DIM, mode="sum",
                                          defer_push=args.defer_push, optimizer=optimizer)
    return towerflow.DynamicEmbedding(DIM, mode="sum", defer_push=args.defer_push,
                                      optimizer=optimizer, admit_after=args.admit_after,
                                      capacity=args.capacity or None)


def worker(args: argparse.Namespace) -> None:
    from towerflow.cluster import ClusterSpec, TaskInfo
    from towerflow.strategies import OptimizerConfig
    from towerflow.strategies.parameter_server import ParameterServer

    torch.set_num_threads(1)
    cluster = ClusterSpec(json.loads(args.cluster))
    strategy = ParameterServer(cluster, TaskInfo("worker", args.index), device=args.device,
                               server=False, dense_with_rows=not args.dense_apart,
                               dense=args.dense, replicas=args.ps_replicas,
                               **({"embedding_staleness": args.embedding_staleness}
                                  if args.dense == "allreduce" else {}))
    model = nn.Sequential()
    model.emb = make_table(args)
    model.out = nn.Linear(DIM, 1)
    strategy.prepare(model, OptimizerConfig("adagrad", lr=0.1))

    def loss_fn(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        out = m(batch[0]).squeeze(1)
        return F.binary_cross_entropy_with_logits(out, batch[1])

    ranks = zipf_batches(args.rows, args.batches, args.index)
    unique = [torch.unique(b).numel() for b in ranks]
    if args.table == "dynamic":
        from dynamic_tables import raw_ids
        batches = [(raw_ids(b).to(args.device), labels_of(b).to(args.device)) for b in ranks]
    else:
        batches = [(b.to(args.device), labels_of(b).to(args.device)) for b in ranks]
    for b in batches[:5]:
        strategy.run_step(loss_fn, b)
    start_together(Path(args.report).parent, args.index, args.workers)
    wire = model.emb.client.wire
    wire.clear()
    losses: list[torch.Tensor] = []
    steps, start, cpu, began = 0, time.perf_counter(), time.process_time(), time.time()
    while True:  # hybrid workers step together: they agree to stop (one step late)
        strategy.ahead(batches[(steps + 1) % len(batches)])  # as the Trainer tells it
        losses.append(strategy.run_step(loss_fn, batches[steps % len(batches)]).loss)
        steps += 1
        if strategy.agree_to_stop(time.perf_counter() - start >= args.seconds):
            break
    elapsed, cpu, ended = time.perf_counter() - start, time.process_time() - cpu, time.time()
    sums = {k: [0, 0] for k in ("pull", "push")}
    for method, (_, sent, received) in wire.items():
        if method in ("PullRows", "PushPullRows"):  # a PushPullRows' reply is the pull's rows
            sums["pull"][1] += received
        if method in ("PushRows", "PushPullRows"):  # its request carries the push's rows
            sums["push"][0] += sent
        if method == "PullRows":
            sums["pull"][0] += sent
    calls = sum(c for c, _, _ in wire.values())
    total = sum(sent + received for _, sent, received in wire.values())
    stats = model.emb.stats() if args.table == "dynamic" else {}
    strategy.shutdown()
    rows_seen = sum(unique[i % len(unique)] for i in range(steps))
    report = {"examples_per_s": steps * BATCH / elapsed, "steps": steps, "began": began,
              "ended": ended,
              "cpu_ms_per_step": 1e3 * cpu / steps, "table_calls_per_step": calls / steps,
              "unique_rows_per_step": rows_seen / steps,
              "pull_recv": sums["pull"][1] / steps, "push_sent": sums["push"][0] / steps,
              "wire_bytes_per_step": total / steps,
              "row_bytes_per_step": rows_seen / steps * DIM * 4,
              "logloss": float(torch.stack(losses[LOSS_STEPS] or losses[-100:]).mean()),
              "stats": stats}
    Path(args.report).write_text(json.dumps(report))


def start_together(folder: Path, index: int, workers: int) -> None:
    """Wait until every worker has warmed up (each leaves a file in ``folder``)."""
    (folder / f"{index}.ready").touch()
    while sum(1 for _ in folder.glob("*.ready")) < workers:
        time.sleep(0.01)  # polling the other workers' files


def distinct_ids(rows: int, batches: int = 50, steps: tuple[int, int] | None = None) -> int:
    """Distinct ids the two workers see: each cycles through its ``batches`` batches (5 of
    warm-up, then ``steps[i]`` measured steps; None: all of them)."""
    seen = []
    for i in range(2):
        mine = zipf_batches(rows, batches, i)
        used = len(mine) if steps is None else min(len(mine), max(5, steps[i]))
        seen.append(torch.cat(mine[:used]).reshape(-1))
    return int(torch.unique(torch.cat(seen)).numel())


PS_CODE = ("import sys, json, towerflow; from towerflow.cluster import ClusterSpec; "
           "towerflow.Server(ClusterSpec(json.loads(sys.argv[1])), 'ps', int(sys.argv[2]))"
           ".join()")
#: a ps task that holds no table: the interpreter, torch, gRPC and the services loaded
BARE_PS_CODE = "import torch, towerflow.ps.server.tables.shard; " + PS_CODE


def current_rss(pid: int) -> int:
    """A process's resident memory now (VmRSS), 0 once it has exited."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return next((int(line.split()[1]) * 1024 for line in text.splitlines()
                 if line.startswith("VmRSS:")), 0)


def run_cluster(args: argparse.Namespace, table: str = "fixed", admit_after: int = 1,
                capacity: int = 0, batches: int = 50) -> dict:
    ports = [f"127.0.0.1:{port}" for port in free_ports(args.ps + args.workers + 2)]
    spec = {"ps": ports[:args.ps], "worker": ports[args.ps:-2]}
    bare_spec = {"ps": [ports[-2]], "worker": [ports[-1]]}
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "TOWERFLOW_SECRET": os.environ.get("TOWERFLOW_SECRET", "bench-secret")}
    base = [sys.executable, __file__, "--cluster", json.dumps(spec), "--rows", str(args.rows),
            "--seconds", str(args.seconds), "--device", args.device,
            *([] if args.defer_push else ["--no-defer-push"]),
            *(["--dense-apart"] if args.dense_apart else []), "--table", table,
            "--dense", args.dense, "--embedding-staleness", str(args.embedding_staleness),
            "--ps-replicas", str(args.ps_replicas),
            "--admit-after", str(admit_after), "--capacity", str(capacity),
            "--batches", str(batches), "--workers", str(args.workers)]
    ps = [subprocess.Popen([sys.executable, "-c", PS_CODE, json.dumps(spec), str(i)], env=env)
          for i in range(args.ps)]
    bare = subprocess.Popen([sys.executable, "-c", BARE_PS_CODE, json.dumps(bare_spec), "0"],
                            env=env)
    tmp = Path(tempfile.mkdtemp())
    try:
        workers = [subprocess.Popen([*base, "--role", "worker", "--index", str(i),
                                     "--report", str(tmp / f"{i}.json")], env=env)
                   for i in range(args.workers)]
        rss, cpu, now_rss = [0] * args.ps, [[] for _ in ps], []
        deadline = time.monotonic() + args.seconds + 300
        while any(w.poll() is None for w in workers) and time.monotonic() < deadline:
            rss = [max(r, peak_rss(p.pid)) for r, p in zip(rss, ps, strict=True)]
            now_rss.append((time.time(), sum(current_rss(p.pid) for p in ps)))
            for samples, p in zip(cpu, ps, strict=True):
                samples.append((time.time(), cpu_seconds(p.pid)))
            time.sleep(0.5)  # sampling interval of the ps tasks' high-water marks
        if any(w.poll() != 0 for w in workers):
            raise SystemExit("a worker failed")
        bare_rss = peak_rss(bare.pid)
    finally:
        for p in [*ps, bare]:
            p.terminate()
            p.wait(30)
    reports = [json.loads((tmp / f"{i}.json").read_text()) for i in range(args.workers)]
    begin, end = max(r["began"] for r in reports), min(r["ended"] for r in reports)
    steps = sum(r["examples_per_s"] for r in reports) / BATCH * (end - begin)
    ps_ms = [1e3 * window_cpu(samples, begin, end) / steps for samples in cpu]
    window = [r for t, r in now_rss if begin <= t <= end]
    return {"workers": reports, "ps_peak_rss": rss, "bare_ps_rss": bare_rss,
            "ps_cpu_ms_per_step": ps_ms, "ps_rss_in_window": window}


def measure_tensorflow(tf_python: str, rows: int, seconds: float, ps: int = 2,
                       workers: int = 2) -> dict:
    """TensorFlow 1's ps runtime on the same workload (``sparse_embedding_tf.py``)."""
    script = Path(__file__).with_name("sparse_embedding_tf.py")
    proc = subprocess.run([tf_python, str(script), "--rows", str(rows), "--seconds",
                           str(seconds), "--ps", str(ps), "--workers", str(workers)],
                          capture_output=True, text=True, timeout=seconds + 900,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    if proc.returncode != 0:
        raise RuntimeError(f"{tf_python} {script} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--ps", type=int, default=2, help="ps tasks the table is split over")
    parser.add_argument("--workers", type=int, default=2,
                        help="worker processes, each with its own batches")
    parser.add_argument("--tf-python", default=None,
                        help="a python with tensorflow-cpu: measure TensorFlow 1's ps runtime")
    parser.add_argument("--dense-apart", action="store_true",
                        help="the dense push in its own request each step "
                             "(ParameterServer(dense_with_rows=False))")
    parser.add_argument("--dense", choices=("ps", "allreduce"), default="ps",
                        help="allreduce: hybrid training (the table on the ps tasks, the dense "
                        "layer all-reduced among the workers)")
    parser.add_argument("--embedding-staleness", type=int, default=0,
                        help="with --dense allreduce: N >= 1 pulls the next step's rows while "
                        "a step runs (pushes in the background, at most N steps behind)")
    parser.add_argument("--ps-replicas", type=int, default=0,
                        help="live copies of each ps shard (ParameterServer(replicas=N)): "
                        "1 keeps shard i's copy on ps task i + 1, a push answered once it has it")
    parser.add_argument("--no-defer-push", dest="defer_push", action="store_false",
                        help="a pull and a push per shard and step (default: push with the "
                        "next pull)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="interleaved rounds; each side's figures are its best round")
    parser.add_argument("--device", default="cpu",
                        help="where the workers compute (cuda: the tables stay on the CPU ps "
                        "tasks; the ceiling is the same model on the GPU in one process)")
    parser.add_argument("--dynamic", action="store_true",
                        help="also run the workload on a DynamicEmbedding (raw 64-bit ids), "
                        "with admission and capacity runs and the store's memory per row")
    parser.add_argument("--memory-rows", type=int, default=10_000_000,
                        help="rows of the in-process store whose bytes per row are measured")
    parser.add_argument("--table", default="fixed", help=argparse.SUPPRESS)
    parser.add_argument("--batches", type=int, default=50, help=argparse.SUPPRESS)
    parser.add_argument("--admit-after", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--capacity", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--role", default="main")
    parser.add_argument("--cluster")
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--report")
    args = parser.parse_args()
    if args.role == "worker":
        worker(args)
        return
    if args.dynamic:
        if (args.ps, args.workers) != (2, 2):
            parser.error(f"--dynamic runs 2 ps + 2 workers, not {args.ps} ps + {args.workers} "
                         "workers; drop --ps and --workers")
        from dynamic_report import run_dynamic
        run_dynamic(args, run_cluster, distinct_ids)
        return
    rounds = []
    for index in range(args.repeats):  # interleaved: the machine's load reaches every side
        result = run_cluster(args)
        ceil = (ceiling(args.rows, args.seconds) if args.device == "cpu"
                else gpu_ceiling(args.rows, args.seconds, args.device))
        tf = (measure_tensorflow(args.tf_python, args.rows, args.seconds, args.ps, args.workers)
              if args.tf_python else None)
        rounds.append((result, ceil, tf))
        total = sum(w["examples_per_s"] for w in result["workers"])
        print(f"round {index + 1}: towerflow {total:,.0f}, ceiling {ceil:,.0f}"
              + ("" if tf is None else f", TensorFlow {tf['examples_per_s']:,.0f}")
              + " examples/s; cluster CPU per example: towerflow " + cpu_text(result)
              + ("" if tf is None else ", TensorFlow " + cpu_text(tf)), flush=True)
    best = max(rounds, key=lambda r: sum(w["examples_per_s"] for w in r[0]["workers"]))
    ceil = max(r[1] for r in rounds)
    tf = None if not args.tf_python else max((r[2] for r in rounds),
                                              key=lambda t: t["examples_per_s"])
    report(args, best[0], ceil, tf)
    mine = statistics.median(sum(cpu_per_example(r[0])) for r in rounds)
    line = f"  cluster CPU per example, median of {len(rounds)} round(s): towerflow {mine:.1f} µs"
    if args.tf_python:
        theirs = statistics.median(sum(cpu_per_example(r[2])) for r in rounds)
        line += f", TensorFlow {theirs:.1f} µs (towerflow / TensorFlow {mine / theirs:.2f})"
    print(line)


def cpu_per_example(run: dict) -> tuple[float, float]:
    """A run's CPU microseconds per example over the cluster: all workers' and all ps tasks'."""
    steps = sum(w["steps"] for w in run["workers"])
    workers = sum(w["cpu_ms_per_step"] * w["steps"] for w in run["workers"]) / steps
    return 1e3 * workers / BATCH, 1e3 * sum(run["ps_cpu_ms_per_step"]) / BATCH


def cpu_text(run: dict) -> str:
    workers, ps = cpu_per_example(run)
    return f"{workers + ps:.1f} µs (workers {workers:.1f} + ps tasks {ps:.1f})"


def report(args: argparse.Namespace, result: dict, ceil: float, tf: dict | None) -> None:
    total = sum(w["examples_per_s"] for w in result["workers"])
    shard_bytes = args.rows // args.ps * DIM * 4 * 2  # rows + Adagrad accumulator per ps
    print(f"best of {args.repeats} round(s); {args.ps} ps + {args.workers} workers, {args.rows} "
          f"x {DIM} table, batch {BATCH} x {IDS} Zipf(1.2), Adagrad, async, ps replicas {args.ps_replicas}, defer_push={args.defer_push}, dense "
          f"{f'all-reduced among the workers (embedding_staleness={args.embedding_staleness})' if args.dense == 'allreduce' else 'push apart' if args.dense_apart else 'push with the rows'}, workers on {args.device}")
    print(f"  towerflow: {total:,.0f} examples/s; one-process ceiling {ceil:,.0f} examples/s "
          f"(ratio {total / ceil:.2f})")
    if tf is not None:
        print(f"  TensorFlow {tf['version']} ps runtime: {tf['examples_per_s']:,.0f} examples/s "
              f"(embedding_lookup_sparse, partition_strategy={tf['partition_strategy']}) -> "
              f"towerflow {total / tf['examples_per_s']:.2f}x (target >= 2x); TensorFlow ps "
              f"peak RSS {', '.join(f'{r / 2**20:.0f}' for r in tf['ps_peak_rss'])} MiB")
    print(f"  cluster CPU per example: towerflow {cpu_text(result)}"
          + ("" if tf is None else f", TensorFlow {cpu_text(tf)}"))
    for i, w in enumerate(result["workers"]):
        row_bytes = w["row_bytes_per_step"]
        print(f"  worker {i}: {w['examples_per_s']:,.0f} examples/s, {w['unique_rows_per_step']:.0f}"
              f" unique rows/step; pull {w['pull_recv'] / row_bytes:.3f}x and push "
              f"{w['push_sent'] / row_bytes:.3f}x of unique rows x row bytes "
              f"({w['wire_bytes_per_step']:,.0f} B/step in {w['table_calls_per_step']:.1f} "
              f"table calls); {w['cpu_ms_per_step']:.2f} ms CPU/step")
    bare = result["bare_ps_rss"]
    print(f"  bare ps task (no table): peak RSS {bare / 2**20:.0f} MiB")
    for i, (rss, ms) in enumerate(zip(result["ps_peak_rss"], result["ps_cpu_ms_per_step"],
                                      strict=True)):
        print(f"  ps {i}: peak RSS {rss / 2**20:.0f} MiB = {rss / shard_bytes:.2f}x its table + "
              f"slot bytes ({shard_bytes / 2**20:.0f} MiB); net of the bare ps "
              f"{(rss - bare) / 2**20:.0f} MiB = {(rss - bare) / shard_bytes:.2f}x (target <= "
              f"1.3x); {ms:.2f} ms CPU per step of the cluster")


if __name__ == "__main__":
    main()
