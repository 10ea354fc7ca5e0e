"""Training: the loop, its hooks, schedules, moving averages, summaries and checkpoints.

``Trainer`` gives any model article 001's machinery; ``run_training`` runs a
built-in task (``towerflow train``). Names are imported on first use (PEP 562);
``Supervisor`` (the managed session of the parameter-server cluster) lives in
:mod:`towerflow.training.supervisor`.

Example:
    >>> from towerflow.training import TrainConfig
    >>> TrainConfig(max_steps=10).log_every
    10
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> module (in towerflow.training) defining it
_LAZY: dict[str, str] = {
    "Trainer": "loop",
    "TrainResult": "loop",
    "default_strategy": "loop",
    "run_training": "run",
    "TrainConfig": "config",
    "ExponentialDecay": "schedules",
    "ExponentialMovingAverage": "ema",
    "SummaryWriter": "summaries",
    "Hook": "hooks",
    "StepContext": "hooks",
    "NanLossDuringTrainingError": "hooks",
    "DataOptions": "tasks",
    "get_task": "tasks",
    "evaluate": "evaluate",
    "evaluate_checkpoint": "evaluate",
    "spawn_replicas": "spawn",
    "Supervisor": "supervisor",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'towerflow.training' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"towerflow.training.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
