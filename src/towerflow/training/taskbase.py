"""The contract of a task of ``towerflow train`` / ``towerflow eval``: :class:`Task` (a model
with its data, loss and transforms) and :class:`DataOptions` (where its data comes from).

The built-in tasks are in :mod:`towerflow.training.tasks`, the user's own
(``--model MODULE:FACTORY``) in :mod:`towerflow.training.user_task`.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from towerflow.training.pipeline import Transform
from towerflow.training.precision import evaluate

__all__ = ["DataOptions", "Task"]


@dataclass(frozen=True, slots=True)
class DataOptions:
    """Where a task's data comes from.

    Attributes:
        data_dir: the data set's files: CIFAR-10's binary files or MovieLens' (downloaded
            there when absent), Criteo's logs.
        synthetic: random images with the real shapes instead of real data.
        synthetic_examples: how many synthetic examples per split.
        download: fetch CIFAR-10 or MovieLens when the files are absent.
    """

    data_dir: str | Path = "/tmp/cifar10_data"
    synthetic: bool = False
    synthetic_examples: int = 10000
    download: bool = True



class Task(abc.ABC):
    """A model with its data, loss and transforms."""

    name: str = ""
    num_examples_per_epoch: int = 0
    #: defaults of the command line for this task
    default_lr: float = 0.1
    default_epochs_per_decay: float = 350.0
    #: ``towerflow train`` options only this task reads (dest -> default)
    options: Mapping[str, Any] = {}
    #: defaults of general ``towerflow train`` options that this task changes (dest -> value)
    option_defaults: Mapping[str, Any] = {}
    #: general ``towerflow train`` settings this task never reads (left out of ``run.yaml``)
    unused_settings: frozenset[str] = frozenset()
    #: what :meth:`score` measures, as ``towerflow eval`` prints it
    metric: str = "precision @ 1"

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> Task:
        """The task for a run's settings (``towerflow train``'s option names)."""
        return cls()

    @abc.abstractmethod
    def build_model(self) -> nn.Module:
        """A freshly initialised model."""

    def build_train_model(self) -> nn.Module:
        """The model a training process builds (the strategy then prepares it)."""
        return self.build_model()

    def replica_data(self, data: Any, *, rank: int, world_size: int, batch_size: int) -> Any:
        """A replica's training data from :meth:`load`'s (a Dataset: as it is, the loop
        shards and batches it)."""
        return data

    def loss_fn(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The training loss of a batch."""
        from towerflow.models import cross_entropy_loss

        return cross_entropy_loss(model, batch)

    @abc.abstractmethod
    def load(self, split: str, options: DataOptions):  # -> towerflow.data.Dataset
        """The ``train`` or ``test`` split."""

    def train_transform(self, device: torch.device, seed: int) -> Transform | None:
        """The on-device transform of training batches (None: use them as they are)."""
        return None

    def eval_images(self, images: torch.Tensor) -> torch.Tensor:
        """Images of the test split as the model takes them."""
        return images

    def score(self, model: nn.Module, data: Any, *, device: torch.device,
              batch_size: int) -> float:
        """The :attr:`metric` of ``model`` on the test split ``data``."""
        return evaluate(model, data, device=device, batch_size=batch_size,
                        images_fn=self.eval_images)

    def reference_score(self, data: Any) -> float | None:
        """The best :attr:`metric` a model can reach on ``data`` when known, else None."""
        return None

    def scores(self, model: nn.Module, data: Any, *, device: torch.device,
               batch_size: int) -> dict[str, float]:
        """:meth:`score` and any other measures of ``model`` on ``data``, :attr:`metric` first."""
        return {self.metric: self.score(model, data, device=device, batch_size=batch_size)}

    def num_test_examples(self, data: Any) -> int:
        """How many examples :meth:`score` scores."""
        return len(data.labels)

    def settings(self) -> dict[str, Any]:
        """This task's own settings for the run's record (``run.yaml``)."""
        return {dest: getattr(self, dest) for dest in self.options}

    def metadata(self) -> dict[str, Any]:
        """What every checkpoint of the task records of it (enough to rebuild it)."""
        return {"task": self.name}

    def own_optimizer(self) -> Any:
        """The optimizer the task's model comes with (after :meth:`build_model`), or None:
        the run's (``--optimizer`` and its flags)."""
        return None
