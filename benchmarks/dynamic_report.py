"""The rounds and the report of ``sparse_embedding.py --dynamic`` (no command of its own)."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

from dynamic_tables import capacity_memory, memory_per_row

DIM = 32


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
    return result["workers"][0]["stats"]  # the table's, summed over the shards


def run_dynamic(args: argparse.Namespace, run_cluster: Callable[..., dict],
                distinct: int) -> None:
    """Fixed and dynamic tables side by side per round, then admission, capacity, memory."""
    fixed, dynamic = [], []
    for index in range(args.repeats):  # interleaved: the machine's load reaches both
        fixed.append(run_cluster(args, "fixed"))
        dynamic.append(run_cluster(args, "dynamic"))
        print(f"round {index + 1}: fixed {_total(fixed[-1]):,.0f}, dynamic "
              f"{_total(dynamic[-1]):,.0f} examples/s "
              f"({_total(dynamic[-1]) / _total(fixed[-1]):.2f}x)", flush=True)
    admit = run_cluster(args, "dynamic", admit_after=2)
    capped = run_cluster(args, "dynamic", capacity=max(1, distinct // 10))
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
    stats = _stats(admit)
    print(f"  dynamic, admit_after=2: {stats['rows']:,} rows stored of {distinct:,} distinct "
          f"ids seen ({stats['rows'] / distinct:.2f}); {stats['filtered']:,} row gradients "
          f"dropped before admission; logloss {_loss(admit):.4f} vs {_loss(last):.4f} at "
          f"admit_after=1; {_total(admit):,.0f} examples/s")
    stats, window = _stats(capped), capped["ps_rss_in_window"]
    quarters = [window[i] for i in (0, len(window) // 4, len(window) // 2, -1)] if window \
        else []
    print(f"  dynamic, capacity {max(1, distinct // 10):,} (a tenth of the distinct ids seen): "
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
