"""Frames: a server reads no message longer than a frame; larger requests travel in frames."""

from __future__ import annotations

import hashlib
import os
import threading

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from towerflow.cluster import Credentials, Server
from towerflow.cluster.auth import ClientAuth
from towerflow.cluster.frames import (
    DEFAULT_FRAME_BYTES,
    FRAME_HEADROOM,
    FRAMES_METADATA_KEY,
    MIN_FRAME_BYTES,
    frame_metadata,
    framed,
    join_pieces,
    pieces,
)
from towerflow.cluster.server import ServerOptions
from towerflow.cluster.transport import (
    ChannelOptions,
    RequestStream,
    make_channel,
    raw_handlers,
    requests_until_closed,
    stream_unary,
    unary,
    unary_stream,
)
from towerflow.errors import (
    InvalidArgumentError,
    ResourceExhaustedError,
    UnauthenticatedError,
)

SECRET = b"frames-cluster-secret"
FRAME = DEFAULT_FRAME_BYTES
#: the server's cap on one joined request message in these tests
CAP = 24 << 20


# --------------------------------------------------------------------------- the framing
@given(messages=st.lists(st.one_of(st.binary(max_size=40),
                                   st.integers(0, 4).map(lambda k: b"x" * (8 * k))),
                         max_size=8),
       frame=st.sampled_from([1, 3, 8]))
def test_pieces_join_back_into_the_same_messages(messages, frame):
    sent = list(framed(messages, frame))
    assert all(len(p) <= frame or p in messages for p in sent)
    assert list(join_pieces(iter(sent), frame, 1 << 20)) == messages


def test_a_message_shorter_than_a_frame_is_sent_as_it_is_and_a_full_one_ends_empty():
    small = b"abc"
    assert next(pieces(small, 4)) is small
    assert list(pieces(b"abcd", 4)) == [b"abcd", b""]
    assert list(pieces(memoryview(b"abcdefghij"), 4)) == [b"abcd", b"efgh", b"ij"]


def test_joining_refuses_a_message_over_the_limit_and_a_stream_ending_inside_one():
    with pytest.raises(ResourceExhaustedError, match=r"more than 8 bytes \(12 so far\).*raise "
                                                     r"the cap"):
        list(join_pieces(iter([b"abcd", b"abcd", b"abcd", b""]), 4, 8))
    with pytest.raises(InvalidArgumentError, match=r"ended inside a framed message \(8 bytes "
                                                   r"in pieces of 4\)"):
        list(join_pieces(iter([b"abcd", b"abcd"]), 4, 100))


def test_a_server_reads_one_frame_and_its_headroom_and_a_channel_the_whole_limit():
    options = dict(ChannelOptions().server_options())
    assert options["grpc.max_receive_message_length"] == FRAME + FRAME_HEADROOM
    assert options["grpc.max_send_message_length"] == 64 << 20
    assert dict(ChannelOptions().grpc_options())["grpc.max_receive_message_length"] == 64 << 20
    small = dict(ChannelOptions(max_message_bytes=1 << 20).server_options())
    assert small["grpc.max_receive_message_length"] == 1 << 20
    with pytest.raises(InvalidArgumentError, match=r"frame_bytes=1000.*at least 65,536 bytes"):
        ChannelOptions(frame_bytes=1000)


# --------------------------------------------------------------------------- a server
class Seen:
    """What the handlers received."""

    def __init__(self) -> None:
        self.calls = 0
        self.lock = threading.Lock()

    def count(self) -> None:
        with self.lock:
            self.calls += 1


