"""Device placement with towerflow: every snippet of "using GPUs across devices" and
§1 of "accelerated computing", written with PyTorch.

It lists the local devices, logs where each operation runs, pins operations with
``towerflow.device`` scopes, shows the error for a device that does not exist and
the soft-placement fallback, builds a two-tower sum on the CPU, and trains a model
on one device and runs it on another through ``towerflow.save`` / ``towerflow.load``.
On a machine without a GPU it shows the error and soft-placement paths.

Commands::

    # any machine (CPU only: the error and soft-placement paths)
    python examples/device_placement.py

    # one or more GPUs; make physical GPUs 2 and 0 visible as GPU 0 and 1, and cap
    # each at 70% of its memory
    python examples/device_placement.py --visible-devices 2,0 --gpu-memory-fraction 0.7

    # the same through the environment, as CUDA does it
    CUDA_VISIBLE_DEVICES=2,0,3 python examples/device_placement.py
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile

import torch
from torch import nn

import towerflow
from towerflow.devices import configure, device, list_local_devices, resolve_device


def section(title: str) -> None:
    print(f"\n=== {title} ===", flush=True)


def constants() -> tuple[torch.Tensor, torch.Tensor]:
    """``tf.constant([1..6], shape=[2, 3])`` and ``shape=[3, 2]``."""
    a = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).reshape(2, 3)
    b = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).reshape(3, 2)
    return a, b


def list_devices() -> None:
    section("device_lib.list_local_devices()")
    print(f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}")
    for info in list_local_devices():
        print(info)
        print(",")
    print(f"default device for new work: {resolve_device(None)}")
    fraction = towerflow.devices.get_config().gpu_memory_fraction
    print(f"gpu_memory_fraction={fraction}: a GPU's memory_limit above is that share of its "
          f"memory; torch.cuda.set_per_process_memory_fraction enforces it "
          f"({torch.cuda.device_count() if torch.cuda.is_available() else 0} GPU(s) here)")


def log_placement() -> None:
    section("log_device_placement=True: c = matmul(a, b)")
    with configure(log_device_placement=True, default_device="auto"):
        a, b = constants()
        c = torch.matmul(a, b)
        print(c.tolist())


def manual_placement() -> None:
    section("with device('/cpu:0'): a, b  -- then c = matmul(a, b) outside")
    with configure(log_device_placement=True, default_device="auto"):
        with device("/cpu:0"):
            a, b = constants()
        c = torch.matmul(a, b)
        print(f"a on {a.device}, b on {b.device}, c on {c.device}: {c.tolist()}")


def missing_device() -> None:
    section("with device('/gpu:2'): a device that may not exist")
    try:
        with configure(log_device_placement=True), device("/gpu:2"):
            a, b = constants()
            c = torch.matmul(a, b)
        print(f"GPU 2 exists: c = {c.tolist()} on {c.device}")
    except towerflow.PlacementError as error:
        print(f"PlacementError: {error}")
    section("the same with allow_soft_placement=True")
    with configure(log_device_placement=True, allow_soft_placement=True), device("/gpu:2"):
        a, b = constants()
        c = torch.matmul(a, b)
    print(f"c = {c.tolist()} on {c.device}")


def multi_tower() -> None:
    section("multi-tower: matmul on /gpu:2 and /gpu:3, add_n on /cpu:0")
    with configure(log_device_placement=True, allow_soft_placement=True):
        towers = []
        for name in ["/gpu:2", "/gpu:3"]:
            with device(name):
                a, b = constants()
                towers.append(torch.matmul(a, b))
        with device("/cpu:0"):
            total = torch.stack(towers).sum(dim=0)  # tf.add_n
    print(f"sum = {total.tolist()} on {total.device}")


def add_n_default_and_pinned() -> None:
    section("article 000: c = add_n([a, b]) with the default device (GPU first)")
    with configure(log_device_placement=True, default_device="auto"):
        a = torch.tensor([1.0, 2.0, 3.0])
        b = torch.tensor([1.0, 2.0, 3.0])
        c = torch.stack([a, b]).sum(dim=0)
    print(c.tolist())
    section("article 000: a, b on /CPU:0, c on /GPU:0")
    for soft in (False, True):
        try:
            with configure(log_device_placement=True, allow_soft_placement=soft):
                with device("/CPU:0"):
                    a = torch.tensor([1.0, 2.0, 3.0])
                    b = torch.tensor([1.0, 2.0, 3.0])
                with device("/GPU:0"):
                    c = torch.stack([a, b]).sum(dim=0)
            print(f"allow_soft_placement={soft}: c = {c.tolist()} on {c.device}")
        except towerflow.PlacementError as error:
            print(f"allow_soft_placement={soft}: PlacementError: {error}")


def variables_with_soft_placement() -> None:
    section("article 000: a_cpu and a_gpu variables, soft placement")
    with configure(log_device_placement=True, allow_soft_placement=True):
        a_cpu = nn.Parameter(torch.tensor(0.0))
        with device("/gpu:0"):
            a_gpu = nn.Parameter(torch.tensor(0.0))
    print(f"a_cpu on {a_cpu.device}, a_gpu on {a_gpu.device}")


def op_without_gpu_kernel() -> None:
    section("an operation with no GPU kernel (torch.histogram) on /gpu:0")
    values, edges = torch.linspace(0, 1, 100), torch.linspace(0, 1, 5)
    for soft in (False, True):
        try:
            with configure(log_device_placement=True, allow_soft_placement=soft):
                with device("/gpu:0"):
                    hist, _ = torch.histogram(values, edges)
            print(f"allow_soft_placement={soft}: {hist.tolist()} on {hist.device}")
        except towerflow.PlacementError as error:
            print(f"allow_soft_placement={soft}: PlacementError: {error}")


def memory_cap() -> None:
    fraction = towerflow.devices.get_config().gpu_memory_fraction
    if not torch.cuda.is_available() or fraction is None or fraction >= 0.9:
        return
    total = torch.cuda.get_device_properties(0).total_memory
    share = min(fraction + 0.1, 1.0)
    section(f"gpu_memory_fraction={fraction}: allocate {share:.0%} of GPU 0's memory")
    try:
        torch.empty(int(total * share), dtype=torch.uint8, device="cuda:0")
        print("allocated: the cap did not hold")
    except torch.OutOfMemoryError as error:
        print(f"OutOfMemoryError: {str(error).splitlines()[0]}")
    kept = torch.empty(int(total * (fraction - 0.05)), dtype=torch.uint8, device="cuda:0")
    print(f"{fraction - 0.05:.0%} of it: allocated {kept.numel() / 2**30:.1f} GiB")
    del kept
    torch.cuda.empty_cache()


def train(device_name: str, x: torch.Tensor, y: torch.Tensor) -> nn.Module:
    """Fit y = 3x + 0.5 with every tensor of the model on ``device_name``."""
    torch.manual_seed(0)
    with device(device_name):
        model = nn.Linear(1, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        for _ in range(100):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)  # x, y are copied to the device
            loss.backward()
            optimizer.step()
    print(f"trained on {model.weight.device}: loss {loss.item():.5f}")
    return model


def train_on_one_device_run_on_another() -> None:
    section("train on one device, run inference on another (save / load)")
    devices = ["/cpu:0"] + (["/gpu:0"] if torch.cuda.is_available() else [])
    x = torch.linspace(-1, 1, 64).unsqueeze(1)
    y = 3 * x + 0.5
    for train_name in devices:
        model = train(train_name, x, y)
        expected = model(x.to(model.weight.device)).detach().cpu()
        with tempfile.TemporaryDirectory() as tmp:
            path = towerflow.save(model, os.path.join(tmp, "linear"))
            for infer_name in devices:  # the same code whatever the two devices are
                with device(infer_name):
                    fresh = nn.Linear(1, 1)
                towerflow.load(path, device=resolve_device(infer_name), into=fresh)
                out = fresh(x.to(fresh.weight.device)).detach().cpu()
                same = torch.allclose(out, expected, atol=1e-5)
                print(f"  trained on {train_name}, inference on {infer_name}: predictions "
                      f"match training device: {same}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--visible-devices", default=None,
                        help="GPUs to show, like CUDA_VISIBLE_DEVICES (e.g. 2,0)")
    parser.add_argument("--gpu-memory-fraction", type=float, default=0.7,
                        help="per-process cap on each GPU's memory (default 0.7)")
    args = parser.parse_args(argv)
    # The placement log goes to the logger "towerflow.placement" (stderr by default);
    # here it goes to stdout so that it interleaves with the printed results.
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logging.getLogger("towerflow.placement").addHandler(handler)
    if args.visible_devices is not None:  # before anything touches CUDA
        configure(visible_devices=args.visible_devices)
    configure(gpu_memory_fraction=args.gpu_memory_fraction)
    list_devices()
    log_placement()
    manual_placement()
    missing_device()
    multi_tower()
    add_n_default_and_pinned()
    variables_with_soft_placement()
    op_without_gpu_kernel()
    memory_cap()
    train_on_one_device_run_on_another()
    return 0


if __name__ == "__main__":
    sys.exit(main())
