"""The state one ps task keeps: a flat parameter buffer and what updates it.

A :class:`ShardState` holds the parameters of the variables placed on this ps
task in **one contiguous float32 buffer** (layout in
:class:`~towerflow.ps.placement.ShardLayout`), the server-side optimizer and
its state buffers, the step counter (on ps task 0 it is the global step), the
de-duplication table of pushes, and the counters a ps reports.

Everything here is plain numpy and threads, so the shard logic is tested
in-process; :mod:`towerflow.ps.service` puts it behind gRPC.

Example:
    >>> import numpy as np
    >>> from towerflow.ps.placement import plan_placement
    >>> from towerflow.ps.optimizers import make_optimizer
    >>> layout = plan_placement({"w": (2,)}, 1).shards[0]
    >>> state = ShardState(layout, np.zeros(2, np.float32), make_optimizer("sgd", 2))
    >>> state.apply(np.ones(2, np.float32), lr=0.5)
    1
    >>> state.params.tolist()
    [-0.5, -0.5]
"""

from __future__ import annotations

import ctypes
import itertools
import math
import platform
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np

from towerflow.errors import DataLossError, DeadlineExceededError, InvalidArgumentError
from towerflow.ps.optimizers import ServerOptimizer
from towerflow.ps.placement import ShardLayout

__all__ = [
    "LedgerRecord",
    "PushHeader",
    "PushOutcome",
    "ShardStats",
    "ShardState",
    "APPLIED",
    "STALE",
    "REFUSED",
    "VOIDED",
    "CHUNK_BYTES",
    "all_finite",
    "tune_malloc",
]

#: bytes per streamed chunk (1-4 MiB measured fastest for Python gRPC)
CHUNK_BYTES = 1 << 20
#: applied pushes a shard's ledger remembers (the newest; about 13 MiB at most)
LEDGER_CAPACITY = 1 << 16
_ITEM = 4  # float32 only
_CHECK_BLOCK = 1 << 16

#: allocations below this come from malloc's reused heap (see :func:`tune_malloc`)
_MMAP_THRESHOLD = 32 << 20
#: free heap kept for reuse before malloc returns it to the system
_TRIM_THRESHOLD = 16 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
_tuned: bool | None = None

APPLIED = "applied"      # the gradient changed the parameters
STALE = "stale"          # sync: computed on an older step; dropped and counted
REFUSED = "refused"      # wrong shape / dtype / NaN / inf; parameters unchanged
VOIDED = "voided"        # sync: the step's partial sum was voided by a refused push


