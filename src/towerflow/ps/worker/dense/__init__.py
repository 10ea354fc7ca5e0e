"""A worker's side of the dense parameters.

- :mod:`~towerflow.ps.worker.dense.client` — :class:`PSClient` and its
  per-shard :class:`ShardClient`: pull, push, push-and-pull, prefetch;
- :mod:`~towerflow.ps.worker.dense.variables` — the flat buffers a model's
  parameters and gradients are views of, whole variables for checkpoints,
  and joining a running job as an elastic worker.
"""
