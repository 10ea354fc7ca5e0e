"""The processes of ``transport_compare.py``: the message bytes, each carrier's server and client.

Run by ``transport_compare.py``, one process per server and per client, all on 127.0.0.1:

    python benchmarks/transport_peers.py server CANDIDATE [--port P] [--certs DIR]
    python benchmarks/transport_peers.py client CANDIDATE PORT [--certs DIR]

A server says ``{"port": ..., "sizes": ...}`` on its first stdout line once it listens, then
answers every request with the kind's prepared reply (no work on the bytes) until its stdin
closes. A client connects, makes one small round trip and says ``ready`` (a ``tcp-tls`` or
``asyncio-uvloop-tls`` client: ``ready`` and the TLS version and cipher negotiated); then on stdin
``warm KIND`` (a few round trips; it says ``warm``) and ``go KIND SECONDS`` (round trips for
that long; it says a JSON line: its rounds, requests, process CPU seconds, wall-clock start
and end and each round's latency in microseconds); it ends when its stdin closes. The ZeroMQ
servers and clients (``zmq``, ``zmq-curve``, ``zmq-hmac``, ``zmq-hmac-body``) are in
``transport_zmq.py``. The TLS candidates (``tcp-tls``, ``grpc-stream-tls``,
``asyncio-uvloop-tls``) take their certificates from ``--certs`` (``transport_tls.py``).
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

SERVICE = "bench.Transport"
KINDS = ("small", "row", "dense")
CANDIDATES = ("tcp", "tcp-tls", "grpc-unary", "grpc-stream", "grpc-stream-tls", "zmq",
              "zmq-curve", "zmq-hmac", "zmq-hmac-body", "asyncio-uvloop", "asyncio-uvloop-tls",
              "grpc-reuseport")
ZMQ = ("zmq", "zmq-curve", "zmq-hmac", "zmq-hmac-body")  # in transport_zmq.py
#: candidate: (the module it needs that towerflow does not, its package: the bench extra)
NEEDS = {**{name: ("zmq", "pyzmq") for name in ZMQ},
         **{name: ("uvloop", "uvloop") for name in ("asyncio-uvloop", "asyncio-uvloop-tls")}}
CODE = {kind: code for code, kind in enumerate(KINDS)}
DENSE = CODE["dense"]
HEADER = struct.Struct("<IBB")  # payload bytes, kind code, 1 on a dense round's last chunk
WARMUP = {"small": 50, "row": 20, "dense": 1}
CHUNK = 1 << 20
ROWS, DIM, BATCH, IDS, ZIPF = 1_000_000, 32, 512, 16, 1.2


# ----------------------------------------------------------------------------- the bytes
def row_messages(seed: int = 0) -> tuple[bytes, bytes]:
    """A click step's framed ``RowBatch`` request (pull with its deferred push) and reply."""
    from towerflow.ps.wire import tables_pb2 as tpb
    from towerflow.ps.wire.framing import pack_parts

    rng = np.random.default_rng(seed)

    def step_ids() -> np.ndarray:
        return np.unique((rng.zipf(ZIPF, BATCH * IDS) - 1) % ROWS).astype(np.int64)

    pushed, pulled = step_ids(), step_ids()  # the previous step's ids carry the push
    grads = rng.standard_normal((pushed.size, DIM), dtype=np.float32) * np.float32(0.01)
    rows = rng.standard_normal((pulled.size, DIM), dtype=np.float32)
    request = tpb.RowBatchRequest()
    item = request.items.add()
    item.pull.table, item.pull.shard, item.pull.num_ids = "emb", 0, pulled.size
    item.push.CopyFrom(tpb.PushRowsRequest(table="emb", shard=0, worker_id=0, incarnation=1,
                                           seq=2, lr=0.1, step=2, num_ids=pushed.size,
                                           dtype="float32"))
    parts = [pulled.tobytes(), pushed.tobytes(), grads.tobytes()]
    request.parts.extend(len(part) for part in parts)
    reply = tpb.RowBatchReply()
    answer = reply.items.add()
    answer.pull.CopyFrom(tpb.PullRowsReply(num_ids=pulled.size, dim=DIM, dtype="float32"))
    answer.push.CopyFrom(tpb.PushRowsReply(status="applied", applied=2))
    reply.parts.append(rows.nbytes)
    return (pack_parts(request.SerializeToString(), parts),
            pack_parts(reply.SerializeToString(), [rows.tobytes()]))


