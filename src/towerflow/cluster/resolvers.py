"""Where a process learns its cluster and its own task.

:func:`resolve_cluster` asks, in order: the explicit arguments, then each
resolver plug-in of :data:`RESOLVERS` with the environment:

1. ``TF_CONFIG`` — what Kubeflow's TFJob (and ``towerflow launch``) sets:
   ``{"cluster": {"ps": [...], "worker": [...]}, "task": {"type": "worker", "index": 1}}``
   (read by :func:`~towerflow.cluster.spec.tf_config_resolver`, which
   ``ClusterSpec.from_tf_config`` also uses).
2. torchrun — ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``
   (and ``LOCAL_WORLD_SIZE``): every rank becomes a task; across nodes the
   ranks' addresses come from torchrun's rendezvous store; see :func:`torchrun_resolver`.
3. Slurm — ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_STEP_NODELIST`` /
   ``SLURM_JOB_NODELIST`` and ``SLURM_STEP_TASKS_PER_NODE``; see :func:`slurm_resolver`.

With torchrun and Slurm the first ``TOWERFLOW_NUM_PS`` ranks (default 0) are
``ps`` tasks and the rest ``worker`` tasks.

Example:
    >>> env = {"TF_CONFIG": '{"cluster": {"worker": ["h0:2222", "h1:2222"]},'
    ...        ' "task": {"type": "worker", "index": 1}}'}
    >>> spec, task = resolve_cluster(env=env)
    >>> task.device_name
    '/job:worker/replica:0/task:1'
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path

from towerflow.cluster.rendezvous import (
    exchange_addresses,
    format_address,
    own_address,
    same_host,
    uses_agent_store,
)
from towerflow.cluster.spec import ClusterSpec, TaskInfo, parse_address, tf_config_resolver
from towerflow.errors import InvalidArgumentError

__all__ = [
    "RESOLVERS",
    "Resolution",
    "resolve_cluster",
    "is_chief",
    "tf_config_resolver",
    "torchrun_resolver",
    "slurm_resolver",
    "slurm_task_nodes",
    "expand_nodelist",
    "expand_tasks_per_node",
]

Resolution = tuple[ClusterSpec, TaskInfo]
#: A resolver reads an environment and returns the cluster and task, or None when
#: the environment is not its kind.
Resolver = Callable[[Mapping[str, str]], Resolution | None]

DEFAULT_SLURM_PORT = 2222


def _env_int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = env.get(name)
    if value is None or value == "":
        if default is None:
            raise InvalidArgumentError(f"environment variable {name} is not set; set it to an integer.")
        return default
    try:
        return int(value)
    except ValueError:
        raise InvalidArgumentError(
            f"environment variable {name}={value!r} is not an integer; set it to one."
        ) from None


# --------------------------------------------------------------------------- torchrun
def _roles(addresses: list[str], rank: int, num_ps: int, source: str) -> Resolution:
    if not 0 <= num_ps < len(addresses):
        raise InvalidArgumentError(
            f"TOWERFLOW_NUM_PS={num_ps} leaves no worker among the {len(addresses)} {source} "
            f"tasks; use a value in 0..{len(addresses) - 1}."
        )
    if not 0 <= rank < len(addresses):
        raise InvalidArgumentError(
            f"{source} rank {rank} is out of range for {len(addresses)} tasks; use 0.."
            f"{len(addresses) - 1}."
        )
    jobs = {"ps": addresses[:num_ps], "worker": addresses[num_ps:]}
    spec = ClusterSpec({job: tasks for job, tasks in jobs.items() if tasks})
    task = TaskInfo("ps", rank) if rank < num_ps else TaskInfo("worker", rank - num_ps)
    return spec, task


def torchrun_resolver(env: Mapping[str, str] | None = None) -> Resolution | None:
    """A cluster from torchrun's ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``.

    Rank ``r`` listens on port ``TOWERFLOW_PORT`` (default ``MASTER_PORT + 1``)
    plus its ``LOCAL_RANK`` (``r % LOCAL_WORLD_SIZE``). Its host:

    - every rank on one node (``LOCAL_WORLD_SIZE == WORLD_SIZE``): ``MASTER_ADDR``;
    - across nodes under torchrun: the address the rank published in torchrun's
      rendezvous store (:mod:`towerflow.cluster.rendezvous`); every rank
      publishes its own and reads the others'. ``TOWERFLOW_HOSTS``
      (comma-separated node hosts in node-rank order) is then optional; when
      set it must name the hosts the store holds (its names are used), else the
      resolver refuses it;
    - across nodes without torchrun's store (the variables set by hand):
      ``TOWERFLOW_HOSTS``, required.

    Raises:
        InvalidArgumentError: malformed variables, or ``TOWERFLOW_HOSTS``
            missing (without a store) or disagreeing with the store.
        UnavailableError, DeadlineExceededError: the store does not answer, or
            ranks published no address in time (named).
    """
    env = os.environ if env is None else env
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    rank, world = _env_int(env, "RANK"), _env_int(env, "WORLD_SIZE")
    if world < 1:
        raise InvalidArgumentError(f"WORLD_SIZE={world} must be at least 1.")
    master = env.get("MASTER_ADDR") or "localhost"
    base = _env_int(env, "TOWERFLOW_PORT", _env_int(env, "MASTER_PORT", 29500) + 1)
    per_node = _env_int(env, "LOCAL_WORLD_SIZE", world)
    if per_node < 1:
        raise InvalidArgumentError(f"LOCAL_WORLD_SIZE={per_node} must be at least 1.")
    nodes = -(-world // per_node)
    hosts = [h.strip() for h in env.get("TOWERFLOW_HOSTS", "").split(",") if h.strip()]
    num_ps = _env_int(env, "TOWERFLOW_NUM_PS", 0)
    if nodes > 1 and uses_agent_store(env):
        port = base + _env_int(env, "LOCAL_RANK", rank % per_node)
        published = exchange_addresses(env, rank, world, own_address(env, port))
        addresses = _checked_against_hosts(published, hosts, per_node, nodes)
        return _roles(addresses, rank, num_ps, "torchrun")
    if nodes == 1:
        hosts = hosts[:1] or [master]
    elif len(hosts) < nodes:
        raise InvalidArgumentError(
            f"torchrun runs {world} ranks on {nodes} nodes but TOWERFLOW_HOSTS names "
            f"{len(hosts)} host(s) {hosts} and no torchrun rendezvous store is there to ask "
            f"(TORCHELASTIC_USE_AGENT_STORE is not True); start the ranks with torchrun, or set "
            f"TOWERFLOW_HOSTS to the {nodes} node hosts in node-rank order."
        )
    addresses = [f"{hosts[r // per_node]}:{base + r % per_node}" for r in range(world)]
    return _roles(addresses, rank, num_ps, "torchrun")


def _checked_against_hosts(published: list[str], hosts: list[str], per_node: int,
                           nodes: int) -> list[str]:
    """The store's addresses, with ``TOWERFLOW_HOSTS``'s names when it is set and agrees.

    Raises:
        InvalidArgumentError: a node's ranks mix loopback and other hosts'
            addresses, or ``TOWERFLOW_HOSTS`` names another host than the store.
    """
    places = [parse_address(a, owner=" (torchrun's rendezvous store)") for a in published]
    loopback = [r for r, (host, _) in enumerate(places) if _is_loopback(host)]
    if loopback and len(loopback) < len(places):
        r = loopback[0]
        raise InvalidArgumentError(
            f"rank {r} reaches torchrun's rendezvous store from the loopback address "
            f"{places[r][0]}, which the ranks of other nodes cannot reach; start torchrun on "
            "that node with --local-addr set to the node's network address (or make its host "
            "name resolve to it)."
        )
    if not hosts:
        return published
    if len(hosts) != nodes:
        raise InvalidArgumentError(
            f"TOWERFLOW_HOSTS names {len(hosts)} host(s) {hosts} but torchrun runs {nodes} nodes; "
            "unset it (torchrun's rendezvous store gives every node's address) or name each node."
        )
    addresses = []
    for r, (host, port) in enumerate(places):
        named = hosts[r // per_node]
        if not same_host(named, host):
            raise InvalidArgumentError(
                f"TOWERFLOW_HOSTS names {named!r} for node {r // per_node}, but rank {r} "
                f"published {published[r]} in torchrun's rendezvous store; unset TOWERFLOW_HOSTS "
                "to use the store's addresses, or correct it."
            )
        addresses.append(format_address(named, port))
    return addresses


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


# --------------------------------------------------------------------------- Slurm
def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm host list (``node[01-03,07],gpu[1-2]-ib``) to host names.

    Example:
        >>> expand_nodelist("node[01-03,07],login")
        ['node01', 'node02', 'node03', 'node07', 'login']
    """
    hosts: list[str] = []
    for item in _split_top_level(nodelist.strip()):
        hosts.extend(_expand_one(item, nodelist))
    if not hosts:
        raise InvalidArgumentError(f"Slurm node list {nodelist!r} names no host.")
    return hosts


