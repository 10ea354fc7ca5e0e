"""The hybrid workers' store (``hybrid_store``): a wait in it ends when a peer's process is
gone, when its timeout passes or when the store's server is gone, each with an error the
strategy turns into its sentence; a real ``TCPStore`` on 127.0.0.1."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from towerflow.strategies import hybrid_store
from towerflow.strategies.hybrid_store import NotHeard, Words, group_endpoint

SERVE = """
import sys
from towerflow.strategies.hybrid_store import group_endpoint
store = group_endpoint("127.0.0.1", 2, 30.0, master=True)
print(store.port, flush=True)
sys.stdin.read()  # serves until told to go: then dies with its store
"""


@pytest.fixture
def store():
    return group_endpoint("127.0.0.1", 2, 30.0, master=True)


def test_a_wait_returns_once_every_worker_said_the_word(store) -> None:
    chief, other = Words(store, 0, 2), Words(store, 1, 2)
    other.say("ready/3")
    chief.hear("ready/3", chief.others, timeout_s=5.0, gone=lambda: True)  # heard: not asked
    chief.hear("start/1", [0], timeout_s=0.0)  # a word of its own only: nothing to wait for


def test_a_wait_ends_once_a_peers_process_is_gone_not_at_its_timeout(store, monkeypatch) -> None:
    monkeypatch.setattr(hybrid_store, "ASK_EVERY_S", 0.0)
    asked = []

    def gone() -> bool:
        asked.append(1)
        return len(asked) == 3  # the third question finds the peer gone

    start = time.monotonic()
    with pytest.raises(NotHeard, match=r"^a peer worker's process is gone$"):
        Words(store, 0, 2).hear("ready/3", [1], timeout_s=600.0, gone=gone)
    assert len(asked) == 3 and time.monotonic() - start < 60


def test_a_wait_that_times_out_names_the_silent_workers(store) -> None:
    Words(store, 2, 4).say("go/7")
    with pytest.raises(NotHeard, match=r"^no word from worker\(s\) 1, 3 within 0\.2 s$"):
        Words(store, 0, 4).hear("go/7", range(4), timeout_s=0.2)


def test_a_wait_in_a_store_whose_server_died_ends_with_the_stores_error() -> None:
    server = subprocess.Popen([sys.executable, "-c", SERVE], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        words = Words(group_endpoint("127.0.0.1", 2, 30.0, port=port, master=False), 1, 2)
        server.kill()
        server.wait(timeout=30)
        with pytest.raises(RuntimeError) as failed:  # torch.distributed.DistNetworkError
            words.hear("go/5", [0], timeout_s=600.0)
        assert not isinstance(failed.value, NotHeard)
    finally:
        server.kill()
        server.wait(timeout=30)