def messages(args: argparse.Namespace) -> dict[str, tuple[bytes, bytes]]:
    """``{kind: (request, reply)}``, the same bytes in every process (seeded)."""
    rng = np.random.default_rng(1)
    small = rng.bytes(args.small_bytes)
    chunk = rng.bytes(CHUNK)
    return {"small": (small, small), "row": row_messages(), "dense": (chunk, chunk)}


def framed(kind: str, payload: bytes, last: bool = False) -> bytes:
    """A ``tcp`` frame: the header, then the payload."""
    return HEADER.pack(len(payload), CODE[kind], int(last)) + payload


class Rounds:
    """How many replies a request gets: one; a dense chunk none until its round's last."""

    def __init__(self) -> None:
        self.pending = 0

    def replies(self, code: int, last: int) -> int:
        if code != DENSE:
            return 1
        self.pending += 1
        if not last:
            return 0
        count, self.pending = self.pending, 0
        return count


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    got, size = 0, len(view)
    while got < size:
        count = sock.recv_into(view[got:] if got else view)
        if not count:
            raise EOFError("the peer closed the connection")
        got += count


# ----------------------------------------------------------------------------- servers
def serve_tcp(replies: dict[str, bytes], args: argparse.Namespace,
              ready: Callable[[int], None], tls=None) -> None:  # noqa: ANN001 - SSLContext
    """Threads on blocking sockets; with ``tls`` (an ``ssl.SSLContext``) each connection is
    wrapped (the handshake in its thread)."""
    out = {CODE[kind]: framed(kind, reply) for kind, reply in replies.items()}
    listener = socket.create_server(("127.0.0.1", args.port))

    def connection(sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        head, body = memoryview(bytearray(HEADER.size)), memoryview(bytearray(CHUNK))
        rounds = Rounds()
        try:
            if tls is not None:
                sock = tls.wrap_socket(sock, server_side=True)
            while True:
                recv_exact(sock, head)
                length, code, last = HEADER.unpack(head)
                if length > len(body):
                    body = memoryview(bytearray(length))
                recv_exact(sock, body[:length])
                for _ in range(rounds.replies(code, last)):
                    sock.sendall(out[code])
        except (EOFError, OSError):
            pass
        finally:
            sock.close()

    def accept() -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=connection, args=(sock,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    ready(listener.getsockname()[1])
    sys.stdin.read()
    listener.close()


def serve_asyncio(replies: dict[str, bytes], args: argparse.Namespace,
                  ready: Callable[[int], None], tls=None) -> None:  # noqa: ANN001 - SSLContext
    """``asyncio.start_server`` on uvloop; with ``tls``, ``ssl=tls``."""
    import asyncio

    import uvloop

    out = {CODE[kind]: framed(kind, reply) for kind, reply in replies.items()}

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        rounds = Rounds()
        try:
            while True:
                length, code, last = HEADER.unpack(await reader.readexactly(HEADER.size))
                await reader.readexactly(length)
                for _ in range(rounds.replies(code, last)):
                    writer.write(out[code])
                    await writer.drain()
        except (asyncio.IncompleteReadError, OSError):  # OSError: ConnectionError, SSLError
            pass
        finally:
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(connection, "127.0.0.1", args.port, limit=4 << 20,
                                            ssl=tls)
        ready(server.sockets[0].getsockname()[1])
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        server.close()

    uvloop.run(main())


def serve_grpc(candidate: str, replies: dict[str, bytes], args: argparse.Namespace,
               ready: Callable[[int], None]) -> None:
    from concurrent import futures

    import grpc

    from towerflow.cluster.options import ChannelOptions, ServerOptions
    from towerflow.cluster.transport import requests_until_closed

    options = [opt for opt in ChannelOptions().server_options() if opt[0] != "grpc.so_reuseport"]
    options.append(("grpc.so_reuseport", int(candidate == "grpc-reuseport")))

    def unary(reply: bytes):  # noqa: ANN202 - a handler
        return lambda request, context: reply

    def stream(reply: bytes):  # noqa: ANN202 - a handler
        def handler(requests, context):  # noqa: ANN001, ANN202
            for _ in requests_until_closed(requests):
                yield reply
        return handler

    def push_pull(requests, context):  # noqa: ANN001, ANN202
        count = sum(1 for _ in requests)
        for _ in range(count):
            yield replies["dense"]

    methods = {f"{kind}-unary": grpc.unary_unary_rpc_method_handler(unary(replies[kind]))
               for kind in KINDS}
    methods.update({f"{kind}-stream": grpc.stream_stream_rpc_method_handler(stream(replies[kind]))
                    for kind in ("small", "row")})
    methods["dense-stream"] = grpc.stream_stream_rpc_method_handler(push_pull)
    server = grpc.server(futures.ThreadPoolExecutor(ServerOptions().max_workers),
                         handlers=[grpc.method_handlers_generic_handler(SERVICE, methods)],
                         options=options)
    if candidate == "grpc-stream-tls":
        from transport_tls import grpc_server_credentials  # the same directory

        port = server.add_secure_port(f"127.0.0.1:{args.port}",
                                      grpc_server_credentials(args.certs))
    else:
        port = server.add_insecure_port(f"127.0.0.1:{args.port}")
    server.start()
    ready(port)
    sys.stdin.read()
    server.stop(0).wait()


def serve(candidate: str, args: argparse.Namespace) -> None:
    """Serve until stdin closes; the port and the kinds' sizes are the first line on stdout."""
    sent = messages(args)
    replies = {kind: reply for kind, (_, reply) in sent.items()}
    sizes = {kind: [len(request), len(reply)] for kind, (request, reply) in sent.items()}

    def ready(port: int) -> None:
        print(json.dumps({"port": port, "sizes": sizes}), flush=True)

    if candidate in ("tcp", "tcp-tls", "asyncio-uvloop", "asyncio-uvloop-tls"):
        tls = None
        if candidate.endswith("-tls"):
            from transport_tls import server_context  # the same directory

            tls = server_context(args.certs)
        loop = serve_tcp if candidate.startswith("tcp") else serve_asyncio
        loop(replies, args, ready, tls)
    elif candidate in ZMQ:
        from transport_zmq import serve_zmq  # the same directory

        serve_zmq(candidate, replies, args, ready)
    else:
        serve_grpc(candidate, replies, args, ready)


# ----------------------------------------------------------------------------- clients
class TcpClient:
    """``tcp`` frames on a blocking socket; replies read into a reused buffer. With ``tls``
    (an ``ssl.SSLContext``), the socket is wrapped, the host name checked (127.0.0.1)."""

    def __init__(self, port: int, sent: dict[str, tuple[bytes, bytes]],
                 tls=None) -> None:  # noqa: ANN001 - SSLContext
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.note = ""
        if tls is not None:
            self.sock = tls.wrap_socket(self.sock, server_hostname="127.0.0.1")
            self.note = f"{self.sock.version()} {self.sock.cipher()[0]}"
        self.requests = {kind: framed(kind, request) for kind, (request, _) in sent.items()}
        self.last_chunk = framed("dense", sent["dense"][0], last=True)
        largest = max(len(reply) for _, reply in sent.values())
        self.head, self.body = memoryview(bytearray(HEADER.size)), memoryview(bytearray(largest))

    def round(self, kind: str, chunks: int) -> None:
        if kind == "dense":
            for index in range(chunks):
                self.sock.sendall(self.last_chunk if index == chunks - 1
                                  else self.requests[kind])
        else:
            self.sock.sendall(self.requests[kind])
        for _ in range(chunks):
            recv_exact(self.sock, self.head)
            recv_exact(self.sock, self.body[:HEADER.unpack(self.head)[0]])

    def end_phase(self) -> None:
        pass

    def close(self) -> None:
        self.sock.close()


class GrpcClient:
    """A channel with the ps options; unary calls, or towerflow's ``RequestStream``."""

    def __init__(self, port: int, sent: dict[str, tuple[bytes, bytes]], stream: bool,
                 tls=None) -> None:  # noqa: ANN001 - grpc.ChannelCredentials
        import grpc

        from towerflow.cluster.options import ChannelOptions
        from towerflow.cluster.transport import RequestStream

        self.open_stream = RequestStream
        if tls is None:
            self.channel = grpc.insecure_channel(f"127.0.0.1:{port}",
                                                 options=ChannelOptions().grpc_options())
        else:
            self.channel = grpc.secure_channel(f"127.0.0.1:{port}", tls,
                                               options=ChannelOptions().grpc_options())
        self.note = ""
        grpc.channel_ready_future(self.channel).result(timeout=60)
        self.requests = {kind: request for kind, (request, _) in sent.items()}
        self.stream = stream
        self.unary = {kind: self.channel.unary_unary(f"/{SERVICE}/{kind}-unary") for kind in KINDS}
        self.push_pull = self.channel.stream_stream(f"/{SERVICE}/dense-stream")
        self.streams: dict = {}

    def round(self, kind: str, chunks: int) -> None:
        request = self.requests[kind]
        if not self.stream:
            for _ in range(chunks):
                self.unary[kind](request)
        elif kind == "dense":
            for _ in self.push_pull(iter([request] * chunks)):
                pass
        elif kind in self.streams:
            self.streams[kind].send(request)
            self.streams[kind].receive()
        else:
            self.streams[kind] = self.open_stream(self.channel, f"/{SERVICE}/{kind}-stream",
                                                  3600.0, request)
            self.streams[kind].receive()

    def end_phase(self) -> None:
        for stream in self.streams.values():
            stream.close()
        self.streams.clear()

    def close(self) -> None:
        self.end_phase()
        self.channel.close()


def client(candidate: str, port: int, args: argparse.Namespace) -> None:
    """Connect, say ``ready``; then ``warm KIND`` and ``go KIND SECONDS`` from stdin."""
    sent = messages(args)
    if candidate in ("tcp", "asyncio-uvloop"):
        conn = TcpClient(port, sent)
    elif candidate in ("tcp-tls", "asyncio-uvloop-tls"):
        from transport_tls import client_context  # the same directory

        conn = TcpClient(port, sent, client_context(args.certs))
    elif candidate in ZMQ:
        from transport_zmq import zmq_client  # the same directory

        conn = zmq_client(candidate, port, sent)
    elif candidate == "grpc-stream-tls":
        from transport_tls import grpc_channel_credentials  # the same directory

        conn = GrpcClient(port, sent, stream=True, tls=grpc_channel_credentials(args.certs))
    else:
        conn = GrpcClient(port, sent, stream=candidate != "grpc-unary")
    conn.round("small", 1)  # the server has answered: connected
    conn.end_phase()
    print(f"ready {getattr(conn, 'note', '')}".strip(), flush=True)
    for line in sys.stdin:
        command, kind, *rest = line.split()
        chunks = args.dense_chunks if kind == "dense" else 1
        if command == "warm":
            for _ in range(WARMUP[kind]):
                conn.round(kind, args.warmup_chunks if kind == "dense" else 1)
            print("warm", flush=True)
            continue
        latencies = []
        cpu, start = time.process_time(), time.time()
        now = begin = time.perf_counter()
        until = begin + float(rest[0])
        while now < until:
            conn.round(kind, chunks)
            latencies.append(time.perf_counter() - now)
            now += latencies[-1]
        cpu, end = time.process_time() - cpu, start + (now - begin)
        conn.end_phase()
        print(json.dumps({"rounds": len(latencies), "requests": len(latencies) * chunks,
                          "cpu": cpu, "start": start, "end": end,
                          "lat_us": [round(x * 1e6) for x in latencies]}), flush=True)
    conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("role", choices=("server", "client"))
    parser.add_argument("candidate", choices=CANDIDATES)
    parser.add_argument("server_port", type=int, nargs="?", default=0)
    parser.add_argument("--port", type=int, default=0, help="the server's (0: any free port)")
    parser.add_argument("--small-bytes", type=int, default=16 << 10)
    parser.add_argument("--dense-chunks", type=int, default=100)
    parser.add_argument("--warmup-chunks", type=int, default=10)
    parser.add_argument("--certs", type=Path, help="the TLS candidates' certificates")
    args = parser.parse_args()
    if args.role == "server":
        serve(args.candidate, args)
    else:
        client(args.candidate, args.server_port, args)


if __name__ == "__main__":
    main()
