"""A RowBatch's row copies travel while its dense step runs (``CopySender``): the two round
trips to the replica's task overlap, and the batch is answered only once both are done."""

from __future__ import annotations

import threading

import pytest

from towerflow.errors import UnavailableError
from towerflow.ps.server.tables.sending import CopySender


class _Replica:
    def __init__(self, started: threading.Event, release: threading.Event | None = None,
                 error: Exception | None = None) -> None:
        self.started, self.release, self.error = started, release, error
        self.done = False

    def forward(self) -> None:
        self.started.set()
        if self.release is not None:
            assert self.release.wait(10), "the dense step never ran beside the copy"
        if self.error is not None:
            raise self.error
        self.done = True


class _Shard:
    def __init__(self, replica: _Replica | None) -> None:
        self.replica = replica


def test_the_copy_runs_while_the_step_runs_and_is_done_before_the_answer():
    started, release = threading.Event(), threading.Event()
    replica = _Replica(started, release)
    sender = CopySender()
    try:
        def step() -> str:
            assert started.wait(10), "the copy did not start beside the step"
            release.set()  # the copy waits for the step: they run side by side
            return "dense reply"

        assert sender.beside([_Shard(replica), _Shard(None)], step) == "dense reply"
        assert replica.done
    finally:
        sender.close()


def test_a_failed_copy_fails_the_batch_after_its_step_and_no_copy_means_no_thread():
    sender = CopySender()
    try:
        ran = []
        with pytest.raises(UnavailableError, match="replica gone"):
            sender.beside([_Shard(_Replica(threading.Event(), error=UnavailableError(
                "replica gone")))], lambda: ran.append("step"))
        assert ran == ["step"]
        sender.close()
        assert sender.beside([_Shard(None)], lambda: 7) == 7  # nothing to copy: no pool
        assert sender._pool is None
    finally:
        sender.close()
