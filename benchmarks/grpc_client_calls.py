"""What one request per ps task and step costs a worker: gRPC's client call forms side by side.

A worker's step sends one request to each of two ps tasks and reads both replies (40 kB out,
80 kB back, the size of a click worker's row traffic per ps task). Two echo servers (thread-pool
``grpc.server``, the form a ps task uses) in their own processes; the client measures its own
CPU time and the wall time per step for:

- ``stream``: towerflow's own ``RequestStream`` per server (a long-lived bidirectional call,
  requests queued to gRPC's thread: what the row and dense streams use);
- ``unary``: a blocking unary call per server, one after the other;
- ``future``: unary calls started together (``.future()``), then both results;
- ``aio-seq``: ``grpc.aio`` streams driven from the calling thread
  (``loop.run_until_complete``: both writes, then both reads; no thread hop on the client).

Rounds interleave the forms; medians are printed, and each form's CPU per step against
``stream``'s. The saving of sending a ps task's dense and row traffic in one request instead of
two is about one ``stream`` request's CPU (half a step of this benchmark).

    python benchmarks/grpc_client_calls.py [--steps 2000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import subprocess
import sys
import time
from concurrent import futures

import grpc
import grpc.aio

from towerflow.cluster.launcher import free_ports
from towerflow.cluster.transport import ChannelOptions, RequestStream

REQUEST = os.urandom(40_000)
REPLY = os.urandom(80_000)
ECHO, STREAM = "/bench.Echo/Echo", "/bench.Echo/Stream"
SERVER_OPTIONS = ChannelOptions().server_options()  # a ps task's
OPTIONS = ChannelOptions().grpc_options()  # a worker's channels


def _ident(data: bytes) -> bytes:
    return data


def serve(port: int) -> None:
    def echo(request: bytes, context: grpc.ServicerContext) -> bytes:
        return REPLY

    def stream(requests, context):  # noqa: ANN001, ANN202
        for _ in requests:
            yield REPLY

    handler = grpc.method_handlers_generic_handler("bench.Echo", {
        "Echo": grpc.unary_unary_rpc_method_handler(echo, _ident, _ident),
        "Stream": grpc.stream_stream_rpc_method_handler(stream, _ident, _ident)})
    server = grpc.server(futures.ThreadPoolExecutor(8), handlers=[handler],
                         options=SERVER_OPTIONS)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(ports: list[int], steps: int, rounds: int) -> dict[str, list[tuple[float, float]]]:
    channels = [grpc.insecure_channel(f"127.0.0.1:{p}", options=OPTIONS) for p in ports]
    for channel in channels:
        grpc.channel_ready_future(channel).result(timeout=60)
    unary = [c.unary_unary(ECHO, _ident, _ident) for c in channels]
    streams = [RequestStream(c, STREAM, 3600.0, REQUEST) for c in channels]
    for stream in streams:  # the first request went out when the call started
        stream.receive()
    loop = asyncio.new_event_loop()

    async def open_aio():  # noqa: ANN202
        aio = [grpc.aio.insecure_channel(f"127.0.0.1:{p}", options=OPTIONS) for p in ports]
        return aio, [c.stream_stream(STREAM, _ident, _ident)() for c in aio]

    aio_channels, aio_calls = loop.run_until_complete(open_aio())

    async def aio_step() -> None:
        for call in aio_calls:
            await call.write(REQUEST)
        for call in aio_calls:
            await call.read()

    def stream_step() -> None:
        for s in streams:
            s.send(REQUEST)
        for s in streams:
            s.receive()

    def unary_step() -> None:
        for call in unary:
            call(REQUEST)

    def future_step() -> None:
        for f in [call.future(REQUEST) for call in unary]:
            f.result()

    forms = {"stream": stream_step, "unary": unary_step, "future": future_step,
             "aio-seq": lambda: loop.run_until_complete(aio_step())}
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in forms}
    for _ in range(rounds):
        for name, step in forms.items():
            for _ in range(50):  # warm
                step()
            cpu, wall = _cpu(), time.perf_counter()
            for _ in range(steps):
                step()
            results[name].append(((_cpu() - cpu) / steps * 1e3,
                                  (time.perf_counter() - wall) / steps * 1e3))
    for s in streams:
        s.close()
    for call in aio_calls:
        call.cancel()
    async def close_aio() -> None:
        for channel in aio_channels:
            await channel.close()

    loop.run_until_complete(close_aio())
    loop.close()
    for channel in channels:
        channel.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return
    env = dict(os.environ, OMP_NUM_THREADS="1")
    ports = free_ports(2)
    servers = [subprocess.Popen([sys.executable, __file__, "--serve", str(p)], env=env)
               for p in ports]
    try:
        results = measure(ports, args.steps, args.rounds)
    finally:
        for server in servers:
            server.kill()
            server.wait(timeout=30)
    base = statistics.median(cpu for cpu, _ in results["stream"])
    print(f"one step = one request to each of 2 ps tasks ({len(REQUEST):,} B out, "
          f"{len(REPLY):,} B back); medians of {args.rounds} interleaved rounds of "
          f"{args.steps} steps; load {os.getloadavg()[0]:.1f}")
    for name, runs in results.items():
        cpu = statistics.median(c for c, _ in runs)
        wall = statistics.median(w for _, w in runs)
        print(f"  {name:8s} client CPU {cpu:.3f} ms/step ({cpu / base:.2f}x stream's), "
              f"wall {wall:.3f} ms/step")


if __name__ == "__main__":
    main()
