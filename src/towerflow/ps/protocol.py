"""The ps shard service's wire contract: names, call sequence, status codes, framing.

Both sides of the dense parameter path import this module and nothing of
each other: the ps task (:mod:`~towerflow.ps.server.dense.service` and the shard state it
hosts) and the worker (:mod:`~towerflow.ps.worker.dense.client`). It holds no state and
imports neither torch nor grpc.

Service ``towerflow.ps.PS`` (raw-bytes handlers of
:func:`towerflow.cluster.transport.raw_handlers`, so every call is
authenticated by the cluster's credentials):

=======================  ===============  =====================================
method                   kind             messages
=======================  ===============  =====================================
``Init``                 stream -> unary  ``InitRequest``, then the params and
                                          slot buffers -> ``Empty``
``Status``               unary            ``StatusRequest`` -> ``StatusReply``
``Join``                 unary            ``JoinRequest`` -> ``JoinReply``
``Pull``                 unary -> stream  ``PullRequest`` -> ``PullReply`` +
                                          buffer chunks
``Push``                 stream -> unary  ``PushRequest``, gradient chunks ->
                                          ``PushReply``
``PushPull``             stream -> stream as ``Push``; replies ``PushReply`` +
                                          param chunks
``PushPullSmall``        unary            ``PushPull`` in one message each way,
                                          for a shard that fits in one chunk
                                          (:func:`pack`)
``PushPullSmallStream``  stream           many ``PushPullSmall`` round trips on
                                          one long-lived call
``Done``                 unary            ``DoneRequest`` -> ``Empty``
``Ledger``               unary            ``LedgerRequest`` -> ``LedgerReply``
=======================  ===============  =====================================

The call sequence by role:

1. The **chief** calls ``Init`` on every ps task (the variables, optimizer,
   aggregation, step, optimizer state and push table, from a checkpoint or
   fresh). A later ``Init`` replaces the shard whole; pushes it had answered
   stay answered.
2. Every **worker** (the chief too, once it has initialised) calls
   ``Status`` until each shard is initialised with its own layout's
   fingerprint, then ``Pull``, then ``Push`` / ``PushPull`` (or their small
   forms) once per step, and ``Done`` when it finishes (the chief's ``Done``
   names the step of its final checkpoint). A worker that stopped on an error
   sends no ``Done``.
3. An **elastic worker** (a process with the cluster and its credentials but
   no task of its own in it) joins a running ``async`` job: after ``Status``
   says every shard is initialised it calls ``Join`` on ps task 0, which
   gives it a worker id from :data:`ELASTIC_BASE` up (counted up, never a
   replica's and never given twice by one ps task) and the id's random
   ticket, then ``Join`` with that id and ticket on every other ps task
   (which asks ps task 0 to confirm them); then ``Pull``, ``Push`` /
   ``PushPull`` as a worker, and ``Done`` with the ticket when it leaves (its
   id is retired: a later push from it is refused). Each shard admits at most
   ``AggregationConfig.max_elastic_workers`` at once. A sync or ssp shard
   refuses ``Join``: its steps and bound count a fixed set of replicas. The
   job's end is the replicas' (every replica's ``Done``): a ps task does not
   wait for its elastic workers.
4. Anyone holding the cluster's credentials may call ``Status`` and
   ``Ledger`` (``towerflow status``, audits); a checkpoint ``Pull`` s the
   slot buffers by name.

Status codes of a push (``PushReply.status``): :data:`APPLIED` (the gradient
is in the parameters), :data:`STALE` (sync: computed on an older step;
dropped and counted), :data:`REFUSED` (wrong shape, dtype, NaN / inf, a
worker that is neither a replica nor an admitted elastic worker: nothing
changed; its retry is checked afresh)
and :data:`VOIDED` (sync: its step was abandoned when the shard was
re-initialised). A retry of a push answered already gets the same answer
with ``duplicate`` set.

Framing: control messages are protobuf (``ps.proto``); tensors never travel
inside them. A streamed call sends its header message first, then the raw
little-endian float32 bytes of a flat buffer in chunks of
:data:`CHUNK_BYTES`; the header says how many elements follow, so the
receiver validates before it copies. A one-message call carries header and
payload as :func:`pack` lays them out. Nothing is unpickled.

Example:
    >>> header = PushHeader(worker_id=1, seq=3, token=7, lr=0.5, numel=2)
    >>> decode_push_header(unpack(pack(encode_push_header(header)))[0])[0] == header
    True
"""

