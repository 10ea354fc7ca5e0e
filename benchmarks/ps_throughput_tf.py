"""TensorFlow's own ps runtime on the same topology, for ``ps_throughput.py`` to compare.

Runs under an interpreter with ``tensorflow-cpu`` (a throwaway venv; towerflow
does not depend on TensorFlow) and prints one JSON line: ``gbps`` of a 100 MB
variable pushed (momentum update from a fed gradient) and pulled (fetched) by
1 worker through ``tf.compat.v1`` ``Server`` + ``replica_device_setter``, and
``steps_per_sec`` of article 003's linear regression with 1 ps and 2 workers.

    /tmp/tfvenv/bin/python benchmarks/ps_throughput_tf.py --numel 25000000
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def start(role: str, cluster: dict, index: int, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, "--role", role, "--cluster",
                             json.dumps(cluster), "--index", str(index), *extra],
                            stdout=subprocess.PIPE, text=True)


def ps_main(cluster: dict, index: int) -> None:
    import tensorflow as tf

    tf.compat.v1.disable_eager_execution()
    server = tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name="ps", task_index=index)
    server.join()


def traffic_main(cluster: dict, index: int, numel: int, iters: int) -> None:
    import numpy as np
    import tensorflow as tf

    tf.compat.v1.disable_eager_execution()
    spec = tf.train.ClusterSpec(cluster)
    server = tf.distribute.Server(spec, job_name="worker", task_index=index)
    with tf.compat.v1.device(tf.compat.v1.train.replica_device_setter(
            worker_device=f"/job:worker/task:{index}", cluster=spec)):
        var = tf.compat.v1.get_variable("w", [numel], initializer=tf.zeros_initializer())
        grad = tf.compat.v1.placeholder(tf.float32, [numel])
        apply = tf.compat.v1.train.MomentumOptimizer(0.01, 0.9).apply_gradients([(grad, var)])
    with tf.compat.v1.Session(server.target) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        g = np.full(numel, 1e-6, np.float32)
        sess.run(apply, {grad: g})
        sess.run(var)  # warm up
        t0 = time.time()
        for _ in range(iters):
            sess.run(apply, {grad: g})   # push
            sess.run(var)                # pull
        seconds = time.time() - t0
    print(json.dumps({"bytes": 2 * numel * 4 * iters, "seconds": seconds}), flush=True)


def linreg_main(cluster: dict, index: int, steps: int, start_at: float) -> None:
    import numpy as np
    import tensorflow as tf

    tf.compat.v1.disable_eager_execution()
    spec = tf.train.ClusterSpec(cluster)
    server = tf.distribute.Server(spec, job_name="worker", task_index=index)
    train_x = np.linspace(-1, 1, 100).astype(np.float32)
    train_y = (2 * train_x + 1 + np.random.randn(100) * 0.3).astype(np.float32)
    with tf.compat.v1.device(tf.compat.v1.train.replica_device_setter(
            worker_device=f"/job:worker/task:{index}", cluster=spec)):
        x = tf.compat.v1.placeholder(tf.float32)
        y = tf.compat.v1.placeholder(tf.float32)
        w = tf.Variable(tf.random.normal([1]), name="weight")
        b = tf.Variable(tf.zeros([1]), name="bias")
        global_step = tf.compat.v1.train.get_or_create_global_step()
        cost = tf.reduce_mean(tf.square(y - (x * w + b)))
        train = tf.compat.v1.train.GradientDescentOptimizer(0.01).minimize(
            cost, global_step=global_step)
    with tf.compat.v1.Session(server.target) as sess:
        if index == 0:  # the chief initialises; the other worker waits for it
            sess.run(tf.compat.v1.global_variables_initializer())
        else:
            while len(sess.run(tf.compat.v1.report_uninitialized_variables())):
                time.sleep(0.05)
        time.sleep(max(0.0, start_at - time.time()))
        t0, local, step = time.time(), 0, 0
        while step < steps:
            _, step = sess.run([train, global_step], {x: train_x, y: train_y})
            local += 1
        end = time.time()
    print(json.dumps({"local_steps": local, "start": t0, "end": end}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", default="main")
    parser.add_argument("--cluster", default="{}")
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--numel", type=int, default=25_000_000)
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--start-at", type=float, default=0.0)
    args = parser.parse_args()
    cluster = json.loads(args.cluster)
    if args.role == "ps":
        ps_main(cluster, args.index)
        return
    if args.role == "traffic":
        traffic_main(cluster, args.index, args.numel, args.iters)
        return
    if args.role == "linreg":
        linreg_main(cluster, args.index, args.steps, args.start_at)
        return
    import tensorflow as tf

    out = {"version": tf.__version__}
    ports = free_ports(3)
    one = {"ps": [f"localhost:{ports[0]}"], "worker": [f"localhost:{ports[1]}"]}
    ps = start("ps", one, 0)
    try:
        worker = start("traffic", one, 0, "--numel", str(args.numel), "--iters", str(args.iters))
        row = json.loads(worker.communicate(timeout=900)[0].strip().splitlines()[-1])
        out["gbps"] = row["bytes"] / row["seconds"] / 1e9
    finally:
        ps.kill()
        ps.wait()
    ports = free_ports(3)
    two = {"ps": [f"localhost:{ports[0]}"],
           "worker": [f"localhost:{ports[1]}", f"localhost:{ports[2]}"]}
    ps = start("ps", two, 0)
    try:
        start_at = str(time.time() + 20.0)  # both workers up and initialised by then
        workers = [start("linreg", two, i, "--steps", str(args.steps), "--start-at", start_at)
                   for i in range(2)]
        rows = [json.loads(w.communicate(timeout=900)[0].strip().splitlines()[-1]) for w in workers]
        seconds = max(r["end"] for r in rows) - min(r["start"] for r in rows)
        out["steps_per_sec"] = sum(r["local_steps"] for r in rows) / seconds
    finally:
        ps.kill()
        ps.wait()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    main()
