"""Hybrid training (tables on the ps, dense layers all-reduced) against the other ways to train.

Issue 37's figures: for two workloads and four modes (a fifth on MovieLens), examples/s and the test AUC of
``towerflow train`` as a user runs it, each run a subprocess with a fresh train dir,
scored as ``towerflow eval --train-dir`` scores it:

- ``hybrid``: ``--ps 2 --workers 2 --dense allreduce`` (the tables' rows on the ps tasks,
  the dense layers replicated and averaged each step by a Gloo all-reduce);
- ``async``: ``--ps 2 --workers 2`` (everything on the ps tasks, asynchronous);
- ``sync``: ``--ps 2 --workers 2 --mode sync`` (everything on the ps tasks, each step's
  gradients of both workers averaged);
- ``one``: one process (no ``--ps``), the same model and optimizer;
- ``async-rows`` (MovieLens only): ``async`` with ``--whole-tables off``: the tables'
  rows on the ps as hybrid keeps them, to tell the dense path's cost apart. The DeepFM's
  ``sparse=True`` tables (3 to 1,683 rows of 16 values) are all under the 256 KiB below
  which all-ps training ships a table whole with the dense layers; hybrid keeps every
  ``sparse=True`` table's rows on the ps, small ones too.

The cluster modes are started by ``towerflow train`` itself (its local launch: 4
processes on the machine, ``OMP_NUM_THREADS`` removed from the environment so that
launch shares the cores: one torch thread each); the one process runs with one thread
too (``OMP_NUM_THREADS=1``: with torch's default of 2 on this machine, shared with other
jobs, OpenMP's waits made it up to 10x slower in a trial run).

Workloads:

- ``movielens``: ``towerflow train movielens`` (the MovieLens-100k DeepFM, batches of
  256) on a synthetic data set in GroupLens' exact ml-100k format written by
  ``movielens_synthetic.write_movielens`` (943 users, 1,682 movies, 100,000 ratings,
  seeded by ``--seed``) with a planted,
  learnable truth: a rating is 4+ with probability ``sigmoid(user bias + movie bias +
  <user factors, movie factors> + genre x gender + genre x age group)``. The test split
  is the latest 20% by timestamp; the truth's own AUC on it is printed as the ceiling.
- ``click``: ``towerflow train click`` at its default sizes (a 1,000,000 x 32 table,
  batches of 512 x 16 Zipf(1.2) ids, Adagrad), 2,048,000 examples a run (its AUC still
  rises slowly there: the modes' AUCs are reported, the issue sets no target on them).

Every mode sees the same number of training examples: ``--max-steps`` is the examples
divided by the examples of one global step (one batch in ``async``, where each worker's
push is a global step, and in ``one``; a batch per worker in ``sync`` and ``hybrid``).
examples/s is the median of the step log's examples/sec over its lines after the first
(the log counts the global batch; the first line holds the start-up); ``--log-every``
is chosen so that a run prints about 20 lines. At each step line the CPU time (user +
system, ``/proc``) of the run's processes is read by role (``TF_CONFIG``'s task type):
the CPU per example between the first and last line says where the work went, and the
CPU seconds per second the cores the run kept busy (at most 2 on this machine).

The AUC is computed by the function ``towerflow eval`` runs (``evaluate_checkpoint`` with
the model and data ``run.yaml`` records), printed to 6 digits (``towerflow eval`` prints
MovieLens' AUC to 3); in the first round ``towerflow eval --train-dir`` itself runs too and
must print the same AUC to its digits.

Each round runs every mode of a workload one after the other (modes interleaved, the
order rotated each round); the table gives medians over rounds, the ratio of examples/s
to ``async`` (of the medians, and the median of each round's own ratio), and the AUC
gaps to ``sync`` and ``one``. Commands::

    python benchmarks/hybrid_modes.py --repeats 3
    python benchmarks/hybrid_modes.py --workloads movielens --modes hybrid,sync,one
    python benchmarks/hybrid_modes.py --quick          # tiny data, one round, two modes
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from movielens_synthetic import write_movielens

MODES: dict[str, tuple[list[str], bool]] = {  # name: (train flags, a step uses every worker)
    "hybrid": (["--ps", "2", "--workers", "2", "--dense", "allreduce"], True),
    # the next step's rows pulled while a step runs (pushes in the background, one step late)
    "hybrid-ahead": (["--ps", "2", "--workers", "2", "--dense", "allreduce",
                      "--embedding-staleness", "1"], True),
    "async": (["--ps", "2", "--workers", "2"], False),
    "sync": (["--ps", "2", "--workers", "2", "--mode", "sync"], True),
    "one": ([], False),
    "async-rows": (["--ps", "2", "--workers", "2", "--whole-tables", "off"], False),
}
#: modes a workload skips: click's table is far above --whole-tables' 256 KiB, so its
#: async-rows run would be its async run
SKIP = {"click": ("async-rows",)}
WORKERS = 2
#: the issue's targets: hybrid's AUC within this of sync's and one process's (MovieLens)
AUC_TARGET = 0.002
STEP_LINE = re.compile(r"step (\d+), loss = \S+ \(([\d.]+) examples/sec")
AUC_LINE = re.compile(r"AUC = ([\d.]+)")

# -- the runs -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Workload:
    """A ``towerflow train`` model, its flags, batch size and the examples each run trains on."""

    name: str
    flags: list[str]
    batch: int
    examples: int


@dataclass(slots=True)
class Run:
    """One mode's run: the step log's rates (after the first line), the test AUC, wall times."""

    workload: str
    mode: str
    round: int
    rates: list[float] = field(default_factory=list)
    auc: float = math.nan
    train_s: float = math.nan
    eval_s: float = math.nan
    cpu_us: dict[str, float] = field(default_factory=dict)  # per example, by role
    cores: float = math.nan  # CPU seconds of the run's processes per second, while logging

    @property
    def rate(self) -> float:
        return statistics.median(self.rates) if self.rates else math.nan


def max_steps(mode: str, workload: Workload) -> int:
    """Global steps that make ``workload.examples`` examples in ``mode``."""
    per_step = workload.batch * (WORKERS if MODES[mode][1] else 1)
    if workload.examples % per_step:
        raise SystemExit(f"{workload.examples} examples are not a whole number of {mode} steps "
                         f"of {per_step} examples; pick a multiple of {WORKERS * workload.batch}.")
    return workload.examples // per_step


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of every run: unbuffered; no thread count nor cluster set by hand."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "TF_CONFIG")}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def run_bounded(argv: Sequence[str], timeout: float,
                on_line: Callable[[str], None] | None = None,
                env: Mapping[str, str] | None = None) -> tuple[int, str, float]:
    """Run ``argv`` in its own process group (:func:`child_env` with ``env``), each output
    line to ``on_line`` as it comes; (status, stdout + stderr, wall seconds).

    After ``timeout`` s the whole group gets SIGTERM, 20 s later SIGKILL; when it ends,
    whatever is left of the group is killed (the tasks a launch starts have groups of
    their own: :func:`end_leftovers` ends those)."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=child_env(env), start_new_session=True)
    stopped = threading.Event()

    def stop() -> None:
        stopped.set()
        _signal_group(proc.pid, signal.SIGTERM)
        if proc.poll() is None and not _wait(proc, 20.0):
            _signal_group(proc.pid, signal.SIGKILL)

    timer = threading.Timer(timeout, stop)
    timer.daemon = True
    timer.start()
    lines: list[str] = []
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if on_line is not None:
                on_line(line)
        proc.wait()
    finally:
        timer.cancel()
        _signal_group(proc.pid, signal.SIGKILL)  # nothing of the run outlives it
        proc.wait()
    note = f"\n(stopped after {timeout:g} s)" if stopped.is_set() else ""
    return proc.returncode, "".join(lines) + note, time.perf_counter() - start


