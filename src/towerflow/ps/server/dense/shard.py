"""One ps task's dense shard: its store, its admission, and the one way a push goes in.

- :class:`ShardState` — what the shard holds: one
  :class:`~towerflow.ps.server.dense.store.DenseStore` (the flat parameter
  buffer, the optimizer and their update) and one
  :class:`~towerflow.ps.server.dense.admission.Admission` (the step, the push
  table, staging, the ledger and the waits), with the reads a ps answers from
  them (step, parameters, counters, a pull's chunks);
- :class:`DenseShard` — a :class:`ShardState` and its
  :mod:`~towerflow.ps.server.dense.aggregation` (async, sync or ssp):
  :meth:`DenseShard.push` is the one entry of every dense push, whatever
  carried its bytes (see :mod:`towerflow.ps.server.dense`).

Everything here is plain numpy and threads, so the shard logic is tested
in-process; :mod:`towerflow.ps.server.dense.service` puts it behind gRPC.

Example:
    >>> import numpy as np
    >>> from towerflow.ps.placement import plan_placement
    >>> from towerflow.ps.wire.messages import AggregationConfig, PushHeader
    >>> from towerflow.ps.server.dense.optimizers import make_optimizer
    >>> layout = plan_placement({"w": (2,)}, 1).shards[0]
    >>> state = ShardState(layout, np.zeros(2, np.float32), make_optimizer("sgd", 2))
    >>> shard = DenseShard(state, AggregationConfig(total_num_replicas=1))
    >>> header = PushHeader(0, 1, 0, 0.5, 2, segments=layout.signature)
    >>> outcome, params = shard.push(header, [np.ones(2, np.float32).tobytes()],
    ...                              want_params=True)
    >>> outcome.status, np.frombuffer(b"".join(params), np.float32).tolist()
    ('applied', [-0.5, -0.5])
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Iterator
from contextlib import AbstractContextManager

import numpy as np

from towerflow.ps.placement import ShardLayout
from towerflow.ps.server.dense.admission import Admission
from towerflow.ps.server.dense.aggregation import Aggregator, AsyncAggregator, SSPAggregator
from towerflow.ps.server.dense.optimizers import ServerOptimizer
from towerflow.ps.server.dense.records import ShardFigures, ShardStats
from towerflow.ps.server.dense.store import DenseStore
from towerflow.ps.server.dense.syncstep import SyncAggregator
from towerflow.ps.wire.calls import REFUSED
from towerflow.ps.wire.framing import CHUNK_BYTES
from towerflow.ps.wire.messages import AggregationConfig, PushHeader, PushOutcome

__all__ = ["ShardState", "DenseShard", "make_aggregator"]

_KINDS: dict[str, type[Aggregator]] = {"async": AsyncAggregator, "sync": SyncAggregator,
                                       "ssp": SSPAggregator}


def make_aggregator(store: DenseStore, admission: Admission, config: AggregationConfig,
                    describe_worker: Callable[[int], str] | None = None,
                    elastic: Container[int] = ()) -> Aggregator:
    """Return the aggregator of ``config.mode`` over ``store`` and ``admission``.

    ``describe_worker(replica)`` names a worker in error messages (default
    ``/job:worker/task:<replica>``); ``elastic``: the elastic workers admitted
    now, whose pushes an async aggregator takes too.
    """
    aggregator = _KINDS[config.mode](store, admission, config)
    aggregator.elastic = elastic
    if describe_worker is not None:
        aggregator.describe_worker = describe_worker
    return aggregator


class ShardState:
    """The store and the admission of one ps task's dense shard.

    Args:
        layout: the segments this shard holds.
        params: the initial values, ``layout.numel`` float32 elements (owned).
        optimizer: the server-side optimizer over the same number of elements.
        step: the initial step (restored from a checkpoint, else 0).
        staging_limit: bytes of pushed chunks this shard may hold at once while
            they are handled (default
            :func:`~towerflow.ps.server.dense.admission.default_staging_limit` of one replica).

    Attributes:
        store: the parameters, the optimizer and their update.
        admission: the step, push table, staging, ledger and waits.
    """

    __slots__ = ("store", "admission")

    def __init__(self, layout: ShardLayout, params: np.ndarray, optimizer: ServerOptimizer,
                 step: int = 0, *, staging_limit: int | None = None) -> None:
        self.store = DenseStore(layout, params, optimizer)
        self.admission = Admission(layout, step, staging_limit=staging_limit)

    @property
    def layout(self) -> ShardLayout:
        """The segments this shard holds."""
        return self.store.layout

    @property
    def params(self) -> np.ndarray:
        """The flat parameter buffer."""
        return self.store.params

    @property
    def optimizer(self) -> ServerOptimizer:
        """The server-side optimizer and its slot buffers."""
        return self.store.optimizer

    @property
    def step(self) -> int:
        """The shard's step (on ps task 0 the global step): updates applied."""
        return self.admission.step

    @property
    def staged(self) -> int:
        """Bytes of pushed chunks received and not yet applied or summed."""
        return self.admission.staged

    @property
    def stats(self) -> ShardStats:
        """A copy of the shard's counters, read at once."""
        return self.admission.stats

    @property
    def ledger(self) -> list[tuple[int, int, int, int]]:
        """``(worker_id, incarnation, seq, step)`` of each push in the parameters, oldest first
        (:attr:`~towerflow.ps.server.dense.admission.Admission.ledger`)."""
        return self.admission.ledger

    def figures(self) -> ShardFigures:
        """The step, counters, staging and push table, read together."""
        return self.admission.figures(self.store.optimizer.step)

    def apply(self, grad: np.ndarray, lr: float) -> int:
        """Apply the whole gradient ``grad`` with rate ``lr`` as one update; return the new step."""
        self.store.apply(grad, lr)
        return self.admission.commit_update()

    def read_chunks(self, name: str = "params", chunk_bytes: int = CHUNK_BYTES
                    ) -> Iterator[bytes]:
        """Yield a copy of buffer ``name`` in chunks, each copied under its range locks
        (:meth:`~towerflow.ps.server.dense.store.DenseStore.read_chunks`), counting the
        bytes sent (a whole buffer counts as a pull)."""
        whole = self.store.buffer(name).nbytes
        sent = 0
        try:
            for data in self.store.read_chunks(name, chunk_bytes):
                sent += len(data)
                yield data
        finally:
            self.admission.count_out(sent, sent == whole)


