"""``SingleDevice``: one process, one device, a local ``torch.optim`` optimizer.

The simplest strategy and the base of :class:`~towerflow.strategies.mirrored.Mirrored`,
which only adds the process group and the ``DistributedDataParallel`` wrapper.

Example:
    >>> import torch
    >>> from towerflow.strategies.base import OptimizerConfig
    >>> strategy = SingleDevice("/cpu:0")
    >>> model = strategy.prepare(torch.nn.Linear(2, 1), OptimizerConfig(lr=0.1))
    >>> batch = (torch.ones(4, 2), torch.zeros(4, 1))
    >>> loss_fn = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])
    >>> strategy.run_step(loss_fn, batch).global_step
    1
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from towerflow.devices import compute_device, move_to_device
from towerflow.devices.transfer import inputs_follow
from towerflow.errors import FailedPreconditionError, InvalidArgumentError
from towerflow.ps.spec.dense import OPTIMIZER_NAMES, torch_optimizer_class
from towerflow.strategies.base import LossFn, OptimizerConfig, StepResult, Strategy

log = logging.getLogger("towerflow.training")

__all__ = ["SingleDevice", "LocalOptimizerStrategy", "load_ps_slots", "optimizer_slots"]


class LocalOptimizerStrategy(Strategy):
    """Shared machinery of strategies whose optimizer runs in this process.

    Subclasses choose the device and may wrap the model (:meth:`_wrap`); the
    step, the optimizer and the checkpoint state are the same for all of them.
    """

    def __init__(self) -> None:
        self._model: nn.Module | None = None
        self._train_model: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._lr_factors: list[float] = []
        self._step = 0
        self._follow: Any = None  # the model's hook moving its inputs to the device

    def _wrap(self, model: nn.Module) -> nn.Module:
        """The module the loss function calls (the model itself by default)."""
        return model

    def prepare(self, model: nn.Module,
                optimizer: OptimizerConfig | torch.optim.Optimizer) -> nn.Module:
        """Move ``model`` to :attr:`device`, wrap it and build the optimizer (a ``torch.optim``
        one is rebuilt from its settings, each parameter group's kept)."""
        from towerflow.strategies.optim import as_optimizer_config

        if not isinstance(model, nn.Module):
            raise InvalidArgumentError(
                f"prepare() needs a torch.nn.Module, got {type(model).__name__}."
            )
        config = as_optimizer_config(optimizer, model)
        model.to(self.device)
        if self._follow is not None:
            self._follow.remove()
        self._follow = inputs_follow(model, self.device)  # a program's own model(x) too
        self._model = model
        self._train_model = self._wrap(model)
        self._optimizer = config.build_named(model.named_parameters())
        #: each group's learning rate over the base one: a schedule's rate scales them all
        self._lr_factors = [group["lr"] / config.lr for group in self._optimizer.param_groups]
        return self._train_model

    @property
    def model(self) -> nn.Module:
        """The user's (unwrapped) model on :attr:`device`."""
        return self._prepared()[0]

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The local optimizer built by :meth:`prepare`."""
        return self._prepared()[1]

    def _prepared(self) -> tuple[nn.Module, torch.optim.Optimizer]:
        if self._model is None or self._optimizer is None:
            raise FailedPreconditionError(
                f"{type(self).__name__} has no model yet; call prepare(model, optimizer) first."
            )
        return self._model, self._optimizer

    def run_step(self, loss_fn: LossFn, batch: Any, *, lr: float | None = None) -> StepResult:
        """Forward, backward and one optimizer update; the loss stays on the device.

        ``batch`` is handed to ``loss_fn`` on :attr:`device` (its tensors moved there,
        :func:`~towerflow.devices.move_to_device`)."""
        _, optimizer = self._prepared()
        if lr is not None:
            for group, factor in zip(optimizer.param_groups, self._lr_factors, strict=True):
                group["lr"] = lr * factor
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(self._train_model, move_to_device(batch, self.device))
        loss.backward()
        if torch.sparse.check_sparse_tensor_invariants.is_enabled():  # the user's choice
            optimizer.step()
        else:  # the sparse rows torch's optimizers build are valid by construction: say so
            with torch.sparse.check_sparse_tensor_invariants(enable=False):
                optimizer.step()
        self._step += 1
        return StepResult(loss=loss.detach(), global_step=self._step)

    @property
    def global_step(self) -> int:
        return self._step

    def shutdown(self) -> None:
        """Take this strategy's hook off the model."""
        follow, self._follow = self._follow, None
        if follow is not None:
            follow.remove()

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        model, optimizer = self._prepared()
        from towerflow.checkpoint import flatten_state

        tensors, _ = flatten_state(optimizer.state_dict())
        return {"model": dict(model.state_dict()), "optimizer": tensors}

    def state_metadata(self) -> dict[str, Any]:
        _, optimizer = self._prepared()
        from towerflow.checkpoint import flatten_state

        _, layout = flatten_state(optimizer.state_dict())
        names = {id(p): n for n, p in self._prepared()[0].named_parameters()}
        # which parameter each optimizer state is, so that a ps run can take it over
        groups = [[names.get(id(p), "") for p in g["params"]] for g in optimizer.param_groups]
        return {"global_step": self._step, "optimizer": layout, "optimizer_params": groups}

    def load_state_dict(self, groups: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Restore the model only (the optimizer state needs :meth:`load_state`)."""
        self.load_state(groups, None)

    def load_state(
        self, groups: Mapping[str, Mapping[str, torch.Tensor]],
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        """Restore parameters, optimizer state and the step from any device."""
        model, optimizer = self._prepared()
        from towerflow.checkpoint import load_into_module, unflatten_state

        if "model" not in groups:
            raise InvalidArgumentError(
                f"The checkpoint has no 'model' group (groups: {sorted(groups)}); "
                "restore a checkpoint written by a towerflow trainer."
            )
        metadata = metadata or {}
        # a ps run's tables, saved as parts of rows: here plain weights of the model
        from towerflow.strategies.ps_tables import table_weights

        table_slots: dict[str, torch.Tensor] = {}
        load_into_module(model, {**groups["model"], **table_weights(
            groups, metadata, model, "the checkpoint", slots=table_slots)})
        layout = metadata.get("optimizer")
        if isinstance(layout, str):  # a parameter server's: its slots by variable
            load_ps_slots(model, optimizer, layout, {**groups.get("optimizer", {}), **table_slots},
                           int(metadata.get("optimizer_step", metadata.get("global_step", 0))))
        elif layout is not None:
            # own copies: torch keeps the given tensors when device and dtype already match
            tensors = {k: v.clone() for k, v in groups.get("optimizer", {}).items()}
            optimizer.load_state_dict(unflatten_state(tensors, layout))
        if "global_step" in metadata:
            self._step = int(metadata["global_step"])


class SingleDevice(LocalOptimizerStrategy):
    """Train on one device of this process.

    Args:
        device: ``"/gpu:0"``, ``"/cpu:0"``, ``"cuda:1"``, a ``torch.device`` or
            None for the default device (``TOWERFLOW_DEVICE`` when set, else the
            lowest-numbered GPU when there is one, else the CPU:
            :func:`~towerflow.devices.compute_device`).
    """

    name = "single"

    def __init__(self, device: str | torch.device | None = None) -> None:
        super().__init__()
        self._device = compute_device(device)

    @property
    def device(self) -> torch.device:
        return self._device

    def __repr__(self) -> str:
        return f"SingleDevice(device={str(self._device)!r})"


def load_ps_slots(model: nn.Module, optimizer: torch.optim.Optimizer, name: str,
                   slots: Mapping[str, torch.Tensor], step: int) -> None:
    """A ps checkpoint's optimizer state (``<variable>/<slot>``, one tensor each, the
    slots named as torch.optim names them) as this optimizer's per-parameter state.

    A checkpoint of another kind of optimizer leaves this one's state fresh (and says so).

    Raises:
        InvalidArgumentError: a slot of a trained parameter is missing or of another shape.
    """
    if name not in OPTIMIZER_NAMES or not isinstance(optimizer, torch_optimizer_class(name)):
        log.warning("the checkpoint's optimizer state is %s's (trained on a parameter server) and "
                    "this run's optimizer is %s: it starts afresh", name,
                    type(optimizer).__name__)
        return
    kinds = {key.rpartition("/")[2] for key in slots}
    for pname, param in model.named_parameters():
        if not param.requires_grad or not kinds:
            continue
        state: dict[str, torch.Tensor] = {}
        for kind in sorted(kinds):
            value = slots.get(f"{pname}/{kind}")
            if value is None or tuple(value.shape) != tuple(param.shape):
                raise InvalidArgumentError(
                    f"The checkpoint's optimizer slot {pname}/{kind} is "
                    f"{'missing' if value is None else tuple(value.shape)}, not "
                    f"{tuple(param.shape)}; resume with the model it was trained with.")
            state[kind] = value.detach().to(param.device, param.dtype).clone()
        if not isinstance(optimizer, torch.optim.SGD):
            state["step"] = torch.tensor(float(step))
        optimizer.state[param] = state


def local_optimizer_slots(model: nn.Module, config: Any, groups: Mapping[str, Any],
                          metadata: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], int]:
    """A one-process (or replicas') checkpoint's optimizer state in a parameter server's
    form: ``{"<variable>/<slot>": tensor}`` and the optimizer's step.

    The state is read into an optimizer of ``config``'s kind built as the run that wrote
    it built its own: the parameter groups its metadata names (``optimizer_params``;
    placeholders of the checkpoint's shapes), else ``model``'s parameters as ``config``
    groups them, so that each state belongs to its parameter's name. A checkpoint whose
    groups cannot be told apart gives no state (the ps starts its slots afresh, and says so).
    """
    from towerflow.checkpoint import unflatten_state

    params = groups.get("model", {})
    recorded = metadata.get("optimizer_params")
    if isinstance(recorded, list) and all(isinstance(g, list) and all(
            isinstance(n, str) and n in params for n in g) for g in recorded):
        named = [[(n, nn.Parameter(torch.empty(params[n].shape))) for n in g] for g in recorded]
        optimizer = config.build([{"params": [p for _, p in g]} for g in named if g])
        names = {id(p): n for g in named for n, p in g}
    else:
        optimizer = config.build_named(model.named_parameters())
        names = {id(p): n for n, p in model.named_parameters()}
    try:
        optimizer.load_state_dict(unflatten_state(
            {k: v.clone() for k, v in groups.get("optimizer", {}).items()},
            metadata["optimizer"]))
    except (ValueError, KeyError) as exc:
        log.warning("the checkpoint's optimizer state does not fit this model's parameter groups "
                    "(%s): the ps tasks start the optimizer afresh", exc)
        return {}, 0
    return optimizer_slots(optimizer, names)


def optimizer_slots(optimizer: torch.optim.Optimizer, names: Mapping[int, str]
                    ) -> tuple[dict[str, torch.Tensor], int]:
    """``optimizer``'s per-parameter state in a parameter server's form,
    ``{"<variable>/<slot>": tensor}`` (``names``: ``id(param) -> name``), and its step."""
    slots, step = {}, 0
    for param, state in optimizer.state.items():
        for kind, value in state.items():
            if kind == "step":
                step = max(step, int(value))
            elif isinstance(value, torch.Tensor) and value.shape == param.shape:
                slots[f"{names[id(param)]}/{kind}"] = value.detach().cpu()
    return slots, step


def as_ps_optimizer_state(model: nn.Module, config: Any, groups: Mapping[str, Any],
                          metadata: dict[str, Any]) -> tuple[Mapping[str, Any], dict[str, Any]]:
    """``(groups, metadata)`` of a checkpoint with its optimizer state in a parameter
    server's form (:func:`local_optimizer_slots`) when one process or replicas wrote it;
    as they are when a ps did."""
    if not isinstance(metadata.get("optimizer"), Mapping):
        return groups, metadata
    slots, step = local_optimizer_slots(model, config, groups, metadata)
    # torch's SGD keeps no step: its momentum was applied once a global step
    return {**groups, "optimizer": slots}, {
        **metadata, "optimizer": config.name,
        "optimizer_step": step or int(metadata.get("global_step", 0))}
