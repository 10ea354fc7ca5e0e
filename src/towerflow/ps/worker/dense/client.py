"""The worker's side of the parameter server: pull, push, push-and-pull, prefetch.

A :class:`PSClient` talks to every ps task of a cluster over the cluster
transport (authenticated channels, a deadline on every call). Each shard's
parameters and gradients are one flat float32 numpy buffer on the worker; a
push streams the gradient buffer in chunks and can bring the fresh parameters
back in the same call; shards are reached in parallel by a thread pool. Every
push carries ``(worker_id, incarnation, seq)``, so a push retried after a lost
reply is applied once. The calls to one ps task are a
:class:`~towerflow.ps.worker.dense.shard_client.ShardClient`'s.

Before streaming a gradient larger than one chunk the client checks that it is
finite (one read pass, no allocation) and says so in the push header
(informative: the ps checks every chunk itself). The ps applies each chunk as
it arrives; a gradient with a NaN / inf is refused at the chunk that holds it
(the chunks before it stay applied, the parameters never hold a NaN) and
counted, and the refusal says how many of its values were applied. A client also tunes its process's malloc for the chunk-sized
``bytes`` gRPC Python sends and receives (``tune_malloc=False`` to opt out).

Example (with a running ps task)::

    client = PSClient(cluster, placement, worker_id=1)
    client.wait_until_initialized(timeout=60)
    step = client.pull(params)                       # list of flat arrays, one per shard
    result = client.push(grads, lr=0.1, pull_into=params)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from towerflow.cluster.transport import ChannelOptions, Credentials, make_channel, unary
from towerflow.errors import (
    AbortedError,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    TowerflowError,
    UnavailableError,
)
from towerflow.ps.memory import tune_malloc as _tune_malloc
from towerflow.ps.placement import Placement
from towerflow.ps.wire import ps_pb2 as pb
from towerflow.ps.wire.calls import (
    APPLIED,
    CHIEF_REPLICA,
    REFUSED,
    STALE,
    failure_line,
    method_path,
)
from towerflow.ps.wire.framing import CHUNK_BYTES
from towerflow.ps.wire.messages import AggregationConfig, push_rows
from towerflow.ps.worker.dense.shard_client import ShardClient
from towerflow.ps.worker.failover import ShardRoute

__all__ = ["PSClient", "PreparedPush", "PushResult", "ShardSnapshot", "tell_chief_failure"]

logger = logging.getLogger("towerflow.ps")

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class PreparedPush:
    """A push encoded ahead of sending (:meth:`PSClient.prepare_push`): one
    ``PushPullSmall`` request per shard, and how log lines name each."""

    requests: tuple[bytes, ...]
    whats: tuple[str, ...]


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
            (:func:`towerflow.ps.memory.tune_malloc`): streamed chunks then cost no
            page faults, which roughly doubles the traffic a worker moves.
        channel_options: gRPC options of the channels to the ps tasks (message
            size, keepalive, per-call window; default
            :class:`~towerflow.cluster.transport.ChannelOptions`).
        sync: the ps tasks aggregate in sync mode, where each completes a step
            on its own: a push whose parameters came from different steps
            (pulled while a step completed, or after a worker stopped between
            its pushes) goes only to the shards at the lowest of them, and is
            stale on the others, so every shard completes the same steps (see
            :meth:`push`).
        replicas: the job's live copies of each shard (``AggregationConfig.replicas``):
            with 1, every request names its shard and term, and a shard whose primary
            is gone is switched to its replica, the call in flight sent again
            (:mod:`~towerflow.ps.worker.failover`); 0: requests as before.
    """

    def __init__(self, cluster: Any, placement: Placement, *, worker_id: int,
                 credentials: Credentials | None = None, timeout: float = 30.0,
                 push_timeout: float | None = None, push_wait: float | None = 0.0,
                 on_bad_gradient: str = "raise", chunk_bytes: int = CHUNK_BYTES, tune_malloc: bool = True,
                 channel_options: ChannelOptions | None = None, sync: bool = False,
                 replicas: int = 0) -> None:
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
        #: an elastic worker's ticket for its id (from ps task 0's Join reply; see join_job)
        self.elastic_ticket = b""
        self.on_bad_gradient = on_bad_gradient
        self.sync = sync
        #: one channel per ps task (a shard's calls go to the task serving it)
        self.channels = [make_channel(cluster.task_address("ps", i), credentials,
                                      options=channel_options) for i in range(num_ps)]
        self.shards = [
            ShardClient(self.channels[i], layout,
                        timeout=timeout, push_timeout=push_timeout, push_wait=push_wait,
                        chunk_bytes=chunk_bytes, route=ShardRoute(
                            i, num_ps, self.channels.__getitem__) if replicas else None)
            for i, layout in enumerate(placement.shards)
        ]
        self._seq = 0
        #: an asynchronous run's last global step (0: none; :meth:`stop_at`) and whether ps
        #: task 0 keeps a step of it for this worker's next push
        self.last_step = 0
        self.reserved = False
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
            AbortedError: the chief failed before it initialised the job (a shard
                says so); this worker has told the shards it stopped.
            DeadlineExceededError: not initialised within ``timeout``.
        """
        deadline = time.monotonic() + timeout
        logged = False
        while True:
            pending = []
            for shard in self.shards:
                try:
                    # a ps task starting is no reason to switch to its replica
                    status = shard.status(timeout=min(5.0, shard.timeout), failover=False)
                except (UnavailableError, FailedPreconditionError) as exc:
                    moved = shard.route is not None and shard.route.discover()
                    if not moved and isinstance(exc, FailedPreconditionError):
                        raise
                    why = "its replica took it over: asked there next" if moved else exc
                    pending.append(f"/job:ps/task:{shard.layout.index} ({why})")
                    continue
                if shard.route is not None and status.role == "primary":
                    shard.route.term = max(shard.route.term, int(status.term))  # served again
                if not status.initialized and shard.route is not None and \
                        shard.route.discover():  # restarted: its copy took the shard over
                    pending.append(f"/job:ps/task:{shard.layout.index} (served by its copy)")
                    continue
                if status.failure and not status.initialized:
                    self.close()  # its Done: the ps tasks end once every replica knows
                    raise AbortedError(
                        f"The chief failed before it initialised the job (ps task "
                        f"{shard.layout.index} says so): {status.failure}. Fix the chief's "
                        "error and start the job again.")
                if not status.initialized:
                    pending.append(f"/job:ps/task:{shard.layout.index} (not initialised)")
                elif status.fingerprint != shard.layout.fingerprint and status.rendezvous:
                    raise InvalidArgumentError(
                        f"ps task {shard.layout.index} was initialised by a chief that "
                        "all-reduces the dense layers among the workers (hybrid training, "
                        "--dense allreduce), and this worker trains them through the ps "
                        "(--dense ps). Start every worker with the same --dense.")
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

        In sync mode a gradient computed on parameters of different steps goes
        to the shards at the lowest step only: it is stale on the shards ahead
        (answered here, with nothing sent), and completes the step the others
        lack, so the shards' steps meet again instead of drifting apart for
        good (a shard a step ahead would otherwise take each later push one
        step ahead of the rest, and no consistent state could be read).

        Raises:
            InvalidArgumentError: a shard refused the gradient and the policy is ``raise``.
        """
        ahead = self._ahead()
        if not ahead:
            small = self.prepare_push(grads, lr, want_params=pull_into is not None)
            if small is not None:
                return self.send_prepared(small, pull_into=pull_into)
        ident = self._next_push(lr)
        return self._result(self._each(lambda shard, i: ahead[i] if i in ahead else shard.push(
            grads[i], pull_into=None if pull_into is None else pull_into[i], **ident)))

    def _ahead(self) -> dict[int, pb.PushReply]:
        """Sync: the shards whose parameters this worker holds from a later step than the
        lowest, each with the ``stale`` reply its push gets without being sent."""
        versions = [shard.version for shard in self.shards]
        low = min(versions)
        if not self.sync or low == max(versions):
            return {}
        behind = [str(i) for i, v in enumerate(versions) if v == low]
        tasks = f"ps task{'s' if len(behind) > 1 else ''} {', '.join(behind)}"
        return {i: pb.PushReply(status=STALE, step=v, message=(
            f"gradient of worker {self.worker_id} was computed on parameters of step {v} of ps "
            f"task {i} but of step {low} of {tasks}: sent to the tasks at step {low} only, so "
            "that every ps task completes the same steps"))
            for i, v in enumerate(versions) if v > low}

    def _next_push(self, lr: float) -> dict[str, Any]:
        """The identity of this worker's next push (a new ``seq``), its rate and the run's
        last step."""
        self._seq += 1
        return {"worker_id": self.worker_id, "incarnation": self.incarnation, "seq": self._seq,
                "lr": lr, "last_step": self.last_step}

    # -- the run's last steps ------------------------------------------------------------
    def stop_at(self, last_step: int | None) -> None:
        """End an asynchronous run at global step ``last_step`` exactly (None or 0: no end):
        each push is sent only with a step of the run kept for it by ps task 0
        (:mod:`~towerflow.ps.server.dense.reservations`; :meth:`reserve`)."""
        self.last_step = max(0, int(last_step or 0))
        self.reserved = False

    def reserve(self, wait: float | None = None) -> bool:
        """Whether this worker's next push may be sent: a step of the run is kept for it (in
        the reply to its last push, else asked of ps task 0 now). Always True with no
        :attr:`last_step`.

        When every step left is kept for other workers, this waits until they have
        pushed them (False: the run is at its last step), or a step is free again (True:
        one of them stopped, or the ps tasks' heartbeats declared it dead), at most
        ``wait`` seconds (default: a call's deadline; then False, in one line).
        """
        if not self.last_step or self.reserved:
            return True
        deadline = time.monotonic() + (self.shards[0].timeout if wait is None else wait)
        delay = 0.01
        while True:
            reply = self.shards[0].reserve(self.worker_id, self.incarnation, self.last_step)
            self.reserved = bool(reply.granted)
            if self.reserved or reply.step >= self.last_step:
                return self.reserved
            if time.monotonic() >= deadline:
                logger.warning("worker %d stops at global step %d of %d: the steps left are "
                               "kept for other workers, which have not pushed them",
                               self.worker_id, reply.step, self.last_step)
                return False
            time.sleep(delay)  # the other workers' last pushes, a few steps' time
            delay = min(2 * delay, 0.25)

    def _result(self, replies: Sequence[pb.PushReply]) -> PushResult:
        if self.last_step:  # the push used its kept step; ps task 0 says if one is kept again
            self.reserved = bool(replies[0].next_reserved)
        result = PushResult(int(replies[0].step), tuple(r.status for r in replies),
                            tuple(r.message for r in replies))
        if result.refused:
            message = next(m for s, m in zip(result.statuses, result.messages, strict=True)
                           if s == REFUSED)
            if self.on_bad_gradient == "raise":
                raise InvalidArgumentError(message)
            logger.warning("gradient skipped: %s", message)
        return result

    def prepare_push(self, grads: Sequence[np.ndarray], lr: float, *,
                     want_params: bool = True) -> PreparedPush | None:
        """The next push, encoded now as one ``PushPullSmall`` request per shard (a copy of
        ``grads``), or None when a shard is too large for one message.

        :meth:`send_prepared` sends it; or each request travels in another
        call to its ps task (a table ``RowBatch``, :meth:`finish_prepared` reads
        the replies). Either way the ps applies it once (its ``seq``).
        """
        if not all(shard.small for shard in self.shards):
            return None
        ident = self._next_push(lr)
        requests = tuple(shard.encode_small(grad, want_params=want_params, **ident)
                         for shard, grad in zip(self.shards, grads, strict=True))
        return PreparedPush(requests, tuple(
            shard.push_name(ident["worker_id"], ident["incarnation"], ident["seq"])
            for shard in self.shards))

    def send_prepared(self, push: PreparedPush, *,
                      pull_into: Sequence[np.ndarray] | None = None) -> PushResult:
        """Send a :meth:`prepare_push` push: every request on its shard's stream first,
        then every reply read (no thread per shard); a shard whose stream is busy is
        pushed in its turn."""
        started = []
        try:
            for shard, request in zip(self.shards, push.requests, strict=True):
                started.append(shard.start_push(request))
        except BaseException:
            for shard, begun in zip(self.shards, started, strict=False):
                if begun:  # its reply will not be read: the stream goes, the push's retry
                    shard.abandon_push()  # (same seq) is applied once
            raise
        return self._result([
            (shard.finish_push if begun else shard.push_small)(
                request, pull_into=None if pull_into is None else pull_into[i],
                what=push.whats[i])
            for i, (shard, request, begun) in enumerate(zip(self.shards, push.requests, started,
                                                            strict=True))])

    def finish_prepared(self, push: PreparedPush, replies: Mapping[int, bytes], *,
                        pull_into: Sequence[np.ndarray] | None = None) -> PushResult:
        """The result of a :meth:`prepare_push` push whose requests travelled in other calls,
        from their reply bytes by shard; a shard with no reply is sent its request now."""
        return self._result([
            shard.small_reply(replies[i], into) if i in replies else
            shard.push_small(push.requests[i], pull_into=into, what=push.whats[i])
            for i, shard in enumerate(self.shards)
            for into in (None if pull_into is None else pull_into[i],)])

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

    def close(self, *, done: bool = True, checkpoint_step: int | None = None,
              failure: str = "") -> None:
        """Tell the shards this worker is done (best effort), then close. Idempotent.

        Args:
            done: False for a worker that stopped before finishing (an error):
                the shards go on counting it as a replica that has not finished.
            checkpoint_step: the chief's ``Done`` carries the global step of its
                final checkpoint (the ps tasks log it); None: no checkpoint.
            failure: the chief's error when it failed before initialising the
                job: sent with its ``Done`` (also when ``done`` is False), so that
                every task of the job stops with it.
        """
        if self._closed:
            return
        self._closed = True
        self._prefetcher.shutdown(wait=True)
        if done or failure:
            for shard in self.shards:
                if shard.route is not None and shard.route.task != shard.layout.index:
                    continue  # its primary is gone; the task serving it has its own Done
                try:
                    shard.done(self.worker_id, checkpoint_step, self.elastic_ticket,
                               failure=failure)
                except (UnavailableError, DeadlineExceededError, FailedPreconditionError,
                        InvalidArgumentError) as exc:
                    logger.debug("done to ps %d failed: %s", shard.layout.index, exc)
        self._pool.shutdown(wait=True)
        for shard in self.shards:
            shard.close_stream()
        for channel in self.channels:
            channel.close()

    def __enter__(self) -> PSClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def tell_chief_failure(cluster: Any, credentials: Credentials | None, failure: str, *,
                       timeout: float = 5.0) -> None:
    """The chief stopped on ``failure`` before it had a client (before it initialised):
    say it to every ps task in a ``Done`` (best effort), so that the job ends with it
    (``credentials`` None: the environment's)."""
    credentials = Credentials.from_env() if credentials is None else credentials
    request = pb.DoneRequest(worker_id=CHIEF_REPLICA,
                             failure=failure_line(failure)).SerializeToString()
    for index in range(cluster.num_tasks("ps")):
        channel = make_channel(cluster.task_address("ps", index), credentials)
        try:
            unary(channel, method_path("Done"), request, timeout=timeout)
        except TowerflowError as exc:
            logger.debug("telling ps %d of the chief's failure failed: %s", index, exc)
        finally:
            channel.close()
