"""The cluster description: jobs of tasks, each task a ``host:port``.

A :class:`ClusterSpec` is TensorFlow's ``tf.train.ClusterSpec``: a mapping from
job names (``"ps"``, ``"worker"``, ``"chief"``, ``"evaluator"`` or any name
such as ``"local"``) to the addresses of that job's tasks. It is immutable and
validated when it is built, so a malformed cluster fails before any process
starts listening:

    >>> spec = ClusterSpec({"ps": ["localhost:2222"], "worker": ["localhost:2223"]})
    >>> spec.task_address("worker", 0)
    'localhost:2223'
    >>> TaskInfo("worker", 1).device_name
    '/job:worker/replica:0/task:1'

The roles of the tasks are computed once, when the spec is built: the
*replicas* (the tasks that compute gradients: the ``chief`` task first, then
the ``worker`` tasks in order; in a cluster with neither, the tasks of its
first job that is not ``ps`` or ``evaluator``), each replica's index, and the
chief (the ``chief`` task, else replica 0). As in TensorFlow, a ``master``
job (the ``Master`` replica of a Kubeflow TFJob) is another name for the
``chief`` job; a cluster may not have both:

    >>> spec.num_replicas, spec.replica_index(TaskInfo("worker", 0)), spec.chief
    (1, 0, TaskInfo(job_name='worker', task_index=0))
    >>> ClusterSpec({"master": ["h:1"], "worker": ["h:2"]}).chief
    TaskInfo(job_name='master', task_index=0)
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from towerflow.errors import InvalidArgumentError, NotFoundError

__all__ = [
    "ClusterSpec",
    "TaskInfo",
    "parse_address",
    "is_loopback_host",
    "strip_scheme",
    "tf_config_resolver",
]

#: the names of the job whose one task is the chief (TensorFlow's ``multi_worker_util``
#: treats ``master``, the TFJob ``Master`` replica, as ``chief``)
CHIEF_JOBS = ("chief", "master")
_JOB_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_HOST = re.compile(r"^[A-Za-z0-9_.\-]+$")


@dataclass(frozen=True, slots=True)
class TaskInfo:
    """One task of a cluster: its job and its index in that job.

    Example:
        >>> TaskInfo("ps", 0).device_name
        '/job:ps/replica:0/task:0'
    """

    job_name: str
    task_index: int

    @property
    def device_name(self) -> str:
        """The task's device-name prefix, ``/job:<job>/replica:0/task:<index>``."""
        return f"/job:{self.job_name}/replica:0/task:{self.task_index}"

    def __str__(self) -> str:
        return f"{self.job_name}:{self.task_index}"


def strip_scheme(address: str) -> str:
    """Return ``address`` without a leading ``grpc://``."""
    return address[len("grpc://") :] if address.startswith("grpc://") else address


def parse_address(address: str, *, owner: str = "") -> tuple[str, int]:
    """Split and validate a ``host:port`` (IPv6 hosts in brackets: ``[::1]:2222``).

    Raises:
        InvalidArgumentError: empty host, missing or non-numeric port, or a port
            outside 1..65535.

    Example:
        >>> parse_address("localhost:2222")
        ('localhost', 2222)
    """
    if not isinstance(address, str):
        raise InvalidArgumentError(
            f"address {address!r}{owner} is not a string; write it as 'host:port', e.g. 'localhost:2222'."
        )
    text = strip_scheme(address.strip())
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
        ok_host = bool(sep) and _valid_ipv6(host)
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            host, port_text = text, ""
        ok_host = bool(host) and bool(_HOST.match(host))
    if not ok_host:
        raise InvalidArgumentError(
            f"address {address!r}{owner} has an empty or malformed host; write it as 'host:port', "
            "e.g. 'localhost:2222' or '[::1]:2222'."
        )
    if not port_text.isdigit():
        raise InvalidArgumentError(
            f"address {address!r}{owner} has no numeric port; write it as 'host:port', "
            "e.g. 'localhost:2222'."
        )
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise InvalidArgumentError(
            f"address {address!r}{owner} has port {port}, outside 1..65535; choose a port in that range."
        )
    return host, port


