"""A ps task's CPU per row request, taken apart: the carrier, towerflow's stack, the handler.

The click benchmark's ps task (``sparse_embedding.py``, 2 ps + 2 workers) spends 1.2-1.5 ms
of CPU per row request, its handler alone (``ps_request_costs.py``) ~0.59 ms, a bare gRPC
stream (``transport_compare.py``) 0.18-0.27 ms. What lies between, side by side: a server
process per variant, 1 and 2 client processes on 127.0.0.1, each with one ``RowBatchStream``
per server (``RowStream`` on a ``make_channel`` channel, as ``TableClient``), the next
request sent when the reply has come. A request is a click step's to ps 0 of 2 (``batch_call``):
the ~1,200 ids shard 0 owns of a 512 x 16 Zipf(1.2) batch over 1M rows pulled, the previous
step's pushed with their fp32 row gradients (the deferred push), a fresh ``seq``.

* ``grpc``: the bare carrier: ``grpc.server`` (the ps's thread pool and options), no
  interceptors, a prepared reply yielded per request (``transport_compare``'s grpc-stream);
* ``stack``: ``towerflow.Server(cluster, "ps", 0)`` with the cluster secret (health gate,
  ``AuthInterceptor``, ``StreamLimiter``, ``FrameInterceptor``, ``_wrap``,
  ``TableService._each_request``) hosting the ps's ``ShardHost`` and a ``TableService`` whose
  ``row_batch`` returns a prepared reply of the real size (no table work);
* ``stack-noauth`` / ``-noframes`` / ``-nolimit``: ``stack`` less that interceptor (no secret
  on either end, or a pass-through in its place); ``stack-none``: less all three;
* ``full``: the real ps task (``ShardHost``, ``TableHost``): ``row_batch`` on shard 0 of a
  1M x 32 table split over 2 ps tasks, row-wise Adagrad, async;
* ``handler``: ``TableService.row_batch`` alone, in one process, no gRPC (``ps_request_costs``).

Per (variant, clients): requests/s; the server's CPU per request (psutil user + system of its
process over the window / requests: 10 ms ticks, so windows of thousands of requests), its
system part, context switches; the thread CPU and context switches inside ``row_batch`` calls;
the clients' CPU per request; p50 / p99; the ratio to and difference from ``grpc``. Then
per client count, medians of each round's own
differences: the carrier; the stack (stack - grpc) by interceptor (stack - stack-no<it>; the
rest: stack-none - grpc); the handler alone (and after a ``--gap-ms`` sleep each:
``handler-gap``); what is left of ``full`` (full - stack - handler): the handler's slowdown in
the server, the rest of the server's extra work around it. The order rotates each round.
``--think-ms``: each client computes that long between a reply and its next request (a click
worker's step is ~3 ms of CPU: the cores shared as in the click benchmark). Command::

    python benchmarks/ps_stack_costs.py            # 3 rounds of 2 s windows: ~3 minutes on 2 cores
    python benchmarks/ps_stack_costs.py --quick    # ~40 s: 1 round of 0.4 s windows
    python benchmarks/ps_stack_costs.py --variants grpc stack full --think-ms 3 --seconds 5
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import os
import queue
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
from transport_compare import Child as PeerChild  # the same directory

ROWS, DIM, BATCH, IDS, ZIPF = 1_000_000, 32, 512, 16, 1.2
POOL = 64  # distinct steps a client cycles through
SECRET = b"ps-stack-costs-bench-secret"
VARIANTS = ("grpc", "stack", "stack-noauth", "stack-noframes", "stack-nolimit", "stack-none",
            "full")
NO_SECRET = ("grpc", "stack-noauth", "stack-none")
BASELINE = "grpc"
HANDLERS = ("handler", "handler-gap")  # row_batch alone: back to back, after a sleep each
TIMEOUT = 120.0  # the longest wait for one answer of a child process
STREAM_TIMEOUT = 3600.0  # a row stream's per-request deadline: it stays open for the whole run


# ----------------------------------------------------------------------------- the requests
def step_ids(seed: int) -> list:
    """``POOL`` steps' ids owned by shard 0 of 2: the unique ids of a 512 x 16 Zipf batch."""
    import torch

    rng = np.random.default_rng(seed)
    steps = [np.unique((rng.zipf(ZIPF, BATCH * IDS) - 1) % ROWS) for _ in range(POOL)]
    return [torch.from_numpy(ids[ids % 2 == 0].astype(np.int64)) for ids in steps]


