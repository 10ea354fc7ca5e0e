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

from towerflow._lazy import lazy_dir, lazy_getattr

# public name -> module defining it
_LAZY: dict[str, str] = {
    "Trainer": "towerflow.training.loop",
    "TrainResult": "towerflow.training.loop",
    "default_strategy": "towerflow.training.loop",
    "run_training": "towerflow.training.run",
    "TrainConfig": "towerflow.training.config",
    "ExponentialDecay": "towerflow.training.schedules",
    "ExponentialMovingAverage": "towerflow.training.ema",
    "SummaryWriter": "towerflow.training.summaries",
    "Hook": "towerflow.training.hooks",
    "StepContext": "towerflow.training.hooks",
    "ExportHook": "towerflow.training.export_hook",
    "NanLossDuringTrainingError": "towerflow.training.hooks",
    "DataOptions": "towerflow.training.tasks",
    "get_task": "towerflow.training.tasks",
    "evaluate": "towerflow.training.evaluate",
    "evaluate_checkpoint": "towerflow.training.evaluate",
    "spawn_replicas": "towerflow.cluster.launcher",
    "Supervisor": "towerflow.training.supervisor",
}

__all__ = sorted(_LAZY)


__getattr__ = lazy_getattr(__name__, _LAZY, globals())

__dir__ = lazy_dir(globals(), __all__)
