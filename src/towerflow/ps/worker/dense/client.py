"""The worker's side of the parameter server: pull, push, push-and-pull, prefetch.

A :class:`PSClient` talks to every ps task of a cluster over the cluster
transport (authenticated channels, a deadline on every call). Each shard's
parameters and gradients are one flat float32 numpy buffer on the worker; a
push streams the gradient buffer in chunks and can bring the fresh parameters
back in the same call; shards are reached in parallel by a thread pool. Every
push carries ``(worker_id, incarnation, seq)``, so a push retried after a lost
reply is applied once.

Before streaming a gradient larger than one chunk the client checks that it is
finite (one read pass, no allocation) and says so in the push header: the ps
then applies each chunk as it arrives instead of staging the whole gradient. A
gradient with a NaN / inf is sent unmarked, so the ps refuses it whole and
counts it. A client also tunes its process's malloc for the chunk-sized
``bytes`` gRPC Python sends and receives (``tune_malloc=False`` to opt out).

Example (with a running ps task)::

    client = PSClient(cluster, placement, worker_id=1)
    client.wait_until_initialized(timeout=60)
    step = client.pull(params)                       # list of flat arrays, one per shard
    result = client.push(grads, lr=0.1, pull_into=params)
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import numpy as np

from towerflow.cluster.transport import (
    ChannelOptions,
    Credentials,
    RequestStream,
    channel_address,
    make_channel,
    map_rpc_error,
    stream_unary,
    unary,
    unary_stream,
)
from towerflow.errors import (
    DataLossError,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    TowerflowError,
    UnavailableError,
)
from towerflow.ps import ps_pb2 as pb
from towerflow.ps.buffers import all_finite
from towerflow.ps.buffers import tune_malloc as _tune_malloc
from towerflow.ps.placement import Placement, ShardLayout
from towerflow.ps.protocol import (
    APPLIED,
    CHUNK_BYTES,
    REFUSED,
    AggregationConfig,
    PushHeader,
    aggregation_to_proto,
    chunks,
    encode_push_header,
    layout_to_proto,
    method_path,
    optimizer_to_proto,
    pack,
    parse_message,
    push_records,
    push_rows,
    signature_bytes,
    unpack,
)

__all__ = ["ShardClient", "PSClient", "PushResult", "ShardSnapshot", "PUSH_RETRY_LOG_EVERY"]

logger = logging.getLogger("towerflow.ps")

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


@dataclass(frozen=True, slots=True)
class PushResult:
    """The outcome of one push to every shard.

    Attributes:
        global_step: ps task 0's step after the push.
        statuses: each shard's outcome (``applied``, ``stale``, ``voided``, ``refused``).
        messages: why, for shards that did not apply it.
    """

    global_step: int
    statuses: tuple[str, ...]
    messages: tuple[str, ...]

    @property
    def applied(self) -> bool:
        """True when every shard applied the gradient."""
        return all(s == APPLIED for s in self.statuses)

    @property
    def refused(self) -> bool:
        """True when some shard refused the gradient as invalid."""
        return REFUSED in self.statuses


@dataclass(frozen=True, slots=True)
class ShardSnapshot:
    """A shard's parameters, optimizer state and push table, for a checkpoint.

    ``pushes``: the push table's rows ``(worker, incarnation, seq, status)``,
    read after the parameters, so every push whose update may be in them is
    listed (a push applied in between is then never applied again: at most once).
    """

    step: int
    optimizer_step: int
    params: np.ndarray
    slots: Mapping[str, np.ndarray]
    pushes: tuple[tuple[int, int, int, str], ...] = ()


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
    """

    def __init__(self, channel: grpc.Channel, layout: ShardLayout, *, timeout: float = 30.0,
                 push_timeout: float | None = None, push_wait: float | None = 0.0,
                 chunk_bytes: int = CHUNK_BYTES) -> None:
        self.channel = channel
        self.layout = layout
        self.timeout = timeout
        self.push_timeout = push_timeout or timeout
        self.push_wait = push_wait
        self.chunk_bytes = chunk_bytes
        self.version = 0  # the shard step of the last parameters received
        self._stream: RequestStream | None = None
        self._stream_lock = threading.Lock()
        self._signature = signature_bytes(layout)

    @property
    def address(self) -> str:
        """The ps task's address."""
        return channel_address(self.channel)

    def _retrying(self, call: Callable[[], _T], timeout: float) -> _T:
        """Run ``call``, retrying while the ps is unavailable, until ``timeout``."""
        deadline = time.monotonic() + timeout
        delay = 0.05
        while True:
            try:
                return call()
            except UnavailableError:
                if time.monotonic() + delay >= deadline:
                    raise
                time.sleep(delay)
                delay = min(delay * 2, 1.0)

    def status(self, timeout: float | None = None) -> pb.StatusReply:
        """The shard's status (initialised, step, layout fingerprint, counters)."""
        data = unary(self.channel, method_path("Status"), b"", timeout=timeout or self.timeout)
        return parse_message(pb.StatusReply, data, "StatusReply")

    def init(self, params: np.ndarray, *, optimizer: Any,
             aggregation: AggregationConfig, step: int = 0,
             slots: Mapping[str, np.ndarray] | None = None, optimizer_step: int = 0,
             pushes: Sequence[tuple[int, int, int, str]] = ()) -> None:
        """Create the shard with ``params`` (and optimizer ``slots``) on the ps.

        ``optimizer``: what the ps applies gradients with (an ``OptimizerConfig``
        or its ``OptimizerSpec``, :func:`~towerflow.ps.protocol.optimizer_to_proto`).
        ``pushes``: the shard's push table from a checkpoint (rows
        ``(worker, incarnation, seq, status)``), so that the pushes it had
        answered are not applied again.
        """
        slots = dict(slots or {})
        req = pb.InitRequest(
            shard=self.layout.index, segments=layout_to_proto(self.layout),
            optimizer=optimizer_to_proto(optimizer), aggregation=aggregation_to_proto(aggregation),
            step=step, slots=list(slots), optimizer_step=optimizer_step,
            pushes=push_records(pushes))

        def messages() -> Iterator[bytes]:
            yield req.SerializeToString()
            for buf in (params, *slots.values()):
                yield from chunks(np.asarray(buf, np.float32).reshape(-1), self.chunk_bytes)

        self._retrying(lambda: stream_unary(self.channel, method_path("Init"), messages(),
                                            timeout=self.timeout), self.timeout)
        self.version = step

    def pull(self, into: np.ndarray, buffer: str = "params", *, track: bool = True) -> pb.PullReply:
        """Receive the shard's ``buffer`` into ``into``; return the reply header.

        With ``track`` (the default) pulled parameters become the version the
        next push says its gradient was computed on; a snapshot for a
        checkpoint passes ``track=False``.
        """
        req = pb.PullRequest(buffer=buffer).SerializeToString()

        def call() -> pb.PullReply:
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

    def push(self, grad: np.ndarray, *, worker_id: int, incarnation: int, seq: int, lr: float,
             pull_into: np.ndarray | None = None) -> pb.PushReply:
        """Push ``grad``; with ``pull_into``, receive the fresh parameters in the same call."""
        small = self.layout.nbytes <= self.chunk_bytes  # one message each way
        header = PushHeader(
            worker_id=worker_id, incarnation=incarnation, seq=seq, token=self.version, lr=lr,
            dtype="float32" if grad.dtype == np.float32 else str(grad.dtype), numel=grad.size,
            # a finite gradient lets the ps apply chunks as they arrive
            finite=not small and grad.dtype == np.float32 and all_finite(grad))
        head = encode_push_header(header, want_params=pull_into is not None,
                                  signature=self._signature)

        def messages() -> Iterator[bytes]:
            yield head
            yield from chunks(grad, self.chunk_bytes)

        def call() -> pb.PushReply:
            if small:
                return self._push_pull_small(head, grad, pull_into)
            if pull_into is None:
                data = stream_unary(self.channel, method_path("Push"), messages(),
                                    timeout=self.push_timeout)
                return parse_message(pb.PushReply, data, "PushReply")
            return self._push_pull(messages(), pull_into)

        reply = self._waiting(call, f"push {seq} of worker {worker_id} (incarnation "
                                    f"{incarnation}, computed on step {header.token})")
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

    def _push_pull_small(self, head: bytes, grad: np.ndarray,
                         into: np.ndarray | None) -> pb.PushReply:
        payload = memoryview(np.ascontiguousarray(grad)).cast("B")
        request = pack(head, payload)
        if self._stream_lock.acquire(blocking=False):
            try:
                data = self._stream_round_trip(request)
            finally:
                self._stream_lock.release()
        else:  # another thread's push holds the stream
            data = unary(self.channel, method_path("PushPullSmall"), request, timeout=self.push_timeout)
        head, params = unpack(data)
        reply = parse_message(pb.PushReply, head, "PushReply")
        if reply.numel and into is not None:
            _receive(into, iter((params,)), reply.numel, f"ps shard {self.layout.index}")
        return reply

    def _stream_round_trip(self, request: bytes) -> bytes:
        """One push-and-pull on the long-lived stream (reopened when old or broken)."""
        if self._stream is not None and not self._stream.fresh:
            self.close_stream()
        if self._stream is None:
            self._stream = RequestStream(self.channel, method_path("PushPullSmallStream"),
                                         self.push_timeout, request)
        else:
            self._stream.send(request)
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

    def done(self, worker_id: int, checkpoint_step: int | None = None) -> None:
        """Tell the shard this worker has finished (the chief: after its final checkpoint,
        written at global step ``checkpoint_step``; None: it wrote none)."""
        request = pb.DoneRequest(worker_id=worker_id, final_checkpoint=checkpoint_step is not None,
                                 checkpoint_step=checkpoint_step or 0)
        unary(self.channel, method_path("Done"), request.SerializeToString(), timeout=self.timeout)

    def ledger(self, since: int = 0) -> pb.LedgerReply:
        """The pushes the shard applied, from ledger entry ``since`` on."""
        data = unary(self.channel, method_path("Ledger"),
                     pb.LedgerRequest(since=since).SerializeToString(), timeout=self.timeout)
        return parse_message(pb.LedgerReply, data, "LedgerReply")


