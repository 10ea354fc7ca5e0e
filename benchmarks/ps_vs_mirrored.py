"""Article 001's topologies side by side: variables on a local ps task (CPU) vs mirrored replicas.

Runs ``towerflow train cifar10`` twice on the same devices with synthetic
CIFAR-10-shaped data and the same per-replica batch:

* mirrored: ``--num-gpus N`` (one process per GPU, all-reduce over NCCL);
* parameter server: ``--num-gpus N --ps 1`` (the workers compute on the GPUs,
  the variables and their updates live on one ps task on the CPU, article
  001's "CPU as parameter server"), ``--mode`` async by default.

Each run's figure is the median examples/sec of its step lines after the
first (the chief's lines count every worker's batches), and the benchmark
prints the ratio ps / mirrored. Without a GPU it runs the same pair on CPU
replicas (``--replicas N``), which measures the CPU path only; the article's
figure needs a GPU machine.

Usage::

    python benchmarks/ps_vs_mirrored.py                 # GPUs when present, else CPU replicas
    python benchmarks/ps_vs_mirrored.py --replicas 2 --steps 400 --mode sync
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

RATE = re.compile(r"step (\d+), loss = [^(]*\(([\d.]+) examples/sec")


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run(label: str, args: list[str], train_dir: str, timeout: float) -> dict:
    """One training run; returns its median step rate (after the first line) and wall time."""
    command = [sys.executable, "-m", "towerflow", "train", "cifar10", "--data", "synthetic",
               "--train-dir", train_dir, "--no-progress", "--checkpoint-every", "0", *args]
    start = time.monotonic()
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    wall = time.monotonic() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{label} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    rates = [float(m.group(2)) for m in RATE.finditer(proc.stdout + proc.stderr)]
    if len(rates) < 2:
        raise RuntimeError(f"{label} printed {len(rates)} step lines; raise --steps")
    return {"median": statistics.median(rates[1:]), "wall": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=None,
                        help="replicas (default: every GPU, else 2 CPU processes)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--mode", choices=("async", "sync", "ssp"), default="async")
    parser.add_argument("--timeout", type=float, default=1200.0)
    args = parser.parse_args()
    gpus = gpu_count()
    n = args.replicas or (gpus if gpus else 2)
    if gpus:
        if n > gpus:
            parser.error(f"--replicas {n} but this machine has {gpus} GPU(s)")
        where, devices = f"{n} GPU(s), ps on the CPU", ["--num-gpus", str(n)]
    else:
        where, devices = f"{n} CPU replica processes (no GPU here)", ["--replicas", str(n)]
    common = [*devices, "--max-steps", str(args.steps), "--batch-size", str(args.batch_size),
              "--log-every", str(args.log_every), "--summary-every", "0"]
    print(f"CIFAR-10 model, synthetic data, batch {args.batch_size} per replica, {args.steps} "
          f"global steps, {where}; examples/sec = median of the step lines after the first",
          flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        mirrored = run("mirrored", common, os.path.join(tmp, "mirrored"), args.timeout)
        print(f"  mirrored: {mirrored['median']:.1f} examples/sec ({mirrored['wall']:.0f} s)",
              flush=True)
        ps = run("ps", [*common, "--ps", "1", "--mode", args.mode], os.path.join(tmp, "ps"),
                 args.timeout)
        print(f"  ps ({args.mode}): {ps['median']:.1f} examples/sec ({ps['wall']:.0f} s)",
              flush=True)
    print(f"parameter server ({args.mode}, variables on the CPU) / mirrored on {where}: "
          f"{ps['median'] / mirrored['median']:.2f}x examples/sec")


if __name__ == "__main__":
    main()
