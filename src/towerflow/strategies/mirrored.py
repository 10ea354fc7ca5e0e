"""``Mirrored``: synchronous data parallelism, one process per device.

Article 001's towers, the PyTorch way: every replica (a process on its own GPU,
or one of N CPU processes) holds a full copy of the model, computes the
gradients of its own shard of the batch, and ``DistributedDataParallel``
averages them with an all-reduce (NCCL on GPUs, Gloo on CPUs) before the same
update is applied everywhere — the article's ``average_gradients``. DDP
broadcasts rank 0's parameters when it wraps the model, so every replica
starts from the same initialisation; a resumed run's checkpoint is read by
rank 0 alone and reaches the others through the process group
(:meth:`Mirrored.restore_checkpoint`), so the machines need no shared file
system.

Where a replica finds its place (first match wins):

1. torchrun's environment: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
   ``MASTER_ADDR``, ``MASTER_PORT`` (``towerflow train --replicas N`` sets the
   same variables for the processes it starts);
2. a cluster without a ``ps`` job (given, or ``TF_CONFIG``): the rank is the
   task's replica index in the ``ClusterSpec`` (the ``chief`` task first, then
   the ``worker`` tasks in order); the rank-0 task's address is the rendezvous;
   the local rank (which GPU of the machine) is ``LOCAL_RANK``, else Slurm's
   ``SLURM_LOCALID`` (the task's index on its node), else the task's index among
   the cluster's replicas on its host;
3. nothing: a world of one process.

Which device (:func:`replica_device`, one rule for every way a replica starts):
the device named (``device=``; a GPU named without its index, ``"cuda"`` or
``"/gpu"``, is the GPU of the local rank); with none named, GPU ``<local
rank>``, or the CPU on a machine without GPUs. When every replica of the world
runs on this machine (``towerflow train --replicas N``, ``spawn_replicas``,
``torchrun --standalone``) and it has fewer GPUs than replicas, every replica
runs on the CPU with Gloo, and one line says so and how to use the GPUs
instead (NCCL runs one rank per GPU); across machines that case is refused
instead, naming the counts and ``device='cpu'``.

Example (two CPU replicas on one machine)::

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 python train.py &
    RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 python train.py
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from towerflow import _identity
from towerflow.devices import DEVICE_ENV, DeviceSpec, resolve_device
from towerflow.errors import FailedPreconditionError, InvalidArgumentError, UnavailableError
from towerflow.strategies.single import LocalOptimizerStrategy

__all__ = ["Mirrored", "ReplicaEnv", "first_line", "replica_device", "replicas_on_host"]

log = logging.getLogger("towerflow.training")

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True, slots=True)
class ReplicaEnv:
    """Where this replica sits: its rank, the world size and the rendezvous address.

    Example:
        >>> env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
        ...        "MASTER_PORT": "29500"}
        >>> ReplicaEnv.from_env(env)
        ReplicaEnv(rank=1, world_size=2, local_rank=1, master_addr='127.0.0.1', master_port=29500, local_world_size=2)

    ``local_world_size`` is how many replicas run on this machine: torchrun's
    ``LOCAL_WORLD_SIZE``, else the whole world when the rendezvous is on the
    loopback interface, else the cluster's replicas on this task's host; None
    when unknown.
    """

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    local_world_size: int | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ReplicaEnv:
        """Read torchrun's variables, else ``TF_CONFIG``, else a world of one."""
        env = os.environ if env is None else env
        if any(name in env for name in ("RANK", "WORLD_SIZE")):
            return cls._from_torchrun(env)
        if env.get("TF_CONFIG"):
            return cls._from_tf_config(env)
        from towerflow.cluster.launcher import free_ports

        return cls(0, 1, 0, "127.0.0.1", free_ports(1)[0], 1)

    @classmethod
    def _from_torchrun(cls, env: Mapping[str, str]) -> ReplicaEnv:
        missing = [name for name in _TORCHRUN_VARS if not env.get(name)]
        if missing:
            raise InvalidArgumentError(
                f"The replica environment is incomplete: {', '.join(missing)} not set; set "
                f"all of {', '.join(_TORCHRUN_VARS)} or start the replicas with torchrun."
            )
        rank = _env_int(env, "RANK")
        world = _env_int(env, "WORLD_SIZE")
        local_rank = _env_int(env, "LOCAL_RANK") if env.get("LOCAL_RANK") else rank
        port = _env_int(env, "MASTER_PORT")
        from towerflow.cluster.spec import is_loopback_host

        if env.get("LOCAL_WORLD_SIZE"):
            local_world: int | None = _env_int(env, "LOCAL_WORLD_SIZE")
        else:  # a rendezvous on loopback: every replica runs on this machine
            local_world = world if is_loopback_host(env["MASTER_ADDR"]) else None
        return cls._checked(rank, world, local_rank, env["MASTER_ADDR"], port, local_world)

    @classmethod
    def _from_tf_config(cls, env: Mapping[str, str]) -> ReplicaEnv:
        from towerflow.cluster import resolve_cluster

        cluster, task = resolve_cluster(env=env)
        if cluster is None or task is None:
            raise InvalidArgumentError(
                "TF_CONFIG names no cluster and task for this process; set "
                '{"cluster": {...}, "task": {"type": "worker", "index": 0}}.'
            )
        return cls.from_cluster(cluster, task, env)

    @classmethod
    def from_cluster(cls, cluster: Any, task: Any,
                     env: Mapping[str, str] | None = None) -> ReplicaEnv:
        """The place of ``task`` among the replicas of ``cluster`` (a ``ClusterSpec``).

        Example:
            >>> from towerflow.cluster import ClusterSpec, TaskInfo
            >>> spec = ClusterSpec({"chief": ["h0:2222"], "worker": ["h1:2222"]})
            >>> ReplicaEnv.from_cluster(spec, TaskInfo("worker", 0), env={})
            ReplicaEnv(rank=1, world_size=2, local_rank=0, master_addr='h0', master_port=2222, local_world_size=1)
        """
        from towerflow.cluster.spec import parse_address

        env = os.environ if env is None else env
        if "ps" in cluster:
            raise InvalidArgumentError(
                "the cluster names a 'ps' job, which the Mirrored strategy does not use; "
                "train with the ParameterServer strategy (towerflow train --ps) instead."
            )
        rank = cluster.replica_index(task)
        chief = cluster.replicas[0]
        host, port = parse_address(cluster.task_address(chief.job_name, chief.task_index))
        here = replicas_on_host(cluster, task)
        local_rank = _local_rank(env)
        return cls._checked(rank, cluster.num_replicas,
                            here.index(task) if local_rank is None else local_rank,
                            host, port, len(here))

    @classmethod
    def _checked(cls, rank: int, world: int, local_rank: int, addr: str, port: int,
                 local_world: int | None) -> ReplicaEnv:
        if world < 1 or not 0 <= rank < world:
            raise InvalidArgumentError(
                f"Replica rank {rank} is outside a world of {world} replicas; "
                "RANK must be in [0, WORLD_SIZE)."
            )
        if local_rank < 0:
            raise InvalidArgumentError(f"LOCAL_RANK must be non-negative, got {local_rank}.")
        if local_world is not None and local_world < 1:
            raise InvalidArgumentError(
                f"LOCAL_WORLD_SIZE={local_world} must be at least 1; set it to the number of "
                "replicas on this machine, or unset it.")
        return cls(rank, world, local_rank, addr, port, local_world)


