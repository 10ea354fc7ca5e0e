"""The dynamic table's side of ``sparse_embedding.py --dynamic`` (no command of its own).

- :func:`raw_ids`: the click workload's Zipf ranks mapped through a fixed random
  64-bit permutation (``splitmix64`` of the rank xor a key: a bijection of the
  int64 space), so the ids are spread over the whole 64-bit range as hashed
  feature ids are, and a rank keeps its id across workers and runs;
- :func:`memory_per_row`: a ps shard's dynamic row store (32 floats, Adagrad)
  filled with ``rows`` distinct raw ids in batches of 65,536 updates, in this
  process: bytes per stored row, by the store's count and by the process's
  resident memory, against 8 bytes of key + row bytes + slot bytes;
- :func:`capacity_memory`: a store with ``capacity`` rows fed ten times as
  many distinct ids; its bytes and the process's resident memory sampled as
  they pass.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from towerflow.ps.partition import HashPartitioner, splitmix64
from towerflow.ps.server.tables.dynamic import DynamicRowStore
from towerflow.ps.spec.initializers import UniformRows
from towerflow.ps.spec.row_optimizers import SparseAdagrad

#: the permutation's key (any fixed value)
KEY = 0x2545F4914F6CDD1D


def raw_ids(ranks: torch.Tensor) -> torch.Tensor:
    """The 64-bit raw id of each Zipf rank (a bijection: distinct ranks, distinct ids)."""
    return splitmix64(ranks ^ KEY)


def rss() -> int:
    """This process's resident memory now (VmRSS), bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _store(dim: int, capacity: int | None = None) -> DynamicRowStore:
    return DynamicRowStore(HashPartitioner(1), 0, dim, SparseAdagrad(),
                           initializer=UniformRows(),
                           options={"admit_after": 1, "evict_after_steps": None,
                                    "capacity": capacity})


def memory_per_row(rows: int, dim: int, batch: int = 65_536) -> dict:
    """Bytes per stored row of a store holding ``rows`` rows (see the module docstring)."""
    torch.set_num_threads(1)
    before = rss()
    store = _store(dim)
    start = time.perf_counter()
    for first in range(0, rows, batch):
        ranks = torch.arange(first, min(first + batch, rows), dtype=torch.int64)
        store.apply(raw_ids(ranks), torch.full((ranks.numel(), dim), 0.01), 0.1, 1 + first)
    seconds = time.perf_counter() - start
    after = rss()
    ideal = 8 + dim * 4 * 2  # key + row + Adagrad accumulator
    probe = raw_ids(torch.randint(0, rows, (16_384,)))
    t0 = time.perf_counter()
    for _ in range(20):
        store.lookup(probe, checked=True)
    lookup_us = (time.perf_counter() - t0) / 20 / probe.numel() * 1e6
    return {"rows": store.num_rows, "store_bytes_per_row": store.nbytes / store.num_rows,
            "rss_bytes_per_row": (after - before) / store.num_rows, "ideal": ideal,
            "insert_us_per_row": seconds / rows * 1e6, "lookup_us_per_id": lookup_us}


def capacity_memory(capacity: int, dim: int, batch: int = 8_192) -> dict:
    """Bytes and RSS of a store of ``capacity`` rows fed ``10 * capacity`` distinct ids."""
    torch.set_num_threads(1)
    store = _store(dim, capacity)
    samples = []
    total = 10 * capacity
    for step, first in enumerate(range(0, total, batch), start=1):
        ranks = torch.arange(first, min(first + batch, total), dtype=torch.int64)
        store.apply(raw_ids(ranks), torch.full((ranks.numel(), dim), 0.01), 0.1, step)
        if first >= capacity:  # the table has reached its capacity
            samples.append((store.nbytes, rss()))
    quarter = len(samples) // 4
    return {"capacity": capacity, "seen": total, "rows": store.num_rows,
            "evicted": store.counters["evicted"],
            "store_bytes": [samples[i][0] for i in (0, quarter, 2 * quarter, -1)],
            "rss": [samples[i][1] for i in (0, quarter, 2 * quarter, -1)]}