class Requests:
    """A click worker's requests to ps task 0, built as ``TableClient`` builds them: step
    ``k`` pulls its ids and pushes step ``k - 1``'s with their row gradients, ``seq`` k."""

    def __init__(self, worker: int) -> None:
        import torch

        self.worker, self.incarnation = worker, time.time_ns() & ((1 << 63) - 1)
        self.ids = step_ids(worker + 1)
        self.grads = [torch.full((ids.numel(), DIM), 0.01) for ids in self.ids]
        self.seq = itertools.count(1)

    def next(self) -> bytes:
        from towerflow.ps.wire import tables_pb2 as tpb
        from towerflow.ps.worker.tables.batch import Item, Push, batch_call

        seq = next(self.seq)
        pulled, pushed = self.ids[seq % POOL], self.ids[(seq - 1) % POOL]
        header = tpb.PushRowsRequest(table="emb", shard=0, worker_id=self.worker,
                                     incarnation=self.incarnation, seq=seq, lr=0.1, step=seq,
                                     num_ids=pushed.numel(), dtype="float32")
        item = Item("emb", 0, ids=pulled, count=pulled.numel(),
                    push=Push(header, pushed, self.grads[(seq - 1) % POOL]))
        return batch_call(0, [item]).payload


def prepared_reply() -> bytes:
    """A ``RowBatchReply`` of the size a shard-0 request's reply has (its mean pulled ids)."""
    from towerflow.ps.wire import tables_pb2 as tpb
    from towerflow.ps.wire.framing import pack_parts

    count = round(statistics.mean(ids.numel() for ids in step_ids(1)))
    rows = np.random.default_rng(0).standard_normal((count, DIM), dtype=np.float32)
    reply = tpb.RowBatchReply(items=[tpb.PushPullRowsReply(
        pull=tpb.PullRowsReply(num_ids=count, dim=DIM, dtype="float32"),
        push=tpb.PushRowsReply(status="applied", applied=2))], parts=[rows.nbytes])
    return pack_parts(reply.SerializeToString(), [rows.tobytes()])


def init_table(service) -> None:  # noqa: ANN001 - a TableService
    """Shard 0 of a 1M x 32 table split over 2 ps tasks, row-wise Adagrad (ps_request_costs')."""
    from towerflow.ps.partition import ModPartitioner
    from towerflow.ps.spec.tables import TableConfig
    from towerflow.ps.wire import tables_pb2 as tpb
    from towerflow.ps.wire.tables import table_spec

    config = TableConfig("emb", ModPartitioner(2, num_rows=ROWS), DIM,
                         {"name": "adagrad", "hyper": {"initial_accumulator_value": 0.1}},
                         {"kind": "uniform", "minval": -0.05, "maxval": 0.05, "seed": 1})
    service.init_table(tpb.InitTableRequest(spec=table_spec(config, 0)).SerializeToString())


# ----------------------------------------------------------------------------- servers
def bare_server(reply: bytes):  # noqa: ANN201 - (a grpc.Server, its port)
    from concurrent import futures

    import grpc

    from towerflow.cluster.options import ChannelOptions, ServerOptions
    from towerflow.cluster.transport import requests_until_closed
    from towerflow.ps.server.tables.service import SERVICE_NAME

    def stream(requests, context):  # noqa: ANN001, ANN202 - a handler
        for _ in requests_until_closed(requests):
            yield reply

    handler = grpc.method_handlers_generic_handler(
        SERVICE_NAME, {"RowBatchStream": grpc.stream_stream_rpc_method_handler(stream)})
    server = grpc.server(futures.ThreadPoolExecutor(ServerOptions().max_workers),
                         handlers=[handler], options=ChannelOptions().server_options())
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


