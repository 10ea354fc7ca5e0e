"""Where a ``ParameterServer`` model's dense variables live on the ps tasks."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from towerflow.errors import InvalidArgumentError

__all__ = ["check_trainable", "plan_variables"]


def check_trainable(params: list[tuple[str, nn.Parameter]], *, elastic: bool,
                    tables: bool) -> None:
    """Refuse what the ps cannot hold: parameters other than float32, and sparse tables in
    an elastic worker's model (their shards count the cluster's replicas alone)."""
    if elastic and tables:
        raise InvalidArgumentError(
            "An elastic worker (join=True) trains dense models only: this model has sparse "
            "tables on the ps tasks, whose shards count the cluster's replicas alone. Add "
            "the worker to the cluster as a task instead (or, in a job whose every "
            "worker keeps its embeddings dense, pass sparse_threshold_bytes=None).")
    wrong = [f"{n} ({p.dtype})" for n, p in params if p.requires_grad and p.dtype != torch.float32]
    if wrong:
        raise InvalidArgumentError(
            f"The parameter server keeps float32 parameters; {', '.join(wrong)} are not. "
            "Call model.float() first (use autocast for lower precision compute).")


def plan_variables(params: list[tuple[str, nn.Parameter]], model: nn.Module, num_ps: int, *,
                   setter: Any, ps_strategy: str | None, threshold: int | None) -> Any:
    """The ``Placement`` of ``params``: as the model was built (under a setter scope), else
    as the ``setter`` (a ``replica_device_setter`` result) places them, else by
    ``ps_strategy`` with variables over ``threshold`` bytes split."""
    from towerflow.devices import parameter_placements
    from towerflow.ps.placement import placement_from_tasks, plan_placement

    shapes = [(n, tuple(p.shape)) for n, p in params]
    built = parameter_placements(model)
    if built:
        source = next(iter(built.values())).source
        threshold = getattr(source, "partition_threshold_bytes", threshold)
        tasks = {n: p.spec.task for n, p in built.items() if p.spec.job == "ps"}
        return placement_from_tasks(shapes, tasks, num_ps, partition_threshold_bytes=threshold)
    if setter is not None and setter.num_ps == num_ps:
        return setter.place(shapes)
    return plan_placement(shapes, num_ps, strategy=ps_strategy,
                          partition_threshold_bytes=threshold)
