"""DevicePrefetcher: order, transform, bounded queue, resume position, errors, shutdown."""

from __future__ import annotations

import gc
import itertools
import threading

import pytest
import torch

from towerflow.data import (
    Dataset,
    DevicePrefetcher,
    Distortion,
    ShardedBatches,
    synthetic_cifar10,
)
from towerflow.errors import InvalidArgumentError
from towerflow.testing import wait_until

CPU = torch.device("cpu")


def _dataset() -> Dataset:
    return synthetic_cifar10(24, seed=0)


def test_batches_arrive_in_sampler_order_with_matching_labels() -> None:
    ds = _dataset()
    expected = list(itertools.islice(iter(ShardedBatches(24, 5, seed=3)), 7))
    with DevicePrefetcher(ds, ShardedBatches(24, 5, seed=3), CPU) as prefetcher:
        got = list(itertools.islice(prefetcher, 7))
    for index, (images, labels) in zip(expected, got, strict=True):
        assert torch.equal(images, ds.images[index])
        assert torch.equal(labels, ds.labels[index])


def test_transform_runs_on_each_batch() -> None:
    def transform(images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return images.float() / 255, labels + 100

    with DevicePrefetcher(_dataset(), ShardedBatches(24, 4), CPU, transform=transform) as p:
        images, labels = next(p)
    assert images.dtype == torch.float32 and float(images.max()) <= 1.0
    assert int(labels.min()) >= 100


def test_queue_holds_at_most_capacity_batches_ahead() -> None:
    sampler = ShardedBatches(24, 2)
    with DevicePrefetcher(_dataset(), sampler, CPU, capacity=2) as p:
        # Two batches queued plus one in the producer's hand, blocked on the full queue.
        wait_until(lambda: sampler.state()["offset"] >= 3 and p._queue.full(),
                   timeout=20.0, what="the queue full at offset 3")
        assert sampler.state()["offset"] == 3
        next(p)
        wait_until(lambda: sampler.state()["offset"] >= 4 and p._queue.full(),
                   timeout=20.0, what="the queue full at offset 4")
        assert sampler.state()["offset"] == 4


def test_state_is_the_position_after_the_last_consumed_batch() -> None:
    with DevicePrefetcher(_dataset(), ShardedBatches(24, 5, seed=1), CPU, capacity=3) as p:
        assert p.state() == {"epoch": 0, "offset": 0}
        consumed = [idx for idx, _ in zip(range(6), p, strict=False)]
        position = p.state()
    assert len(consumed) == 6
    assert position == {"epoch": 1, "offset": 2}
    reference = list(itertools.islice(iter(ShardedBatches(24, 5, seed=1)), 8))
    resumed = ShardedBatches(24, 5, seed=1)
    resumed.load_state(position)
    assert torch.equal(next(iter(resumed)), reference[6])


def test_resumed_run_distorts_every_later_batch_as_the_uninterrupted_run() -> None:
    ds = _dataset()

    def distorted(count: int, position: dict[str, int] | None = None,
                  seed: int = 7) -> tuple[list[torch.Tensor], dict[str, int]]:
        batches = ShardedBatches(24, 5, seed=1)
        if position:
            batches.load_state(position)
        with DevicePrefetcher(ds, batches, CPU, transform=Distortion(CPU, seed=seed)) as p:
            return [images for images, _ in itertools.islice(p, count)], p.state()

    whole, _ = distorted(9)
    first, position = distorted(4)
    resumed, _ = distorted(5, position)
    for a, b in zip(whole, first + resumed, strict=True):
        assert torch.equal(a, b)
    # the same images at another position, or with another seed, are distorted differently
    distortion, images = Distortion(CPU, seed=7), ds.images[:5]
    distortion.seek({"epoch": 0, "offset": 1})
    at_one, _ = distortion(images, ds.labels[:5])
    distortion.seek({"epoch": 0, "offset": 2})
    assert not torch.equal(distortion(images, ds.labels[:5])[0], at_one)
    assert not torch.equal(distorted(1, seed=8)[0][0], whole[0])


def test_producer_exception_is_raised_in_the_consumer() -> None:
    calls = []

    def transform(images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("bad batch number 2")
        return images, labels

    p = DevicePrefetcher(_dataset(), ShardedBatches(24, 4), CPU, transform=transform)
    try:
        next(p)
        with pytest.raises(ValueError, match=r"bad batch number 2"):
            next(p)
        wait_until(lambda: not p.running, timeout=20.0, what="the prefetcher stopped")
        with pytest.raises(StopIteration):
            next(p)
    finally:
        p.close()


def test_close_stops_the_thread_and_is_idempotent() -> None:
    p = DevicePrefetcher(_dataset(), ShardedBatches(24, 4), CPU)
    next(p)
    p.close()
    assert not p.running
    p.close()
    with pytest.raises(StopIteration):
        next(p)


def test_garbage_collected_prefetcher_stops_its_thread() -> None:
    p = DevicePrefetcher(_dataset(), ShardedBatches(24, 4), CPU)
    thread = p._thread
    next(p)
    del p
    gc.collect()
    wait_until(lambda: not thread.is_alive(), timeout=20.0, what="the thread ended")
    assert not [t for t in threading.enumerate() if t is thread]


def test_capacity_must_be_positive() -> None:
    with pytest.raises(InvalidArgumentError, match=r"capacity=0 must be a positive integer"):
        DevicePrefetcher(_dataset(), ShardedBatches(24, 4), CPU, capacity=0)


@pytest.mark.gpu
def test_batches_land_on_the_gpu_unchanged() -> None:
    ds = _dataset()
    expected = next(iter(ShardedBatches(24, 6)))
    with DevicePrefetcher(ds, ShardedBatches(24, 6), torch.device("cuda:0")) as p:
        images, labels = next(p)
        assert images.device.type == "cuda" and labels.device.type == "cuda"
        assert torch.equal(images.cpu(), ds.images[expected])
        assert torch.equal(labels.cpu(), ds.labels[expected])


@pytest.mark.gpu
def test_on_a_gpu_batches_load_in_the_consumers_thread_and_resume_alike() -> None:
    ds = _dataset()
    gpu = torch.device("cuda:0")
    before = set(threading.enumerate())
    with DevicePrefetcher(ds, ShardedBatches(24, 4, seed=1), gpu,
                          transform=Distortion(gpu, seed=5)) as p:
        assert not p.running and set(threading.enumerate()) == before
        first = [next(p) for _ in range(2)]
        position = p.state()
        expected = [next(p)[0].cpu() for _ in range(3)]
    batches = ShardedBatches(24, 4, seed=1)
    batches.load_state(position)
    with DevicePrefetcher(ds, batches, gpu, transform=Distortion(gpu, seed=5)) as resumed:
        again = [next(resumed)[0].cpu() for _ in range(3)]
    assert first[0][0].device == gpu and first[0][0].dtype == torch.float32
    for a, b in zip(expected, again, strict=True):
        assert torch.equal(a, b)
