"""A snapshot of a running ps cluster: which tasks are up, and what each ps shard sees.

:class:`ClusterObserver` asks every task of a cluster, as any cluster peer
does (authenticated channels with the cluster's credentials):

- each task's built-in ``Ping`` with a deadline: ``up`` (it answered),
  ``dead`` (the connection is refused: the process is gone or not started)
  or ``suspended`` (its port accepts the connection but the task does not
  answer before the deadline: stopped with ``SIGSTOP``, or hung), as
  heartbeats tell them; ``refused`` when it refuses our credentials;
- each ps shard's ``Status``: its parameter bytes, counters (pushes, bytes in
  and out, stale and refused pushes), global step and bounded-staleness lead,
  and per training replica its pushes, how far behind the global step its last
  push was, and what the ps's heartbeats say of it; and each elastic worker
  that joined the job (``Join``) after the replicas: its id, name, figures,
  and whether it has left (state ``joined`` or ``left``).

Rates (pushes/s, bytes/s, a worker's steps/s) are the change between two
snapshots of the same observer. ``towerflow status`` shows the snapshots live;
the chief writes :func:`summary_scalars` of them to TensorBoard.

Example::

    >>> with ClusterObserver(cluster, credentials) as observer:      # doctest: +SKIP
    ...     observer.snapshot(sample=1.0)["workers"][1]["steps_per_sec"]
    41.5
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from towerflow.cluster.server import PING_METHOD
from towerflow.cluster.spec import ClusterSpec, parse_address
from towerflow.cluster.transport import Credentials, make_channel, unary
from towerflow.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    TowerflowError,
    UnauthenticatedError,
    UnavailableError,
)
from towerflow.ps.wire import ps_pb2 as pb
from towerflow.ps.wire import tables_pb2 as tpb
from towerflow.ps.wire.calls import method_path

__all__ = ["ClusterObserver", "ClusterScalars", "ChiefClusterScalars", "summary_scalars"]

STATUS_METHOD = method_path("Status")
TABLE_STATS_METHOD = "/towerflow.ps.Tables/TableStats"
#: a table shard's figures copied into a snapshot
_TABLE_FIELDS = ("name", "shard", "kind", "rows", "nbytes", "applied", "admitted", "evicted",
                 "filtered")

#: a shard's counters copied into a snapshot
_COUNTERS = ("pushes", "applied", "stale", "refused", "duplicates", "pulls", "bytes_in",
             "bytes_out", "max_lead")

StatusCall = Callable[[], pb.StatusReply]


class ClusterObserver:
    """Takes snapshots of a cluster (see the module doc).

    Args:
        cluster: the cluster (a ``ClusterSpec`` or its dict form).
        credentials: the cluster's credentials (default: from the environment).
        timeout: deadline of each call; a task that does not answer within it
            is ``suspended``.
        status_calls: ps shard index -> a call returning its ``StatusReply``
            (e.g. a ``PSClient``'s shards), instead of channels of its own.
        probe_tasks: also ping every task for its up / dead / suspended state.
    """

    def __init__(self, cluster: ClusterSpec | Mapping, credentials: Credentials | None = None,
                 *, timeout: float = 2.0, status_calls: Mapping[int, StatusCall] | None = None,
                 probe_tasks: bool = True) -> None:
        if not timeout > 0:
            raise InvalidArgumentError(
                f"ClusterObserver(timeout={timeout!r}): give a positive number of seconds.")
        self.cluster = ClusterSpec(cluster)
        self.credentials = Credentials.from_env() if credentials is None else credentials
        self.timeout = timeout
        self.probe_tasks = probe_tasks
        self._channels: dict[str, Any] = {}
        self._status_calls = dict(status_calls) if status_calls is not None else None
        self._previous: tuple[float, dict[str, Any]] | None = None
        tasks = len(list(self.cluster.tasks())) if probe_tasks else 0
        self._pool = ThreadPoolExecutor(max(1, min(32, tasks + self._num_ps())),
                                        thread_name_prefix="towerflow-observe")

    def _num_ps(self) -> int:
        if self._status_calls is not None:
            return len(self._status_calls)
        return self.cluster.num_tasks("ps") if "ps" in self.cluster.jobs else 0

    def _channel(self, address: str) -> Any:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = make_channel(address, self.credentials)
        return channel

    # -- one look -------------------------------------------------------------------------
    def probe(self, job_name: str, task_index: int) -> dict[str, Any]:
        """One task's state: ``{"task", "address", "state", "pid", "detail"}``."""
        address = self.cluster.task_address(job_name, task_index)
        entry: dict[str, Any] = {"task": f"/job:{job_name}/replica:0/task:{task_index}",
                                 "job": job_name, "index": task_index, "address": address,
                                 "state": "up", "pid": None, "detail": ""}
        try:
            reply = json.loads(unary(self._channel(address), PING_METHOD, b"",
                                     timeout=self.timeout))
            entry["pid"] = reply.get("pid")
        except UnavailableError as exc:
            if self._accepts_connections(address):  # a gRPC handshake unanswered: stopped
                entry.update(state="suspended", detail="accepts connections but does not "
                             "answer: suspended or hung")
            else:
                entry.update(state="dead", detail=_first_sentence(exc))
        except DeadlineExceededError:
            entry.update(state="suspended",
                         detail=f"no reply within {self.timeout:g} s: suspended or hung")
        except UnauthenticatedError as exc:
            entry.update(state="refused", detail=_first_sentence(exc))
        except TowerflowError as exc:
            entry.update(state="error", detail=_first_sentence(exc))
        return entry

    def _accepts_connections(self, address: str) -> bool:
        """Whether something listens at ``address`` (a suspended process's kernel still accepts).

        A fresh channel to a process stopped with ``SIGSTOP`` fails as
        UNAVAILABLE (its HTTP/2 handshake times out), as one to a dead task
        does; only the dead task's port refuses the TCP connection.
        """
        host, port = parse_address(address)
        try:
            socket.create_connection((host.strip("[]"), port), timeout=self.timeout).close()
        except OSError:
            return False
        return True

    def shard_status(self, index: int) -> pb.StatusReply:
        """ps shard ``index``'s ``StatusReply``.

        Raises:
            TowerflowError: as the call (unavailable, deadline, credentials).
        """
        if self._status_calls is not None:
            return self._status_calls[index]()
        address = self.cluster.task_address("ps", index)
        data = unary(self._channel(address), STATUS_METHOD, b"", timeout=self.timeout)
        return pb.StatusReply.FromString(data)

    def sample(self) -> dict[str, Any]:
        """One raw sample: the task states and the ps shards' replies (no rates)."""
        tasks = [(t.job_name, t.task_index) for t, _ in self.cluster.tasks()] \
            if self.probe_tasks else []
        probes = [self._pool.submit(self.probe, job, index) for job, index in tasks]
        shards = [self._pool.submit(self._shard_entry, i) for i in range(self._num_ps())]
        return {"time": time.time(), "monotonic": time.monotonic(),
                "tasks": [f.result() for f in probes], "shards": [f.result() for f in shards]}

    def _shard_entry(self, index: int) -> dict[str, Any]:
        try:
            return {"shard": index, "reply": self.shard_status(index), "error": "",
                    "tables": self.table_stats(index)}
        except TowerflowError as exc:
            return {"shard": index, "reply": None, "error": _first_sentence(exc), "tables": []}

    def table_stats(self, index: int) -> list[dict[str, Any]]:
        """The sparse table shards ps task ``index`` holds, each with its figures
        (none when the status calls are given, as in tests of the dense view)."""
        if self._status_calls is not None:
            return []
        address = self.cluster.task_address("ps", index)
        data = unary(self._channel(address), TABLE_STATS_METHOD, b"", timeout=self.timeout)
        return [{k: getattr(t, k) for k in _TABLE_FIELDS}
                for t in tpb.TableStatsReply.FromString(data).tables]

    # -- snapshots ------------------------------------------------------------------------
    def snapshot(self, sample: float = 0.0) -> dict[str, Any]:
        """A snapshot (JSON-ready) with rates since the previous one.

        Args:
            sample: for a first snapshot, seconds between the two samples its
                rates come from (0: a first snapshot has no rates).
        """
        if self._previous is None and sample > 0:
            first = self.sample()
            self._previous = (first["monotonic"], _counters(first))
            time.sleep(sample)  # the interval the first rates are measured over
        current = self.sample()
        previous = self._previous
        self._previous = (current["monotonic"], _counters(current))
        return _render(self.cluster, current, previous)

    def close(self) -> None:
        """Close the channels and the threads."""
        self._pool.shutdown(wait=True)
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()

    def __enter__(self) -> ClusterObserver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _first_sentence(exc: BaseException, limit: int = 200) -> str:
    text = str(exc)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _counters(sample: Mapping[str, Any]) -> dict[str, Any]:
    """The counters rates are taken from: per shard pushes and bytes, per replica pushes."""
    counters: dict[str, Any] = {}
    for shard in sample["shards"]:
        reply = shard["reply"]
        if reply is None:
            continue
        stats = dict(reply.stats)
        counters[f"ps{shard['shard']}"] = (stats.get("pushes", 0),
                                           stats.get("bytes_in", 0) + stats.get("bytes_out", 0))
        for worker in reply.workers:
            key = f"replica{worker.worker_id}"
            counters[key] = max(counters.get(key, 0), worker.pushes)
    return counters


def _rate(now: int | float, before: int | float | None, seconds: float | None) -> float | None:
    if before is None or not seconds:
        return None
    return max(0.0, (now - before) / seconds)


def _render(cluster: ClusterSpec, current: Mapping[str, Any],
            previous: tuple[float, Mapping[str, Any]] | None) -> dict[str, Any]:
    """The JSON snapshot of a sample, with rates against ``previous``."""
    seconds = current["monotonic"] - previous[0] if previous is not None else None
    before = previous[1] if previous is not None else {}
    states = {(t["job"], t["index"]): t for t in current["tasks"]}
    shards = [_shard_view(s, before, seconds) for s in current["shards"]]
    workers = _worker_views(cluster, current["shards"], states, before, seconds)
    tables = [{**t, "task": s["shard"]} for s in current["shards"] for t in s.get("tables", ())]
    return {"time": current["time"], "interval": seconds, "tasks": current["tasks"],
            "ps": shards, "workers": workers, "tables": tables}


def _shard_view(shard: Mapping[str, Any], before: Mapping[str, Any],
                seconds: float | None) -> dict[str, Any]:
    reply = shard["reply"]
    view: dict[str, Any] = {"shard": shard["shard"], "error": shard["error"]}
    if reply is None:
        return view
    stats = dict(reply.stats)
    pushes, moved = stats.get("pushes", 0), stats.get("bytes_in", 0) + stats.get("bytes_out", 0)
    then = before.get(f"ps{shard['shard']}")
    tokens = [w.last_token for w in reply.workers if w.pushes and not w.done]
    view.update(
        initialized=reply.initialized, mode=reply.mode, global_step=reply.step,
        param_bytes=reply.numel * 4, uptime=round(reply.uptime, 1),
        pushes_per_sec=_rate(pushes, then[0] if then else None, seconds),
        bytes_per_sec=_rate(moved, then[1] if then else None, seconds),
        lead=(max(tokens) - min(tokens)) if tokens else 0,
        term=reply.term, role=reply.role, alone=reply.alone,
        copies=[{"shard": c.shard, "role": c.role, "term": c.term, "step": c.step,
                 "alone": c.alone} for c in reply.replicas],
        **{name: stats.get(name, 0) for name in _COUNTERS})
    return view


def _worker_views(cluster: ClusterSpec, shards: Sequence[Mapping[str, Any]],
                  states: Mapping[tuple[str, int], Mapping[str, Any]],
                  before: Mapping[str, Any], seconds: float | None) -> list[dict[str, Any]]:
    """One entry per training replica (its task's state and shard 0's figures for it),
    then one per elastic worker the shards know."""
    figures: dict[int, pb.WorkerStat] = {}
    for shard in shards:  # shard 0 holds the global step; others fill in what it lacks
        for worker in shard["reply"].workers if shard["reply"] is not None else ():
            if worker.worker_id not in figures or worker.pushes > figures[worker.worker_id].pushes:
                figures[worker.worker_id] = worker
    views = []
    for replica, task in enumerate(cluster.replicas):
        state = states.get((task.job_name, task.task_index), {})
        stat = figures.get(replica)
        view: dict[str, Any] = {"replica": replica, "task": task.device_name,
                                "job": task.job_name, "index": task.task_index, "elastic": False,
                                "state": state.get("state"), "detail": state.get("detail", "")}
        if stat is not None:
            view.update(_figures(stat, before, seconds))
        views.append(view)
    for worker_id, stat in sorted(figures.items()):
        if stat.elastic:
            views.append({"replica": worker_id, "task": stat.task, "job": "elastic",
                          "index": worker_id, "elastic": True, "name": stat.name,
                          "left": stat.done, "state": "left" if stat.done else "joined",
                          "detail": "", **_figures(stat, before, seconds)})
    return views


def _figures(stat: pb.WorkerStat, before: Mapping[str, Any],
             seconds: float | None) -> dict[str, Any]:
    """A worker's figures in a snapshot, its steps/s against ``before``."""
    return dict(
        steps=stat.pushes, applied=stat.applied, done=stat.done,
        steps_per_sec=_rate(stat.pushes, before.get(f"replica{stat.worker_id}"), seconds),
        behind=stat.behind, last_step=stat.last_token,
        last_push_age=None if stat.last_push_age < 0 else round(stat.last_push_age, 2),
        heartbeat=stat.heartbeat or None,
        last_heartbeat_age=None if stat.last_heartbeat_age < 0
        else round(stat.last_heartbeat_age, 2))


def summary_scalars(snapshot: Mapping[str, Any]) -> dict[str, float]:
    """TensorBoard scalars (``cluster/...``) of a snapshot: per ps shard and per replica.

    Example:
        >>> summary_scalars({"ps": [{"shard": 0, "global_step": 7, "stale": 1}], "workers": []})
        {'cluster/ps0/global_step': 7.0, 'cluster/ps0/stale': 1.0}
    """
    scalars: dict[str, float] = {}
    for shard in snapshot.get("ps", ()):
        for key in ("global_step", "pushes_per_sec", "bytes_per_sec", "stale", "refused",
                    "lead", "max_lead", "param_bytes"):
            if shard.get(key) is not None:
                scalars[f"cluster/ps{shard['shard']}/{key}"] = float(shard[key])
    for worker in snapshot.get("workers", ()):
        for key in ("steps", "steps_per_sec", "behind", "last_heartbeat_age"):
            if worker.get(key) is not None:
                name = f"{worker.get('job', 'replica')}{worker.get('index', worker['replica'])}"
                scalars[f"cluster/{name}/{key}"] = float(worker[key])
    return scalars


class ClusterScalars:
    """The chief's ``cluster/...`` TensorBoard scalars, through its own ps client's channels.

    Each call takes a snapshot of the ps shards (no task pings) and returns
    :func:`summary_scalars` of it, with rates since the previous call.

    Args:
        cluster: the cluster.
        client: the chief's ``PSClient`` (its shards' ``status()`` are called).
    """

    def __init__(self, cluster: ClusterSpec | Mapping, client: Any) -> None:
        calls = {index: shard.status for index, shard in enumerate(client.shards)}
        self._observer = ClusterObserver(cluster, Credentials(), status_calls=calls,
                                         probe_tasks=False)

    @classmethod
    def of(cls, strategy: Any) -> ClusterScalars | None:
        """For a strategy with a ps client and a cluster (a ``ParameterServer``), else None."""
        try:
            client, cluster = strategy.client, strategy.cluster
        except (AttributeError, TowerflowError):  # not a ps strategy, or not prepared
            return None
        if not hasattr(client, "shards"):
            return None
        return cls(cluster, client)

    def __call__(self) -> dict[str, float]:
        """The scalars now."""
        return summary_scalars(self._observer.snapshot())

    def close(self) -> None:
        """Stop the observer's threads (the client's channels stay open)."""
        self._observer.close()


class ChiefClusterScalars:
    """A training loop's ``cluster/...`` scalars: :class:`ClusterScalars` of its strategy,
    opened at the first read; none for a strategy without ps tasks.

    The Supervisor and the Trainer's summaries (chief only) both read them.

    Example:
        >>> ChiefClusterScalars().read(object())  # not a ParameterServer: no scalars
        {}
    """

    __slots__ = ("_scalars",)

    def __init__(self) -> None:
        self._scalars: ClusterScalars | None | bool = None  # False: the strategy has no ps

    def read(self, strategy: Any) -> dict[str, float]:
        """The scalars of ``strategy``'s ps job now ({} without one)."""
        if self._scalars is None:
            self._scalars = ClusterScalars.of(strategy) or False
        return self._scalars() if self._scalars else {}

    def close(self) -> None:
        """Stop the observer (idempotent); a later read opens another."""
        scalars, self._scalars = self._scalars, None
        if scalars:
            scalars.close()
