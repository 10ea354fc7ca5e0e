"""Tiny CIFAR-10 binary files in the real format, written by the tests."""

from __future__ import annotations

from pathlib import Path

import torch

from towerflow.data import write_batch_file


def write_tiny_cifar10(data_dir: Path, per_file: int = 4) -> None:
    """Binary CIFAR-10 files in the real format, ``per_file`` records each."""
    data_dir.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    names = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]
    for name in names:
        images = torch.randint(0, 256, (per_file, 3, 32, 32), dtype=torch.uint8, generator=g)
        labels = torch.randint(0, 10, (per_file,), generator=g)
        write_batch_file(data_dir / name, images, labels)
