"""The ps data plane's carrier: gRPC's Python stream against raw TCP, gRPC unary, ZeroMQ, uvloop, TLS.

A ps task spends about 1.47 ms of CPU per row request, about 0.9 ms of it in gRPC's Python
server (the hand-off of each stream message to a pool thread, the request iterator, the
completion-queue thread). This benchmark measures the carrier alone: an echo-like server in
its own process answers each request with a prepared reply of the kind's reply size and does
no work on the bytes, against 1, 2 and 8 client processes, all on 127.0.0.1. Each client has
one connection and sends its next request once the reply has come.

Kinds (a request is one message each way):

* ``small``: 16 KiB out, 16 KiB back;
* ``row``: a click step's row traffic as one framed ``RowBatch`` (``wire/framing.py``
  ``pack_parts``, the layout of ``tables.proto``): the request is the header, the ~2,420
  pulled ids (int64; the unique ids of a 512 x 16 Zipf(1.2) batch over 1M rows), the
  previous step's ids and their 32-wide fp32 row gradients (the deferred push), ~349 KB;
  the reply is the ``RowBatchReply`` header and the pulled rows, ~310 KB: ~659 KB per round
  trip, the bytes of a click worker's step (a 2-ps cluster sends it as two halves);
* ``dense``: a push-pull of a 100 MiB model in 1 MiB chunks: a round is 100 chunks out, then
  100 back (the server answers once the round's last chunk has come, as a push-pull does);
  a request is one chunk each way.

Candidates:

* ``tcp``: the floor: length-prefixed frames on a blocking socket, a server thread per
  connection reading into a reused buffer (``recv_into``);
* ``tcp-tls``: ``tcp`` with both ends wrapped by Python's ``ssl`` (OpenSSL), TLS 1.3 only:
  the server a ``PROTOCOL_TLS_SERVER`` context with the certificate, the clients a
  ``PROTOCOL_TLS_CLIENT`` context trusting the CA alone and checking the host name
  (127.0.0.1, the certificate's SAN IP); the cipher negotiated is said before the table;
* ``grpc-unary``: ``grpc.server`` (a 256-thread pool, the ps task's server options: 2 MiB
  stream window, no BDP probing) with a generic unary bytes-in, bytes-out handler (no
  protobuf); a dense round is 100 calls, a chunk each way;
* ``grpc-stream``: the baseline, as towerflow carries rows: one long-lived bidirectional
  call per client (towerflow's ``RequestStream``: requests queued to gRPC's thread) and a
  handler yielding a reply per request; a dense round is one call (100 chunks pushed, then
  100 yielded), the form of a dense push-pull;
* ``grpc-stream-tls``: ``grpc-stream`` over gRPC's TLS (``grpc.ssl_server_credentials``,
  ``grpc.ssl_channel_credentials`` trusting the CA; BoringSSL), as towerflow across machines;
* ``zmq``: pyzmq ROUTER server, DEALER clients, multipart frames, ``copy=False`` both ways;
* ``zmq-curve``: ``zmq`` with ZeroMQ's CURVE on both sides (every message encrypted and
  authenticated in libzmq's I/O thread, XSalsa20-Poly1305 under ephemeral session keys, so
  replay-proof); the key pairs are derived from a cluster secret, and a ZAP handler admits
  only the client key of that secret (a client with another key gets no answer);
* ``zmq-hmac``: ``zmq`` with a header frame (the tag and a per-direction counter) and an
  HMAC-SHA256 of that header alone, checked on each side: the header authenticated in
  Python, the payload not;
* ``zmq-hmac-body``: ``zmq-hmac`` with the HMAC over the header and every payload frame,
  checked by the server before it answers and by the client for each reply: every byte
  authenticated in Python (OpenSSL), nothing encrypted;
* ``asyncio-uvloop``: ``asyncio.start_server`` streams on uvloop, the ``tcp`` frames (its
  clients are the ``tcp`` clients);
* ``asyncio-uvloop-tls``: ``asyncio-uvloop`` with ``ssl=`` (the ``tcp-tls`` server context)
  on ``start_server``; its clients are the ``tcp-tls`` clients;
* ``grpc-reuseport``: ``grpc-stream`` served by ``--reuseport-servers`` processes on one
  port (``grpc.so_reuseport``); the kernel spreads connections (not requests) over them.

The ``zmq`` candidates and ``asyncio-uvloop`` need pyzmq and uvloop (``pip install -e
.[bench]``), ``zmq-curve`` a libzmq with CURVE (``zmq.has("curve")``); without them they are
skipped, and one line says so. The TLS candidates' certificates (a throwaway CA, a server
certificate for localhost and 127.0.0.1) are made by the ``openssl`` command line in a
temporary directory, removed at the end; without ``openssl`` they are skipped in that line.
The servers and clients are in ``transport_peers.py``, the ZeroMQ ones in
``transport_zmq.py``, the TLS set-up in ``transport_tls.py``.

Per (kind, clients, candidate): requests/s, GB/s (request and reply bytes / wall, first send
to last reply), the server's CPU per request (user + system of its process(es), psutil,
over the window), the clients' CPU per request (each client's own process time over its
loop, averaged over clients), p50 and p99 latency per round (ms; a dense round is the whole
push-pull), and each candidate's ratios of server CPU per request and of GB/s to
``grpc-stream``'s and to ``tcp``'s, measured in the same round. Every server and client
process starts once; each measurement warms up (50 small, 20 row round trips, one dense round
of 10 chunks), then runs ``--seconds``; candidates take turns per (kind, clients), the order
rotating each round; with ``--rounds`` > 1 the figures are medians, the ratios medians of each
round's own ratio.

Command::

    python benchmarks/transport_compare.py            # 2 s windows: ~4 minutes on 2 cores
    python benchmarks/transport_compare.py --quick    # ~30 s: 1 and 2 clients, short windows
    python benchmarks/transport_compare.py --candidates tcp grpc-stream zmq --kinds row --clients 2
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import queue
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
from transport_peers import CANDIDATES, KINDS, NEEDS  # the same directory
from transport_tls import TLS, has_openssl, make_certs  # the same directory

PEERS = Path(__file__).resolve().with_name("transport_peers.py")
BASELINE, FLOOR = "grpc-stream", "tcp"
TIMEOUT = 120.0  # the longest wait for one answer of a child process
CHUNK = 1 << 20


class Child:
    """A server or client of ``transport_peers.py`` in its own process; its stdout lines
    arrive in a queue."""

    def __init__(self, args: argparse.Namespace, *role: str) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.what = " ".join(role)
        self.proc = subprocess.Popen(
            [sys.executable, str(PEERS), *role, "--small-bytes", str(args.small_bytes),
             "--dense-chunks", str(args.dense_chunks), "--warmup-chunks",
             str(args.warmup_chunks), *(["--certs", str(args.certs)] if getattr(args, "certs", None) else [])],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.lines: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def expect(self, timeout: float = TIMEOUT) -> str:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"{self.what}: no answer in {timeout:.0f} s") from None
        if line is None:
            self.proc.wait(10)
            raise RuntimeError(f"{self.what}: the process ended (status {self.proc.returncode})")
        return line.strip()

    def cpu(self) -> float:
        import psutil

        times = psutil.Process(self.proc.pid).cpu_times()
        return times.user + times.system

    def stop(self) -> None:
        """Close its stdin (it ends by itself); terminate, then kill, if it does not."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        for end in (None, self.proc.terminate, self.proc.kill):
            if end is not None:
                end()
            try:
                self.proc.wait(10)
                break
            except subprocess.TimeoutExpired:
                continue


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Candidate:
    """A candidate's server process(es) and its client processes, started once."""

    def __init__(self, name: str, args: argparse.Namespace) -> None:
        self.name, self.clients, self.note = name, [], ""
        if name == "grpc-reuseport":
            port = str(free_port())
            self.servers = [Child(args, "server", name, "--port", port)
                            for _ in range(args.reuseport_servers)]
        else:
            self.servers = [Child(args, "server", name)]
        self.sizes: dict[str, list[int]] = {}

    def start_clients(self, args: argparse.Namespace, count: int) -> None:
        """Once its servers listen (each says its port and the kinds' sizes)."""
        said = [json.loads(server.expect()) for server in self.servers]
        ports = {line["port"] for line in said}
        if len(ports) != 1:
            raise RuntimeError(f"the {self.name} servers listen on {sorted(ports)}, not one port")
        self.sizes, port = said[0]["sizes"], str(ports.pop())
        self.clients = [Child(args, "client", self.name, port) for _ in range(count)]

    def wait_ready(self) -> None:
        """Each client says ``ready`` (a TLS one: and its TLS version and cipher)."""
        for proc in self.clients:
            word, _, note = (line := proc.expect()).partition(" ")
            if word != "ready":
                raise RuntimeError(f"{proc.what}: {line!r} instead of ready")
            self.note = note

    def server_cpu(self) -> float:
        return sum(server.cpu() for server in self.servers)

    def stop(self) -> None:
        for proc in self.clients + self.servers:
            proc.stop()


