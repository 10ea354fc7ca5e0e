"""Digits test accuracy: 2 CPU replicas vs 1 replica with the same global batch.

Trains scikit-learn's digits with ``towerflow train digits`` twice — one
process with a global batch of ``2 x B``, then ``--replicas 2`` with ``B``
each — and evaluates both with ``towerflow eval`` (moving averages, CPU).
Targets: the 2-replica run reaches >= 96% test precision and is within one
point of the 1-replica run.

    python benchmarks/digits_accuracy.py [--steps 3000] [--batch-size 32]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time


def _towerflow(*args: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TF_CONFIG", None)
    proc = subprocess.run([sys.executable, "-m", "towerflow", *args], env=env,
                          capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"towerflow {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def _train_and_eval(train_dir: str, steps: int, batch: int, replicas: int, lr: float) -> float:
    common = ["--train-dir", train_dir, "--max-steps", str(steps), "--batch-size", str(batch),
              "--lr", str(lr), "--log-every", str(max(steps // 5, 1)), "--summary-every", "0",
              "--checkpoint-every", "0", "--no-progress"]
    extra = ["--replicas", str(replicas)] if replicas > 1 else ["--device", "/cpu:0"]
    start = time.perf_counter()
    _towerflow("train", "digits", *common, *extra)
    elapsed = time.perf_counter() - start
    out = _towerflow("eval", "digits", "--train-dir", train_dir, "--device", "/cpu:0")
    precision = float(re.search(r"precision @ 1 = (\d\.\d+)", out).group(1))
    print(f"replicas={replicas} batch/replica={batch} global batch={batch * replicas} "
          f"steps={steps}: precision @ 1 = {precision:.3f}  ({elapsed:.1f} s)", flush=True)
    return precision


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=32, help="per replica with 2 replicas")
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        one = _train_and_eval(f"{tmp}/one", args.steps, 2 * args.batch_size, 1, args.lr)
        two = _train_and_eval(f"{tmp}/two", args.steps, args.batch_size, 2, args.lr)
    ok = two >= 0.96 and abs(two - one) <= 0.01
    print(f"2 replicas: {two:.3f} (target >= 0.960); difference to 1 replica: "
          f"{100 * (two - one):+.1f} points (target within 1.0): {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
