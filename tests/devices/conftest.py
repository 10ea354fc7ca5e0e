"""Fixtures of the device tests: a device other than the CPU on a machine without a GPU."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="session")
def second_device() -> Any:
    """PyTorch's ``lazy`` device: a device other than the CPU on a machine without a GPU
    (tensors on it and on the CPU do not mix, as a GPU's do not), for tests that the
    batches a program feeds follow its model there."""
    import torch
    import torch._lazy.ts_backend

    torch._lazy.ts_backend.init()
    return torch.device("lazy")