class HandlerClock:
    """What ``row_batch`` calls cost their thread: CPU seconds (``thread_time``) and context
    switches (``getrusage(RUSAGE_THREAD)``); and their count (a server's ``stats`` line)."""

    def __init__(self) -> None:
        self.usage, self.calls, self._lock = np.zeros(2), 0, threading.Lock()

    @staticmethod
    def now() -> np.ndarray:  # rusage's CPU times are too coarse for one call; its counts are not
        use = resource.getrusage(resource.RUSAGE_THREAD)
        return np.array([time.thread_time(), use.ru_nvcsw + use.ru_nivcsw])

    def timed(self, fn, *args: object) -> bytes:  # noqa: ANN001
        begin = self.now()
        out = fn(*args)
        spent = self.now() - begin
        with self._lock:
            self.usage, self.calls = self.usage + spent, self.calls + 1
        return out

    def stats(self) -> dict:
        with self._lock:
            return {"usage": self.usage.tolist(), "calls": self.calls}


CLOCK = HandlerClock()


def stack_server(variant: str, reply: bytes):  # noqa: ANN201 - (Server, port)
    import grpc

    import towerflow
    from towerflow.cluster import server as server_module
    from towerflow.cluster.launcher import free_ports
    from towerflow.cluster.transport import Credentials
    from towerflow.ps.server.tables.service import TableHost, TableService

    class PassThrough(grpc.ServerInterceptor):
        """Stands in for a left-out interceptor: the handler as it is."""

        def intercept_service(self, continuation, handler_call_details):  # type: ignore[override]
            return continuation(handler_call_details)

    def stub(data: bytes, context: object = None) -> bytes:
        return reply  # prepared: no table work

    class ClockedTables(TableService):
        """``row_batch`` (the stub's or the real one) with its thread CPU counted."""

        def row_batch(self, data: bytes, context: object = None) -> bytes:
            real = super().row_batch if variant == "full" else stub
            return CLOCK.timed(real, data, context)

    class ClockedHost(TableHost):
        def __init__(self, server: object) -> None:  # noqa: D107
            self.server = server
            self.service = ClockedTables(server.task.task_index)  # type: ignore[attr-defined]

    if variant in ("stack-noframes", "stack-none"):
        server_module.FrameInterceptor = lambda *args, **kwargs: PassThrough()
    if variant in ("stack-nolimit", "stack-none"):
        server_module.StreamLimiter = lambda *args, **kwargs: PassThrough()
    # no worker calls its dense shard: its lifecycle would warn every 30 s that they are away
    logging.getLogger("towerflow.ps").setLevel(logging.ERROR)
    ports = [f"127.0.0.1:{port}" for port in free_ports(4)]
    server = towerflow.Server(
        {"ps": ports[:2], "worker": ports[2:]}, "ps", 0,
        credentials=Credentials(secret=None if variant in NO_SECRET else SECRET),
        services=["towerflow.ps.server.host:ShardHost", ClockedHost])
    if variant == "full":
        init_table(next(s for s in server.services if isinstance(s, TableHost)).service)
    return server, int(ports[0].rpartition(":")[2])


def serve(args: argparse.Namespace) -> None:
    """Serve one variant until stdin closes; its port is the first line on stdout, then a
    ``stats`` line on stdin is answered with the handler's CPU so far (``HandlerClock``)."""
    reply = prepared_reply()
    if args.variant == "grpc":
        server, port = bare_server(reply)
    else:
        server, port = stack_server(args.variant, reply)
    print(json.dumps({"port": port, "reply_bytes": len(reply)}), flush=True)
    for _ in sys.stdin:
        print(json.dumps(CLOCK.stats()), flush=True)
    server.stop(0)


