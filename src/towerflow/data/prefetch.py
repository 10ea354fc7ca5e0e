"""Background prefetch of batches onto the training device.

A :class:`DevicePrefetcher` runs one background thread that gathers the next
batches from an in-memory :class:`~towerflow.data.dataset.Dataset`, copies
them to the device and applies the transform (e.g. :func:`distort_images`),
keeping at most ``capacity`` batches ready in a bounded queue, so the copy and
the distortion of the next batch overlap the training step of this one.

On CUDA the host batch is pinned and copied with ``non_blocking=True`` on a
side stream; the consumer's stream waits on an event recorded after the
transform, so batches are never used before they are ready.

A transform with a ``seek(position)`` method (:class:`~towerflow.data.Distortion`)
is told each batch's position (``{"epoch": e, "offset": o}`` after the batch)
before it is applied, so its randomness can follow the data position and a
resumed run transforms every batch as an uninterrupted one would.

The thread stops when :meth:`DevicePrefetcher.close` is called, when the
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
    ready: Any  # torch.cuda.Event or None


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
    """The background thread's loop; holds no reference to the prefetcher."""
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    try:
        it = iter(batches)
        while not stop.is_set():
            try:
                index = next(it)
            except StopIteration:
                _put(q, _End(), stop)
                return
            position = batches.state()
            if stream is not None:
                with torch.cuda.stream(stream):
                    images, labels = _load(dataset, index, device, transform, position)
                    ready = torch.cuda.Event()
                    ready.record(stream)
            else:
                images, labels = _load(dataset, index, device, transform, position)
                ready = None
            if not _put(q, _Batch(images, labels, position, ready), stop):
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
        capacity: Batches kept ready ahead of the consumer (2 x replicas is
            the usual choice).
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
        if item.ready is not None:
            consumer = torch.cuda.current_stream(self.device)
            consumer.wait_event(item.ready)
            item.images.record_stream(consumer)
            item.labels.record_stream(consumer)
        self._position = item.position
        return item.images, item.labels

    def state(self) -> dict[str, int]:
        """The sampler position after the last batch handed out (for a checkpoint)."""
        return dict(self._position)

    def close(self) -> None:
        """Stop the background thread and drop the prefetched batches (idempotent)."""
        self._finalizer()

    @property
    def running(self) -> bool:
        """Whether the background thread is alive."""
        return self._thread.is_alive()

    def __enter__(self) -> DevicePrefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