def _wait(proc: subprocess.Popen, seconds: float) -> bool:
    try:
        proc.wait(seconds)
    except subprocess.TimeoutExpired:
        return False
    return True


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def processes_naming(marker: str) -> list[int]:
    """Pids of this user's processes whose command line holds ``marker`` (a run's own
    train dir: the tasks a launch started are in process groups of their own)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if entry.stat().st_uid == os.getuid() and \
                    marker.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def end_leftovers(marker: str, grace: float = 10.0) -> list[int]:
    """SIGTERM, then SIGKILL after ``grace`` s, the processes naming ``marker``; their pids."""
    found = processes_naming(marker)
    left = list(found)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = [pid for pid in left if pid in processes_naming(marker)]
    return found


def cpu_by_role(marker: str) -> dict[str, float]:
    """CPU seconds (user + system) so far of the processes naming ``marker``, by their
    ``TF_CONFIG`` task type (``ps``, ``worker``, ``chief``; ``main``: none, the launcher
    or the one process)."""
    tick = os.sysconf("SC_CLK_TCK")
    totals: dict[str, float] = {}
    for pid in processes_naming(marker):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        config = next((e[len(b"TF_CONFIG="):] for e in environ if e.startswith(b"TF_CONFIG=")),
                      None)
        role = json.loads(config).get("task", {}).get("type", "main") if config else "main"
        totals[role] = totals.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return totals


class StepWatch:
    """Reads a run's output as it comes: the step lines' rates, and at each step line the
    CPU of the run's processes, for the CPU per example between the first and last line."""

    def __init__(self, marker: str, examples_per_step: int) -> None:
        self.marker, self.examples_per_step = marker, examples_per_step
        self.rates: list[float] = []
        self.marks: list[tuple[float, int, dict[str, float]]] = []

    def __call__(self, line: str) -> None:
        found = STEP_LINE.search(line)
        if found is not None:
            self.rates.append(float(found.group(2)))
            self.marks.append((time.monotonic(), int(found.group(1)),
                               cpu_by_role(self.marker)))

    def cpu(self) -> tuple[dict[str, float], float]:
        """µs of CPU per example by role, and the cores busy, from the first to the last line."""
        (t0, s0, c0), (t1, s1, c1) = self.marks[0], self.marks[-1]
        examples = (s1 - s0) * self.examples_per_step
        if examples <= 0 or t1 <= t0:
            return {}, math.nan
        used = {role: c1.get(role, 0.0) - c0.get(role, 0.0) for role in c1}
        return ({role: 1e6 * cpu / examples for role, cpu in used.items()},
                sum(used.values()) / (t1 - t0))