def handler_alone(args: argparse.Namespace) -> None:
    """``TableService.row_batch`` in this process, no gRPC: ``warm N``, ``go:GAP_MS SECONDS``
    (a call every GAP_MS of sleep after the previous one, or back to back)."""
    import torch

    from towerflow.ps.server.tables.service import TableService

    torch.set_num_threads(1)
    service = TableService(0)
    init_table(service)
    requests = Requests(0)
    print("ready", flush=True)
    for line in sys.stdin:
        command, value = line.split()
        if command == "warm":
            for _ in range(int(value)):
                service.row_batch(requests.next())
            print("warm", flush=True)
            continue
        clock, gap = HandlerClock(), float(command.split(":")[1]) / 1e3
        start = time.time()
        until = time.perf_counter() + float(value)
        while time.perf_counter() < until:
            data = requests.next()  # built outside the timed call, as a server receives it
            if gap:
                time.sleep(gap)  # idle between requests, as a server waits for the next
            clock.timed(service.row_batch, data)
        print(json.dumps({"requests": clock.calls, "start": start, "end": time.time(),
                          **clock.stats()}), flush=True)


# ----------------------------------------------------------------------------- clients
def think(work: np.ndarray, seconds: float) -> None:
    """Compute for ``seconds`` of this thread's CPU, through ``work`` (a worker's step)."""
    until = time.thread_time() + seconds
    while seconds and time.thread_time() < until:
        np.multiply(work, 1.0000001, out=work)


def client(args: argparse.Namespace) -> None:
    """One worker: a row stream to every server; ``warm VARIANT N``, ``go VARIANT SECONDS``."""
    from towerflow.cluster.transport import Credentials, make_channel
    from towerflow.ps.worker.tables.stream import RowStream

    requests, work = Requests(args.index), np.ones(1 << 20, np.float32)
    streams, channels = {}, []
    for variant, port in json.loads(args.ports).items():
        secret = None if variant in NO_SECRET else SECRET
        channel = make_channel(f"127.0.0.1:{port}", Credentials(secret=secret))
        channels.append(channel)
        streams[variant] = RowStream(channel, STREAM_TIMEOUT, requests.next())
        streams[variant].receive()
    print("ready", flush=True)
    for line in sys.stdin:
        command, variant, value = line.split()
        stream = streams[variant]
        if command == "warm":
            for _ in range(int(value)):
                stream.send(requests.next())
                stream.receive()
            print("warm", flush=True)
            continue
        latencies = []
        cpu, start = time.process_time(), time.time()
        now = begin = time.perf_counter()
        until = begin + float(value)
        while now < until:
            stream.send(requests.next())
            stream.receive()
            latencies.append(time.perf_counter() - now)
            think(work, args.think_ms / 1e3)
            now = time.perf_counter()
        print(json.dumps({"requests": len(latencies), "cpu": time.process_time() - cpu,
                          "start": start, "end": start + (now - begin),
                          "lat_us": [round(x * 1e6) for x in latencies]}), flush=True)
    for stream, channel in zip(streams.values(), channels, strict=True):
        stream.close()
        channel.close()


# ----------------------------------------------------------------------------- the parent
class Child(PeerChild):
    """A process of this script in another role, added to ``started`` (``transport_compare``'s
    ``Child``: its stdout lines in a queue, its ``stop``)."""

    def __init__(self, started: list, *argv: str) -> None:  # noqa: D107 - its own command line
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.what = " ".join(argv)
        self.proc = subprocess.Popen([sys.executable, __file__, *argv], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        started.append(self)
        self.lines: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._read, daemon=True).start()

    def counters(self) -> np.ndarray:
        """Its CPU seconds (user + system), system seconds and context switches (of all its
        threads alive) so far."""
        import psutil

        times = psutil.Process(self.proc.pid).cpu_times()
        switches = 0
        for status in Path(f"/proc/{self.proc.pid}/task").glob("*/status"):
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                switches += sum(int(line.split()[1]) for line in status.read_text().splitlines()
                                if "ctxt_switches:" in line)
        return np.array([times.user + times.system, times.system, switches])

    def stats(self) -> dict:
        """A server's handler CPU so far (``HandlerClock``)."""
        self.send("stats")
        return json.loads(self.expect())


