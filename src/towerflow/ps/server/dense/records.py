"""What a dense ps shard counts and reports: its counters, its ``Status`` figures, its ledger.

Plain values, read by :class:`~towerflow.ps.server.dense.admission.Admission`'s
callers; the admission changes them only under its own lock.

Example:
    >>> ShardStats(pushes=2, applied=1).as_dict()["applied"]
    1
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

__all__ = ["ShardStats", "ShardFigures", "LedgerRecord"]


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
    max_lead: int = 0
    pulls: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    refusals: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, int]:
        """The counters as a dict (the last refusal messages left out)."""
        return {k: getattr(self, k) for k in self.__slots__ if k != "refusals"}


class ShardFigures(NamedTuple):
    """What a shard reports in its ``Status`` reply, read at one moment."""

    step: int
    optimizer_step: int
    stats: dict[str, int]
    refusals: tuple[str, ...]
    staged: int
    pushes: tuple[tuple[int, int, int, str], ...]


class LedgerRecord(NamedTuple):
    """One entry of a shard's ledger: a push whose gradient is in the parameters.

    An applied push's range ``applied_start .. applied_stop - 1`` is the whole
    buffer; an async push refused part way (a NaN / inf in a later chunk) is
    ``partial``: its first ``applied_stop`` elements were applied.
    """

    worker_id: int
    incarnation: int
    seq: int
    step: int
    partial: bool = False
    applied_start: int = 0
    applied_stop: int = 0
