"""A ``towerflow launch`` a test started: its output lines waited for by pattern, its tasks
found by their ``TF_CONFIG``, and every process of it ended when the test leaves."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence

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


class Launched:
    """``command`` (a ``towerflow launch``) running with its output read on a thread.

    Use as a context manager: on leaving, a launch still running has its tasks killed
    first (each runs in its own process group), then itself.
    """

    def __init__(self, command: Sequence[str], env: Mapping[str, str]) -> None:
        self.process = subprocess.Popen(list(command), env=dict(env), stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True,
                                        start_new_session=True)
        self.seen: list[str] = []
        self._lines: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(
            target=lambda: [self._lines.put(x) for x in self.process.stdout], daemon=True)
        self._reader.start()

    def wait_for(self, *patterns: str, timeout: float = 120.0) -> None:
        """Until a line matched each of ``patterns`` (in any order), ``timeout`` s at most."""
        left, deadline = list(patterns), time.monotonic() + timeout
        while left:
            try:
                line = self._lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no line matched {left} in {timeout:g} s:\n" +
                                     "".join(self.seen[-80:])) from None
            self.seen.append(line)
            left = [p for p in left if not re.search(p, line)]

    def task(self, job: str, index: int) -> psutil.Process:
        """The process of its task ``job:index``."""
        return task_process(self.process, job, index)

    def said(self) -> str:
        """Every line read so far."""
        return "".join(self.seen)

    def __enter__(self) -> Launched:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(psutil.Error):
                for child in psutil.Process(self.process.pid).children(recursive=True):
                    child.kill()
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self._reader.join(timeout=10)
