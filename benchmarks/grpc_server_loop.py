"""The ps server loop: ``grpc.aio`` on one event loop against the thread-pool server.

A ps task serves its row stream and its dense push-and-pull with
``grpc.server(ThreadPoolExecutor)`` and synchronous handlers. This benchmark
serves the same two kinds of traffic, with the same per-message work, from
three servers, each in its own process on 127.0.0.1:

* ``thread``: ``grpc.server(futures.ThreadPoolExecutor(256))`` with
  synchronous handlers and the ps task's server options (message size,
  keepalive, the fixed 2 MiB stream window): the form a ps task uses today;
* ``aio-loop``: ``grpc.aio.server()`` with async handlers; the work runs in
  the event loop's one thread;
* ``aio-executor``: the same, the work handed to a small thread pool with
  ``loop.run_in_executor`` (the apply beside the loop, not in it).

Traffic, from 2 and 8 client processes (sync gRPC clients, ``OMP_NUM_THREADS=1``):

* ``rows``: one long-lived stream per client; each request carries 1,200
  random ids of a 1M x 32 fp32 table plus the previous request's ids with
  1,200 x 32 fp32 row gradients (a deferred push); the server applies a
  row-wise Adagrad update to the pushed rows and gathers the requested rows
  under the table's lock, and replies with the 1,200 x 32 rows; a client
  sends its next request when the reply has come (a worker's step);
* ``dense``: each call pushes a 25M-float gradient in 1 MiB chunks, each
  applied on arrival (a saxpy into a 25M-float buffer under a per-chunk
  lock), then streams the whole buffer back in 1 MiB chunks.

Per (traffic, clients, server) it prints requests/s (rows) or GB/s of push
plus pull (dense), the server process's CPU seconds per request (user +
system over the measured window; a dense request is one 100 MB round trip),
and the ratio to the thread-pool server measured in the same round. Rounds
are interleaved (the servers' order rotates each round) and the figures are
medians over rounds. Before measuring, every server kind answers the same
requests as a local reference (``--check`` runs only that, on small sizes).

Usage::

    python benchmarks/grpc_server_loop.py                       # 3 rounds x 5 s: ~6 minutes
    python benchmarks/grpc_server_loop.py --rounds 5 --seconds 8 --clients 2 8
    python benchmarks/grpc_server_loop.py --check               # the answers only, seconds
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent import futures
from pathlib import Path

import numpy as np

from towerflow.ps.wire.framing import CHUNK_BYTES, pack, unpack

HERE = Path(__file__).resolve()
SERVICE = "bench.ServerLoop"
KINDS = ("thread", "aio-loop", "aio-executor")
TRAFFIC = ("rows", "dense")
LR = np.float32(0.01)
_ROWS_HEADER = struct.Struct("<iii")  # ids, pushed ids, row width


# ----------------------------------------------------------------------------- the work
def encode_rows(ids: np.ndarray, push_ids: np.ndarray, grads: np.ndarray) -> bytes:
    """A row request: the header, then the ids, the pushed ids and their gradients, raw."""
    header = _ROWS_HEADER.pack(ids.size, push_ids.size, grads.shape[1] if grads.ndim == 2 else 0)
    return pack(header, b"".join((ids.tobytes(), push_ids.tobytes(), grads.tobytes())))


def decode_rows(message: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(ids, push_ids, grads)`` of :func:`encode_rows`, as views over ``message``."""
    header, payload = unpack(message)
    n, pushed, dim = _ROWS_HEADER.unpack(header)
    ids = np.frombuffer(payload, np.int64, n)
    push_ids = np.frombuffer(payload, np.int64, pushed, offset=8 * n)
    grads = np.frombuffer(payload, np.float32, pushed * dim, offset=8 * (n + pushed))
    return ids, push_ids, grads.reshape(pushed, dim)


