"""A server's limits: stream caps per peer and in all, rate-limited warnings, the default-visible line."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import textwrap
import threading
import time

import grpc
import pytest

from towerflow.cluster import Credentials, Server, ServerOptions
from towerflow.cluster.limits import RateLimitedLog
from towerflow.cluster.server import PING_METHOD
from towerflow.cluster.transport import make_channel, raw_handlers, stream_unary, unary
from towerflow.errors import InvalidArgumentError, ResourceExhaustedError
from towerflow.testing import wait_until

SECRET = Credentials(secret=b"limits-test-secret")


def _own_connection(address: str) -> grpc.Channel:
    """A channel with its own connection (gRPC shares one between equal channels otherwise)."""
    channel = grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
    from towerflow.cluster.auth import ClientAuth

    return grpc.intercept_channel(channel, ClientAuth(SECRET.secret, channel, address))


class _IdleStreams:
    """Streams that send one message and then nothing until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls: list[grpc.Future] = []

    def _requests(self):  # type: ignore[no-untyped-def]
        yield b"hello"
        self.release.wait(60)

    def open(self, channel: grpc.Channel, n: int) -> None:
        for _ in range(n):
            self.calls.append(channel.stream_unary("/t.Idle/Hold").future(self._requests(),
                                                                          timeout=60))

    def refused(self) -> list[str]:
        """Details of the calls that ended with RESOURCE_EXHAUSTED (waits for them to end)."""
        out = []
        for call in self.calls:
            if call.done() and call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                out.append(call.details())
        return out


def _hold(requests) -> bytes:  # type: ignore[no-untyped-def]
    for _ in requests:
        pass
    return b"done"


@pytest.fixture
def idle_server(free_ports):
    def start(options: ServerOptions) -> tuple[Server, str]:
        address = f"127.0.0.1:{free_ports(1)[0]}"
        server = Server({"ps": [address]}, "ps", 0, credentials=SECRET, services=None,
                        handlers=[raw_handlers("t.Idle", {"Hold": ("stream_unary", _hold)})],
                        options=options)
        started.append(server)
        return server, address

    started: list[Server] = []
    yield start
    for server in started:
        server.stop(0)


def test_a_stream_past_the_cap_of_its_peer_is_refused_and_other_peers_go_on(idle_server):
    server, address = idle_server(ServerOptions(max_workers=16, max_streams=8,
                                                max_streams_per_peer=3))
    idle = _IdleStreams()
    hostile = _own_connection(address)
    honest = make_channel(address, SECRET)
    try:
        idle.open(hostile, 5)
        wait_until(lambda: len(idle.refused()) == 2 and server.streams.open_streams == 3,
                   timeout=30.0, what="two refused and three open streams")
        assert re.search(r"refuses another stream from ipv[46]:\S+: it already has 3 open, the cap "
                         r"per peer \(max_streams_per_peer=3\); close idle streams or raise the "
                         r"cap \(ServerOptions\.max_streams_per_peer, towerflow server "
                         r"--max-streams-per-peer\)", idle.refused()[0])
        # the honest peer streams and calls as before
        assert stream_unary(honest, "/t.Idle/Hold", iter([b"x", b"y"]), timeout=10) == b"done"
        assert b'"job": "ps"' in unary(honest, PING_METHOD, b"", timeout=10)
    finally:
        idle.release.set()
        hostile.close()
        honest.close()
    wait_until(lambda: server.streams.open_streams == 0, timeout=30.0, what="every stream closed")


def test_idle_streams_past_the_cap_in_all_are_refused_and_unary_calls_still_answer(idle_server):
    # the default caps: 256 handler threads, 192 streams in all, 32 per connection
    server, address = idle_server(ServerOptions())
    idle = _IdleStreams()
    channels = [_own_connection(address) for _ in range(9)]
    honest = make_channel(address, SECRET)
    try:
        for channel in channels:
            idle.open(channel, 29)  # 261 streams, none over the cap of its connection
        wait_until(lambda: server.streams.open_streams + len(idle.refused()) == 261,
                   timeout=60, what="261 streams open or refused")
        assert server.streams.open_streams == 192
        assert "the cap in all (max_streams=192)" in idle.refused()[0]
        started = time.monotonic()
        assert b'"job": "ps"' in unary(honest, PING_METHOD, b"", timeout=10)
        assert time.monotonic() - started < 5
        with pytest.raises(ResourceExhaustedError, match=r"failed with RESOURCE_EXHAUSTED: .*"
                           r"192 are open, the cap in all \(max_streams=192\); close idle "
                           r"streams or raise the cap"):
            stream_unary(honest, "/t.Idle/Hold", iter([b"x"]), timeout=10)
    finally:
        idle.release.set()
        for channel in channels:
            channel.close()
        honest.close()
    wait_until(lambda: server.streams.open_streams == 0,
               timeout=30.0, what="every stream closed")  # every handler returned


