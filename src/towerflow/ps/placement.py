"""Placement of variables on ps tasks: ``replica_device_setter`` and its choosers.

TensorFlow's ``tf.train.replica_device_setter`` puts every variable on a ps
task (round-robin by default, or greedily on the least loaded task) and every
computation on the worker. towerflow does the same for the parameters of a
PyTorch module, and also partitions a tensor larger than a threshold across
the ps tasks along its first dimension (what TF's variable partitioners do).

The result is a :class:`Placement`: for each ps task, a :class:`ShardLayout`
listing the :class:`Segment` s its one flat buffer holds, in order. Placement
is deterministic, so the chief and every worker compute the same one from the
same model; a fingerprint of each layout lets the ps check it.

Example:
    >>> setter = replica_device_setter(ps_tasks=2, worker_device="/job:worker/task:1")
    >>> setter("w", shape=(4, 4)), setter("b", shape=(4,))
    ('/job:ps/task:0', '/job:ps/task:1')
    >>> setter.worker_device
    '/job:worker/task:1'
    >>> plan = setter.place({"w": (4, 4), "b": (4,)})
    >>> [s.name for s in plan.shards[0].segments], plan.shards[1].numel
    (['w'], 4)

As a placement scope it puts a module's parameters on the ps tasks::

    with towerflow.device(towerflow.replica_device_setter(cluster=cluster)):
        model = Model()    # parameters: ps tasks in turn; compute: the worker

This module imports neither torch nor grpc: a ps task loads it to check
layouts.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from towerflow.errors import InvalidArgumentError

__all__ = [
    "Segment",
    "ShardLayout",
    "Placement",
    "DeviceSetter",
    "replica_device_setter",
    "plan_placement",
    "placement_from_tasks",
    "PS_OPS",
    "STRATEGY_NAMES",
    "DEFAULT_PS_STRATEGY",
]

#: chooser names accepted by ``ps_strategy`` (besides a callable)
STRATEGY_NAMES = ("round_robin", "greedy")

#: the ``ParameterServer`` strategy's (and ``--ps-strategy``'s) chooser: bytes, not counts, so
#: that one large variable and many small ones still load the ps tasks evenly.
#: ``replica_device_setter`` itself keeps TensorFlow's default, round robin.
DEFAULT_PS_STRATEGY = "greedy"

_FLOAT32_BYTES = 4


@dataclass(frozen=True, slots=True)
class Segment:
    """A run of one variable's elements stored in a shard's flat buffer.

    Attributes:
        name: the variable's name (``module.named_parameters()`` key).
        shape: the shape of this part (the whole variable's when unpartitioned).
        var_shape: the whole variable's shape.
        start: index of the part's first element in the variable's flat view.
        offset: index of the part's first element in the shard's flat buffer.
        numel: number of elements of this part.
        part: the part's index; ``num_parts`` is 1 for a whole variable.
    """

    name: str
    shape: tuple[int, ...]
    var_shape: tuple[int, ...]
    start: int
    offset: int
    numel: int
    part: int = 0
    num_parts: int = 1

    def as_json(self) -> dict[str, Any]:
        """The segment as a JSON-able dict (for fingerprints and messages)."""
        return {
            "name": self.name, "shape": list(self.shape), "var_shape": list(self.var_shape),
            "start": self.start, "offset": self.offset, "numel": self.numel,
            "part": self.part, "num_parts": self.num_parts,
        }

    @property
    def label(self) -> str:
        """``name`` or ``name/part_1_of_2`` for a partition (used in messages)."""
        if self.num_parts == 1:
            return self.name
        return f"{self.name}/part_{self.part}_of_{self.num_parts}"


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """What one ps task's flat buffer holds.

    Attributes:
        index: the ps task index.
        segments: the segments in buffer order (offsets increasing, no gaps).
        numel: total number of elements of the buffer.
    """

    index: int
    segments: tuple[Segment, ...]
    numel: int

    @property
    def fingerprint(self) -> str:
        """A short hash of the layout; equal layouts have equal fingerprints."""
        blob = json.dumps([s.as_json() for s in self.segments], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    @property
    def signature(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """``(label, shape)`` of every segment: what a push must match."""
        return tuple((s.label, s.shape) for s in self.segments)

    @property
    def nbytes(self) -> int:
        """Bytes of the shard's float32 buffer."""
        return self.numel * _FLOAT32_BYTES

    def segment_at(self, element: int) -> Segment:
        """Return the segment holding buffer element ``element``."""
        lo, hi = 0, len(self.segments) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.segments[mid].offset <= element:
                lo = mid
            else:
                hi = mid - 1
        return self.segments[lo]

    @classmethod
    def build(cls, index: int, parts: Iterable[tuple[str, tuple[int, ...], tuple[int, ...],
                                                     int, int, int, int]]) -> ShardLayout:
        """Lay out ``(name, shape, var_shape, start, numel, part, num_parts)`` in order."""
        segments = []
        offset = 0
        for name, shape, var_shape, start, numel, part, num_parts in parts:
            segments.append(Segment(name, tuple(shape), tuple(var_shape), start, offset,
                                    numel, part, num_parts))
            offset += numel
        return cls(index, tuple(segments), offset)


@dataclass(frozen=True, slots=True)
class Placement:
    """Where every variable lives: one :class:`ShardLayout` per ps task.

    Attributes:
        shards: the layouts, indexed by ps task.
        ps_device: the device-name prefix of the ps job (``/job:ps``).
    """

    shards: tuple[ShardLayout, ...]
    ps_device: str = "/job:ps"

    @property
    def num_shards(self) -> int:
        """Number of ps tasks."""
        return len(self.shards)

    def segments_of(self, name: str) -> list[tuple[int, Segment]]:
        """Return ``(ps task, segment)`` for every part of variable ``name``."""
        found = [(shard.index, seg) for shard in self.shards for seg in shard.segments
                 if seg.name == name]
        if not found:
            raise InvalidArgumentError(
                f"Variable {name!r} is not placed on any ps task; placed variables: "
                f"{', '.join(self.names()) or 'none'}."
            )
        return sorted(found, key=lambda item: item[1].part)

    def names(self) -> list[str]:
        """Names of the placed variables, in placement order."""
        seen: dict[str, None] = {}
        for shard in self.shards:
            for seg in shard.segments:
                seen.setdefault(seg.name)
        return list(seen)

    def device_of(self, name: str) -> str:
        """The ps device of ``name`` (its first part's task for a partitioned one)."""
        task, _ = self.segments_of(name)[0]
        return f"{self.ps_device}/task:{task}"


class _RoundRobinStrategy:
    """Assigns variables to ps tasks in turn (TF's default)."""

    __slots__ = ("_num_tasks", "_next")

    def __init__(self, num_tasks: int) -> None:
        self._num_tasks = num_tasks
        self._next = 0

    def __call__(self, name: str, nbytes: int) -> int:
        task = self._next
        self._next = (self._next + 1) % self._num_tasks
        return task


class _GreedyLoadBalancingStrategy:
    """Assigns each variable to the ps task holding the fewest bytes so far."""

    __slots__ = ("_loads",)

    def __init__(self, num_tasks: int) -> None:
        self._loads = [0] * num_tasks

    def __call__(self, name: str, nbytes: int) -> int:
        task = min(range(len(self._loads)), key=lambda i: (self._loads[i], i))
        self._loads[task] += nbytes
        return task


_CHOOSERS: dict[str, Callable[[int], Callable[[str, int], int]]] = {
    "round_robin": _RoundRobinStrategy,
    "greedy": _GreedyLoadBalancingStrategy,
}


def _make_chooser(strategy: str | Callable[[str, int], int] | None,
                  num_tasks: int) -> Callable[[str, int], int]:
    if strategy is None:
        return _RoundRobinStrategy(num_tasks)
    if callable(strategy):
        return strategy
    factory = _CHOOSERS.get(strategy)
    if factory is None:
        raise InvalidArgumentError(
            f"Unknown ps_strategy {strategy!r}; use one of {', '.join(STRATEGY_NAMES)} "
            "or a callable (name, nbytes) -> ps task index."
        )
    return factory(num_tasks)


def _shape_of(value: Any) -> tuple[int, ...]:
    shape = value if isinstance(value, (tuple, list)) else getattr(value, "shape", None)
    if shape is None:
        raise InvalidArgumentError(
            f"Cannot place {type(value).__name__!r}: pass a shape tuple or a tensor."
        )
    dims = tuple(int(d) for d in shape)
    if any(d < 0 for d in dims):
        raise InvalidArgumentError(f"Shape {dims} has a negative dimension.")
    return dims


def _split_rows(shape: tuple[int, ...], parts: int) -> list[tuple[int, int]]:
    """Split dimension 0 of ``shape`` into ``parts`` near-equal ``(row_start, rows)``."""
    rows = shape[0]
    base, extra = divmod(rows, parts)
    spans, start = [], 0
    for i in range(parts):
        n = base + (1 if i < extra else 0)
        spans.append((start, n))
        start += n
    return spans


def _partitioned(shape: tuple[int, ...], num_ps: int, threshold: int | None) -> bool:
    """Whether a variable of ``shape`` is split along dimension 0 across the ps tasks."""
    nbytes = math.prod(shape) * _FLOAT32_BYTES
    return threshold is not None and nbytes > threshold and num_ps > 1 and len(shape) >= 1 \
        and shape[0] >= 2


class _Assigner:
    """Decides where each variable goes, once: split across the tasks, or the chooser's task."""

    __slots__ = ("num_ps", "threshold", "_chooser")

    def __init__(self, num_ps: int, strategy: str | Callable[[str, int], int] | None,
                 threshold: int | None) -> None:
        self.num_ps = num_ps
        self.threshold = threshold
        self._chooser = _make_chooser(strategy, num_ps)

    def decide(self, name: str, shape: tuple[int, ...]) -> int | None:
        """The ps task of ``name``, or ``None`` when it is partitioned across them."""
        if _partitioned(shape, self.num_ps, self.threshold):
            return None
        task = self._chooser(name, math.prod(shape) * _FLOAT32_BYTES)
        if isinstance(task, bool) or not isinstance(task, int) or not 0 <= task < self.num_ps:
            raise InvalidArgumentError(
                f"The ps strategy put {name!r} on task {task!r}; it must return an index "
                f"in 0..{self.num_ps - 1}."
            )
        return task


def _check_num_ps(num_ps: int) -> None:
    if num_ps < 1:
        raise InvalidArgumentError(
            f"Cannot place variables on {num_ps} ps tasks; the cluster needs a 'ps' job "
            "with at least one task."
        )


def _layout(items: list[tuple[str, Any]], num_ps: int,
            decide: Callable[[str, tuple[int, ...]], int | None], ps_device: str) -> Placement:
    per_shard: list[list[tuple]] = [[] for _ in range(num_ps)]
    seen: set[str] = set()
    for name, value in items:
        if name in seen:
            raise InvalidArgumentError(f"Variable name {name!r} is placed twice; names must be unique.")
        seen.add(name)
        shape = _shape_of(value)
        numel = math.prod(shape)
        task = decide(name, shape)
        if task is None:
            row = numel // shape[0]
            spans = _split_rows(shape, min(num_ps, shape[0]))
            for part, (row_start, rows) in enumerate(spans):
                per_shard[part].append((name, (rows, *shape[1:]), shape, row_start * row,
                                        rows * row, part, len(spans)))
            continue
        per_shard[task].append((name, shape, shape, 0, numel, 0, 1))
    shards = tuple(ShardLayout.build(i, parts) for i, parts in enumerate(per_shard))
    return Placement(shards, ps_device)


def _items(variables: Mapping[str, Any] | Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
    return list(variables.items()) if isinstance(variables, Mapping) else list(variables)


def plan_placement(
    variables: Mapping[str, Any] | Sequence[tuple[str, Any]],
    num_ps: int,
    *,
    strategy: str | Callable[[str, int], int] | None = None,
    partition_threshold_bytes: int | None = None,
    ps_device: str = "/job:ps",
) -> Placement:
    """Place ``variables`` (name -> shape or tensor, in order) on ``num_ps`` tasks.

    A variable larger than ``partition_threshold_bytes`` (float32 bytes) with
    at least two rows is split along dimension 0 into one part per ps task
    (at most one per row); every other variable goes whole to the task the
    chooser names.

    Raises:
        InvalidArgumentError: ``num_ps < 1``, a duplicate name, a bad shape, an
            unknown strategy, or a chooser returning a task out of range.
    """
    _check_num_ps(num_ps)
    assigner = _Assigner(num_ps, strategy, partition_threshold_bytes)
    return _layout(_items(variables), num_ps, assigner.decide, ps_device)


#: the operation types a device setter puts on the ps tasks (TensorFlow's ``ps_ops``)
PS_OPS = ("Variable", "VariableV2", "VarHandleOp", "AutoReloadVariable", "MutableHashTable",
          "MutableHashTableV2", "MutableHashTableOfTensors", "MutableHashTableOfTensorsV2",
          "MutableDenseHashTable", "MutableDenseHashTableV2")


class DeviceSetter:
    """The device function ``replica_device_setter`` returns.

    As a placement scope (``with towerflow.device(setter):``) it is asked
    about every operation: a parameter's creation (type ``VariableV2``, one of
    :data:`PS_OPS`) goes to a ps task chosen by the setter's rule, everything
    else to ``worker_device``. Asked directly, ``setter(name, shape=...)``
    names the ps device of a variable (deciding its task the first time it is
    asked, the same answer afterwards), and ``setter.place(variables)``
    returns the whole :class:`Placement`, agreeing with every answer the
    setter already gave: one rule, one sequence of decisions.
    """

    __slots__ = ("num_ps", "ps_device", "worker_device", "strategy",
                 "partition_threshold_bytes", "ps_ops", "_assigner", "_assigned")

    def __init__(self, num_ps: int, ps_device: str, worker_device: str,
                 strategy: str | Callable[[str, int], int] | None,
                 partition_threshold_bytes: int | None,
                 ps_ops: Sequence[str] = PS_OPS) -> None:
        self.num_ps = num_ps
        self.ps_device = ps_device
        self.worker_device = worker_device
        self.strategy = strategy
        self.partition_threshold_bytes = partition_threshold_bytes
        self.ps_ops = frozenset(ps_ops)
        self._assigner = _Assigner(num_ps, strategy, partition_threshold_bytes)
        self._assigned: dict[str, tuple[tuple[int, ...], int | None]] = {}

    def _device(self, task: int | None) -> str:
        return f"{self.ps_device}/task:{0 if task is None else task}"

    def _decide(self, name: str, shape: tuple[int, ...]) -> int | None:
        known = self._assigned.get(name)
        if known is not None:
            if known[0] != shape and shape:
                raise InvalidArgumentError(
                    f"Variable {name!r} was placed with shape {known[0]} and is now asked "
                    f"about with shape {shape}; give each variable one name and shape."
                )
            return known[1]
        task = self._assigner.decide(name, shape)
        self._assigned[name] = (shape, task)
        return task

    def __call__(self, op: Any, *, shape: Any = ()) -> str:
        """The device of a variable named ``op`` or of an operation ``op``.

        Args:
            op: a variable's name, or an operation (an object with ``type``,
                ``name`` and ``shape``, as ``towerflow.device`` passes one).
            shape: the variable's shape (or a tensor) when ``op`` is a name.

        Returns:
            ``/job:ps/task:K`` for a variable (the task of its first part when
            it is partitioned), ``worker_device`` for any other operation.
        """
        if isinstance(op, str):
            return self._device(self._decide(op, _shape_of(shape)))
        if getattr(op, "type", None) not in self.ps_ops:
            return self.worker_device
        return self._device(self._assigner.decide(op.name, _shape_of(op.shape)))

    def place(self, variables: Mapping[str, Any] | Sequence[tuple[str, Any]]) -> Placement:
        """Return the placement of ``variables``; names asked about before keep their task."""
        return _layout(_items(variables), self.num_ps, self._decide, self.ps_device)

    def __repr__(self) -> str:
        return (f"DeviceSetter(num_ps={self.num_ps}, ps_device={self.ps_device!r}, "
                f"worker_device={self.worker_device!r})")


def placement_from_tasks(
    variables: Mapping[str, Any] | Sequence[tuple[str, Any]],
    tasks: Mapping[str, int],
    num_ps: int,
    *,
    partition_threshold_bytes: int | None = None,
    ps_device: str = "/job:ps",
) -> Placement:
    """The placement of variables whose ps tasks were decided already (``name -> task``).

    Used for a model built under ``towerflow.device(replica_device_setter(...))``:
    each parameter keeps the task the setter gave it when it was created.

    Raises:
        InvalidArgumentError: a variable has no task, or a task is out of range.
    """
    _check_num_ps(num_ps)

    def decide(name: str, shape: tuple[int, ...]) -> int | None:
        if _partitioned(shape, num_ps, partition_threshold_bytes):
            return None
        task = tasks.get(name)
        if task is None or not 0 <= task < num_ps:
            where = "no ps task" if task is None else f"ps task {task}"
            raise InvalidArgumentError(
                f"Variable {name!r} was given {where}, and the cluster has {num_ps} ps "
                "task(s); build every parameter of the model inside the same "
                "towerflow.device(towerflow.replica_device_setter(cluster=cluster)) scope, "
                "for a cluster with the same ps job."
            )
        return task

    return _layout(_items(variables), num_ps, decide, ps_device)


def replica_device_setter(
    ps_tasks: int = 0,
    ps_device: str = "/job:ps",
    worker_device: str = "/job:worker",
    merge_devices: bool = True,
    cluster: Any = None,
    ps_strategy: str | Callable[[str, int], int] | None = None,
    *,
    partition_threshold_bytes: int | None = None,
    ps_ops: Sequence[str] | None = None,
) -> DeviceSetter | None:
    """Return a device setter placing variables on ps tasks, computation on the worker.

    Args:
        ps_tasks: number of ps tasks; taken from ``cluster`` when given.
        ps_device: the ps job's device-name prefix.
        worker_device: where computation runs, e.g. ``/job:worker/task:1``.
        merge_devices: kept for TensorFlow compatibility (always merged).
        cluster: a ``ClusterSpec`` (or a mapping) whose ``ps`` job is counted.
        ps_strategy: ``"round_robin"`` (default), ``"greedy"`` (by bytes) or a
            callable ``(name, nbytes) -> task``.
        partition_threshold_bytes: split variables larger than this across
            the ps tasks (``None``: never).
        ps_ops: the operation types placed on the ps tasks (default
            :data:`PS_OPS`; a parameter's creation is ``VariableV2``).

    Returns:
        A :class:`DeviceSetter`, or ``None`` when there is no ps task (as in TF).

    Example:
        >>> replica_device_setter(cluster={"ps": ["a:1"], "worker": ["b:2"]})
        DeviceSetter(num_ps=1, ps_device='/job:ps', worker_device='/job:worker')
    """
    del merge_devices
    if cluster is not None:
        jobs = cluster.as_dict() if hasattr(cluster, "as_dict") else dict(cluster)
        ps_tasks = len(jobs.get("ps", ()))
    if ps_tasks < 0:
        raise InvalidArgumentError(f"ps_tasks must be >= 0, got {ps_tasks}.")
    if ps_tasks == 0:
        return None
    if isinstance(ps_strategy, str) and ps_strategy not in _CHOOSERS:
        _make_chooser(ps_strategy, ps_tasks)
    return DeviceSetter(ps_tasks, ps_device.rstrip("/"), worker_device, ps_strategy,
                        partition_threshold_bytes, PS_OPS if ps_ops is None else ps_ops)
