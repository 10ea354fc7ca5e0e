"""What runs inside a worker (and the chief): the clients of the ps tasks and their modules.

- :mod:`~towerflow.ps.worker.dense` — the dense path: :class:`PSClient` (pull,
  push, push-and-pull to every ps shard) and the flat buffers a model's
  parameters are views of;
- :mod:`~towerflow.ps.worker.tables` — the sparse tables: :class:`TableClient`,
  its row stream, the embedding modules (:class:`ShardedEmbedding`) and the
  tables' checkpoints;
- :mod:`~towerflow.ps.worker.observe` — a live view of the cluster's ps tasks
  (``towerflow status``, the chief's cluster summaries).

Nothing here imports a module of a ps task (:mod:`towerflow.ps.server`): both
halves speak the wire contract at the root of :mod:`towerflow.ps`. Importing
this package loads none of its modules.
"""