def train(workload: Workload, mode: str, train_dir: Path,
          timeout: float) -> tuple[StepWatch, float]:
    """Train one run: its :class:`StepWatch` (rates, CPU) and wall time."""
    steps = max_steps(mode, workload)
    argv = [sys.executable, "-m", "towerflow", "train", *workload.flags, *MODES[mode][0],
            "--max-steps", str(steps), "--log-every", str(max(1, steps // 20)),
            "--checkpoint-every", "0", "--summary-every", "0", "--no-progress",
            "--device", "cpu",  # the figures are CPU workers', on a GPU machine too
            "--train-dir", str(train_dir)]
    watch = StepWatch(str(train_dir), workload.examples // steps)
    status, out, wall = run_bounded(argv, timeout, watch,
                                    env={"OMP_NUM_THREADS": "1"} if mode == "one" else None)
    if status != 0:
        raise RuntimeError(f"{workload.name} {mode}: towerflow train ended with status "
                           f"{status}:\n{out[-3000:]}")
    if len(watch.rates) < 2:
        raise RuntimeError(f"{workload.name} {mode}: fewer than 2 step lines:\n{out[-3000:]}")
    return watch, wall


def score(train_dir: Path, timeout: float) -> tuple[float, str]:
    """The test AUC of a run's last checkpoint, as ``towerflow eval`` computes it, to 6 digits
    (``towerflow eval`` prints MovieLens' to 3): ``--score`` in a child process."""
    status, out, _ = run_bounded([sys.executable, __file__, "--score", str(train_dir)], timeout)
    found = AUC_LINE.search(out)
    if status != 0 or found is None:
        raise RuntimeError(f"scoring {train_dir} failed (status {status}):\n{out[-3000:]}")
    return float(found.group(1)), out


def score_here(train_dir: str) -> None:
    """``--score DIR``: what ``towerflow eval --train-dir DIR --device cpu`` does, more digits."""
    from towerflow.training.evaluate import data_options_from, evaluate_checkpoint
    from towerflow.training.runconfig import load_run_settings

    saved = load_run_settings(train_dir)
    result = evaluate_checkpoint(saved["model"], train_dir, device="cpu",
                                 data=data_options_from(saved), batch_size=128)
    print(f"step {result.step}: {result.metric} = {result.precision:.6f}", flush=True)


def eval_check(train_dir: Path, auc_value: float, timeout: float) -> str:
    """``towerflow eval --train-dir`` on one run: its AUC must be ours, to its digits."""
    status, out, _ = run_bounded([sys.executable, "-m", "towerflow", "eval", "--train-dir",
                                  str(train_dir), "--device", "cpu"], timeout)
    found = AUC_LINE.search(out)
    if status != 0 or found is None:
        raise RuntimeError(f"towerflow eval failed (status {status}):\n{out[-3000:]}")
    printed = found.group(1)
    digits = len(printed.split(".")[1])
    if abs(float(printed) - auc_value) > 0.6 * 10 ** -digits:
        raise RuntimeError(f"towerflow eval printed AUC {printed}, --score {auc_value:.6f}")
    return f"towerflow eval: AUC = {printed} (--score {auc_value:.6f})"


# -- rounds, the table, the targets ---------------------------------------------------------
def workloads(quick: bool, data_dir: Path) -> dict[str, Workload]:
    """The two workloads at full size, or ``--quick``'s tiny ones."""
    movielens = ["movielens", "--data-dir", str(data_dir), "--no-download"]
    if quick:
        return {"movielens": Workload("movielens", movielens, 256, 4 * 512),
                "click": Workload("click", ["click", "--table-rows", "2000",
                                            "--ids-per-example", "8", "--embedding-dim", "8"],
                                  512, 10 * 1024)}
    return {"movielens": Workload("movielens", movielens, 256, 256_000),
            "click": Workload("click", ["click"], 512, 2_048_000)}


def one_run(workload: Workload, mode: str, round_index: int, base: Path,
            timeout: float, check_eval: bool) -> Run:
    """Train and score one mode in a fresh train dir, deleted afterwards."""
    train_dir = Path(tempfile.mkdtemp(prefix=f"{workload.name}-{mode}-", dir=base))
    run = Run(workload.name, mode, round_index)
    try:
        watch, run.train_s = train(workload, mode, train_dir, timeout)
        run.rates = watch.rates[1:]
        run.cpu_us, run.cores = watch.cpu()
        start = time.perf_counter()
        run.auc, _ = score(train_dir, timeout)
        run.eval_s = time.perf_counter() - start
        if check_eval:
            print(f"  {workload.name} {mode}: {eval_check(train_dir, run.auc, timeout)}",
                  flush=True)
    finally:
        left = end_leftovers(str(train_dir))
        if left:
            print(f"  ended {len(left)} process(es) left by the run: {left}", flush=True)
        subprocess.run(["rm", "-rf", str(train_dir)], check=False)
    return run


def run_rounds(args: argparse.Namespace, base: Path, loads: dict[str, Workload]) -> list[Run]:
    """``--repeats`` rounds; in each, every workload's modes one after the other, rotated."""
    runs: list[Run] = []
    for r in range(args.repeats):
        for name in args.workloads:
            order = args.modes[r % len(args.modes):] + args.modes[:r % len(args.modes)]
            for mode in (m for m in order if m not in SKIP.get(name, ())):
                run = one_run(loads[name], mode, r + 1, base, args.timeout, check_eval=r == 0)
                runs.append(run)
                print(f"round {r + 1}: {name} {mode}: {run.rate:,.0f} examples/s (median of "
                      f"{len(run.rates)} log lines), AUC {run.auc:.4f}; train {run.train_s:.1f} s"
                      f" (max-steps {max_steps(mode, loads[name])}), score {run.eval_s:.1f} s;"
                      f" {cpu_text(run)}; load average {os.getloadavg()[0]:.1f}", flush=True)
    return runs


def cpu_parts(run: Run) -> tuple[float, float, float]:
    """µs of CPU per example: the workers (and a chief), the ps tasks, the rest (the
    launcher of a cluster run; the process itself of a one-process run)."""
    cpu = run.cpu_us
    if not cpu:
        return math.nan, math.nan, math.nan
    return (cpu.get("worker", 0.0) + cpu.get("chief", 0.0), cpu.get("ps", 0.0),
            cpu.get("main", 0.0))


def cpu_text(run: Run) -> str:
    workers, ps, rest = cpu_parts(run)
    return (f"CPU per example {workers + ps + rest:.1f} µs (workers {workers:.1f}, ps tasks "
            f"{ps:.1f}, launcher or one process {rest:.1f}) on {run.cores:.2f} cores")


def _median(values: Sequence[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return statistics.median(values) if values else math.nan


def summary(runs: Sequence[Run], workload: str, modes: Sequence[str]) -> list[dict]:
    """One row per mode: medians, ranges, ratios to async, AUC gaps to sync and one."""
    by = {m: rs for m in modes
          if (rs := [r for r in runs if r.workload == workload and r.mode == m])}
    med = {m: (_median([r.rate for r in rs]), _median([r.auc for r in rs]))
           for m, rs in by.items()}
    rows = []
    for mode, rs in by.items():
        rate, auc_value = med[mode]
        rounds = {r.round: r.rate for r in by.get("async", [])}
        per_round = [r.rate / rounds[r.round] for r in rs if r.round in rounds]
        rows.append({
            "workload": workload, "mode": mode, "rate": rate,
            "rate_range": (min(r.rate for r in rs), max(r.rate for r in rs)),
            "vs_async": rate / med["async"][0] if "async" in med else math.nan,
            "vs_async_rounds": _median(per_round), "auc": auc_value,
            "auc_range": (min(r.auc for r in rs), max(r.auc for r in rs)),
            "gap_sync": auc_value - med["sync"][1] if "sync" in med else math.nan,
            "gap_one": auc_value - med["one"][1] if "one" in med else math.nan,
            "cpu": [_median([cpu_parts(r)[i] for r in rs]) for i in range(3)],
            "cores": _median([r.cores for r in rs])})
    return rows


def _cell(value: float, fmt: str) -> str:
    return "-" if math.isnan(value) else format(round(value, 4) + 0.0, fmt)  # no -0.0000


def table(rows: Sequence[dict]) -> list[str]:
    """The markdown table of :func:`summary`'s rows."""
    lines = ["| workload | mode | examples/s | range | / async | / async, per round | AUC | "
             "AUC range | AUC - sync | AUC - one |", "|---" * 10 + "|"]
    for row in rows:
        lo, hi = row["rate_range"]
        alo, ahi = row["auc_range"]
        lines.append(
            f"| {row['workload']} | {row['mode']} | {row['rate']:,.0f} | {lo:,.0f}-{hi:,.0f} | "
            f"{_cell(row['vs_async'], '.2f')} | {_cell(row['vs_async_rounds'], '.2f')} | "
            f"{row['auc']:.4f} | {alo:.4f}-{ahi:.4f} | {_cell(row['gap_sync'], '+.4f')} | "
            f"{_cell(row['gap_one'], '+.4f')} |")
    return lines


def cpu_table(rows: Sequence[dict]) -> list[str]:
    """Where the CPU went: µs per example by role (medians), and the cores busy."""
    lines = ["| workload | mode | CPU µs per example | workers | ps tasks | launcher or one "
             "process | cores busy |", "|---" * 7 + "|"]
    for row in rows:
        workers, ps, rest = row["cpu"]
        lines.append(f"| {row['workload']} | {row['mode']} | {workers + ps + rest:.1f} | "
                     f"{workers:.1f} | {ps:.1f} | {rest:.1f} | {row['cores']:.2f} |")
    return lines


def targets(rows: Sequence[dict]) -> list[str]:
    """The issue's targets, each with its figure and met / missed (absent modes: skipped)."""
    lines = []
    get = {(r["workload"], r["mode"]): r for r in rows}
    for mode in ("hybrid", "hybrid-ahead"):
        hybrid = get.get(("movielens", mode))
        for other in ("sync", "one"):
            if hybrid is not None and ("movielens", other) in get:
                gap = round(hybrid[f"gap_{other}"], 6)  # --score's digits
                lines.append(f"movielens: {mode} AUC - {other} AUC = {_cell(gap, '+.4f')} "
                             f"(target within {AUC_TARGET}): "
                             f"{'met' if abs(gap) <= AUC_TARGET else 'missed'}")
        for workload in ("movielens", "click"):
            row = get.get((workload, mode))
            if row is not None and (workload, "async") in get:
                ratio, per_round = row["vs_async"], row["vs_async_rounds"]
                lines.append(f"{workload}: {mode} / async examples/s = {ratio:.2f} (median of "
                             f"the rounds' own ratios {per_round:.2f}; target >= 1): "
                             f"{'met' if ratio >= 1 else 'missed'}")
    return lines


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="movielens,click",
                        help="comma-separated: movielens, click")
    parser.add_argument("--modes", default=None,
                        help="comma-separated of hybrid, async, sync, one (default: all four; "
                        "--quick: hybrid,async)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny data, a few steps, one round: checks that it runs")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds one training or scoring run may take (then it is stopped)")
    parser.add_argument("--seed", type=int, default=0, help="the MovieLens data set's seed")
    parser.add_argument("--score", metavar="TRAIN_DIR", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.workloads = args.workloads.split(",")
    args.modes = (args.modes or ("hybrid,async" if args.quick else "hybrid,async,sync,one"))
    args.modes = args.modes.split(",")
    for name in args.workloads + args.modes:
        if name not in ("movielens", "click", *MODES):
            parser.error(f"unknown workload or mode {name!r}")
    if args.quick:
        args.repeats = 1
    return args


def stop_on_sigterm() -> None:
    """SIGTERM ends this process as an exception would: each run's clean-up runs (its
    processes ended, its train dir removed)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    stop_on_sigterm()
    if args.score:
        score_here(args.score)
        return 0
    with tempfile.TemporaryDirectory(prefix="hybrid-modes-") as tmp:
        base = Path(tmp)
        size = {"users": 100, "items": 200, "ratings": 5_000} if args.quick else {}
        truth = write_movielens(base / "ml-100k", seed=args.seed, **size) \
            if "movielens" in args.workloads else math.nan
        loads = workloads(args.quick, base)
        for name in args.workloads:
            w = loads[name]
            print(f"{name}: {w.examples:,} examples per run, batches of {w.batch}; "
                  + ", ".join(f"{m} --max-steps {max_steps(m, w)}" for m in args.modes
                              if m not in SKIP.get(name, ())))
        if not math.isnan(truth):
            print(f"movielens: the planted truth's AUC on the test split {truth:.4f}")
        runs = run_rounds(args, base, loads)
    rows = [row for name in args.workloads for row in summary(runs, name, args.modes)]
    print(f"\nmedians of {args.repeats} round(s); examples/s: the median of each run's step "
          "log lines after the first")
    print("\n".join(table(rows)))
    print("\nCPU per example between the first and last step line (each process's user + "
          "system time; medians), and the cores the run's processes kept busy meanwhile")
    print("\n".join(cpu_table(rows)))
    print("\n".join(targets(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