def measure(candidate: Candidate, kind: str, clients: int, args: argparse.Namespace) -> dict:
    """One window: ``clients`` of the candidate's clients warm up, then load it together."""
    active = candidate.clients[:clients]
    for proc in active:
        proc.send(f"warm {kind}")
    for proc in active:
        if (line := proc.expect()) != "warm":
            raise RuntimeError(f"{proc.what}: {line!r} instead of warm")
    cpu = candidate.server_cpu()
    for proc in active:
        proc.send(f"go {kind} {args.seconds}")
    runs = [json.loads(proc.expect(args.seconds + TIMEOUT)) for proc in active]
    cpu = candidate.server_cpu() - cpu
    requests = sum(run["requests"] for run in runs)
    wall = max(run["end"] for run in runs) - min(run["start"] for run in runs)
    latencies = np.array([x for run in runs for x in run["lat_us"]], np.float64) / 1e3
    return {"kind": kind, "clients": clients, "candidate": candidate.name,
            "rate": requests / wall, "gbps": requests * sum(candidate.sizes[kind]) / wall / 1e9,
            "server_us": cpu / requests * 1e6,
            "client_us": statistics.mean(run["cpu"] / run["requests"] for run in runs) * 1e6,
            "p50": float(np.percentile(latencies, 50)),
            "p99": float(np.percentile(latencies, 99))}


