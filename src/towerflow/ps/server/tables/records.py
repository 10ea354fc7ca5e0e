"""A table shard's push records, kept for the job's current workers only.

A table shard remembers, per worker id, the newest incarnation and the
answer of its newest push (:class:`~towerflow.ps.server.pushes.PushTable`),
so that a retry is answered and never applied twice. Those records are
bounded by the job, as the dense shard's are:

- **who**: :class:`JobWorkers` says whose pushes a table shard takes: the
  job's replicas ``0 .. total_num_replicas - 1`` and, in ``async`` mode, the
  elastic workers admitted now (from their ``Join`` to their ``Done``), as
  the ps task's dense shard counts them (its ``Init`` and its elastic
  membership; before its ``Init``, the cluster's replicas). A push from any
  other id is refused before anything is recorded. A table served with no
  dense shard beside it (a table-only server in tests) knows no job: it takes
  any id, up to :data:`~towerflow.ps.server.pushes.MAX_REPLICAS_TRACKED`.
- **dropped**: :class:`TablePushes` drops the record of an id that is no
  longer one of the job's workers (an elastic worker whose ``Done`` retired
  it, or that expired) once no push of it is in progress: any later push
  under that id is refused, so no retry of it can be applied. A newer
  incarnation's first push replaces the older incarnation's record (its
  pushes are refused from then on). A replica's record stays: a replica that
  says ``Done`` may restart under the same id, and its record is what answers
  a retry of a push it sent before.
- **bounded**: records <= the job's workers (replicas + ``max_elastic_workers``),
  each with at most :data:`MAX_PUSHES_IN_FLIGHT` pushes in progress (and a
  sync step at most that many per replica, whatever their incarnations); so
  the ``TableStatus`` reply and a checkpoint carry the live records alone.

Example:
    >>> workers = JobWorkers(replicas=2)
    >>> (1 in workers, 2 in workers, (1 << 20) in workers)
    (True, False, False)
    >>> 12345 in JobWorkers()  # no job known: any id
    True
"""

from __future__ import annotations

from collections.abc import Callable, Container
from typing import Any, Protocol

from towerflow.errors import InvalidArgumentError
from towerflow.ps.server.elastic import ElasticMembers
from towerflow.ps.server.pushes import PushTable
from towerflow.ps.wire.calls import ELASTIC_BASE

__all__ = ["JobWorkers", "DenseMembership", "DenseNeighbour", "TablePushes",
           "MAX_PUSHES_IN_FLIGHT"]

#: pushes one worker may have in progress on one table shard (a sync push waits for its
#: step; a worker sends its pushes to a shard in order, so a few at most)
MAX_PUSHES_IN_FLIGHT = 64


class DenseMembership(Protocol):
    """What a table shard reads of its ps task's dense shard service (``PSService``, which
    the tables may not import): whether its ``Init`` came, its shard's aggregation config,
    the cluster's replica count and the elastic workers admitted."""

    replicas: int | None
    elastic: ElasticMembers

    @property
    def initialized(self) -> bool: ...

    @property
    def shard(self) -> Any: ...  # its ``config``: the shard's ``AggregationConfig``


class DenseNeighbour(DenseMembership, Protocol):
    """The ps task's dense shard service as its table service sees it: the membership
    above, and the dense push a ``RowBatch`` carries (``RowBatchRequest.dense``: a
    ``PushPullSmall`` request, answered with its ``PushPullSmall`` reply)."""

    def push_pull_small(self, request: bytes | memoryview, context: Any = None) -> bytes: ...


class JobWorkers:
    """The job's current workers, as the ps task's dense shard counts them.

    Args:
        replicas: the job's replicas when no dense shard is known (a fixed
            count); None: any id (no job known).
        ps: the ps task's dense shard service (a :class:`DenseMembership`): its ``Init``'s
            ``total_num_replicas`` and mode once initialised (before: its
            ``replicas``, the cluster's), and its elastic membership.
    """

    __slots__ = ("_replicas", "ps")

    def __init__(self, replicas: int | None = None, ps: DenseMembership | None = None
                 ) -> None:
        self._replicas = replicas
        self.ps = ps

    def _dense(self) -> Any:
        """The dense shard's ``AggregationConfig`` (None: no dense shard, or not initialised)."""
        ps = self.ps
        return ps.shard.config if ps is not None and ps.initialized else None

    def view(self) -> tuple[int | None, Container[int]]:
        """``(replicas, elastic)``: the job's replica count (None: no job known, any id) and
        the elastic workers admitted now (empty outside ``async`` mode or with no dense shard)."""
        config, ps = self._dense(), self.ps
        if config is not None:
            return int(config.total_num_replicas), ps.elastic if config.mode == "async" else ()
        if ps is not None:
            return (int(ps.replicas) if ps.replicas else self._replicas), ps.elastic
        return self._replicas, ()

    def __contains__(self, worker_id: object) -> bool:
        if not isinstance(worker_id, int):
            return False
        replicas, elastic = self.view()
        return replicas is None or 0 <= worker_id < replicas or worker_id in elastic

    def check(self, worker_id: int, what: str) -> None:
        """Raise unless ``worker_id`` is one of the job's current workers.

        Raises:
            InvalidArgumentError: one sentence naming the id, the job's workers and the way out.
        """
        replicas, elastic = self.view()
        if replicas is None or 0 <= worker_id < replicas or worker_id in elastic:
            return
        joins = isinstance(elastic, ElasticMembers)
        raise InvalidArgumentError(
            f"{what} from worker {worker_id} was refused: the workers of this job are its "
            f"replicas 0 .. {replicas - 1} (total_num_replicas={replicas})"
            + (f" and the elastic workers admitted now (ids from {ELASTIC_BASE} up, from their "
               "Join to their Done)" if joins else "")
            + "; push under the worker's replica index"
            + (" (an elastic worker: under the id its Join gave, until its Done)." if joins
               else ".")
        )


class TablePushes(PushTable):
    """A :class:`~towerflow.ps.server.pushes.PushTable` whose records of former workers are
    dropped (:meth:`prune`) and whose pushes in progress per worker are counted."""

    __slots__ = ()

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._replicas

    def in_flight(self, worker_id: int, incarnation: int) -> int:
        """Pushes of ``worker_id``'s ``incarnation`` in progress (0: another incarnation's row)."""
        rec = self._replicas.get(worker_id)
        return len(rec.pending) if rec is not None and rec.incarnation == incarnation else 0

    def prune(self, current: Callable[[int], bool]) -> int:
        """Drop the record of every id not ``current`` with no push in progress; how many."""
        gone = [w for w, rec in self._replicas.items() if not rec.pending and not current(w)]
        for worker in gone:
            del self._replicas[worker]
        return len(gone)
