"""Input pipelines of the loop: a replica's batches, on its device, with a resumable position.

Two kinds of input are accepted:

* a :class:`towerflow.data.Dataset` — sharded per replica with
  :class:`~towerflow.data.ShardedBatches`, prefetched onto the device
  (:class:`~towerflow.data.DevicePrefetcher`: a background thread on the CPU,
  capacity ``2 x replicas`` as in article 001; on a GPU the batches are
  queued on the step's stream) and transformed there (the distorted inputs);
  its position (epoch, offset) goes into every checkpoint;
* any iterable of batches (a ``DataLoader``, a generator...) — moved to the
  device as it comes; restarted when exhausted (a new epoch); resumable when
  it has ``state()`` / ``load_state()`` methods.

The prefetch runs ahead of the step; the position saved is the one after the
last batch the step *used* (the prefetcher hands it out with the batch).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from towerflow.errors import InvalidArgumentError

__all__ = ["Pipeline", "DatasetPipeline", "IterablePipeline", "ReadAhead", "make_pipeline",
           "to_device"]

Transform = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def to_device(batch: Any, device: torch.device) -> Any:
    """Move the tensors of a (nested) batch to ``device``
    (:func:`towerflow.devices.move_to_device`)."""
    from towerflow.devices import move_to_device

    return move_to_device(batch, device)


def _leading_dim(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, (tuple, list)) and batch:
        return _leading_dim(batch[0])
    if isinstance(batch, Mapping) and batch:
        return _leading_dim(next(iter(batch.values())))
    return 1


class Pipeline:
    """A replica's stream of batches on its device."""

    def __next__(self) -> Any:
        raise NotImplementedError

    def __iter__(self) -> Pipeline:
        return self

    def position(self) -> dict[str, Any] | None:
        """JSON-able position after the last batch returned, or None if not resumable."""
        return None

    def examples_per_batch(self) -> int:
        """Examples in this replica's batch (for examples/sec)."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop background threads. Idempotent."""


class DatasetPipeline(Pipeline):
    """Sharded, prefetched, on-device-transformed batches of a towerflow Dataset."""

    def __init__(self, dataset: Any, *, device: torch.device, batch_size: int, rank: int,
                 world_size: int, seed: int, capacity: int, transform: Transform | None,
                 position: Mapping[str, int] | None = None) -> None:
        from towerflow.data import DevicePrefetcher, ShardedBatches

        batches = ShardedBatches(len(dataset.labels), batch_size, rank=rank,
                                 world_size=world_size, seed=seed)
        if position:
            batches.load_state(position)
        self._batch_size = batch_size
        self._prefetcher = DevicePrefetcher(dataset, batches, device, capacity=capacity,
                                            transform=transform)

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return next(self._prefetcher)

    def position(self) -> dict[str, Any]:
        return self._prefetcher.state()

    def examples_per_batch(self) -> int:
        return self._batch_size

    def close(self) -> None:
        self._prefetcher.close()


class IterablePipeline(Pipeline):
    """Batches of any iterable, moved to the device; restarted when it runs out."""

    def __init__(self, data: Iterable[Any], *, device: torch.device,
                 position: Mapping[str, Any] | None = None) -> None:
        self._data = data
        self._device = device
        self._resumable = callable(getattr(data, "state", None)) and callable(
            getattr(data, "load_state", None))
        if position and self._resumable:
            data.load_state(position)  # type: ignore[attr-defined]
        self._iter = iter(data)
        self._examples = 0

    def __next__(self) -> Any:
        try:
            batch = next(self._iter)
        except StopIteration:
            self._iter = iter(self._data)
            try:
                batch = next(self._iter)
            except StopIteration:
                raise InvalidArgumentError(
                    "The training data yielded no batch; pass a non-empty dataset or iterable."
                ) from None
        self._examples = _leading_dim(batch)
        return to_device(batch, self._device)

    def position(self) -> dict[str, Any] | None:
        if not self._resumable:
            return None
        return dict(self._data.state())  # type: ignore[attr-defined]

    def examples_per_batch(self) -> int:
        return self._examples


class ReadAhead(Pipeline):
    """``pipeline`` read one batch ahead (:meth:`peek`), for a strategy that uses the next
    step's batch while this step runs (:attr:`~towerflow.strategies.base.Strategy.reads_ahead`);
    its position is still the one after the last batch returned, so a checkpoint resumes
    with the batch read ahead."""

    def __init__(self, pipeline: Pipeline) -> None:
        self._inner = pipeline
        self._held: tuple[Any, dict[str, Any] | None, int] | None = None
        self._position = pipeline.position()
        self._examples: int | None = None

    def _read(self) -> tuple[Any, dict[str, Any] | None, int]:
        batch = next(self._inner)
        return batch, self._inner.position(), self._inner.examples_per_batch()

    def __next__(self) -> Any:
        held, self._held = self._held, None
        batch, self._position, self._examples = held if held is not None else self._read()
        return batch

    def peek(self) -> Any:
        """The next batch, read now and returned by the next ``next()``."""
        if self._held is None:
            self._held = self._read()
        return self._held[0]

    def position(self) -> dict[str, Any] | None:
        return self._position

    def examples_per_batch(self) -> int:
        return self._inner.examples_per_batch() if self._examples is None else self._examples

    def close(self) -> None:
        self._inner.close()


def make_pipeline(data: Any, *, device: torch.device, batch_size: int, rank: int,
                  world_size: int, seed: int, capacity: int, transform: Transform | None,
                  position: Mapping[str, Any] | None) -> Pipeline:
    """The pipeline for ``data``: a towerflow Dataset or an iterable of batches."""
    from towerflow.data import Dataset

    if isinstance(data, Dataset):
        return DatasetPipeline(data, device=device, batch_size=batch_size, rank=rank,
                               world_size=world_size, seed=seed, capacity=capacity,
                               transform=transform, position=position)
    if transform is not None:
        raise InvalidArgumentError(
            "transform= applies to a towerflow.data.Dataset; apply it in your own iterable "
            f"({type(data).__name__}) instead."
        )
    if not isinstance(data, Iterable):
        raise InvalidArgumentError(
            f"Training data must be a towerflow.data.Dataset or an iterable of batches, "
            f"got {type(data).__name__}."
        )
    return IterablePipeline(data, device=device, position=position)
