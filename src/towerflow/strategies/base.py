"""The strategy contract: one class per way to run a training step.

A strategy owns *where* a step runs and *how* gradients become parameter
updates; the training loop (``towerflow.training``) owns *when* (logging,
summaries, checkpoints, schedules). Every strategy has the same small
contract, so no code outside this package branches on the strategy's kind:

==================  ===========================================================
``SingleDevice``    one process, one device, a local optimizer
``Mirrored``        one process per device, ``DistributedDataParallel``
                    (NCCL on GPUs, Gloo on CPUs) averages the gradients
``ParameterServer`` parameters and optimizer state live on ps tasks; workers
                    pull parameters, compute gradients, push them
==================  ===========================================================

Usage from a training loop::

    strategy = SingleDevice("/cpu:0")
    model = strategy.prepare(model, OptimizerConfig(name="sgd", lr=0.1))
    for batch in strategy.shard(loader):
        result = strategy.run_step(loss_fn, batch, lr=schedule(step))
    strategy.shutdown()

The registry at the bottom maps a strategy name to its class, imported lazily
(like ``torch.distributed.elastic.rendezvous``'s handler registry).
"""

from __future__ import annotations

import abc
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from towerflow.errors import InvalidArgumentError
from towerflow.ps.spec.dense import check_optimizer_name

__all__ = [
    "GROUP_SETTINGS",
    "OptimizerConfig",
    "StepResult",
    "Strategy",
    "LossFn",
    "get_strategy_class",
    "STRATEGIES",
]

#: ``loss_fn(model, batch) -> scalar loss tensor`` (on the strategy's device).
LossFn = Callable[[nn.Module, Any], torch.Tensor]

#: the hyper-parameters a parameter group may set (``OptimizerConfig.param_settings``)
GROUP_SETTINGS = ("lr", "momentum", "weight_decay", "betas", "eps", "initial_accumulator_value")


@dataclass(frozen=True)
class OptimizerConfig:
    """A declarative optimizer, so that a ps task can apply it server-side.

    Strategies also take a ``torch.optim`` SGD, Adagrad or Adam instance
    (:func:`towerflow.strategies.optim.as_optimizer_config`): its parameter
    groups become :attr:`param_settings`.

    Attributes:
        name: one of ``sgd``, ``momentum``, ``adam``, ``adagrad``.
        lr: the base learning rate (a schedule may pass another per step).
        momentum: for ``momentum`` (and ``sgd`` when non-zero).
        weight_decay: L2 penalty added to the gradient.
        betas, eps: for ``adam``; ``eps`` and ``initial_accumulator_value``
            for ``adagrad``.
        param_settings: per parameter (its ``named_parameters()`` name), the
            settings of :data:`GROUP_SETTINGS` that differ from the ones above,
            as a parameter group of ``torch.optim`` gives them. A schedule
            scales each parameter's ``lr`` by the same factor as the base one.

    Example:
        >>> config = OptimizerConfig("adagrad", lr=0.01, param_settings={"emb.weight":
        ...                                                              {"lr": 0.05}})
        >>> config.lr_factor("emb.weight"), config.lr_factor("mlp.weight")
        (5.0, 1.0)
    """

    name: str = "sgd"
    lr: float = 0.1
    momentum: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    initial_accumulator_value: float = 0.1
    extra: Mapping[str, float] = field(default_factory=dict)
    param_settings: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_optimizer_name(self.name)
        if not self.lr > 0:
            raise InvalidArgumentError(
                f"Learning rate must be positive, got {self.lr!r}; pass lr > 0."
            )
        for param, settings in self.param_settings.items():
            unknown = sorted(set(settings) - set(GROUP_SETTINGS))
            if unknown:
                raise InvalidArgumentError(
                    f"param_settings[{param!r}] sets {unknown}; a parameter group may set "
                    f"{', '.join(GROUP_SETTINGS)}.")
            if "lr" in settings and not settings["lr"] > 0:
                raise InvalidArgumentError(
                    f"The learning rate of parameter {param!r} must be positive, got "
                    f"{settings['lr']!r}; give its group lr > 0.")

    def settings_of(self, param: str) -> dict[str, Any]:
        """Every setting of :data:`GROUP_SETTINGS` that parameter ``param`` trains with."""
        return {**{key: getattr(self, key) for key in GROUP_SETTINGS},
                **self.param_settings.get(param, {})}

    def lr_factor(self, param: str) -> float:
        """``param``'s learning rate over the base :attr:`lr` (what a schedule scales)."""
        return float(self.param_settings.get(param, {}).get("lr", self.lr)) / self.lr

    def build(self, params: Any) -> torch.optim.Optimizer:
        """Return the equivalent local ``torch.optim`` optimizer over ``params`` (tensors or
        parameter groups)."""
        if self.name in ("sgd", "momentum"):
            return torch.optim.SGD(
                params, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay
            )
        if self.name == "adam":
            return torch.optim.Adam(
                params, lr=self.lr, betas=self.betas, eps=self.eps,
                weight_decay=self.weight_decay,
            )
        return torch.optim.Adagrad(
            params, lr=self.lr, eps=self.eps, weight_decay=self.weight_decay,
            initial_accumulator_value=self.initial_accumulator_value,
        )

    def build_named(self, named_params: Any) -> torch.optim.Optimizer:
        """:meth:`build` over ``(name, parameter)`` pairs, one parameter group per distinct
        :attr:`param_settings` (the base settings' group first)."""
        groups: dict[tuple[tuple[str, Any], ...], list[nn.Parameter]] = {(): []}
        for name, param in named_params:
            key = tuple(sorted(self.param_settings.get(name, {}).items()))
            groups.setdefault(key, []).append(param)
        return self.build([{"params": params, **dict(key)} for key, params in groups.items()
                           if params])


