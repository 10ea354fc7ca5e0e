"""One strict check of an ``Init`` header before a ps shard allocates or changes anything.

An ``InitRequest`` (the chief's, or anyone's holding the cluster secret) names
the shard's variables, optimizer, aggregation and push table; its payload
follows. :func:`check_init` turns it into an :class:`InitPlan` or raises an
:class:`~towerflow.errors.InvalidArgumentError` naming the field, its value
and the limit:

- sizes in Python integers (no int64 wrap-around), every dimension and every
  total within :data:`MAX_ELEMENTS`, each segment's ``numel`` equal to the
  product of its shape and inside its variable;
- names, counts and nesting bounded (:data:`MAX_NAME`, :data:`MAX_SEGMENTS`,
  :data:`MAX_DIMS`), labels unique;
- the optimizer and mode from their closed lists (an empty or garbage
  message names neither, so it never replaces a live shard), hyper-parameters
  finite and in range (the ranges ``torch.optim`` accepts), the aggregation
  spec valid (:class:`~towerflow.ps.wire.messages.AggregationConfig`), its
  replicas within the cluster's;
- optimizer state buffers among the optimizer's, each once; steps >= 0;
  push-table rows of real replicas.

Nothing is allocated here; the service then allocates the buffers lazily
(pages are touched only as payload bytes arrive).

Example:
    >>> from towerflow.ps.wire import ps_pb2 as pb
    >>> req = pb.InitRequest(optimizer=pb.OptimizerSpec(name="sgd"),
    ...                      aggregation=pb.AggregationSpec(mode="async", total_num_replicas=1))
    >>> check_init(req, 0).layout.numel
    0
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from towerflow.errors import InvalidArgumentError
from towerflow.ps.placement import ShardLayout
from towerflow.ps.spec.dense import OPTIMIZER_NAMES, SLOT_NAMES, canonical_name
from towerflow.ps.wire.calls import (
    APPLIED,
    DEFAULT_MAX_ELASTIC,
    DEFAULT_TIMEOUT,
    MODES,
    STALE,
    VOIDED,
    bounded,
)
from towerflow.ps.wire.messages import AggregationConfig

__all__ = ["InitPlan", "check_init", "check_round", "MAX_ELEMENTS", "MAX_SEGMENTS", "MAX_DIMS",
           "MAX_NAME"]

#: elements of one shard (and of any dimension or variable): 2**36 float32 = 256 GiB
MAX_ELEMENTS = 1 << 36
#: longest hybrid rendezvous address (host:port) an Init may carry
MAX_RENDEZVOUS = 300
#: variable parts one shard holds
MAX_SEGMENTS = 1 << 20
#: dimensions of one variable
MAX_DIMS = 32
#: characters of a variable name
MAX_NAME = 4096


@dataclass(frozen=True, slots=True)
class InitPlan:
    """A checked ``Init`` header: what the shard will be.

    Attributes:
        layout: the variables, in buffer order.
        optimizer: ``make_optimizer`` keyword arguments (``name`` included).
        config: the aggregation.
        slots: optimizer state buffers the payload carries after the params.
        step: the shard's step; ``optimizer_step``: the optimizer's update count.
        pushes: push-table rows ``(worker, incarnation, seq, status)``.
        round: ``(clocks, done)`` of a sync or ssp aggregation (:func:`check_round`; a
            replica's copy carries them, a chief's Init none).
    """

    layout: ShardLayout
    optimizer: dict[str, Any]
    config: AggregationConfig
    slots: tuple[str, ...]
    step: int
    optimizer_step: int
    pushes: tuple[tuple[int, int, int, str], ...]
    round: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())

    @property
    def payload_elements(self) -> int:
        """float32 elements the payload must hold (params, then each slot)."""
        return self.layout.numel * (1 + len(self.slots))


def _fail(field: str, value: object, rule: str) -> InvalidArgumentError:
    shown = bounded(repr(value), 200)
    return InvalidArgumentError(
        f"Init field {field} = {shown} is invalid: {rule}. The shard is unchanged; "
        "initialise it from a towerflow chief of the same version."
    )


def _count(field: str, value: int, low: int, high: int) -> int:
    if not low <= value <= high:
        raise _fail(field, value, f"it must be between {low} and {high}")
    return int(value)


def _real(field: str, value: float, low: float, high: float = math.inf, *,
          below_high: bool = False) -> float:
    ok = math.isfinite(value) and low <= value and (value < high if below_high else value <= high)
    if not ok:
        limit = f"< {high}" if below_high else f"<= {high}"
        raise _fail(field, value, f"it must be a finite number >= {low} and {limit}")
    return float(value)


def _shape(field: str, dims: Any) -> tuple[tuple[int, ...], int]:
    """``(shape, product)`` with every dimension and the product within MAX_ELEMENTS."""
    if len(dims) > MAX_DIMS:
        raise _fail(f"{field} rank", len(dims), f"at most {MAX_DIMS} dimensions")
    numel = 1
    for d in dims:
        _count(f"{field} dimension", d, 0, MAX_ELEMENTS)
        numel *= int(d)
        if numel > MAX_ELEMENTS:
            raise _fail(field, list(dims), f"its {numel}+ elements exceed {MAX_ELEMENTS}")
    return tuple(int(d) for d in dims), numel


def _layout(index: int, segments: Any) -> ShardLayout:
    _count("segments count", len(segments), 0, MAX_SEGMENTS)
    parts, labels, total = [], set(), 0
    for i, seg in enumerate(segments):
        where = f"segments[{i}]"
        if not seg.name or len(seg.name) > MAX_NAME:
            raise _fail(f"{where}.name", seg.name, f"1 to {MAX_NAME} characters")
        shape, numel = _shape(f"{where}.shape", seg.shape)
        var_shape, var_numel = _shape(f"{where}.var_shape", seg.var_shape)
        if seg.numel != numel:
            raise _fail(f"{where}.numel", seg.numel, f"the product of its shape {list(shape)} "
                        f"is {numel}")
        num_parts = int(seg.num_parts) or 1
        _count(f"{where}.num_parts", num_parts, 1, MAX_SEGMENTS)
        part = _count(f"{where}.part", seg.part, 0, num_parts - 1)
        start = _count(f"{where}.start", seg.start, 0, max(var_numel - numel, 0))
        if start + numel > var_numel:
            raise _fail(f"{where}.var_shape", list(var_shape),
                        f"its {var_numel} elements cannot hold {numel} from element {start}")
        if (seg.name, part) in labels:
            raise _fail(f"{where}.name", seg.name, f"part {part} of it is listed twice")
        labels.add((seg.name, part))
        total += numel
        if total > MAX_ELEMENTS:
            raise _fail("segments", f"{len(segments)} segments", f"more than {MAX_ELEMENTS} "
                        "elements in all")
        parts.append((seg.name, shape, var_shape, start, numel, part, num_parts))
    return ShardLayout.build(index, parts)


def _optimizer(o: Any) -> dict[str, Any]:
    if o.name not in OPTIMIZER_NAMES:
        raise _fail("optimizer.name", o.name, f"one of {', '.join(OPTIMIZER_NAMES)}")
    return {
        "name": o.name,
        "momentum": _real("optimizer.momentum", o.momentum, 0.0),
        "weight_decay": _real("optimizer.weight_decay", o.weight_decay, 0.0),
        "betas": (_real("optimizer.beta1", o.beta1 or 0.9, 0.0, 1.0, below_high=True),
                  _real("optimizer.beta2", o.beta2 or 0.999, 0.0, 1.0, below_high=True)),
        "eps": _real("optimizer.eps", o.eps or 1e-8, 0.0),
        "initial_accumulator_value": _real("optimizer.initial_accumulator_value",
                                           o.initial_accumulator_value, 0.0),
    }


#: the largest ratio of a variable's learning rate to the pushed one
MAX_LR_FACTOR = 1e6


def _lr_ranges(factors: Any, layout: ShardLayout) -> tuple[tuple[int, int, float], ...]:
    """``(offset, numel, factor)`` of each segment whose variable has a learning-rate factor."""
    if len(factors) > len(layout.segments):
        raise _fail("optimizer.lr_factors", f"{len(factors)} factors",
                    f"at most one per variable ({len(layout.segments)})")
    names = {seg.name for seg in layout.segments}
    for name, value in factors.items():
        if name not in names:
            raise _fail("optimizer.lr_factors", name[:80], "a variable of this shard")
        if not value > 0:
            raise _fail(f"optimizer.lr_factors[{name[:80]!r}]", value, "a number > 0")
        _real(f"optimizer.lr_factors[{name[:80]!r}]", value, 0.0, MAX_LR_FACTOR)
    return tuple((seg.offset, seg.numel, float(factors[seg.name]))
                 for seg in layout.segments if seg.name in factors and seg.numel)


def _aggregation(a: Any, replicas: int | None) -> AggregationConfig:
    if a.mode not in MODES:
        raise _fail("aggregation.mode", a.mode, f"one of {', '.join(MODES)}")
    high = replicas or MAX_SEGMENTS
    total = _count("aggregation.total_num_replicas", a.total_num_replicas, 1, high)
    to_aggregate = _count("aggregation.replicas_to_aggregate", a.replicas_to_aggregate, 0, total)
    staleness = _count("aggregation.staleness", a.staleness, 0, 1 << 30)
    if a.wait_forever:
        if a.timeout:
            raise _fail("aggregation.timeout", a.timeout, "it must be 0 with wait_forever")
        timeout = None
    elif not math.isfinite(a.timeout) or a.timeout < 0:
        raise _fail("aggregation.timeout", a.timeout, "a finite number of seconds >= 0 "
                    "(0: the default; set wait_forever to wait forever)")
    else:
        timeout = a.timeout or DEFAULT_TIMEOUT
    elastic = (_count("aggregation.max_elastic_workers", a.max_elastic_workers, 0, 1 << 16)
               if a.HasField("max_elastic_workers") else DEFAULT_MAX_ELASTIC)
    if len(a.rendezvous) > MAX_RENDEZVOUS or any(c.isspace() for c in a.rendezvous):
        raise _fail("aggregation.rendezvous", a.rendezvous[:80],
                    f"a host:port of at most {MAX_RENDEZVOUS} characters")
    copies = _count("aggregation.replicas", a.replicas, 0, 1)
    return AggregationConfig(mode=a.mode, total_num_replicas=total,
                             replicas_to_aggregate=to_aggregate or None, staleness=staleness,
                             timeout=timeout, max_elastic_workers=elastic,
                             rendezvous=a.rendezvous, replicas=copies)


def check_init(req: Any, shard_index: int, replicas: int | None = None) -> InitPlan:
    """Check ``req`` (an ``InitRequest``) for ps task ``shard_index``; return the plan.

    Args:
        req: the parsed ``InitRequest``.
        shard_index: this ps task's index.
        replicas: the cluster's number of training replicas (chief and
            workers), when known: ``total_num_replicas`` may not exceed it.

    Raises:
        InvalidArgumentError: the first field that is out of its limits.
    """
    if req.shard != shard_index:
        raise InvalidArgumentError(
            f"Init for shard {req.shard} reached ps task {shard_index}; the cluster spec's ps "
            "addresses differ between the chief and this task."
        )
    optimizer = _optimizer(req.optimizer)
    config = _aggregation(req.aggregation, replicas)
    layout = _layout(shard_index, req.segments)
    optimizer["lr_ranges"] = _lr_ranges(req.optimizer.lr_factors, layout)
    kept = SLOT_NAMES[canonical_name(optimizer["name"], optimizer["momentum"])]
    if len(set(req.slots)) != len(req.slots) or any(s not in kept for s in req.slots):
        raise _fail("slots", list(req.slots)[:8], f"{optimizer['name']} keeps "
                    f"{list(kept) or 'no state'}, each sent at most once")
    _count("step", req.step, 0, 1 << 62)
    _count("optimizer_step", req.optimizer_step, 0, 1 << 62)
    _count("pushes count", len(req.pushes), 0, config.total_num_replicas)
    pushes = []
    for i, row in enumerate(req.pushes):
        _count(f"pushes[{i}].worker_id", row.worker_id, 0, config.total_num_replicas - 1)
        if row.status not in (APPLIED, STALE, VOIDED):
            raise _fail(f"pushes[{i}].status", row.status, "applied, stale or voided")
        pushes.append((int(row.worker_id), int(row.incarnation), int(row.seq), row.status))
    return InitPlan(layout, optimizer, config, tuple(req.slots), int(req.step),
                    int(req.optimizer_step), tuple(pushes),
                    check_round(req.round, config, f"Init of ps shard {shard_index}"))


def check_round(state: Any, config: AggregationConfig, what: str
                ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(clocks, done)`` of a ``RoundState`` (the aggregation's state a replica's copy
    carries), checked against ``config``: ssp keeps one clock per replica (or none: all at
    0), the other modes none; ``done`` names distinct replicas.

    Example:
        >>> from towerflow.ps.wire import ps_pb2 as pb
        >>> config = AggregationConfig(mode="ssp", total_num_replicas=2)
        >>> check_round(pb.RoundState(clocks=[3, 2], done=[1]), config, "Init")
        ((3, 2), (1,))

    Raises:
        InvalidArgumentError: a sentence naming the field, its value and the rule.
    """
    total, clocks, done = config.total_num_replicas, tuple(state.clocks), tuple(state.done)
    wanted = (0, total) if config.mode == "ssp" else (0,)
    if len(clocks) not in wanted or any(not 0 <= c <= 1 << 62 for c in clocks):
        raise InvalidArgumentError(
            f"{what}: round.clocks = {bounded(repr(list(clocks)), 200)} is invalid: "
            f"{config.mode} mode keeps " + (
                f"one clock >= 0 per replica ({total}), or none" if config.mode == "ssp"
                else "none") +
            ". The shard is unchanged; send it from a towerflow ps of the same version.")
    if len(set(done)) != len(done) or any(not 0 <= w < total for w in done):
        raise InvalidArgumentError(
            f"{what}: round.done = {bounded(repr(list(done)), 200)} is invalid: it names "
            f"distinct replicas 0 .. {total - 1}. The shard is unchanged; send it from a "
            "towerflow ps of the same version.")
    return tuple(int(c) for c in clocks), tuple(int(w) for w in done)
