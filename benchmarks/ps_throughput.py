"""Parameter-server figures: traffic GB/s vs raw loopback TCP, ps memory, linear-regression steps/s.

Everything runs on this machine in one invocation, every task a real process:

1. Raw loopback TCP: a server process receives a 100 MB buffer and sends it
   back, over and over (1 and 2 clients): the ceiling of any transport here.
2. Parameter traffic: a ps task (``towerflow server``) holding a 100 MB fp32
   model with momentum, and 1 or 2 worker processes doing push-and-pull
   round trips (push 100 MB of gradients, receive 100 MB of parameters): GB/s
   of push + pull, and the ratio to (1) (target >= 0.5x). Async with 1 and 2
   workers, and sync with 2 workers.
3. Memory: the ps process's peak resident memory (VmHWM) against its parameter
   bytes, for each run (target <= 3x with momentum, whatever the number of
   workers), also net of the idle server's own memory.
4. Article 003: linear regression with 1 ps and 2 workers: total steps/s.
5. TensorFlow (when ``--tf-python`` names an interpreter with tensorflow-cpu):
   the same traffic and the same linear regression with ``tf.compat.v1``
   ``Server`` + ``replica_device_setter``.

Usage::

    python benchmarks/ps_throughput.py                     # towerflow only
    python benchmarks/ps_throughput.py --tf-python /tmp/tfvenv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

MB = 1_000_000
HERE = Path(__file__).resolve()


# ----------------------------------------------------------------------------- raw TCP
def tcp_echo_server(port: int, nbytes: int, clients: int) -> None:
    """Receive ``nbytes`` and send them back, per connection, until it closes."""
    import threading

    srv = socket.create_server(("127.0.0.1", port))

    def serve(conn: socket.socket) -> None:
        buf = memoryview(bytearray(nbytes))
        with conn:
            while True:
                got = 0
                while got < nbytes:
                    n = conn.recv_into(buf[got:])
                    if n == 0:
                        return
                    got += n
                conn.sendall(buf)

    threads = []
    for _ in range(clients):
        conn, _ = srv.accept()
        thread = threading.Thread(target=serve, args=(conn,))
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()


def tcp_client(port: int, nbytes: int, iters: int, start_at: float) -> dict:
    data = memoryview(np.random.default_rng(0).bytes(nbytes))
    back = memoryview(bytearray(nbytes))
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(data)  # warm up, as the ps workers do
    got = 0
    while got < nbytes:
        got += sock.recv_into(back[got:])
    time.sleep(max(0.0, start_at - time.time()))
    start = time.time()
    for _ in range(iters):
        sock.sendall(data)
        got = 0
        while got < nbytes:
            got += sock.recv_into(back[got:])
    end = time.time()
    sock.close()
    return {"bytes": 2 * nbytes * iters, "start": start, "end": end}


# ----------------------------------------------------------------------------- towerflow traffic
def placement_100mb(numel: int):
    from towerflow.ps import plan_placement

    return plan_placement({f"layer{i}.weight": (numel // 4,) for i in range(4)}, 1)


def traffic_worker(cluster_json: str, worker_id: int, numel: int, iters: int,
                   start_at: float) -> dict:
    from towerflow.cluster import ClusterSpec
    from towerflow.ps import PSClient

    cluster = ClusterSpec(json.loads(cluster_json))
    plan = placement_100mb(numel)
    with PSClient(cluster, plan, worker_id=worker_id, timeout=120.0, push_timeout=300.0) as c:
        c.wait_until_initialized(60)
        params = [np.empty(s.numel, np.float32) for s in plan.shards]
        grads = [np.full(s.numel, 1e-6, np.float32) for s in plan.shards]
        c.pull(params)
        c.push(grads, lr=0.01, pull_into=params)  # warm up: first touch of every buffer
        time.sleep(max(0.0, start_at - time.time()))
        start = time.time()
        for _ in range(iters):
            c.push(grads, lr=0.01, pull_into=params)
        end = time.time()
    return {"bytes": 2 * numel * 4 * iters, "start": start, "end": end}


def linreg_worker(cluster_json: str, worker_id: int, steps: int, start_at: float) -> dict:
    import torch

    from towerflow.cluster import ClusterSpec, TaskInfo
    from towerflow.models.linear import LinearRegression, mse_loss, regression_data
    from towerflow.strategies import OptimizerConfig
    from towerflow.strategies.parameter_server import ParameterServer

    torch.set_num_threads(1)
    cluster = ClusterSpec(json.loads(cluster_json))
    strategy = ParameterServer(cluster, TaskInfo("worker", worker_id), device="cpu")
    data = regression_data(100)
    strategy.prepare(LinearRegression(), OptimizerConfig("sgd", lr=0.01))
    strategy.global_step  # the chief initialises here  # noqa: B018
    time.sleep(max(0.0, start_at - time.time()))
    start, local = time.time(), 0
    while strategy.global_step < steps:
        strategy.run_step(mse_loss, data)
        local += 1
    end = time.time()
    strategy.shutdown()
    return {"local_steps": local, "start": start, "end": end}


# ----------------------------------------------------------------------------- processes
def child_env(secret: str, tf_config: dict | None = None) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOWERFLOW_SECRET=secret)
    env.pop("TF_CONFIG", None)
    if tf_config is not None:
        env["TF_CONFIG"] = json.dumps(tf_config)
    return env


def run_role(role: str, env: dict[str, str], *args: object) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(HERE), "--role", role, *map(str, args)],
                            env=env, stdout=subprocess.PIPE, text=True)


def results(procs: list[subprocess.Popen]) -> list[dict]:
    out = []
    for proc in procs:
        stdout, _ = proc.communicate(timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"a benchmark process failed with status {proc.returncode}")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def aggregate(rows: list[dict], key: str = "bytes") -> tuple[float, float]:
    start, end = min(r["start"] for r in rows), max(r["end"] for r in rows)
    return sum(r[key] for r in rows), end - start


def vm_hwm(pid: int) -> int:
    """Peak resident memory of a process, bytes (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def free_ports(n: int) -> list[int]:
    from towerflow.cluster.launcher import free_ports as pick

    return pick(n)


class PsTask:
    """A ps process (``towerflow server`` with TF_CONFIG) for one measurement."""

    def __init__(self, secret: str, workers: int) -> None:
        ports = free_ports(1 + workers)
        self.cluster = {"ps": [f"127.0.0.1:{ports[0]}"],
                        "worker": [f"127.0.0.1:{p}" for p in ports[1:]]}
        tf_config = {"cluster": self.cluster, "task": {"type": "ps", "index": 0}}
        self.proc = subprocess.Popen([sys.executable, "-m", "towerflow", "server"],
                                     env=child_env(secret, tf_config),
                                     stderr=subprocess.DEVNULL)
        self.secret = secret

    def wait_ready(self) -> int:
        from towerflow.cluster import ClusterSpec
        from towerflow.cluster.transport import Credentials
        from towerflow.ps import PSClient

        plan = placement_100mb(4)
        c = PSClient(ClusterSpec(self.cluster), plan, worker_id=0,
                     credentials=Credentials(secret=self.secret.encode()), timeout=5.0)
        try:
            c.shards[0]._retrying(c.shards[0].status, 60.0)
        finally:
            c.close(done=False)
        import psutil

        return psutil.Process(self.proc.pid).memory_info().rss

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def init_ps(cluster: dict, secret: str, numel: int, mode: str, workers: int) -> None:
    from towerflow.cluster import ClusterSpec
    from towerflow.cluster.transport import Credentials
    from towerflow.ps import AggregationConfig, PSClient
    from towerflow.ps import ps_pb2 as pb

    plan = placement_100mb(numel)
    with PSClient(ClusterSpec(cluster), plan, worker_id=0,
                  credentials=Credentials(secret=secret.encode()), timeout=120.0) as c:
        c.initialize([np.zeros(s.numel, np.float32) for s in plan.shards],
                     optimizer=pb.OptimizerSpec(name="momentum", momentum=0.9),
                     aggregation=AggregationConfig(mode=mode, total_num_replicas=workers))


def measure_tcp(numel: int, clients: int, iters: int) -> float:
    port = free_ports(1)[0]
    env = child_env("x")
    server = run_role("tcp-server", env, port, numel * 4, clients)
    time.sleep(0.5)
    start_at = time.time() + 2.0
    rows = results([run_role("tcp-client", env, port, numel * 4, iters, start_at)
                    for _ in range(clients)])
    server.wait(30)
    total, seconds = aggregate(rows)
    return total / seconds / 1e9


def measure_traffic(numel: int, workers: int, iters: int, mode: str) -> dict:
    secret = os.urandom(16).hex()
    ps = PsTask(secret, workers)
    try:
        idle = ps.wait_ready()
        init_ps(ps.cluster, secret, numel, mode, workers)
        start_at = time.time() + 4.0
        rows = results([run_role("traffic-worker", child_env(secret), json.dumps(ps.cluster), w,
                                 numel, iters, start_at) for w in range(workers)])
        peak = vm_hwm(ps.proc.pid)
    finally:
        ps.stop()
    total, seconds = aggregate(rows)
    param_bytes = numel * 4
    return {"gbps": total / seconds / 1e9, "peak_rss": peak, "idle_rss": idle,
            "ratio": peak / param_bytes, "net_ratio": (peak - idle) / param_bytes}


def measure_linreg(steps: int) -> float:
    secret = os.urandom(16).hex()
    ps = PsTask(secret, 2)
    try:
        ps.wait_ready()
        start_at = time.time() + 3.0
        rows = results([run_role("linreg-worker", child_env(secret), json.dumps(ps.cluster), w,
                                 steps, start_at) for w in range(2)])
    finally:
        ps.stop()
    total, seconds = aggregate(rows, "local_steps")
    return total / seconds


def measure_tensorflow(tf_python: str, numel: int, iters: int, steps: int) -> dict:
    script = HERE.with_name("ps_throughput_tf.py")
    proc = subprocess.run([tf_python, str(script), "--numel", str(numel), "--iters", str(iters),
                           "--steps", str(steps)], capture_output=True, text=True, timeout=1200,
                          env=dict(os.environ, OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2"))
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", default="main")
    parser.add_argument("--model-mb", type=int, default=100)
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--linreg-steps", type=int, default=2000)
    parser.add_argument("--tf-python", default=None)
    parser.add_argument("rest", nargs="*")
    args = parser.parse_args()
    roles = {
        "tcp-server": lambda a: tcp_echo_server(int(a[0]), int(a[1]), int(a[2])),
        "tcp-client": lambda a: print(json.dumps(tcp_client(int(a[0]), int(a[1]), int(a[2]), float(a[3])))),
        "traffic-worker": lambda a: print(json.dumps(traffic_worker(a[0], int(a[1]), int(a[2]), int(a[3]), float(a[4])))),
        "linreg-worker": lambda a: print(json.dumps(linreg_worker(a[0], int(a[1]), int(a[2]), float(a[3])))),
    }
    if args.role != "main":
        roles[args.role](args.rest)
        return
    numel = args.model_mb * MB // 4
    print(f"model: {numel * 4 / MB:.0f} MB fp32, momentum on the ps; {args.iters} push+pull "
          f"round trips per worker; {os.cpu_count()} CPU cores")
    rows = []
    for workers in (1, 2):
        tcp = measure_tcp(numel, workers, args.iters)
        modes = ("async",) if workers == 1 else ("async", "sync")
        for mode in modes:
            r = measure_traffic(numel, workers, args.iters, mode)
            rows.append((workers, mode, r, tcp))
            print(f"{workers} worker(s) {mode:5s}: towerflow {r['gbps']:.2f} GB/s, raw TCP "
                  f"{tcp:.2f} GB/s, ratio {r['gbps'] / tcp:.2f}x (target >= 0.5x); ps peak RSS "
                  f"{r['peak_rss'] / MB:.0f} MB = {r['ratio']:.2f}x params "
                  f"({r['net_ratio']:.2f}x net of the idle server's {r['idle_rss'] / MB:.0f} MB; "
                  "target <= 3x)", flush=True)
    steps_per_sec = measure_linreg(args.linreg_steps)
    print(f"article 003 linear regression, 1 ps + 2 workers: {steps_per_sec:.0f} steps/s total",
          flush=True)
    if args.tf_python:
        tf = measure_tensorflow(args.tf_python, numel, args.iters, args.linreg_steps)
        mine = rows[0][2]["gbps"]
        print(f"TensorFlow {tf['version']} ps runtime, 1 worker: {tf['gbps']:.2f} GB/s -> towerflow "
              f"{mine / tf['gbps']:.2f}x (target >= 2x)")
        print(f"TensorFlow linear regression, 1 ps + 2 workers: {tf['steps_per_sec']:.0f} steps/s "
              f"-> towerflow {steps_per_sec / tf['steps_per_sec']:.2f}x (target >= 2x)")
    else:
        print("TensorFlow comparison skipped (pass --tf-python PATH to a python with tensorflow-cpu)")


if __name__ == "__main__":
    main()
