"""The worker's side of the dense ps path: flat buffers and whole variables.

A ps shard holds its variables as segments of one flat float32 buffer (a
partitioned variable spans several shards). On a worker:

- :class:`FlatBuffers` keeps one flat parameter buffer and one flat gradient
  buffer per shard on the worker's device; every parameter's ``.data`` and
  ``.grad`` are views into them (a partitioned variable's parts are copied in
  and out), so a push sends the gradient buffer without a gather and a pull
  lands in place;
- :func:`assemble` builds a whole variable from the shards' snapshots and
  :func:`split_flat` cuts whole tensors into the shards' flat arrays, so a
  checkpoint restores onto any placement of the same variables;
- :func:`dense_groups` / :func:`dense_restore` turn the shards' snapshots into
  checkpoint groups and back, the shards' push tables as int64 rows in the
  :data:`PUSH_TABLE_GROUP` group (a restored ps applies no push twice);
- :func:`consistent_snapshot` reads every shard as of one global step;
- :func:`join_job` makes a client an elastic worker of a running async job
  (``Join`` on ps task 0 for an id, then on every other ps task).

The optimizer the ps applies is described to it by the worker's
``OptimizerConfig`` (:func:`~towerflow.ps.wire.messages.optimizer_to_proto`); the
calls go through :class:`~towerflow.ps.worker.dense.client.PSClient`. Nothing here imports
a server module.

Example:
    >>> from towerflow.ps.placement import plan_placement
    >>> placement = plan_placement({"w": (4,)}, 2, partition_threshold_bytes=8)
    >>> flat = split_flat(placement, lambda name: torch.arange(4.0))
    >>> [a.tolist() for a in flat]
    [[0.0, 1.0], [2.0, 3.0]]
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from towerflow.errors import AbortedError, InvalidArgumentError
from towerflow.ps.placement import Placement

__all__ = [
    "PUSH_TABLE_GROUP",
    "FlatBuffers",
    "DenseRestore",
    "assemble",
    "split_flat",
    "push_table_rows",
    "push_table_tensor",
    "dense_groups",
    "dense_restore",
    "consistent_snapshot",
    "join_job",
]

#: checkpoint group of the ps shards' push tables (``shard_<i>``: int64 rows
#: ``worker, incarnation, seq, status code``), so a restored ps applies no push twice
PUSH_TABLE_GROUP = "ps_pushes"
_STATUS_CODES = ("applied", "stale", "voided")


class FlatBuffers:
    """Per-shard flat parameter and gradient buffers with the model's tensors as views.

    Args:
        placement: where each variable lives (one flat buffer per shard).
        params: the model's trainable parameters by name.
        device: where the worker computes; on another device than the CPU the
            host copies the wire needs are kept too (pinned on CUDA).
    """

    def __init__(self, placement: Placement, params: dict[str, nn.Parameter],
                 device: torch.device) -> None:
        self.placement = placement
        self.device = device
        self.params = params
        self.flat = [torch.empty(s.numel, device=device) for s in placement.shards]
        self.grad = [torch.zeros(s.numel, device=device) for s in placement.shards]
        pin = device.type == "cuda"
        if device.type == "cpu":
            self.host_p, self.host_g = self.flat, self.grad
        else:
            self.host_p = [torch.empty(s.numel, pin_memory=pin) for s in placement.shards]
            self.host_g = [torch.empty(s.numel, pin_memory=pin) for s in placement.shards]
        self.host_param_arrays = [t.numpy() for t in self.host_p]
        self.host_grad_arrays = [t.numpy() for t in self.host_g]
        self._partitioned: list[tuple[str, int, Any]] = []
        with torch.no_grad():
            for shard in placement.shards:
                for seg in shard.segments:
                    param = params[seg.name]
                    view = slice(seg.offset, seg.offset + seg.numel)
                    part = param.detach().reshape(-1)[seg.start:seg.start + seg.numel]
                    self.flat[shard.index][view] = part
                    if seg.num_parts == 1:
                        param.data = self.flat[shard.index][view].view(param.shape)
                        param.grad = self.grad[shard.index][view].view(param.shape)
                    else:
                        self._partitioned.append((seg.name, shard.index, seg))

    def host_params(self) -> list[np.ndarray]:
        """The current parameters, one flat host array per shard."""
        with torch.no_grad():
            for name, index, seg in self._partitioned:
                values = self.params[name].detach().reshape(-1)[seg.start:seg.start + seg.numel]
                self.flat[index][seg.offset:seg.offset + seg.numel] = values
        if self.device.type != "cpu":
            for host, flat in zip(self.host_p, self.flat, strict=True):
                _copy_to_host(host, flat)
        return self.host_param_arrays

    def load_from(self, shards: list[np.ndarray]) -> None:
        """Set the local parameters from per-shard flat arrays."""
        for host, values in zip(self.host_param_arrays, shards, strict=True):
            host[...] = values
        self.params_to_device()

    def zero_grads(self) -> None:
        """Zero every gradient (the flat buffers and the partitioned variables')."""
        for grad in self.grad:
            grad.zero_()
        for name, _, _ in self._partitioned:
            param = self.params[name]
            if param.grad is not None:
                param.grad.zero_()

    def nonfinite_gradient(self) -> str | None:
        """Name of a parameter whose gradient holds NaN / inf, or None (one sync).

        The sum of each flat gradient is finite when every value is (one reduction per
        shard, no mask); only a sum that is not (a NaN, an inf, or finite values that
        overflowed) is looked at value by value.
        """
        self._gather_partitioned()
        sums = [g.sum() for g in self.grad if g.numel()]
        if not sums or bool(torch.isfinite(torch.stack(sums)).all()):
            return None
        if all(bool(torch.isfinite(g).all()) for g in self.grad):
            return None  # finite values whose sum overflowed
        for name, param in self.params.items():
            if param.grad is not None and not bool(torch.isfinite(param.grad).all()):
                return name
        return "?"

    def _gather_partitioned(self) -> None:
        for name, index, seg in self._partitioned:
            grad = self.params[name].grad
            target = self.grad[index][seg.offset:seg.offset + seg.numel]
            if grad is None:
                target.zero_()
            else:
                target.copy_(grad.reshape(-1)[seg.start:seg.start + seg.numel])

    def grads_to_host(self) -> list[np.ndarray]:
        """The gradients, one flat host array per shard (views made once, reused every step)."""
        if self.device.type != "cpu":
            for host, grad in zip(self.host_g, self.grad, strict=True):
                _copy_to_host(host, grad)
        return self.host_grad_arrays

    def params_to_device(self) -> None:
        """Copy the pulled host parameters to the device and into partitioned variables."""
        with torch.no_grad():
            if self.device.type != "cpu":
                for flat, host in zip(self.flat, self.host_p, strict=True):
                    flat.copy_(host, non_blocking=True)
            for name, index, seg in self._partitioned:
                param = self.params[name]
                param.data.reshape(-1)[seg.start:seg.start + seg.numel] = \
                    self.flat[index][seg.offset:seg.offset + seg.numel]


def _copy_to_host(host: torch.Tensor, source: torch.Tensor) -> None:
    """``host[...] = source``: straight from a GPU into the (pinned) host buffer; from a
    device of another kind (``mps``, ``xpu``, ``lazy``) through its own ``cpu()``."""
    host.copy_(source if source.device.type == "cuda" else source.cpu())


def push_table_tensor(rows: Any) -> torch.Tensor:
    """A shard's push-table rows as an int64 ``[n, 4]`` tensor."""
    data = [(w, i, q, _STATUS_CODES.index(st) if st in _STATUS_CODES else 0)
            for w, i, q, st in rows]
    return torch.tensor(data, dtype=torch.int64).reshape(-1, 4)


def push_table_rows(tensor: torch.Tensor | None) -> list[tuple[int, int, int, str]]:
    """The rows of a :func:`push_table_tensor` (none when the checkpoint has no table)."""
    if tensor is None:
        return []
    if tensor.dtype != torch.int64 or tensor.dim() != 2 or tensor.shape[1] != 4:
        raise InvalidArgumentError(
            f"The checkpoint's push table is {tensor.dtype} of shape {list(tensor.shape)}, not "
            "int64 rows of 4; restore a checkpoint written by towerflow."
        )
    return [(int(w), int(i), int(q), _STATUS_CODES[int(c)] if 0 <= c < 3 else "applied")
            for w, i, q, c in tensor.tolist()]


def assemble(placement: Placement, snaps: list[Any], name: str, buffer: str) -> torch.Tensor:
    """Variable ``name`` whole, from the shards' snapshots' ``buffer`` (params or a slot)."""
    parts = placement.segments_of(name)
    var_shape = parts[0][1].var_shape
    out = np.empty(int(np.prod(var_shape, dtype=np.int64)), np.float32)
    for task, seg in parts:
        source = snaps[task].params if buffer == "params" else snaps[task].slots[buffer]
        out[seg.start:seg.start + seg.numel] = source[seg.offset:seg.offset + seg.numel]
    return torch.from_numpy(out).reshape(var_shape)


def split_flat(placement: Placement, tensor_of: Callable[[str], torch.Tensor]) -> list[np.ndarray]:
    """Per-shard flat arrays from whole tensors (``tensor_of(name)``)."""
    shards = [np.empty(s.numel, np.float32) for s in placement.shards]
    for shard in placement.shards:
        for seg in shard.segments:
            flat = tensor_of(seg.name).detach().to("cpu", torch.float32).reshape(-1).numpy()
            shards[shard.index][seg.offset:seg.offset + seg.numel] = \
                flat[seg.start:seg.start + seg.numel]
    return shards


def dense_groups(placement: Placement, snaps: list[Any]) -> dict[str, dict[str, torch.Tensor]]:
    """Checkpoint groups of the shards' snapshots: ``model`` (whole variables),
    ``optimizer`` (``<name>/<slot>``) and :data:`PUSH_TABLE_GROUP`."""
    names = placement.names()
    return {
        "model": {name: assemble(placement, snaps, name, "params") for name in names},
        "optimizer": {f"{name}/{slot}": assemble(placement, snaps, name, slot)
                      for slot in snaps[0].slots for name in names},
        PUSH_TABLE_GROUP: {f"shard_{i}": push_table_tensor(snap.pushes)
                           for i, snap in enumerate(snaps)},
    }


@dataclass(frozen=True, slots=True)
class DenseRestore:
    """What the chief sends the ps shards to restore a checkpoint (per shard)."""

    params: list[np.ndarray]
    slots: list[dict[str, np.ndarray]]
    step: int
    optimizer_step: int
    pushes: list[list[tuple[int, int, int, str]]]


def dense_restore(placement: Placement, groups: Mapping[str, Any],
                  metadata: Mapping[str, Any], optimizer_name: str) -> DenseRestore:
    """The shards' state from checkpoint ``groups`` (see :func:`dense_groups`).

    Optimizer slots are restored only when the checkpoint's optimizer is
    ``optimizer_name``; otherwise the ps starts them afresh.
    """
    model_group = groups["model"]
    params = split_flat(placement, lambda name: model_group[name])
    optimizer_group = groups.get("optimizer", {})
    slot_names = sorted({key.rsplit("/", 1)[1] for key in optimizer_group})
    slots: list[dict[str, np.ndarray]] = [{} for _ in params]
    if slot_names and metadata.get("optimizer") == optimizer_name:
        for slot in slot_names:
            per_shard = split_flat(placement, lambda name, s=slot: optimizer_group[f"{name}/{s}"])
            for shard_slots, values in zip(slots, per_shard, strict=True):
                shard_slots[slot] = values
    tables = groups.get(PUSH_TABLE_GROUP, {})
    pushes = [push_table_rows(tables.get(f"shard_{i}")) for i in range(len(params))]
    step = int(metadata.get("global_step", 0))
    return DenseRestore(params, slots, step, int(metadata.get("optimizer_step", step)), pushes)


def consistent_snapshot(client: Any, *, sync: bool, timeout: float) -> list[Any]:
    """Every shard's state (:meth:`PSClient.snapshot`); in sync mode as of one global step.

    A sync step completes on each shard on its own, so a snapshot taken while
    one completes can straddle it: it is taken again once the shards' steps
    agree (within ``timeout`` seconds).

    Raises:
        AbortedError: the shards stayed at different steps (a worker stopped
            between its pushes to them, so a step is complete on some only):
            no consistent state can be read until that step completes.
    """
    snaps = client.snapshot()
    if not sync:
        return snaps
    deadline = time.monotonic() + timeout
    while len({snap.step for snap in snaps}) > 1:
        steps = [int(shard.status().step) for shard in client.shards]
        if len(set(steps)) == 1:
            snaps = client.snapshot()
            continue
        if time.monotonic() >= deadline:
            listing = ", ".join(f"ps task {i} at step {step}" for i, step in enumerate(steps))
            raise AbortedError(
                f"The ps tasks hold different global steps ({listing}): a sync step is "
                "complete on some shards only (a worker stopped between its pushes to them), "
                "so no consistent state can be read; it will be once a worker completes "
                "that step."
            )
        time.sleep(0.05)
    return snaps


def join_job(client: Any, name: str) -> tuple[int, int]:
    """Join ``client`` (a ``PSClient``) to a running async job as an elastic worker.

    Ps task 0 gives the id (see :mod:`towerflow.ps.wire.calls`' call sequence);
    every other ps task is told it; the client then pushes under it, and its
    ``close()`` says ``Done``, which retires the id. (A ps task answers a
    ``Join`` sent again after a lost reply with the same id.)

    Returns:
        ``(worker id, ps task 0's global step)``.

    Raises:
        FailedPreconditionError: a ps task is not initialised, or not async.
        ResourceExhaustedError: a ps task admits no more elastic workers.
    """
    from towerflow.cluster.transport import unary
    from towerflow.ps.wire import ps_pb2 as pb
    from towerflow.ps.wire.calls import method_path
    from towerflow.ps.wire.messages import parse_message

    def join(shard: Any, worker_id: int, ticket: bytes = b"") -> Any:
        request = pb.JoinRequest(worker_id=worker_id, name=name, incarnation=client.incarnation,
                                 ticket=ticket)
        data = unary(shard.channel, method_path("Join"), request.SerializeToString(),
                     timeout=shard.timeout)
        return parse_message(pb.JoinReply, data, "JoinReply")

    first = join(client.shards[0], 0)
    for shard in client.shards[1:]:
        join(shard, first.worker_id, first.ticket)
    client.worker_id = int(first.worker_id)
    client.elastic_ticket = bytes(first.ticket)  # its Done carries it
    return client.worker_id, int(first.step)
