"""``ExportHook``: exports for serving while training runs — a full one, then deltas.

Every ``every_secs`` seconds of wall time (checked after each step) the chief writes an
export of the trainer's state into ``out_dir`` (:mod:`towerflow.serving`): a full export
``full-<step>``, then deltas ``delta-<step>`` each on top of the export before it, a full
one again after ``full_every`` exports, and one last export when training ends. Each
directory appears whole or not at all (written under a temporary name, fsynced, renamed),
so a server that polls ``out_dir`` never reads a partial one. After each export the
newest ``keep`` exports and the exports their chains need are kept; older ones are
removed. A server loads the newest state with ``towerflow.serving.load(out_dir, model)``.

On a parameter server the tables stream from the ps shards as for a checkpoint; the
rows of a delta are those that differ from the chain before it (see docs/serving.md for
what one export sees in async and sync training).

Example::

    trainer = towerflow.Trainer(model, loss_fn, data, strategy=ps,
                                hooks=[ExportHook("exports/", every_secs=300)])
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from towerflow.checkpoint.atomic import remove_stale_temps, remove_tree
from towerflow.errors import AlreadyExistsError, InvalidArgumentError
from towerflow.serving import export_name, export_source, source_from_state
from towerflow.serving.chain import export_chain_names
from towerflow.training.hooks import Hook, StepContext, TrainerView

__all__ = ["ExportHook"]

log = logging.getLogger("towerflow.training")


class ExportHook(Hook):
    """Write serving exports every ``every_secs`` seconds: full, then deltas (chief only).

    Args:
        out_dir: where the exports go (created).
        every_secs: seconds of wall time between two exports (> 0).
        full_every: every how many exports one is full (1: all are full).
        keep: the newest exports kept (with the exports their chains need).
        clock: the time source (seconds).
    """

    def __init__(self, out_dir: str | Path, every_secs: float = 600.0, *, full_every: int = 10,
                 keep: int = 5, clock: Callable[[], float] = time.monotonic) -> None:
        for what, value, low in (("every_secs", every_secs, 0), ("full_every", full_every, 1),
                                 ("keep", keep, 1)):
            if isinstance(value, bool) or not isinstance(value, int | float) or value < low or (
                    what == "every_secs" and value <= 0):
                raise InvalidArgumentError(f"ExportHook: {what}={value!r}; give a number "
                                           f"{'> 0' if what == 'every_secs' else '>= 1'}.")
        self.out_dir, self.every_secs = Path(out_dir), float(every_secs)
        self.full_every, self.keep, self._clock = int(full_every), int(keep), clock
        self._trainer: TrainerView | None = None
        self._last_time = 0.0
        self._last: tuple[Path, int] | None = None  # the newest export this hook wrote
        self._count = 0  # exports since the last full one
        self.written: list[Path] = []

    def begin(self, trainer: TrainerView) -> None:
        self._trainer = trainer if trainer.strategy.is_chief else None
        self._last_time = self._clock()
        if self._trainer is not None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            remove_stale_temps(self.out_dir)

    def after_step(self, ctx: StepContext) -> None:
        if self._trainer is not None and self._clock() - self._last_time >= self.every_secs:
            self.export_now()

    def end(self, ctx: StepContext | None, error: BaseException | None) -> None:
        if self._trainer is not None and error is None:
            self.export_now()

    def export_now(self) -> Path | None:
        """Write the next export now (None: the step has not moved since the last one)."""
        trainer = self._trainer
        if trainer is None:
            return None
        self._last_time = self._clock()
        groups, metadata = trainer.checkpoint_state()
        source = source_from_state(groups, metadata)
        if self._last is not None and source.step <= self._last[1]:
            return None
        full = self._last is None or self._count >= self.full_every - 1
        target = self.out_dir / export_name("full" if full else "delta", source.step)
        try:
            path = export_source(source, target,
                                 since=None if full else self._last[0])  # type: ignore[index]
        except AlreadyExistsError:
            log.warning("export %s exists already (an earlier run's); no export at step %d",
                        target, source.step)
            return None
        self._count = 0 if full else self._count + 1
        self._last = (path, source.step)
        self.written.append(path)
        log.info("exported step %d for serving: %s", source.step, path)
        self._retain()
        return path

    def _retain(self) -> None:
        """Remove the exports that neither the newest ``keep`` nor their chains need."""
        names = export_chain_names(self.out_dir)  # name -> its chain's names, oldest first
        newest = sorted(names, key=lambda n: (int(n.split("-")[1]), n.startswith("full")))
        needed = {name for kept in newest[-self.keep:] for name in names[kept]}
        for name in newest:
            if name not in needed:
                remove_tree(self.out_dir / name)
                log.info("removed old export %s", self.out_dir / name)

    @property
    def last(self) -> Path | None:
        """The newest export this hook wrote."""
        return None if self._last is None else self._last[0]