@dataclass
class StepResult:
    """What one step returns.

    Attributes:
        loss: the step's loss, detached, still on the device (reading it
            synchronises the host, so the loop reads it only when it logs).
        global_step: the global step after this update (for a parameter
            server in async mode, not consecutive between calls).
        applied: False when the update was dropped (a stale gradient in sync
            mode, a refused gradient with the ``skip`` policy).
        stopped: the run's last steps (:meth:`Strategy.stop_at`) were other
            workers' pushes: this step was not pushed, and this worker's training
            ends here.
    """

    loss: torch.Tensor
    global_step: int
    applied: bool = True
    stopped: bool = False


class Strategy(abc.ABC):
    """Runs training steps of one model on one or more devices or tasks."""

    #: registry name, e.g. ``"mirrored"``
    name: str = ""

    @property
    @abc.abstractmethod
    def device(self) -> torch.device:
        """The device this process computes on."""

    @property
    def rank(self) -> int:
        """This replica's index among ``world_size`` (data sharding uses it)."""
        return 0

    @property
    def world_size(self) -> int:
        """Number of replicas computing gradients."""
        return 1

    @property
    def batches_per_step(self) -> int:
        """Replica batches one global step consumes (examples/sec and epochs count with it).

        Every replica's in synchronous all-reduce training: ``world_size``.
        """
        return self.world_size

    @property
    def is_chief(self) -> bool:
        """True in the one process that writes checkpoints and summaries."""
        return self.rank == 0

    @abc.abstractmethod
    def prepare(self, model: nn.Module,
                optimizer: OptimizerConfig | torch.optim.Optimizer) -> nn.Module:
        """Place ``model`` and set up the optimizer (an :class:`OptimizerConfig`, or a
        ``torch.optim`` SGD / Adagrad / Adam over ``model``'s parameters); return the model
        to call."""

    @abc.abstractmethod
    def run_step(self, loss_fn: LossFn, batch: Any, *, lr: float | None = None) -> StepResult:
        """Compute the loss of ``batch``, its gradients, and apply one update."""

    @property
    def reads_ahead(self) -> bool:
        """Whether this strategy uses the next step's batch before this step runs
        (:meth:`ahead`); the ``Trainer`` then reads one batch ahead."""
        return False

    def ahead(self, batch: Any) -> None:
        """``batch`` is the next step's (called before this step's :meth:`run_step`): a
        strategy that pulls rows from ps tasks pulls its rows while this step runs."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """Tensors to checkpoint, by group (``model``, ``optimizer``, ...)."""

    @abc.abstractmethod
    def load_state_dict(self, groups: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Restore what :meth:`state_dict` returned (tensors on any device)."""

    def state_metadata(self) -> dict[str, Any]:
        """JSON-able facts a checkpoint stores next to :meth:`state_dict`.

        For example the layout of a flattened optimizer state. Empty by default.
        """
        return {}

    def load_state(
        self, groups: Mapping[str, Mapping[str, torch.Tensor]],
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        """Restore tensors together with what :meth:`state_metadata` returned.

        The default ignores ``metadata`` and calls :meth:`load_state_dict`.
        """
        self.load_state_dict(groups)

    def restore_checkpoint(self, read: Callable[[], Any]) -> Any:
        """The checkpoint this replica restores; ``read()`` reads the train dir's latest.

        The default reads it here. A strategy whose replicas hold the same
        state may have one replica read it and hand it to the others, so that
        they need no shared file system. Returns a ``Checkpoint`` or None.
        """
        return read()

    def broadcast_model(self) -> None:
        """Give every replica replica 0's parameters and buffers (no-op in one process).

        Called by every replica together when a session starts with no
        checkpoint, after the chief's ``init_fn`` changed its own model.
        """

    def reduce_mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of ``value`` over the replicas (``value`` itself in one process).

        The loop calls it only on log and checkpoint steps, so that every
        replica logs the same loss and stops together on a NaN.
        """
        return value

    def settle(self) -> None:
        """Make the model hold every update this process has sent (no-op where a step's
        update is in the model when :meth:`run_step` returns).

        A ``ParameterServer`` worker may send a step's dense push with the next step's
        table pull: until then its model lags its own last update by one step. Its
        ``model.state_dict()``, :meth:`state_dict`, :attr:`global_step`, the end of a
        ``Trainer`` or ``Supervisor`` loop, their summaries, moving averages and
        exports settle first; a program that reads the parameters themselves between
        steps calls this.
        """

    def check_restored_step(self, step: int) -> None:
        """Raise when the replicas restored different steps (no-op in one process)."""

    @property
    def global_step(self) -> int:
        """The number of updates applied so far (shared across replicas)."""
        return 0

    def barrier(self) -> None:
        """Wait for every replica (no-op for a single process)."""

    def wait_for_peers(self, timeout: float) -> bool:
        """Before the chief's final checkpoint: wait (bounded) for peers whose updates it
        must hold; True when it waited. No-op (False) where replicas step together."""
        return False

    #: replicas step together (all-reduce): a stop must be agreed (:meth:`agree_to_stop`)
    lockstep: bool = False

    def stop_at(self, last_step: int | None) -> None:
        """End training at global step ``last_step`` (None: no end): the training loop
        says it before its first step. Synchronous strategies count one step per update
        and stop there already; an asynchronous ps worker sends no push past it."""

    def agree_to_stop(self, requested: bool) -> bool:
        """Whether training stops after this step, ``requested`` being this replica's wish.

        Called by every replica once per step. Replicas that step together
        (all-reduce) must stop at the same step; here (one process, or a ps
        task's worker, which stops alone) the wish itself.
        """
        return requested

    def end_training(self, *, finished: bool, checkpoint_step: int | None = None,
                     error: BaseException | None = None) -> None:
        """How this replica's training ended, for what :meth:`shutdown` tells its peers.

        The Supervisor and the Trainer call it when training stops. Args:
        ``finished``: False when it stopped on an error (its peers must not
        count it as finished); ``checkpoint_step``: the global step of the final
        checkpoint this task wrote, if any; ``error``: what it stopped on (a
        chief that fails before initialising a cluster tells its peers). No-op
        by default.
        """

    def shutdown(self) -> None:
        """Release process groups, channels and threads. Idempotent."""


#: strategy name -> "module:Class", imported on first use
STRATEGIES: dict[str, str] = {
    "single": "towerflow.strategies.single:SingleDevice",
    "mirrored": "towerflow.strategies.mirrored:Mirrored",
    "ps": "towerflow.strategies.parameter_server:ParameterServer",
}


def get_strategy_class(name: str) -> type[Strategy]:
    """Return the strategy class registered under ``name``.

    Example:
        >>> get_strategy_class("single").__name__
        'SingleDevice'
    """
    target = STRATEGIES.get(name)
    if target is None:
        raise InvalidArgumentError(
            f"Unknown strategy {name!r}; use one of {', '.join(sorted(STRATEGIES))}."
        )
    module_name, _, cls_name = target.partition(":")
    return getattr(importlib.import_module(module_name), cls_name)
