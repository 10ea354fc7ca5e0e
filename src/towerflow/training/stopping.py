"""Ending a run on SIGTERM / SIGINT the way a scheduler expects.

Slurm (``scancel``, preemption), Kubernetes (pod eviction) and a terminal
(Ctrl-C) stop a job with SIGTERM or SIGINT. While :class:`StopSignals` is
installed, the first such signal only asks the loop to stop: the step in
flight finishes, the chief writes a final checkpoint at that step, and the
process exits 0, so that the next run resumes from it. The final checkpoint
is written inside :meth:`StopSignals.final_save`: a second signal, or the
deadline (``stop_deadline`` seconds after the first signal) passing, abandons
it with :class:`FinalCheckpointAbandoned`; the checkpoint format's atomic
writes then leave no partial checkpoint, only the previous one.

Example:
    >>> with StopSignals(deadline_s=30.0) as stop:     # doctest: +SKIP
    ...     while not stop.requested and step < max_steps:
    ...         step = train_one_step()
    ...     if stop.requested:
    ...         with stop.final_save():
    ...             save(step)
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

__all__ = ["FinalCheckpointAbandoned", "StopSignals", "DEFAULT_STOP_DEADLINE_S",
           "exit_on_signals", "finish_failing"]

log = logging.getLogger("towerflow.training")

#: seconds the final checkpoint may take after the first stop signal
DEFAULT_STOP_DEADLINE_S = 30.0


class FinalCheckpointAbandoned(SystemExit):  # noqa: N818 - an exit, as SystemExit is
    """The final checkpoint after a stop signal was given up (a second signal, or the deadline).

    A ``SystemExit`` with status ``128 + signal`` (as a shell reports a process
    ended by that signal): no ``except Exception`` on the way swallows it, and
    a program that does not catch it ends with that status and no traceback;
    its message was logged when it was raised. ``signum`` is the first signal.
    """

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(128 + signum)
        self.message = message
        self.signum = signum

    def __str__(self) -> str:
        return self.message


class StopSignals:
    """SIGTERM / SIGINT become a stop request while installed (in the main thread only).

    Args:
        signals: the signals that ask the run to stop.
        deadline_s: seconds after the first signal that the final checkpoint may
            take; None or 0: no deadline (a second signal still abandons it).
        on_request: called with the first signal's number when it arrives.

    Attributes:
        requested: the number of the first signal received, None before.
    """

    def __init__(self, signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT),
                 deadline_s: float | None = DEFAULT_STOP_DEADLINE_S,
                 on_request: Callable[[int], None] | None = None) -> None:
        self.signals = tuple(signals)
        self._on_request = on_request
        self.deadline_s = deadline_s or None
        self.requested: int | None = None
        self._received_at = 0.0
        self._saving = False
        self._previous: dict[int, Any] = {}

    def handle(self, signum: int, frame: object) -> None:
        """The signal handler: the first signal asks to stop; another one while saving abandons."""
        if self.requested is None:
            self.requested = signum
            self._received_at = time.monotonic()
            log.info("received signal %d; stopping after the step in flight (the chief then "
                     "writes a final checkpoint; a second signal abandons it)", signum)
            if self._on_request is not None:
                self._on_request(signum)
            return
        if self._saving:
            self._abandon(f"a second signal ({signum})")
        self._raise(f"Stopped by signal {self.requested}, then by signal {signum} before "
                    "the final checkpoint was written; the run resumes from its previous "
                    "checkpoint.")

    def _abandon(self, why: str) -> None:
        self._raise(f"The final checkpoint after signal {self.requested} was abandoned ({why}); "
                    "no partial checkpoint is left and the run resumes from its previous "
                    "checkpoint. Give it more time with --stop-deadline "
                    "(TrainConfig.stop_deadline).")

    def _raise(self, message: str) -> None:
        log.error("%s", message)
        raise FinalCheckpointAbandoned(message, self.requested or 0)

    @contextlib.contextmanager
    def final_save(self) -> Iterator[None]:
        """The block that writes the final checkpoint: abandoned by a second signal or the
        deadline (:class:`FinalCheckpointAbandoned` is raised inside it)."""
        armed = False
        if self.deadline_s is not None and self._previous:
            left = self.deadline_s - (time.monotonic() - self._received_at)
            if left <= 0:
                self._abandon(f"the {self.deadline_s:g} s deadline passed before it started")
            previous = signal.signal(signal.SIGALRM, self._alarm)
            signal.setitimer(signal.ITIMER_REAL, left)
            armed = True
        self._saving = True
        try:
            yield
        finally:
            self._saving = False
            if armed:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)

    def _alarm(self, signum: int, frame: object) -> None:
        self._abandon(f"the {self.deadline_s:g} s deadline passed")

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self.handle)
        return self

    def __exit__(self, *exc: object) -> None:
        previous, self._previous = self._previous, {}
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def exit_on_signals(signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT)) -> Iterator[None]:
    """Within the block, SIGTERM / SIGINT end the process with status 0 (``SystemExit(0)``).

    For the time around training (starting, waiting for the chief, shutting
    down): nothing is lost by stopping then, so a scheduler's signal ends the
    task cleanly instead of by the signal's default action. While training,
    :class:`StopSignals` (installed by the loop) takes precedence. Main thread only.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def leave(signum: int, frame: object) -> None:
        log.info("received signal %d outside training; exiting", signum)
        raise SystemExit(0)

    previous = {sig: signal.signal(sig, leave) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def finish_failing(signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT)) -> Iterator[None]:
    """Within the block (the shutdown of a run that failed), a first SIGTERM / SIGINT is
    logged and the block goes on: the failure then ends the process with its own message and
    status, where :func:`exit_on_signals` would end it with status 0 and no word (a launcher
    stopping the rest of a failed group sends one). A second signal ends it at once, with
    status ``128 + signal``. Main thread only.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def hold(signum: int, frame: object) -> None:
        if received:
            raise SystemExit(128 + signum)
        received.append(signum)
        log.info("received signal %d while stopping on an error; finishing the shutdown "
                 "(a second signal ends it now)", signum)

    previous = {sig: signal.signal(sig, hold) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