def measure(server: Child, variant: str, clients: list[Child], args: argparse.Namespace) -> dict:
    """One window: the clients warm up on ``variant``, then load its server together."""
    for proc in clients:
        proc.send(f"warm {variant} {args.warmup}")
    for proc in clients:
        if (line := proc.expect()) != "warm":
            raise RuntimeError(f"{proc.what}: {line!r} instead of warm")
    stats, counters = server.stats(), server.counters()
    for proc in clients:
        proc.send(f"go {variant} {args.seconds}")
    runs = [json.loads(proc.expect(args.seconds + TIMEOUT)) for proc in clients]
    (cpu, system, switches), after = server.counters() - counters, server.stats()
    requests = sum(run["requests"] for run in runs)
    wall = max(run["end"] for run in runs) - min(run["start"] for run in runs)
    latencies = np.array([x for run in runs for x in run["lat_us"]], np.float64) / 1e3
    return {"variant": variant, "clients": len(clients), "rate": requests / wall,
            "server_us": cpu / requests * 1e6, "sys_us": system / requests * 1e6,
            "ctx": switches / requests, **in_calls(stats, after),
            "client_us": statistics.mean(run["cpu"] / run["requests"] for run in runs) * 1e6,
            "p50": float(np.percentile(latencies, 50)), "p99": float(np.percentile(latencies, 99))}


def in_calls(before: dict, after: dict) -> dict:
    """The ``row_batch`` calls' thread CPU (us) and context switches per call."""
    calls = after["calls"] - before["calls"]
    if not calls:
        return {"handler_us": None, "handler_ctx": None}
    cpu, switches = (np.array(after["usage"]) - before["usage"]) / calls
    return {"handler_us": cpu * 1e6, "handler_ctx": switches}


def measure_handler(handler: Child, args: argparse.Namespace, gap_ms: float) -> dict:
    """The handler alone: its calls back to back (``gap_ms`` 0) or after a sleep each."""
    handler.send(f"warm {args.warmup}")
    if (line := handler.expect()) != "warm":
        raise RuntimeError(f"handler: {line!r} instead of warm")
    handler.send(f"go:{gap_ms} {args.seconds}")
    run = json.loads(handler.expect(args.seconds + TIMEOUT))
    calls = in_calls({"usage": [0, 0], "calls": 0}, run)
    return {"variant": "handler-gap" if gap_ms else "handler", "clients": 0,
            "rate": run["requests"] / (run["end"] - run["start"]), **calls,
            "server_us": calls["handler_us"], "sys_us": None, "ctx": calls["handler_ctx"],
            "client_us": None, "p50": None, "p99": None}


def run(args: argparse.Namespace) -> tuple[list[dict], dict[str, float]]:
    """Start every server, the handler process and the clients; measure; stop them all."""
    load = os.getloadavg()[0]  # before this run's processes start
    procs: list[Child] = []  # every process started, stopped in the end
    results = []
    try:
        servers = {variant: Child(procs, "--role", "server", "--variant", variant)
                   for variant in args.variants}
        handler = Child(procs, "--role", "handler")
        said = {variant: json.loads(server.expect()) for variant, server in servers.items()}
        ports = json.dumps({variant: line["port"] for variant, line in said.items()})
        clients = [Child(procs, "--role", "client", "--index", str(i), "--ports", ports,
                         "--think-ms", str(args.think_ms)) for i in range(max(args.clients))]
        for proc in [*clients, handler]:
            if (line := proc.expect()) != "ready":
                raise RuntimeError(f"{proc.what}: {line!r} instead of ready")
        reply = next(iter(said.values()))["reply_bytes"]
        sample = Requests(0)
        sizes = [len(sample.next()) for _ in range(POOL)]
        print(f"{os.cpu_count()} cores, load {load:.2f} before the start; requests to ps 0 of 2: "
              f"{statistics.mean(sizes):,.0f} B on average ({min(sizes):,}-{max(sizes):,}), the "
              f"prepared reply {reply:,} B; clients think {args.think_ms:g} ms between requests; "
              f"{args.seconds} s windows, {args.rounds} round(s)",
              flush=True)
        idle = {variant: server.counters()[0] for variant, server in servers.items()}
        time.sleep(args.idle_seconds)
        idle = {variant: (server.counters()[0] - idle[variant]) / args.idle_seconds * 1e3
                for variant, server in servers.items()}
        print("idle CPU, ms per s (clients connected, no traffic): "
              + ", ".join(f"{v} {ms:.1f}" for v, ms in idle.items()), flush=True)
        for round_index in range(args.rounds):
            for gap in (0.0, args.gap_ms):
                row = measure_handler(handler, args, gap)
                row["round"] = round_index
                results.append(row)
                print(f"round {round_index}: {row['variant']} alone {row['server_us']:,.0f} us "
                      "CPU/req", flush=True)
            for count in args.clients:
                turn = round_index % len(args.variants)
                for variant in args.variants[turn:] + args.variants[:turn]:
                    row = measure(servers[variant], variant, clients[:count], args)
                    row["round"] = round_index
                    results.append(row)
                    print(f"round {round_index}: {variant} x{count}: {row['rate']:,.0f} req/s, "
                          f"server {row['server_us']:,.0f} us/req", flush=True)
    finally:
        for proc in reversed(procs):
            proc.stop()
    return results, idle


