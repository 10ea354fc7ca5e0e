"""towerflow's training loop vs a plain PyTorch loop, on the article's CIFAR-10 model.

Two figures, each measured against its baseline in the same run, interleaved
round by round so that a noisy machine disturbs both alike:

1. Mirrored: 2 CPU replicas over Gloo. towerflow's ``Trainer`` with the
   ``Mirrored`` strategy vs a plain ``DistributedDataParallel`` loop written
   here (SGD, the learning rate set every step, the loss read every 10 steps).
   Target: step-time ratio <= 1.05.
2. Single device: towerflow's ``Trainer`` with ``SingleDevice`` vs the same
   plain loop without DDP. Target: <= 1.03.

Both loops see the same pre-built batches (24x24 float images), so the figure
is the cost of the loop itself. towerflow runs as plain PyTorch would here:
no moving averages, no checkpoints or summaries (``--ema`` adds the article's
moving averages to towerflow's side only, for information).

    python benchmarks/mirrored_vs_ddp.py [--batch-size 32] [--steps 20] [--rounds 10] [--warmup 20]
    python benchmarks/mirrored_vs_ddp.py --only single --device cuda:0 --batch-size 128   # a GPU
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F


def _batches(batch_size: int, count: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(batch_size, 3, 24, 24, generator=g),
             torch.randint(0, 10, (batch_size,), generator=g)) for _ in range(count)]


def _plain_loop(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                batches: list, steps: int, start: int) -> None:
    """What a PyTorch user writes by hand: forward, backward, step; log every 10 steps."""
    from towerflow.models import weight_decay_loss

    for i in range(start, start + steps):
        images, labels = batches[i % len(batches)]
        for group in optimizer.param_groups:
            group["lr"] = 0.1 * 0.1 ** (i // 100000)
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(images), labels) + weight_decay_loss(model)
        loss.backward()
        optimizer.step()
        if (i + 1) % 10 == 0:
            loss.item()


class _Cycle:
    """The same batches, forever (what both loops read)."""

    def __init__(self, batches: list) -> None:
        self.batches = batches

    def __iter__(self):
        while True:
            yield from self.batches


def _trainer(strategy, batches: list, ema: bool):
    from towerflow.models import Cifar10Net, cross_entropy_loss
    from towerflow.strategies.base import OptimizerConfig
    from towerflow.training import ExponentialDecay, TrainConfig, Trainer

    torch.manual_seed(0)
    config = TrainConfig(max_steps=1, batch_size=len(batches[0][1]), log_every=10,
                         summary_every=0, ema_decay=0.9999 if ema else None, progress=False)
    return Trainer(Cifar10Net(), cross_entropy_loss, _Cycle(batches), strategy=strategy,
                   optimizer=OptimizerConfig(lr=0.1),
                   schedule=ExponentialDecay(0.1, decay_steps=100000, decay_rate=0.1),
                   config=config, hooks=())


def _timed(fn, barrier) -> float:
    barrier()
    start = time.perf_counter()
    fn()
    barrier()
    return time.perf_counter() - start


def _compare(strategy, plain_model, batches, args, barrier) -> tuple[float, float]:
    """Median seconds per step of towerflow and of the plain loop."""
    import contextlib
    import io

    trainer = _trainer(strategy, batches, args.ema)
    optimizer = torch.optim.SGD(plain_model.parameters(), lr=0.1)
    towerflow_times, plain_times = [], []
    quiet = contextlib.redirect_stdout(io.StringIO())
    with quiet:
        trainer.fit(args.warmup)
    _plain_loop(plain_model, optimizer, batches, args.warmup, 0)
    for r in range(args.rounds):
        target, start = args.warmup + (r + 1) * args.steps, args.warmup + r * args.steps
        runs = [(towerflow_times, lambda t=target: trainer.fit(t)),
                (plain_times,
                 lambda s=start: _plain_loop(plain_model, optimizer, batches, args.steps, s))]
        for times, run in runs if r % 2 == 0 else runs[::-1]:  # ABBA: neither always first
            with quiet:
                times.append(_timed(run, barrier))
    return (statistics.median(towerflow_times) / args.steps,
            statistics.median(plain_times) / args.steps)


def replica(args: argparse.Namespace) -> None:
    """One of the 2 Gloo replicas of figure 1."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from towerflow.models import Cifar10Net
    from towerflow.strategies.mirrored import Mirrored

    strategy = Mirrored(device="cpu")
    torch.manual_seed(0)
    plain = DistributedDataParallel(Cifar10Net())
    batches = _batches(args.batch_size)
    tf_step, plain_step = _compare(strategy, plain, batches, args, dist.barrier)
    if strategy.rank == 0:
        _report("Mirrored, 2 CPU replicas (Gloo)", "plain DDP loop", tf_step, plain_step,
                args.batch_size * 2, 1.05)
    strategy.shutdown()


def single(args: argparse.Namespace) -> None:
    """Figure 2, in this process."""
    from towerflow.models import Cifar10Net
    from towerflow.strategies.single import SingleDevice

    device = torch.device(args.device)
    torch.manual_seed(0)
    batches = [(x.to(device), y.to(device)) for x, y in _batches(args.batch_size)]
    barrier = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    tf_step, plain_step = _compare(SingleDevice(device), Cifar10Net().to(device), batches,
                                   args, barrier)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "1 CPU process"
    _report(f"SingleDevice, {where}", "plain PyTorch loop", tf_step, plain_step,
            args.batch_size, 1.03)


def _report(what: str, baseline: str, tf_step: float, plain_step: float, batch: int,
            target: float) -> None:
    ratio = tf_step / plain_step
    print(f"{what}: towerflow {tf_step * 1000:.1f} ms/step ({batch / tf_step:.1f} examples/sec), "
          f"{baseline} {plain_step * 1000:.1f} ms/step ({batch / plain_step:.1f} examples/sec); "
          f"ratio {ratio:.3f} (target <= {target:.2f}: {'PASS' if ratio <= target else 'FAIL'})",
          flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32, help="per replica")
    parser.add_argument("--steps", type=int, default=20, help="steps per round")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--ema", action="store_true", help="towerflow keeps moving averages")
    parser.add_argument("--only", choices=("mirrored", "single"), default=None)
    parser.add_argument("--device", default="cpu", help="device of figure 2 (e.g. cuda:0)")
    parser.add_argument("--replica", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.replica:
        replica(args)
        return 0
    status = 0
    if args.only in (None, "mirrored"):
        from towerflow.cluster.launcher import spawn_replicas

        argv = [sys.executable, os.path.abspath(__file__), "--replica",
                "--batch-size", str(args.batch_size), "--steps", str(args.steps),
                "--rounds", str(args.rounds), "--warmup", str(args.warmup)]
        status = spawn_replicas(argv + (["--ema"] if args.ema else []), 2,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
    if args.only in (None, "single"):
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        single(args)
    return status


if __name__ == "__main__":
    sys.exit(main())
