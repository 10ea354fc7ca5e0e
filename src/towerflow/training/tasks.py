"""The built-in tasks of ``towerflow train`` / ``towerflow eval``: CIFAR-10 and digits.

A task ties a model to its data, its loss and its input transforms, so the
command line, the trainer and the evaluator agree on them:

=========  ====================================  ==========================================
task       model                                 data
=========  ====================================  ==========================================
cifar10    article 001's network (24x24 input)   CIFAR-10 binary files, or ``synthetic``;
                                                 training batches distorted on the device
digits     a two-layer net (8x8 input)           scikit-learn's bundled digits (no network)
=========  ====================================  ==========================================

Example:
    >>> from towerflow.training.tasks import get_task
    >>> get_task("cifar10").num_examples_per_epoch
    50000
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from towerflow.errors import InvalidArgumentError
from towerflow.training.pipeline import Transform

__all__ = ["DataOptions", "Task", "Cifar10Task", "DigitsTask", "TASKS", "get_task"]


@dataclass(frozen=True, slots=True)
class DataOptions:
    """Where a task's data comes from.

    Attributes:
        data_dir: CIFAR-10's binary files (downloaded there when absent).
        synthetic: random images with the real shapes instead of real data.
        synthetic_examples: how many synthetic examples per split.
        download: fetch CIFAR-10 when the files are absent.
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

    @abc.abstractmethod
    def build_model(self) -> nn.Module:
        """A freshly initialised model."""

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


class Cifar10Task(Task):
    """Article 001: CIFAR-10 with distorted 24x24 training crops."""

    name = "cifar10"
    num_examples_per_epoch = 50000

    def build_model(self) -> nn.Module:
        from towerflow.models import Cifar10Net

        return Cifar10Net()

    def load(self, split: str, options: DataOptions):  # noqa: ANN201
        from towerflow.data import load_cifar10, synthetic_cifar10

        if options.synthetic:
            return synthetic_cifar10(options.synthetic_examples, seed=0 if split == "train" else 1)
        return load_cifar10(options.data_dir, split, download=options.download)

    def train_transform(self, device: torch.device, seed: int) -> Transform:
        from towerflow.data import Distortion

        return Distortion(device, seed)

    def eval_images(self, images: torch.Tensor) -> torch.Tensor:
        from towerflow.data import eval_images

        return eval_images(images)


class DigitsTask(Task):
    """scikit-learn's 8x8 digits: a real data set that needs no network."""

    name = "digits"
    num_examples_per_epoch = 1437
    default_lr = 0.1
    default_epochs_per_decay = 350.0

    def build_model(self) -> nn.Module:
        from towerflow.models import DigitsNet

        return DigitsNet()

    def load(self, split: str, options: DataOptions):  # noqa: ANN201
        from towerflow.data import load_digits

        return load_digits(split)


TASKS: dict[str, type[Task]] = {"cifar10": Cifar10Task, "digits": DigitsTask}


def get_task(name: str) -> Task:
    """The built-in task called ``name``."""
    cls = TASKS.get(name)
    if cls is None:
        raise InvalidArgumentError(
            f"Unknown model {name!r}; use one of {', '.join(sorted(TASKS))}."
        )
    return cls()
