"""examples/device_placement.py runs and shows every path of the articles' snippets."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "device_placement.py"
CPU = "/job:localhost/replica:0/task:0/device:CPU:0"


@pytest.mark.slow
def test_example_reproduces_the_snippets(python: str, subprocess_env: dict[str, str]) -> None:
    done = subprocess.run(
        [python, str(EXAMPLE)], capture_output=True, text=True, env=subprocess_env,
        timeout=240, check=False,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert 'name: "/device:CPU:0"\ndevice_type: "CPU"\nmemory_limit: ' in out
    assert "[[22.0, 28.0], [49.0, 64.0]]" in out                 # matmul
    assert "sum = [[44.0, 56.0], [98.0, 128.0]]" in out          # two towers summed
    assert f"stack: (aten::stack): {CPU}\nsum: (aten::sum): {CPU}" in out
    assert "[2.0, 4.0, 6.0]" in out                              # add_n
    assert "predictions match training device: True" in out
    assert "predictions match training device: False" not in out
    if torch.cuda.device_count() < 3:
        assert "Device mapping:" in out
        assert (
            "PlacementError: Cannot assign a device for operation 'tensor': Could not satisfy "
            "explicit device specification '/device:GPU:2' because no devices matching that "
            "specification are registered in this process" in out
        )
        assert (f"matmul: (aten::mm): {CPU} (soft placement: no device matches "
                "'/device:GPU:2')") in out
    if not torch.cuda.is_available():
        assert "Device mapping: no known devices." in out
        assert "allow_soft_placement=False: PlacementError: Cannot assign a device for " \
               "operation 'stack': Could not satisfy explicit device specification " \
               "'/device:GPU:0'" in out
        assert "a_cpu on cpu, a_gpu on cpu" in out
