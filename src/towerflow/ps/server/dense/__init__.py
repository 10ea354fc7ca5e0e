"""A ps task's dense shard: flat parameter buffer, optimizers, aggregation, the ``PS`` service.

- :mod:`~towerflow.ps.server.dense.store` — :class:`DenseStore`: the flat
  parameter buffer and its range locks, the optimizer and its slots, their
  update and its finite checks, the chunked reads (nothing about who pushed);
- :mod:`~towerflow.ps.server.dense.admission` — :class:`Admission`: who may
  push, exactly once, and when: the step, the push table, staging memory,
  the ledger, the counters and the waits;
- :mod:`~towerflow.ps.server.dense.aggregation` — async / sync / ssp: an
  :class:`Aggregator` composes one store and one admission (the sync one in
  :mod:`~towerflow.ps.server.dense.syncstep`);
- :mod:`~towerflow.ps.server.dense.replication` and
  :mod:`~towerflow.ps.server.dense.copies` — a shard's live copy on the next
  ps task (``replicas=1``), the primary's side and the replica's;
- :mod:`~towerflow.ps.server.dense.shard` — :class:`ShardState` (one store and
  one admission) and :class:`DenseShard` (a state and its aggregator, with
  :meth:`DenseShard.push`, the one entry of a dense push);
- :mod:`~towerflow.ps.server.dense.checks` — whether a push matches the shard;
- :mod:`~towerflow.ps.server.dense.records` — what a shard counts and reports;
- :mod:`~towerflow.ps.server.dense.optimizers` — the server-side optimizers;
- :mod:`~towerflow.ps.server.dense.initspec` — checking the chief's ``Init``;
- :mod:`~towerflow.ps.server.dense.service` — :class:`PSService` behind gRPC.

The path of one dense push, whatever carried its bytes:

1. a carrier decodes its framing (``service.py``): ``PSService.push`` and
   ``PSService.push_pull`` (the chunked ``Push`` / ``PushPull`` streams: the
   header is the first message, ``_payload`` the rest);
   ``PSService.push_pull_small`` (``PushPullSmall``: header and payload packed
   in one message; ``PushPullSmallStream`` calls it per request); a
   ``RowBatch`` of the task's table service
   (``tables/service.py``: ``TableService.row_batch`` -> ``_dense_step``)
   carries a ``PushPullSmall`` request and hands it to
   ``PSService.push_pull_small`` through ``TableService.dense`` (a
   ``DenseNeighbour``, set by ``TableService.serve_beside``, which
   ``host.py``'s ``ShardHost.start`` calls);
2. ``PSService.dense_push`` (``service.py``): the one route on the task: the
   shard's push, then the job's records of the worker and the reply;
3. ``DenseShard.push`` (``shard.py``): counts the payload's bytes and hands
   the push to its aggregator; with ``want_params`` reads the parameters
   back after it (``ShardState.read_chunks`` -> ``DenseStore.read_chunks``);
4. ``Aggregator.push`` (``aggregation.py``): ``_begin`` checks the sender
   and registers the push with ``Admission.begin_push`` (``admission.py``: the
   push table; a retry gets its answer; the header is checked by
   ``checks.check_header``); ``_accept`` takes the payload chunk by chunk
   (:func:`~towerflow.ps.wire.framing.receive_into`):

   - async / ssp: each chunk under ``Admission.holding``, checked by
     ``DenseStore.scan`` and ``DenseStore.check_update``, applied by
     ``DenseStore.apply_range`` (``store.py``); then ``Admission.commit_update``;
   - sync (``syncstep.py``): admitted to the step under ``Admission.locked``
     (waiting with ``Admission.wait_once``), each chunk checked by
     ``DenseStore.find_nonfinite`` and summed by ``DenseStore.add_range``; the
     last replica's push averages and applies the step
     (``DenseStore.check_update``, ``DenseStore.apply``,
     ``Admission.commit_update``) and answers its pushes
     (``Admission.finish_push``); each push waits with ``Admission.wait_outcome``;

   then ``Admission.finish_push`` answers the push (push table, ledger,
   counters), and ssp waits for the staleness bound (``Admission.wait_once``);
5. with a replica, ``ReplicaLink.forward`` (``replication.py``) returns once
   the copy holds the shard after the push (in sync mode, after its step)
   before the worker is answered.
"""
