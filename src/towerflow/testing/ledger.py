"""The update ledger of a chaos run: which pushes were applied, and how many times.

With the ``ledger`` model of :mod:`towerflow.testing.task` every push is the
one-hot gradient of its own parameter element (replica ``r``'s push ``n``
owns element ``r * slots + n``) applied by SGD at rate 1, so after the run the
parameters are minus the number of times each push was applied. Each worker
journals ``push n`` before a push and ``applied n`` once the ps acknowledged
it; a worker killed in between leaves a push *in flight*, which the ps may or
may not have applied. Each incarnation of a worker starts its journal section
with ``incarnation <id>``; its pushes then carry sequence numbers 1, 2, ...,
which is how the ps's own ledger (``PSClient.ledger()``: the applied
``(worker, incarnation, seq, step)``) is mapped back onto the pushes. A push
cut off part way (its worker killed mid-stream) is in the ps ledger as partial
with the range of elements it applied: replayed, it changes its own element
only when that element lies in the range. :func:`audit_ledger` compares the
parameters, the journals and the ps ledger.

Example:
    >>> import numpy as np
    >>> audit = audit_ledger(np.array([-1.0, 0.0, 0.0, 0.0], np.float32),
    ...                      {0: ["push 0", "applied 0", "push 1"]}, slots=4)
    >>> (audit.acknowledged, audit.in_flight, audit.lost, audit.applied_twice)
    (1, 1, 0, 0)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["Journal", "LedgerAudit", "audit_ledger", "read_journals"]


class Journal:
    """A worker's append-only record of its pushes (each line reaches the OS at once).

    Args:
        path: the journal file; an existing one is continued (a restarted worker).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        pushed = [int(line.split()[1]) for line in self.lines() if line.startswith("push ")]
        self.next = max(pushed, default=-1) + 1
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def lines(self) -> list[str]:
        """The journal's lines so far."""
        try:
            return self.path.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            return []

    def write(self, line: str) -> None:
        """Append one line and hand it to the OS (it survives a SIGKILL)."""
        self._file.write(line + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file."""
        self._file.close()


def read_journals(directory: str | Path, replicas: Mapping[int, str]) -> dict[int, list[str]]:
    """``{replica: lines}`` of the journals ``<directory>/<name>.journal``."""
    out = {}
    for replica, name in replicas.items():
        path = Path(directory) / f"{name}.journal"
        out[replica] = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    return out


@dataclass(frozen=True, slots=True)
class LedgerAudit:
    """The comparison of the parameters with the workers' journals.

    Attributes:
        pushes: pushes the workers started.
        acknowledged: pushes the ps answered as applied.
        in_flight: pushes whose worker was killed before the answer.
        in_flight_applied: those of them the ps had applied.
        updates: updates in the parameters (the sum of the counts).
        lost: acknowledged pushes missing from the parameters.
        applied_twice: pushes applied more than once.
        unexpected: elements changed by no push at all, or not by a whole number.
        ledger_entries: entries of the ps ledger audited (-1: none given).
        ledger_partial: of them, pushes cut off part way (a range applied).
        ledger_updates: updates the replay of the ps ledger made (its complete
            entries and the partial ones whose range holds their push's element).
        ledger_duplicates: pushes the ps ledger lists more than once.
        ledger_unknown: ps ledger entries matching no journalled push.
        ledger_uncovered: parameter elements no ledger given covers (a shard
            whose ledger was lost with its ps task); the replay skips them.
        replay_matches: replaying the ps ledger on the initial zeros gives the
            final parameters exactly, on the elements it covers (None: no ledger given).
    """

    pushes: int
    acknowledged: int
    in_flight: int
    in_flight_applied: int
    updates: int
    lost: int
    applied_twice: int
    unexpected: int
    ledger_entries: int = -1
    ledger_partial: int = 0
    ledger_updates: int = 0
    ledger_duplicates: int = 0
    ledger_unknown: int = 0
    ledger_uncovered: int = 0
    replay_matches: bool | None = None

    @property
    def consistent(self) -> bool:
        """None lost, none applied twice, nothing unexplained, the ledger replays."""
        return not (self.lost or self.applied_twice or self.unexpected or self.ledger_duplicates
                    or self.ledger_unknown or self.replay_matches is False) \
            and self.updates == self.acknowledged + self.in_flight_applied


def _push_slots(lines: Sequence[str]) -> dict[tuple[int, int], int]:
    """``{(incarnation, seq): n}`` of the pushes journalled in ``lines``."""
    out, incarnation, seq = {}, None, 0
    for line in lines:
        word, _, number = line.partition(" ")
        if word == "incarnation":
            incarnation, seq = int(number), 0
        elif word == "push" and incarnation is not None:
            seq += 1
            out[(incarnation, seq)] = int(number)
    return out


def _audit_ps_ledger(params: np.ndarray, journals: Mapping[int, Sequence[str]], slots: int,
                     shards: Sequence[tuple[int, int, Sequence[Sequence[int]]]]
                     ) -> dict[str, int | bool]:
    """Replay each shard's entries (``LedgerRecord``-like tuples) on zeros over the shard's
    elements ``[start, stop)`` of ``params`` (a partial entry's range is the shard's own);
    compare the elements the ledgers cover with ``params``."""
    slot_of = {r: _push_slots(lines) for r, lines in journals.items()}
    flat = np.asarray(params).reshape(-1)
    replay = np.zeros(flat.size, np.float32)
    covered = np.zeros(flat.size, bool)
    total = unknown = partial = updates = duplicates = 0
    for start, stop, entries in shards:
        covered[start:stop] = True
        keys = [tuple(entry[:3]) for entry in entries]
        total, duplicates = total + len(keys), duplicates + len(keys) - len(set(keys))
        for entry in entries:
            worker, incarnation, seq = entry[:3]
            n = slot_of.get(worker, {}).get((incarnation, seq))
            if n is None:
                unknown += 1
                continue
            cut = len(entry) > 4 and bool(entry[4])
            partial += cut
            element = worker * slots + n
            if not start <= element < stop:
                continue  # the push's own element lies in another shard
            if not cut or entry[5] <= element - start < entry[6]:
                replay[element] -= 1.0  # SGD at rate 1 of a one-hot gradient
                updates += 1
    return {"ledger_entries": total, "ledger_partial": partial, "ledger_updates": updates,
            "ledger_duplicates": duplicates, "ledger_unknown": unknown,
            "ledger_uncovered": int(np.count_nonzero(~covered)),
            "replay_matches": bool(np.array_equal(replay[covered], flat[covered]))}


def audit_ledger(params: np.ndarray, journals: Mapping[int, Sequence[str]], *,
                 slots: int, ps_ledger: Sequence[Sequence[int]] | None = None,
                 shard_ledgers: Sequence[tuple[int, int, Sequence[Sequence[int]]]] | None = None
                 ) -> LedgerAudit:
    """Audit the final ledger-model parameters against the workers' journals.

    Args:
        params: the final flat parameters (zeros initially, SGD at rate 1).
        journals: each replica's journal lines.
        slots: pushes per replica (the model's element stride).
        ps_ledger: the ps's ledger ``(worker_id, incarnation, seq, step)``, each
            optionally followed by ``(partial, applied_start, applied_stop)``
            (a :class:`~towerflow.ps.server.dense.records.LedgerRecord`), to replay on zeros and
            compare with ``params``.
        shard_ledgers: instead of ``ps_ledger``, the ledgers of a partitioned
            parameter's shards, ``(start, stop, entries)`` each: the shard holds
            elements ``[start, stop)``, and its ledger's ranges are within it. A shard
            left out (its ledger was lost with a ps task) leaves its elements to the
            parameters' audit alone (:attr:`LedgerAudit.ledger_uncovered`).
    """
    counts = -np.asarray(params, np.float64).reshape(-1)
    whole = np.round(counts)
    unexpected = int(np.count_nonzero((whole != counts) | (whole < 0)))
    counts = whole.astype(np.int64)
    explained = np.zeros(counts.size, bool)
    pushes = acknowledged = in_flight = in_flight_applied = lost = 0
    for replica, lines in journals.items():
        started, answered = set(), set()
        for line in lines:
            word, _, number = line.partition(" ")
            if word == "push":
                started.add(int(number))
            elif word in ("applied", "unapplied"):
                answered.add(int(number))
                if word == "applied":
                    acknowledged += 1
                    lost += int(counts[replica * slots + int(number)] == 0)
        pushes += len(started)
        for n in started:
            explained[replica * slots + n] = True
        for n in started - answered:
            in_flight += 1
            in_flight_applied += int(counts[replica * slots + n] > 0)
    unexpected += int(np.count_nonzero((counts != 0) & ~explained))
    if ps_ledger is not None:
        shard_ledgers = [(0, counts.size, ps_ledger)]
    replayed = {} if shard_ledgers is None else _audit_ps_ledger(params, journals, slots,
                                                                 shard_ledgers)
    return LedgerAudit(pushes=pushes, acknowledged=acknowledged, in_flight=in_flight,
                       in_flight_applied=in_flight_applied, updates=int(counts.sum()),
                       lost=lost, applied_twice=int(np.count_nonzero(counts > 1)),
                       unexpected=unexpected, **replayed)
