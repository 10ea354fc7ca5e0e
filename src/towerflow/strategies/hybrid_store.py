"""The workers' store in hybrid training: where their process group meets, and the words
they tell each other outside a collective.

The chief serves a c10d ``TCPStore`` (:func:`group_endpoint`); the others find it at the
address the chief's ``Init`` gave the ps tasks (:func:`reach_store`). In it the workers
say and hear :class:`Words` where a wait may last longer than a collective may: every
worker here before the group forms, the chief's restore before the first step, a
checkpoint's pause.

A worker that dies sends no word, and the store does not notice (only the death of its
server, in the chief, reaches the others: as a broken connection). So a wait also asks,
about once a second, whether a peer's process is gone, and ends then instead of at its
timeout. Every way a wait ends without its words is an error the strategy turns into its
one sentence naming the worker lost: :class:`NotHeard` (a peer gone, the timeout passed)
or the store's own ``torch.distributed.DistError`` (its server gone); both are
``RuntimeError`` s, as a failed collective's error is.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch.distributed as dist

from towerflow.errors import FailedPreconditionError, UnavailableError
from towerflow.strategies.mirrored import first_line

__all__ = ["NotHeard", "Words", "group_endpoint", "reach_store"]

log = logging.getLogger("towerflow.ps")

#: seconds between two questions of a waiting worker: is a peer's process gone?
ASK_EVERY_S = 1.0
#: the first and the longest pause between two looks into the store while waiting
_FIRST_LOOK_S, _LAST_LOOK_S = 0.002, 0.1


class NotHeard(RuntimeError):  # noqa: N818 - an outcome of a wait, as TimeoutError is
    """A wait in the store ended without every word: a peer's process is gone, or the
    timeout passed."""


def group_endpoint(host: str, world: int, timeout_s: float, *, port: int = 0,
                   master: bool, connect_s: float | None = None) -> Any:
    """The ``TCPStore`` the workers' process group meets at: served by the chief
    (``master``, ``port`` 0: a free port) or reached by the others at ``host:port``
    (trying for ``connect_s`` seconds; then its operations wait up to ``timeout_s``)."""
    store = dist.TCPStore(host, port, world, is_master=master,
                          timeout=datetime.timedelta(seconds=connect_s or timeout_s),
                          wait_for_workers=False)
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    return store


def reach_store(rendezvous: Callable[[], str], *, rank: int, world: int, timeout_s: float,
                init_timeout_s: float) -> tuple[Any, str]:
    """(Not the chief) the chief's store and its address, read by ``rendezvous()`` (ps task
    0's status: what the chief's ``Init`` named). A chief started again (a restart of the
    job, torchrun's elastic restart) names a new one in its new ``Init``: an address that
    does not answer is read again until ``init_timeout_s``."""
    from towerflow.cluster.spec import parse_address

    deadline = time.monotonic() + init_timeout_s
    while True:
        address = rendezvous()
        if not address:
            raise FailedPreconditionError(
                "The ps tasks were initialised by a chief that trains the dense layers "
                "through the ps (dense='ps'), and this worker all-reduces them "
                "(dense='allreduce'). Start every worker with the same --dense.")
        host, port = parse_address(address)
        try:
            return group_endpoint(host, world, timeout_s, port=port, master=False,
                                  connect_s=5.0), address
        except RuntimeError as exc:  # torch.distributed.DistError: nothing answers there
            if time.monotonic() >= deadline:
                raise UnavailableError(
                    f"Worker {rank} could not reach the chief's store at {address} within "
                    f"{init_timeout_s:g} s ({first_line(exc)}); start the chief (worker 0) of "
                    "this job.") from None
            log.info("the chief's store at %s does not answer; reading its address again",
                     address)


class Words:
    """What the workers tell each other in their store, where a wait may last longer than
    a collective may (the group's timeout is the step timeout): that every worker is here
    (before the group forms), that the chief read the checkpoint and is ready to start
    (before the first collectives), that a worker's pushes are applied and the chief has
    read the ps tasks (a paused step).

    Args:
        store: the workers' store (the chief's ``TCPStore``).
        rank: this worker's rank.
        world: the number of workers.
    """

    def __init__(self, store: Any, rank: int, world: int) -> None:
        self._store = dist.PrefixStore("towerflow/hybrid/words", store)
        self.rank, self.world = rank, world

    def say(self, word: str) -> None:
        """Tell the others ``word`` (once per word: a word is a key of the store)."""
        self._store.set(f"{word}/{self.rank}", "1")

    def hear(self, word: str, ranks: Iterable[int], timeout_s: float,
             gone: Callable[[], bool] | None = None) -> None:
        """Wait until every worker of ``ranks`` said ``word``, at most ``timeout_s`` seconds;
        ``gone()``, asked every :data:`ASK_EVERY_S` seconds meanwhile, says whether a peer's
        process is gone (the wait then ends at once).

        The store is looked into, not waited on: its own wait can be left neither for the
        question nor for a signal, and it logs a warning at each timeout.

        Raises:
            NotHeard: a peer is gone, or ``timeout_s`` passed without every word.
            RuntimeError: the store failed (``torch.distributed.DistError``: its server,
                the chief, is gone).
        """
        keys = {r: f"{word}/{r}" for r in ranks if r != self.rank}
        start = time.monotonic()
        asked, look = start, _FIRST_LOOK_S
        while keys and not self._store.check(list(keys.values())):
            now = time.monotonic()
            if now - start >= timeout_s:
                silent = [r for r, key in keys.items() if not self._store.check([key])]
                raise NotHeard(f"no word from worker(s) {', '.join(map(str, silent))} within "
                               f"{timeout_s:g} s")
            if gone is not None and now - asked >= ASK_EVERY_S:
                if gone():
                    raise NotHeard("a peer worker's process is gone")
                asked = time.monotonic()
            time.sleep(min(look, max(0.0, start + timeout_s - now)))
            look = min(2 * look, _LAST_LOOK_S)

    @property
    def others(self) -> list[int]:
        return [r for r in range(self.world) if r != self.rank]
