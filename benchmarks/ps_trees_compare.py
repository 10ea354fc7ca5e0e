"""Dense ps traffic and ps peak memory of two source trees, measured alternately.

Each case (1 worker async, 2 workers async, 2 workers sync) runs
``measure_traffic`` of ``benchmarks/ps_throughput.py`` in a fresh process whose
``PYTHONPATH`` is the tree's ``src`` (the ps, the workers and the driver all
import that tree), before and after alternating case by case for
``--rounds`` rounds; the medians and the ratio after / before are printed.

    python benchmarks/ps_trees_compare.py --before /path/to/main --after . --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
CASES = ((1, "async"), (2, "async"), (2, "sync"))


def measure(tree: Path, numel: int, workers: int, mode: str, iters: int, optimizer: str) -> dict:
    code = (
        "import json, sys, numpy as np\n"
        f"sys.path.insert(0, {str(HERE.parent)!r})\n"
        "import ps_throughput as bench\n"
        "def init_ps(cluster, secret, numel, mode, workers):\n"
        "    from towerflow.cluster import ClusterSpec\n"
        "    from towerflow.ps import AggregationConfig, PSClient\n"
        "    from towerflow.ps.wire import ps_pb2 as pb\n"
        "    plan = bench.placement_100mb(numel)\n"
        "    with PSClient(ClusterSpec(cluster), plan, worker_id=0,\n"
        "                  credentials=bench.credentials(secret), timeout=120.0) as c:\n"
        "        c.initialize([np.zeros(s.numel, np.float32) for s in plan.shards],\n"
        f"                     optimizer=pb.OptimizerSpec(name={optimizer!r}),\n"
        "                     aggregation=AggregationConfig(mode=mode, total_num_replicas=workers))\n"
        "bench.init_ps = init_ps\n"
        f"print(json.dumps(bench.measure_traffic({numel}, {workers}, {iters}, {mode!r})))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=900, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"measuring {tree} ({workers} worker(s) {mode}) failed with status "
                           f"{out.returncode}: {out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True)
    parser.add_argument("--after", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model-mb", type=int, default=100)
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--optimizer", default="sgd")
    args = parser.parse_args()
    numel = args.model_mb * (1 << 20) // 4
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    rows: dict[tuple[str, int, str], list[dict]] = {}
    for index in range(args.rounds):
        for workers, mode in CASES:
            for name in (("before", "after") if index % 2 == 0 else ("after", "before")):
                got = measure(trees[name], numel, workers, mode, args.iters, args.optimizer)
                rows.setdefault((name, workers, mode), []).append(got)
                print(f"round {index + 1} {name:6s} {workers} worker(s) {mode:5s}: "
                      f"{got['gbps']:.2f} GB/s, ps peak RSS {got['ratio']:.2f}x params "
                      f"({got['net_ratio']:.2f}x net of the idle server)", flush=True)
    print(f"\nmedians of {args.rounds} interleaved rounds, {args.model_mb} MB fp32 model, "
          f"{args.optimizer} on the ps, 1 ps task:")
    for workers, mode in CASES:
        med = {name: {key: statistics.median(r[key] for r in rows[(name, workers, mode)])
                      for key in ("gbps", "ratio", "net_ratio")} for name in trees}
        b, a = med["before"], med["after"]
        print(f"{workers} worker(s) {mode:5s}: GB/s {b['gbps']:.2f} -> {a['gbps']:.2f} "
              f"({a['gbps'] / b['gbps']:.2f}x); ps peak RSS {b['ratio']:.2f}x -> "
              f"{a['ratio']:.2f}x params (net of idle {b['net_ratio']:.2f}x -> "
              f"{a['net_ratio']:.2f}x)")


if __name__ == "__main__":
    main()
