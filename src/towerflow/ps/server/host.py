"""A ps task's host: the shard services in a ``Server``, until the job has finished.

- :class:`ShardHost` — the dense shard service (:mod:`towerflow.ps.server.dense.service`)
  hosted by a ps task's ``Server`` (so ``Server(cluster, "ps", 0).join()`` is a
  whole ps task, as in article 003), with the heartbeats it watches and the
  job's :class:`~towerflow.ps.server.lifecycle.JobLifecycle`;
- :func:`run_ps_task` — the same, until the job has finished or SIGTERM / SIGINT.

With more than one ps task, a :class:`~towerflow.ps.server.rejoin.Rejoin`
brings back the copy of a shard this task serves alone (``replicas=1``).

The sparse tables' service is hosted next to it by
:class:`~towerflow.ps.server.tables.service.TableHost`.

Example (a ps task, as the article's ``server.join()``)::

    server = towerflow.Server(cluster, "ps", 0)   # hosts ShardHost (JOB_SERVICES["ps"])
    server.join()
"""

from __future__ import annotations

import logging
from typing import Any

from towerflow.cluster import Server, ServerOptions
from towerflow.cluster.heartbeat import HeartbeatMonitor
from towerflow.cluster.server import stop_on_signals_from_now
from towerflow.errors import InvalidArgumentError
from towerflow.ps.server.dense.service import PSService, _worker_describer, replica_task
from towerflow.ps.server.elastic import confirm_with_task0
from towerflow.ps.server.lifecycle import JobLifecycle, peer_describer
from towerflow.ps.server.rejoin import Rejoin
from towerflow.ps.server.tables.service import TableHost

__all__ = ["ShardHost", "run_ps_task"]

logger = logging.getLogger("towerflow.ps")


