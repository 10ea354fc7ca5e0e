"""A user's data factory as a resumable stream of batches: epochs, and the position in one.

A data factory (``--data MODULE:FACTORY``, :mod:`~towerflow.training.user_task`) is
called once per epoch. :class:`FactoryBatches` counts the batches each epoch has
given, so every checkpoint records where the replica was (``{"epoch", "batch"}``), and
a resumed run continues there as a built-in task does, in the first of these ways
the factory offers:

* its iterable has ``state_dict()`` / ``load_state_dict()`` (a
  ``torchdata.stateful_dataloader.StatefulDataLoader``, or your own class): the
  state is saved with the position (it must be JSON: numbers, strings, lists,
  dicts) and handed back to the epoch's new iterable;
* the factory names a ``skip`` keyword: it is called with the batches of the epoch
  to leave out;
* otherwise towerflow reads that many batches and drops them (said in one line:
  a large skip reads its data again).

Example:
    >>> class Task:
    ...     def call_data_factory(self, values):
    ...         return [values["epoch"] * 10 + i for i in range(3)]
    ...     data = "mine:batches"
    ...     def names_keyword(self, name):
    ...         return False
    >>> data = FactoryBatches(Task(), {"split": "train"})
    >>> stream = iter(data); next(stream), next(stream), data.state()
    (0, 1, {'epoch': 0, 'batch': 2})
    >>> data.load_state({"epoch": 1, "batch": 1}); list(data)
    [11, 12]
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from towerflow.errors import InvalidArgumentError

__all__ = ["FactoryBatches"]

log = logging.getLogger("towerflow.training")


class _Factory(Protocol):  # the task that calls the user's data factory
    data: str

    def call_data_factory(self, values: Mapping[str, Any]) -> Any: ...

    def names_keyword(self, name: str) -> bool: ...


def _json_state(batches: Any, factory: str) -> Any:
    """The iterable's ``state_dict()``, checked to be JSON (None when it has none)."""
    state_dict = getattr(batches, "state_dict", None)
    if not callable(state_dict) or not callable(getattr(batches, "load_state_dict", None)):
        return None
    state = state_dict()
    try:
        json.dumps(state)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(
            f"--data {factory} returned a {type(batches).__name__} whose state_dict() is not "
            f"JSON ({exc}); a checkpoint records it as the data's position: return plain "
            "numbers, strings, lists and dicts (or drop state_dict() and towerflow counts "
            "batches).") from None
    return state


class FactoryBatches:
    """The batches a data factory gives one replica: iterating again calls it again (an
    epoch); :meth:`state` / :meth:`load_state` are the position a checkpoint keeps."""

    def __init__(self, task: _Factory, values: Mapping[str, Any]) -> None:
        self._task, self._values = task, dict(values)
        self.split = self._values.get("split")
        self._epoch = 0  # the epoch the next iteration starts
        self._now = {"epoch": 0, "batch": 0}  # where the current one is
        self._current: Any = None
        self._resume: dict[str, Any] | None = None

    def bound(self, **values: Any) -> FactoryBatches:
        """The same split with other values (another replica or batch size), from its start."""
        return FactoryBatches(self._task, {**self._values, **values})

    def state(self) -> dict[str, Any]:
        """The position after the last batch given: ``{"epoch", "batch"[, "iterable"]}``."""
        state = dict(self._now)
        own = _json_state(self._current, self._task.data) if self._current is not None else None
        if own is not None:
            state["iterable"] = own
        return state

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Continue at ``state`` (what :meth:`state` gave) when iterated next.

        Raises:
            InvalidArgumentError: ``state`` is not such a position.
        """
        epoch, batch = (state.get(k) if isinstance(state, Mapping) else None
                        for k in ("epoch", "batch"))
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                   for v in (epoch, batch)):
            raise InvalidArgumentError(
                f"The checkpoint's data position {state!r:.200} is not a position of "
                f"--data {self._task.data} ({{'epoch': int, 'batch': int}}); it was written by "
                "another data source: resume with the data it was trained on, or train in a "
                "new --train-dir.")
        self._epoch, self._resume = int(epoch), dict(state)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        resume, self._resume = self._resume, None
        skip = int(resume["batch"]) if resume else 0
        values = {**self._values, "epoch": self._epoch}
        # the iterable's own state places it, else the factory's skip, else reading and dropping
        own_state = resume is not None and "iterable" in resume
        skipped_by_factory = bool(skip) and not own_state and self._task.names_keyword("skip")
        if skipped_by_factory:
            values["skip"] = skip
        batches = self._task.call_data_factory(values)
        own = _json_state(batches, self._task.data)  # refused before the first batch
        self._now, self._current = {"epoch": self._epoch, "batch": skip}, batches
        self._epoch += 1
        if own_state:
            if own is None:
                raise InvalidArgumentError(
                    f"The checkpoint holds the state_dict() of --data {self._task.data}'s "
                    f"iterable, and the {type(batches).__name__} it returns now has no "
                    "load_state_dict(); return the same kind of iterable as when it was "
                    "trained.")
            batches.load_state_dict(resume["iterable"])  # type: ignore[index]
        return self._counted(iter(batches), 0 if own_state or skipped_by_factory else skip)

    def _counted(self, batches: Iterator[Any], skip: int) -> Iterator[Any]:
        if skip:
            log.warning("--data %s: resuming at batch %d of epoch %d by reading and dropping "
                        "the batches before it (name a 'skip' keyword in the factory, or give "
                        "its iterable state_dict() / load_state_dict(), to start there at "
                        "once)", self._task.data, skip, self._now["epoch"])
        for batch in itertools.islice(batches, skip, None):
            self._now["batch"] += 1
            yield batch