@pytest.fixture
def served(free_ports):
    """A server with a cap of 24 MiB per request message; yields (address, seen)."""
    seen = Seen()

    def digest(request: bytes) -> bytes:
        seen.count()
        return hashlib.sha256(request).digest() + len(request).to_bytes(8, "little")

    def digests(requests) -> bytes:  # type: ignore[no-untyped-def]
        seen.count()
        return b"".join(digest(r) for r in requests)

    def halves(request: bytes):  # type: ignore[no-untyped-def]
        seen.count()
        yield request[: len(request) // 2]
        yield request[len(request) // 2:]

    def each(requests):  # type: ignore[no-untyped-def]
        for request in requests_until_closed(requests):
            yield digest(request)

    address = f"127.0.0.1:{free_ports(1)[0]}"
    service = raw_handlers("test.Frames", {
        "Digest": ("unary_unary", digest), "Digests": ("stream_unary", digests),
        "Halves": ("unary_stream", halves), "Each": ("stream_stream", each)})
    options = ServerOptions(channel=ChannelOptions(max_message_bytes=CAP))
    server = Server({"local": [address]}, "local", 0, credentials=Credentials(secret=SECRET),
                    handlers=[service], options=options)
    try:
        yield address, seen
    finally:
        server.stop(0)


def _answer(payload: bytes) -> bytes:
    return hashlib.sha256(payload).digest() + len(payload).to_bytes(8, "little")


@pytest.fixture
def channel(served):
    channel = make_channel(served[0], Credentials(secret=SECRET),
                           options=ChannelOptions(max_message_bytes=64 << 20))
    yield channel
    channel.close()


def test_requests_larger_than_a_frame_reach_the_handler_whole_on_every_kind_of_call(channel):
    sizes = [0, 5, FRAME - 1, FRAME, FRAME + 1, 2 * FRAME, 9 << 20]
    payloads = [os.urandom(n) for n in sizes]
    for payload in payloads:
        assert unary(channel, "/test.Frames/Digest", payload, timeout=30) == _answer(payload)
        halves = list(unary_stream(channel, "/test.Frames/Halves", payload, timeout=30))
        assert b"".join(halves) == payload
    reply = stream_unary(channel, "/test.Frames/Digests", iter(payloads), timeout=60)
    assert reply == b"".join(_answer(p) for p in payloads)


def test_a_request_stream_carries_large_requests_among_small_ones_in_order(channel):
    payloads = [b"first", os.urandom(9 << 20), b"", os.urandom(FRAME), b"last"]
    stream = RequestStream(channel, "/test.Frames/Each", 60.0, payloads[0])
    try:
        for payload in payloads[1:]:
            stream.send(payload)
        assert [stream.receive() for _ in payloads] == [_answer(p) for p in payloads]
    finally:
        stream.close()


def test_a_framed_request_over_the_servers_cap_is_refused_and_reaches_no_handler(served, channel):
    _, seen = served
    with pytest.raises(ResourceExhaustedError, match=r"refuses a request message of "
                                                     r"26,214,400 bytes to /test.Frames/Digest: "
                                                     r"more than its limit of 25,165,824.*raise "
                                                     r"the cap"):
        unary(channel, "/test.Frames/Digest", bytes(25 << 20), timeout=30)
    assert seen.calls == 0  # refused from what the call declared, before a piece was read
    with pytest.raises(ResourceExhaustedError, match=r"a request message of at least [\d,]+ "
                                                     r"bytes to /test.Frames/Digests"):
        stream_unary(channel, "/test.Frames/Digests", iter([b"a", bytes(25 << 20)]), timeout=30)
    assert seen.calls == 2  # the handler and its first message; the second never came whole


def test_a_streamed_first_message_over_the_cap_is_refused_before_its_handler(served, channel):
    """The auth check holds a framed call's first message to check its digest: no more of it
    than the cap, even from a peer with the secret."""
    with pytest.raises(ResourceExhaustedError, match=r"call refused: /test.Frames/Digests: a "
                                                     r"request message of more than 25,165,824"):
        stream_unary(channel, "/test.Frames/Digests", iter([bytes(25 << 20)]), timeout=30)


def test_a_framed_control_call_is_refused_unread_even_with_the_secret(free_ports):
    seen = Seen()

    def status(request: bytes) -> bytes:
        seen.count()
        return b"ok"

    address = f"127.0.0.1:{free_ports(1)[0]}"
    service = raw_handlers("test.Control", {"Status": ("unary_unary", status)})
    server = Server({"local": [address]}, "local", 0, credentials=Credentials(secret=SECRET),
                    handlers=[service])
    channel = make_channel(address, Credentials(secret=SECRET),
                           options=ChannelOptions(max_message_bytes=64 << 20))
    try:
        assert unary(channel, "/test.Control/Status", b"small", timeout=30) == b"ok"
        with pytest.raises(ResourceExhaustedError, match=r"refuses the framed call to "
                                                         r"/test.Control/Status: a control "
                                                         r"call is one message of at most a "
                                                         r"frame"):
            unary(channel, "/test.Control/Status", bytes(3 * FRAME), timeout=30)
    finally:
        channel.close()
        server.stop(0)
    assert seen.calls == 1


def test_one_message_longer_than_a_frame_is_refused_unread_whoever_sends_it(served):
    address, seen = served
    raw = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20)])
    signed = grpc.intercept_channel(raw, ClientAuth(SECRET, raw, address))
    try:
        with pytest.raises(grpc.RpcError) as caught:  # a client that does not frame it
            signed.unary_unary("/test.Frames/Digest")(bytes(FRAME + FRAME_HEADROOM + 1),
                                                      timeout=30)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # a frame and its headroom is read
        signed.unary_unary("/test.Frames/Digest")(bytes(FRAME + FRAME_HEADROOM), timeout=30)
    finally:
        raw.close()
    assert seen.calls == 1


@pytest.mark.parametrize("value", ["12", "abc", "4194304:x"])
def test_a_call_naming_a_bad_frame_is_refused_in_one_sentence(served, value):
    address, seen = served
    raw = grpc.insecure_channel(address)
    signed = grpc.intercept_channel(raw, ClientAuth(SECRET, raw, address))
    try:
        with pytest.raises(grpc.RpcError) as caught:
            signed.stream_unary("/test.Frames/Digest")(
                iter([b"x"]), timeout=10, metadata=((FRAMES_METADATA_KEY, value),))
    finally:
        raw.close()
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"send frames of at least {MIN_FRAME_BYTES:,} bytes" in caught.value.details()
    assert seen.calls == 0


class _Tamper(grpc.StreamUnaryClientInterceptor):
    """Below the authenticating interceptor: changes a byte of the second piece on the wire."""

    def intercept_stream_unary(self, continuation, details, request_iterator):  # type: ignore[override]
        sent = list(request_iterator)
        sent[1] = b"\xff" + sent[1][1:]
        return continuation(details, iter(sent))


def test_the_token_covers_every_piece_of_a_framed_request(served):
    address, seen = served
    raw = grpc.insecure_channel(address)
    tampered = grpc.intercept_channel(grpc.intercept_channel(raw, _Tamper()),
                                      ClientAuth(SECRET, raw, address))
    try:
        with pytest.raises(UnauthenticatedError, match="not the one its credentials were issued"):
            unary(tampered, "/test.Frames/Digest", bytes(FRAME + 10), timeout=30)
    finally:
        raw.close()
    assert seen.calls == 0


def test_a_framed_call_without_credentials_is_refused_before_its_pieces_are_read(served):
    address, seen = served
    with grpc.insecure_channel(address) as stranger:
        with pytest.raises(grpc.RpcError) as caught:
            stranger.stream_unary("/test.Frames/Digest")(
                pieces(bytes(9 << 20), FRAME), timeout=10, metadata=frame_metadata(FRAME))
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert seen.calls == 0