def _valid_ipv6(host: str) -> bool:
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        return False
    return True


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` names this machine's loopback interface only.

    Example:
        >>> is_loopback_host("localhost"), is_loopback_host("10.0.0.3")
        (True, False)
    """
    if host.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class ClusterSpec:
    """An immutable, validated map of job names to task addresses.

    Args:
        cluster: ``{job: ["host:port", ...]}``, or ``{job: {index: "host:port"}}``
            (indices must then be exactly ``0..n-1``), or another ``ClusterSpec``.

    Raises:
        InvalidArgumentError: an empty cluster or job, a malformed job name or
            address, an address used twice, more than one chief, or both a
            ``chief`` and a ``master`` job.
    """

    __slots__ = ("_jobs", "_replicas")

    _jobs: dict[str, tuple[str, ...]]
    _replicas: tuple[TaskInfo, ...]

    def __init__(
        self, cluster: Mapping[str, Sequence[str] | Mapping[int, str]] | ClusterSpec
    ) -> None:
        if isinstance(cluster, ClusterSpec):
            jobs = dict(cluster._jobs)
        else:
            if not isinstance(cluster, Mapping):
                raise InvalidArgumentError(
                    f"cluster {cluster!r} is not a mapping; pass e.g. "
                    "{'ps': ['localhost:2222'], 'worker': ['localhost:2223']}."
                )
            jobs = {job: _job_tasks(job, tasks) for job, tasks in cluster.items()}
        _validate(jobs)
        object.__setattr__(self, "_jobs", jobs)
        object.__setattr__(self, "_replicas", _replica_tasks(jobs))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("ClusterSpec is immutable; build a new one instead.")

    # -- constructors -------------------------------------------------------
    @classmethod
    def from_json_file(cls, path: str | Path) -> ClusterSpec:
        """Read a cluster from a JSON file: ``{job: [...]}`` or ``{"cluster": {job: [...]}}``.

        Raises:
            NotFoundError: the file does not exist.
            InvalidArgumentError: the file is not valid JSON or not a cluster.
        """
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise NotFoundError(
                f"cluster file '{path}' does not exist; pass the path of a JSON file like "
                '{"ps": ["localhost:2222"], "worker": ["localhost:2223"]}.'
            ) from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidArgumentError(
                f"cluster file '{path}' is not valid JSON ({exc}); fix the file."
            ) from None
        if isinstance(data, dict) and isinstance(data.get("cluster"), dict):
            data = data["cluster"]
        return cls(data)

    @classmethod
    def from_tf_config(cls, env: Mapping[str, str] | None = None) -> tuple[ClusterSpec, TaskInfo]:
        """Read the cluster and this task from ``TF_CONFIG`` (Kubeflow TFJob format).

        Raises:
            NotFoundError: ``TF_CONFIG`` is not set.
            InvalidArgumentError: it is malformed, names an unknown job or an
                index out of range.
        """
        result = tf_config_resolver(env)
        if result is None:
            raise NotFoundError(
                "TF_CONFIG is not set; set it to "
                '\'{"cluster": {"worker": ["host:port", ...]}, "task": {"type": "worker", '
                "\"index\": 0}}'."
            )
        return result

    # -- queries ------------------------------------------------------------
    @property
    def jobs(self) -> list[str]:
        """Job names, in the order they were given."""
        return list(self._jobs)

    def num_tasks(self, job: str) -> int:
        """Number of tasks of ``job``.

        Raises:
            InvalidArgumentError: ``job`` is not in the cluster.
        """
        return len(self._tasks_of(job))

    def task_address(self, job: str, index: int) -> str:
        """The ``host:port`` of task ``index`` of ``job`` (validated)."""
        self.validate_task(job, index)
        return self._jobs[job][index]

    def job_tasks(self, job: str) -> list[str]:
        """Addresses of every task of ``job``, by index."""
        return list(self._tasks_of(job))

    def tasks(self) -> Iterator[tuple[TaskInfo, str]]:
        """Every task of the cluster with its address, job by job."""
        for job, addresses in self._jobs.items():
            for index, address in enumerate(addresses):
                yield TaskInfo(job, index), address

    def as_dict(self) -> dict[str, list[str]]:
        """A plain ``{job: [address, ...]}`` copy (JSON-able)."""
        return {job: list(tasks) for job, tasks in self._jobs.items()}

    def tf_config(self, task: TaskInfo) -> str:
        """The ``TF_CONFIG`` value (JSON) that tells a process it is ``task``.

        ``task`` may lie outside the cluster (an ``evaluator``, as in a TFJob).
        """
        config = {"cluster": self.as_dict(), "task": {"type": task.job_name, "index": task.task_index}}
        return json.dumps(config)

    # -- roles ------------------------------------------------------------
    @property
    def replicas(self) -> tuple[TaskInfo, ...]:
        """The tasks that train, in replica order (chief or master first, then the workers)."""
        return self._replicas

    @property
    def num_replicas(self) -> int:
        """How many tasks train (compute gradients)."""
        return len(self._replicas)

    @property
    def chief(self) -> TaskInfo | None:
        """The task that initialises, restores and saves: replica 0 (None without replicas)."""
        return self._replicas[0] if self._replicas else None

    def is_chief(self, task: TaskInfo) -> bool:
        """Whether ``task`` is the chief (the ``chief`` or ``master`` task, else worker 0)."""
        return task == self.chief

    def replica_index(self, task: TaskInfo) -> int:
        """The index of ``task`` among :attr:`replicas` (its rank).

        Raises:
            InvalidArgumentError: ``task`` does not train (a ``ps`` or
                ``evaluator`` task, or one outside the cluster).

        Example:
            >>> spec = ClusterSpec({"chief": ["h:1"], "worker": ["h:2", "h:3"]})
            >>> spec.replica_index(TaskInfo("worker", 1)), spec.num_replicas
            (2, 3)
        """
        try:
            return self._replicas.index(TaskInfo(task.job_name, task.task_index))
        except ValueError:
            names = ", ".join(str(t) for t in self._replicas) or "none"
            raise InvalidArgumentError(
                f"task {task.job_name}:{task.task_index} does not train in this cluster; its "
                f"training tasks are {names}. A ps task serves its shard "
                "(towerflow.Server(cluster, 'ps', i).join()); run training code in a chief "
                "or worker task."
            ) from None

    def validate_task(self, job: str, index: int) -> None:
        """Check that task ``index`` of ``job`` exists.

        Raises:
            InvalidArgumentError: the job is unknown or the index out of range.
        """
        tasks = self._tasks_of(job)
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(tasks):
            raise InvalidArgumentError(
                f"task index {index!r} is out of range for job '{job}', which has "
                f"{len(tasks)} task(s); use an index in 0..{len(tasks) - 1}."
            )

    def _tasks_of(self, job: str) -> tuple[str, ...]:
        try:
            return self._jobs[job]
        except KeyError:
            raise InvalidArgumentError(
                f"job '{job}' is not in the cluster, whose jobs are {sorted(self._jobs)}; "
                "use one of those or add the job to the cluster."
            ) from None

    # -- value object -------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ClusterSpec):
            return NotImplemented
        return self._jobs == other._jobs

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._jobs.items())))

    def __repr__(self) -> str:
        return f"ClusterSpec({self.as_dict()!r})"

    def __contains__(self, job: object) -> bool:
        return job in self._jobs


def tf_config_resolver(
    env: Mapping[str, str] | None = None,
) -> tuple[ClusterSpec, TaskInfo] | None:
    """The cluster and task of ``TF_CONFIG``; ``None`` when it is unset or empty.

    An ``evaluator`` task may be absent from the cluster (Kubeflow runs it
    outside): it resolves to ``TaskInfo("evaluator", index)``.

    Raises:
        InvalidArgumentError: invalid JSON, no cluster, an unknown task type,
            or an index out of range.
    """
    env = os.environ if env is None else env
    text = env.get("TF_CONFIG", "").strip()
    if not text:
        return None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidArgumentError(f"TF_CONFIG is not valid JSON ({exc}); fix its value.") from None
    if config in ({}, None):
        return None
    if not isinstance(config, dict) or not config.get("cluster"):
        raise InvalidArgumentError(
            'TF_CONFIG has no "cluster"; set it to {"cluster": {"worker": ["host:port"]}, '
            '"task": {"type": "worker", "index": 0}}.'
        )
    spec = ClusterSpec(config["cluster"])
    task = config.get("task") or {}
    if not isinstance(task, dict) or "type" not in task:
        raise InvalidArgumentError(
            f'TF_CONFIG task {task!r} has no "type"; set "task": {{"type": "<job>", "index": <i>}} '
            f"with a job among {spec.jobs}."
        )
    job, index = task["type"], task.get("index", 0)
    if isinstance(index, bool) or not isinstance(index, int):
        raise InvalidArgumentError(f"TF_CONFIG task index {index!r} is not an integer; fix it.")
    if job == "evaluator" and "evaluator" not in spec:
        return spec, TaskInfo(job, index)
    if job not in spec:
        raise InvalidArgumentError(
            f"TF_CONFIG task type {job!r} is not a job of its cluster {spec.jobs}; use one of "
            "those (or 'evaluator')."
        )
    spec.validate_task(job, index)
    return spec, TaskInfo(job, index)


#: jobs whose tasks never compute gradients
_SERVING_JOBS = ("ps", "evaluator")


def _replica_tasks(jobs: Mapping[str, tuple[str, ...]]) -> tuple[TaskInfo, ...]:
    """The training tasks: chief (or master) then workers, else the first job that is not
    ps / evaluator."""
    training = (*CHIEF_JOBS, "worker")
    if any(job in jobs for job in training):
        names = [job for job in training if job in jobs]
    else:
        names = [job for job in jobs if job not in _SERVING_JOBS][:1]
    return tuple(TaskInfo(job, i) for job in names for i in range(len(jobs[job])))


def _job_tasks(job: object, tasks: object) -> tuple[str, ...]:
    if not isinstance(job, str) or not _JOB_NAME.match(job):
        raise InvalidArgumentError(
            f"job name {job!r} is not valid; use lower-case letters, digits and '_', "
            "starting with a letter (e.g. 'worker')."
        )
    if isinstance(tasks, str):
        raise InvalidArgumentError(
            f"job '{job}' has a single string {tasks!r} instead of a list; write "
            f"'{job}': [{tasks!r}]."
        )
    if isinstance(tasks, Mapping):
        return _indexed_tasks(job, tasks)
    if not isinstance(tasks, Sequence):
        raise InvalidArgumentError(
            f"job '{job}' has tasks {tasks!r}, which is not a list of 'host:port' strings; "
            "write e.g. ['localhost:2222']."
        )
    return tuple(tasks)


def _indexed_tasks(job: str, tasks: Mapping[Any, str]) -> tuple[str, ...]:
    try:
        by_index = {int(k): v for k, v in tasks.items()}
    except (TypeError, ValueError):
        raise InvalidArgumentError(
            f"job '{job}' has task keys {list(tasks)!r}; dict-of-index form needs integer "
            "indices 0..n-1."
        ) from None
    expected = list(range(len(by_index)))
    if sorted(by_index) != expected:
        raise InvalidArgumentError(
            f"job '{job}' has task indices {sorted(by_index)}; indices must be exactly "
            f"{expected} (no gaps, none negative)."
        )
    return tuple(by_index[i] for i in expected)


def _validate(jobs: dict[str, tuple[str, ...]]) -> None:
    if not jobs:
        raise InvalidArgumentError(
            "the cluster has no jobs; give at least one, e.g. {'worker': ['localhost:2222']}."
        )
    seen: dict[tuple[str, int], str] = {}
    for job, tasks in jobs.items():
        if not tasks:
            raise InvalidArgumentError(
                f"job '{job}' has no tasks; give it at least one 'host:port' or remove it."
            )
        for index, address in enumerate(tasks):
            name = f"/job:{job}/replica:0/task:{index}"
            host, port = parse_address(address, owner=f" of {name}")
            key = (_canonical_host(host), port)
            if key in seen:
                raise InvalidArgumentError(
                    f"address '{address}' of {name} is also used by {seen[key]}; give every "
                    "task its own host:port."
                )
            seen[key] = name
    _validate_chief(jobs)


def _validate_chief(jobs: Mapping[str, tuple[str, ...]]) -> None:
    named = [job for job in CHIEF_JOBS if job in jobs]
    if len(named) > 1:
        raise InvalidArgumentError(
            f"the cluster has both a 'chief' job {list(jobs['chief'])} and a 'master' job "
            f"{list(jobs['master'])}, two names of the one chief task; keep one of them."
        )
    for job in named:
        if len(jobs[job]) > 1:
            raise InvalidArgumentError(
                f"the cluster has {len(jobs[job])} chiefs {list(jobs[job])} in job '{job}'; a "
                "cluster has at most one chief task (put the others in the 'worker' job)."
            )


def _canonical_host(host: str) -> str:
    return "127.0.0.1" if host.lower() == "localhost" else host.lower()
