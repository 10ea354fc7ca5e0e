"""Where a ``ParameterServer`` model's dense variables live on the ps tasks."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from towerflow.errors import InvalidArgumentError

__all__ = ["check_dense_mode", "check_replicas", "check_trainable", "DenseModes",
           "plan_variables"]

#: where a ParameterServer's dense layers train: the class that trains them there
DENSE_MODES = {"ps": None, "allreduce": "towerflow.strategies.hybrid:HybridParameterServer"}


def check_replicas(replicas: Any, num_ps: int) -> int:
    """The live copies of each ps shard that ``replicas`` asks, checked against the job.

    A shard's copies live on other ps tasks (shard ``i``'s on ps task ``(i + 1) % n``),
    so ``replicas`` is below the number of ps tasks; one copy per shard, of the dense
    and table shards, fixed or dynamic (async, sync or ssp), is built so far.

    Example:
        >>> check_replicas(1, 2), check_replicas(0, 1)
        (1, 0)
    """
    if isinstance(replicas, bool) or not isinstance(replicas, int) or \
            not 0 <= replicas < max(num_ps, 1):
        raise InvalidArgumentError(
            f"replicas={replicas!r} with {num_ps} ps task(s): a shard's live copies live on "
            f"other ps tasks, so replicas is an integer from 0 to {max(num_ps - 1, 0)}. Use "
            "replicas=0 (no copy), or start at least 2 ps tasks for replicas=1 "
            "(--ps-replicas, run.yaml's ps_replicas).")
    if replicas > 1:
        raise InvalidArgumentError(
            f"replicas={replicas}: one live copy per shard is built so far; use replicas=1 "
            "or 0.")
    return replicas


def check_dense_mode(dense: str, staleness: int | None, backend: str | None, *,
                     mode: str = "async", join: bool = False, prefetch: bool = False
                     ) -> tuple[int, str | None]:
    """``(embedding_staleness, backend)`` of a ``ParameterServer`` whose dense layers train
    on ``dense``; the hybrid options are refused with ``dense="ps"``, and what hybrid
    training cannot do (a ``sync`` / ``ssp`` mode, an elastic worker, a dense prefetch)
    with ``dense="allreduce"``.

    Example:
        >>> check_dense_mode("allreduce", None, None)
        (0, None)
    """
    if dense not in DENSE_MODES:
        raise InvalidArgumentError(
            f"dense={dense!r}; use 'ps' (the dense layers on the ps tasks) or 'allreduce' "
            "(hybrid: the tables on the ps tasks, the dense layers all-reduced among the "
            "workers).")
    if dense == "ps":
        given = [f"{k}={v!r}" for k, v in (("embedding_staleness", staleness),
                                           ("backend", backend)) if v is not None]
        if given:
            raise InvalidArgumentError(
                f"{', '.join(given)} applies to hybrid training only; add dense='allreduce' "
                "(--dense allreduce) or remove it.")
        return 0, None
    if mode != "async":
        raise InvalidArgumentError(
            f"dense='allreduce' with mode={mode!r}: the dense layers are already averaged "
            "synchronously by all-reduce among the workers, and the tables are updated "
            "asynchronously (bounded by embedding_staleness). Drop the mode (--mode "
            f"{mode}), or train everything through the ps tasks with dense='ps' for "
            f"{mode} tables.")
    for name, given, why in (("join", join, "an elastic worker cannot join an all-reduce group"),
                             ("prefetch", prefetch, "the dense step is an all-reduce, not a push")):
        if given:
            raise InvalidArgumentError(
                f"dense='allreduce' with {name}=True: {why}. Remove it, or train with "
                "dense='ps'.")
    if staleness is not None and (isinstance(staleness, bool) or not isinstance(staleness, int)
                                  or staleness < 0):
        raise InvalidArgumentError(
            f"embedding_staleness={staleness!r} must be a whole number >= 0: how many of a "
            "worker's own steps its pulled rows may lag its pushes (0: none).")
    return staleness or 0, backend


class DenseModes:
    """A ``ParameterServer(dense="allreduce")`` call makes the hybrid strategy, its subclass
    (imported by name; the signature callers see stays ``ParameterServer.__init__``'s)."""

    def __new__(cls, *args: Any, dense: str = "ps", **options: Any) -> Any:
        import importlib

        target = DENSE_MODES.get(dense) if isinstance(dense, str) else None
        if target is not None and cls.__name__ == "ParameterServer":
            module, _, name = target.partition(":")
            cls = getattr(importlib.import_module(module), name)
        return super().__new__(cls)


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
