"""A worker's side of the dense parameters.

- :mod:`~towerflow.ps.worker.dense.client` — :class:`PSClient`: pull, push,
  push-and-pull and prefetch to every ps task, in parallel;
- :mod:`~towerflow.ps.worker.dense.shard_client` — :class:`ShardClient`: the
  calls to one ps task;
- :mod:`~towerflow.ps.worker.dense.variables` — the flat buffers a model's
  parameters and gradients are views of, whole variables for checkpoints,
  and joining a running job as an elastic worker.
"""