def _split_top_level(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item for item in items if item]


def _expand_one(item: str, whole: str) -> list[str]:
    match = re.search(r"\[([^\[\]]*)\]", item)
    if match is None:
        if "[" in item or "]" in item:
            raise InvalidArgumentError(f"Slurm node list {whole!r} has unbalanced brackets.")
        return [item]
    head, tail = item[: match.start()], item[match.end() :]
    out = []
    for value in _expand_range(match.group(1), whole):
        out.extend(_expand_one(head + value + tail, whole))
    return out


def _expand_range(ranges: str, whole: str) -> list[str]:
    values = []
    for part in ranges.split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise InvalidArgumentError(
                f"Slurm node list {whole!r} has range {part!r}; ranges look like '01-03' or '7'."
            )
        hi = hi or lo
        if int(hi) < int(lo):
            raise InvalidArgumentError(f"Slurm node list {whole!r} has descending range {part!r}.")
        width = len(lo)
        values.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return values


def expand_tasks_per_node(spec: str) -> list[int]:
    """Expand ``SLURM_TASKS_PER_NODE`` (``2(x3),1``) to one count per node.

    Example:
        >>> expand_tasks_per_node("2(x3),1")
        [2, 2, 2, 1]
    """
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise InvalidArgumentError(
                f"Slurm tasks-per-node {spec!r} has part {part!r}; expected forms like '2' or "
                "'2(x3)'."
            )
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def slurm_resolver(env: Mapping[str, str] | None = None) -> Resolution | None:
    """A cluster from the environment of a ``srun`` task.

    Node ``i`` of ``SLURM_STEP_NODELIST`` (or ``SLURM_JOB_NODELIST``) runs
    ``SLURM_STEP_TASKS_PER_NODE`` (or ``SLURM_TASKS_PER_NODE``; default: an
    even split) of the tasks; which ones, ``SLURM_DISTRIBUTION`` says (see
    :func:`slurm_task_nodes`). The ``k``-th task of a node listens on
    ``TOWERFLOW_PORT`` (default 2222) ``+ k``.

    Raises:
        InvalidArgumentError: the variables disagree, the distribution is one
            the resolver cannot lay out, or this task runs on another node (or
            as another local task) than the layout says.
    """
    env = os.environ if env is None else env
    if "SLURM_PROCID" not in env:
        return None
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise InvalidArgumentError(
            "SLURM_PROCID is set but neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST is; "
            "start the tasks with srun."
        )
    hosts = expand_nodelist(nodelist)
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
    counts = _slurm_counts(env, hosts, per_node)
    nodes = slurm_task_nodes(counts, env)
    base = _env_int(env, "TOWERFLOW_PORT", DEFAULT_SLURM_PORT)
    local = [nodes[:task].count(node) for task, node in enumerate(nodes)]
    rank = _env_int(env, "SLURM_PROCID")
    if 0 <= rank < len(nodes):
        layout = f"node list {nodelist} and tasks per node {per_node or counts}"
        _check_own_node(env, rank, hosts[nodes[rank]], local[rank], layout)
    addresses = [f"{hosts[node]}:{base + k}" for node, k in zip(nodes, local, strict=True)]
    return _roles(addresses, rank, _env_int(env, "TOWERFLOW_NUM_PS", 0), "Slurm")


