"""TensorFlow 1's ps runtime on the sparse embedding workload, for ``sparse_embedding.py``.

Runs under an interpreter with ``tensorflow-cpu`` (a throwaway venv; towerflow
does not depend on TensorFlow) and prints one JSON line. The workload is the
one of ``sparse_embedding.py``: a ``rows x 32`` float32 table made by
``tf.compat.v1.get_variable(..., partitioner=fixed_size_partitioner(N))`` over
N ps tasks (``--ps``, default 2), looked up with ``tf.compat.v1.nn.embedding_lookup_sparse``
(combiner ``sum``; it de-duplicates the ids and gathers only their rows from
the owning ps task) or ``tf.compat.v1.nn.embedding_lookup`` + ``reduce_sum``
(``--lookup dense``), a linear layer, sigmoid cross entropy,
``AdagradOptimizer(0.1)`` (initial accumulator 0.1, sparse updates on the
ps), async, M workers (``--workers``, default 2) each in their own
``Session(server.target)``, batches of 512 examples x 16 ids drawn from
Zipf(1.2) with the same generator and seeds as towerflow's workers, all on
127.0.0.1. Each worker reports its CPU time per step and the ps tasks' CPU
time is sampled over the window in which every worker measured.

    /tmp/tfvenv/bin/python benchmarks/sparse_embedding_tf.py --rows 1000000 --seconds 20
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from ps_throughput_tf import free_ports, ps_main  # the same directory, the same interpreter

DIM, BATCH, IDS = 32, 512, 16


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


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def window_cpu(samples: list[tuple[float, float]], begin: float, end: float) -> float:
    """CPU seconds between ``begin`` and ``end`` from ``(time, cpu)`` samples (interpolated)."""
    import numpy as np

    times = [t for t, _ in samples]
    values = [c for _, c in samples]
    return float(np.interp(end, times, values) - np.interp(begin, times, values))


def zipf_batches(rows: int, count: int, seed: int) -> list:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [(rng.zipf(1.2, size=(BATCH, IDS)) - 1) % rows for _ in range(count)]


def labels_of(ids):  # noqa: ANN001, ANN201 - numpy in, numpy out
    import numpy as np

    return np.round(((ids * 2654435761) % 1000 < 500).astype(np.float32).mean(1))


def build(spec, index: int, rows: int, lookup: str, strategy: str):  # noqa: ANN001, ANN201
    import tensorflow as tf

    v1 = tf.compat.v1
    with v1.device(v1.train.replica_device_setter(worker_device=f"/job:worker/task:{index}",
                                                  cluster=spec)):
        table = v1.get_variable(
            "table", [rows, DIM], tf.float32,
            initializer=v1.random_uniform_initializer(-0.05, 0.05),
            partitioner=v1.fixed_size_partitioner(len(spec.job_tasks("ps"))))
        ids = v1.placeholder(tf.int64, [BATCH, IDS])
        labels = v1.placeholder(tf.float32, [BATCH])
        if lookup == "sparse":
            flat = tf.reshape(ids, [-1])
            rows_of = tf.cast(tf.range(BATCH * IDS) // IDS, tf.int64)
            cols = tf.cast(tf.range(BATCH * IDS) % IDS, tf.int64)
            sp = tf.SparseTensor(tf.stack([rows_of, cols], 1), flat, [BATCH, IDS])
            bags = v1.nn.embedding_lookup_sparse(table, sp, None, combiner="sum",
                                                 partition_strategy=strategy)
        else:
            bags = tf.reduce_sum(v1.nn.embedding_lookup(table, ids, partition_strategy=strategy),
                                 1)
        weight = v1.get_variable("out/w", [DIM, 1], tf.float32,
                                 initializer=v1.glorot_uniform_initializer())
        bias = v1.get_variable("out/b", [1], tf.float32, initializer=v1.zeros_initializer())
        logits = tf.squeeze(tf.matmul(bags, weight) + bias, 1)
        loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=labels,
                                                                      logits=logits))
        train = v1.train.AdagradOptimizer(0.1, initial_accumulator_value=0.1).minimize(loss)
    return ids, labels, loss, train


def worker_main(cluster: dict, index: int, rows: int, seconds: float, start_at: float,
                lookup: str, strategy: str) -> None:
    import tensorflow as tf

    v1 = tf.compat.v1
    v1.disable_eager_execution()
    spec = tf.train.ClusterSpec(cluster)
    server = tf.distribute.Server(spec, job_name="worker", task_index=index)
    ids, labels, loss, train = build(spec, index, rows, lookup, strategy)
    batches = zipf_batches(rows, 50, index)
    feeds = [{ids: b, labels: labels_of(b)} for b in batches]
    with v1.Session(server.target) as sess:
        if index == 0:  # the chief initialises; the other worker waits for it
            sess.run(v1.global_variables_initializer())
        else:
            while len(sess.run(v1.report_uninitialized_variables())):
                time.sleep(0.05)  # polling the chief's initialisation, TensorFlow's own way
        first = sess.run(loss, feeds[0])
        for feed in feeds[:5]:
            sess.run(train, feed)
        time.sleep(max(0.0, start_at - time.time()))  # the workers start together
        steps, t0, cpu, began = 0, time.perf_counter(), time.process_time(), time.time()
        while time.perf_counter() - t0 < seconds:
            sess.run(train, feeds[steps % len(feeds)])
            steps += 1
        elapsed, cpu, ended = time.perf_counter() - t0, time.process_time() - cpu, time.time()
        last = float(sess.run(loss, feeds[0]))
    print(json.dumps({"examples_per_s": steps * BATCH / elapsed, "steps": steps,
                      "cpu_ms_per_step": 1e3 * cpu / steps, "began": began, "ended": ended,
                      "loss_first": float(first), "loss_last": last}), flush=True)


def start(role: str, cluster: dict, index: int, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, "--role", role, "--cluster",
                             json.dumps(cluster), "--index", str(index), *extra],
                            stdout=subprocess.PIPE, text=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", default="main")
    parser.add_argument("--cluster", default="{}")
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--ps", type=int, default=2, help="ps tasks the table is split over")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--start-at", type=float, default=0.0)
    parser.add_argument("--lookup", choices=("sparse", "dense"), default="sparse",
                        help="embedding_lookup_sparse (ids de-duplicated) or embedding_lookup")
    parser.add_argument("--partition-strategy", choices=("mod", "div"), default="mod",
                        help="id -> partition of the lookup (mod: id %% ps tasks, as "
                        "towerflow's default; div: contiguous ranges)")
    args = parser.parse_args()
    cluster = json.loads(args.cluster)
    if args.role == "ps":
        ps_main(cluster, args.index)
        return
    if args.role == "worker":
        worker_main(cluster, args.index, args.rows, args.seconds, args.start_at, args.lookup,
                    args.partition_strategy)
        return
    import tensorflow as tf

    ports = free_ports(args.ps + args.workers)
    spec = {"ps": [f"127.0.0.1:{p}" for p in ports[:args.ps]],
            "worker": [f"127.0.0.1:{p}" for p in ports[args.ps:]]}
    ps = [start("ps", spec, i) for i in range(args.ps)]
    try:
        # every worker up and initialised by then (each process imports TensorFlow)
        start_at = str(time.time() + max(30.0, 5.0 * (args.ps + args.workers)))
        workers = [start("worker", spec, i, "--rows", str(args.rows), "--seconds",
                         str(args.seconds), "--start-at", start_at, "--lookup", args.lookup,
                         "--partition-strategy", args.partition_strategy)
                   for i in range(args.workers)]
        rss, cpu = [0] * args.ps, [[] for _ in ps]
        deadline = time.monotonic() + args.seconds + 600
        while any(w.poll() is None for w in workers) and time.monotonic() < deadline:
            rss = [max(r, peak_rss(p.pid)) for r, p in zip(rss, ps, strict=True)]
            for samples, p in zip(cpu, ps, strict=True):
                samples.append((time.time(), cpu_seconds(p.pid)))
            time.sleep(0.5)  # sampling interval of the ps tasks' high-water marks and CPU
        reports = [json.loads(w.communicate(timeout=60)[0].strip().splitlines()[-1])
                   for w in workers]
    finally:
        for p in ps:
            p.kill()
            p.wait()
    begin, end = max(r["began"] for r in reports), min(r["ended"] for r in reports)
    steps = sum(r["examples_per_s"] for r in reports) / BATCH * (end - begin)
    print(json.dumps({"version": tf.__version__, "lookup": args.lookup,
                      "partition_strategy": args.partition_strategy, "workers": reports,
                      "examples_per_s": sum(r["examples_per_s"] for r in reports),
                      "ps_peak_rss": rss,
                      "ps_cpu_ms_per_step": [1e3 * window_cpu(s, begin, end) / steps
                                             for s in cpu]}), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    main()
