"""The dense half of hybrid training: every worker's replica of the dense layers.

Each worker keeps the model's dense parameters and the user's ``torch.optim``
optimizer (built from the same settings on every worker). Their gradients are
views into one flat buffer (as ``DistributedDataParallel``'s
``gradient_as_bucket_view``), so a step's all-reduce is one
``torch.distributed.all_reduce`` of that buffer with no gather and no copy back;
three more elements travel in it: how many workers found a NaN / inf in their
tables' row gradients, how many asked to stop (the stop vote of lockstep
training, read one step later), and whether the chief paused the step.

A checkpoint consistent at one global step: between steps ``s`` and ``s + 1`` the
chief joins the others' all-reduce of step ``s + 1`` with zeros and its pause flag
(:meth:`DenseReplica.pause`); each of them keeps the sum it received (the others'
gradients), waits until its pushes are applied and the chief says go, and takes
the all-reduce again, where only the chief's gradients are added. Every worker
then holds the same sum (the others' plus the chief's), so the step is as without
the pause, and no push of step ``s + 1`` reached the ps tasks while the chief read
them. It costs nothing when no checkpoint is taken.

Every worker receives the same reduced buffer, divides it by the same world size and
applies the same optimizer to the same state, so the dense parameters stay bit for
bit equal on every worker (``tests/strategies/test_hybrid.py`` checks it).
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["DenseReplica", "Reduced", "sum_within", "timedelta_of", "worker_device"]

log = logging.getLogger("towerflow.ps")


#: the flags after the gradients: bad tables, stop votes, the chief's pause
_FLAGS = 3


@dataclass(frozen=True)
class Reduced:
    """What a step's all-reduce said besides the averaged gradients."""

    bad_tables: int  # workers whose tables' row gradients held NaN / inf
    stop_votes: int  # workers that asked to stop (their vote of the step before)


class DenseReplica:
    """A worker's dense parameters, their flat gradient buffer and its local optimizer.

    Args:
        model: the model (its tables already swapped for ``ShardedEmbedding`` modules,
            whose rows are not parameters).
        optimizer: the local ``torch.optim`` optimizer over the model's parameters.
        lr: the optimizer's base learning rate (a schedule's rate scales every group).
        device: where the parameters (and so the buffer) are.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, lr: float,
                 device: torch.device) -> None:
        self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.optimizer = optimizer
        self._factors = [group["lr"] / lr for group in optimizer.param_groups]
        self.numel = sum(p.numel() for _, p in self.params)
        self.flat = torch.zeros(self.numel + _FLAGS, dtype=torch.float32, device=device)
        self._kept: torch.Tensor | None = None  # the chief: the others' sum of a paused step
        self._bind()

    def _bind(self) -> None:
        """Make every parameter's ``.grad`` a view into :attr:`flat` (autograd adds into it)."""
        offset = 0
        for _, param in self.params:
            size = param.numel()
            param.grad = self.flat[offset:offset + size].view_as(param)
            offset += size

    def zero_grads(self) -> None:
        """Zero the buffer; a parameter whose ``.grad`` was replaced is bound again."""
        self.flat.zero_()
        if any(param.grad is None or param.grad.data_ptr() != view.data_ptr()
               for (_, param), view in zip(self.params, self._views(), strict=True)):
            self._bind()

    def _views(self) -> Iterator[torch.Tensor]:
        offset = 0
        for _, param in self.params:
            size = param.numel()
            yield self.flat[offset:offset + size]
            offset += size

    def all_reduce(self, *, bad_tables: bool, stop_vote: bool, world: int,
                   paused: Callable[[], None], timeout: Any = None, group: Any = None) -> Reduced:
        """Average the gradients over the ``world`` workers (one collective, waited for at
        most ``timeout``, a ``timedelta``; None: the group's) and count the flags; a sparse
        gradient (an embedding kept dense with ``sparse=True``) is made dense in the buffer
        first. A step the chief paused runs ``paused()`` and the collective again (see the
        module's docstring)."""
        for (_, param), view in zip(self.params, self._views(), strict=True):
            grad = param.grad
            if grad is not None and grad.is_sparse:
                view.copy_(grad.to_dense().reshape(-1))
                param.grad = view.view_as(param)
        flags = self.flat[self.numel:]
        flags[0], flags[1], flags[2] = float(bad_tables), float(stop_vote), 0.0
        sum_within(self.flat, timeout, group)
        kept, self._kept = self._kept, None
        if kept is None and bool(flags[2] > 0):  # the chief paused this step: the others' sum
            kept = self.flat.clone()
            self.flat.zero_()
            paused()
            sum_within(self.flat, timeout, group)  # the chief's gradients, added to it
        if kept is not None:
            self.flat.add_(kept)
        counts = flags.tolist()
        if world > 1:
            self.flat[:self.numel].div_(world)
        return Reduced(round(counts[0]), round(counts[1]))

    def pause(self, timeout: Any = None, group: Any = None) -> None:
        """(The chief, between two steps) join the others' all-reduce of the next step with
        zeros and the pause flag; keep what they sent for this worker's next step."""
        self._kept = torch.zeros_like(self.flat)
        self._kept[self.numel + 2] = 1.0
        sum_within(self._kept, timeout, group)

    def nonfinite(self) -> str | None:
        """The name of a parameter whose averaged gradient holds NaN / inf, or None (one
        reduction when every value is finite)."""
        if bool(torch.isfinite(self.flat[:self.numel].sum())):
            return None
        for (name, _), view in zip(self.params, self._views(), strict=True):
            if not bool(torch.isfinite(view).all()):
                return name
        return None

    def step(self, lr: float | None) -> None:
        """One local optimizer update (``lr``: a schedule's rate for this step)."""
        if lr is not None:
            for group, factor in zip(self.optimizer.param_groups, self._factors, strict=True):
                group["lr"] = lr * factor
        self.optimizer.step()

    def broadcast(self, model: nn.Module, step: int, device: torch.device,
                  group: Any = None) -> int:
        """Give every worker worker 0's parameters, buffers and step; return the step."""
        shared = torch.tensor([step], dtype=torch.int64, device=device)
        with torch.no_grad():
            dist.broadcast(shared, 0, group=group)
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor.data, 0, group=group)
        return int(shared.item())