FIGURES = ("rate", "server_us", "sys_us", "ctx", "handler_us", "handler_ctx", "client_us", "p50",
           "p99")


def per_round(results: list[dict]) -> dict[tuple[int, int], dict[str, dict]]:
    """``{(clients, round): {variant: row}}``, the handler's rows in every client count's."""
    cells: dict[tuple[int, int], dict[str, dict]] = {}
    alone = [row for row in results if row["variant"] in HANDLERS]
    for row in results:
        if row["variant"] not in HANDLERS:
            cells.setdefault((row["clients"], row["round"]), {})[row["variant"]] = row
    for (_, round_index), runs in cells.items():
        runs.update({row["variant"]: row for row in alone if row["round"] == round_index})
    return cells


def median_of(cells: dict, clients: int, fn) -> float | None:  # noqa: ANN001
    """The median over rounds of ``fn(runs)`` (rounds where it is None left out)."""
    values = [v for (count, _), runs in cells.items() if count == clients
              if (v := fn(runs)) is not None]
    return statistics.median(values) if values else None


def fig(name: str, key: str = "server_us"):  # noqa: ANN201 - a function of one round's runs
    return lambda r: r[name][key] if name in r and r[name][key] is not None else None


def minus(a, b, op=lambda x, y: x - y):  # noqa: ANN001, ANN201 - the same
    return lambda r: None if (x := a(r)) is None or (y := b(r)) is None else op(x, y)


def around(name: str):  # noqa: ANN201 - a server's CPU per request outside its handler's calls
    return minus(fig(name), fig(name, "handler_us"))


def summary(results: list[dict]) -> list[dict]:
    """Medians per (clients, variant); ratios and differences to grpc: medians of each round's."""
    cells = per_round(results)
    lines = []
    for clients in sorted({count for count, _ in cells}):
        for name in (*VARIANTS, *HANDLERS):
            line = {"clients": clients, "variant": name, "vs_base": None, "minus_base": None}
            line.update({key: median_of(cells, clients, fig(name, key)) for key in FIGURES})
            if line["server_us"] is None:
                continue
            if name not in HANDLERS:
                line["vs_base"] = median_of(cells, clients, minus(fig(name), fig(BASELINE),
                                                                  lambda x, y: x / y))
                line["minus_base"] = median_of(cells, clients, minus(fig(name), fig(BASELINE)))
            lines.append(line)
    return lines