def _slurm_counts(env: Mapping[str, str], hosts: list[str], per_node: str) -> list[int]:
    """Tasks per node of the step, checked against the node list and the task count."""
    ntasks = _env_int(env, "SLURM_STEP_NUM_TASKS", _env_int(env, "SLURM_NTASKS", len(hosts)))
    if per_node:
        counts = expand_tasks_per_node(per_node)
    else:
        even, extra = divmod(ntasks, len(hosts))
        counts = [even + (i < extra) for i in range(len(hosts))]
    if len(counts) != len(hosts) or sum(counts) != ntasks:
        raise InvalidArgumentError(
            f"Slurm tasks per node {counts} do not match {len(hosts)} node(s) {hosts} and "
            f"{ntasks} task(s); check SLURM_STEP_TASKS_PER_NODE and SLURM_NTASKS."
        )
    return counts


_WAY_OUT = ("start the tasks with `srun --distribution=block` (Slurm's default; cyclic and "
            "plane=N are understood too)")


def slurm_task_nodes(counts: list[int], env: Mapping[str, str] | None = None) -> list[int]:
    """The node index of each task of a step, as ``SLURM_DISTRIBUTION`` lays tasks out.

    Only the part before ``:`` places tasks on nodes (the rest binds them to
    sockets and cores), and ``,pack`` / ``,nopack`` only change the counts:

    - ``block`` (and unset, Slurm's default): consecutive tasks fill a node
      before the next;
    - ``cyclic``: task ``t`` goes to the next node, in turn, that has room;
    - ``plane`` (size ``SLURM_DIST_PLANESIZE``, or ``plane=N``): blocks of
      ``N`` consecutive tasks go to the nodes in turn.

    Example:
        >>> slurm_task_nodes([2, 2], {"SLURM_DISTRIBUTION": "cyclic:block"})
        [0, 1, 0, 1]
        >>> slurm_task_nodes([3, 1], {})
        [0, 0, 0, 1]

    Raises:
        InvalidArgumentError: another distribution (``arbitrary``), or a plane
            without its size.
    """
    env = os.environ if env is None else env
    given = env.get("SLURM_DISTRIBUTION", "").strip()
    kind = given.lower().split(",")[0].split(":")[0]
    plane = 1
    if kind.startswith("plane"):
        kind, _, size = kind.partition("=")
        plane = int(size) if size.isdigit() else _env_int(env, "SLURM_DIST_PLANESIZE", 0)
    if kind in ("", "*", "block"):
        return [node for node, count in enumerate(counts) for _ in range(count)]
    if kind not in ("cyclic", "plane") or plane < 1:
        raise InvalidArgumentError(
            f"SLURM_DISTRIBUTION={given} lays out tasks in a way the Slurm resolver cannot map "
            f"to nodes (a plane needs SLURM_DIST_PLANESIZE); {_WAY_OUT}."
        )
    nodes: list[int] = []
    left = list(counts)
    while any(left):
        for node, room in enumerate(left):
            take = min(room, plane)
            nodes.extend([node] * take)
            left[node] -= take
    return nodes


