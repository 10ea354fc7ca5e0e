"""The cost model of RESULTS' "Bigger clusters and a cost model", extended to hybrid training.

examples/s and CPU per example of ``towerflow train --ps P --workers W --dense allreduce``
against the number of workers (``--workers``, default 2,3,4), of ps tasks (``--ps``,
default 1,2) and the size of the all-reduce (``--dense-floats``: float32 values added to
the dense layers), each beside all-ps async (``--ps P --workers W``) on the same
topology. The model is the click model of ``towerflow train click`` (a 1,000,000 x 32
``nn.EmbeddingBag(sparse=True)`` summed over 16 Zipf(1.2) ids per example, a linear and
a 32-wide MLP head: 1,122 dense values) given as ``--model hybrid_cost:build --data
hybrid_cost:batches`` (the same planted click logs, ``towerflow.data.clicks``), with
``HYBRID_COST_DENSE`` extra dense values: a parameter the loss touches at one element (its
gradient is a full tensor of zeros), so the all-reduce grows (and, all-ps, the dense
push and pull) while the model's arithmetic does not. Batches of 512, Adagrad (lr 0.1,
initial accumulator 1e-4), as ``towerflow train click``.

Each run trains ``--examples`` examples (the same number in every mode and topology:
``--max-steps`` divided by the batches of a global step, W in hybrid, 1 in async) with
``OMP_NUM_THREADS`` removed (launch shares the cores: 1 thread per process). Figures,
between the first and the last step line (``hybrid_modes.StepWatch``): examples/s (the
median of the step log's lines after the first), the CPU per example of the workers and
of the ps tasks (``/proc``, user + system), and the cores the run kept busy (CPU seconds
per second). The grid is every (W, P) at the smallest ``--dense-floats`` and every
``--dense-floats`` at the first W and the last P; ``--repeats`` rounds, the grid in each.

The fit (least squares per mode over its runs, per worker step of B = 512 examples): a
worker's CPU ``w = w0 + w1 P + g (W - 1) + r M`` and all the ps tasks' ``q = a P + c + s M``,
M the dense megabytes a worker step moves (hybrid: its share of a ring all-reduce,
``2 (W - 1) / W * 4 * dense values``; async: the push and the pull, ``2 * 4 * dense
values``); examples/s on shared cores ``X = C_eff * B / (w + q)``, C_eff the cores busy.
``--from-log FILE`` fits and tabulates an earlier run's output again. Commands::

    python benchmarks/hybrid_cost.py --repeats 2
    python benchmarks/hybrid_cost.py --workers 2,4 --ps 2 --dense-floats 0 --repeats 3
    python benchmarks/hybrid_cost.py --quick
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
PAD_ENV = "HYBRID_COST_DENSE"
ROWS, DIM, BAG, BATCH, HIDDEN = 1_000_000, 32, 16, 512, 32
MODEL_DENSE = DIM + 1 + DIM * HIDDEN + HIDDEN + HIDDEN + 1  # the linear and MLP heads: 1,122


# -- the model and data factories (run by every task of a run) -------------------------------
def _click_logs(rows: int) -> Any:
    from towerflow.data.clicks import ClickLogs
    from towerflow.training.tasks import ClickTask

    return ClickLogs([rows], bag=BAG, zipf=ClickTask.zipf, ctr=ClickTask.ctr,
                     weight_std=ClickTask.weight_std, seed=0)


def build() -> Any:
    """``--model hybrid_cost:build``: the click model and ``$HYBRID_COST_DENSE`` dense values."""
    import torch
    from torch import nn

    from towerflow.models.click import ClickNet

    class Padded(nn.Module):
        """The click model; ``pad`` joins the dense layers (the loss touches one element)."""

        def __init__(self, rows: int, extra: int) -> None:
            super().__init__()
            self.net = ClickNet(rows, DIM, hidden=HIDDEN, sparse_gradients=True,
                                table_device="meta")
            self.pad = nn.Parameter(torch.zeros(extra)) if extra else None

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            out = self.net(ids)
            return out if self.pad is None else out + 0.0 * self.pad[0]

    return Padded(int(os.environ.get("HYBRID_COST_ROWS", ROWS)),
                  int(os.environ.get(PAD_ENV, "0")))


def batches(split: str, batch_size: int, rank: int, seed: int) -> Any:
    """``--data hybrid_cost:batches``: replica ``rank``'s endless stream of click logs."""
    import torch

    from towerflow.data.clicks import ClickStream

    logs = _click_logs(int(os.environ.get("HYBRID_COST_ROWS", ROWS)))
    if split != "train":  # held-out logs (towerflow eval)
        fields, clicks = logs.sample(10_000, torch.Generator().manual_seed(1))
        return [(fields[0], clicks.float())]
    return ClickStream(logs, batch_size=batch_size, seed=seed, replica=rank)


