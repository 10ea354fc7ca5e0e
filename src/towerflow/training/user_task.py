"""Your own model and data as a task of ``towerflow train``: ``--model MODULE:FACTORY --data
MODULE:FACTORY``.

A :class:`UserTask` is a :class:`~towerflow.training.tasks.Task` like the
built-in ones, so every option of ``towerflow train`` serves it: one process,
``--replicas``, ``--ps N --workers M``, ``--config run.yaml``, checkpoints,
resume and ``towerflow eval``. The factories are named as ``package.module:name``
(the current directory is importable, as ``python -m`` makes it) and recorded
in ``run.yaml`` and in every checkpoint's metadata, so a resumed run and
``towerflow eval`` rebuild them.

The contract:

* **model factory** — called with no arguments; returns an ``nn.Module``, or a
  mapping with ``"model"`` (the module) and optionally ``"loss_fn"`` (a
  criterion ``loss_fn(outputs, targets) -> scalar tensor``, as
  ``nn.BCEWithLogitsLoss()``) and ``"optimizer"`` (a ``torch.optim`` SGD /
  Adagrad / Adam over the model's parameters, per-group learning rates
  included, or an :class:`~towerflow.strategies.OptimizerConfig`) and
  ``"metrics"`` (names to ``fn(outputs, targets) -> float``, scored on the test
  split). ``--loss``
  (``mse``, ``cross_entropy``, ``bce_with_logits``) names a loss instead;
  ``--optimizer`` and its flags describe the optimizer when the factory gives
  none.
* **data factory** — called with the keywords it names among ``split``
  (``"train"`` or ``"test"``), ``batch_size``, ``rank``, ``world_size``,
  ``seed``, ``epoch`` and ``data_dir`` (``--data-dir``); returns an iterable
  of ``(inputs, targets)`` batches: ``inputs`` a tensor, a tuple of tensors
  (the model's positional arguments) or a dict of tensors (its keywords). It
  is called again for each epoch of the training split; a replica's share is
  its to take (``rank`` of ``world_size``). A resumed run continues at the
  batch its checkpoint recorded (:mod:`~towerflow.training.user_data`: the
  iterable's ``state_dict()``, a ``skip`` keyword, or batches read and dropped).

``towerflow eval`` prints the mean loss of the test split and the metrics its
loss implies (:mod:`~towerflow.training.user_metrics`: AUC and logloss for a
binary cross entropy, accuracy for a cross entropy) and the factory's own.

Example:
    >>> task = UserTask("torch.nn:Identity", "towerflow.testing:none", loss="mse")
    >>> task.name, task.metric
    ('torch.nn:Identity', 'loss')
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from towerflow.errors import InvalidArgumentError, NotFoundError
from towerflow.training.names import LOSS_NAMES
from towerflow.training.taskbase import DataOptions, Task
from towerflow.training.user_data import FactoryBatches
from towerflow.training.user_metrics import check_metrics, kind_of_loss, split_metrics

__all__ = ["UserTask", "LOSSES", "DATA_KEYWORDS", "is_factory_spec", "load_factory"]

log = logging.getLogger("towerflow.training")


def _bce_with_logits(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(outputs.reshape(targets.shape),
                                              targets.to(outputs.dtype))


def _mse(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(outputs.reshape(targets.shape), targets.to(outputs.dtype))


#: ``--loss`` names: criteria ``(outputs, targets) -> scalar``
LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = dict(zip(
    LOSS_NAMES, (_mse, F.cross_entropy, _bce_with_logits), strict=True))
#: the keywords a data factory may name
DATA_KEYWORDS = ("split", "batch_size", "rank", "world_size", "seed", "epoch", "data_dir", "skip")
_MODEL_KEYS = frozenset({"model", "loss_fn", "optimizer", "metrics"})
#: ``towerflow train``'s settings that describe the optimizer
_OPTIMIZER_SETTINGS = frozenset({"optimizer", "lr", "momentum", "weight_decay", "adam_beta1",
                                 "adam_beta2", "eps", "initial_accumulator_value"})


def is_factory_spec(value: object) -> bool:
    """True for ``"package.module:name"`` (a factory), False for a built-in name.

    Example:
        >>> is_factory_spec("mymodels:build"), is_factory_spec("digits")
        (True, False)
    """
    return isinstance(value, str) and ":" in value


def load_factory(spec: str, flag: str) -> Callable[..., Any]:
    """The callable ``spec`` (``package.module:name``) names; ``flag`` names it in errors.

    The current directory is importable (as under ``python -m``).

    Raises:
        InvalidArgumentError: ``spec`` is not ``MODULE:NAME``, importing the module
            raised, or the attribute is not callable.
        NotFoundError: no such module, or no such attribute in it.
    """
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr or not all(p.isidentifier() for p in
                                              module_name.split(".") + attr.split(".")):
        raise InvalidArgumentError(
            f"{flag} {spec!r} is not MODULE:FACTORY; write it as package.module:function, "
            "e.g. mymodels:build_model.")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not module_name.startswith(exc.name):
            raise InvalidArgumentError(
                f"{flag} {spec!r}: importing {module_name!r} failed, it imports {exc.name!r}, "
                "which is not installed; install it in this environment.") from exc
        raise NotFoundError(
            f"{flag} {spec!r}: no module named {module_name!r} on the Python path "
            f"(the current directory {os.getcwd()!r} and PYTHONPATH); run from its directory "
            "or add that directory to PYTHONPATH.") from None
    except Exception as exc:  # noqa: BLE001 - the user's module failed while importing
        raise InvalidArgumentError(
            f"{flag} {spec!r}: importing {module_name!r} raised {type(exc).__name__}: "
            f"{str(exc)[:200]}; fix the module.") from exc
    value: Any = module
    for part in attr.split("."):
        if not hasattr(value, part):
            names = sorted(n for n, v in vars(module).items()
                           if callable(v) and not n.startswith("_"))[:12]
            raise NotFoundError(
                f"{flag} {spec!r}: module {module_name!r} has no attribute {attr!r}; name one "
                f"of its callables ({', '.join(names) or 'it has none'}).")
        value = getattr(value, part)
    if not callable(value):
        raise InvalidArgumentError(
            f"{flag} {spec!r} is a {type(value).__name__}, not a callable; name the function "
            "(or class) that builds it.")
    return value


class UserTask(Task):
    """A model and data of the user's own, from factories named ``package.module:name``.

    Args:
        model: the model factory's ``MODULE:NAME``.
        data: the data factory's ``MODULE:NAME``.
        loss: a :data:`LOSSES` name, or None for the model factory's ``loss_fn``.
        seed: the run's seed (handed to the data factory).
        optimizer_flags: the optimizer flags the command line gave (refused when the
            model factory returns an optimizer).
    """

    metric = "loss"
    num_examples_per_epoch = 1_000_000  # unknown: an epoch of the schedule counts a million
    default_lr = 0.1
    default_epochs_per_decay = 1e9  # no decay unless --epochs-per-decay says
    options = {"loss": None}
    #: no moving averages unless --ema-decay asks (eval scores the parameters); the data
    #: factory's ``data_dir`` is the current directory unless --data-dir names one
    option_defaults = {"ema_decay": 0.0, "data_dir": "."}
    unused_settings = frozenset({"synthetic_examples"})

    def __init__(self, model: str, data: str, *, loss: str | None = None, seed: int = 0,
                 optimizer_flags: Iterable[str] = ()) -> None:
        if not is_factory_spec(data):
            raise InvalidArgumentError(
                f"--model {model} needs its data as a factory too, not --data {data}; pass "
                "--data MODULE:FACTORY (a function returning an iterable of (inputs, targets) "
                "batches).")
        if loss is not None and loss not in LOSSES:
            raise InvalidArgumentError(f"Unknown loss {loss!r}; use one of "
                                       f"{', '.join(LOSSES)}, or drop --loss to use the "
                                       "model factory's loss_fn.")
        self.name, self.data, self.loss, self.seed = model, data, loss, seed
        self.optimizer_flags = tuple(optimizer_flags)
        self._criterion: Callable[[Any, Any], torch.Tensor] | None = None
        self._kind: str | None = None  # what the loss says the outputs are (user_metrics)
        self._metrics: dict[str, Callable[[Any, Any], Any]] = {}
        self._optimizer: Any = None
        self._data_factory: Callable[..., Any] | None = None

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> UserTask:
        given = set(settings.get("_explicit") or ())
        flags = sorted("--" + d.replace("_", "-") for d in _OPTIMIZER_SETTINGS & given)
        return cls(str(settings["model"]), str(settings.get("data")),
                   loss=settings.get("loss"), seed=int(settings.get("seed") or 0),
                   optimizer_flags=flags)

    def settings(self) -> dict[str, Any]:
        return {"data": self.data, "loss": self.loss}

    def metadata(self) -> dict[str, Any]:
        return {"task": self.name, "task_data": self.data, "task_loss": self.loss}

    # -- the model ---------------------------------------------------------------------
    def build_model(self) -> nn.Module:
        built = load_factory(self.name, "--model")()
        if isinstance(built, Mapping):
            unknown = sorted(set(map(str, built)) - _MODEL_KEYS)
            if unknown or "model" not in built:
                raise InvalidArgumentError(
                    f"--model {self.name} returned a mapping with keys {sorted(map(str, built))}"
                    f"; return an nn.Module, or a mapping with 'model' and optionally "
                    "'loss_fn', 'optimizer' and 'metrics'.")
            model, criterion, optimizer = built["model"], built.get("loss_fn"), \
                built.get("optimizer")
            self._metrics = check_metrics(built.get("metrics"), self.name)
        else:
            model, criterion, optimizer = built, None, None
        if not isinstance(model, nn.Module):
            raise InvalidArgumentError(
                f"--model {self.name} returned a {type(model).__name__}, not a torch.nn.Module; "
                "return the model (or {'model': model, 'loss_fn': ...}).")
        if criterion is not None and not callable(criterion):
            raise InvalidArgumentError(
                f"--model {self.name} returned a loss_fn of type {type(criterion).__name__}, "
                "which is not callable; return a criterion such as nn.BCEWithLogitsLoss().")
        if optimizer is not None:
            optimizer = self._checked_optimizer(optimizer, model)
        if self.loss is not None:
            criterion = LOSSES[self.loss]
        if criterion is None:
            raise InvalidArgumentError(
                f"--model {self.name} gives no loss; pass --loss ({', '.join(LOSSES)}), or "
                "return {'model': model, 'loss_fn': criterion} from the factory.")
        self._criterion, self._optimizer = criterion, optimizer
        self._kind = kind_of_loss(criterion, self.loss)
        return model

    def _checked_optimizer(self, optimizer: Any, model: nn.Module) -> Any:
        from towerflow.strategies.base import OptimizerConfig

        if self.optimizer_flags:
            raise InvalidArgumentError(
                f"--model {self.name} returns its own optimizer and the command line sets "
                f"{', '.join(self.optimizer_flags)} too; drop those flags, or return no "
                "'optimizer' from the factory.")
        if not isinstance(optimizer, OptimizerConfig | torch.optim.Optimizer):
            raise InvalidArgumentError(
                f"--model {self.name} returned an optimizer of type "
                f"{type(optimizer).__name__}; return a torch.optim SGD, Adagrad or Adam over "
                "the model's parameters (or a towerflow OptimizerConfig), or none and pass "
                "--optimizer.")
        from towerflow.strategies.optim import as_optimizer_config

        return as_optimizer_config(optimizer, model)  # refused here when it has no counterpart

    def own_optimizer(self) -> Any:
        """The optimizer the model factory returned (after :meth:`build_model`), or None."""
        return self._optimizer

    def loss_fn(self, model: nn.Module, batch: Any) -> torch.Tensor:
        if not isinstance(batch, tuple | list) or len(batch) != 2:
            raise InvalidArgumentError(
                f"--data {self.data} yielded a {type(batch).__name__} batch; yield "
                "(inputs, targets) pairs.")
        inputs, targets = batch
        return self._loss(_forward(model, inputs), targets)

    def _loss(self, outputs: Any, targets: Any) -> torch.Tensor:
        if self._criterion is None:
            raise InvalidArgumentError(f"The {self.name} task's loss is unknown until its "
                                       "model is built; call build_model() first.")
        return self._criterion(outputs, targets)

    # -- the data ----------------------------------------------------------------------
    def names_keyword(self, name: str) -> bool:
        """Whether the data factory names the keyword ``name`` (``skip``: it can resume)."""
        return name in inspect.signature(self._factory()).parameters

    def _factory(self) -> Callable[..., Any]:
        if self._data_factory is None:
            self._data_factory = load_factory(self.data, "--data")
        return self._data_factory

    def call_data_factory(self, values: Mapping[str, Any]) -> Iterable[Any]:
        """The data factory called with the keywords it names among ``values``."""
        factory = self._factory()
        params = inspect.signature(factory).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            kwargs = dict(values)
        else:
            kwargs = {k: v for k, v in values.items() if k in params}
        if "split" not in kwargs:
            raise InvalidArgumentError(
                f"--data {self.data} takes no 'split' argument; define it as "
                f"def {factory.__name__}(split, batch_size, ...) with any of "
                f"{', '.join(DATA_KEYWORDS)}.")
        batches = factory(**kwargs)
        if isinstance(batches, torch.Tensor | str | bytes) or not isinstance(batches, Iterable):
            raise InvalidArgumentError(
                f"--data {self.data} returned a {type(batches).__name__} for split "
                f"{values['split']!r}, not an iterable of (inputs, targets) batches; return a "
                "list, a generator or a DataLoader.")
        return batches

    def load(self, split: str, options: DataOptions) -> FactoryBatches:
        return FactoryBatches(self, {"split": split, "batch_size": 128, "rank": 0,
                                     "world_size": 1, "seed": self.seed,
                                     "data_dir": str(options.data_dir)})

    def replica_data(self, data: Any, *, rank: int, world_size: int, batch_size: int) -> Any:
        return data.bound(batch_size=batch_size, rank=rank, world_size=world_size)

    @torch.no_grad()
    def scores(self, model: nn.Module, data: Any, *, device: torch.device,
               batch_size: int) -> dict[str, float]:
        """The mean loss per example of the test split, and the metrics of its outputs."""
        from towerflow.training.pipeline import to_device

        model.eval()
        total, count = 0.0, 0
        keep = self._kind is not None or bool(self._metrics)
        outputs_seen: list[torch.Tensor] = []
        targets_seen: list[torch.Tensor] = []
        for batch in data.bound(batch_size=batch_size, rank=0, world_size=1):
            if not isinstance(batch, tuple | list) or len(batch) != 2:
                self.loss_fn(model, batch)  # says what a batch must be
            inputs, targets = to_device(batch, device)
            outputs = _forward(model, inputs)
            n = int(targets.shape[0]) if targets.dim() else 1
            total += float(self._loss(outputs, targets)) * n
            count += n
            if not keep:
                continue
            if isinstance(outputs, torch.Tensor) and isinstance(targets, torch.Tensor):
                outputs_seen.append(outputs.detach().float().cpu())
                targets_seen.append(targets.detach().cpu())
            else:
                keep = False
                log.warning("--model %s returns a %s (targets: %s), not tensors: its test "
                            "split's loss alone is reported", self.name,
                            type(outputs).__name__, type(targets).__name__)
        if count == 0:
            raise InvalidArgumentError(f"--data {self.data} yielded no test batch; return the "
                                       "test split's batches for split='test'.")
        self._test_examples = count
        scores = {self.metric: total / count}
        if keep:
            scores.update(split_metrics(self._kind, self._metrics, torch.cat(outputs_seen),
                                        torch.cat(targets_seen)))
        return scores

    def score(self, model: nn.Module, data: Any, *, device: torch.device,
              batch_size: int) -> float:
        return self.scores(model, data, device=device, batch_size=batch_size)[self.metric]

    def num_test_examples(self, data: Any) -> int:
        return int(getattr(self, "_test_examples", 0))


def _forward(model: nn.Module, inputs: Any) -> Any:
    """``model(inputs)``; a tuple is its positional arguments, a dict its keywords."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    return model(inputs)
