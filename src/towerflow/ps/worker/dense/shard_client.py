"""A worker's calls to one ps task of the dense path: status, init, pull, push, done, ledger.

A :class:`ShardClient` holds an authenticated channel to one ps task and what
its shard holds. A push streams the gradient in chunks (one message each way
for a shard of one chunk, on a long-lived stream) and can bring the fresh
parameters back in the same call; a push whose attempt runs out of time is
sent again as the same push (the ps applies it once) while ``push_wait``
allows. :class:`~towerflow.ps.worker.dense.client.PSClient` runs one per ps
task, in parallel.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import grpc
import numpy as np

from towerflow.cluster.transport import (
    RequestStream,
    channel_address,
    map_rpc_error,
    stream_unary,
    unary,
    unary_stream,
)
from towerflow.errors import (
    DataLossError,
    DeadlineExceededError,
    FailedPreconditionError,
    TowerflowError,
    UnavailableError,
)
from towerflow.ps.placement import ShardLayout
from towerflow.ps.wire import ps_pb2 as pb
from towerflow.ps.wire.calls import failure_line, method_path
from towerflow.ps.wire.finite import all_finite
from towerflow.ps.wire.framing import CHUNK_BYTES, chunks, pack, unpack
from towerflow.ps.wire.messages import (
    AggregationConfig,
    PushHeader,
    aggregation_to_proto,
    encode_push_header,
    layout_to_proto,
    optimizer_to_proto,
    parse_message,
    push_records,
    signature_bytes,
)
from towerflow.ps.worker.failover import ShardRoute, failover_worthy, routed_push

__all__ = ["ShardClient", "PUSH_RETRY_LOG_EVERY"]

logger = logging.getLogger("towerflow.ps")

#: seconds of waiting for a ps task before a line says so, then between two such lines
_NOTE_AFTER_S, _NOTE_EVERY_S = 3.0, 10.0

#: a push sent again after its deadline logs a line at its first retry and every this many
PUSH_RETRY_LOG_EVERY = 5

_T = TypeVar("_T")


def _receive(into: np.ndarray, chunks: Iterator[bytes], numel: int, what: str) -> None:
    if numel != into.size:
        raise DataLossError(
            f"{what} announces {numel} elements but this worker's buffer holds {into.size}; "
            "the ps holds another model: restart it or the chief."
        )
    raw = into.view(np.uint8)
    pos = 0
    for chunk in chunks:
        end = pos + len(chunk)
        if end > raw.size:
            raise DataLossError(f"{what} sent more than the {raw.size} bytes it announced.")
        raw[pos:end] = np.frombuffer(chunk, np.uint8)
        pos = end
    if pos != raw.size:
        raise DataLossError(f"{what} ended after {pos} of {raw.size} bytes.")


class ShardClient:
    """Calls to one ps task.

    Args:
        channel: an authenticated channel to the ps task.
        layout: what that shard holds.
        timeout: deadline of ordinary calls (seconds).
        push_timeout: deadline of one attempt of a push (covers a sync step's wait).
        push_wait: how long, from its start, a push whose attempt ran out of
            time is sent again (the same push: the ps answers the retry with the
            first attempt's outcome, so it is applied once); None: for ever; 0:
            never.
        chunk_bytes: size of streamed chunks.
        route: with ``replicas=1``, where the shard is served and at which term (every
            request names both, and a primary that is gone is switched from to its
            replica: :class:`~towerflow.ps.worker.failover.ShardRoute`); None:
            the ps task of ``channel``, requests as with no replica.
    """

    def __init__(self, channel: grpc.Channel, layout: ShardLayout, *, timeout: float = 30.0,
                 push_timeout: float | None = None, push_wait: float | None = 0.0,
                 chunk_bytes: int = CHUNK_BYTES, route: ShardRoute | None = None) -> None:
        self._channel = channel
        self.route = route
        self.layout = layout
        self.timeout = timeout
        self.push_timeout = push_timeout or timeout
        self.push_wait = push_wait
        self.chunk_bytes = chunk_bytes
        self.version = 0  # the shard step of the last parameters received
        self._stream: RequestStream | None = None
        self._stream_lock = threading.Lock()
        self._sent_at = 0.0  # when start_push queued the push finish_push reads
        self._signature = signature_bytes(layout)

    @property
    def channel(self) -> grpc.Channel:
        """The channel to the ps task serving the shard now."""
        return self._channel if self.route is None else self.route.channel

    def _routing(self) -> dict[str, int]:
        """The fields naming the shard and its term in a request (none with no route)."""
        if self.route is None:
            return {}
        return {"shard": self.layout.index, "term": self.route.term}

    def _routed(self, request: bytes) -> bytes:
        """A packed push request (:meth:`encode_small`) naming the shard's term now (the
        request itself when it does, or with no route)."""
        if self.route is None:
            return request
        return routed_push(request, self.layout.index, self.route.term)

    def _switch(self, before: tuple[int, int] | None, exc: TowerflowError) -> bool:
        """After a failed call sent at ``before``: whether the shard is served elsewhere now
        (its replica took it over: send again; the push stream is dropped). ``before`` None
        with a route: a call that switches nothing itself (an Init: a task starting is no
        reason to promote its copy) follows a switch made already."""
        if before is None and self.route is not None:
            return failover_worthy(exc) and self.route.discover()
        if before is None or not self.route.fail_over(before, exc):
            return False
        if self._stream_lock.acquire(blocking=False):
            try:
                self.close_stream()
            finally:
                self._stream_lock.release()
        return True

    def _once(self, call: Callable[[], _T]) -> _T:
        """Run ``call``; sent again on the shard's replica when its primary is gone."""
        while True:
            before = None if self.route is None else self.route.where()
            try:
                return call()
            except (UnavailableError, DeadlineExceededError, FailedPreconditionError) as exc:
                if not self._switch(before, exc):
                    raise

    @property
    def address(self) -> str:
        """The ps task's address."""
        return channel_address(self.channel)

    def _retrying(self, call: Callable[[], _T], timeout: float, *, failover: bool = True) -> _T:
        """Run ``call``, retrying while the ps is unavailable, until ``timeout`` (with a
        route and ``failover``, on the shard's replica once its primary is gone).

        While it waits, a line every few seconds says for what; when it gives up,
        the error says how long it tried.
        """
        start = time.monotonic()
        deadline, note = start + timeout, start + _NOTE_AFTER_S
        delay = 0.05
        while True:
            before = None if self.route is None or not failover else self.route.where()
            try:
                return call()
            except (DeadlineExceededError, FailedPreconditionError) as exc:
                if not self._switch(before, exc):
                    raise
                continue
            except UnavailableError as exc:
                if self._switch(before, exc):
                    continue
                now = time.monotonic()
                if now + delay >= deadline:
                    why = f" {self.route.refusal}" if self.route and self.route.refusal else ""
                    raise UnavailableError(
                        f"the ps task at {self.address} did not answer for {now - start:.0f} s: "
                        f"{exc}{why}") from None
                if now >= note:
                    logger.info("waiting for the ps task at %s to answer (%.0f s of %.0f s); "
                                "is it running?", self.address, now - start, timeout)
                    note = now + _NOTE_EVERY_S
                time.sleep(delay)
                delay = min(delay * 2, 1.0)

    def status(self, timeout: float | None = None, *, failover: bool = True) -> pb.StatusReply:
        """The shard's status (initialised, step, layout fingerprint, counters); with a route
        and ``failover``, from its replica once its primary is gone (without ``failover``, from
        the task the route names, at whatever term it serves the shard)."""
        routing = self._routing() if failover else {
            k: v for k, v in self._routing().items() if k != "term"}

        def call() -> bytes:  # no route: an empty request, as before replicas
            return unary(self.channel, method_path("Status"),
                         pb.StatusRequest(**routing).SerializeToString(),
                         timeout=timeout or self.timeout)

        data = self._once(call) if failover else call()
        return parse_message(pb.StatusReply, data, "StatusReply")

    def init(self, params: np.ndarray, *, optimizer: Any,
             aggregation: AggregationConfig, step: int = 0,
             slots: Mapping[str, np.ndarray] | None = None, optimizer_step: int = 0,
             pushes: Sequence[tuple[int, int, int, str]] = ()) -> None:
        """Create the shard with ``params`` (and optimizer ``slots``) on the ps.

        ``optimizer``: what the ps applies gradients with (an ``OptimizerConfig``
        or its ``OptimizerSpec``, :func:`~towerflow.ps.wire.messages.optimizer_to_proto`).
        ``pushes``: the shard's push table from a checkpoint (rows
        ``(worker, incarnation, seq, status)``), so that the pushes it had
        answered are not applied again.
        """
        slots = dict(slots or {})
        req = pb.InitRequest(
            shard=self.layout.index, segments=layout_to_proto(self.layout),
            optimizer=optimizer_to_proto(optimizer, (s.name for s in self.layout.segments)),
            aggregation=aggregation_to_proto(aggregation),
            step=step, slots=list(slots), optimizer_step=optimizer_step,
            pushes=push_records(pushes))

        def messages() -> Iterator[bytes]:
            yield req.SerializeToString()
            for buf in (params, *slots.values()):
                yield from chunks(np.asarray(buf, np.float32).reshape(-1), self.chunk_bytes)

        self._retrying(lambda: stream_unary(self.channel, method_path("Init"), messages(),
                                            timeout=self.timeout), self.timeout, failover=False)
        self.version = step

    def pull(self, into: np.ndarray, buffer: str = "params", *, track: bool = True) -> pb.PullReply:
        """Receive the shard's ``buffer`` into ``into``; return the reply header.

        With ``track`` (the default) pulled parameters become the version the
        next push says its gradient was computed on; a snapshot for a
        checkpoint passes ``track=False``.
        """
        def call() -> pb.PullReply:
            req = pb.PullRequest(buffer=buffer, **self._routing()).SerializeToString()
            replies = unary_stream(self.channel, method_path("Pull"), req, timeout=self.timeout)
            first = next(replies, None)
            if first is None:
                raise DataLossError(f"ps shard {self.layout.index} answered a pull with nothing.")
            head = parse_message(pb.PullReply, first, "PullReply")
            _receive(into, replies, head.numel, f"ps shard {self.layout.index}")
            return head

        head = self._retrying(call, self.timeout)
        if buffer == "params" and track:
            self.version = head.step
        return head

    @property
    def small(self) -> bool:
        """Whether a push and its parameters fit one message each way."""
        return self.layout.nbytes <= self.chunk_bytes

    def _head(self, grad: np.ndarray, *, worker_id: int, incarnation: int, seq: int, lr: float,
              want_params: bool, last_step: int = 0) -> tuple[PushHeader, bytes]:
        header = PushHeader(
            worker_id=worker_id, incarnation=incarnation, seq=seq, token=self.version, lr=lr,
            dtype="float32" if grad.dtype == np.float32 else str(grad.dtype), numel=grad.size,
            # informative: the ps checks every chunk itself
            finite=not self.small and grad.dtype == np.float32 and all_finite(grad),
            last_step=last_step, **self._routing())
        return header, encode_push_header(header, want_params=want_params,
                                          signature=self._signature)

    def encode_small(self, grad: np.ndarray, *, worker_id: int, incarnation: int, seq: int,
                     lr: float, want_params: bool, last_step: int = 0) -> bytes:
        """A small push as one ``PushPullSmall`` request (header and gradient packed: a copy,
        so the gradient's buffer may be reused before it is sent)."""
        _, head = self._head(grad, worker_id=worker_id, incarnation=incarnation, seq=seq,
                             lr=lr, want_params=want_params, last_step=last_step)
        return pack(head, memoryview(np.ascontiguousarray(grad)).cast("B"))

    def start_push(self, request: bytes) -> bool:
        """Queue a small push (:meth:`encode_small`) on this shard's stream without waiting
        for its reply.

        True: :meth:`finish_push` reads the reply (the stream is held until then).
        False: nothing was sent (a large shard, or another thread holds the stream):
        call :meth:`push_small`. So a worker's pushes to several shards are on their way
        before it reads the first reply, with no thread per shard.
        """
        if not self.small or not self._stream_lock.acquire(blocking=False):
            return False
        try:
            self._send_on_stream(self._routed(request))
        except BaseException:
            self.close_stream()
            self._stream_lock.release()
            raise
        self._sent_at = time.monotonic()
        return True

    def finish_push(self, request: bytes, *, pull_into: np.ndarray | None = None,
                    what: str = "a push") -> pb.PushReply:
        """The reply of the push :meth:`start_push` queued.

        A stream that fails is dropped and the push sent again by :meth:`push_small`,
        with its retries and waits: the ps applies a push once, whatever the tries. A
        push out of time once ``push_wait`` has passed raises, as :meth:`push` does.
        """
        stream, data, failure = self._stream, None, None
        try:
            data = stream.receive() if stream is not None else None
        except TowerflowError as exc:
            failure = exc
        if data is None:
            self.close_stream()
        self._stream_lock.release()
        if data is not None:
            return self.small_reply(data, pull_into)
        if failure is not None and self._switch(
                None if self.route is None else self.route.where(), failure):
            return self.push_small(request, pull_into=pull_into, what=what)  # on the replica
        if isinstance(failure, DeadlineExceededError) and self.push_wait is not None \
                and time.monotonic() - self._sent_at >= self.push_wait:
            raise failure
        return self.push_small(request, pull_into=pull_into, what=what)

    def abandon_push(self) -> None:
        """Give up the push :meth:`start_push` queued without reading its reply."""
        self.close_stream()
        self._stream_lock.release()

    def push_small(self, request: bytes, *, pull_into: np.ndarray | None = None,
                   what: str = "a push") -> pb.PushReply:
        """Send a small push (:meth:`encode_small`) and read its reply, with the retries and
        waits of :meth:`push` (``what`` names it in their log lines)."""
        return self._waiting(lambda: self._push_pull_small(request, pull_into), what)

    def push_name(self, worker_id: int, incarnation: int, seq: int) -> str:
        """How log lines name a push of this shard (with the step it was computed on)."""
        return (f"push {seq} of worker {worker_id} (incarnation {incarnation}, computed on "
                f"step {self.version})")

    def push(self, grad: np.ndarray, *, worker_id: int, incarnation: int, seq: int, lr: float,
             pull_into: np.ndarray | None = None, last_step: int = 0) -> pb.PushReply:
        """Push ``grad``; with ``pull_into``, receive the fresh parameters in the same call."""
        what = self.push_name(worker_id, incarnation, seq)
        if self.small:  # one message each way
            return self.push_small(self.encode_small(
                grad, worker_id=worker_id, incarnation=incarnation, seq=seq, lr=lr,
                want_params=pull_into is not None, last_step=last_step), pull_into=pull_into,
                what=what)
        def messages() -> Iterator[bytes]:  # the head names the shard's term at each try
            yield self._head(grad, worker_id=worker_id, incarnation=incarnation, seq=seq,
                             lr=lr, want_params=pull_into is not None, last_step=last_step)[1]
            yield from chunks(grad, self.chunk_bytes)

        def call() -> pb.PushReply:
            if pull_into is None:
                data = stream_unary(self.channel, method_path("Push"), messages(),
                                    timeout=self.push_timeout)
                return parse_message(pb.PushReply, data, "PushReply")
            return self._push_pull(messages(), pull_into)

        reply = self._waiting(call, what)
        if pull_into is not None and reply.numel:
            self.version = reply.step
        return reply

    def _waiting(self, call: Callable[[], pb.PushReply], what: str) -> pb.PushReply:
        """Run a push's ``call``; after its deadline send it again while ``push_wait`` allows."""
        start = time.monotonic()
        retries = 0
        while True:
            try:
                return self._retrying(call, self.push_timeout)
            except DeadlineExceededError:
                waited = time.monotonic() - start
                if self.push_wait is not None and waited >= self.push_wait:
                    raise
            retries += 1
            if retries % PUSH_RETRY_LOG_EVERY == 1 or PUSH_RETRY_LOG_EVERY == 1:
                limit = ("for ever (step_timeout=None)" if self.push_wait is None
                         else f"up to {self.push_wait:g} s")
                logger.warning(
                    "%s is still waiting for ps task %d at %s after %.0f s: its step needs the "
                    "other workers' gradients. Sent again (retry %d, each attempt %g s; the ps "
                    "applies it once); waiting %s.", what, self.layout.index, self.address,
                    waited, retries, self.push_timeout, limit)

    def _push_pull_small(self, request: bytes, into: np.ndarray | None) -> pb.PushReply:
        request = self._routed(request)
        if self._stream_lock.acquire(blocking=False):
            try:
                data = self._stream_round_trip(request)
            finally:
                self._stream_lock.release()
        else:  # another thread's push holds the stream
            data = unary(self.channel, method_path("PushPullSmall"), request, timeout=self.push_timeout)
        return self.small_reply(data, into)

    def small_reply(self, data: bytes, into: np.ndarray | None) -> pb.PushReply:
        """A ``PushPullSmall`` reply: its ``PushReply``, the parameters it carries written
        into ``into``."""
        head, params = unpack(data)
        reply = parse_message(pb.PushReply, head, "PushReply")
        if reply.numel and into is not None:
            _receive(into, iter((params,)), reply.numel, f"ps shard {self.layout.index}")
            self.version = reply.step
        return reply

    def _send_on_stream(self, request: bytes) -> None:
        """Queue ``request`` on the long-lived push stream (opened anew when old or closed)."""
        if self._stream is not None and not self._stream.fresh:
            self.close_stream()
        if self._stream is None:
            self._stream = RequestStream(self.channel, method_path("PushPullSmallStream"),
                                         self.push_timeout, request)
        else:
            self._stream.send(request)

    def _stream_round_trip(self, request: bytes) -> bytes:
        """One push-and-pull on the long-lived stream (reopened when old or broken)."""
        self._send_on_stream(request)
        try:
            return self._stream.receive()
        except TowerflowError:
            self.close_stream()
            raise

    def close_stream(self) -> None:
        """End the push stream, if one is open (the next small push opens another)."""
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()

    def _push_pull(self, messages: Iterator[bytes], into: np.ndarray) -> pb.PushReply:
        method = method_path("PushPull")
        call = self.channel.stream_stream(method)(messages, timeout=self.push_timeout)
        try:
            replies = iter(call)
            first = next(replies, None)
            if first is None:
                raise DataLossError(f"ps shard {self.layout.index} answered a push with nothing.")
            reply = parse_message(pb.PushReply, first, "PushReply")
            if reply.numel:
                _receive(into, replies, reply.numel, f"ps shard {self.layout.index}")
            return reply
        except grpc.RpcError as exc:
            raise map_rpc_error(exc, method, self.address) from None
        finally:
            call.cancel()

    def done(self, worker_id: int, checkpoint_step: int | None = None, ticket: bytes = b"", *,
             failure: str = "") -> None:
        """Tell the shard this worker has finished (the chief: after its final checkpoint,
        written at global step ``checkpoint_step``; None: it wrote none; an elastic worker:
        with its id's ``ticket``; the chief that failed before initialising: its
        ``failure``)."""
        request = pb.DoneRequest(worker_id=worker_id, final_checkpoint=checkpoint_step is not None,
                                 checkpoint_step=checkpoint_step or 0, ticket=ticket,
                                 failure=failure_line(failure) if failure else "")
        unary(self.channel, method_path("Done"), request.SerializeToString(), timeout=self.timeout)

    def reserve(self, worker_id: int, incarnation: int, last_step: int) -> pb.ReserveReply:
        """``Reserve`` (ps task 0): keep a step of the run's end for this worker's next push."""
        data = self._retrying(lambda: unary(
            self.channel, method_path("Reserve"), pb.ReserveRequest(
                worker_id=worker_id, incarnation=incarnation, last_step=last_step,
                **self._routing()).SerializeToString(), timeout=self.timeout), self.timeout)
        return parse_message(pb.ReserveReply, data, "ReserveReply")

    def ledger(self, since: int = 0) -> pb.LedgerReply:
        """The pushes the shard applied, from ledger entry ``since`` on.

        Raises:
            FailedPreconditionError: the shard's copy took it over (its primary's ledger
                went with that task; a ``Ledger`` call reaches the copy's task's own shard).
        """
        if self.route is not None and self.route.task != self.layout.index:
            raise FailedPreconditionError(
                f"The ledger of shard {self.layout.index} went with ps task "
                f"{self.layout.index}; its copy on ps task {self.route.task} serves the shard "
                "now, and a Ledger call there reads that task's own shard. Audit the shard by "
                "its parameters.")
        data = unary(self.channel, method_path("Ledger"),
                     pb.LedgerRequest(since=since).SerializeToString(), timeout=self.timeout)
        return parse_message(pb.LedgerReply, data, "LedgerReply")