# -- the runs ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Setting:
    """One topology and dense size, in one mode (``hybrid`` or ``async``)."""

    mode: str
    workers: int
    ps: int
    extra: int

    @property
    def batches_per_step(self) -> int:
        return self.workers if self.mode == "hybrid" else 1

    @property
    def ring_bytes(self) -> float:
        """Bytes one worker sends (and receives) in a ring all-reduce of the dense layers."""
        return 2 * (self.workers - 1) / self.workers * 4 * (MODEL_DENSE + self.extra)


@dataclass(slots=True)
class Result:
    setting: Setting
    round: int
    rate: float
    cpu_us: dict[str, float] = field(default_factory=dict)
    cores: float = math.nan

    def per_step_ms(self, role: str) -> float:
        """CPU ms of ``role`` (all its tasks) per worker step of B examples."""
        return self.cpu_us.get(role, 0.0) * BATCH / 1e3


def grid(workers: Sequence[int], ps: Sequence[int], extras: Sequence[int]) -> list[tuple]:
    """Every (W, P) at the smallest dense size; every dense size at the first W, last P."""
    first = [(w, p, min(extras)) for w in workers for p in ps]
    return first + [(workers[0], ps[-1], e) for e in sorted(extras) if e != min(extras)]


def run_setting(hm: Any, setting: Setting, examples: int, base: Path, timeout: float,
                rows: int) -> Result:
    """One ``towerflow train`` run of ``setting``; its figures."""
    per_step = BATCH * setting.batches_per_step
    steps = examples // per_step
    train_dir = Path(tempfile.mkdtemp(prefix=f"{setting.mode}-", dir=base))
    argv = [sys.executable, "-m", "towerflow", "train", "--model", "hybrid_cost:build",
            "--data", "hybrid_cost:batches", "--loss", "bce_with_logits",
            "--optimizer", "adagrad", "--lr", "0.1", "--initial-accumulator-value", "1e-4",
            "--batch-size", str(BATCH), "--ema-decay", "0", "--ps", str(setting.ps),
            "--workers", str(setting.workers), "--device", "cpu",  # CPU workers, GPU or not
            *(["--dense", "allreduce"] if setting.mode == "hybrid" else []),
            "--max-steps", str(steps), "--log-every", str(max(1, steps // 20)),
            "--checkpoint-every", "0", "--summary-every", "0", "--no-progress",
            "--train-dir", str(train_dir)]
    env = {PAD_ENV: str(setting.extra), "HYBRID_COST_ROWS": str(rows),
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    watch = hm.StepWatch(str(train_dir), per_step)
    try:
        status, out, _ = hm.run_bounded(argv, timeout, watch, env=env)
    finally:
        hm.end_leftovers(str(train_dir))
        hm.subprocess.run(["rm", "-rf", str(train_dir)], check=False)
    if status != 0 or len(watch.rates) < 2:
        raise RuntimeError(f"{setting}: towerflow train ended with status {status}:\n"
                           f"{out[-3000:]}")
    cpu, cores = watch.cpu()
    return Result(setting, 0, statistics.median(watch.rates[1:]), cpu, cores)


def moved_mb(setting: Setting) -> float:
    """MB of dense values a worker step moves: a ring all-reduce's share (hybrid), the push
    and the pull of every dense value (async)."""
    if setting.mode == "hybrid":
        return setting.ring_bytes / 1e6
    return 2 * 4 * (MODEL_DENSE + setting.extra) / 1e6


def fit(results: Sequence[Result], mode: str = "hybrid") -> dict[str, float]:
    """Least squares over ``mode``'s runs, per worker step: a worker's CPU
    ``w = w0 + w1 P + g (W - 1) + r M`` and all ps tasks' ``q = a P + c + s M`` (ms; M the
    dense MB the step moves, :func:`moved_mb`); {} when the runs cannot separate them."""
    runs = [r for r in results if r.setting.mode == mode]
    x = np.array([[1.0, r.setting.ps, r.setting.workers - 1, moved_mb(r.setting)]
                  for r in runs]).reshape(-1, 4)
    if len(runs) < 5 or np.linalg.matrix_rank(x) < 4:
        return {}
    w = np.array([r.per_step_ms("worker") + r.per_step_ms("chief") for r in runs])
    w0, w1, g, rate = np.linalg.lstsq(x, w, rcond=None)[0]
    q = np.array([r.per_step_ms("ps") for r in runs])
    a, s, c = np.linalg.lstsq(x[:, [1, 3, 0]], q, rcond=None)[0]
    return {"w0": w0, "w1": w1, "g": g, "r": rate, "a": a, "c": c, "s": s}


def predicted_ms(model: dict[str, float], setting: Setting) -> float:
    """The fit's CPU of the whole cluster per worker step (w + q)."""
    moved = moved_mb(setting)
    return (model["w0"] + model["w1"] * setting.ps + model["g"] * (setting.workers - 1)
            + model["r"] * moved + model["a"] * setting.ps + model["c"] + model["s"] * moved)


def fit_text(model: dict[str, float], mode: str) -> str:
    return (f"{mode}: worker w = {model['w0']:.2f} + {model['w1']:.2f} P + {model['g']:.2f} "
            f"(W - 1) + {model['r']:.2f} M ms; all ps tasks q = {model['a']:.2f} P + "
            f"{model['c']:.2f} + {model['s']:.2f} M ms")


def summary(results: Sequence[Result]) -> list[dict]:
    """Medians over rounds per setting, hybrid beside async on the same topology."""
    keys = sorted({r.setting for r in results},
                  key=lambda s: (s.extra, s.workers, s.ps, s.mode != "hybrid"))
    rows = []
    for key in keys:
        mine = [r for r in results if r.setting == key]
        rows.append({"setting": key, "rate": statistics.median(r.rate for r in mine),
                     "workers": statistics.median(r.per_step_ms("worker")
                                                  + r.per_step_ms("chief") for r in mine),
                     "ps": statistics.median(r.per_step_ms("ps") for r in mine),
                     "cores": statistics.median(r.cores for r in mine), "runs": len(mine)})
    return rows


def table(rows: Sequence[dict], models: dict[str, dict[str, float]]) -> list[str]:
    """A line per setting: figures, and its mode's fit's CPU and examples/s."""
    lines = ["| workers | ps | dense values | mode | examples/s | worker CPU ms per worker step "
             "| ps CPU ms per worker step (all) | µs per example | cores busy | model: µs per "
             "example | model: examples/s at these cores |", "|---" * 11 + "|"]
    for row in rows:
        s = row["setting"]
        per_example = 1e3 * (row["workers"] + row["ps"]) / BATCH
        predicted = ["-", "-"]
        if models.get(s.mode):
            cost = predicted_ms(models[s.mode], s)
            predicted = [f"{1e3 * cost / BATCH:.1f}", f"{row['cores'] * BATCH / cost * 1e3:,.0f}"]
        lines.append(f"| {s.workers} | {s.ps} | {MODEL_DENSE + s.extra:,} | {s.mode} | "
                     f"{row['rate']:,.0f} | {row['workers']:.2f} | {row['ps']:.2f} | "
                     f"{per_example:.1f} | {row['cores']:.2f} | {' | '.join(predicted)} |")
    return lines


ROUND_LINE = re.compile(
    r"round (\d+): (\w+) (\d+) workers (\d+) ps, ([\d,]+) dense values: ([\d,]+) examples/s; "
    r"worker CPU ([\d.]+) ms, ps ([\d.]+) ms per worker step; ([\d.]+) cores")


def from_log(text: str) -> list[Result]:
    """The runs of an earlier run's output (its ``round ...`` lines), to fit again."""
    results = []
    for m in ROUND_LINE.finditer(text):
        extra = int(m.group(5).replace(",", "")) - MODEL_DENSE
        setting = Setting(m.group(2), int(m.group(3)), int(m.group(4)), extra)
        per_us = 1e3 / BATCH
        results.append(Result(setting, int(m.group(1)), float(m.group(6).replace(",", "")),
                              {"worker": float(m.group(7)) * per_us,
                               "ps": float(m.group(8)) * per_us}, float(m.group(9))))
    return results


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=_ints, default=[2, 3, 4], help="default 2,3,4")
    parser.add_argument("--ps", type=_ints, default=[1, 2], help="default 1,2")
    parser.add_argument("--dense-floats", type=_ints, default=[0, 262_144, 1_048_576],
                        help="extra dense values (default 0,262144,1048576: +1, +4 MiB)")
    parser.add_argument("--modes", default="hybrid,async", help="hybrid and/or async")
    parser.add_argument("--examples", type=int, default=1_228_800,
                        help="examples per run (a multiple of 512 x each worker count)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    parser.add_argument("--from-log", metavar="FILE",
                        help="fit and tabulate the round lines of an earlier run's output")
    parser.add_argument("--quick", action="store_true",
                        help="a 2,000-row table, 2 workers, 1 ps, 2 dense sizes, few steps")
    args = parser.parse_args(argv)
    args.modes = args.modes.split(",")
    args.rows = ROWS
    if args.quick:
        args.workers, args.ps, args.dense_floats = [2], [1], [0, 4096]
        args.examples, args.repeats, args.rows = 20 * 1024, 1, 2000
    return args


def run_grid(args: argparse.Namespace) -> list[Result]:
    """``--repeats`` rounds of the grid, each setting in every mode, a line per run."""
    sys.path.insert(0, str(HERE))
    import hybrid_modes as hm

    hm.stop_on_sigterm()
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="hybrid-cost-") as tmp:
        for r in range(args.repeats):
            for w, p, extra in grid(args.workers, args.ps, args.dense_floats):
                for mode in args.modes:
                    result = run_setting(hm, Setting(mode, w, p, extra), args.examples,
                                         Path(tmp), args.timeout, args.rows)
                    result.round = r + 1
                    results.append(result)
                    print(f"round {r + 1}: {mode} {w} workers {p} ps, {MODEL_DENSE + extra:,} "
                          f"dense values: {result.rate:,.0f} examples/s; worker CPU "
                          f"{result.per_step_ms('worker') + result.per_step_ms('chief'):.2f} "
                          f"ms, ps {result.per_step_ms('ps'):.2f} ms per worker step; "
                          f"{result.cores:.2f} cores; load average {os.getloadavg()[0]:.1f}",
                          flush=True)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_log:
        results = from_log(Path(args.from_log).read_text())
        rounds = len({r.round for r in results})
    else:
        results, rounds = run_grid(args), args.repeats
    models = {mode: fit(results, mode) for mode in ("hybrid", "async")}
    print(f"\nmedians of {rounds} round(s)")
    print("\n".join(table(summary(results), models)))
    for mode, model in models.items():
        if model:
            print(f"fit over the {mode} runs, per worker step of {BATCH} examples (M: dense MB "
                  f"moved per worker step): {fit_text(model, mode)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
