"""The names of the built-in training tasks, for whoever must list them without importing torch.

:data:`~towerflow.training.tasks.TASKS` maps each name to its task class; the
command line offers them in its help and errors (``towerflow train --help`` stays
fast because reading this module loads no model or data code).
"""

from __future__ import annotations

__all__ = ["TASK_NAMES"]

#: the built-in tasks (``towerflow train NAME``), in the order the help lists them
TASK_NAMES = ("cifar10", "digits", "click", "movielens", "criteo")
