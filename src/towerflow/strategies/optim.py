"""A ``torch.optim`` optimizer as towerflow's declarative :class:`OptimizerConfig`.

A PyTorch user builds ``torch.optim.Adagrad([{"params": model.emb.parameters(), "lr":
0.05}, {"params": model.mlp.parameters(), "lr": 0.01}], lr=0.01)``. Every strategy
takes it where it takes an :class:`OptimizerConfig`: the class becomes the
config's ``name``, its defaults the base settings, and each parameter group's
settings that differ (learning rate, momentum, weight decay, betas, eps, initial
accumulator) the :attr:`~OptimizerConfig.param_settings` of its parameters, by
name. A single device or mirrored replicas build the same ``torch.optim``
groups; a ps task applies each dense variable's learning rate; a sparse table
takes its weight's group settings for its row-wise optimizer. The update is
then the same whatever the strategy, so an optimizer with no counterpart on a
ps task (another class, Nesterov, AMSGrad, ...) is refused, never changed.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    >>> opt = torch.optim.Adagrad([{"params": model[0].parameters(), "lr": 0.05},
    ...                            {"params": model[1].parameters()}], lr=0.01)
    >>> config = as_optimizer_config(opt, model)
    >>> config.name, config.lr, dict(config.param_settings)["0.weight"]
    ('adagrad', 0.01, {'lr': 0.05})
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from towerflow.errors import InvalidArgumentError
from towerflow.ps.spec.dense import torch_optimizer_class
from towerflow.strategies.base import OptimizerConfig

__all__ = ["as_optimizer_config", "from_torch", "check_dense_groups"]

#: the group settings each ``torch.optim`` counterpart has
_SETTINGS = {"sgd": ("lr", "momentum", "weight_decay"),
             "adagrad": ("lr", "eps", "weight_decay", "initial_accumulator_value"),
             "adam": ("lr", "betas", "eps", "weight_decay")}
#: the ``torch.optim`` classes with a counterpart, and the group settings each has
_KINDS: dict[type, tuple[str, tuple[str, ...]]] = {
    torch_optimizer_class(name): (name, settings) for name, settings in _SETTINGS.items()}
#: group options that must keep these values (the ps tasks' update has no other form)
_FIXED = {"sgd": {"dampening": 0, "nesterov": False, "maximize": False},
          "adagrad": {"lr_decay": 0, "maximize": False},
          "adam": {"amsgrad": False, "maximize": False, "decoupled_weight_decay": False}}


def as_optimizer_config(optimizer: Any, model: nn.Module) -> OptimizerConfig:
    """``optimizer`` as an :class:`OptimizerConfig` for ``model`` (a config as it is).

    Raises:
        InvalidArgumentError: neither a config nor a ``torch.optim`` optimizer;
            a class or option with no counterpart (:func:`from_torch`); a
            ``param_settings`` name that is no parameter of ``model``.
    """
    if isinstance(optimizer, torch.optim.Optimizer):
        return from_torch(optimizer, model)
    if not isinstance(optimizer, OptimizerConfig):
        raise InvalidArgumentError(
            f"The optimizer must be a towerflow OptimizerConfig or a torch.optim SGD, Adagrad "
            f"or Adam, got {type(optimizer).__name__}; pass one of those.")
    if optimizer.param_settings:
        names = {name for name, _ in model.named_parameters()}
        unknown = sorted(set(optimizer.param_settings) - names)
        if unknown:
            raise InvalidArgumentError(
                f"OptimizerConfig.param_settings names {unknown[:5]}, which are no parameters "
                f"of {type(model).__name__}; use names of model.named_parameters().")
    return optimizer


def _settings(kind: str, keys: tuple[str, ...], group: dict[str, Any]) -> dict[str, Any]:
    values = {key: group[key] for key in keys if key in group}
    values["lr"] = float(values["lr"])  # may be a tensor
    if "betas" in values:
        values["betas"] = tuple(float(b) for b in values["betas"])
    return values


def _check_group(cls: type, kind: str, group: dict[str, Any], index: int) -> None:
    for option, wanted in _FIXED[kind].items():
        value = group.get(option, wanted)
        if bool(value) != bool(wanted):
            raise InvalidArgumentError(
                f"torch.optim.{cls.__name__}'s parameter group {index} sets {option}={value!r}, "
                f"which towerflow's {kind} update (on a ps task, or a table's row-wise one) "
                f"does not have; build the optimizer with {option}={wanted!r}.")


def from_torch(optimizer: torch.optim.Optimizer, model: nn.Module) -> OptimizerConfig:
    """The :class:`OptimizerConfig` of a ``torch.optim`` SGD, Adagrad or Adam over ``model``.

    The defaults are the base settings; a group's settings that differ become
    its parameters' :attr:`~OptimizerConfig.param_settings`.

    Raises:
        InvalidArgumentError: another class (RMSprop, AdamW, ...), an option the
            update has no form for (Nesterov, dampening, AMSGrad, ``maximize``,
            ``lr_decay``), a parameter of the optimizer that is not ``model``'s, or a
            trainable parameter of ``model`` that is in no group.
    """
    cls = type(optimizer)
    if cls not in _KINDS:
        raise InvalidArgumentError(
            f"torch.optim.{cls.__name__} has no counterpart in towerflow (the ps tasks and the "
            "sparse tables apply the update themselves); use torch.optim.SGD, Adagrad or Adam, "
            "or a towerflow OptimizerConfig.")
    kind, keys = _KINDS[cls]
    names = {id(p): name for name, p in model.named_parameters()}
    base = _settings(kind, keys, dict(optimizer.defaults))
    settings: dict[str, dict[str, Any]] = {}
    for index, group in enumerate(optimizer.param_groups):
        _check_group(cls, kind, group, index)
        values = _settings(kind, keys, group)
        differ = {k: v for k, v in values.items() if v != base.get(k)}
        for param in group["params"]:
            name = names.get(id(param))
            if name is None:
                raise InvalidArgumentError(
                    f"torch.optim.{cls.__name__}'s parameter group {index} holds a parameter of "
                    f"shape {list(param.shape)} that is not {type(model).__name__}'s; build "
                    "the optimizer over this model's parameters.")
            settings[name] = differ
    missing = [n for n, p in model.named_parameters() if p.requires_grad and n not in settings]
    if missing:
        raise InvalidArgumentError(
            f"Parameters {missing[:5]} of {type(model).__name__} are in no parameter group of "
            f"torch.optim.{cls.__name__}; add them to a group, or set requires_grad=False on "
            "the ones that must not train.")
    if kind == "sgd" and (base.get("momentum") or any(s.get("momentum")
                                                       for s in settings.values())):
        kind = "momentum"
    return OptimizerConfig(kind, **base, param_settings={n: s for n, s in settings.items() if s})


def check_dense_groups(config: OptimizerConfig, dense: list[str]) -> None:
    """Refuse a dense parameter whose group sets more than its learning rate (a ps task
    applies one of every other setting to all the variables it holds).

    Raises:
        InvalidArgumentError: naming the parameter, its settings and the ways out.
    """
    for name in dense:
        own = {k: v for k, v in config.param_settings.get(name, {}).items() if k != "lr"}
        if own:
            base = {k: getattr(config, k) for k in own}
            raise InvalidArgumentError(
                f"Parameter {name!r} trains with {own} in its parameter group, but a ps task "
                f"applies the optimizer's {base} to every dense variable it holds (only the "
                "learning rate may differ per group); give its group the optimizer's settings, "
                "or train with Mirrored replicas.")
