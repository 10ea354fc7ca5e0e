"""The one road from a program to its strategy: :func:`choose_strategy`.

Every caller (the :class:`~towerflow.training.Trainer`, the
:class:`~towerflow.training.Supervisor`, ``towerflow train`` and its
parameter-server tasks) asks this function, so they all agree. It looks, in
order, at:

1. an explicit strategy: a :class:`Strategy` is used as it is; a registry name
   (``"single"``, ``"mirrored"``, ``"ps"``) picks the class;
2. an explicit cluster: a running ``Server`` (its cluster, task and
   credentials), or ``cluster=`` and ``task=``;
3. the environment, through the cluster resolvers (``TF_CONFIG``, then
   torchrun's ``RANK`` / ``WORLD_SIZE``, then Slurm).

With no cluster the program trains on one device. A cluster with a ``ps``
job trains with the ``ParameterServer`` strategy; a cluster of several
training tasks and no ps with ``Mirrored`` (all-reduce); a cluster whose only
training task is this one with ``SingleDevice``. A task that does not train
(a ps or evaluator task) is refused, never trained locally.

Example:
    >>> choose_strategy(env={}).name
    'single'
    >>> from towerflow.cluster import ClusterSpec, TaskInfo
    >>> choose_kind(ClusterSpec({"ps": ["h:1"], "worker": ["h:2"]}), TaskInfo("worker", 0))
    'ps'
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping
from typing import Any

import torch

from towerflow.errors import InvalidArgumentError
from towerflow.strategies.base import Strategy, get_strategy_class

__all__ = ["choose_strategy", "choose_kind", "strategy_options"]

_TORCHRUN = ("RANK", "WORLD_SIZE")
#: what the chooser itself passes (the cluster, the task, the device, the environment)
_CHOSEN_HERE = frozenset({"cluster", "task", "device", "env"})


def choose_kind(cluster: Any, task: Any) -> str:
    """The registry name of the strategy that trains ``task`` of ``cluster`` (None: no cluster).

    Raises:
        InvalidArgumentError: ``task`` does not train in ``cluster``.
    """
    if cluster is None:
        return "single"
    cluster.replica_index(task)  # a ps / evaluator task is refused here
    if "ps" in cluster:
        return "ps"
    return "mirrored" if cluster.num_replicas > 1 else "single"


def strategy_options(kind: str) -> frozenset[str]:
    """Keyword options the strategy class registered as ``kind`` accepts."""
    params = inspect.signature(get_strategy_class(kind)).parameters
    return frozenset(name for name, p in params.items()
                     if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
                     and name not in _CHOSEN_HERE)


def _check_options(kind: str, options: Mapping[str, Any], why: str) -> None:
    unknown = sorted(set(options) - strategy_options(kind))
    if unknown:
        cls = get_strategy_class(kind).__name__
        raise InvalidArgumentError(
            f"option(s) {', '.join(f'{k}={options[k]!r}' for k in unknown)} do not apply: this "
            f"program trains with {cls} ({why}), which accepts "
            f"{', '.join(sorted(strategy_options(kind)))}. Remove them, or name a cluster "
            "whose strategy takes them (a 'ps' job for mode=, replicas_to_aggregate=...)."
        )


def _where(server: Any, cluster: Any, task: Any,
           env: Mapping[str, str]) -> tuple[Any, Any, Any, str]:
    """(cluster, task, credentials, why) from the explicit arguments, then the environment."""
    from towerflow.cluster import resolve_cluster

    if server is not None:
        return server.cluster, server.task, server.credentials, f"server {server.target}"
    if cluster is not None or task is not None:
        job = getattr(task, "job_name", None)
        index = getattr(task, "task_index", None)
        spec, me = resolve_cluster(cluster, job, index, env=env)
        if spec is not None and me is None:
            raise InvalidArgumentError(
                f"cluster {spec.as_dict()} was given without this process's task; pass "
                "task=TaskInfo(job, index) or set TF_CONFIG."
            )
        return spec, me, None, "the cluster given"
    spec, me = resolve_cluster(env=env)
    return spec, me, None, "the environment's cluster" if spec is not None else "no cluster"


def choose_strategy(strategy: Strategy | str | None = None, *, server: Any = None,
                    cluster: Any = None, task: Any = None,
                    device: str | torch.device | None = None, is_chief: bool | None = None,
                    env: Mapping[str, str] | None = None, **options: Any) -> Strategy:
    """The strategy that runs this process's training steps.

    Args:
        strategy: a :class:`Strategy` (returned as it is) or a registry name.
        server: this task's running ``towerflow.Server``: its cluster and task.
        cluster: a ``ClusterSpec`` (or its dict, or a JSON file path).
        task: this process's ``TaskInfo`` in ``cluster``.
        device: the device this process computes on (default: the strategy's).
        is_chief: whether this task initialises and saves, for the strategies that
            take it (``ParameterServer``); the others' chief is replica 0.
        env: the environment to read (default ``os.environ``).
        **options: keyword options of the chosen strategy class (e.g. ``mode``
            of ``ParameterServer``); one the class does not take is refused.

    Raises:
        InvalidArgumentError: this task does not train, an option does not
            apply to the chosen strategy, or the strategy name is unknown.
    """
    if isinstance(strategy, Strategy):
        if options or device is not None:
            raise InvalidArgumentError(
                f"{type(strategy).__name__} was given ready-made; pass its options to its "
                f"constructor, not here ({', '.join(sorted(options)) or 'device'})."
            )
        return strategy
    env = os.environ if env is None else env
    spec, me, credentials, why = _where(server, cluster, task, env)
    kind = strategy if strategy is not None else choose_kind(spec, me)
    get_strategy_class(kind)  # an unknown name is refused with the registry's sentence
    _check_options(kind, options, why)
    if is_chief is not None and "is_chief" in strategy_options(kind):
        options.setdefault("is_chief", is_chief)
    if kind == "ps":
        options.setdefault("server", server if server is not None else True)
        options.setdefault("credentials", credentials)
        return get_strategy_class(kind)(spec, me, device=device, **options)
    if kind == "mirrored":
        if spec is not None and not (server is None and cluster is None
                                     and all(name in env for name in _TORCHRUN)):
            options.update(cluster=spec, task=me)
        return get_strategy_class(kind)(device=device, env=env, **options)
    return get_strategy_class(kind)(device, **options)