def sum_within(tensor: torch.Tensor, timeout: Any, group: Any) -> None:
    """``tensor`` summed over the group in place, waited for at most ``timeout`` (a stalled
    worker fails the step then: ``RuntimeError``)."""
    work = dist.all_reduce(tensor, group=group, async_op=True)
    if timeout is None:
        work.wait()
    else:
        work.wait(timeout=timeout)


def worker_device(local: int, here: int, named: torch.device | None, gpus: int,
                  backend: str | None) -> tuple[torch.device, str]:
    """The device and collective backend of the worker ``local`` of the ``here`` workers
    of its machine, which has ``gpus`` GPUs: the device named, else GPU ``local % gpus``
    (the CPU without GPUs); NCCL when each worker of the machine has a GPU of its own,
    else Gloo (NCCL runs one rank per GPU), said in one line by the machine's first worker.

    Example:
        >>> worker_device(1, 2, None, 2, None)
        (device(type='cuda', index=1), 'nccl')
        >>> worker_device(1, 2, None, 1, None)[1]
        'gloo'
        >>> worker_device(0, 2, None, 0, None)
        (device(type='cpu'), 'gloo')
    """
    device = named if named is not None else (
        torch.device("cuda", local % gpus) if gpus else torch.device("cpu"))
    if backend is None:
        backend = "nccl" if device.type == "cuda" and here <= gpus else "gloo"
        if device.type == "cuda" and backend == "gloo" and local == 0:
            log.warning("%d workers share %d GPU(s) on this machine (NCCL runs one rank per "
                        "GPU): their dense all-reduce runs over Gloo; start at most %d worker(s) "
                        "per machine for NCCL.", here, gpus, gpus)
    return device, backend


def timedelta_of(seconds: float) -> datetime.timedelta:
    """``seconds`` as the ``timedelta`` torch.distributed takes."""
    return datetime.timedelta(seconds=seconds)