@dataclass(frozen=True, slots=True)
class PushHeader:
    """What a push says about itself before its payload.

    Attributes:
        worker_id: the pushing worker's index.
        incarnation: distinguishes a restarted worker (its ``seq`` restarts).
        seq: the push's sequence number for this worker incarnation.
        token: the shard step the gradient was computed on (sync staleness).
        lr: the learning rate to apply it with.
        dtype: dtype name of the payload (``float32``).
        numel: number of elements in the payload.
        segments: ``(name, shape)`` of each variable part, in buffer order.
        finite: the sender checked that every value is finite, so the shard
            may apply the payload chunk by chunk as it arrives (async / ssp).
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


@dataclass(slots=True)
class ShardStats:
    """Counters a shard reports (all since it was initialised)."""

    pushes: int = 0
    applied: int = 0
    updates: int = 0
    stale: int = 0
    refused: int = 0
    duplicates: int = 0
    voided: int = 0
    #: ledger records of streamed pushes cut off part way and not completed
    partial: int = 0
    max_lead: int = 0
    pulls: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    refusals: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, int]:
        """The counters as a dict (the last refusal messages left out)."""
        return {k: getattr(self, k) for k in self.__slots__ if k != "refusals"}


class LedgerRecord(NamedTuple):
    """One entry of a shard's ledger: a push whose gradient is in the parameters.

    A streamed push cut off part way (its stream broken or cancelled, its
    worker dead, a NaN / inf in a later chunk) is recorded ``partial``: its
    elements ``applied_start .. applied_stop - 1`` (of the shard's flat buffer)
    were applied, the others were not, and no step was counted (``step`` is the
    shard's step when it was cut off). When a retry of the same ``(worker,
    incarnation, seq)`` completes it, the same entry becomes complete, in
    place. A complete entry's range is the whole buffer.
    """

    worker_id: int
    incarnation: int
    seq: int
    step: int
    partial: bool = False
    applied_start: int = 0
    applied_stop: int = 0


@dataclass(slots=True)
class _Entry:
    incarnation: int
    seq: int
    outcome: PushOutcome | None = None
    #: a streamed push cut off part way: elements already applied and its update number
    applied: int = 0
    update: int = 0
    interrupted: bool = False
    #: absolute index of its ledger record once it has one (a partial push), else -1
    ledger_index: int = -1


class ShardState:
    """Parameters, optimizer, step and push bookkeeping of one ps task.

    Args:
        layout: the segments this shard holds.
        params: the initial values, ``layout.numel`` float32 elements (owned).
        optimizer: the server-side optimizer over the same number of elements.
        step: the initial step (restored from a checkpoint, else 0).
    """

    def __init__(self, layout: ShardLayout, params: np.ndarray, optimizer: ServerOptimizer,
                 step: int = 0) -> None:
        if params.dtype != np.float32 or params.ndim != 1 or params.size != layout.numel:
            raise InvalidArgumentError(
                f"Shard {layout.index} needs {layout.numel} float32 initial values in a flat "
                f"buffer, got {params.size} {params.dtype} values of shape {list(params.shape)}."
            )
        if optimizer.numel != layout.numel:
            raise InvalidArgumentError(
                f"The optimizer covers {optimizer.numel} elements but shard {layout.index} "
                f"holds {layout.numel}."
            )
        self.layout = layout
        self.params = params
        self.optimizer = optimizer
        self.step = int(step)
        self.stats = ShardStats()
        #: guards step, stats and the push table; waiters wait on it
        self.cond = threading.Condition(threading.RLock())
        #: guards the values of params and the optimizer state (held per chunk)
        self.apply_lock = threading.Lock()
        self._table: dict[int, _Entry] = {}
        #: the newest ledger records, oldest first (see :meth:`ledger_since`)
        self._records: deque[LedgerRecord] = deque(maxlen=LEDGER_CAPACITY)
        #: records ever made (the absolute index of the next one)
        self.ledger_total = 0
        self._expected = layout.signature
        self._zeros = np.zeros(min(layout.numel, _CHECK_BLOCK) or 1, np.float32)

    # -- updates ----------------------------------------------------------------
    def apply(self, grad: np.ndarray, lr: float) -> int:
        """Apply the whole gradient ``grad`` with rate ``lr``; return the new step."""
        with self.apply_lock:
            self.optimizer.apply(self.params, grad, lr)
        return self.commit_update()

    def begin_update(self) -> int:
        """Number the next update of the optimizer (see :meth:`apply_range`)."""
        with self.apply_lock:
            return self.optimizer.begin()

    def apply_range(self, first: int, grad: np.ndarray, lr: float, update: int) -> None:
        """Apply ``grad`` to elements ``first..`` as part of update number ``update``.

        Each range is applied under the apply lock, so concurrent pushes
        interleave range by range and a pull never reads a half-updated range.
        """
        with self.apply_lock:
            self.optimizer.apply_range(self.params, first, grad, lr, update)

    def commit_update(self) -> int:
        """Count one applied update; return the new step (waking waiters)."""
        with self.cond:
            self.step += 1
            self.stats.updates += 1
            self.cond.notify_all()
            return self.step

    # -- push bookkeeping ---------------------------------------------------------
    def begin_push(self, header: PushHeader, timeout: float) -> PushOutcome | None:
        """Validate ``header`` and register the push.

        Returns:
            The earlier outcome when ``(worker, seq)`` was already pushed (a
            retry: the gradient is not applied twice), else ``None``. A retry of
            a streamed push that was cut off part way resumes it: see
            :meth:`resume_point`.

        Raises:
            InvalidArgumentError: wrong dtype, size or variable shapes
                (counted; the caller records the refusal with :meth:`finish_push`).
        """
        with self.cond:
            entry = self._table.get(header.worker_id)
            if entry is not None and entry.incarnation == header.incarnation \
                    and header.seq <= entry.seq:
                if entry.interrupted and header.seq == entry.seq:
                    entry.interrupted = False
                    self.stats.duplicates += 1
                    return None
                self.stats.duplicates += 1
                outcome = self._wait_outcome(entry, header, timeout)
                return replace(outcome, duplicate=True)
            self._table[header.worker_id] = _Entry(header.incarnation, header.seq)
            self.stats.pushes += 1
        self.validate_header(header)
        return None

    def resume_point(self, header: PushHeader) -> tuple[int, int]:
        """``(elements already applied, update number)`` of ``header``'s push.

        ``(0, 0)`` for a fresh push; for the retry of a streamed push cut off
        part way, the part applied before, which the retry skips.
        """
        with self.cond:
            entry = self._table.get(header.worker_id)
            if entry is None or entry.seq != header.seq:
                return 0, 0
            return entry.applied, entry.update

    def note_progress(self, header: PushHeader, applied: int, update: int) -> None:
        """Record that ``applied`` elements of a streamed push are in the parameters."""
        entry = self._table.get(header.worker_id)
        if entry is not None and entry.seq == header.seq:
            entry.applied, entry.update = applied, update

    def _wait_outcome(self, entry: _Entry, header: PushHeader, timeout: float) -> PushOutcome:
        if header.seq < entry.seq:
            return PushOutcome(STALE, self.step, f"push {header.seq} of worker "
                               f"{header.worker_id} was superseded by push {entry.seq}")
        deadline = time.monotonic() + timeout
        while entry.outcome is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DeadlineExceededError(
                    f"Push {header.seq} of worker {header.worker_id} is a retry of a push still "
                    f"in progress on shard {self.layout.index} after {timeout:.0f} s; retry later."
                )
            self.cond.wait(remaining)
        return entry.outcome

    def forget_push(self, header: PushHeader) -> None:
        """An interrupted push: drop its record so that its retry is handled afresh.

        A streamed push that already changed part of the parameters is kept
        instead, so that its retry applies only the rest.
        """
        with self.cond:
            entry = self._table.get(header.worker_id)
            if entry is not None and entry.seq == header.seq and entry.outcome is None:
                if entry.applied:
                    entry.interrupted = True
                    self._record_partial(header, entry)
                else:
                    del self._table[header.worker_id]
            self.cond.notify_all()

    def finish_push(self, header: PushHeader, outcome: PushOutcome) -> PushOutcome:
        """Record ``outcome`` for ``header``'s push (answers its retries); return it."""
        with self.cond:
            entry = self._table.get(header.worker_id)
            if entry is not None and entry.seq == header.seq \
                    and entry.incarnation == header.incarnation:
                entry.outcome = outcome
            else:
                entry = None
            if outcome.status == APPLIED:
                self.stats.applied += 1
                if entry is not None and entry.ledger_index >= 0:
                    self.stats.partial -= 1  # a retry completed it
                self._ledger_put(entry, LedgerRecord(
                    header.worker_id, header.incarnation, header.seq, outcome.step,
                    applied_stop=self.layout.numel))
            elif outcome.status == REFUSED:
                if entry is not None and entry.applied:
                    self._record_partial(header, entry)
                self.stats.refused += 1
                self.stats.refusals = [*self.stats.refusals[-9:], outcome.message]
            elif outcome.status == STALE:
                self.stats.stale += 1
            elif outcome.status == VOIDED:
                self.stats.voided += 1
            self.cond.notify_all()
        return outcome

    def _record_partial(self, header: PushHeader, entry: _Entry) -> None:
        """Ledger the part of ``entry``'s streamed push already applied (caller holds cond)."""
        if entry.ledger_index < 0:
            self.stats.partial += 1
        self._ledger_put(entry, LedgerRecord(
            header.worker_id, header.incarnation, header.seq, self.step, partial=True,
            applied_stop=entry.applied))

    def _ledger_put(self, entry: _Entry | None, record: LedgerRecord) -> None:
        """Append ``record``, or replace ``entry``'s earlier (partial) record in place."""
        first = self.ledger_total - len(self._records)
        if entry is not None and entry.ledger_index >= first:
            self._records[entry.ledger_index - first] = record
            return
        self._records.append(record)
        if entry is not None:
            entry.ledger_index = self.ledger_total
        self.ledger_total += 1

    @property
    def ledger(self) -> list[tuple[int, int, int, int]]:
        """``(worker_id, incarnation, seq, step)`` of each push applied whole, oldest first.

        Of the newest :data:`LEDGER_CAPACITY` records; :meth:`ledger_since`
        also returns the partial ones.
        """
        with self.cond:
            return [(r.worker_id, r.incarnation, r.seq, r.step) for r in self._records
                    if not r.partial]

    def ledger_since(self, since: int) -> tuple[int, list[LedgerRecord]]:
        """``(index of the first record returned, records)`` of the ledger from ``since`` on.

        Records are in the order the pushes were first applied to (a partial
        record completed by a retry keeps its place). Records older than the
        newest :data:`LEDGER_CAPACITY` are forgotten; the returned index then
        exceeds ``since``.
        """
        with self.cond:
            first = self.ledger_total - len(self._records)
            start = max(first, since)
            return start, list(itertools.islice(self._records, start - first, None))

    # -- validation ---------------------------------------------------------------
    def validate_header(self, header: PushHeader) -> None:
        """Raise :class:`InvalidArgumentError` unless the push matches the layout."""
        who = f"worker {header.worker_id}"
        if header.dtype != "float32":
            raise InvalidArgumentError(
                f"Gradient pushed by {who} to ps shard {self.layout.index} has dtype "
                f"{header.dtype}; the parameters are float32. Cast gradients to float32."
            )
        if header.segments and header.segments != self._expected:
            raise InvalidArgumentError(self._describe_mismatch(header, who))
        if header.numel != self.layout.numel:
            raise InvalidArgumentError(
                f"Gradient pushed by {who} to ps shard {self.layout.index} has {header.numel} "
                f"elements but the shard holds {self.layout.numel} "
                f"({self._listing(self._expected)}); push gradients of the same model."
            )
        if not np.isfinite(header.lr) or header.lr <= 0:
            raise InvalidArgumentError(
                f"Learning rate {header.lr!r} pushed by {who} is not a positive number."
            )

    def _describe_mismatch(self, header: PushHeader, who: str) -> str:
        got = dict(header.segments)
        expected = dict(self._expected)
        problems = []
        for name, shape in self._expected:
            if name not in got:
                problems.append(f"variable {name!r} {list(shape)} is missing")
            elif tuple(got[name]) != tuple(shape):
                problems.append(f"variable {name!r} has shape {list(got[name])} but the "
                                f"parameter has shape {list(shape)}")
        problems += [f"unexpected variable {name!r} {list(shape)}"
                     for name, shape in header.segments if name not in expected]
        if not problems:
            problems.append("the variables are in a different order")
        return (f"Gradient pushed by {who} to ps shard {self.layout.index} does not match "
                f"its parameters: {'; '.join(problems)}. It was refused and the parameters "
                "are unchanged; push gradients of the same model.")

    @staticmethod
    def _listing(items: Sequence[tuple[str, tuple[int, ...]]]) -> str:
        shown = ", ".join(f"{n} {list(s)}" for n, s in items[:8])
        return shown + (", ..." if len(items) > 8 else "")

    def find_nonfinite(self, values: np.ndarray, base: int = 0) -> int | None:
        """Index (in the shard buffer) of the first NaN / inf of ``values``, else None.

        ``values`` holds the buffer's elements from ``base`` on. The scan is a
        dot product with zeros (``x * 0`` is 0 for every finite ``x`` and NaN
        otherwise), which reads the values once and writes nothing.
        """
        bad = _first_nonfinite(values, self._zeros)
        return None if bad is None else base + bad

    def nonfinite_message(self, header: PushHeader, index: int, applied: int = 0) -> str:
        """The refusal message for a NaN / inf at buffer ``index``.

        ``applied``: elements of the push already applied (a streamed push).
        """
        seg = self.layout.segment_at(index)
        fate = "the parameters are unchanged" if not applied else (
            f"its first {applied} of {header.numel} elements, declared finite by the worker, "
            "were already applied")
        return (f"Gradient pushed by worker {header.worker_id} to ps shard {self.layout.index} "
                f"contains NaN or inf in variable {seg.label!r} (shape {list(seg.shape)}); it "
                f"was refused and {fate}. Lower the learning rate or clip the gradients.")

    # -- reads ----------------------------------------------------------------------
    def buffer(self, name: str) -> np.ndarray:
        """``params`` or one optimizer slot buffer by name."""
        if name == "params":
            return self.params
        slot = self.optimizer.slots.get(name)
        if slot is None:
            raise InvalidArgumentError(
                f"Shard {self.layout.index} has no buffer {name!r}; it has params"
                f"{''.join(', ' + k for k in self.optimizer.slots)}."
            )
        return slot

    def read_chunks(self, name: str = "params", chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
        """Yield a copy of buffer ``name`` in chunks, each copied under the apply lock.

        The ``bytes`` of a chunk are the one copy a reply needs (gRPC sends
        ``bytes``): each is a consistent snapshot of its range.
        """
        raw = self.buffer(name).view(np.uint8)
        sent = 0
        try:
            for start in range(0, raw.size, chunk_bytes):
                with self.apply_lock:
                    data = raw[start:start + chunk_bytes].tobytes()
                sent += len(data)
                yield data
        finally:
            with self.cond:
                self.stats.bytes_out += sent
                self.stats.pulls += sent == raw.size


class PayloadCutOff(DataLossError):
    """A push's payload ended before the size its header announced (the sender went away)."""


def receive_into(target: np.ndarray | None, chunks: Iterable[bytes | memoryview], numel: int,
                 *, who: str, on_chunk=None) -> int:
    """Copy a payload of ``numel`` float32 elements from ``chunks`` into ``target``.

    ``on_chunk(offset, values)`` (when given) handles each chunk instead of the
    copy (``values`` is a read-only view of the chunk; ``target`` may then be
    None). Returns the number of bytes received.

    Raises:
        DataLossError: a chunk not a whole number of elements, or a payload
            shorter or longer than announced.
    """
    expected = numel * _ITEM
    received = 0
    for chunk in chunks:
        size = len(chunk)
        if size % _ITEM or received + size > expected:
            raise DataLossError(
                f"Payload from {who} does not match its header: a {size}-byte chunk at byte "
                f"{received} of {expected}; the push was refused."
            )
        values = np.frombuffer(chunk, dtype=np.float32)
        first = received // _ITEM
        if on_chunk is None:
            target[first:first + values.size] = values  # type: ignore[index]
        else:
            on_chunk(first, values)
        received += size
    if received != expected:
        raise PayloadCutOff(
            f"Payload from {who} ended after {received} of {expected} bytes; the push was "
            "refused."
        )
    return received


def all_finite(values: np.ndarray) -> bool:
    """True when no element of the float32 array ``values`` is NaN or inf (one read pass)."""
    flat = values.reshape(-1)
    return _first_nonfinite(flat, np.zeros(min(flat.size, _CHECK_BLOCK) or 1, np.float32)) is None


def _first_nonfinite(values: np.ndarray, zeros: np.ndarray) -> int | None:
    """Index of the first NaN / inf of the flat ``values``, else None.

    Scans in blocks of ``zeros.size`` with a dot product against ``zeros``
    (``x * 0`` is 0 for every finite ``x`` and NaN otherwise): it reads the
    values once and writes nothing.
    """
    with np.errstate(invalid="ignore"):
        for start in range(0, values.size, zeros.size):
            block = values[start:start + zeros.size]
            if not math.isfinite(float(np.dot(block, zeros[: block.size]))):
                return start + int(np.argmin(np.isfinite(block)))
    return None


def tune_malloc(*, one_arena: bool = False) -> bool:
    """Make glibc's malloc reuse chunk-sized blocks instead of mapping fresh pages.

    Every streamed chunk is a new ``bytes`` object (gRPC Python sends and
    receives ``bytes``). glibc serves blocks above its mmap threshold with
    fresh zeroed pages and unmaps them on free, so each chunk costs page
    faults that take longer than copying it; the dynamic threshold only partly
    avoids that. Fixing the mmap threshold at 32 MiB and the trim threshold at
    16 MiB keeps chunk-sized blocks on the heap for reuse (at most 16 MiB of
    free heap at its top is kept); the large flat buffers are still mapped. With
    ``one_arena`` (a ps task) every thread allocates from one arena, so the
    free heap kept is bounded once, not once per gRPC handler thread.
    Process-wide and idempotent; does nothing (returns False) where malloc is
    not glibc's.
    """
    global _tuned
    if _tuned is None:
        _tuned = False
        if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
            try:
                mallopt = ctypes.CDLL(None).mallopt
            except (OSError, AttributeError):
                return False
            _tuned = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) and \
                bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
    if _tuned and one_arena:
        ctypes.CDLL(None).mallopt(_M_ARENA_MAX, 1)
    return _tuned


def release_free_memory() -> None:
    """Return malloc's free heap to the system (``malloc_trim``; after :func:`tune_malloc`)."""
    if _tuned:
        ctypes.CDLL(None).malloc_trim(0)
