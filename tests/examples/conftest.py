"""Fixtures of the example programs' tests: a child process whose model computes on
PyTorch's ``lazy`` device while its batches come from the CPU."""

from __future__ import annotations

import os

import pytest

#: the folder whose sitecustomize makes PyTorch's ``lazy`` device ready in a child process
SECOND_DEVICE_SITE = os.path.join(os.path.dirname(__file__), os.pardir, "support", "second_device")


@pytest.fixture
def second_device_env(subprocess_env: dict[str, str]) -> dict[str, str]:
    """``subprocess_env`` for a program whose model computes on the ``lazy`` device
    (``TOWERFLOW_DEVICE=lazy``) while its batches come from the CPU."""
    path = subprocess_env.get("PYTHONPATH")
    return dict(subprocess_env, TOWERFLOW_DEVICE="lazy",
                PYTHONPATH=SECOND_DEVICE_SITE + (os.pathsep + path if path else ""))
