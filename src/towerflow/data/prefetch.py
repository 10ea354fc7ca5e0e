"""Prefetch of batches onto the training device.

A :class:`DevicePrefetcher` hands out ``(images, labels)`` batches of an
in-memory :class:`~towerflow.data.dataset.Dataset`, already on the device and
transformed there (e.g. :func:`distort_images`).

On the CPU one background thread gathers the next batches and applies the
transform, keeping at most ``capacity`` batches ready in a bounded queue, so
the distortion of the next batch runs on another core while this one trains.

On a GPU the batch is gathered, pinned, copied with ``non_blocking=True`` and
transformed in the consumer's thread, on its current stream: the copy and
the distortion are queued on the GPU ahead of the step like its own kernels,
so the host never waits for them, and no second Python thread competes for
the interpreter lock. A training step on a GPU is mostly kernel launches
from Python; a producer thread launching the copy and the ~20 distortion
kernels beside it made every launch of the step wait its turn for the lock
(measured on an H200 with article 001's CIFAR-10 model: 0.73x the
examples/sec of the same work in one thread; ``benchmarks/train_vs_plain.py``).

A transform with a ``seek(position)`` method (:class:`~towerflow.data.Distortion`)
is told each batch's position (``{"epoch": e, "offset": o}`` after the batch)
before it is applied, so its randomness can follow the data position and a
resumed run transforms every batch as an uninterrupted one would.

The CPU thread stops when :meth:`DevicePrefetcher.close` is called, when the
prefetcher is used as a context manager and the block ends, or when the
prefetcher is garbage-collected. An exception raised while producing a batch
is raised again in the consumer, by the next ``next()``.

Example:
    >>> from towerflow.data import ShardedBatches, synthetic_cifar10
    >>> ds = synthetic_cifar10(8)
    >>> with DevicePrefetcher(ds, ShardedBatches(8, 4), torch.device("cpu")) as batches:
    ...     images, labels = next(iter(batches))
    >>> images.shape, labels.shape
    (torch.Size([4, 3, 32, 32]), torch.Size([4]))
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from towerflow.data.dataset import Dataset
from towerflow.data.sampler import ShardedBatches
from towerflow.errors import InvalidArgumentError

__all__ = ["DevicePrefetcher"]

Transform = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

_POLL = 0.05  # seconds between checks of the stop flag while blocked on the queue


@dataclass(frozen=True, slots=True)
class _Batch:
    images: torch.Tensor
    labels: torch.Tensor
    position: dict[str, int]  # sampler position after this batch


@dataclass(frozen=True, slots=True)
class _Failure:
    error: BaseException


class _End:
    """The batches ran out (a finite iterator)."""


def _put(q: queue.Queue[Any], item: Any, stop: threading.Event) -> bool:
    while not stop.is_set():
        try:
            q.put(item, timeout=_POLL)
            return True
        except queue.Full:
            continue
    return False


def _load(
    dataset: Dataset, index: torch.Tensor, device: torch.device, transform: Transform | None,
    position: dict[str, int],
) -> tuple[torch.Tensor, torch.Tensor]:
    images = dataset.images.index_select(0, index)
    labels = dataset.labels.index_select(0, index)
    if device.type == "cuda":
        images = images.pin_memory().to(device, non_blocking=True)
        labels = labels.pin_memory().to(device, non_blocking=True)
    elif device.type != "cpu":
        images, labels = images.to(device), labels.to(device)
    if transform is not None:
        seek = getattr(transform, "seek", None)
        if seek is not None:
            seek(position)
        images, labels = transform(images, labels)
    return images, labels


def _produce(
    dataset: Dataset,
    batches: ShardedBatches,
    device: torch.device,
    transform: Transform | None,
    q: queue.Queue[Any],
    stop: threading.Event,
) -> None:
    """The background thread's loop (CPU devices); holds no reference to the prefetcher."""
    try:
        it = iter(batches)
        while not stop.is_set():
            try:
                index = next(it)
            except StopIteration:
                _put(q, _End(), stop)
                return
            position = batches.state()
            images, labels = _load(dataset, index, device, transform, position)
            if not _put(q, _Batch(images, labels, position), stop):
                return
    except BaseException as exc:  # handed to the consumer, raised there
        _put(q, _Failure(exc), stop)


def _shutdown(stop: threading.Event, q: queue.Queue[Any], thread: threading.Thread) -> None:
    stop.set()
    while True:  # unblock a producer waiting on a full queue
        try:
            q.get_nowait()
        except queue.Empty:
            break
    if thread.is_alive() and thread is not threading.current_thread():
        thread.join(timeout=10.0)


class DevicePrefetcher:
    """Iterate ``(images, labels)`` batches already on ``device``.

    Args:
        dataset: The in-memory examples (CPU tensors).
        batches: Index batches; owned by the background thread from now on
            (read the position with :meth:`state`, not ``batches.state()``).
        device: Where batches go.
        capacity: Batches kept ready ahead of the consumer by the CPU thread
            (2 x replicas is the usual choice); on a GPU the stream queues them.
        transform: Applied on ``device`` to each ``(images, labels)``.
    """

    def __init__(
        self,
        dataset: Dataset,
        batches: ShardedBatches,
        device: torch.device,
        capacity: int = 2,
        transform: Transform | None = None,
    ) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise InvalidArgumentError(f"Prefetch capacity={capacity!r} must be a positive integer.")
        self.device = torch.device(device)
        self.capacity = capacity
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=capacity)
        self._stop = threading.Event()
        self._position = batches.state()
        self._finished = False
        self._inline: tuple[Dataset, ShardedBatches, Iterator[torch.Tensor],
                            Transform | None] | None = None
        if self.device.type == "cuda":  # loaded in the consumer's thread, queued on its stream
            self._inline = (dataset, batches, iter(batches), transform)
            self._thread: threading.Thread | None = None
            self._finalizer: weakref.finalize | None = None  # no thread to stop
            return
        self._thread = threading.Thread(
            target=_produce,
            args=(dataset, batches, self.device, transform, self._queue, self._stop),
            name="towerflow-prefetch",
            daemon=True,
        )
        self._finalizer = weakref.finalize(self, _shutdown, self._stop, self._queue, self._thread)
        self._thread.start()

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._finished or self._stop.is_set():
            raise StopIteration
        if self._inline is not None:
            return self._next_inline(*self._inline)
        while True:
            try:
                item = self._queue.get(timeout=_POLL)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    self._finished = True
                    raise StopIteration from None
        if isinstance(item, _Failure):
            self._finished = True
            self.close()
            raise item.error
        if isinstance(item, _End):
            self._finished = True
            raise StopIteration
        self._position = item.position
        return item.images, item.labels

    def _next_inline(self, dataset: Dataset, batches: ShardedBatches,
                     it: Iterator[torch.Tensor],
                     transform: Transform | None) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            index = next(it)
        except StopIteration:
            self._finished = True
            raise
        position = batches.state()
        images, labels = _load(dataset, index, self.device, transform, position)
        self._position = position
        return images, labels

    def state(self) -> dict[str, int]:
        """The sampler position after the last batch handed out (for a checkpoint)."""
        return dict(self._position)

    def close(self) -> None:
        """Stop the background thread and drop the prefetched batches (idempotent)."""
        self._stop.set()
        if self._finalizer is not None:
            self._finalizer()

    @property
    def running(self) -> bool:
        """Whether the background thread is alive (there is none on a GPU)."""
        return self._thread is not None and self._thread.is_alive()

    def __enter__(self) -> DevicePrefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
