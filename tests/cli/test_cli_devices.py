"""``towerflow devices``: the table and the JSON list."""

from __future__ import annotations

import json
import subprocess

import psutil
import pytest
import torch

from towerflow.cli import main


def test_json_lists_every_device_with_tensorflow_field_names(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["devices", "--json"]) == 0
    devices = json.loads(capsys.readouterr().out)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert len(devices) == 1 + gpus
    assert devices[0] == {
        "name": "/device:CPU:0",
        "device_type": "CPU",
        "memory_limit": psutil.virtual_memory().total,
        "locality": {},
        "incarnation": devices[0]["incarnation"],
        "physical_device_desc": "",
    }
    assert devices[0]["incarnation"] > 0
    for index, gpu in enumerate(devices[1:]):
        assert gpu["name"] == f"/device:GPU:{index}"
        assert gpu["physical_device_desc"].startswith(f"device: {index}, name: ")


def test_table_shows_the_columns_and_the_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["devices"]) == 0
    out = capsys.readouterr().out
    for column in ("name", "device_type", "memory_limit", "physical_device_desc"):
        assert column in out
    assert "/device:CPU:0" in out and "GiB" in out


def test_bad_option_is_reported_as_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["devices", "--gpu-memory-fraction", "2"]) == 2
    assert "towerflow devices: error: gpu_memory_fraction=2.0 is not valid" in (
        capsys.readouterr().err)


def test_module_entry_point_runs_in_a_fresh_process(
    python: str, subprocess_env: dict[str, str]
) -> None:
    done = subprocess.run(
        [python, "-m", "towerflow", "devices", "--json"],
        capture_output=True, text=True, env=subprocess_env, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)[0]["name"] == "/device:CPU:0"
