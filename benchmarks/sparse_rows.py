"""Cost of one sparse Adagrad apply on a ps shard's rows, against torch.optim.Adagrad.

The workload of a click model's embedding table: a 1M x 32 float32 table, a
push of 2,400 unique rows (what a batch of 8,192 Zipf(1.2) ids touches), the
row gradients random. Four ways to apply it, alternated round by round so
that machine noise hits them alike:

* ``towerflow, sorted ids``: ``DenseRowStore.apply`` with ``SparseAdagrad``,
  the ids as ``torch.unique`` gives them (what a worker sends) — the whole ps
  path: id and gradient checks, coalescing, ``index_select`` / ``addcmul_`` /
  ``index_copy_`` on the touched rows;
* ``towerflow, unsorted ids``: the same with the ids in arrival order (the
  store sorts them);
* ``torch.optim, grad per push``: ``torch.optim.Adagrad`` stepping an
  ``nn.Parameter`` of the same table whose ``.grad`` is built from the same
  ``(ids, rows)`` as a sparse COO tensor on each push (the baseline: the same
  input as the store gets);
* ``torch.optim, coalesced grad``: the same with one pre-coalesced sparse
  gradient reused (its optimizer step alone, the best case).

Before timing, one apply of the store and of torch's Adagrad on the same rows
are checked to give the same table (to 1e-5: torch adds ``eps`` to the root,
TensorFlow's kernel does not). It prints the median milliseconds per apply of
each and its ratio to the first, and the same for a lookup of the rows
(``index_select`` against ``table[ids]``).

Commands::

    python benchmarks/sparse_rows.py                 # ~1 minute on 2 cores
    python benchmarks/sparse_rows.py --rounds 50 --rows 1000000 --dim 32 --unique 2400
    python benchmarks/sparse_rows.py --threads 1     # one core each, as a busy ps task has
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from towerflow.ps.partition import ModPartitioner
from towerflow.ps.server.tables.rows import DenseRowStore
from towerflow.ps.spec.initializers import UniformRows
from towerflow.ps.spec.row_optimizers import SparseAdagrad

LR = 0.05


def zipf_unique(num_rows: int, unique: int, gen: torch.Generator) -> torch.Tensor:
    """``unique`` distinct ids drawn from a Zipf(1.2) distribution over ``num_rows`` rows."""
    weights = torch.arange(1, num_rows + 1, dtype=torch.float64).pow_(-1.2)
    seen = torch.empty(0, dtype=torch.int64)
    while seen.numel() < unique:
        seen = torch.unique(torch.cat([seen, torch.multinomial(weights, 8192, True,
                                                               generator=gen)]))
    return seen[torch.randperm(seen.numel(), generator=gen)[:unique]]


def median_ms(fn: Callable[[], object], reps: int) -> float:
    """Median milliseconds of ``reps`` calls of ``fn``."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--unique", type=int, default=2400)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--reps", type=int, default=20, help="applies per round and way")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    gen = torch.Generator().manual_seed(0)
    ids = zipf_unique(args.rows, args.unique, gen)  # arrival order
    grads = torch.randn(ids.numel(), args.dim, generator=gen)
    sorted_ids, order = torch.sort(ids)
    sorted_grads = grads[order]
    store = DenseRowStore(ModPartitioner(1, num_rows=args.rows), 0, args.dim, SparseAdagrad(),
                          initializer=UniformRows())
    param = nn.Parameter(store.export().rows)
    opt = torch.optim.Adagrad([param], lr=LR, initial_accumulator_value=0.1)
    with torch.sparse.check_sparse_tensor_invariants(False):
        coalesced = torch.sparse_coo_tensor(ids[None], grads, param.shape).coalesce()
    step = [0]

    def ours(ids: torch.Tensor, grads: torch.Tensor) -> None:
        step[0] += 1
        store.apply(ids, grads, LR, step[0])

    def torch_optim(grad: Callable[[], torch.Tensor]) -> None:
        param.grad = grad()
        opt.step()

    def per_push() -> torch.Tensor:
        with torch.sparse.check_sparse_tensor_invariants(False):
            return torch.sparse_coo_tensor(ids[None], grads, param.shape)

    ways = {
        "towerflow, sorted ids": lambda: ours(sorted_ids, sorted_grads),
        "towerflow, unsorted ids": lambda: ours(ids, grads),
        "torch.optim, grad per push": lambda: torch_optim(per_push),
        "torch.optim, coalesced grad": lambda: torch_optim(lambda: coalesced),
    }
    ways["towerflow, unsorted ids"]()
    ways["torch.optim, grad per push"]()
    torch.testing.assert_close(store.lookup(ids), param.detach()[ids], rtol=1e-5, atol=1e-5)

    table = param.detach()
    lookups = {"index_select": lambda: store.lookup(ids), "table[ids]": lambda: table[ids]}
    times: dict[str, list[float]] = {name: [] for name in (*ways, *lookups)}
    for _ in range(args.rounds):
        for name, fn in (*ways.items(), *lookups.items()):
            times[name].append(median_ms(fn, args.reps))

    print(f"table {args.rows:,} x {args.dim} float32, {ids.numel():,} unique rows per push, "
          f"{torch.get_num_threads()} torch threads, torch {torch.__version__}; median ms of "
          f"{args.rounds} rounds x {args.reps}")
    for group in (ways, lookups):
        first = statistics.median(times[next(iter(group))])
        for name in group:
            ms = statistics.median(times[name])
            print(f"  {name:30s} {ms:7.3f} ms   {ms / first:5.2f}x")


if __name__ == "__main__":
    main()
