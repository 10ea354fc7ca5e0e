"""A ps task's watch over the shards it serves without a live copy, until their copy rejoins.

With ``replicas=1`` a shard lives on two ps tasks, its own and the next one
(:func:`~towerflow.ps.wire.calls.partner_of`): one serves it, the other holds
its copy. When the copy's task is gone (the primary goes on alone:
:meth:`~towerflow.ps.server.terms.ShardTerm.go_alone`) or the copy took the
shard over from a dead primary (:meth:`~towerflow.ps.server.terms.ShardTerm.promote`),
the shard has no copy. :class:`Rejoin` asks the other task of the pair for its
``Status`` every second; once it answers (the task restarted by hand, by
``towerflow launch --max-restarts``, by Slurm or Kubernetes, or brought back)
the shard's copy is made there again while training goes on:

1. the dense shard whole (``ReplicaInit`` at the shard's term: the task takes
   the shard as its replica, even its own shard, from then on);
2. every table shard of the shard: its table (``ReplicaInitTable``), then its
   rows in parts, pushes going on between them
   (:meth:`~towerflow.ps.server.tables.replica.RowReplica.catch_up`);
3. the other task is told the copy is whole (``CaughtUp``: until then it refuses to
   take the shard over, so a primary lost during a catch-up is never replaced by half a
   copy), and the shard is no longer alone
   (:meth:`~towerflow.ps.server.terms.ShardTerm.joined`): a push is answered once the
   copy has it again.

A catch-up that fails (the task died again, or does not answer) leaves the
shard alone, and is started over once the task answers.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from towerflow.errors import TowerflowError
from towerflow.ps.server.terms import PRIMARY
from towerflow.ps.wire import ps_pb2 as pb
from towerflow.ps.wire.calls import method_path, partner_of

__all__ = ["Rejoin", "REJOIN_PERIOD"]

logger = logging.getLogger("towerflow.ps")

#: seconds between two looks for a shard's copy task
REJOIN_PERIOD = 1.0
_PROBE_S = 0.5


class Rejoin:
    """Brings back the copy of every shard this ps task serves alone (see the module doc).

    Args:
        dense: the task's dense shard service (``PSService``: its terms, its copies).
        tables: the task's table service (None: it serves no tables).
        period: seconds between two rounds.
    """

    def __init__(self, dense: Any, tables: Any = None, *, period: float = REJOIN_PERIOD) -> None:
        self.dense, self.tables, self.period = dense, tables, period
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Look every ``period`` seconds, on a daemon thread, until :meth:`stop`."""
        self._thread = threading.Thread(target=self._run, name="towerflow-ps-rejoin",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop looking (a catch-up under way ends first)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30.0)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.round()

    def round(self) -> list[int]:
        """One look: catch up the copy of every shard served alone whose other task answers;
        the shards whose copy is whole again."""
        if self.dense.num_ps is None or self.dense.peer_channel is None:
            return []
        return [term.shard for term in self.dense.terms.held()
                if term.role == PRIMARY and term.alone and self.catch_up(term)]

    def catch_up(self, term: Any) -> bool:
        """Make the copy of ``term``'s shard whole on its other task when that task answers
        (see the module doc); whether it is."""
        from towerflow.cluster.transport import unary

        shard, num_ps = term.shard, self.dense.num_ps
        task = partner_of(shard, term.task, num_ps)
        try:
            unary(self.dense.peer_channel(task), method_path("Status"), b"", timeout=_PROBE_S)
        except TowerflowError:
            return False  # not back yet
        service = self.dense if shard == self.dense.shard_index else \
            self.dense.copies.get(shard) if self.dense.copies is not None else None
        link = None if service is None else service.replica_link()
        tables = [] if self.tables is None else self.tables.served(shard)
        if link is None and not tables:
            return False  # nothing here keeps a copy (yet)
        logger.warning("ps task %d: ps task %d answers; copying shard %d to it while "
                       "training goes on", term.task, task, shard)
        try:
            if link is not None:
                link.seed(catch_up=True)
            for table in tables:
                self.tables.replica_for(table).catch_up()
            unary(self.dense.peer_channel(task), method_path("CaughtUp"), pb.PromoteRequest(
                shard=shard, term=term.term).SerializeToString(), timeout=link.timeout if link
                else _PROBE_S * 20)
        except TowerflowError as exc:
            logger.warning("ps task %d: the copy of shard %d on ps task %d did not catch up "
                           "(%s: %s); tried again once it answers", term.task, shard, task,
                           type(exc).__name__, exc)
            return False
        term.joined()
        return True