class DenseShard:
    """A dense shard and the aggregator of its mode: where every dense push goes.

    Args:
        state: the shard's store and admission.
        config: the aggregation mode and its options.
        describe_worker: names a worker in error messages (default
            ``/job:worker/task:<replica>``).
        elastic: the elastic workers admitted now (an async shard takes their pushes too).

    Attributes:
        state: the :class:`ShardState`.
        aggregator: the :class:`~towerflow.ps.server.dense.aggregation.Aggregator`
            over ``state.store`` and ``state.admission``.
    """

    __slots__ = ("state", "aggregator")

    def __init__(self, state: ShardState, config: AggregationConfig,
                 describe_worker: Callable[[int], str] | None = None,
                 elastic: Container[int] = ()) -> None:
        self.state = state
        self.aggregator = make_aggregator(state.store, state.admission, config,
                                          describe_worker, elastic)

    @property
    def config(self) -> AggregationConfig:
        """The aggregation mode and its options (from the chief's ``Init``)."""
        return self.aggregator.config

    @property
    def layout(self) -> ShardLayout:
        """The segments this shard holds."""
        return self.state.layout

    def push(self, header: PushHeader, chunks: Iterable[bytes | memoryview], *,
             want_params: bool = False, active: Callable[[], bool] | None = None,
             chunk_bytes: int | None = CHUNK_BYTES,
             applying: Callable[[], AbstractContextManager] | None = None
             ) -> tuple[PushOutcome, Iterable[bytes]]:
        """Handle one push; return its outcome and the parameters to send back.

        The one entry of a dense push: ``chunks`` is its payload as it was
        received (one piece from a small message, many from a stream), each a
        run of float32 values in buffer order, counted into the shard's
        ``bytes_in``. The aggregator checks, de-duplicates and applies or sums
        it chunk by chunk (:meth:`~towerflow.ps.server.dense.aggregation.Aggregator.push`).

        With ``want_params`` (and the push not refused) the parameters are
        read after it, in chunks of ``chunk_bytes`` (None: one chunk), each
        range copied under its locks when the chunk is taken; else nothing.
        ``active()`` (the call's ``is_active``) and ``applying()`` (held while the push
        changes the shard, with a replica): see the aggregator.
        """
        outcome = self.aggregator.push(header, self._counted(chunks), active, applying)
        if not want_params or outcome.status == REFUSED:
            return outcome, ()
        size = chunk_bytes or max(self.state.layout.nbytes, 1)
        return outcome, self.state.read_chunks("params", size)

    def _counted(self, chunks: Iterable[bytes | memoryview]) -> Iterator[bytes | memoryview]:
        """``chunks``, their bytes counted into ``bytes_in`` once the payload ends (or is cut
        off): one count under the admission's lock per push, none per chunk."""
        received = 0
        try:
            for chunk in chunks:
                received += len(chunk)
                yield chunk
        finally:
            self.state.admission.count_bytes_in(received)

    def worker_done(self, worker_id: int) -> None:
        """Worker ``worker_id`` has finished: the aggregator stops waiting for it."""
        self.aggregator.worker_done(worker_id)

    def close(self) -> None:
        """The shard was replaced (the chief re-initialised it): release waiting pushes."""
        self.aggregator.close()