class RowTable:
    """A ``rows x dim`` fp32 table with a row-wise Adagrad accumulator, behind one lock."""

    def __init__(self, rows: int, dim: int) -> None:
        rng = np.random.default_rng(0)
        self.weights = rng.standard_normal((rows, dim), dtype=np.float32)
        self.weights *= np.float32(0.01)
        self.accum = np.full(rows, 0.1, np.float32)
        self.lock = threading.Lock()

    def step(self, message: bytes) -> bytes:
        """Apply the pushed rows (row-wise Adagrad), then gather the requested rows."""
        ids, push_ids, grads = decode_rows(message)
        with self.lock:
            if push_ids.size:
                self.accum[push_ids] += np.mean(np.square(grads), axis=1)
                scale = LR / np.sqrt(self.accum[push_ids])
                self.weights[push_ids] -= grads * scale[:, None]
            rows = self.weights[ids]
        return rows.tobytes()


class DenseBuffer:
    """A flat fp32 buffer updated and read in ``CHUNK_BYTES`` chunks, a lock per chunk."""

    def __init__(self, numel: int) -> None:
        self.params = (np.arange(numel, dtype=np.int64) % 997).astype(np.float32)
        self.step_elems = CHUNK_BYTES // 4
        self.chunks = -(-numel // self.step_elems)
        self.locks = [threading.Lock() for _ in range(self.chunks)]

    def apply(self, index: int, chunk: bytes) -> None:
        """``params[chunk index] -= lr * gradient chunk``."""
        grad = np.frombuffer(chunk, np.float32)
        start = index * self.step_elems
        with self.locks[index]:
            view = self.params[start:start + grad.size]
            view -= LR * grad

    def read(self, index: int) -> bytes:
        """One chunk of the parameters (a copy taken under its lock)."""
        start = index * self.step_elems
        with self.locks[index]:
            return self.params[start:start + self.step_elems].tobytes()


# ----------------------------------------------------------------------------- servers
def _generic(rows: Callable, dense: Callable):  # noqa: ANN202 - grpc.GenericRpcHandler
    import grpc

    return grpc.method_handlers_generic_handler(SERVICE, {
        "rows": grpc.stream_stream_rpc_method_handler(rows),
        "dense": grpc.stream_stream_rpc_method_handler(dense),
    })


def thread_handlers(table: RowTable | None, dense: DenseBuffer | None):  # noqa: ANN201
    def rows(requests: Iterator[bytes], context: object) -> Iterator[bytes]:
        for message in requests:
            yield table.step(message)

    def push_pull(requests: Iterator[bytes], context: object) -> Iterator[bytes]:
        for index, chunk in enumerate(requests):
            dense.apply(index, chunk)
        for index in range(dense.chunks):
            yield dense.read(index)

    return _generic(rows, push_pull)


def aio_handlers(table: RowTable | None, dense: DenseBuffer | None,
                 pool: futures.ThreadPoolExecutor | None):  # noqa: ANN201
    """Async handlers; the work in the loop (``pool`` None) or in ``pool``."""

    async def run(fn: Callable, *args: object) -> object:
        if pool is None:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    async def rows(requests: AsyncIterator[bytes], context: object) -> AsyncIterator[bytes]:
        async for message in requests:
            yield await run(table.step, message)

    async def push_pull(requests: AsyncIterator[bytes], context: object) -> AsyncIterator[bytes]:
        index = 0
        async for chunk in requests:
            await run(dense.apply, index, chunk)
            index += 1
        for index in range(dense.chunks):
            yield await run(dense.read, index)

    return _generic(rows, push_pull)


def grpc_server_options() -> list:
    from towerflow.cluster.transport import ChannelOptions

    return ChannelOptions().server_options()


def grpc_channel_options() -> list:
    from towerflow.cluster.transport import ChannelOptions

    return ChannelOptions().grpc_options()


def serve(kind: str, traffic: list[str], args: argparse.Namespace) -> None:
    """Serve until stdin closes; the bound port is the first line on stdout."""
    import grpc

    from towerflow.cluster.options import ServerOptions
    from towerflow.ps.memory import tune_malloc

    tune_malloc(one_arena=True)  # as a ps task does
    table = RowTable(args.table_rows, args.dim) if "rows" in traffic else None
    dense = DenseBuffer(args.dense_numel) if "dense" in traffic else None
    if kind == "thread":
        server = grpc.server(futures.ThreadPoolExecutor(ServerOptions().max_workers),
                             options=grpc_server_options())
        server.add_generic_rpc_handlers((thread_handlers(table, dense),))
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        print(json.dumps({"port": port}), flush=True)
        sys.stdin.read()
        server.stop(0).wait()
        return

    async def main() -> None:
        pool = None if kind == "aio-loop" else futures.ThreadPoolExecutor(args.apply_threads)
        server = grpc.aio.server(options=grpc_server_options())
        server.add_generic_rpc_handlers((aio_handlers(table, dense, pool),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(json.dumps({"port": port}), flush=True)
        waiter = threading.Thread(target=sys.stdin.read, daemon=True)
        waiter.start()
        while waiter.is_alive():
            await asyncio.sleep(0.2)
        await server.stop(0)
        if pool is not None:
            pool.shutdown()

    asyncio.run(main())


# ----------------------------------------------------------------------------- clients
class Window:
    """Counts what happens between ``start`` and ``end`` (wall-clock seconds)."""

    def __init__(self, start: float = 0.0, end: float = 0.0) -> None:
        self.start, self.end, self.count = start, end, 0

    def add(self, amount: int) -> None:
        if self.start <= time.time() <= self.end:
            self.count += amount


class RowsClient:
    """One worker's row stream: a request per step, the next once the reply came."""

    def __init__(self, channel, args: argparse.Namespace, seed: int) -> None:  # noqa: ANN001
        self.rng = np.random.default_rng(seed)
        self.rows, self.dim = args.table_rows, args.dim
        self.grads = (self.rng.standard_normal((args.batch, args.dim), dtype=np.float32)
                      * np.float32(0.01))
        self.batch = args.batch
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.replies = channel.stream_stream(f"/{SERVICE}/rows")(iter(self.queue.get, None))
        self.previous = np.empty(0, np.int64)

    def request(self) -> bytes:
        ids = self.rng.integers(0, self.rows, self.batch, dtype=np.int64)
        grads = self.grads if self.previous.size else np.empty((0, self.dim), np.float32)
        message = encode_rows(ids, self.previous, grads)
        self.previous = ids
        return message

    def step(self, window: Window, message: bytes | None = None) -> bytes:
        self.queue.put(self.request() if message is None else message)
        reply = next(self.replies)
        if len(reply) != self.batch * self.dim * 4:
            raise RuntimeError(f"a rows reply of {len(reply)} bytes, expected "
                               f"{self.batch * self.dim * 4}")
        window.add(1)
        return reply

    def close(self) -> None:
        self.queue.put(None)
        for _ in self.replies:
            pass


class DenseClient:
    """One worker's dense round trips: push the gradient in chunks, receive the parameters."""

    def __init__(self, channel, args: argparse.Namespace, seed: int) -> None:  # noqa: ANN001
        nbytes = args.dense_numel * 4
        grad = np.full(CHUNK_BYTES // 4, 1e-6, np.float32).tobytes()
        count = -(-nbytes // CHUNK_BYTES)
        self.chunks = [grad] * (count - 1) + [grad[:nbytes - (count - 1) * CHUNK_BYTES]]
        self.nbytes = nbytes
        self.call = channel.stream_stream(f"/{SERVICE}/dense")

    def step(self, window: Window, chunks: list[bytes] | None = None) -> bytes:
        def sent() -> Iterator[bytes]:
            for chunk in chunks or self.chunks:
                window.add(len(chunk))
                yield chunk

        back = []  # kept only for a check's own chunks
        for chunk in self.call(sent()):
            window.add(len(chunk))
            if chunks is not None:
                back.append(chunk)
        return b"".join(back)

    def close(self) -> None:
        pass


def client(traffic: str, port: int, seed: int, args: argparse.Namespace) -> None:
    """Warm up, say ``ready``, read the window's start from stdin, load until its end."""
    import grpc

    from towerflow.ps.memory import tune_malloc

    tune_malloc()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=grpc_channel_options())
    grpc.channel_ready_future(channel).result(timeout=60)
    load = (RowsClient if traffic == "rows" else DenseClient)(channel, args, seed)
    idle = Window()
    for _ in range(20 if traffic == "rows" else 1):
        load.step(idle)
    print("ready", flush=True)
    start = float(sys.stdin.readline())
    window = Window(start, start + args.seconds)
    while time.time() < window.end:
        load.step(window)
    load.close()
    channel.close()
    print(json.dumps({"count": window.count}), flush=True)


# ----------------------------------------------------------------------------- the parent
def role_args(args: argparse.Namespace) -> list[str]:
    return ["--table-rows", str(args.table_rows), "--dim", str(args.dim),
            "--batch", str(args.batch), "--dense-numel", str(args.dense_numel),
            "--seconds", str(args.seconds), "--apply-threads", str(args.apply_threads)]


def spawn(args: argparse.Namespace, *role: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, str(HERE), "--role", *role, *role_args(args)],
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


class ServerProcess:
    """A server of one kind in its own process (stopped by closing its stdin)."""

    def __init__(self, args: argparse.Namespace, kind: str, traffic: list[str]) -> None:
        self.proc = spawn(args, "server", kind, ",".join(traffic))
        line = self.proc.stdout.readline()
        if not line:
            self.stop()
            raise RuntimeError(f"the {kind} server ended before it listened "
                               f"(status {self.proc.returncode})")
        self.port = json.loads(line)["port"]

    def cpu(self) -> float:
        import psutil

        times = psutil.Process(self.proc.pid).cpu_times()
        return times.user + times.system

    def stop(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
        self.proc.stdout.close()


def measure(args: argparse.Namespace, traffic: str, clients: int, kind: str) -> dict:
    """One measurement: a fresh server, ``clients`` client processes, one window."""
    server = ServerProcess(args, kind, [traffic])
    procs = [spawn(args, "client", traffic, str(server.port), str(seed))
             for seed in range(clients)]
    try:
        for proc in procs:
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a {traffic} client of the {kind} server failed to start")
        start = time.time() + 0.5  # every client loads for 0.5 s before the window opens
        for proc in procs:
            proc.stdin.write(f"{start!r}\n")
            proc.stdin.flush()
        time.sleep(max(0.0, start - time.time()))
        cpu0 = server.cpu()
        time.sleep(max(0.0, start + args.seconds - time.time()))
        cpu = server.cpu() - cpu0
        counts = []
        for proc in procs:
            out, _ = proc.communicate(timeout=args.seconds + 300)
            if proc.returncode != 0:
                raise RuntimeError(f"a {traffic} client of the {kind} server failed "
                                   f"(status {proc.returncode})")
            counts.append(json.loads(out.strip().splitlines()[-1])["count"])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
        server.stop()
    total = sum(counts)
    requests = total if traffic == "rows" else total / (2 * args.dense_numel * 4)
    rate = total / args.seconds if traffic == "rows" else total / args.seconds / 1e9
    return {"traffic": traffic, "clients": clients, "kind": kind, "rate": rate,
            "cpu_per_request": cpu / requests if requests else float("nan"), "cpu": cpu}


def check(args: argparse.Namespace) -> None:
    """Every server kind answers the same row and dense requests as a local reference."""
    import grpc

    small = argparse.Namespace(**{**vars(args), "table_rows": 1000, "dim": 8, "batch": 50,
                                  "dense_numel": (CHUNK_BYTES // 4) * 2 + 1000})
    rng = np.random.default_rng(7)
    requests = []
    previous = np.empty(0, np.int64)
    for _ in range(4):
        ids = rng.integers(0, small.table_rows, small.batch, dtype=np.int64)
        grads = rng.standard_normal((previous.size, small.dim), dtype=np.float32)
        requests.append(encode_rows(ids, previous, grads))
        previous = ids
    table, dense = RowTable(small.table_rows, small.dim), DenseBuffer(small.dense_numel)
    want_rows = [table.step(message) for message in requests]
    grad = rng.standard_normal(small.dense_numel, dtype=np.float32).tobytes()
    pushed = [grad[i:i + CHUNK_BYTES] for i in range(0, len(grad), CHUNK_BYTES)]
    for index, chunk in enumerate(pushed):
        dense.apply(index, chunk)
    want_dense = dense.params.tobytes()
    for kind in KINDS:
        server = ServerProcess(small, kind, list(TRAFFIC))
        try:
            with grpc.insecure_channel(f"127.0.0.1:{server.port}",
                                       options=grpc_channel_options()) as channel:
                rows = RowsClient(channel, small, 0)
                got = [rows.step(Window(), message) for message in requests]
                rows.close()
                got_dense = DenseClient(channel, small, 0).step(Window(), pushed)
        finally:
            server.stop()
        if got != want_rows or got_dense != want_dense:
            raise RuntimeError(f"the {kind} server's answers differ from the reference "
                               f"(rows {'same' if got == want_rows else 'differ'}, dense "
                               f"{'same' if got_dense == want_dense else 'differ'})")
        print(f"check: {kind} server answers rows and dense as the reference", flush=True)


def summary(results: list[dict]) -> list[dict]:
    """Medians per (traffic, clients, kind) and the median of each round's ratio to ``thread``."""
    by_round: dict[tuple, dict] = {}
    for row in results:
        by_round.setdefault((row["round"], row["traffic"], row["clients"]), {})[row["kind"]] = row
    lines = []
    keys = sorted({(r["traffic"], r["clients"], r["kind"]) for r in results},
                  key=lambda k: (TRAFFIC.index(k[0]), k[1], KINDS.index(k[2])))
    for traffic, clients, kind in keys:
        rounds = [runs for (_, t, c), runs in sorted(by_round.items())
                  if (t, c) == (traffic, clients) and kind in runs and "thread" in runs]
        lines.append({
            "traffic": traffic, "clients": clients, "kind": kind,
            "rate": statistics.median(runs[kind]["rate"] for runs in rounds),
            "cpu_per_request": statistics.median(runs[kind]["cpu_per_request"]
                                                 for runs in rounds),
            "ratio": statistics.median(runs[kind]["rate"] / runs["thread"]["rate"]
                                       for runs in rounds),
            "cpu_ratio": statistics.median(runs[kind]["cpu_per_request"]
                                           / runs["thread"]["cpu_per_request"]
                                           for runs in rounds),
            "ratios": [round(runs[kind]["rate"] / runs["thread"]["rate"], 3) for runs in rounds],
        })
    return lines


def report(lines: list[dict]) -> None:
    print("\n| traffic | clients | server | rate (median) | server CPU / request | "
          "ratio to thread (median) | CPU ratio | per-round ratios |")
    print("|---|---|---|---|---|---|---|---|")
    for line in lines:
        unit, cpu_unit, scale = (("req/s", "ms", 1e3) if line["traffic"] == "rows"
                                 else ("GB/s", "ms / round trip", 1e3))
        rate = f"{line['rate']:,.0f} {unit}" if line["traffic"] == "rows" \
            else f"{line['rate']:.2f} {unit}"
        print(f"| {line['traffic']} | {line['clients']} | {line['kind']} | {rate} | "
              f"{line['cpu_per_request'] * scale:.3f} {cpu_unit} | {line['ratio']:.3f} | "
              f"{line['cpu_ratio']:.3f} | {', '.join(map(str, line['ratios']))} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0, help="per measurement window")
    parser.add_argument("--clients", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--traffic", nargs="+", choices=TRAFFIC, default=list(TRAFFIC))
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--table-rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1200)
    parser.add_argument("--dense-numel", type=int, default=25_000_000)
    parser.add_argument("--apply-threads", type=int, default=2,
                        help="threads of the aio-executor server's pool")
    parser.add_argument("--check", action="store_true", help="only check the servers' answers")
    parser.add_argument("--json", type=Path, help="write every measurement and the medians here")
    parser.add_argument("--role", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        if args.role[0] == "server":
            serve(args.role[1], args.role[2].split(","), args)
        else:
            client(args.role[1], int(args.role[2]), int(args.role[3]), args)
        return
    check(args)
    if args.check:
        return
    if "thread" not in args.kinds:
        parser.error("--kinds must include thread, the baseline of every ratio")
    results = []
    for round_index in range(args.rounds):
        turn = round_index % len(args.kinds)
        order = args.kinds[turn:] + args.kinds[:turn]
        for traffic in args.traffic:
            for clients in args.clients:
                for kind in order:
                    row = measure(args, traffic, clients, kind)
                    row["round"] = round_index
                    results.append(row)
                    print(f"round {round_index}: {traffic} x{clients} {kind}: "
                          f"{row['rate']:,.2f} {'req/s' if traffic == 'rows' else 'GB/s'}, "
                          f"server CPU {row['cpu']:.2f} s", flush=True)
    lines = summary(results)
    report(lines)
    if args.json:
        args.json.write_text(json.dumps({"runs": results, "medians": lines}, indent=1))


if __name__ == "__main__":
    main()
