"""The ps wire's messages as Python values: headers, outcomes, configs and their protobufs.

The control messages are protobuf (``ps.proto``, :mod:`~towerflow.ps.wire.ps_pb2`);
this module converts between them and what each side computes with:

- :class:`PushHeader` (a push's ``PushRequest``: :func:`encode_push_header`,
  :func:`decode_push_header`, :func:`signature_bytes`) and :class:`PushOutcome`
  (its ``PushReply``: :func:`outcome_to_reply`);
- :class:`AggregationConfig` (``AggregationSpec``: :func:`aggregation_to_proto`),
  an optimizer config (``OptimizerSpec``: :func:`optimizer_to_proto`), a shard's
  layout (``Segment``: :func:`layout_to_proto`, :func:`layout_from_proto`) and the
  push table's rows (``PushRecord``: :func:`push_records`, :func:`push_rows`);
- :func:`parse_message`: any message from received bytes, malformed input
  refused by name.

It holds no state and imports neither torch nor grpc.

Example:
    >>> from towerflow.ps.wire.framing import pack, unpack
    >>> header = PushHeader(worker_id=1, seq=3, token=7, lr=0.5, numel=2)
    >>> decode_push_header(unpack(pack(encode_push_header(header)))[0])[0] == header
    True
"""

from __future__ import annotations

import math
from collections.abc import Container, Iterable
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError

from towerflow.errors import InvalidArgumentError
from towerflow.ps.placement import ShardLayout
from towerflow.ps.wire import ps_pb2 as pb
from towerflow.ps.wire.calls import (
    APPLIED,
    DEFAULT_MAX_ELASTIC,
    DEFAULT_TIMEOUT,
    ELASTIC_BASE,
    MODES,
    bounded,
)

__all__ = [
    "AggregationConfig",
    "PushHeader",
    "PushOutcome",
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
        last_step: an asynchronous run's last global step (0: none): ps task 0
            keeps a step of the run's end for the worker's next push
            (:mod:`~towerflow.ps.server.dense.reservations`).
        term: the shard's term the worker believes in (0: not checked).
        shard: the shard the push is for (-1: the ps task's own shard; another
            index: a shard this ps task took over as its replica).
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
    last_step: int = 0
    term: int = 0
    shard: int = -1


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
        rendezvous: hybrid training (dense layers all-reduced among the workers):
            ``host:port`` of the store where the workers' process group meets, set
            by the chief; empty otherwise.
        replicas: live copies of each shard on other ps tasks (0: none; 1: shard
            ``i``'s copy on ps task ``(i + 1) % n``): a push is acknowledged once
            the copy has it too (:mod:`~towerflow.ps.server.dense.replication`).
    """

    mode: str = "async"
    total_num_replicas: int = 1
    replicas_to_aggregate: int | None = None
    staleness: int = 2
    timeout: float | None = DEFAULT_TIMEOUT
    max_elastic_workers: int = DEFAULT_MAX_ELASTIC
    rendezvous: str = ""
    replicas: int = 0

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
        _positive_int("replicas", self.replicas, 0)
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
        want_params=want_params, finite=header.finite, last_step=header.last_step,
        term=header.term)
    if header.shard >= 0:
        req.shard = header.shard
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
        segments=tuple((s.name, tuple(s.shape)) for s in req.segments), finite=req.finite,
        last_step=max(0, req.last_step), term=max(0, req.term),
        shard=req.shard if req.HasField("shard") else -1)
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
        max_elastic_workers=config.max_elastic_workers, rendezvous=config.rendezvous,
        replicas=config.replicas)


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
