"""The tasks of a ``towerflow launch`` a test started: find one by its ``TF_CONFIG``."""

from __future__ import annotations

import contextlib
import json
import subprocess

import psutil


def task_process(launcher: subprocess.Popen, job: str, index: int) -> psutil.Process:
    """The process of task ``job:index`` among the launch's children (by its TF_CONFIG)."""
    for proc in psutil.Process(launcher.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            task = json.loads(proc.environ().get("TF_CONFIG", "{}")).get("task", {})
            if task == {"type": job, "index": index} and "towerflow" in " ".join(
                    proc.cmdline()):
                return proc
    raise AssertionError(f"{job} {index} is not running")