from __future__ import annotations

import math
import struct
from collections.abc import Container, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from towerflow.errors import DataLossError, InvalidArgumentError
from towerflow.ps import ps_pb2 as pb
from towerflow.ps.placement import ShardLayout

__all__ = [
    "SERVICE_NAME",
    "METHODS",
    "method_path",
    "APPLIED",
    "STALE",
    "REFUSED",
    "VOIDED",
    "FINAL",
    "MODES",
    "ELASTIC_BASE",
    "ELASTIC_LIMIT",
    "DEFAULT_MAX_ELASTIC",
    "DEFAULT_TIMEOUT",
    "AggregationConfig",
    "CHUNK_BYTES",
    "MESSAGE_LIMIT",
    "PushHeader",
    "PushOutcome",
    "bounded",
    "CHIEF_REPLICA",
    "failure_line",
    "chunks",
    "pack",
    "pack_parts",
    "split_parts",
    "unpack",
    "parse_message",
    "layout_to_proto",
    "layout_from_proto",
    "signature_bytes",
    "encode_push_header",
    "decode_push_header",
    "outcome_to_reply",
    "push_records",
    "push_rows",
    "aggregation_to_proto",
    "optimizer_to_proto",
]

SERVICE_NAME = "towerflow.ps.PS"
#: the service's methods, in the order of the call sequence
METHODS = ("Init", "Status", "Join", "Pull", "Push", "PushPull", "PushPullSmall",
           "PushPullSmallStream", "Done", "Ledger")

APPLIED = "applied"      # the gradient changed the parameters
STALE = "stale"          # sync: computed on an older step; dropped and counted
REFUSED = "refused"      # wrong shape / dtype / NaN / inf; parameters unchanged
VOIDED = "voided"        # sync: the step was abandoned (its shard re-initialised)
#: outcomes a retry is answered with (a refused push may be sent again)
FINAL = (APPLIED, STALE, VOIDED)

#: bytes per streamed chunk (1-4 MiB measured fastest for Python gRPC)
CHUNK_BYTES = 1 << 20
#: characters of a refusal message a shard keeps and replies with
MESSAGE_LIMIT = 1024

_LENGTH = struct.Struct("<I")


def method_path(method: str) -> str:
    """The gRPC path of one of :data:`METHODS` (``/towerflow.ps.PS/<method>``)."""
    return f"/{SERVICE_NAME}/{method}"


def bounded(message: str, limit: int = MESSAGE_LIMIT) -> str:
    """``message`` cut to ``limit`` characters (saying how much was left out)."""
    if len(message) <= limit:
        return message
    return f"{message[:limit]}... ({len(message) - limit} more characters)"


#: the replica that initialises the shards (the chief: replica 0 of the cluster)
CHIEF_REPLICA = 0


def failure_line(error: str) -> str:
    """The first line of a chief's error as a ``Done`` carries it: printable, bounded.

    Example:
        >>> failure_line("CheckpointError: bad\\x07 digest\\nTraceback ...")
        'CheckpointError: bad  digest'
    """
    lines = error.strip().splitlines()
    text = "".join(c if c.isprintable() else " " for c in (lines[0] if lines else ""))
    return bounded(text) if text else "an error it did not name"


@dataclass(frozen=True, slots=True)
class PushHeader:
    """What a push says about itself before its payload.

    Attributes:
        worker_id: the pushing worker's replica index.
        incarnation: distinguishes a restarted worker (its ``seq`` restarts).
        seq: the push's sequence number for this worker incarnation.
        token: the shard step the gradient was computed on (sync staleness).
        lr: the learning rate to apply it with.
        dtype: dtype name of the payload (``float32``).
        numel: number of elements in the payload.
        segments: ``(name, shape)`` of each variable part, in buffer order.
        finite: the sender checked that every value is finite (informative:
            the shard checks every value itself).
    """

    worker_id: int
    seq: int
    token: int
    lr: float
    numel: int
    dtype: str = "float32"
    incarnation: int = 0
    segments: tuple[tuple[str, tuple[int, ...]], ...] = ()
    finite: bool = False