def _local_rank(env: Mapping[str, str]) -> int | None:
    """This process's index among the replicas of its machine as the environment says it:
    ``LOCAL_RANK`` (torchrun), else ``SLURM_LOCALID`` (the task's index on its node under
    ``srun``), else None."""
    for name in ("LOCAL_RANK", "SLURM_LOCALID"):
        if env.get(name):
            return _env_int(env, name)
    return None


def replicas_on_host(cluster: Any, task: Any) -> list[Any]:
    """The replicas of ``cluster`` whose host is ``task``'s (loopback names are one host),
    in replica order.

    Example:
        >>> from towerflow.cluster import ClusterSpec, TaskInfo
        >>> spec = ClusterSpec({"chief": ["localhost:1"], "worker": ["127.0.0.1:2", "h:3"]})
        >>> replicas_on_host(spec, TaskInfo("worker", 0))
        [TaskInfo(job_name='chief', task_index=0), TaskInfo(job_name='worker', task_index=0)]
    """
    from towerflow.cluster.spec import is_loopback_host, parse_address

    def host(t: Any) -> str:
        name = parse_address(cluster.task_address(t.job_name, t.task_index))[0].lower()
        return "localhost" if is_loopback_host(name) else name

    mine = host(task)
    return [t for t in cluster.replicas if host(t) == mine]


