"""Your own model, trained with towerflow's strategy, logging, summaries and checkpoints.

A small convolutional network on scikit-learn's 8x8 digits (real data, no
download), trained with :class:`towerflow.Trainer`: the same code runs on one
device, on N GPUs or N CPU processes of one machine, and on N machines. The
strategy is picked from the environment — ``Mirrored`` (all-reduce) when the
process is a replica, ``SingleDevice`` otherwise.

One GPU (or the CPU when there is none)::

    python examples/multi_gpu_custom_model.py --train-dir runs/custom

N GPUs of one machine (one process per GPU, NCCL)::

    torchrun --nproc-per-node 4 examples/multi_gpu_custom_model.py --train-dir runs/custom
    python examples/multi_gpu_custom_model.py --replicas 4 --train-dir runs/custom   # same

N CPU processes (Gloo), e.g. on a laptop or in CI::

    python examples/multi_gpu_custom_model.py --replicas 2 --cpu --train-dir runs/custom

N machines (run on each; rank 0's address is the rendezvous)::

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 4 \\
        --master-addr 10.0.0.1 --master-port 29500 \\
        examples/multi_gpu_custom_model.py --train-dir /shared/runs/custom
    # or, under Kubeflow's TFJob, the TF_CONFIG it sets (a chief and workers, no ps)

Running the same command again resumes from the latest checkpoint in
``--train-dir``; ``tensorboard --logdir runs/custom`` shows the summaries.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

import towerflow
from towerflow.cluster.launcher import spawn_replicas
from towerflow.data import load_digits
from towerflow.strategies import OptimizerConfig
from towerflow.training import ExponentialDecay, TrainConfig, default_strategy
from towerflow.training.evaluate import evaluate


class SmallConvNet(nn.Module):
    """Conv 3x3x32 -> 2x2 max pool -> fully connected 512 -> 10 logits."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 32, 3, padding=1)
        self.logits = nn.Linear(32 * 4 * 4, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv(images)), 2)
        return self.logits(torch.flatten(x, 1))


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``loss_fn(model, batch)``: ``model`` may be wrapped by the strategy; call it as is."""
    images, labels = batch
    return F.cross_entropy(model(images), labels)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-dir", default="runs/custom")
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32, help="per replica")
    parser.add_argument("--replicas", type=int, default=1, help="processes on this machine")
    parser.add_argument("--cpu", action="store_true", help="train on CPUs even with GPUs")
    return parser.parse_args(argv)


def train(args: argparse.Namespace) -> None:
    """One replica (or the only process): build, train, evaluate."""
    torch.manual_seed(0)
    device = "cpu" if args.cpu else None
    strategy = default_strategy(device)
    config = TrainConfig(train_dir=args.train_dir, max_steps=args.max_steps,
                         batch_size=args.batch_size, log_every=50, summary_every=100,
                         checkpoint_every=100)
    schedule = ExponentialDecay(0.1, decay_steps=200, decay_rate=0.5)
    with towerflow.Trainer(SmallConvNet(), loss_fn, load_digits("train"), strategy=strategy,
                           optimizer=OptimizerConfig("momentum", lr=0.1, momentum=0.9),
                           schedule=schedule, config=config) as trainer:
        result = trainer.fit()
        if strategy.is_chief:
            test = load_digits("test")
            precision = evaluate(trainer.model, test, device=strategy.device)
            print(f"step {result.step}: test precision @ 1 = {precision:.3f}", flush=True)
    strategy.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replicas > 1 and "RANK" not in os.environ:
        # Start this script once per replica with torchrun's environment.
        command = [sys.executable, os.path.abspath(__file__), "--train-dir", args.train_dir,
                   "--max-steps", str(args.max_steps), "--batch-size", str(args.batch_size)]
        return spawn_replicas(command + (["--cpu"] if args.cpu else []), args.replicas)
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
