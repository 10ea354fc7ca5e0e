"""``towerflow train cifar10`` against a plain PyTorch loop on the same device, examples/sec.

Both sides train article 001's CIFAR-10 model on the same synthetic data
(``towerflow.data.synthetic_cifar10``: uint8 32x32 images) with the same
work per step: a batch of 128 taken in a shuffled order, copied from pinned
memory, randomly distorted on the device (crop to 24x24, flip, brightness,
contrast, standardisation: ``distort_images``), forward, cross entropy plus
weight decay, backward, SGD with the staircase learning rate, and the loss
read every ``--log-every`` steps for the step line. towerflow's side is the
command line as a user runs it (``--num-gpus 1`` on a GPU machine, else
``--device /cpu:0``), without moving averages (``--ema-decay 0``) since the
plain loop keeps none, no checkpoints and no summaries. The plain side is
this file's loop, a fresh process. Runs alternate (towerflow, plain, plain,
towerflow, ...); each run's figure is the median of its step lines after the
first, and the ratio is of the medians over runs. Target: >= 0.97x.

    python benchmarks/train_vs_plain.py                        # a GPU when present
    python benchmarks/train_vs_plain.py --steps 1000 --runs 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from ps_vs_mirrored import RATE, run  # the same directory


def plain(args: argparse.Namespace) -> None:
    """The loop a PyTorch user writes by hand; prints towerflow's step line format."""
    import torch.nn.functional as F  # noqa: N812

    from towerflow.data import synthetic_cifar10
    from towerflow.data.augment import distort_images
    from towerflow.models import Cifar10Net, weight_decay_loss

    device = torch.device(args.device)
    torch.manual_seed(0)
    data = synthetic_cifar10(args.examples, seed=0)
    model = Cifar10Net().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator(device=device).manual_seed(0)
    pin = device.type == "cuda"
    step, last, n = 0, time.perf_counter(), len(data.labels)
    while step < args.steps:
        order = torch.randperm(n)
        for start in range(0, n - args.batch_size + 1, args.batch_size):
            index = order[start:start + args.batch_size]
            images, labels = data.images[index], data.labels[index]
            if pin:
                images, labels = images.pin_memory(), labels.pin_memory()
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            for group in optimizer.param_groups:  # staircase decay, as the trainer's
                group["lr"] = 0.1 * 0.1 ** (step * args.batch_size // (350 * n))
            optimizer.zero_grad(set_to_none=True)
            logits = model(distort_images(images, generator))
            loss = F.cross_entropy(logits, labels) + weight_decay_loss(model)
            loss.backward()
            optimizer.step()
            step += 1
            if step % args.log_every == 0:
                value = loss.item()
                now = time.perf_counter()
                per_batch = (now - last) / args.log_every
                print(f"step {step}, loss = {value:.2f} ({args.batch_size / per_batch:.1f} "
                      f"examples/sec; {per_batch:.3f} sec/batch)", flush=True)
                last = now
            if step >= args.steps:
                break


def run_plain(args: argparse.Namespace) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--role", "plain", "--device",
               args.device, "--steps", str(args.steps), "--batch-size", str(args.batch_size),
               "--log-every", str(args.log_every), "--examples", str(args.examples)]
    start = time.monotonic()
    proc = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"plain loop failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    rates = [float(m.group(2)) for m in RATE.finditer(proc.stdout)]
    return {"median": statistics.median(rates[1:]), "wall": time.monotonic() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--examples", type=int, default=10000)
    parser.add_argument("--runs", type=int, default=2, help="runs of each side, alternated")
    parser.add_argument("--device", default=None, help="default: cuda:0 when there is a GPU")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--role", default="main")
    args = parser.parse_args()
    args.device = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    if args.role == "plain":
        plain(args)
        return
    cuda = torch.device(args.device).type == "cuda"
    where = ["--num-gpus", "1"] if cuda else ["--device", "/cpu:0"]
    name = torch.cuda.get_device_name(args.device) if cuda else "CPU"
    common = [*where, "--max-steps", str(args.steps), "--batch-size", str(args.batch_size),
              "--log-every", str(args.log_every), "--summary-every", "0", "--ema-decay", "0",
              "--synthetic-examples", str(args.examples)]
    print(f"CIFAR-10 model on {name} (torch {torch.__version__}), synthetic data, batch "
          f"{args.batch_size}, {args.steps} steps a run, {args.runs} runs each", flush=True)
    ours, theirs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(args.runs):
            sides = [("towerflow", ours), ("plain", theirs)]
            for label, figures in sides if index % 2 == 0 else sides[::-1]:
                if label == "plain":
                    result = run_plain(args)
                else:
                    result = run(label, common, os.path.join(tmp, f"run{index}"), args.timeout)
                figures.append(result["median"])
                print(f"  {label}: {result['median']:.1f} examples/sec ({result['wall']:.0f} s)",
                      flush=True)
    mine, base = statistics.median(ours), statistics.median(theirs)
    ratio = mine / base
    print(f"towerflow train cifar10 {' '.join(where)}: {mine:.1f} examples/sec; plain PyTorch "
          f"loop: {base:.1f}; ratio {ratio:.3f} (target >= 0.97: "
          f"{'PASS' if ratio >= 0.97 else 'FAIL'})")


if __name__ == "__main__":
    main()