def replica_device(local_rank: int, device: str | torch.device | None = None, *,
                   local_replicas: int | None = None, gpus: int | None = None) -> torch.device:
    """The device a replica computes on (a GPU is made the current device).

    - ``device`` naming a GPU without its index (``"cuda"``, ``"/gpu"``): GPU
      ``<local_rank>``, refused when the machine has no such GPU;
    - any other ``device``: that device;
    - no ``device``: the one ``TOWERFLOW_DEVICE`` names when it is set, else GPU
      ``<local_rank>``; the CPU on a machine without GPUs;
      the CPU as well, said in one line (by local replica 0), when every
      replica of the world runs on this machine (``local_replicas``) and it
      has fewer GPUs than replicas (NCCL runs one rank per GPU, and the
      replicas must all use one backend); otherwise, a local rank without its
      GPU is refused.

    Args:
        local_rank: the replica's index among the replicas of its machine.
        device: the device the user named, or None.
        local_replicas: how many replicas run on this machine when they are the
            whole world; None: unknown, or the world spans machines (where each
            machine deciding alone could leave the replicas with two backends).
        gpus: the GPUs visible to this process (default: the CUDA runtime's count,
            :func:`towerflow.devices.local.gpu_count`).

    Raises:
        InvalidArgumentError: the local rank has no GPU among the visible ones
            (with no fallback above).

    Example:
        >>> replica_device(1, local_replicas=2, gpus=0)
        device(type='cpu')
        >>> replica_device(0, "cpu", gpus=4)
        device(type='cpu')
    """
    if device is None:  # the device a program's environment names (TOWERFLOW_DEVICE=cpu)
        device = os.environ.get(DEVICE_ENV, "").strip() or None
    chosen = _replica_choice(local_rank, device, local_replicas, gpus)
    if chosen.type == "cuda":
        torch.cuda.set_device(chosen)
    return chosen


def _replica_choice(local_rank: int, device: str | torch.device | None,
                    local_replicas: int | None, gpus: int | None) -> torch.device:
    named_gpu = False
    if device is not None:
        spec = DeviceSpec.from_string(device)
        named_gpu = spec.device_type == "GPU" and spec.device_index is None \
            and spec.job is None and spec.task is None
        if not named_gpu:
            return resolve_device(device)
    if gpus is None:
        from towerflow.devices.local import gpu_count

        gpus = gpu_count()
    if local_rank < gpus:
        if named_gpu or local_replicas is None or local_replicas <= gpus:
            return torch.device("cuda", local_rank)
    elif not named_gpu and gpus == 0:
        return torch.device("cpu")
    if not named_gpu and local_replicas is not None and local_replicas > gpus:
        if local_rank == 0:
            log.warning(
                "%d replicas run on this machine but %d GPU(s) are visible (NCCL runs one "
                "replica per GPU): every replica runs on the CPU with Gloo; to train on the "
                "GPUs start at most %d replica(s) per machine, or name device='cpu' "
                "(towerflow train --device cpu) to choose the CPU without this line.",
                local_replicas, gpus, gpus)
        return torch.device("cpu")
    asked = f"device {str(device)!r} (GPU {local_rank})" if named_gpu else f"GPU {local_rank}"
    raise InvalidArgumentError(
        f"Replica with local rank {local_rank} (LOCAL_RANK or SLURM_LOCALID) needs {asked} "
        f"but {gpus} GPU(s) are visible; start at most {gpus} replicas per machine, let every "
        "replica of a machine see all of its GPUs (under Slurm: no --gpus-per-task or "
        "--gpu-bind), or run every replica on the CPU (device='cpu', towerflow train "
        "--device cpu)."
    )