def attribution(results: list[dict]) -> list[str]:
    """Per client count: carrier, stack (by interceptor), handler, what is left."""
    cells = per_round(results)
    parts = [
        ("carrier (grpc)", fig("grpc")),
        ("stack - grpc", minus(fig("stack"), fig("grpc"))),
        ("  auth (stack - stack-noauth)", minus(fig("stack"), fig("stack-noauth"))),
        ("  frames (stack - stack-noframes)", minus(fig("stack"), fig("stack-noframes"))),
        ("  stream limiter (stack - stack-nolimit)", minus(fig("stack"), fig("stack-nolimit"))),
        ("  the rest (stack-none - grpc)", minus(fig("stack-none"), fig("grpc"))),
        ("handler alone (thread CPU of its calls)", fig("handler", "handler_us")),
        ("full", fig("full")),
        ("left: full - stack - handler alone",
         minus(minus(fig("full"), fig("stack")), fig("handler"))),
        ("  the handler slowed in the server (its calls in full - alone)",
         minus(fig("full", "handler_us"), fig("handler", "handler_us"))),
        ("    as much alone with a sleep before each call (handler-gap - handler)",
         minus(fig("handler-gap"), fig("handler"))),
        ("  the rest of the server busier (full - its calls) - (stack - its stub's)",
         minus(around("full"), around("stack"))),
    ]
    out = []
    for clients in sorted({count for count, _ in cells}):
        figures = [(label, median_of(cells, clients, fn)) for label, fn in parts]
        out.append(f"\n{clients} client(s), server CPU per request, us (medians of each "
                   "round's own difference):")
        out += [f"  {label}: {value:,.0f}" for label, value in figures if value is not None]
    return out


def report(lines: list[dict], notes: list[str]) -> None:
    def num(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    print(f"\n| clients | variant | req/s | server CPU us/req | of it system | ctx switches/req "
          f"| in row_batch us/req | its ctx switches | client CPU us/req | p50 ms | p99 ms "
          f"| server CPU vs {BASELINE} | server CPU - {BASELINE} us |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    formats = (("rate", ",.0f"), ("server_us", ",.0f"), ("sys_us", ",.0f"), ("ctx", ".1f"),
               ("handler_us", ",.0f"), ("handler_ctx", ".2f"),
               ("client_us", ",.0f"), ("p50", ".3f"), ("p99", ".3f"), ("vs_base", ".2f"),
               ("minus_base", ",.0f"))
    for line in lines:
        cells = [str(line["clients"]), line["variant"], *(num(line[k], f) for k, f in formats)]
        print("| " + " | ".join(cells) + " |")
    print("(handler, handler-gap: row_batch alone in one process, no gRPC, back to back or "
          "after a sleep each: their figures are their calls' thread's; 'in row_batch': the "
          "thread CPU and context switches inside the handler's calls)")
    for note in notes:
        print(note)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--seconds", type=float, help="per window (default 2; --quick: 0.4)")
    parser.add_argument("--rounds", type=int, help="default 3; --quick: 1")
    parser.add_argument("--warmup", type=int, help="round trips before each window (20; 8)")
    parser.add_argument("--think-ms", type=float, default=0.0,
                        help="a client's compute between a reply and its next request (a "
                             "worker's step: its CPU time, on a 4 MB array); 0: none")
    parser.add_argument("--gap-ms", type=float, default=0.5,
                        help="handler-gap's sleep before each call (a server's wait for the next)")
    parser.add_argument("--quick", action="store_true", help="a smoke run of about 40 s")
    parser.add_argument("--json", type=Path, help="write every measurement and the table here")
    parser.add_argument("--role", choices=("parent", "server", "client", "handler"),
                        default="parent", help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--ports", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role != "parent":
        {"server": serve, "client": client, "handler": handler_alone}[args.role](args)
        return
    args.idle_seconds = 0.5 if args.quick else 2.0
    for key, default, quick in (("seconds", 2.0, 0.4), ("rounds", 3, 1), ("warmup", 20, 8)):
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else default)
    if BASELINE not in args.variants:
        parser.error(f"--variants must include the baseline, {BASELINE}")
    args.variants = list(dict.fromkeys(args.variants))
    results, idle = run(args)
    lines = summary(results)
    report(lines, attribution(results))
    if args.json:
        args.json.write_text(json.dumps({"runs": results, "table": lines, "idle_ms_per_s": idle},
                                        indent=1))


if __name__ == "__main__":
    main()