def test_stream_caps_must_leave_threads_for_unary_calls():
    with pytest.raises(InvalidArgumentError, match=r"max_streams below max_workers"):
        Server({"ps": ["127.0.0.1:1"]}, "ps", 0, credentials=SECRET, start=False,
               options=ServerOptions(max_workers=8, max_streams=8))


def test_a_repeated_warning_is_written_once_then_with_its_count(caplog):
    log = RateLimitedLog(logging.getLogger("towerflow.cluster"), interval=0.5)
    with caplog.at_level(logging.WARNING, logger="towerflow.cluster"):
        for i in range(3000):
            log.warning("no credentials", "refused call to %s: no credentials", f"/m{i % 3}")
        log.warning("other", "something else")
        wait_until(lambda: "more in the last" in caplog.text,
                   timeout=10, what="the rate-limited line")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["refused call to /m0: no credentials", "something else",
                     "refused call to /m0: no credentials (and 2,999 more in the last 0.5 s)"]


@pytest.mark.slow
def test_unauthenticated_calls_to_a_real_server_write_a_few_lines_not_one_each(
        idle_server, caplog):
    server, address = idle_server(ServerOptions(warning_interval=1.0))
    with caplog.at_level(logging.WARNING, logger="towerflow.cluster"), \
            grpc.insecure_channel(address) as bare:
        for _ in range(300):
            with pytest.raises(grpc.RpcError):
                bare.unary_unary(PING_METHOD)(b"", timeout=10)
        wait_until(lambda: "more in the last" in caplog.text,
                   timeout=10, what="the rate-limited line")
    refusals = [r.getMessage() for r in caplog.records if "refused call" in r.getMessage()]
    assert refusals == [
        f"refused call to {PING_METHOD}: no credentials",
        f"refused call to {PING_METHOD}: no credentials (and 299 more in the last 1 s)",
    ]


_PEER_WAIT = textwrap.dedent("""
    import sys
    from towerflow.cluster import Credentials, Server
    {configure}
    spec = {{"local": ["127.0.0.1:{a}", "127.0.0.1:{b}"]}}
    server = Server(spec, "local", 0, credentials=Credentials(secret=b"s"), services=None)
    try:
        server.wait_for_peers(timeout=1.5)
    except Exception as exc:
        print("gave up:", type(exc).__name__, file=sys.stderr)
    server.stop(0)
""")


@pytest.mark.parametrize("configure, shown", [
    ("", True),
    ("import logging; logging.basicConfig(level=logging.WARNING)", False),
    ("import logging; logging.getLogger('towerflow.cluster').setLevel(logging.WARNING)", False),
    ("import logging; logging.basicConfig(level=logging.INFO, format='app: %(message)s')", True),
], ids=["unconfigured", "basicConfig-warning", "level-on-logger", "basicConfig-info"])
def test_the_peer_wait_line_shows_by_default_and_follows_logging_configuration(
        free_ports, subprocess_env, configure, shown):
    a, b = free_ports(2)
    program = _PEER_WAIT.format(configure=configure, a=a, b=b)
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=120, env=subprocess_env)
    line = f"waiting for /job:local/replica:0/task:1 at 127.0.0.1:{b} (failed to connect; retrying)"
    assert "gave up: UnavailableError" in done.stderr
    assert (line in done.stderr) is shown, done.stderr
    assert line not in done.stdout
    if "format='app:" in configure:
        assert f"app: {line}" in done.stderr


def test_closing_the_log_writes_every_open_count_and_leaves_no_timer(caplog):
    log = RateLimitedLog(logging.getLogger("towerflow.cluster"), interval=3600)
    with caplog.at_level(logging.WARNING, logger="towerflow.cluster"):
        for _ in range(5):
            log.warning("a", "refused call to %s: no credentials", "/a")
        log.warning("b", "something else")  # no repeat: no count line
        log.close()
    assert [r.getMessage() for r in caplog.records] == [
        "refused call to /a: no credentials", "something else",
        "refused call to /a: no credentials (and 4 more in the last 3600 s)"]
    assert not [t for t in threading.enumerate()
                if isinstance(t, threading.Timer) and t.function == log._close]


def test_a_warning_after_close_is_written_at_once_with_no_timer(caplog):
    log = RateLimitedLog(logging.getLogger("towerflow.cluster"), interval=3600)
    log.close()
    with caplog.at_level(logging.WARNING, logger="towerflow.cluster"):
        log.warning("late", "refused call to %s: no credentials", "/late")
    assert [r.getMessage() for r in caplog.records] == ["refused call to /late: no credentials"]
    assert not [t for t in threading.enumerate()
                if isinstance(t, threading.Timer) and t.function == log._close]
