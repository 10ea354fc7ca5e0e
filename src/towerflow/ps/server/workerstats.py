"""Per-replica figures a ps shard keeps for its ``Status`` reply (server side).

For each training replica that pushed: how many pushes it made and how many
were applied, the global step its last push was computed on, how far behind
the shard's global step that push was, and when it came. One record per
replica (at most ``limit``: a shard knows its replicas) and per elastic
worker the shard admits or remembers (:mod:`~towerflow.ps.server.elastic`), updated
on the push path without a lock: a few attribute writes per push.
"""

from __future__ import annotations

import time
from typing import Any

from towerflow.ps.wire import ps_pb2 as pb

__all__ = ["WorkerTable"]

_DEFAULT_LIMIT = 1024


class _Record:
    __slots__ = ("pushes", "applied", "last_token", "behind", "last_push")

    def __init__(self) -> None:
        self.pushes = self.applied = self.last_token = self.behind = 0
        self.last_push = 0.0


class WorkerTable:
    """The per-replica push figures of one shard.

    Args:
        limit: most replicas recorded (the cluster's replica count when
            known); pushes from other ids are not recorded (the shard refuses
            them anyway), but for the elastic workers ``elastic`` knows.
        elastic: the shard's :class:`~towerflow.ps.server.elastic.ElasticMembers`, or None.
    """

    __slots__ = ("_records", "_limit", "_elastic")

    def __init__(self, limit: int | None = None, elastic: Any = None) -> None:
        self._records: dict[int, _Record] = {}
        self._limit = limit or _DEFAULT_LIMIT
        self._elastic = elastic

    def record(self, worker_id: int, token: int, step: int, applied: bool) -> None:
        """One answered push of ``worker_id``, computed on step ``token``; ``step`` after it."""
        record = self._records.get(worker_id)
        if record is None:
            if not (0 <= worker_id < self._limit or self._known(worker_id) is not None):
                return
            record = self._records.setdefault(worker_id, _Record())
        record.pushes += 1
        record.applied += applied
        record.last_token = token
        record.behind = max(0, step - token - applied)
        record.last_push = time.monotonic()

    def to_proto(self, replicas: int | None = None, describe: object = None,
                 done: object = ()) -> list[pb.WorkerStat]:
        """The figures as ``WorkerStat`` messages, by replica id.

        Args:
            replicas: also list replicas ``0 .. replicas - 1`` that never pushed.
            describe: ``describe(worker_id) -> (task, heartbeat, last_heartbeat_age)``
                adding what the heartbeats say, or None.
            done: the replica ids that said they finished.
        """
        now = time.monotonic()
        stats = []
        members = ({m.worker_id: m for m in self._elastic.entries()}
                   if self._elastic is not None else {})
        for gone in [w for w in list(self._records) if w >= self._limit and w not in members]:
            self._records.pop(gone, None)  # a retired elastic worker the shard forgot
        ids = sorted(set(self._records) | set(range(min(replicas or 0, self._limit)))
                     | set(members))
        for worker_id in ids:
            record = self._records.get(worker_id) or _Record()
            stat = pb.WorkerStat(worker_id=worker_id, pushes=record.pushes,
                                 applied=record.applied, last_token=record.last_token,
                                 behind=record.behind, last_push_age=now - record.last_push,
                                 last_heartbeat_age=-1.0, done=worker_id in done)
            if not record.pushes:
                stat.last_push_age = -1.0
            member = members.get(worker_id)
            if member is not None:  # no task of the cluster: no heartbeats
                stat.elastic, stat.name, stat.done = True, member.name, bool(member.left)
                stat.task = f"elastic worker {worker_id} ({member.name})"
            elif callable(describe):
                stat.task, stat.heartbeat, stat.last_heartbeat_age = describe(worker_id)
            if stat.done:
                stat.heartbeat = "finished"
            stats.append(stat)
        return stats

    def _known(self, worker_id: int) -> Any:
        return None if self._elastic is None else self._elastic.known(worker_id)
