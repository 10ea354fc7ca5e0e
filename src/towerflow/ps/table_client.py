"""A worker's client of the sparse table service ``towerflow.ps.Tables``.

:class:`TableConfig` says what a table is (name, partitioner, dim, dtype,
row-wise optimizer, initializer); :class:`TableClient` makes the calls of
``tables.proto`` to every ps task: ``InitTable`` (chief), ``PullRows`` and
``PushRows`` (one call per owning shard, the shards in parallel; a pushed
``(worker_id, incarnation, seq)`` makes a retried push apply once),
``ExportRows`` / ``ImportRows`` (checkpoints, streamed in chunks) and
``TableStatus``. Ids and rows travel as raw little-endian buffers.

It imports the generated messages, the partitioners and the cluster
transport only, never a server module.
"""

from __future__ import annotations

import itertools
import json
import logging
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from towerflow.cluster.transport import (
    Credentials,
    make_channel,
    stream_unary,
    unary,
    unary_stream,
)
from towerflow.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    UnavailableError,
)
from towerflow.ps import tables_pb2 as tpb
from towerflow.ps.partition import Partitioner, check_ids

__all__ = ["TableConfig", "TableClient", "DEFAULT_INITIALIZER"]

logger = logging.getLogger("towerflow.ps")

_SERVICE = tpb.DESCRIPTOR.services_by_name["Tables"].full_name
_DTYPE_NAMES = {torch.float32: "float32", torch.float64: "float64"}
#: the default row initializer: uniform in [-0.05, 0.05), a function of the id
DEFAULT_INITIALIZER: dict[str, Any] = {"kind": "uniform", "minval": -0.05, "maxval": 0.05,
                                       "seed": 0}


def _method(name: str) -> str:
    return f"/{_SERVICE}/{name}"


def _describe(value: Any, what: str) -> dict[str, Any]:
    """A description dict from a dict or an object with ``to_dict()``."""
    if isinstance(value, Mapping):
        return dict(value)
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):
        return dict(to_dict())
    raise InvalidArgumentError(
        f"{what} must be a dict or have to_dict() (e.g. towerflow.ps.sparse_optim.SparseAdagrad"
        f"() or towerflow.ps.rows.UniformRows()), got {type(value).__name__}."
    )


def _encode(tensor: torch.Tensor) -> bytes:
    if sys.byteorder != "little":  # pragma: no cover
        tensor = tensor.byteswap()
    return tensor.detach().contiguous().cpu().numpy().tobytes()


