"""The last steps of an asynchronous run, kept for the workers' next pushes (ps task 0).

An asynchronous worker stops when the global step reaches the run's last
step, but it learns the step only from the reply to its own push: two workers
that both saw step 299 of 300 would both push, and the run would end at 301
(as TensorFlow 1's ``StopAtStepHook`` does). Here no push is sent that has no
step kept for it: ps task 0 (which counts the global step) keeps a step of
the run's end for a worker's *next* push in the reply to its current one
(``PushReply.next_reserved``), or when the worker asks (``Reserve``, before
its first push), while ``step + steps kept < last_step``. A worker refused
one asks again until the other workers have pushed the steps left (then it
stops) or one is free again. Every push that is
sent is applied on every ps task as before; none is refused for this, so the
ps tasks agree on every update, and the run ends at its last step exactly.

The check is conservative: a push already counted in the step whose reply
has not been written yet still holds its kept step for that moment, which can
stop a worker one push early; the worker whose reply comes last sees no such
overlap, so the run still reaches its last step. A kept step is released by
the worker's next push (or retry), its ``Done``, a new incarnation of the
worker (a restarted worker), and the ps task's heartbeats declaring the worker
dead (``alive``): the workers left then push the step it held.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["StepReservations"]


class StepReservations:
    """The steps of the run's end kept for workers' next pushes.

    Args:
        step: reads ps task 0's step (the updates applied so far).
        alive: ``alive(worker_id)``: False once the ps task's heartbeats declared the
            worker dead (its kept step is then free); None: every worker counts as alive.
    """

    def __init__(self, step: Callable[[], int],
                 alive: Callable[[int], bool] | None = None) -> None:
        self._step = step
        self.alive = alive
        self._lock = threading.Lock()
        #: worker id -> the incarnation a step is kept for
        self._held: dict[int, int] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def after_push(self, worker_id: int, incarnation: int, last_step: int) -> bool:
        """A push of ``worker_id`` was answered (its step, if it held one, is used): keep
        one for its next push when there is room; whether one is kept."""
        with self._lock:
            self._held.pop(worker_id, None)
            return self._grant(worker_id, incarnation, last_step)

    def reserve(self, worker_id: int, incarnation: int, last_step: int) -> bool:
        """Keep a step for ``worker_id``'s next push (its first, or after a restart); whether
        one is kept (True at once when this incarnation holds one already)."""
        with self._lock:
            if self._held.get(worker_id) == incarnation:
                return True
            self._held.pop(worker_id, None)  # an earlier incarnation's is void
            return self._grant(worker_id, incarnation, last_step)

    def release(self, worker_id: int) -> None:
        """``worker_id`` will push no more (its ``Done``): the step it holds is free."""
        with self._lock:
            self._held.pop(worker_id, None)

    def _grant(self, worker_id: int, incarnation: int, last_step: int) -> bool:
        if last_step <= 0:
            return False
        step = self._step()
        if step + len(self._held) >= last_step and self.alive is not None:
            for dead in [w for w in self._held if w != worker_id and not self.alive(w)]:
                del self._held[dead]  # a dead worker pushes no more: its step is free
        if step + len(self._held) >= last_step:
            return False
        self._held[worker_id] = incarnation
        return True
