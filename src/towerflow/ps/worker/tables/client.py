"""A worker's client of the sparse table service ``towerflow.ps.Tables``.

:class:`~towerflow.ps.spec.tables.TableConfig` says what a table is
(name, partitioner, dim, dtype, row-wise optimizer, initializer);
:class:`TableClient` makes the calls of
``tables.proto`` to every ps task: ``InitTable`` (chief); pulls, pushes and
push-and-pulls of every table of a step in one ``RowBatch`` request per ps task,
the ps tasks in parallel, on one long-lived ``RowBatchStream`` per ps task
(:mod:`towerflow.ps.worker.tables.stream`;
a pushed ``(worker_id, incarnation, seq)`` makes a retried push apply once);
``ExportRows`` / ``ImportRows`` (checkpoints, streamed in chunks) and
``TableStatus``. Ids and rows travel as raw little-endian buffers.

It imports the generated messages, the partitioners and the cluster
transport only, never a server module.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from towerflow.cluster.transport import Credentials, make_channel, stream_unary, unary, unary_stream
from towerflow.errors import (
    DataLossError,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    UnavailableError,
)
from towerflow.ps.partition import check_ids
from towerflow.ps.spec.tables import DTYPE_NAMES, TableConfig
from towerflow.ps.wire import tables_pb2 as tpb
from towerflow.ps.wire.framing import split_parts, unpack
from towerflow.ps.wire.messages import parse_message, push_records
from towerflow.ps.wire.tables import table_spec
from towerflow.ps.wire.tensors import decode, encode
from towerflow.ps.worker.tables.batch import Call, Item, Push, group_calls
from towerflow.ps.worker.tables.fusion import TableView
from towerflow.ps.worker.tables.routing import TableRouting, send_calls
from towerflow.ps.worker.tables.stream import RowStream

__all__ = ["TableClient"]

logger = logging.getLogger("towerflow.ps")

_SERVICE = tpb.DESCRIPTOR.services_by_name["Tables"].full_name


def _method(name: str) -> str:
    return f"/{_SERVICE}/{name}"


def _aggregation_json(config: Any) -> str:
    """The JSON of an ``AggregationConfig`` for ``InitTableRequest.aggregation``.

    Async sends none (``""``): each push applies on arrival, from any worker id; unless the
    job asks ``replicas`` (a live copy of each table shard on the next ps task).
    """
    replicas = getattr(config, "replicas", 0)
    if config is None or (config.mode == "async" and not replicas):
        return ""
    fields = {"mode": config.mode, "total_num_replicas": config.total_num_replicas,
              "replicas_to_aggregate": config.replicas_to_aggregate,
              "staleness": config.staleness, "timeout": config.timeout}
    return json.dumps({**fields, "replicas": replicas} if replicas else fields, sort_keys=True)


class TableClient:
    """A worker's calls to the ``towerflow.ps.Tables`` service of every ps task.

    Whatever the number of tables, a step costs one request per ps task:
    :meth:`pull_many` sends the pulls of every table (each with its deferred
    push) and :meth:`push_many` the pushes of every table as one
    ``RowBatchRequest`` per ps task (cut in several only past
    ``max_call_bytes``). Requests to different ps tasks are in flight
    together; the requests to one travel in order on its row stream
    (:class:`~towerflow.ps.worker.tables.stream.RowStream`), so its pushes arrive in
    ``seq`` order. A request whose stream fails ``UNAVAILABLE`` /
    ``DEADLINE_EXCEEDED`` / ``DATA_LOSS`` is sent again as a unary
    ``RowBatch`` call (the same bytes: a push's ``seq`` makes it apply at
    most once; a pull reads again), as is a request of a thread that finds
    another thread using the shard's stream.

    A push may be deferred (``push(..., defer=True)``): its requests are kept
    and travel with the table's next pull of each shard in the same round
    trip (the ps applies the push, then reads the rows,
    so that pull sees it), or are sent by :meth:`flush`, which
    :meth:`export_shard`, :meth:`import_rows`, :meth:`status` and
    :meth:`close` call first. Until then the other workers do not see it.

    Args:
        addresses: the ps tasks' addresses; task ``i`` holds shard ``i``.
        credentials: the cluster credentials (default: from the environment).
        worker_id: this replica's index (the push table's key).
        incarnation: distinguishes a restarted worker (default: now in ns).
        timeout: deadline of each call, seconds.
        max_call_bytes: largest rows payload of one call; bigger pulls and
            pushes to a shard are cut into several calls.
        retries: how often a call that failed UNAVAILABLE / DEADLINE_EXCEEDED
            is sent again.
        aggregation: the job's ``AggregationConfig`` (sent with ``InitTable``;
            None: async). In sync and ssp modes a push may wait on the ps for
            the other workers: each push goes to every shard (empty where the
            batch touched no row), a request's deadline is ``timeout`` plus the
            mode's ``timeout``, and with none (wait for ever) a push whose
            deadline passes is sent again, without end. A shard's push of
            one step is then one request whatever its size (the ps counts a
            replica once per step), within the channel's message limit.

    Attributes:
        wire: per kind of request (``PullRows``: pulls only, ``PushRows``:
            pushes only, ``PushPullRows``: both), ``[requests, request bytes,
            reply bytes]`` so far; a request is one ``RowBatchRequest`` to one
            ps task, whatever the tables it carries.
    """

    def __init__(self, addresses: Sequence[str], *, credentials: Credentials | None = None,
                 worker_id: int = 0, incarnation: int | None = None, timeout: float = 30.0,
                 max_call_bytes: int = 8 << 20, retries: int = 3,
                 aggregation: Any = None) -> None:
        if not addresses:
            raise InvalidArgumentError("A table client needs the ps tasks' addresses.")
        credentials = Credentials.from_env() if credentials is None else credentials
        self._channels = [make_channel(a, credentials) for a in addresses]
        self._routing = TableRouting(self._channels, getattr(aggregation, "replicas", 0))
        self._pool = ThreadPoolExecutor(len(addresses), thread_name_prefix="towerflow-tables")
        self.worker_id = worker_id
        self.incarnation = time.time_ns() & ((1 << 63) - 1) if incarnation is None \
            else incarnation
        self.aggregation = aggregation
        waits = aggregation is not None and aggregation.mode in ("sync", "ssp")
        #: sync / ssp: every step pushes to every shard (an empty push where no row is touched)
        self.every_shard = waits
        self._wait_forever = waits and aggregation.timeout is None
        # a push may wait for the other workers: its deadline covers the ps's own limit
        self.timeout = timeout + (aggregation.timeout or 0.0) if waits else timeout
        self.max_call_bytes = max_call_bytes
        self.retries = retries
        self._streams: list[RowStream | None] = [None] * len(addresses)
        self._stream_locks = [threading.Lock() for _ in addresses]
        self._seq = itertools.count(1)
        self._seq_lock = threading.Lock()
        self._deferred: dict[tuple[str, int], Push] = {}  # (table, shard) -> its push
        self._deferred_lock = threading.Lock()
        self.wire: dict[str, list[int]] = {}
        self._wire_lock = threading.Lock()
        self._views: dict[str, TableView] = {}
        self.pin_memory = False  # rows pulled into pinned memory (a GPU worker's)

    def fuse(self, views: Mapping[str, TableView]) -> None:
        """Serve the tables named in ``views`` from the fused tables they point to
        (:mod:`towerflow.ps.worker.tables.fusion`); every call below translates."""
        self._views.update(views)

    def _on_ps(self, config: TableConfig) -> tuple[TableConfig, int]:
        """The table on the ps that holds ``config``'s rows, and the first of them."""
        view = self._views.get(config.name)
        return (config, 0) if view is None else (view.table, view.offset)

    @property
    def num_shards(self) -> int:
        """Number of ps tasks (shards of every table)."""
        return len(self._channels)

    def share_routes(self, routes: Sequence[Any]) -> None:
        """Route the table calls by the dense client's shard routes (``replicas=1``)."""
        self._routing.adopt(routes)

    def _call(self, shard: int, method: str, message: Any, reply: type) -> Any:
        while True:  # with replicas: on the shard's other task once it serves the shard
            before = self._routing.where(shard)
            try:
                return reply.FromString(unary(self._routing.channel(shard), _method(method),
                                              message.SerializeToString(), timeout=self.timeout))
            except (UnavailableError, DeadlineExceededError, FailedPreconditionError) as exc:
                if not self._routing.switch(shard, before, exc):
                    raise

    def _each(self, jobs: list[tuple[int, Any]], fn: Any) -> list[Any]:
        """``fn(shard, job)`` for every job, the shards in parallel, in order."""
        if len(jobs) == 1:
            return [fn(*jobs[0])]
        futures = [self._pool.submit(fn, shard, job) for shard, job in jobs]
        return [f.result() for f in futures]

    def _run(self, queues: list[list[Call]]) -> list[list[bytes]]:
        """Send each queue's calls in order, the queues (one per shard) side by side.

        Every queue's requests go out on its shard's row stream before any
        reply is read (no thread per shard); a shard whose stream another
        thread holds gets unary calls instead. Returns each call's reply bytes
        (``PushPullRowsReply``), queue by queue.
        """
        if not queues:
            return []
        started: list[tuple[int, RowStream | None]] = []
        try:
            for queue in queues:
                started.append((queue[0].shard, self._start(queue)))
            out = [self._finish(queue, stream)
                   for queue, (_, stream) in zip(queues, started, strict=True)]
        finally:
            for shard, stream in started:
                if stream is not None:
                    if not stream.idle:  # replies left unread: the stream cannot be reused
                        self._drop_stream(shard)
                    self._stream_locks[shard].release()
        with self._wire_lock:
            for queue, replies in zip(queues, out, strict=True):
                for call, data in zip(queue, replies, strict=True):
                    count = self.wire.setdefault(call.method, [0, 0, 0])
                    count[0] += 1
                    count[1] += len(call.payload)
                    count[2] += len(data)
        return out

    def _start(self, queue: list[Call]) -> RowStream | None:
        """Queue ``queue``'s requests on its shard's stream (its lock then held); None: busy."""
        shard = queue[0].shard
        lock = self._stream_locks[shard]
        if not lock.acquire(blocking=False):
            return None
        try:
            stream = self._streams[shard]
            if stream is not None and not (stream.fresh and stream.idle):
                self._drop_stream(shard)
                stream = None
            for call in queue:
                if stream is None:
                    stream = self._streams[shard] = RowStream(
                        self._routing.channel(shard), self.timeout, self._routing.payload(call))
                else:
                    stream.send(self._routing.payload(call))
            return stream
        except BaseException:
            self._drop_stream(shard)
            lock.release()
            raise

    def _finish(self, queue: list[Call], stream: RowStream | None) -> list[bytes]:
        """The replies of ``queue``'s calls: read from ``stream``, or sent as unary calls.

        A stream that fails UNAVAILABLE / DEADLINE_EXCEEDED / DATA_LOSS is
        dropped and the calls not answered yet are sent again as unary calls
        (with :meth:`_send`'s retries: a push applies once).
        """
        if stream is None:
            return self._send(queue)
        replies: list[bytes] = []
        try:
            for _ in queue:
                replies.append(stream.receive())
        except (UnavailableError, DeadlineExceededError, DataLossError,
                FailedPreconditionError) as exc:  # the last: a deposed primary, maybe
            self._drop_stream(queue[0].shard)
            rest = queue[len(replies):]
            if not all(call.retry for call in rest) or not self.retries or isinstance(
                    exc, FailedPreconditionError) and self._routing.routes is None:
                raise
            logger.info("row stream to ps task %d failed; %d request(s) sent again",
                        queue[0].shard, len(rest))
            return replies + self._send(rest)
        return replies

    def _drop_stream(self, shard: int) -> None:
        stream, self._streams[shard] = self._streams[shard], None
        if stream is not None:
            stream.close()

    def _send(self, queue: list[Call]) -> list[bytes]:
        """The replies of ``queue``'s calls, sent one after the other as unary calls."""
        return send_calls(queue, self._routing, timeout=self.timeout, retries=self.retries,
                          wait_forever=self._wait_forever)

    def init_table(self, config: TableConfig, *, wait: float = 300.0) -> list[Any]:
        """Create the table's shard on every ps task (idempotent); the ``InitTableReply``s.

        A ps task not reachable yet is asked again (with a logged retry) for up
        to ``wait`` seconds, as the dense Init waits for its shards.
        """
        self._check_shards(config)
        config = self._on_ps(config)[0]  # a fused table: created once, by its first member
        jobs = [(s, table_spec(config, s)) for s in range(self.num_shards)]
        deadline = time.monotonic() + wait
        aggregation = _aggregation_json(self.aggregation)

        def init(shard: int, spec: Any) -> Any:
            while True:
                try:
                    return self._call(shard, "InitTable",
                                      tpb.InitTableRequest(spec=spec, aggregation=aggregation),
                                      tpb.InitTableReply)
                except UnavailableError as exc:
                    if time.monotonic() >= deadline:
                        raise
                    logger.info("table %r: ps task %d not reachable yet (%s); retrying",
                                config.name, shard, str(exc)[:120])
                    time.sleep(0.2)

        return self._each(jobs, init)

    def _check_shards(self, config: TableConfig) -> None:
        if config.partitioner.num_shards != self.num_shards:
            raise InvalidArgumentError(
                f"Table {config.name!r} is split into {config.partitioner.num_shards} shards but "
                f"the cluster has {self.num_shards} ps tasks; give the partitioner num_shards="
                f"{self.num_shards}."
            )

    def pull(self, config: TableConfig, ids: torch.Tensor) -> torch.Tensor:
        """The ``(len(ids), dim)`` rows of ``ids``, one request per owning shard, in parallel.

        A deferred push of this table goes with the pull of its shard (the
        rows answered include it), or alone to a shard this pull does not ask.
        """
        return self.pull_many([(config, ids)])[0]

    def pull_many(self, lookups: Sequence[tuple[TableConfig, torch.Tensor]]
                  ) -> list[torch.Tensor]:
        """The rows of every ``(table, ids)``: one request per ps task for all of them.

        Each table's deferred pushes travel in the same request (the first
        pull of the table's shard carries its push; a shard the pulls do not
        ask gets it alone), applied before the rows are read. The lookups of
        tables fused on the ps (and repeated lookups of one table) are one
        item per ps task. A request larger than ``max_call_bytes`` is cut into
        several, in order.
        """
        return self.pull_with_dense(lookups, {})[0]

    def pull_with_dense(self, lookups: Sequence[tuple[TableConfig, torch.Tensor]],
                        dense: Mapping[int, bytes]) -> tuple[list[torch.Tensor], dict[int, bytes]]:
        """:meth:`pull_many`, each ps task's request also carrying ``dense[task]``: a
        ``PushPullSmall`` request to its dense shard (``RowBatchRequest.dense``), handled
        after the rows. Returns the rows and the ``PushPullSmall`` reply bytes by task:
        the step's row and dense traffic in one round trip per ps task."""
        on_ps: dict[str, tuple[TableConfig, list[tuple[int, torch.Tensor]]]] = {}
        for index, (config, ids) in enumerate(lookups):
            table, offset = self._on_ps(config)
            ids = config.partitioner.check(check_ids(ids))
            on_ps.setdefault(table.name, (table, []))[1].append(
                (index, ids + offset if offset else ids))
        with self._deferred_lock:
            deferred = {key: self._deferred.pop(key)
                        for key in [k for k in self._deferred if k[0] in on_ps]}
        per_shard: list[list[Item]] = [[] for _ in range(self.num_shards)]
        outs: list[torch.Tensor] = [torch.empty(0)] * len(lookups)
        for table, parts in on_ps.values():
            ids = parts[0][1] if len(parts) == 1 else torch.cat([p[1] for p in parts])
            out = torch.empty((ids.numel(), table.dim), dtype=table.dtype,
                              pin_memory=self.pin_memory)
            start = 0
            for index, part in parts:
                outs[index] = out[start:start + part.numel()]
                start += part.numel()
            step = max(1, self.max_call_bytes // (table.row_bytes + 8))
            for shard, (positions, shard_ids) in enumerate(
                    table.partitioner.split(ids, checked=True)):  # each part checked above
                for first in range(0, shard_ids.numel(), step):
                    chunk = shard_ids[first:first + step]
                    per_shard[shard].append(Item(
                        table.name, shard, ids=chunk, count=chunk.numel(),
                        push=deferred.pop((table.name, shard), None), out=out,
                        positions=positions[first:first + step]))
        for (name, shard), push in sorted(deferred.items()):  # not pulled: the push alone
            per_shard[shard].append(Item(name, shard, push=push))
        dense_replies: dict[int, bytes] = {}
        self._exchange(per_shard, dense, dense_replies)
        return outs, dense_replies

    def _exchange(self, per_shard: list[list[Item]], dense: Mapping[int, bytes] | None = None,
                  dense_replies: dict[int, bytes] | None = None) -> list[Any]:
        """Send each shard's items (one request, or more past ``max_call_bytes``; the first
        carries ``dense[shard]``), the shards side by side; copy the rows into their outputs;
        the ``PushRowsReply``s of the pushes (the dense replies into ``dense_replies``)."""
        dense = dense or {}
        queues = [group_calls(shard, items, self.max_call_bytes, dense.get(shard, b""))
                  for shard, items in enumerate(per_shard) if items or dense.get(shard)]
        pushed = []
        for queue, replies in zip(queues, self._run(queues), strict=True):
            for call, data in zip(queue, replies, strict=True):
                head, payload = unpack(data)
                reply = parse_message(tpb.RowBatchReply, head, "RowBatchReply")
                answers = reply.items
                if len(answers) != len(call.items) or len(reply.parts) != len(answers) + \
                        reply.dense:
                    raise DataLossError(
                        f"ps task {call.shard} answered {len(answers)} of {len(call.items)} "
                        f"table requests in {len(reply.parts)} buffers; client and ps must run "
                        "the same towerflow version."
                    )
                parts = split_parts(payload, reply.parts, "RowBatchReply")
                if reply.dense and dense_replies is not None:
                    dense_replies[call.shard] = parts[-1]
                for item, answer, part in zip(call.items, answers, parts, strict=False):
                    out = item.out
                    if out is not None and item.count:  # a view of the reply: copied out
                        rows = decode(part, out.dtype, (item.count, out.shape[1]))
                        out.index_copy_(0, item.positions, rows)  # type: ignore[arg-type]
                    if item.push is not None:
                        pushed.append(answer.push)
        return pushed

    def next_seq(self) -> int:
        """A fresh push sequence number of this client's incarnation."""
        with self._seq_lock:
            return next(self._seq)

    def push(self, config: TableConfig, ids: torch.Tensor, grads: torch.Tensor, *, lr: float,
             step: int, defer: bool = False) -> list[Any]:
        """Push row gradients (duplicates are summed on the ps); the ``PushRowsReply``s.

        :meth:`push_many` of one table.
        """
        return self.push_many([(config, ids, grads, defer)], lr=lr, step=step)

    def push_many(self, pushes: Sequence[tuple[TableConfig, torch.Tensor, torch.Tensor, bool]],
                  *, lr: float, step: int,
                  scales: Mapping[str, float] | None = None) -> list[Any]:
        """Push the row gradients of every ``(table, ids, grads, defer)``; the ``PushRowsReply``s.

        One request per owning ps task carries every table's push (more when
        larger than ``max_call_bytes``), the ps tasks in parallel, each push
        applied at most once; tables fused on the ps push as one.
        ``defer=True``: a table's push to a shard that fits one call is kept
        and sent with that table's next pull of the shard (see the class
        docstring); no reply is returned for it. A push deferred before and
        not sent yet is sent first, in the same request. ``scales``: a table's
        learning rate over ``lr``, by its name (tables fused on the ps share one).
        """
        on_ps: dict[str, tuple[TableConfig, bool, list[torch.Tensor], list[torch.Tensor]]] = {}
        rates: dict[str, float] = {}
        for config, ids, grads, defer in pushes:
            table, offset = self._on_ps(config)
            ids = config.partitioner.check(check_ids(ids))
            rates[table.name] = lr * (scales or {}).get(config.name, 1.0)
            entry = on_ps.setdefault(table.name, (table, defer, [], []))
            entry[2].append(ids + offset if offset else ids)
            entry[3].append(grads.detach().to("cpu", table.dtype))
        per_shard: list[list[Item]] = [[] for _ in range(self.num_shards)]
        with self._deferred_lock:  # earlier deferred pushes of these tables go first
            for key in sorted(k for k in self._deferred if k[0] in on_ps):
                per_shard[key[1]].append(Item(key[0], key[1], push=self._deferred.pop(key)))
        keep: dict[tuple[str, int], Push] = {}
        for table, defer, id_parts, grad_parts in on_ps.values():
            ids = id_parts[0] if len(id_parts) == 1 else torch.cat(id_parts)
            grads = grad_parts[0] if len(grad_parts) == 1 else torch.cat(grad_parts)
            dtype = DTYPE_NAMES[table.dtype]
            step_rows = max(1, self.max_call_bytes // (table.row_bytes + 8))
            for shard, (positions, shard_ids) in enumerate(
                    table.partitioner.split(ids, checked=True)):  # each part checked above
                if not shard_ids.numel() and not self.every_shard:
                    continue
                shard_grads = grads.index_select(0, positions)
                # sync / ssp count one push per replica, shard and step: never cut in pieces
                cuts = [slice(None)] if self.every_shard else \
                    [slice(i, i + step_rows) for i in range(0, shard_ids.numel(), step_rows)]
                requests = []
                for cut in cuts:
                    chunk = shard_ids[cut]
                    requests.append(Push(tpb.PushRowsRequest(
                        table=table.name, shard=shard, worker_id=self.worker_id,
                        incarnation=self.incarnation, seq=self.next_seq(),
                        lr=rates[table.name], step=step, num_ids=chunk.numel(), dtype=dtype),
                        chunk, shard_grads[cut]))
                if defer and len(requests) == 1:
                    keep[(table.name, shard)] = requests[0]
                else:
                    per_shard[shard].extend(Item(table.name, shard, push=r) for r in requests)
        if keep:
            with self._deferred_lock:
                self._deferred.update(keep)
        return self._exchange(per_shard)

    def flush(self, config: TableConfig | None = None) -> list[Any]:
        """Send the deferred pushes (of ``config``'s table, or of every table); their replies.

        One request per ps task carries them all.
        """
        name = None if config is None else self._on_ps(config)[0].name
        with self._deferred_lock:
            keys = sorted(k for k in self._deferred if name is None or k[0] == name)
            taken = [(k, self._deferred.pop(k)) for k in keys]
        if not taken:
            return []
        per_shard: list[list[Item]] = [[] for _ in range(self.num_shards)]
        for (table, shard), push in taken:
            per_shard[shard].append(Item(table, shard, push=push))
        return self._exchange(per_shard)

    def deferred(self) -> int:
        """Number of deferred pushes not sent yet (one per table shard at most)."""
        with self._deferred_lock:
            return len(self._deferred)

    def status(self, config: TableConfig, shard: int) -> Any:
        """The ``TableStatusReply`` of one shard (deferred pushes of the table sent first)."""
        self.flush(config)
        return self._call(shard, "TableStatus",
                          tpb.TableStatusRequest(table=self._on_ps(config)[0].name, shard=shard),
                          tpb.TableStatusReply)

    def export_shard(self, config: TableConfig, shard: int, *, chunk_rows: int = 0
                     ) -> Iterator[Any]:
        """The ``RowChunk``s of one shard (rows and slots of one moment), streamed.

        Deferred pushes of the table are sent first, so the export holds them.
        A table fused on the ps is exported by its rows' range, its ids its own.
        """
        self.flush(config)
        table, offset = self._on_ps(config)
        request = tpb.ExportRowsRequest(table=table.name, shard=shard, chunk_rows=chunk_rows)
        if table is not config:
            request.id_start, request.id_stop = offset, offset + config.num_rows
        for data in unary_stream(self._routing.channel(shard), _method("ExportRows"),
                                 request.SerializeToString(), timeout=self.timeout * 10):
            chunk = tpb.RowChunk.FromString(data)
            if table is not config:
                chunk.ids = encode(decode(chunk.ids, torch.int64, (chunk.num_ids,)) - offset)
                if chunk.HasField("spec"):
                    chunk.spec.CopyFrom(table_spec(config, shard))
            yield chunk

    def import_rows(self, config: TableConfig, shard: int,
                    pieces: Iterable[tuple[Any, ...]],
                    pushes: Sequence[tuple[int, int, int, str]] = ()) -> int:
        """Set rows (and slots) of shard ``shard`` from ``(ids, rows, slots)`` pieces
        (``(ids, rows, slots, versions[, (counter ids, counts)])``: a dynamic table's rows
        with their last update step, and admission counters).

        The ps checks every piece before it sets any row; returns the rows set.
        Deferred pushes of the table are sent first (the import overwrites them).
        """
        self.flush(config)
        table, offset = self._on_ps(config)
        spec = table_spec(table, shard)

        def chunks() -> Iterator[bytes]:
            first = True
            for ids, rows, slots, *extra in pieces:
                versions = extra[:1] if extra else []
                counters = extra[1] if len(extra) > 1 else None
                names = sorted(slots) if slots else []
                chunk = tpb.RowChunk(num_ids=ids.numel(), ids=encode(ids + offset),
                                     rows=encode(rows.to(config.dtype)), slot_names=names,
                                     slots=[encode(slots[k].to(config.dtype)) for k in names])
                if versions and versions[0] is not None and ids.numel():
                    chunk.versions = encode(versions[0].to(torch.int64))
                if counters is not None and counters[0].numel():
                    chunk.num_counters = counters[0].numel()
                    chunk.counter_ids, chunk.counter_counts = (encode(t.to(torch.int64))
                                                               for t in counters)
                if first:
                    chunk.spec.CopyFrom(spec)
                    chunk.pushes.extend(push_records(pushes))
                    first = False
                yield chunk.SerializeToString()

        data = stream_unary(self._routing.channel(shard), _method("ImportRows"), chunks(),
                            timeout=self.timeout * 10)
        return tpb.ImportRowsReply.FromString(data).rows

    def done(self) -> None:
        """Tell every ps task this worker has finished (deferred pushes sent first).

        Sync steps and the ssp bound of every table stop waiting for it.
        """
        self.flush()
        request = tpb.TablesDoneRequest(worker_id=self.worker_id)
        self._each([(s, request) for s in range(self.num_shards)],
                   lambda shard, req: self._call(shard, "Done", req, tpb.TablesDoneReply))

    def close(self) -> None:
        """Send the deferred pushes, then close the channels and the thread pool.

        The channels are closed even when a deferred push cannot be sent; its
        error is raised then.
        """
        try:
            self.flush()
        finally:
            self._close()

    def _close(self) -> None:
        for shard in range(self.num_shards):
            with self._stream_locks[shard]:
                self._drop_stream(shard)
        self._pool.shutdown(wait=False)
        for channel in self._channels:
            channel.close()