def _decode(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    count = 1
    for n in shape:
        count *= n
    size = torch.empty((), dtype=dtype).element_size()
    if len(data) != count * size:
        raise InvalidArgumentError(
            f"A ps answered {len(data)} bytes where {shape} {dtype} values need {count * size}; "
            "client and ps must run the same towerflow version."
        )
    if not data:
        return torch.empty(shape, dtype=dtype)
    out = torch.frombuffer(bytearray(data), dtype=dtype).view(shape)
    return out if sys.byteorder == "little" else out.byteswap()  # pragma: no cover


@dataclass(frozen=True)
class TableConfig:
    """What a table is: its name, shape, dtype, sharding, optimizer and initializer.

    Attributes:
        name: unique among the job's tables.
        partitioner: how rows map to shards (its ``num_rows`` is the table's).
        dim: values per row.
        optimizer: the row-wise optimizer's description (``{"name", "hyper"}``).
        initializer: the rows' start (``{"kind", ...}``).
        dtype: ``torch.float32`` or ``torch.float64``.
    """

    name: str
    partitioner: Partitioner
    dim: int
    optimizer: Mapping[str, Any]
    initializer: Mapping[str, Any]
    dtype: torch.dtype = torch.float32

    @property
    def num_rows(self) -> int:
        """Rows of the table."""
        return int(self.partitioner.num_rows or 0)

    @property
    def row_bytes(self) -> int:
        """Bytes of one row."""
        return self.dim * torch.empty((), dtype=self.dtype).element_size()

    def spec(self, shard: int) -> tpb.TableSpec:
        """The ``TableSpec`` message of shard ``shard``."""
        return tpb.TableSpec(
            name=self.name, num_rows=self.num_rows, dim=self.dim,
            dtype=_DTYPE_NAMES[self.dtype],
            partitioner=json.dumps(self.partitioner.to_dict(), sort_keys=True),
            optimizer=json.dumps(dict(self.optimizer), sort_keys=True),
            initializer=json.dumps(dict(self.initializer), sort_keys=True), shard=shard)


class TableClient:
    """A worker's calls to the ``towerflow.ps.Tables`` service of every ps task.

    Args:
        addresses: the ps tasks' addresses; task ``i`` holds shard ``i``.
        credentials: the cluster credentials (default: from the environment).
        worker_id: this replica's index (the push table's key).
        incarnation: distinguishes a restarted worker (default: now in ns).
        timeout: deadline of each call, seconds.
        max_call_bytes: largest rows payload of one call; bigger pulls and
            pushes to a shard are cut into several calls.
        retries: how often a push that failed UNAVAILABLE / DEADLINE_EXCEEDED
            is sent again (the same ``seq``: applied at most once).
    """

    def __init__(self, addresses: Sequence[str], *, credentials: Credentials | None = None,
                 worker_id: int = 0, incarnation: int | None = None, timeout: float = 30.0,
                 max_call_bytes: int = 8 << 20, retries: int = 3) -> None:
        if not addresses:
            raise InvalidArgumentError("A table client needs the ps tasks' addresses.")
        credentials = Credentials.from_env() if credentials is None else credentials
        self._channels = [make_channel(a, credentials) for a in addresses]
        self._pool = ThreadPoolExecutor(len(addresses), thread_name_prefix="towerflow-tables")
        self.worker_id = worker_id
        self.incarnation = time.time_ns() & ((1 << 63) - 1) if incarnation is None \
            else incarnation
        self.timeout = timeout
        self.max_call_bytes = max_call_bytes
        self.retries = retries
        self._seq = itertools.count(1)
        self._seq_lock = threading.Lock()

    @property
    def num_shards(self) -> int:
        """Number of ps tasks (shards of every table)."""
        return len(self._channels)

    def _call(self, shard: int, method: str, message: Any, reply: type) -> Any:
        data = unary(self._channels[shard], _method(method), message.SerializeToString(),
                     timeout=self.timeout)
        return reply.FromString(data)

    def _each(self, jobs: list[tuple[int, Any]], fn: Any) -> list[Any]:
        """``fn(shard, job)`` for every job, the shards in parallel, in order."""
        if len(jobs) == 1:
            return [fn(*jobs[0])]
        futures = [self._pool.submit(fn, shard, job) for shard, job in jobs]
        return [f.result() for f in futures]

    def _pieces(self, config: TableConfig, ids: torch.Tensor) -> list[tuple[int, slice]]:
        step = max(1, self.max_call_bytes // config.row_bytes)
        return [(start, slice(start, start + step)) for start in range(0, ids.numel(), step)]

    def init_table(self, config: TableConfig, *, wait: float = 300.0) -> list[Any]:
        """Create the table's shard on every ps task (idempotent); the ``InitTableReply``s.

        A ps task not reachable yet is asked again (with a logged retry) for up
        to ``wait`` seconds, as the dense Init waits for its shards.
        """
        self._check_shards(config)
        jobs = [(s, config.spec(s)) for s in range(self.num_shards)]
        deadline = time.monotonic() + wait

        def init(shard: int, spec: Any) -> Any:
            while True:
                try:
                    return self._call(shard, "InitTable", tpb.InitTableRequest(spec=spec),
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
        """The ``(len(ids), dim)`` rows of ``ids``, one call per owning shard, in parallel."""
        ids = config.partitioner.check(check_ids(ids))
        out = torch.empty((ids.numel(), config.dim), dtype=config.dtype)
        jobs = [(s, part) for s, part in enumerate(config.partitioner.split(ids))
                if part[0].numel()]

        def pull_shard(shard: int, part: tuple[torch.Tensor, torch.Tensor]) -> None:
            positions, shard_ids = part
            for _, piece in self._pieces(config, shard_ids):
                chunk = shard_ids[piece]
                reply = self._call(shard, "PullRows", tpb.PullRowsRequest(
                    table=config.name, shard=shard, num_ids=chunk.numel(), ids=_encode(chunk)),
                    tpb.PullRowsReply)
                rows = _decode(reply.rows, config.dtype, (chunk.numel(), config.dim))
                out.index_copy_(0, positions[piece], rows)

        self._each(jobs, pull_shard)
        return out

    def next_seq(self) -> int:
        """A fresh push sequence number of this client's incarnation."""
        with self._seq_lock:
            return next(self._seq)

    def push(self, config: TableConfig, ids: torch.Tensor, grads: torch.Tensor, *, lr: float,
             step: int) -> list[Any]:
        """Push row gradients (duplicates are summed on the ps); the ``PushRowsReply``s.

        Each owning shard gets one call (more when larger than
        ``max_call_bytes``), the shards in parallel, each applied at most once.
        """
        ids = config.partitioner.check(check_ids(ids))
        grads = grads.detach().to("cpu", config.dtype)
        jobs = [(s, part) for s, part in enumerate(config.partitioner.split(ids))
                if part[0].numel()]
        dtype = _DTYPE_NAMES[config.dtype]

        def push_shard(shard: int, part: tuple[torch.Tensor, torch.Tensor]) -> list[Any]:
            positions, shard_ids = part
            shard_grads = grads.index_select(0, positions)
            replies = []
            for _, piece in self._pieces(config, shard_ids):
                chunk = shard_ids[piece]
                request = tpb.PushRowsRequest(
                    table=config.name, shard=shard, worker_id=self.worker_id,
                    incarnation=self.incarnation, seq=self.next_seq(), lr=lr, step=step,
                    num_ids=chunk.numel(), dtype=dtype, ids=_encode(chunk),
                    grads=_encode(shard_grads[piece]))
                replies.append(self._push_once(shard, request))
            return replies

        return [r for replies in self._each(jobs, push_shard) for r in replies]

    def _push_once(self, shard: int, request: Any) -> Any:
        """Send a push, again on a lost connection (its seq makes it apply once)."""
        for attempt in range(self.retries + 1):
            try:
                return self._call(shard, "PushRows", request, tpb.PushRowsReply)
            except (UnavailableError, DeadlineExceededError):
                if attempt == self.retries:
                    raise
                time.sleep(min(2.0, 0.1 * 2**attempt))
        raise AssertionError("unreachable")  # pragma: no cover

    def status(self, config: TableConfig, shard: int) -> Any:
        """The ``TableStatusReply`` of one shard."""
        return self._call(shard, "TableStatus",
                          tpb.TableStatusRequest(table=config.name, shard=shard),
                          tpb.TableStatusReply)

    def export_shard(self, config: TableConfig, shard: int, *, chunk_rows: int = 0
                     ) -> Iterator[Any]:
        """The ``RowChunk``s of one shard (rows and slots of one moment), streamed."""
        request = tpb.ExportRowsRequest(table=config.name, shard=shard, chunk_rows=chunk_rows)
        for data in unary_stream(self._channels[shard], _method("ExportRows"),
                                 request.SerializeToString(), timeout=self.timeout * 10):
            yield tpb.RowChunk.FromString(data)

    def import_rows(self, config: TableConfig, shard: int,
                    pieces: Iterable[tuple[torch.Tensor, torch.Tensor,
                                           Mapping[str, torch.Tensor] | None]],
                    pushes: Sequence[tuple[int, int, int, str]] = ()) -> int:
        """Set rows (and slots) of shard ``shard`` from ``(ids, rows, slots)`` pieces.

        The ps checks every piece before it sets any row; returns the rows set.
        """
        spec = config.spec(shard)

        def chunks() -> Iterator[bytes]:
            first = True
            for ids, rows, slots in pieces:
                names = sorted(slots) if slots else []
                chunk = tpb.RowChunk(num_ids=ids.numel(), ids=_encode(ids),
                                     rows=_encode(rows.to(config.dtype)), slot_names=names,
                                     slots=[_encode(slots[k].to(config.dtype)) for k in names])
                if first:
                    chunk.spec.CopyFrom(spec)
                    chunk.pushes.extend(tpb.TablePushRecord(worker_id=w, incarnation=i, seq=q,
                                                            status=st)
                                        for w, i, q, st in pushes)
                    first = False
                yield chunk.SerializeToString()

        data = stream_unary(self._channels[shard], _method("ImportRows"), chunks(),
                            timeout=self.timeout * 10)
        return tpb.ImportRowsReply.FromString(data).rows

    def close(self) -> None:
        """Close the channels and the thread pool."""
        self._pool.shutdown(wait=False)
        for channel in self._channels:
            channel.close()
