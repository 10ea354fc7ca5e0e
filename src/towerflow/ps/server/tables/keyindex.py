"""An int64 key -> slot map in torch tensors: open addressing, vectorised probing.

A dynamic table's shard maps each id it holds (any int64) to a *slot*: the
index of its row in the store's row tensors. :class:`KeyIndex` keeps that
map with no Python object per key:

- ``keys``: int64 ``(capacity,)``, the key held in each slot;
- ``table``: int32 ``(2**k,)``, an open-addressing hash table of slot
  numbers (``-1`` empty, ``-2`` a deleted entry), probed linearly from
  the top ``k`` bits of ``key * 0x9E3779B97F4A7C15`` (Fibonacci hashing);
- a free list of slots (an int64 stack) that :meth:`remove` fills and
  :meth:`insert` takes from first.

Every operation is on a whole batch, never a Python step per key: a
lookup reads each key's home position in one element-wise pass, then
windows of 8 positions for the few keys not settled there (numpy over the
tensors' memory); an insert places keys round by round, one key per free
position and round (the first of those that want it). The table is kept at most
:data:`MAX_LOAD` full (entries and deleted entries); past it, it is rebuilt
(at twice the size when the live keys need it). Per key: 8 bytes of key
plus 7 to 13 bytes of table (load between 0.3 and 0.6).

Why not sorted keys with ``searchsorted``: a lookup is one call there, but
each batch of new keys is a merge that moves every key after the first new
one (at 10M rows, ~80 MB per step); an open-addressing table inserts in
place.

Example:
    >>> import torch
    >>> index = KeyIndex()
    >>> index.insert(torch.tensor([-2**63, 7, 2**63 - 1])).tolist()
    [0, 1, 2]
    >>> index.find(torch.tensor([7, 8, -2**63])).tolist()
    [1, -1, 0]
    >>> index.remove(torch.tensor([1])); index.find(torch.tensor([7])).tolist()
    [-1]
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["KeyIndex", "MAX_LOAD"]

#: most entries (live and deleted) per table position before a rebuild
MAX_LOAD = 0.6
_EMPTY, _DELETED = -1, -2
_FIB = -7046029254386353131  # 0x9E3779B97F4A7C15 (2**64 / golden ratio) as int64
_MIN_TABLE = 1 << 10
_WINDOW = 8  # table positions a probe round reads per key


class KeyIndex:
    """Int64 keys to dense slot numbers (see the module docstring).

    Args:
        capacity: slots to reserve at first.
        on_grow: called with the new number of slots whenever the key array
            grows (the store grows its row tensors alike).
    """

    def __init__(self, capacity: int = 1024, on_grow: object = None) -> None:
        capacity = max(16, int(capacity))
        self.keys = torch.empty(capacity, dtype=torch.int64)
        self._table = torch.full((_table_size(capacity),), _EMPTY, dtype=torch.int32)
        self._mask = self._table.numel() - 1
        self._free = torch.empty(0, dtype=torch.int64)
        self._used = 0  # slots ever handed out (high-water mark)
        self._live = 0
        self._deleted = 0
        self._on_grow = on_grow

    @property
    def live(self) -> int:
        """Keys held."""
        return self._live

    @property
    def used(self) -> int:
        """Slots below this number may be live; above it none is."""
        return self._used

    @property
    def nbytes(self) -> int:
        """Bytes of the key array, the table and the free list."""
        return (self.keys.numel() * 8 + self._table.numel() * 4 + self._free.numel() * 8)

    def _home(self, keys: torch.Tensor) -> torch.Tensor:
        # Fibonacci hashing: the top bits of key * 2**64 / golden ratio (three element-wise
        # ops; independent of the partitioner's splitmix64, which picked this shard)
        bits = self._mask.bit_length()
        return ((keys * _FIB) >> (64 - bits)) & self._mask

    def _probe(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot or -1, table position or -1) of each key.

        A first pass reads each key's home position (most keys sit there: the
        table is at most ``MAX_LOAD`` full); then each round reads a window of
        ``_WINDOW`` positions per key still looking. A key stops at its match
        or at the first empty position (no key lies past an empty one on its
        path: a removal leaves a deleted mark, not an empty). Run in numpy over
        the tensors' memory: on arrays of a batch's size its calls cost a few
        microseconds each, torch's several times more.
        """
        table, held, look = self._table.numpy(), self.keys.numpy(), keys.numpy()
        mask = np.int64(self._mask)
        pos = self._home(keys).numpy()
        entry = table[pos].astype(np.int64)
        match = (entry >= 0) & (held[np.maximum(entry, 0)] == look)
        slot = np.where(match, entry, -1)
        where = np.where(match, pos, -1)
        active = np.flatnonzero(~(match | (entry == _EMPTY)))
        pos = (pos[active] + 1) & mask
        offsets = np.arange(_WINDOW, dtype=np.int64)
        while active.size:
            cand = (pos[:, None] + offsets) & mask
            entry = table[cand].astype(np.int64)
            match = (entry >= 0) & (held[np.maximum(entry, 0)] == look[active][:, None])
            stop = match | (entry == _EMPTY)
            ended = stop.any(1)
            first = stop.argmax(1)
            rows = np.arange(active.size)
            hit = ended & match[rows, first]
            slot[active[hit]] = entry[rows, first][hit]
            where[active[hit]] = cand[rows, first][hit]
            active, pos = active[~ended], (pos[~ended] + _WINDOW) & mask
        return torch.from_numpy(slot), torch.from_numpy(where)

    def find(self, keys: torch.Tensor) -> torch.Tensor:
        """The slot of each key, ``-1`` where it is not held."""
        if not keys.numel():
            return torch.empty(0, dtype=torch.int64)
        return self._probe(keys)[0]

    def insert(self, keys: torch.Tensor) -> torch.Tensor:
        """Give each key (unique, none held yet) a slot; return the slots, in order."""
        n = keys.numel()
        if not n:
            return torch.empty(0, dtype=torch.int64)
        slots = self._take(n)
        self.keys.index_copy_(0, slots, keys)
        if (self._live + self._deleted + n) > MAX_LOAD * self._table.numel():
            self._live += n
            self._rebuild()
            return slots
        self._place(keys, slots)
        self._live += n
        return slots

    def _place(self, keys: torch.Tensor, slots: torch.Tensor) -> None:
        """Put ``slots`` into the table at their keys' first free positions."""
        pos = self._home(keys)
        active = torch.arange(keys.numel())
        while active.numel():
            entry = self._table.index_select(0, pos)
            free = entry < 0
            if bool(free.any()):
                cand = free.nonzero().view(-1)
                cpos = pos[cand]
                # one key per free position: the first of those that want it
                uniq, inverse = torch.unique(cpos, return_inverse=True)
                first = torch.full((uniq.numel(),), cand.numel(), dtype=torch.int64)
                first.scatter_reduce_(0, inverse, torch.arange(cand.numel()), "amin")
                won = cand[first]
                reused = int((entry[won] == _DELETED).sum())
                self._deleted -= reused
                self._table.index_copy_(0, pos[won], slots[active[won]].to(torch.int32))
                keep = torch.ones(active.numel(), dtype=torch.bool)
                keep[won] = False
            else:
                keep = torch.ones(active.numel(), dtype=torch.bool)
            # the losers of a position try it again (now taken: they move on next round)
            step = (~free).to(torch.int64)
            active, pos = active[keep], ((pos + step) & self._mask)[keep]

    def _take(self, n: int) -> torch.Tensor:
        """``n`` free slots: the free list's first, then new ones (growing the arrays)."""
        reuse = min(n, self._free.numel())
        taken = self._free[self._free.numel() - reuse:]
        self._free = self._free[:self._free.numel() - reuse]
        fresh = n - reuse
        if self._used + fresh > self.keys.numel():
            self._grow(self._used + fresh)
        new = torch.arange(self._used, self._used + fresh, dtype=torch.int64)
        self._used += fresh
        return torch.cat([taken, new]) if reuse else new

    def _grow(self, need: int) -> None:
        size = max(need, self.keys.numel() + self.keys.numel() // 4 + 16)
        keys = torch.empty(size, dtype=torch.int64)
        keys[:self._used] = self.keys[:self._used]
        self.keys = keys
        if callable(self._on_grow):
            self._on_grow(size)

    def remove(self, slots: torch.Tensor) -> None:
        """Forget the keys of ``slots`` (held, unique); the slots go to the free list."""
        if not slots.numel():
            return
        _, where = self._probe(self.keys.index_select(0, slots))
        self._table.index_fill_(0, where, _DELETED)
        self._deleted += slots.numel()
        self._live -= slots.numel()
        self._free = torch.cat([self._free, slots])
        if self._live + self._deleted > MAX_LOAD * self._table.numel():
            self._rebuild()

    def live_slots(self) -> torch.Tensor:
        """The slots that hold a key, ascending."""
        held = self._table[self._table >= 0].to(torch.int64)
        return torch.sort(held).values

    def _rebuild(self) -> None:
        """A fresh table for the live keys (bigger when they need it); no deleted entries."""
        # the slots being inserted are not in the table yet: every used slot not free is live
        used = torch.ones(self._used, dtype=torch.bool)
        used[self._free] = False
        live = used.nonzero().view(-1)
        self._table = torch.full((_table_size(live.numel()),), _EMPTY, dtype=torch.int32)
        self._mask = self._table.numel() - 1
        self._deleted = 0
        self._place(self.keys.index_select(0, live), live)

    def clear(self) -> None:
        """Forget every key (the slots' arrays keep their size)."""
        self._table.fill_(_EMPTY)
        self._free = torch.empty(0, dtype=torch.int64)
        self._used = self._live = self._deleted = 0


def _table_size(keys: int) -> int:
    """A power of two that holds ``keys`` at load at most ``MAX_LOAD / 2`` (then room to grow)."""
    size = _MIN_TABLE
    while size * MAX_LOAD / 2 < keys:
        size *= 2
    return size