@dataclass(frozen=True, slots=True)
class PushOutcome:
    """What happened to a push.

    Attributes:
        status: one of ``applied``, ``stale``, ``refused``, ``voided``.
        step: the shard's step after the push.
        message: why, for a refused, stale or voided push.
        duplicate: True when this push was a retry answered from the table.
    """

    status: str
    step: int
    message: str = ""
    duplicate: bool = False

    @property
    def applied(self) -> bool:
        """True when the gradient is part of an applied update."""
        return self.status == APPLIED


MODES = ("async", "sync", "ssp")
#: the first elastic worker id: ids from here up are elastic workers', never a replica's
ELASTIC_BASE = 1 << 20
#: one past the last elastic worker id (ids travel as int32)
ELASTIC_LIMIT = (1 << 31) - 1
#: elastic workers a shard admits at once unless the chief says otherwise
DEFAULT_MAX_ELASTIC = 16
#: seconds a sync / ssp push waits by default
DEFAULT_TIMEOUT = 120.0


def _positive_int(name: str, value: object, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise InvalidArgumentError(f"{name} must be an integer >= {least}, got {value!r}.")


@dataclass(frozen=True, slots=True)
class AggregationConfig:
    """How gradients are combined on the ps.

    Attributes:
        mode: ``async``, ``sync`` or ``ssp``.
        total_num_replicas: number of workers pushing gradients (their ids are
            ``0 .. total_num_replicas - 1``).
        replicas_to_aggregate: gradients averaged per step in sync mode
            (default: all replicas).
        staleness: ssp bound: pushes a worker may be ahead of the slowest.
        timeout: seconds a push may wait for its step (sync) or for the
            slowest worker (ssp) before failing with DeadlineExceededError; a
            finite positive number, or None to wait forever.
        max_elastic_workers: async: elastic workers (``Join``) a shard admits
            at once; 0: none.
    """

    mode: str = "async"
    total_num_replicas: int = 1
    replicas_to_aggregate: int | None = None
    staleness: int = 2
    timeout: float | None = DEFAULT_TIMEOUT
    max_elastic_workers: int = DEFAULT_MAX_ELASTIC

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InvalidArgumentError(
                f"Unknown ps mode {bounded(repr(self.mode), 100)}; use one of {', '.join(MODES)}."
            )
        _positive_int("total_num_replicas", self.total_num_replicas, 1)
        r = self.replicas_to_aggregate
        if r is not None:
            _positive_int("replicas_to_aggregate", r, 1)
            if r > self.total_num_replicas:
                raise InvalidArgumentError(
                    f"replicas_to_aggregate={r} must be between 1 and total_num_replicas="
                    f"{self.total_num_replicas}; extra replicas act as backup workers."
                )
        _positive_int("staleness", self.staleness, 0)
        _positive_int("max_elastic_workers", self.max_elastic_workers, 0)
        t = self.timeout
        if t is not None and (isinstance(t, bool) or not isinstance(t, int | float)
                              or not math.isfinite(t) or t <= 0):
            raise InvalidArgumentError(
                f"timeout must be a finite number of seconds > 0, got {t!r}; use timeout=None "
                "to wait forever."
            )

    @property
    def required(self) -> int:
        """Gradients averaged per sync step."""
        return self.replicas_to_aggregate or self.total_num_replicas

    @property
    def backups(self) -> int:
        """Number of backup workers (sync mode)."""
        return self.total_num_replicas - self.required

    def check_replica(self, worker_id: int, what: str, elastic: Container[int] = ()) -> None:
        """Raise InvalidArgumentError unless ``worker_id`` is one of the replicas.

        In async mode an id in ``elastic`` (the elastic workers admitted now)
        counts too; sync and ssp count the replicas alone.
        """
        if 0 <= worker_id < self.total_num_replicas:
            return
        if self.mode == "async" and worker_id in elastic:
            return
        hint = (f" Ids from {ELASTIC_BASE} up are elastic workers': one counts from its Join "
                "to its Done (async mode only)." if worker_id >= ELASTIC_BASE else "")
        raise InvalidArgumentError(
            f"{what} from worker {worker_id} was refused: the replicas of this job are "
            f"0 .. {self.total_num_replicas - 1} (total_num_replicas="
            f"{self.total_num_replicas}). Give each worker its replica index.{hint}"
        )


# -- framing -------------------------------------------------------------------------------
def chunks(buffer: np.ndarray, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """The raw bytes of ``buffer`` (made contiguous) in chunks of ``chunk_bytes``."""
    raw = memoryview(np.ascontiguousarray(buffer)).cast("B")
    for start in range(0, len(raw), chunk_bytes):
        yield bytes(raw[start:start + chunk_bytes])


def pack(header: bytes, payload: bytes | memoryview = b"") -> bytes:
    """One message: a 4-byte little-endian header length, the header, the raw payload."""
    return b"".join((_LENGTH.pack(len(header)), header, payload))


def unpack(message: bytes) -> tuple[bytes, memoryview]:
    """Split a :func:`pack` message into its header and (zero-copy) payload.

    Raises:
        DataLossError: the message is shorter than its header length says.
    """
    view = memoryview(message)
    if len(view) < _LENGTH.size:
        raise DataLossError(f"A {len(view)}-byte message is too short for its header length.")
    (length,) = _LENGTH.unpack_from(view)
    end = _LENGTH.size + length
    if end > len(view):
        raise DataLossError(
            f"A message announces a {length}-byte header but holds {len(view)} bytes in all."
        )
    return bytes(view[_LENGTH.size:end]), view[end:]


def pack_parts(header: bytes, parts: Sequence[bytes | memoryview]) -> bytes:
    """:func:`pack` of a payload of several raw buffers end to end (each copied once)."""
    return b"".join((_LENGTH.pack(len(header)), header, *parts))


def split_parts(payload: memoryview, sizes: Sequence[int], what: str) -> list[memoryview]:
    """The buffers of a :func:`pack_parts` payload, by their byte lengths (zero-copy views).

    Raises:
        DataLossError: the lengths are negative or do not add up to the payload.
    """
    out, start = [], 0
    for size in sizes:
        if size < 0 or start + size > len(payload):
            break
        out.append(payload[start:start + size])
        start += size
    if len(out) != len(sizes) or start != len(payload):
        raise DataLossError(
            f"A {what} of {len(payload)} payload bytes announces parts of {list(sizes)[:8]} "
            "bytes; client and ps must run the same towerflow version."
        )
    return out


def parse_message(cls: type, data: bytes, what: str):  # noqa: ANN201 - a protobuf message
    """Parse protobuf ``cls`` from ``data``; malformed input is InvalidArgumentError."""
    try:
        return cls.FromString(bytes(data))
    except (DecodeError, ValueError, TypeError, RecursionError) as exc:
        raise InvalidArgumentError(
            f"Malformed {what} message ({len(data)} bytes): {bounded(str(exc), 200)}; client "
            "and ps must run the same towerflow version."
        ) from None


# -- message <-> header conversions --------------------------------------------------------
def layout_to_proto(layout: ShardLayout) -> list[pb.Segment]:
    """The protobuf segments of ``layout`` (an ``Init``'s variables)."""
    return [pb.Segment(name=s.name, shape=s.shape, var_shape=s.var_shape, start=s.start,
                       numel=s.numel, part=s.part, num_parts=s.num_parts)
            for s in layout.segments]


def layout_from_proto(index: int, segments: Iterable[pb.Segment]) -> ShardLayout:
    """Shard ``index``'s layout from its protobuf segments (:func:`layout_to_proto`'s inverse).

    Example:
        >>> from towerflow.ps.placement import plan_placement
        >>> layout = plan_placement({"w": (3, 2)}, 1).shards[0]
        >>> layout_from_proto(0, layout_to_proto(layout)) == layout
        True
    """
    return ShardLayout.build(index, ((s.name, tuple(s.shape), tuple(s.var_shape), s.start,
                                      s.numel, s.part, s.num_parts) for s in segments))


def signature_bytes(layout: ShardLayout) -> bytes:
    """The serialised variable signature of ``layout``'s pushes.

    Serialised protobuf messages concatenate into their merge: a worker
    serialises the signature, the same for every push, once and prefixes it to
    each :func:`encode_push_header`.
    """
    return pb.PushRequest(segments=[pb.SegmentSignature(name=n, shape=s)
                                    for n, s in layout.signature]).SerializeToString()


def encode_push_header(header: PushHeader, *, want_params: bool = False,
                       signature: bytes = b"") -> bytes:
    """The ``PushRequest`` of ``header`` (``signature``: :func:`signature_bytes`).

    ``header.segments`` are sent when no ``signature`` is given.
    """
    req = pb.PushRequest(
        worker_id=header.worker_id, incarnation=header.incarnation, seq=header.seq,
        token=header.token, lr=header.lr, dtype=header.dtype, numel=header.numel,
        want_params=want_params, finite=header.finite)
    if not signature:
        req.segments.extend(pb.SegmentSignature(name=n, shape=s) for n, s in header.segments)
    return signature + req.SerializeToString()


def decode_push_header(data: bytes) -> tuple[PushHeader, bool]:
    """``(header, want_params)`` of a serialised ``PushRequest``.

    Raises:
        InvalidArgumentError: the message is malformed.
    """
    req = parse_message(pb.PushRequest, data, "PushRequest")
    header = PushHeader(
        worker_id=req.worker_id, seq=req.seq, token=req.token, lr=req.lr, numel=req.numel,
        dtype=req.dtype or "float32", incarnation=req.incarnation,
        segments=tuple((s.name, tuple(s.shape)) for s in req.segments), finite=req.finite)
    return header, req.want_params


def outcome_to_reply(outcome: PushOutcome) -> pb.PushReply:
    """The ``PushReply`` of ``outcome`` (its ``numel`` is set when parameters follow)."""
    return pb.PushReply(status=outcome.status, step=outcome.step, message=outcome.message,
                        duplicate=outcome.duplicate)


def push_records(rows: Iterable[tuple[int, int, int, str]]) -> list[pb.PushRecord]:
    """Push-table rows ``(worker, incarnation, seq, status)`` as ``PushRecord`` messages."""
    return [pb.PushRecord(worker_id=w, incarnation=i, seq=q, status=st) for w, i, q, st in rows]


def push_rows(records: Iterable[Any]) -> tuple[tuple[int, int, int, str], ...]:
    """The rows of ``PushRecord`` messages (the inverse of :func:`push_records`)."""
    return tuple((int(r.worker_id), int(r.incarnation), int(r.seq), r.status) for r in records)


def aggregation_to_proto(config: AggregationConfig) -> pb.AggregationSpec:
    """The ``AggregationSpec`` of ``config``."""
    return pb.AggregationSpec(
        mode=config.mode, total_num_replicas=config.total_num_replicas,
        replicas_to_aggregate=config.replicas_to_aggregate or 0, staleness=config.staleness,
        timeout=config.timeout or 0.0, wait_forever=config.timeout is None,
        max_elastic_workers=config.max_elastic_workers)


def optimizer_to_proto(config: Any, names: Iterable[str] = ()) -> pb.OptimizerSpec:
    """The ``OptimizerSpec`` the ps applies gradients with.

    ``config`` has the fields of :class:`towerflow.strategies.OptimizerConfig`
    (``name``, ``momentum``, ``weight_decay``, ``betas``, ``eps``,
    ``initial_accumulator_value``, and ``lr_factor(name)``, each variable's learning
    rate over the base one: sent for those of ``names``, the shard's variables,
    that differ from 1); an ``OptimizerSpec`` is returned as it is.
    """
    if isinstance(config, pb.OptimizerSpec):
        return config
    factor = getattr(config, "lr_factor", None)
    factors = {} if factor is None else {n: factor(n) for n in set(names)}
    return pb.OptimizerSpec(
        name=config.name, momentum=config.momentum, weight_decay=config.weight_decay,
        beta1=config.betas[0], beta2=config.betas[1], eps=config.eps,
        initial_accumulator_value=config.initial_accumulator_value,
        lr_factors={n: f for n, f in factors.items() if f != 1.0})
