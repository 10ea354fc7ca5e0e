"""ShardedBatches: shared permutation, disjoint shards, equal counts, exact resume."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from towerflow.data import ShardedBatches
from towerflow.errors import InvalidArgumentError


def _take(batches: ShardedBatches, n: int) -> list[torch.Tensor]:
    return list(itertools.islice(iter(batches), n))


def test_one_epoch_of_all_ranks_covers_the_permutation_disjointly() -> None:
    world = 3
    samplers = [ShardedBatches(30, 5, rank=r, world_size=world, seed=7) for r in range(world)]
    shards = [torch.cat(_take(s, s.batches_per_epoch)) for s in samplers]
    together = torch.cat(shards)
    assert sorted(together.tolist()) == list(range(30))
    assert all(s.batches_per_epoch == 2 for s in samplers)
    perm = samplers[0].permutation(0)
    assert torch.equal(shards[1], perm[1::3])


def test_drop_last_gives_full_batches_and_equal_counts_on_every_rank() -> None:
    samplers = [ShardedBatches(23, 4, rank=r, world_size=2, seed=0) for r in range(2)]
    for s in samplers:
        batches = _take(s, s.batches_per_epoch)
        assert [len(b) for b in batches] == [4, 4]
        assert all(b.dtype == torch.int64 for b in batches)


def test_without_drop_last_epoch_is_padded_so_ranks_stay_in_step() -> None:
    samplers = [ShardedBatches(7, 2, rank=r, world_size=2, seed=0, drop_last=False) for r in range(2)]
    sizes = [[len(b) for b in _take(s, s.batches_per_epoch)] for s in samplers]
    assert sizes == [[2, 2], [2, 2]]
    seen = torch.cat([torch.cat(_take(ShardedBatches(7, 2, rank=r, world_size=2, drop_last=False), 2)) for r in range(2)])
    assert set(seen.tolist()) == set(range(7))


def test_each_epoch_has_a_new_order_the_same_for_the_same_seed() -> None:
    a = ShardedBatches(12, 12, seed=5)
    first, second = _take(a, 2)
    assert not torch.equal(first, second)
    assert sorted(first.tolist()) == sorted(second.tolist())
    again = _take(ShardedBatches(12, 12, seed=5), 2)
    assert torch.equal(again[0], first) and torch.equal(again[1], second)
    assert not torch.equal(_take(ShardedBatches(12, 12, seed=6), 1)[0], first)


def test_state_and_load_state_resume_the_exact_same_batches() -> None:
    reference = _take(ShardedBatches(20, 3, rank=1, world_size=2, seed=9), 11)
    interrupted = ShardedBatches(20, 3, rank=1, world_size=2, seed=9)
    _take(interrupted, 4)
    saved = json.loads(json.dumps(interrupted.state()))
    resumed = ShardedBatches(20, 3, rank=1, world_size=2, seed=9)
    resumed.load_state(saved)
    rest = _take(resumed, 7)
    for a, b in zip(reference[4:], rest, strict=True):
        assert torch.equal(a, b)
    assert resumed.state() == {"epoch": 3, "offset": 2}


def test_an_offset_past_the_epoch_continues_in_the_following_epochs() -> None:
    reference = ShardedBatches(20, 3, rank=1, world_size=2, seed=9)  # 3 batches per epoch
    expected = _take(reference, 9)[7:]
    jumped = ShardedBatches(20, 3, rank=1, world_size=2, seed=9)
    jumped.load_state({"epoch": 0, "offset": 7})
    assert jumped.state() == {"epoch": 2, "offset": 1}
    for a, b in zip(expected, _take(jumped, 2), strict=True):
        assert torch.equal(a, b)


def test_invalid_arguments_are_refused() -> None:
    with pytest.raises(InvalidArgumentError, match=r"rank=2 must be in 0\.\.1"):
        ShardedBatches(10, 2, rank=2, world_size=2)
    with pytest.raises(InvalidArgumentError, match=r"5 examples cannot fill one batch of 4 on each of 2 replicas"):
        ShardedBatches(5, 4, world_size=2)
    with pytest.raises(InvalidArgumentError, match=r"batch_size=0 must be a positive integer"):
        ShardedBatches(5, 0)
    with pytest.raises(InvalidArgumentError, match=r"Data position .* is not"):
        ShardedBatches(5, 1).load_state({"epoch": -1, "offset": 0})