def _env_int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise InvalidArgumentError(
            f"Environment variable {name}={env[name]!r} is not an integer."
        ) from None


class Mirrored(LocalOptimizerStrategy):
    """Synchronous all-reduce training, one process per device.

    Args:
        backend: ``"nccl"`` or ``"gloo"``; by default NCCL for a GPU, Gloo for a CPU.
        device: force this replica's device (e.g. ``"cpu"`` for CPU replicas on a
            machine with GPUs; ``"cuda"``: the GPU of the local rank, or an error);
            by default ``cuda:<local rank>`` (``LOCAL_RANK``, else ``SLURM_LOCALID``)
            when CUDA is available, else the CPU; every replica on the CPU, said in
            one line, when the whole world runs on one machine with fewer GPUs than
            replicas (:func:`replica_device`).
        timeout_s: how long a collective (and the rendezvous) may wait for
            the other replicas.
        env: the environment to read (``os.environ`` by default).
        cluster: a ``ClusterSpec`` without a ``ps`` job whose replicas are the
            world (with ``task``, this process's task); by default the
            environment says where this replica sits.
        task: this process's ``TaskInfo`` in ``cluster``.
    """

    name = "mirrored"
    lockstep = True

    def __init__(self, backend: str | None = None, *, device: str | torch.device | None = None,
                 timeout_s: float = 1800.0, env: Mapping[str, str] | None = None,
                 cluster: Any = None, task: Any = None) -> None:
        super().__init__()
        if (cluster is None) != (task is None):
            raise InvalidArgumentError("Mirrored needs both cluster= and task=, or neither.")
        self.replica = (ReplicaEnv.from_env(env) if cluster is None
                        else ReplicaEnv.from_cluster(cluster, task, env))
        whole_world_here = self.replica.local_world_size == self.replica.world_size
        self._device = replica_device(
            self.replica.local_rank, device,
            local_replicas=self.replica.world_size if whole_world_here else None)
        self.backend = backend or ("nccl" if self._device.type == "cuda" else "gloo")
        if self.backend not in ("nccl", "gloo"):
            raise InvalidArgumentError(
                f"Unknown backend {self.backend!r}; use 'nccl' (GPUs) or 'gloo' (CPUs)."
            )
        if self.backend == "nccl" and self._device.type != "cuda":
            raise InvalidArgumentError(
                f"The NCCL backend needs a GPU but this replica runs on {self._device}; "
                "use backend='gloo'."
            )
        self._owns_group = False
        self._stop_vote: tuple[Any, torch.Tensor] | None = None  # the last step's, in flight
        self._init_group(timeout_s)
        # each replica names its devices as its own task (the placement log), as TensorFlow's
        # multi-worker replicas do; a cluster task already registered (its Server) comes first
        job, index = (task.job_name, task.task_index) if task is not None else ("worker",
                                                                                 self.rank)
        self._identity = _identity.register(job, index) if self.world_size > 1 else None

    def _init_group(self, timeout_s: float) -> None:
        if dist.is_initialized():
            if dist.get_world_size() != self.replica.world_size:
                raise FailedPreconditionError(
                    f"A process group of {dist.get_world_size()} processes already exists but "
                    f"this replica expects {self.replica.world_size}; destroy it first."
                )
            return
        host = self.replica.master_addr
        host = f"[{host}]" if ":" in host else host
        try:
            dist.init_process_group(
                self.backend,
                init_method=f"tcp://{host}:{self.replica.master_port}",
                rank=self.replica.rank,
                world_size=self.replica.world_size,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
        except RuntimeError as exc:  # Gloo / NCCL / the store: one sentence, not their traceback
            raise UnavailableError(
                f"Replica {self.replica.rank} of {self.replica.world_size} could not join the "
                f"{self.backend} process group at {host}:{self.replica.master_port}: "
                f"{first_line(exc)}. Check the network the replicas use (GLOO_SOCKET_IFNAME / "
                "NCCL_SOCKET_IFNAME must name an interface of this host, MASTER_ADDR must be "
                "reachable) and that every replica was started."
            ) from exc
        self._owns_group = True

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def rank(self) -> int:
        return self.replica.rank

    @property
    def world_size(self) -> int:
        return self.replica.world_size

    def _wrap(self, model: nn.Module) -> nn.Module:
        ids = [self._device.index] if self._device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)

    def reduce_mean(self, value: torch.Tensor) -> torch.Tensor:
        total = value.detach().to(self._device, torch.float32).clone()
        dist.all_reduce(total)
        return total / self.world_size

    def restore_checkpoint(self, read: Callable[[], Any]) -> Any:
        """Replica 0 reads the checkpoint; the others receive it through the process group.

        No other replica reads its own train dir (it may be empty, or hold another
        run), so replicas on several machines resume with no shared file system.
        When replica 0 finds none, every replica starts fresh; when reading fails,
        every replica raises.
        """
        from towerflow.strategies.broadcast import share_read

        return share_read(read, rank=self.rank, device=self._device)

    def broadcast_model(self) -> None:
        model = self._model
        if model is None:
            return
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor.data, 0)

    def check_restored_step(self, step: int) -> None:
        steps = torch.tensor([step, -step], dtype=torch.int64, device=self._device)
        dist.all_reduce(steps, op=dist.ReduceOp.MAX)
        high, low = int(steps[0]), -int(steps[1])
        if high != low:
            raise FailedPreconditionError(
                f"Replica {self.rank} restored step {step} but the replicas restored steps "
                f"between {low} and {high}; restore through the strategy "
                "(restore_checkpoint), which hands replica 0's checkpoint to every replica."
            )

    def agree_to_stop(self, requested: bool) -> bool:
        """Every replica stops at the same step: the wishes of each step are all-reduced
        (max) while the next step runs, so they are read one step later with no wait."""
        vote = torch.tensor([int(requested)], dtype=torch.int32, device=self._device)
        pending, self._stop_vote = self._stop_vote, (
            dist.all_reduce(vote, op=dist.ReduceOp.MAX, async_op=True), vote)
        if pending is None:
            return False
        work, agreed = pending
        work.wait()
        return bool(agreed.item())

    def end_training(self, *, finished: bool, checkpoint_step: int | None = None,
                     error: BaseException | None = None) -> None:
        """A replica that finished waits for the last step's stop vote (every replica sent it);
        one that stopped on an error does not (a peer may be gone)."""
        vote, self._stop_vote = self._stop_vote, None
        if vote is not None and finished:
            vote[0].wait()

    def barrier(self) -> None:
        if dist.is_initialized():
            if self.backend == "nccl":
                dist.barrier(device_ids=[self._device.index])
            else:
                dist.barrier()

    def shutdown(self) -> None:
        # The DDP wrapper holds the process group and sits in reference cycles: free it now,
        # so that the group's worker threads end while the interpreter runs. Left to the
        # interpreter's exit, a thread still releasing its last collective finds the
        # interpreter gone and aborts the process ("terminate called without an active
        # exception").
        self._train_model = self._model
        self._stop_vote = None
        super().shutdown()
        _identity.unregister(self._identity)
        gc.collect()
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_group = False

    def __repr__(self) -> str:
        return (f"Mirrored(rank={self.rank}, world_size={self.world_size}, "
                f"device={str(self._device)!r}, backend={self.backend!r})")


def first_line(error: BaseException) -> str:
    """An error's first line without a C++ ``[enforce fail at file:line]`` prefix.

    Example:
        >>> first_line(RuntimeError("[enforce fail at device.cc:84] ifa != nullptr. Unable"))
        'ifa != nullptr. Unable'
    """
    lines = str(error).strip().splitlines() or [type(error).__name__]
    return re.sub(r"^\[enforce fail at [^\]]*\]\s*", "", lines[0]).rstrip(".") or lines[0]