class PSClient:
    """A worker's connection to every ps task of the cluster.

    Args:
        cluster: the ``ClusterSpec`` (its ``ps`` job is used).
        placement: where each variable lives (one layout per ps task).
        worker_id: this worker's replica index (0 .. total_num_replicas - 1).
        credentials: the cluster credentials (default: from the environment).
        timeout: deadline of ordinary calls.
        push_timeout: deadline of one attempt of a push (default: ``timeout``).
        push_wait: how long a push is sent again after an attempt ran out of
            time, from its start (None: for ever; 0: never); see :class:`ShardClient`.
        on_bad_gradient: ``"raise"`` an InvalidArgumentError when the ps refuses a
            gradient, or ``"skip"`` it with a warning.
        chunk_bytes: size of streamed chunks.
        tune_malloc: let glibc's malloc reuse chunk-sized blocks in this process
            (:func:`towerflow.ps.buffers.tune_malloc`): streamed chunks then cost no
            page faults, which roughly doubles the traffic a worker moves.
        channel_options: gRPC options of the channels to the ps tasks (message
            size, keepalive, per-call window; default
            :class:`~towerflow.cluster.transport.ChannelOptions`).
    """

    def __init__(self, cluster: Any, placement: Placement, *, worker_id: int,
                 credentials: Credentials | None = None, timeout: float = 30.0,
                 push_timeout: float | None = None, push_wait: float | None = 0.0,
                 on_bad_gradient: str = "raise", chunk_bytes: int = CHUNK_BYTES, tune_malloc: bool = True,
                 channel_options: ChannelOptions | None = None) -> None:
        if on_bad_gradient not in ("raise", "skip"):
            raise InvalidArgumentError(
                f"on_bad_gradient={on_bad_gradient!r}; use 'raise' or 'skip'."
            )
        num_ps = cluster.num_tasks("ps")
        if num_ps != placement.num_shards:
            raise InvalidArgumentError(
                f"The placement has {placement.num_shards} shards but the cluster has {num_ps} "
                "ps tasks; place the variables with this cluster's replica_device_setter."
            )
        credentials = Credentials.from_env() if credentials is None else credentials
        if tune_malloc:
            _tune_malloc()
        self.placement = placement
        self.worker_id = worker_id
        self.incarnation = time.time_ns() & ((1 << 63) - 1)
        self.on_bad_gradient = on_bad_gradient
        self.shards = [
            ShardClient(make_channel(cluster.task_address("ps", i), credentials,
                                     options=channel_options), layout,
                        timeout=timeout, push_timeout=push_timeout, push_wait=push_wait,
                        chunk_bytes=chunk_bytes)
            for i, layout in enumerate(placement.shards)
        ]
        self._seq = 0
        self._pool = ThreadPoolExecutor(max(1, len(self.shards)),
                                        thread_name_prefix="towerflow-ps-client")
        self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="towerflow-ps-prefetch")
        self._closed = False

    def _each(self, fn: Callable[[ShardClient, int], _T]) -> list[_T]:
        """Run ``fn(shard, index)`` on every shard in parallel; re-raise the first error."""
        if len(self.shards) == 1:
            return [fn(self.shards[0], 0)]
        futures = [self._pool.submit(fn, shard, i) for i, shard in enumerate(self.shards)]
        return [f.result() for f in futures]

    # -- initialisation ----------------------------------------------------------------
    def initialize(self, params: Sequence[np.ndarray], *, optimizer: Any,
                   aggregation: AggregationConfig, step: int = 0,
                   slots: Sequence[Mapping[str, np.ndarray]] | None = None,
                   optimizer_step: int = 0,
                   pushes: Sequence[Sequence[tuple[int, int, int, str]]] | None = None) -> None:
        """(Chief) create every shard with ``params[i]`` and optional optimizer state.

        ``optimizer``: see :meth:`ShardClient.init`. ``pushes[i]``: shard ``i``'s
        push table from a checkpoint (see :class:`ShardSnapshot`).
        """
        self._each(lambda shard, i: shard.init(
            params[i], optimizer=optimizer, aggregation=aggregation, step=step,
            slots=slots[i] if slots else None, optimizer_step=optimizer_step,
            pushes=pushes[i] if pushes else ()))

    def wait_until_initialized(self, timeout: float = 300.0, poll: float = 0.2) -> int:
        """(Non-chief) wait until every shard is initialised with this layout; return the step.

        Raises:
            InvalidArgumentError: a shard holds another model's layout.
            DeadlineExceededError: not initialised within ``timeout``.
        """
        deadline = time.monotonic() + timeout
        logged = False
        while True:
            pending = []
            for shard in self.shards:
                try:
                    status = shard.status(timeout=min(5.0, shard.timeout))
                except UnavailableError as exc:
                    pending.append(f"/job:ps/task:{shard.layout.index} ({exc})")
                    continue
                if not status.initialized:
                    pending.append(f"/job:ps/task:{shard.layout.index} (not initialised)")
                elif status.fingerprint != shard.layout.fingerprint:
                    raise InvalidArgumentError(
                        f"ps task {shard.layout.index} holds variables with layout "
                        f"{status.fingerprint} but this worker's model has layout "
                        f"{shard.layout.fingerprint}; run the same model on every worker."
                    )
            if not pending:
                return self.global_step()
            if time.monotonic() >= deadline:
                raise DeadlineExceededError(
                    f"Worker {self.worker_id} waited {timeout:.0f} s for the chief to initialise "
                    f"the parameters; still waiting for {', '.join(pending)}. Start the chief."
                )
            if not logged:
                logger.info("worker %d waiting for the chief to initialise %s", self.worker_id,
                            ", ".join(pending))
                logged = True
            time.sleep(poll)

    # -- traffic -------------------------------------------------------------------------
    def global_step(self) -> int:
        """ps task 0's step (the global step)."""
        return int(self.shards[0].status().step)

    def pull(self, into: Sequence[np.ndarray]) -> int:
        """Receive every shard's parameters into ``into``; return the global step."""
        heads = self._each(lambda shard, i: shard.pull(into[i]))
        return int(heads[0].step)

    def push(self, grads: Sequence[np.ndarray], lr: float, *,
             pull_into: Sequence[np.ndarray] | None = None) -> PushResult:
        """Push every shard's gradient; with ``pull_into``, get fresh parameters back.

        Raises:
            InvalidArgumentError: a shard refused the gradient and the policy is ``raise``.
        """
        self._seq += 1
        seq = self._seq
        replies = self._each(lambda shard, i: shard.push(
            grads[i], worker_id=self.worker_id, incarnation=self.incarnation, seq=seq, lr=lr,
            pull_into=None if pull_into is None else pull_into[i]))
        result = PushResult(int(replies[0].step), tuple(r.status for r in replies),
                            tuple(r.message for r in replies))
        if result.refused:
            message = next(m for s, m in zip(result.statuses, result.messages, strict=True)
                           if s == REFUSED)
            if self.on_bad_gradient == "raise":
                raise InvalidArgumentError(message)
            logger.warning("gradient skipped: %s", message)
        return result

    def push_async(self, grads: Sequence[np.ndarray], lr: float, *,
                   pull_into: Sequence[np.ndarray] | None = None) -> Future[PushResult]:
        """:meth:`push` in the background (prefetching the next parameters)."""
        return self._prefetcher.submit(self.push, grads, lr, pull_into=pull_into)

    def snapshot(self) -> list[ShardSnapshot]:
        """Pull every shard's parameters and optimizer state (for a checkpoint)."""

        def one(shard: ShardClient, i: int) -> ShardSnapshot:
            status = shard.status()
            params = np.empty(shard.layout.numel, np.float32)
            head = shard.pull(params, track=False)
            slots = {}
            for name in status.slots:
                slots[name] = np.empty(shard.layout.numel, np.float32)
                shard.pull(slots[name], buffer=name, track=False)
            pushes = push_rows(shard.status().pushes)
            return ShardSnapshot(int(head.step), int(head.optimizer_step), params, slots, pushes)

        return self._each(one)

    def ledger(self, since: int = 0) -> list[pb.LedgerReply]:
        """Each shard's ledger of applied pushes ``(worker_id, incarnation, seq, step)``."""
        return self._each(lambda shard, i: shard.ledger(since))

    def stats(self) -> list[dict[str, int]]:
        """Each shard's counters (applied, stale, refused, duplicates, ...)."""
        return [dict(shard.status().stats) for shard in self.shards]

    def close(self, *, done: bool = True, checkpoint_step: int | None = None) -> None:
        """Tell the shards this worker is done (best effort), then close. Idempotent.

        Args:
            done: False for a worker that stopped before finishing (an error):
                the shards go on counting it as a replica that has not finished.
            checkpoint_step: the chief's ``Done`` carries the global step of its
                final checkpoint (the ps tasks log it); None: no checkpoint.
        """
        if self._closed:
            return
        self._closed = True
        self._prefetcher.shutdown(wait=True)
        if done:
            for shard in self.shards:
                try:
                    shard.done(self.worker_id, checkpoint_step)
                except (UnavailableError, DeadlineExceededError, FailedPreconditionError,
                        InvalidArgumentError) as exc:
                    logger.debug("done to ps %d failed: %s", shard.layout.index, exc)
        self._pool.shutdown(wait=True)
        for shard in self.shards:
            shard.close_stream()
            shard.channel.close()

    def __enter__(self) -> PSClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
