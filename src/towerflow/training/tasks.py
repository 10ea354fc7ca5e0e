"""The built-in tasks of ``towerflow train`` / ``towerflow eval``: CIFAR-10, digits, clicks,
MovieLens and Criteo.

A task ties a model to its data, its loss and its input transforms, so the
command line, the trainer and the evaluator agree on them:

=========  ====================================  ==========================================
task       model                                 data
=========  ====================================  ==========================================
cifar10    article 001's network (24x24 input)   CIFAR-10 binary files, or ``synthetic``;
                                                 training batches distorted on the device
digits     a two-layer net (8x8 input)           scikit-learn's bundled digits (no network)
click      an embedding bag of hashed ids,       synthetic click logs with a planted truth
           a linear and an MLP head (BCE)        (Zipf ids); scored by AUC against the truth's
movielens  DeepFM: an ``nn.Embedding`` per       MovieLens (GroupLens' files: ml-100k, ml-1m,
           field, FM + MLP (BCE)                 ml-20m, ml-25m): rated 4+?; AUC, logloss
criteo     DeepFM with 13 dense features         Criteo's display-advertising TSV (gzipped
                                                 or not); AUC, logloss
=========  ====================================  ==========================================

A task may read settings of its own from the run's (``towerflow train``'s
options: :meth:`Task.from_settings`), e.g. the click task's table size.

Example:
    >>> from towerflow.training.tasks import get_task
    >>> get_task("cifar10").num_examples_per_epoch
    50000
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from towerflow.errors import InvalidArgumentError
from towerflow.training.names import TASK_NAMES
from towerflow.training.pipeline import Transform
from towerflow.training.taskbase import DataOptions, Task

__all__ = ["DataOptions", "Task", "Cifar10Task", "DigitsTask", "ClickTask", "MovieLensTask",
           "CriteoTask", "TASKS", "get_task", "task_class", "default_train_dir"]


#: the data settings of a task whose data needs no files (generated, or bundled)
_NO_FILES = frozenset({"data_dir", "data", "synthetic_examples", "no_download"})


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
    unused_settings = _NO_FILES
    num_examples_per_epoch = 1437
    default_lr = 0.1
    default_epochs_per_decay = 350.0

    def build_model(self) -> nn.Module:
        from towerflow.models import DigitsNet

        return DigitsNet()

    def load(self, split: str, options: DataOptions):  # noqa: ANN201
        from towerflow.data import load_digits

        return load_digits(split)


class ClickTask(Task):
    """A click-through model on synthetic click logs with a planted truth, scored by AUC.

    Settings (``towerflow train``'s options): ``table_rows`` (the table's rows,
    the ids' range), ``embedding_dim``, ``ids_per_example`` (a bag of Zipf(1.2)
    ids per example) and ``seed`` (the truth's). Under the ``ParameterServer``
    strategy (a ``sparse=True`` table, or ``sparse_threshold`` at most its
    bytes; not with ``off``), the table is row-sharded over the ps tasks and a
    worker never allocates it.
    """

    name = "click"
    unused_settings = _NO_FILES
    num_examples_per_epoch = 1_000_000  # an endless stream: an epoch counts a million examples
    default_lr = 0.1
    options = {"table_rows": 1_000_000, "embedding_dim": 32, "ids_per_example": 16}
    #: Adagrad, its accumulator from 1e-4 (TensorFlow's 0.1 stalls the rare ids, whose
    #: gradients are small), batches of 512, no moving averages of a large table
    option_defaults = {"optimizer": "adagrad", "initial_accumulator_value": 1e-4,
                       "batch_size": 512, "ema_decay": 0.0}
    metric = "AUC"
    zipf, ctr, weight_std, hidden, eval_examples = 1.2, 0.15, 0.5, 32, 50_000

    def __init__(self, table_rows: int = 1_000_000, embedding_dim: int = 32,
                 ids_per_example: int = 16, *, seed: int = 0, sparse_gradients: bool = True, tables_on_ps: bool = False) -> None:
        for what, value in (("table_rows", table_rows), ("embedding_dim", embedding_dim),
                            ("ids_per_example", ids_per_example)):
            if value < 1:
                raise InvalidArgumentError(f"The click model's {what} must be at least 1, got "
                                           f"{value}; pass --{what.replace('_', '-')} N >= 1.")
        self.table_rows, self.embedding_dim = table_rows, embedding_dim
        self.ids_per_example, self.seed = ids_per_example, seed
        self.sparse_gradients, self.tables_on_ps = sparse_gradients, tables_on_ps
        self._logs: Any = None

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> ClickTask:
        """A ps run's table on the ps tasks when sparse (or at least ``sparse_threshold``).

        Sparse gradients unless the optimizer has no sparse update (Adam, weight decay).
        """
        get = {**cls.options, **cls.option_defaults, **settings}.get
        rows, dim = int(get("table_rows")), int(get("embedding_dim"))
        from towerflow.ps.worker.tables.swap import DEFAULT_SPARSE_THRESHOLD

        threshold = get("sparse_threshold")
        sparse = get("optimizer") in ("sgd", "momentum", "adagrad") and not get("weight_decay")
        if threshold is None and get("ps"):  # the strategy's default rule
            on_ps = sparse or rows * dim * 4 >= DEFAULT_SPARSE_THRESHOLD
        else:
            on_ps = threshold not in (None, "off") and (sparse or rows * dim * 4 >= int(threshold))
        return cls(rows, dim, int(get("ids_per_example")), seed=int(get("seed") or 0),
                   sparse_gradients=sparse, tables_on_ps=on_ps)

    @property
    def logs(self) -> Any:
        """The planted truth (:class:`towerflow.data.clicks.ClickLogs`), built once."""
        if self._logs is None:
            from towerflow.data.clicks import ClickLogs

            self._logs = ClickLogs([self.table_rows], bag=self.ids_per_example, zipf=self.zipf,
                                   ctr=self.ctr, weight_std=self.weight_std, seed=self.seed)
        return self._logs

    def build_model(self) -> nn.Module:
        from towerflow.models.click import ClickNet

        return ClickNet(self.table_rows, self.embedding_dim, hidden=self.hidden,
                        sparse_gradients=self.sparse_gradients)

    def build_train_model(self) -> nn.Module:
        """The table on the meta device when the ps tasks hold it (the strategy swaps it)."""
        from towerflow.models.click import ClickNet

        return ClickNet(self.table_rows, self.embedding_dim, hidden=self.hidden,
                        sparse_gradients=self.sparse_gradients,
                        table_device="meta" if self.tables_on_ps else None)

    def loss_fn(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        from towerflow.models.click import click_loss

        return click_loss(model, batch)

    def load(self, split: str, options: DataOptions):  # noqa: ANN201
        """``train``: replica 0's endless stream; ``test``: held-out ``(ids, clicks)``."""
        from towerflow.data.clicks import HELD_OUT_SEED, ClickStream

        if split == "train":
            return ClickStream(self.logs, batch_size=int(self.option_defaults["batch_size"]),
                               seed=self.seed)
        fields, clicks = self.logs.sample(
            self.eval_examples, torch.Generator().manual_seed(HELD_OUT_SEED + self.seed))
        return fields[0], clicks

    def replica_data(self, data: Any, *, rank: int, world_size: int, batch_size: int) -> Any:
        """The replica's own stream, of ``batch_size`` examples per batch."""
        return data.for_replica(rank, batch_size=batch_size)

    @torch.no_grad()
    def score(self, model: nn.Module, data: Any, *, device: torch.device,
              batch_size: int) -> float:
        from towerflow.data.clicks import auc

        ids, clicks = data
        model.eval()
        scores = torch.cat([model(ids[i:i + batch_size].to(device)).cpu()
                            for i in range(0, len(clicks), batch_size)])
        return auc(scores, clicks)

    def reference_score(self, data: Any) -> float:
        """The planted truth's own AUC on the same examples (no model ranks better)."""
        from towerflow.data.clicks import auc

        ids, clicks = data
        return auc(self.logs.logits([ids]), clicks)

    def num_test_examples(self, data: Any) -> int:
        return len(data[1])


class _FieldTask(Task):
    """DeepFM on recommendation data read from files (:class:`towerflow.data.recsys.FieldData`).

    Trains on replica-sharded batches of the training split, scored by AUC
    and logloss (scikit-learn's) on the test split.
    """

    metric = "AUC"
    default_lr = 0.05
    default_epochs_per_decay = 1000.0
    hidden = (128, 64)
    dense_features = 0
    #: Adagrad (sparse rows), batches of 256, no moving averages of the tables
    option_defaults = {"optimizer": "adagrad", "initial_accumulator_value": 1e-4,
                       "batch_size": 256, "ema_decay": 0.0, "embedding_dim": 16}

    def __init__(self, *, embedding_dim: int = 16, seed: int = 0,
                 sparse_gradients: bool = True) -> None:
        if embedding_dim < 1:
            raise InvalidArgumentError(f"The {self.name} model's embedding_dim must be at least "
                                       f"1, got {embedding_dim}; pass --embedding-dim N >= 1.")
        self.embedding_dim, self.seed, self.sparse_gradients = embedding_dim, seed, sparse_gradients

    @staticmethod
    def _common(settings: Mapping[str, Any], cls: type[_FieldTask]) -> dict[str, Any]:
        get = {**cls.options, **cls.option_defaults, **settings}.get
        sparse = get("optimizer") in ("sgd", "momentum", "adagrad") and not get("weight_decay")
        return {"embedding_dim": int(get("embedding_dim")), "seed": int(get("seed") or 0),
                "sparse_gradients": sparse}

    def field_rows(self) -> list[int]:
        """Each field's table rows (known without reading the data)."""
        raise NotImplementedError

    def read(self, split: str, options: DataOptions):  # noqa: ANN201
        """The split as :class:`towerflow.data.recsys.FieldData`."""
        raise NotImplementedError

    def build_model(self) -> nn.Module:
        from towerflow.models.deepfm import DeepFM

        return DeepFM(self.field_rows(), self.embedding_dim, dense_features=self.dense_features,
                      hidden=self.hidden, sparse=self.sparse_gradients)

    def loss_fn(self, model: nn.Module, batch: Any) -> torch.Tensor:
        from towerflow.models.deepfm import deepfm_loss

        return deepfm_loss(model, batch)

    def load(self, split: str, options: DataOptions):  # noqa: ANN201
        """``train``: batches of the training split (every replica's); ``test``: the split."""
        from towerflow.data.recsys import FieldBatches

        data = self.read(split, options)
        if split == "test":
            return data
        return FieldBatches(data, batch_size=min(len(data),
                                                 int(self.option_defaults["batch_size"])),
                            seed=self.seed)

    def replica_data(self, data: Any, *, rank: int, world_size: int, batch_size: int) -> Any:
        """The replica's share of the training split, ``batch_size`` examples per batch."""
        return data.for_replica(rank, world_size, batch_size=batch_size)

    @torch.no_grad()
    def scores(self, model: nn.Module, data: Any, *, device: torch.device,
               batch_size: int) -> dict[str, float]:
        """AUC and logloss (scikit-learn's) of the predicted click probabilities."""
        from towerflow.training.user_metrics import binary_scores

        model.eval()
        probs = []
        for start in range(0, len(data), batch_size):
            fields, dense, _ = data.batch(slice(start, start + batch_size))
            logits = model([f.to(device) for f in fields], dense.to(device))
            probs.append(torch.sigmoid(logits).double().cpu())
        return binary_scores(data.labels, torch.cat(probs), one_class="raise",
                             what=f"the {self.name} test split")

    def score(self, model: nn.Module, data: Any, *, device: torch.device,
              batch_size: int) -> float:
        return self.scores(model, data, device=device, batch_size=batch_size)[self.metric]

    def num_test_examples(self, data: Any) -> int:
        return len(data)


class MovieLensTask(_FieldTask):
    """DeepFM on MovieLens as GroupLens publishes it: will the user rate the movie 4 or more?

    Settings: ``movielens_variant`` (ml-100k, ml-1m, ml-20m, ml-25m; its folder
    in ``--data-dir``) and ``embedding_dim``; the latest 20% of the ratings
    are the test split.
    """

    name = "movielens"
    num_examples_per_epoch = 80_000  # ml-100k's training split
    options = {"movielens_variant": "ml-100k", "embedding_dim": 32}
    option_defaults = {**_FieldTask.option_defaults, "data_dir": "/tmp/movielens_data"}
    test_fraction = 0.2

    def __init__(self, movielens_variant: str = "ml-100k", **kwargs: Any) -> None:
        from towerflow.data.movielens import movielens_rows

        super().__init__(**kwargs)
        self.movielens_variant = movielens_variant
        self._rows = list(movielens_rows(movielens_variant).values())

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> MovieLensTask:
        variant = settings.get("movielens_variant") or cls.options["movielens_variant"]
        return cls(str(variant), **cls._common(settings, cls))

    def field_rows(self) -> list[int]:
        return self._rows

    def read(self, split: str, options: DataOptions):  # noqa: ANN201
        from towerflow.data.movielens import load_movielens

        return load_movielens(options.data_dir, split, variant=self.movielens_variant,
                              test_fraction=self.test_fraction, download=options.download)


class CriteoTask(_FieldTask):
    """DeepFM on Criteo's display-advertising logs (``train.txt`` or ``train.txt.gz``).

    Settings: ``criteo_buckets`` (rows per categorical field: the hashed
    values' range) and ``embedding_dim``; the last 10% of the lines (the
    latest) are the test split.
    """

    name = "criteo"
    num_examples_per_epoch = 41_000_000  # about 90% of the challenge's 45.8M lines
    options = {"criteo_buckets": 100_000, "embedding_dim": 32}
    option_defaults = {**_FieldTask.option_defaults, "data_dir": "/tmp/criteo_data",
                       "batch_size": 1024}
    dense_features = 13
    test_fraction = 0.1

    def __init__(self, criteo_buckets: int = 100_000, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if criteo_buckets < 1:
            raise InvalidArgumentError(f"The criteo model's criteo_buckets must be at least 1, "
                                       f"got {criteo_buckets}; pass --criteo-buckets N >= 1.")
        self.criteo_buckets = criteo_buckets

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> CriteoTask:
        buckets = settings.get("criteo_buckets") or cls.options["criteo_buckets"]
        return cls(int(buckets), **cls._common(settings, cls))

    def field_rows(self) -> list[int]:
        from towerflow.data.criteo import NUM_CATEGORICAL

        return [self.criteo_buckets + 1] * NUM_CATEGORICAL

    def read(self, split: str, options: DataOptions):  # noqa: ANN201
        from towerflow.data.criteo import load_criteo

        return load_criteo(options.data_dir, split, buckets=self.criteo_buckets,
                           test_fraction=self.test_fraction)


TASKS: dict[str, type[Task]] = dict(zip(
    TASK_NAMES, (Cifar10Task, DigitsTask, ClickTask, MovieLensTask, CriteoTask), strict=True))


def task_class(name: str) -> type[Task]:
    """The class of the task ``name``: a built-in one, or ``MODULE:FACTORY`` (the user's own,
    :class:`~towerflow.training.user_task.UserTask`)."""
    if ":" in name:
        from towerflow.training.user_task import UserTask

        return UserTask
    cls = TASKS.get(name)
    if cls is None:
        raise InvalidArgumentError(
            f"Unknown model {name!r}; use one of {', '.join(sorted(TASKS))}, or your own "
            "as MODULE:FACTORY (--model mymodels:build)."
        )
    return cls


def get_task(name: str, settings: Mapping[str, Any] | None = None) -> Task:
    """The task called ``name`` (built-in, or ``MODULE:FACTORY``), for a run's ``settings``
    (its own options)."""
    return task_class(name).from_settings({**(settings or {}), "model": name})


def default_train_dir(name: str) -> str:
    """Where a run of the model ``name`` writes when no ``--train-dir`` is given.

    Example:
        >>> default_train_dir("digits"), default_train_dir("my.models:build")
        ('/tmp/digits_train', '/tmp/my.models_build_train')
    """
    return f"/tmp/{name.replace(':', '_').replace('/', '_')}_train"