def _check_own_node(env: Mapping[str, str], rank: int, node: str, local: int, layout: str) -> None:
    """Refuse when Slurm ran task ``rank`` elsewhere than the layout computed."""
    where, source = env.get("SLURMD_NODENAME", ""), "SLURMD_NODENAME"
    if not where and env.get("SLURM_TOPOLOGY_ADDR"):
        where, source = _topology_node(env), "SLURM_TOPOLOGY_ADDR"
    local_id = env.get("SLURM_LOCALID", "")
    known_local = local if local_id == "" else _env_int(env, "SLURM_LOCALID")
    if (not where or where == node) and known_local == local:
        return
    dist = env.get("SLURM_DISTRIBUTION") or "block (unset)"
    raise InvalidArgumentError(
        f"Slurm task {rank} runs on {where or '?'} ({source}) as its local task {known_local} "
        f"(SLURM_LOCALID), but SLURM_DISTRIBUTION={dist} with {layout} puts it on {node} as "
        f"local task {local}, so every task would be told wrong addresses; {_WAY_OUT}."
    )


def _topology_node(env: Mapping[str, str]) -> str:
    """The node name in ``SLURM_TOPOLOGY_ADDR`` (its ``node`` level, else the last)."""
    parts = env["SLURM_TOPOLOGY_ADDR"].split(".")
    pattern = env.get("SLURM_TOPOLOGY_ADDR_PATTERN", "").split(".")
    return parts[pattern.index("node")] if len(pattern) == len(parts) and "node" in pattern \
        else parts[-1]