FIGURES = ("rate", "gbps", "server_us", "client_us", "p50", "p99")


def summary(results: list[dict]) -> list[dict]:
    """Medians per (kind, clients, candidate); ratios: medians of each round's own ratio."""
    cells: dict[tuple, dict[int, dict]] = {}
    for row in results:
        cells.setdefault((row["kind"], row["clients"]), {}).setdefault(row["round"], {})[
            row["candidate"]] = row
    lines = []
    for (kind, clients), rounds in sorted(cells.items(),
                                          key=lambda c: (KINDS.index(c[0][0]), c[0][1])):
        names = {name for runs in rounds.values() for name in runs}
        for name in sorted(names, key=CANDIDATES.index):
            line = {"kind": kind, "clients": clients, "candidate": name}
            own = [runs[name] for runs in rounds.values() if name in runs]
            line.update({fig: statistics.median(run[fig] for run in own) for fig in FIGURES})
            for base in (BASELINE, FLOOR):
                pairs = [(runs[name], runs[base]) for runs in rounds.values()
                         if name in runs and base in runs]
                line[f"cpu_vs_{base}"] = statistics.median(
                    a["server_us"] / b["server_us"] for a, b in pairs) if pairs else None
                line[f"gbps_vs_{base}"] = statistics.median(
                    a["gbps"] / b["gbps"] for a, b in pairs) if pairs else None
            lines.append(line)
    return lines


