"""The rounds and the report of ``sparse_embedding.py --dynamic`` (no command of its own)."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

from dynamic_tables import capacity_memory, memory_per_row

DIM = 32
#: batches per worker in the admission and capacity runs: ids seen once are common
FRESH = 1000


def _total(result: dict) -> float:
    return sum(w["examples_per_s"] for w in result["workers"])


def _loss(result: dict) -> float:
    return statistics.mean(w["logloss"] for w in result["workers"])


def _cpu(results: list[dict]) -> str:
    """Median CPU ms per step: each worker's, and the two ps tasks' (per cluster step)."""
    worker = statistics.median(w["cpu_ms_per_step"] for r in results for w in r["workers"])
    ps = statistics.median(sum(r["ps_cpu_ms_per_step"]) for r in results)
    return f"{worker:.2f} ms CPU per worker step, {ps:.2f} ms of the 2 ps tasks per step"


def _stats(result: dict) -> dict:
    """The table's stats (summed over the shards) as the worker that ended last read them
    (after every push of the other, which had flushed its own)."""
    return max(result["workers"], key=lambda w: w["ended"])["stats"]


def _seen(result: dict, distinct_ids: Callable[..., int], rows: int) -> int:
    """Distinct ids the workers of a run of :data:`FRESH` batches saw."""
    steps = tuple(w["steps"] for w in result["workers"])
    return distinct_ids(rows, FRESH, steps)


def run_dynamic(args: argparse.Namespace, run_cluster: Callable[..., dict],
                distinct_ids: Callable[..., int]) -> None:
    """Fixed and dynamic tables side by side per round, then admission, capacity, memory."""
    fixed, dynamic = [], []
    for index in range(args.repeats):  # interleaved: the machine's load reaches both
        fixed.append(run_cluster(args, "fixed"))
        dynamic.append(run_cluster(args, "dynamic"))
        print(f"round {index + 1}: fixed {_total(fixed[-1]):,.0f}, dynamic "
              f"{_total(dynamic[-1]):,.0f} examples/s "
              f"({_total(dynamic[-1]) / _total(fixed[-1]):.2f}x)", flush=True)
    distinct = distinct_ids(args.rows)
    once = run_cluster(args, "dynamic", batches=FRESH)
    admit = run_cluster(args, "dynamic", admit_after=2, batches=FRESH)
    capacity = max(1, _seen(once, distinct_ids, args.rows) // 10)
    capped = run_cluster(args, "dynamic", capacity=capacity, batches=FRESH)
    flat = capacity_memory(max(1, args.memory_rows // 100), DIM)  # first: the smaller store
    memory = memory_per_row(args.memory_rows, DIM)
    fixed_median = statistics.median(map(_total, fixed))
    dynamic_median = statistics.median(map(_total, dynamic))
    print(f"2 ps + 2 workers, {args.rows:,} Zipf(1.2) ranks x {DIM}, batch 512 x 16, Adagrad, "
          f"async, defer_push={args.defer_push}; {args.repeats} round(s) of {args.seconds:g} s")
    print(f"  examples/s, median: fixed table {fixed_median:,.0f}, dynamic table (raw 64-bit "
          f"ids) {dynamic_median:,.0f}: {dynamic_median / fixed_median:.2f}x (target >= 0.8x); "
          "per round " + ", ".join(f"{_total(d) / _total(f):.2f}x"
                                   for f, d in zip(fixed, dynamic, strict=True)))
    print(f"  CPU, median: fixed {_cpu(fixed)}; dynamic {_cpu(dynamic)}")
    last = dynamic[-1]
    print(f"  dynamic, admit_after=1: {_stats(last)['rows']:,} rows stored of {distinct:,} "
          f"distinct ids seen; logloss of steps 301-400 {_loss(last):.4f} (fixed "
          f"{_loss(fixed[-1]):.4f})")
    for name, result in (("admit_after=1", once), ("admit_after=2", admit)):
        stats, seen = _stats(result), _seen(result, distinct_ids, args.rows)
        print(f"  dynamic, {FRESH} batches per worker (ids seen once are common), {name}: "
              f"{stats['rows']:,} rows stored of {seen:,} distinct ids seen "
              f"({stats['rows'] / seen:.2f}); {stats['filtered']:,} row gradients dropped "
              f"before admission; logloss of steps 301-400 {_loss(result):.4f}; "
              f"{_total(result):,.0f} examples/s")
    stats, window = _stats(capped), capped["ps_rss_in_window"]
    seen = _seen(capped, distinct_ids, args.rows)
    quarters = [window[i] for i in (0, len(window) // 4, len(window) // 2, -1)] if window \
        else []
    print(f"  dynamic, capacity {capacity:,} (a tenth of the distinct ids the admit_after=1 "
          f"run saw), {FRESH} batches per worker: {seen:,} distinct ids seen "
          f"({seen / capacity:.1f}x capacity); "
          f"{stats['rows']:,} rows, {stats['evicted']:,} evicted; the 2 ps tasks' RSS through "
          f"the run {', '.join(f'{r / 2**20:.0f}' for r in quarters)} MiB "
          f"(last / first {quarters[-1] / quarters[0]:.3f}); logloss {_loss(capped):.4f}; "
          f"{_total(capped):,.0f} examples/s" if quarters else "  (no RSS samples)")
    print(f"  one store of {memory['rows']:,} rows x {DIM} (Adagrad), this process: "
          f"{memory['store_bytes_per_row']:.0f} B per row counted by the store, "
          f"{memory['rss_bytes_per_row']:.0f} B by resident memory, against "
          f"{memory['ideal']} B of key + row + slot: {memory['rss_bytes_per_row'] / memory['ideal']:.2f}x "
          f"(target <= 1.5x); {memory['insert_us_per_row']:.2f} us per row made, "
          f"{memory['lookup_us_per_id']:.3f} us per id looked up")
    print(f"  one store of capacity {flat['capacity']:,} fed {flat['seen']:,} distinct ids: "
          f"{flat['rows']:,} rows, {flat['evicted']:,} evicted; store bytes "
          f"{', '.join(f'{b / 2**20:.1f}' for b in flat['store_bytes'])} MiB, RSS "
          f"{', '.join(f'{r / 2**20:.0f}' for r in flat['rss'])} MiB at 0, 1/4, 1/2 and all "
          "of the ids past capacity")
