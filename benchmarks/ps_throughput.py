"""Parameter-server figures: traffic GB/s vs raw loopback TCP, ps memory, linear-regression steps/s.

Everything runs on this machine in one invocation, every task a real process:

1. Baselines on the same topology as the ps runs (one server process, 1 or 2
   client processes, each sending the 100 MB model and receiving it back):
   raw loopback TCP (the ceiling of any transport here), and bare Python gRPC
   (1 MiB chunks streamed and echoed back as they are: what gRPC itself costs
   before towerflow does anything).
2. Parameter traffic: a ps task (``towerflow server``) holding a 100 MB fp32
   model with momentum, and 1 or 2 worker processes doing push-and-pull
   round trips (push 100 MB of gradients, receive 100 MB of parameters): GB/s
   of push + pull, and the ratio to (1) (target >= 0.5x). Async with 1 and 2
   workers, and sync with 2 workers.
3. Memory: the ps process's peak resident memory (VmHWM) against its parameter
   bytes, for each run (target <= 3x with momentum, whatever the number of
   workers), also net of the idle server's own memory.
   The cost of authentication: 1 worker with and without the cluster secret.
4. Article 003: linear regression with 1 ps and 2 workers: total steps/s.
5. TensorFlow (when ``--tf-python`` names an interpreter with tensorflow-cpu):
   the same traffic and the same linear regression with ``tf.compat.v1``
   ``Server`` + ``replica_device_setter``.

Usage::

    python benchmarks/ps_throughput.py                     # towerflow only
    python benchmarks/ps_throughput.py --tf-python /tmp/tfvenv/bin/python
    python benchmarks/ps_throughput.py --poll-status       # + the live view's cost
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


# ----------------------------------------------------------------------------- bare gRPC
def grpc_echo_server(port: int, clients: int) -> None:
    """Python gRPC with nothing on top: a stream of chunks in, the same chunks back."""
    from concurrent import futures

    import grpc

    from towerflow.ps.memory import tune_malloc

    tune_malloc(one_arena=True)

    def echo(requests, context):  # noqa: ANN001, ANN202
        yield from list(requests)

    server = grpc.server(futures.ThreadPoolExecutor(4 * clients), options=GRPC_OPTIONS)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "echo.Echo", {"Echo": grpc.stream_stream_rpc_method_handler(echo)}),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination(timeout=300)


def grpc_echo_client(port: int, nbytes: int, iters: int, start_at: float) -> dict:
    import grpc

    from towerflow.ps.memory import tune_malloc
    from towerflow.ps.wire.framing import CHUNK_BYTES

    tune_malloc()
    data = np.random.default_rng(0).bytes(nbytes)
    chunks = [data[i:i + CHUNK_BYTES] for i in range(0, nbytes, CHUNK_BYTES)]
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS)
    grpc.channel_ready_future(channel).result(timeout=30)
    echo = channel.stream_stream("/echo.Echo/Echo")
    for _ in echo(iter(chunks)):  # warm up
        pass
    time.sleep(max(0.0, start_at - time.time()))
    start = time.time()
    for _ in range(iters):
        got = sum(len(c) for c in echo(iter(chunks)))
        if got != nbytes:
            raise RuntimeError(f"echo returned {got} of {nbytes} bytes")
    end = time.time()
    channel.close()
    return {"bytes": 2 * nbytes * iters, "start": start, "end": end}


GRPC_OPTIONS = [("grpc.max_send_message_length", 64 << 20),
                ("grpc.max_receive_message_length", 64 << 20)]


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
def child_env(secret: str | None, tf_config: dict | None = None) -> dict[str, str]:
    """The environment of a benchmark process; ``secret`` None: no authentication."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for key in ("TF_CONFIG", "TOWERFLOW_SECRET", "TOWERFLOW_SECRET_FILE"):
        env.pop(key, None)
    if secret is not None:
        env["TOWERFLOW_SECRET"] = secret
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

    def __init__(self, secret: str | None, workers: int) -> None:
        ports = free_ports(1 + workers)
        self.cluster = {"ps": [f"127.0.0.1:{ports[0]}"],
                        "worker": [f"127.0.0.1:{p}" for p in ports[1:]]}
        tf_config = {"cluster": self.cluster, "task": {"type": "ps", "index": 0}}
        self.proc = subprocess.Popen([sys.executable, "-m", "towerflow", "server",
                                      "--serve-forever"],
                                     env=child_env(secret, tf_config),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.secret = secret

    def wait_ready(self) -> int:
        from towerflow.cluster import ClusterSpec
        from towerflow.ps import PSClient

        plan = placement_100mb(4)
        c = PSClient(ClusterSpec(self.cluster), plan, worker_id=0,
                     credentials=credentials(self.secret), timeout=5.0)
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


def credentials(secret: str | None):  # noqa: ANN201 - towerflow Credentials
    from towerflow.cluster.transport import Credentials

    return Credentials(secret=None if secret is None else secret.encode())


def init_ps(cluster: dict, secret: str | None, numel: int, mode: str, workers: int) -> None:
    from towerflow.cluster import ClusterSpec
    from towerflow.ps import AggregationConfig, PSClient
    from towerflow.ps.wire import ps_pb2 as pb

    plan = placement_100mb(numel)
    with PSClient(ClusterSpec(cluster), plan, worker_id=0, credentials=credentials(secret),
                  timeout=120.0) as c:
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


def measure_grpc(numel: int, clients: int, iters: int) -> float:
    port = free_ports(1)[0]
    env = child_env(None)
    server = run_role("grpc-server", env, port, clients)
    try:
        start_at = time.time() + 3.0
        rows = results([run_role("grpc-client", env, port, numel * 4, iters, start_at)
                        for _ in range(clients)])
    finally:
        server.terminate()
        server.wait(30)
    total, seconds = aggregate(rows)
    return total / seconds / 1e9


def status_poller(cluster: dict, secret: str | None) -> subprocess.Popen:
    """``towerflow status --json`` polling the ps every second (the live view), output dropped."""
    tf_config = {"cluster": cluster, "task": {"type": "ps", "index": 0}}
    return subprocess.Popen([sys.executable, "-m", "towerflow", "status", "--json",
                             "--interval", "1"], env=child_env(secret, tf_config),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def measure_traffic(numel: int, workers: int, iters: int, mode: str, auth: bool = True,
                    poll: bool = False) -> dict:
    secret = os.urandom(16).hex() if auth else None
    ps = PsTask(secret, workers)
    poller = None
    try:
        idle = ps.wait_ready()
        init_ps(ps.cluster, secret, numel, mode, workers)
        poller = status_poller(ps.cluster, secret) if poll else None
        start_at = time.time() + 4.0
        rows = results([run_role("traffic-worker", child_env(secret), json.dumps(ps.cluster), w,
                                 numel, iters, start_at) for w in range(workers)])
        peak = vm_hwm(ps.proc.pid)
    finally:
        if poller is not None:
            poller.terminate()
            poller.wait(10)
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


def auth_seconds_per_call(calls: int = 5000) -> float:
    """Seconds a client's auth token plus the server's check of it take, per call."""
    from towerflow.cluster.auth import AuthInterceptor, make_token

    secret, method = os.urandom(32).hex().encode(), "/towerflow.ps.PS/PushPull"
    check = AuthInterceptor(secret, task="/job:ps/replica:0/task:0")
    header = os.urandom(64)  # a push's first message, whose digest the token binds
    start = time.perf_counter()
    for _ in range(calls):
        if check.check(method, make_token(secret, method, check.identity, header)) is not None:
            raise RuntimeError("a fresh auth token was refused")
    return (time.perf_counter() - start) / calls


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
    parser.add_argument("--repeats", type=int, default=2,
                        help="interleaved rounds; each figure is the best of them")
    parser.add_argument("--poll-status", action="store_true",
                        help="also measure async traffic while `towerflow status` polls the ps "
                        "every second, and report the cost of its statistics")
    parser.add_argument("rest", nargs="*")
    args = parser.parse_args()
    roles = {
        "tcp-server": lambda a: tcp_echo_server(int(a[0]), int(a[1]), int(a[2])),
        "tcp-client": lambda a: print(json.dumps(tcp_client(int(a[0]), int(a[1]), int(a[2]), float(a[3])))),
        "traffic-worker": lambda a: print(json.dumps(traffic_worker(a[0], int(a[1]), int(a[2]), int(a[3]), float(a[4])))),
        "grpc-server": lambda a: grpc_echo_server(int(a[0]), int(a[1])),
        "grpc-client": lambda a: print(json.dumps(grpc_echo_client(int(a[0]), int(a[1]), int(a[2]), float(a[3])))),
        "linreg-worker": lambda a: print(json.dumps(linreg_worker(a[0], int(a[1]), int(a[2]), float(a[3])))),
    }
    if args.role != "main":
        roles[args.role](args.rest)
        return
    numel = args.model_mb * MB // 4
    print(f"model: {numel * 4 / MB:.0f} MB fp32, momentum on the ps; {args.iters} push+pull "
          f"round trips per worker; {os.cpu_count()} CPU cores; every figure is the best of "
          f"{args.repeats} interleaved rounds (peak memory: the worst)", flush=True)
    rounds = [run_round(args, numel, r) for r in range(args.repeats)]
    report(rounds, args)


CASES = (("tcp", 1), ("tcp", 2), ("grpc", 1), ("grpc", 2), ("async", 1), ("async", 2),
         ("sync", 2), ("async-noauth", 1))


def run_round(args: argparse.Namespace, numel: int, index: int) -> dict:
    """Every measurement once; a line per figure so a slow run shows its progress."""
    out: dict = {}
    cases = CASES + ((("async-poll", 1), ("async-poll", 2)) if args.poll_status else ())
    for kind, n in cases:
        if kind == "tcp":
            out[kind, n] = measure_tcp(numel, n, args.iters)
        elif kind == "grpc":
            out[kind, n] = measure_grpc(numel, n, args.iters)
        else:
            mode, _, variant = kind.partition("-")
            out[kind, n] = measure_traffic(numel, n, args.iters, mode,
                                           auth=variant != "noauth", poll=variant == "poll")
        value = out[kind, n] if isinstance(out[kind, n], float) else out[kind, n]["gbps"]
        print(f"  round {index + 1}: {kind} x{n}: {value:.2f} GB/s", flush=True)
    out["linreg"] = measure_linreg(args.linreg_steps)
    print(f"  round {index + 1}: linear regression {out['linreg']:.0f} steps/s", flush=True)
    if args.tf_python:
        out["tf"] = measure_tensorflow(args.tf_python, numel, args.iters, args.linreg_steps)
        print(f"  round {index + 1}: TensorFlow {out['tf']['gbps']:.2f} GB/s, "
              f"{out['tf']['steps_per_sec']:.0f} steps/s", flush=True)
    return out


def report(rounds: list[dict], args: argparse.Namespace) -> None:
    def best(key) -> float:  # noqa: ANN001
        values = [r[key] if isinstance(r[key], float) else r[key]["gbps"] for r in rounds]
        return max(values)

    def worst(key, field: str) -> float:  # noqa: ANN001
        return max(r[key][field] for r in rounds)

    print("baselines, same topology as the ps runs (1 server process, N client processes, each "
          "sending the model and receiving it back):")
    for n in (1, 2):
        print(f"  {n} client(s): raw loopback TCP {best(('tcp', n)):.2f} GB/s; bare Python gRPC "
              f"(1 MiB chunks echoed back, no copy, no work) {best(('grpc', n)):.2f} GB/s")
    for kind, n in (("async", 1), ("async", 2), ("sync", 2)):
        gbps = best((kind, n))
        print(f"{n} worker(s) {kind:5s}: towerflow {gbps:.2f} GB/s = "
              f"{gbps / best(('tcp', n)):.2f}x raw TCP (target >= 0.5x), "
              f"{gbps / best(('grpc', n)):.2f}x bare gRPC; ps peak RSS "
              f"{worst((kind, n), 'peak_rss') / MB:.0f} MB = {worst((kind, n), 'ratio'):.2f}x "
              f"params, {worst((kind, n), 'net_ratio'):.2f}x net of the idle server's "
              f"{worst((kind, n), 'idle_rss') / MB:.0f} MB (target <= 3x)")
    auth, plain = best(("async", 1)), best(("async-noauth", 1))
    per_call = auth_seconds_per_call()
    round_trip = 2 * args.model_mb * MB / (auth * 1e9)
    print(f"authentication: 1 worker async {auth:.2f} GB/s with the cluster secret, {plain:.2f} "
          f"GB/s without -> cost {100 * (1 - auth / plain):.1f}% (target < 5%); the check itself "
          f"(token + HMAC verify + nonce) takes {per_call * 1e6:.1f} us per call = "
          f"{100 * per_call / round_trip:.4f}% of a {round_trip * 1e3:.0f} ms push+pull call")
    if args.poll_status:
        for n in (1, 2):
            quiet, polled = best(("async", n)), best(("async-poll", n))
            print(f"live view: {n} worker(s) async {polled:.2f} GB/s while `towerflow status` "
                  f"polls every second, {quiet:.2f} GB/s without -> cost "
                  f"{100 * (1 - polled / quiet):.1f}% (target < 2%)")
    linreg = max(r["linreg"] for r in rounds)
    print(f"article 003 linear regression, 1 ps + 2 workers: {linreg:.0f} steps/s total")
    if not args.tf_python:
        print("TensorFlow comparison skipped (pass --tf-python PATH to a python with tensorflow-cpu)")
        return
    tf_gbps = max(r["tf"]["gbps"] for r in rounds)
    tf_steps = max(r["tf"]["steps_per_sec"] for r in rounds)
    print(f"TensorFlow {rounds[0]['tf']['version']} ps runtime, 1 worker: {tf_gbps:.2f} GB/s -> "
          f"towerflow (authenticated) {auth / tf_gbps:.2f}x (target >= 2x; TensorFlow has no "
          f"authentication, towerflow without it: {plain / tf_gbps:.2f}x)")
    print(f"TensorFlow linear regression, 1 ps + 2 workers: {tf_steps:.0f} steps/s -> towerflow "
          f"{linreg / tf_steps:.2f}x (target >= 2x)")

if __name__ == "__main__":
    main()