def report(lines: list[dict]) -> None:
    def ratio(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    print(f"\n| kind | clients | candidate | req/s | GB/s | server CPU us/req | client CPU us/req "
          f"| p50 ms | p99 ms | server CPU vs {BASELINE} | GB/s vs {BASELINE} "
          f"| server CPU vs {FLOOR} | GB/s vs {FLOOR} |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for line in lines:
        print(f"| {line['kind']} | {line['clients']} | {line['candidate']} | "
              f"{line['rate']:,.0f} | {line['gbps']:.3f} | {line['server_us']:,.0f} | "
              f"{line['client_us']:,.0f} | {line['p50']:.3f} | {line['p99']:.3f} | "
              f"{ratio(line[f'cpu_vs_{BASELINE}'])} | {ratio(line[f'gbps_vs_{BASELINE}'])} | "
              f"{ratio(line[f'cpu_vs_{FLOOR}'])} | {ratio(line[f'gbps_vs_{FLOOR}'])} |")


def run(args: argparse.Namespace) -> list[dict]:
    """Make the TLS candidates' certificates (if any) in a temporary directory, measure."""
    args.certs = None
    if not set(args.candidates) & set(TLS):
        return measure_all(args)
    with tempfile.TemporaryDirectory(prefix="transport-tls-") as directory:
        args.certs = make_certs(Path(directory))
        return measure_all(args)


def measure_all(args: argparse.Namespace) -> list[dict]:
    """Start every candidate's server(s) and clients, measure, stop them all."""
    load = os.getloadavg()[0]  # before this run's processes start
    candidates: list[Candidate] = []
    results = []
    try:
        for name in args.candidates:
            candidates.append(Candidate(name, args))
        for candidate in candidates:
            candidate.start_clients(args, max(args.clients))
        for candidate in candidates:
            candidate.wait_ready()
        (small, _), (request, reply) = (candidates[0].sizes[k] for k in ("small", "row"))
        print(f"{os.cpu_count()} cores, load {load:.2f} before the start; small: {small:,} B each "
              f"way; row: {request:,} B request + {reply:,} B reply = {request + reply:,} B; "
              f"dense: {args.dense_chunks} x {CHUNK:,} B each way per round; {args.seconds} s "
              f"windows, {args.rounds} round(s)", flush=True)
        for candidate in candidates:
            if candidate.note:
                print(f"{candidate.name}: {candidate.note}", flush=True)
        for round_index in range(args.rounds):
            for kind in args.kinds:
                for clients in args.clients:
                    turn = round_index % len(candidates)
                    for candidate in candidates[turn:] + candidates[:turn]:
                        row = measure(candidate, kind, clients, args)
                        row["round"] = round_index
                        results.append(row)
                        print(f"round {round_index}: {kind} x{clients} {candidate.name}: "
                              f"{row['rate']:,.0f} req/s, {row['gbps']:.3f} GB/s, server "
                              f"{row['server_us']:,.0f} us/req", flush=True)
    finally:
        for candidate in candidates:
            candidate.stop()
    return results


def has_curve() -> bool:
    import zmq

    return bool(zmq.has("curve"))


def available(names: list[str], find: Callable = importlib.util.find_spec,
              curve: Callable[[], bool] = has_curve,
              openssl: Callable[[], bool] = has_openssl) -> tuple[list[str], str]:
    """The candidates whose packages are installed (``zmq-curve``: and whose libzmq has CURVE;
    the TLS ones: and the ``openssl`` command), and a line naming those skipped ("" if none)."""
    why = {name: f"{NEEDS[name][1]} not installed" for name in names
           if name in NEEDS and find(NEEDS[name][0]) is None}
    if "zmq-curve" in names and "zmq-curve" not in why and not curve():
        why["zmq-curve"] = "pyzmq's libzmq has no CURVE"
    tls = [name for name in names if name in TLS and name not in why]
    if tls and not openssl():
        why.update({name: "no openssl command for its certificates" for name in tls})
    line = "" if not why else (
        "skipped: " + ", ".join(f"{name} ({reason})" for name, reason in why.items())
        + ("; pip install -e .[bench]" if any(r.endswith("installed") for r in why.values())
           else ""))
    return [name for name in names if name not in why], line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--candidates", nargs="+", choices=CANDIDATES, default=list(CANDIDATES))
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--clients", type=int, nargs="+", default=None,
                        help="client process counts (default 1 2 8; --quick: 1 2)")
    parser.add_argument("--seconds", type=float, default=None,
                        help="per measurement window (default 2; --quick: 0.3)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="a smoke run of about 30 s")
    parser.add_argument("--small-bytes", type=int, default=16 << 10)
    parser.add_argument("--dense-chunks", type=int, default=100, help="1 MiB chunks per round")
    parser.add_argument("--warmup-chunks", type=int, default=10,
                        help="chunks of the dense warm-up round")
    parser.add_argument("--reuseport-servers", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write every measurement and the table here")
    args = parser.parse_args()
    args.clients = args.clients or ([1, 2] if args.quick else [1, 2, 8])
    args.seconds = args.seconds or (0.3 if args.quick else 2.0)
    args.candidates, skipped = available(args.candidates)
    if skipped:
        print(skipped, flush=True)
    if not args.candidates:
        parser.error("no candidate left to measure")
    results = run(args)
    lines = summary(results)
    report(lines)
    if args.json:
        args.json.write_text(json.dumps({"runs": results, "table": lines}, indent=1))


if __name__ == "__main__":
    main()
