"""Cost of towerflow's placement on a CIFAR-10-size CNN training step (CPU).

Four variants of the same step (conv 5x5x64, pool, conv 5x5x64, pool, fc 384,
fc 192, fc 10 on 24x24x3 images, batch 128, SGD with momentum), one step at a
time in a shuffled order each round so that machine noise hits them alike:

* ``plain``: plain PyTorch;
* ``idle``: towerflow imported, a scope and the log opened and closed once
  before, nothing active now (checked: no mode on the stack, no module hooks);
* ``scope``: the step inside ``towerflow.device('/cpu:0')``;
* ``log``: ``log_device_placement=True`` with the log going to a ``NullHandler``;
* ``torch.device``: the step inside PyTorch's own ``with torch.device(...)``
  (also a function mode that sees every operation: the floor of any placement
  scope in eager PyTorch), for reference.

It prints the median step time of each, its ratio to ``plain``, and the median
of the per-round ratios (each variant against the ``plain`` step of the same
round, which cancels slow drifts in machine load). Targets: idle <= 1.01x,
scope <= 1.05x, log <= 1.5x.

Commands::

    python benchmarks/placement_overhead.py                  # ~1-2 minutes on 2 cores
    python benchmarks/placement_overhead.py --rounds 40 --batch-size 128
    python benchmarks/placement_overhead.py --device cuda:0 --rounds 200   # on a GPU
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import random
import statistics
import time
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

import towerflow

TARGETS = {"idle": 1.01, "scope": 1.05, "log": 1.5}


class Cifar10Net(nn.Module):
    """The CIFAR-10 model of the multi-GPU article (inference part)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 5, padding=2)
        self.conv2 = nn.Conv2d(64, 64, 5, padding=2)
        self.local3 = nn.Linear(64 * 6 * 6, 384)
        self.local4 = nn.Linear(384, 192)
        self.softmax_linear = nn.Linear(192, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 3, stride=2, padding=1)
        x = F.max_pool2d(F.relu(self.conv2(x)), 3, stride=2, padding=1)
        x = x.flatten(1)
        x = F.relu(self.local3(x))
        x = F.relu(self.local4(x))
        return self.softmax_linear(x)


def make_step(batch_size: int, device: str = "cpu") -> Callable[[], None]:
    """One training step on ``device``; on a GPU it waits for the GPU before returning."""
    torch.manual_seed(0)
    model = Cifar10Net().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    images = torch.randn(batch_size, 3, 24, 24, device=device)
    labels = torch.randint(0, 10, (batch_size,), device=device)
    cuda = torch.device(device).type == "cuda"

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        if cuda:
            torch.cuda.synchronize()

    return step


def nothing_installed() -> bool:
    module = torch.nn.modules.module
    return not (_get_current_function_mode_stack() or module._global_forward_hooks
                or module._global_forward_pre_hooks)


#: the scope variant's device (``towerflow.device`` form of ``--device``)
SCOPE = {"spec": "/cpu:0", "torch": "cpu"}


@contextlib.contextmanager
def variant(name: str) -> Iterator[None]:
    if name in ("plain", "idle"):
        if not nothing_installed():
            raise RuntimeError(f"variant {name!r}: something is installed in PyTorch")
        yield
    elif name == "scope":
        with towerflow.device(SCOPE["spec"]):
            yield
    elif name == "torch.device":  # PyTorch's own device context: a function mode too
        with torch.device(SCOPE["torch"]):
            yield
    else:
        with towerflow.configure(log_device_placement=True):
            yield


def measure(step: Callable[[], None], rounds: int, warmup: int) -> dict[str, list[float]]:
    names = ["plain", "idle", "scope", "log", "torch.device"]
    times: dict[str, list[float]] = {name: [] for name in names}
    order = random.Random(0)
    for round_index in range(warmup + rounds):
        order.shuffle(names)
        for name in names:
            with variant(name):
                start = time.perf_counter()
                step()
                elapsed = time.perf_counter() - start
            if round_index >= warmup:
                times[name].append(elapsed)
    return times


class _CountCalls(TorchFunctionMode):
    """Counts the calls that reach a function mode during one step."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.calls += 1
        return func(*args, **(kwargs or {}))


def per_call_cost(device: str = "cpu", repeats: int = 20000) -> tuple[float, float]:
    """Microseconds added per intercepted call by a scope and by the log (tiny tensors)."""
    a = torch.ones(4, device=device)

    def calls() -> float:
        start = time.perf_counter()
        for _ in range(repeats):
            torch.add(a, a)
        return (time.perf_counter() - start) / repeats * 1e6

    samples: dict[str, list[float]] = {"plain": [], "scope": [], "log": []}
    for _ in range(5):
        for name in samples:
            with variant(name):
                samples[name].append(calls())
    plain = statistics.median(samples["plain"])
    return (statistics.median(samples["scope"]) - plain,
            statistics.median(samples["log"]) - plain)


def main() -> int:
    parser = argparse.ArgumentParser(description="placement overhead on a CNN training step")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--device", default="cpu",
                        help="where the step runs: cpu, or cuda:N (the scope is /gpu:N)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: PyTorch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    logger = logging.getLogger("towerflow.placement")
    logger.addHandler(logging.NullHandler())  # the log variant formats nothing to a stream
    with towerflow.device("/cpu:0"), towerflow.configure(log_device_placement=True):
        pass  # "idle" is measured after towerflow was used and closed again
    if torch.device(args.device).type == "cuda":
        SCOPE["spec"] = f"/gpu:{torch.device(args.device).index or 0}"
        SCOPE["torch"] = args.device
    step = make_step(args.batch_size, args.device)
    counter = _CountCalls()
    with counter:
        step()
    scope_us, log_us = per_call_cost(args.device)
    times = measure(step, args.rounds, args.warmup)
    plain = statistics.median(times["plain"])
    where = torch.cuda.get_device_name(args.device) if SCOPE["spec"] != "/cpu:0" else "CPU"
    print(f"{where}, torch {torch.__version__}, {torch.get_num_threads()} threads, batch "
          f"{args.batch_size}, {args.rounds} rounds (+{args.warmup} warm-up), medians:")
    for name, samples in times.items():
        median = statistics.median(samples)
        paired = statistics.median(t / p for t, p in zip(samples, times["plain"], strict=True))
        target = (f"(target <= {TARGETS[name]:.2f}x)" if name in TARGETS
                  else "(reference)" if name != "plain" else "(baseline)")
        print(f"  {name:12s} {median * 1e3:8.2f} ms/step  {median / plain:6.3f}x plain  "
              f"per-round {paired:6.3f}x  {target}")
    print(f"{counter.calls} calls per step reach the placer; each costs {scope_us:.1f} us in a "
          f"scope and {log_us:.1f} us with the log on: {counter.calls * scope_us / 1e3:.2f} ms "
          f"and {counter.calls * log_us / 1e3:.2f} ms per step "
          f"({counter.calls * scope_us / 1e3 / plain / 1e3:.2%} and "
          f"{counter.calls * log_us / 1e3 / plain / 1e3:.2%} of the plain step)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
