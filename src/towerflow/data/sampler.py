"""Deterministic, resumable, sharded batches of example indices.

Every epoch has one permutation of the data set, computed from ``(seed,
epoch)`` alone, so every replica computes the same one without talking to the
others. Replica ``rank`` of ``world_size`` takes every ``world_size``-th
example of it, starting at ``rank`` (the shards are disjoint and together
cover the epoch), and cuts its shard into batches. Every replica gets the same
number of batches per epoch, which synchronous training needs.

The position is two integers (epoch, batches taken in that epoch): saved with
a checkpoint and loaded back, the iterator yields exactly the batches it would
have yielded without the interruption.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

import torch

from towerflow.errors import InvalidArgumentError

__all__ = ["ShardedBatches"]

_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant decorrelating (seed, epoch) pairs


def _positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(f"{name}={value!r} must be a positive integer.")


class ShardedBatches:
    """An infinite iterator of int64 index batches for one replica.

    Args:
        num_examples: Size of the data set.
        batch_size: Examples per batch on this replica.
        rank: This replica's index, ``0 <= rank < world_size``.
        world_size: Number of replicas sharing the data.
        seed: Decides every epoch's permutation (same on all replicas).
        drop_last: Drop the incomplete tail of an epoch so that every batch
            has ``batch_size`` examples; otherwise the epoch is padded by
            wrapping around so all replicas have the same number of examples,
            and the last batch may be smaller.

    Example:
        >>> b = ShardedBatches(10, 2, rank=1, world_size=2, seed=0)
        >>> b.batches_per_epoch
        2
        >>> it = iter(b); first = next(it); b.state()
        {'epoch': 0, 'offset': 1}
    """

    def __init__(
        self,
        num_examples: int,
        batch_size: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        _positive("num_examples", num_examples)
        _positive("batch_size", batch_size)
        _positive("world_size", world_size)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise InvalidArgumentError(f"rank={rank!r} must be in 0..{world_size - 1} (world_size={world_size}).")
        if drop_last and num_examples < batch_size * world_size:
            raise InvalidArgumentError(
                f"{num_examples} examples cannot fill one batch of {batch_size} on each of "
                f"{world_size} replicas; lower the batch size or pass drop_last=False."
            )
        self.num_examples = num_examples
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.drop_last = drop_last
        self._epoch = 0
        self._offset = 0
        self._cache: tuple[int, torch.Tensor] | None = None

    def __repr__(self) -> str:
        return (
            f"ShardedBatches(num_examples={self.num_examples}, batch_size={self.batch_size}, "
            f"rank={self.rank}, world_size={self.world_size}, seed={self.seed}, "
            f"drop_last={self.drop_last})"
        )

    @property
    def per_replica(self) -> int:
        """Examples this replica sees per epoch."""
        if self.drop_last:
            return self.num_examples // (self.batch_size * self.world_size) * self.batch_size
        return math.ceil(self.num_examples / self.world_size)

    @property
    def batches_per_epoch(self) -> int:
        """Batches this replica yields per epoch (the same on every replica)."""
        return math.ceil(self.per_replica / self.batch_size)

    def permutation(self, epoch: int) -> torch.Tensor:
        """The whole data set's order in ``epoch`` (identical on every replica)."""
        gen = torch.Generator().manual_seed((self.seed * _MIX + epoch) % (1 << 63))
        return torch.randperm(self.num_examples, generator=gen)

    def shard(self, epoch: int) -> torch.Tensor:
        """This replica's examples of ``epoch``, in order."""
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        perm = self.permutation(epoch)
        total = self.per_replica * self.world_size
        if total > len(perm):  # pad by wrapping around so every replica has as many
            perm = perm.repeat(math.ceil(total / len(perm)))
        mine = perm[:total][self.rank :: self.world_size].contiguous()
        self._cache = (epoch, mine)
        return mine

    def state(self) -> dict[str, int]:
        """The position: the current epoch and the batches already taken in it."""
        self._normalise()
        return {"epoch": self._epoch, "offset": self._offset}

    def load_state(self, state: Mapping[str, int]) -> None:
        """Continue from a position that :meth:`state` returned."""
        epoch, offset = state.get("epoch"), state.get("offset")
        if not isinstance(epoch, int) or not isinstance(offset, int) or epoch < 0 or offset < 0:
            raise InvalidArgumentError(
                f"Data position {dict(state)!r} is not {{'epoch': int >= 0, 'offset': int >= 0}}."
            )
        self._epoch, self._offset = epoch, offset
        self._normalise()

    def _normalise(self) -> None:
        epochs, self._offset = divmod(self._offset, self.batches_per_epoch)
        self._epoch += epochs

    def __iter__(self) -> Iterator[torch.Tensor]:
        """Yield batches forever from the current position (which advances)."""
        while True:
            self._normalise()
            start = self._offset * self.batch_size
            batch = self.shard(self._epoch)[start : start + self.batch_size]
            self._offset += 1
            yield batch