class ShardHost:
    """The ps shard service as a ``Server``'s hosted service (see ``towerflow.cluster.services``).

    Built by ``Server(cluster, "ps", i)`` for its task: a :class:`PSService`
    for shard ``i`` and, when ``server.options.heartbeat`` is set, a
    ``HeartbeatMonitor`` watching the chief and the workers, so a sync step
    that misses a gradient names the task and its heartbeat state, and a dead
    or suspended task is logged by name.

    Args:
        server: the ps task's server (not started yet).

    A :class:`~towerflow.ps.server.lifecycle.JobLifecycle` ends the task once every
    replica has finished (unless ``server.options.serve_forever``) and keeps
    its health probe ``NOT_SERVING`` until the shard is initialised.

    Attributes:
        service: the :class:`PSService`.
        monitor: the heartbeat monitor, or None.
        lifecycle: the job's :class:`~towerflow.ps.server.lifecycle.JobLifecycle`.
    """

    __slots__ = ("server", "service", "monitor", "lifecycle", "rejoin")

    #: it logs the task's one "serving at" line itself (the server's own is not repeated)
    announces_serving = True

    def __init__(self, server: Any) -> None:
        self.server = server
        self.monitor = None
        jobs = list(dict.fromkeys(task.job_name for task in server.cluster.replicas))
        if server.options.heartbeat is not None and jobs:
            self.monitor = HeartbeatMonitor(server, jobs=jobs, options=server.options.heartbeat,
                                            start=False)
        replicas = server.cluster.num_replicas
        self.service = PSService(server.task.task_index,
                                 describe_worker=_worker_describer(server.cluster, self.monitor),
                                 on_worker_done=self._worker_done, replicas=replicas or None,
                                 describe_peer=peer_describer(server.cluster, self.monitor),
                                 confirm_join=None if server.task.task_index == 0 else
                                 confirm_with_task0(lambda: server.channel("ps", 0)),
                                 peer_channel=lambda k: server.channel("ps", k),
                                 num_ps=len(server.cluster.job_tasks("ps")))
        self.lifecycle = JobLifecycle(server, self.service, self.monitor)
        self.rejoin: Rejoin | None = None
        if self.monitor is not None:  # a dead worker's kept step of the run's end is free
            self.service.reservations.alive = self._worker_alive

    def _worker_done(self, replica: int) -> None:
        """A worker said it finished: stop its heartbeats so it is not reported dead."""
        task = replica_task(self.server.cluster, replica)
        if self.monitor is not None and task is not None:
            self.monitor.mark_finished(task.job_name, task.task_index)
        self.lifecycle.done(replica, self.service.finished.get(replica, ""))

    def _worker_alive(self, replica: int) -> bool:
        """False once the heartbeats declared replica ``replica`` dead (True for a worker
        they do not watch: an elastic one)."""
        task = replica_task(self.server.cluster, replica)
        try:
            return task is None or self.monitor.is_alive(task.job_name, task.task_index)  # type: ignore[union-attr]
        except InvalidArgumentError:  # not watched
            return True

    def ready(self) -> bool:
        """Whether the shard is initialised (the task's health probe says SERVING)."""
        return self.service.initialized

    def handlers(self) -> Any:
        """The ``towerflow.ps.PS`` gRPC service."""
        return self.service.handlers()

    def start(self) -> None:
        """Start watching the chief and workers (the server listens already); put the
        task's table service beside this dense shard service (it counts the job's workers
        as this shard does, and hands the dense push a ``RowBatch`` carries to
        :meth:`~towerflow.ps.server.dense.service.PSService.push_pull_small`)."""
        tables = None
        for hosted in self.server.services:
            if isinstance(hosted, TableHost):
                hosted.service.serve_beside(self.service)
                tables = hosted.service
        if self.service.num_ps and self.service.num_ps > 1:  # a shard's copy may rejoin
            self.rejoin = Rejoin(self.service, tables)
            self.rejoin.start()
        if self.monitor is not None:
            self.monitor.start()
        self.lifecycle.start()
        logger.info("ps task %d serving at %s%s", self.server.task.task_index, self.server.target,
                    "" if self.monitor is None
                    else f" (heartbeat every {self.monitor.options.interval:g} s)")

    def stop(self) -> None:
        """Stop the heartbeats and the lifecycle watcher (before the server stops)."""
        self.lifecycle.stop()
        if self.rejoin is not None:
            self.rejoin.stop()
        if self.monitor is not None:
            self.monitor.stop()

    def __repr__(self) -> str:
        return f"ShardHost(shard {self.service.shard_index})"


def run_ps_task(cluster: Any, task: Any, credentials: Any = None, *,
                heartbeat: Any = None, bind_host: str | None = None,
                serve_forever: bool = False, idle_timeout: float | None = 3600.0) -> int:
    """Serve the ps shard of ``task`` until its job has finished (or SIGTERM / SIGINT); return 0.

    The same as ``Server(cluster, "ps", i, options=ServerOptions(heartbeat=...)).join()``
    (in the main thread, SIGTERM / SIGINT end the join).

    Args:
        cluster: the ``ClusterSpec`` (or its dict form).
        task: the ``TaskInfo`` of this ps task.
        credentials: the cluster's ``Credentials`` (default: from the environment).
        heartbeat: ``HeartbeatOptions`` to watch the chief and workers (they must run
            a ``Server``): a dead or suspended one is logged by name, and named with
            its state when a sync step misses its gradient. None: no heartbeats.
        bind_host: the interface to listen on instead of the host the cluster
            names (``ServerOptions.bind_host``); None: that host.
        serve_forever: serve until stopped, not only until every replica finished.
        idle_timeout: seconds to keep the parameters while every replica that
            has not finished is away; None: forever.

    Raises:
        UnavailableError: the replicas stayed away past ``idle_timeout``.
    """
    with stop_on_signals_from_now() as bind:  # also a signal before join(): it listens now
        server = Server(cluster, task.job_name, task.task_index, credentials=credentials,
                        options=ServerOptions(heartbeat=heartbeat, bind_host=bind_host,
                                              serve_forever=serve_forever,
                                              idle_timeout=idle_timeout))
        bind(server)
        try:
            server.join(handle_signals=False)
        finally:
            server.stop(grace=1.0)
    return 0
