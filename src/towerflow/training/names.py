"""The names of the built-in training tasks and losses, for whoever must list them without torch.

:data:`~towerflow.training.tasks.TASKS` maps each task name to its class and
:data:`~towerflow.training.user_task.LOSSES` each loss name to its criterion; the
command line offers them in its help and errors (``towerflow train --help`` stays
fast because reading this module loads no model or data code).
"""

from __future__ import annotations

__all__ = ["TASK_NAMES", "LOSS_NAMES", "LOSS_KINDS"]

#: the built-in tasks (``towerflow train NAME``), in the order the help lists them
TASK_NAMES = ("cifar10", "digits", "click", "movielens", "criteo")
#: the criteria a user's model may train with (``--loss``; :data:`~towerflow.training.user_task.LOSSES`)
LOSS_NAMES = ("mse", "cross_entropy", "bce_with_logits")
#: what each loss says a model's outputs are (:mod:`~towerflow.training.user_metrics`)
LOSS_KINDS = {"mse": None, "cross_entropy": "classes", "bce_with_logits": "logits"}