#: Resolver plug-ins, asked in order; the first that recognises the environment wins.
RESOLVERS: list[tuple[str, Resolver]] = [
    ("TF_CONFIG", tf_config_resolver),
    ("torchrun", torchrun_resolver),
    ("slurm", slurm_resolver),
]


def resolve_cluster(
    cluster: ClusterSpec | Mapping | str | Path | None = None,
    job_name: str | None = None,
    task_index: int | None = None,
    env: Mapping[str, str] | None = None,
) -> tuple[ClusterSpec | None, TaskInfo | None]:
    """This process's cluster and task.

    Explicit arguments win: ``cluster`` (a spec, its dict, or a JSON file path)
    and ``job_name`` / ``task_index``. What they leave open comes from the
    first resolver of :data:`RESOLVERS` that recognises ``env`` (default
    ``os.environ``). ``(None, None)`` means a single process with no cluster.

    Raises:
        InvalidArgumentError: the cluster is malformed or the task is not in it.
    """
    env = os.environ if env is None else env
    spec: ClusterSpec | None = None
    task: TaskInfo | None = None
    if cluster is not None:
        spec = (
            ClusterSpec.from_json_file(cluster)
            if isinstance(cluster, str | Path)
            else ClusterSpec(cluster)
        )
    if spec is None or job_name is None:
        for _name, resolver in RESOLVERS:
            found = resolver(env)
            if found is not None:
                spec = spec or found[0]
                task = found[1]
                break
    if job_name is not None:
        task = TaskInfo(job_name, 0 if task_index is None else task_index)
    elif task is not None and task_index is not None:
        task = TaskInfo(task.job_name, task_index)
    if spec is not None and task is not None and not (
        task.job_name == "evaluator" and "evaluator" not in spec
    ):
        spec.validate_task(task.job_name, task.task_index)
    if spec is None and task is not None:
        raise InvalidArgumentError(
            f"task {task.device_name} was given but no cluster; pass --cluster or set TF_CONFIG."
        )
    return spec, task


def is_chief(cluster: ClusterSpec, task: TaskInfo) -> bool:
    """Whether ``task`` is the chief: task 0 of the ``chief`` (or ``master``) job, else worker 0.

    A cluster with neither job (e.g. only ``local``) makes task 0 of its first
    job that is not ``ps`` the chief.

    Example:
        >>> spec = ClusterSpec({"ps": ["h:1"], "worker": ["h:2", "h:3"]})
        >>> is_chief(spec, TaskInfo("worker", 0)), is_chief(spec, TaskInfo("worker", 1))
        (True, False)
    """
    return cluster.is_chief(task)
