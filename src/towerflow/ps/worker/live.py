"""What a running cluster's ps tasks hold now, read by a process outside the job.

``towerflow export --cluster`` writes a serving export of a job while it trains,
from a process that is not one of its tasks: it holds the cluster's
credentials, asks each ps task for its variables' layout (``Status`` with
``with_layout``), pulls the dense parameters shard by shard, and streams every
table's rows out of the shards part by part (``ExportRows``, as a checkpoint
does), so no table is ever gathered in one process. It pushes nothing and
never says ``Done``: the job does not count it.

What the ps tasks do not hold comes from the job's newest checkpoint: the
tables' descriptions (names, dims, partitioners, and which tables share one
table on the ps) and the model's buffers (a batch norm's running statistics).
The dense parameters are each shard's as of one moment; in async training the
rows of a step may straddle the moment a shard is read (as for a checkpoint).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from towerflow.cluster.transport import Credentials, make_channel, unary
from towerflow.errors import FailedPreconditionError, InvalidArgumentError, TowerflowError
from towerflow.ps.placement import Placement
from towerflow.ps.spec.tables import TableConfig
from towerflow.ps.wire import ps_pb2 as pb
from towerflow.ps.wire.calls import method_path
from towerflow.ps.wire.messages import layout_from_proto, parse_message
from towerflow.ps.worker.dense.client import PSClient
from towerflow.ps.worker.dense.variables import consistent_snapshot, dense_groups
from towerflow.ps.worker.tables.checkpoint import (
    FUSED_KEY,
    PART_BYTES,
    TABLES_GROUP,
    TABLES_KEY,
    checked_descriptions,
    config_from_description,
    export_tables,
)
from towerflow.ps.worker.tables.client import TableClient
from towerflow.ps.worker.tables.fusion import TableView

__all__ = ["live_placement", "live_state"]

log = logging.getLogger("towerflow.ps")



def live_placement(cluster: Any, credentials: Credentials, *, timeout: float = 10.0
                   ) -> tuple[Placement, str]:
    """Every ps task's variables as it holds them now, and the job's mode (``async`` ...).

    Raises:
        FailedPreconditionError: a ps task is not initialised yet.
        UnavailableError: a ps task does not answer.
    """
    request = pb.StatusRequest(with_layout=True).SerializeToString()
    layouts, mode = [], ""
    for index in range(cluster.num_tasks("ps")):
        address = cluster.task_address("ps", index)
        channel = make_channel(address, credentials)
        try:
            reply = parse_message(pb.StatusReply, unary(channel, method_path("Status"), request,
                                                        timeout=timeout), "StatusReply")
        finally:
            channel.close()
        if not reply.initialized:
            raise FailedPreconditionError(
                f"ps task {index} at {address} is not initialised yet (the chief initialises "
                "it when the job starts); export once the job trains, or export its newest "
                "checkpoint (leave out --cluster).")
        layouts.append(layout_from_proto(index, reply.segments))
        mode = mode or reply.mode
    return Placement(tuple(layouts)), mode


def _tables(metadata: Mapping[str, Any]) -> tuple[list[TableConfig], dict[str, TableView]]:
    """The logical tables of a checkpoint's strategy metadata and where each lives on the ps."""
    configs = [config_from_description(name, d, p) for name, (d, p)
               in checked_descriptions(metadata.get(TABLES_KEY, {})).items()]
    views: dict[str, TableView] = {}
    fused = metadata.get(FUSED_KEY, {})
    if not isinstance(fused, Mapping):
        raise InvalidArgumentError(f"The checkpoint's {FUSED_KEY!r} is not an object by table "
                                   "name; export the checkpoint itself (leave out --cluster).")
    for name, entry in fused.items():
        members = entry.get("members") if isinstance(entry, Mapping) else None
        if not isinstance(members, Mapping):
            raise InvalidArgumentError(f"The checkpoint's fused table {name!r} names no "
                                       "members; export the checkpoint itself.")
        (description, partitioner), = checked_descriptions(
            {name: {k: v for k, v in entry.items() if k != "members"}}).values()
        table = config_from_description(name, description, partitioner)
        for member, offset in members.items():
            views[str(member)] = TableView(table, int(offset))
    return configs, views


@contextmanager
def live_state(cluster: Any, credentials: Credentials, checkpoint_metadata: Mapping[str, Any],
               *, timeout: float = 30.0, part_bytes: int = PART_BYTES
               ) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """The cluster's state now as checkpoint groups and metadata (what a trainer's
    ``checkpoint_state()`` gives): ``model`` (the dense parameters the ps tasks hold),
    ``optimizer``, and the tables' chunked group, streamed from the shards while the
    context is open (its channels close with it).

    Args:
        cluster: the job's ``ClusterSpec``.
        credentials: the cluster's credentials (its secret; TLS off loopback).
        checkpoint_metadata: the strategy's metadata of the job's newest checkpoint
            (the tables' descriptions, and which share one table on the ps).
        timeout: seconds per call.
        part_bytes: rows and slots per streamed part of a table.

    Raises:
        FailedPreconditionError: the job is not initialised yet.
        InvalidArgumentError: the ps tasks do not hold the checkpoint's tables.
    """
    placement, mode = live_placement(cluster, credentials, timeout=min(timeout, 10.0))
    client = PSClient(cluster, placement, worker_id=-1, credentials=credentials, timeout=timeout)
    try:
        snaps = consistent_snapshot(client, sync=mode == "sync", timeout=timeout)
    finally:
        client.close(done=False)  # an observer: the job does not count it
    groups: dict[str, Any] = {k: v for k, v in dense_groups(placement, snaps).items()
                              if k in ("model", "optimizer")}
    metadata: dict[str, Any] = {"step": snaps[0].step, "strategy": {"mode": mode}}
    configs, views = _tables(checkpoint_metadata)
    if not configs:
        yield groups, metadata
        return
    addresses = [cluster.task_address("ps", i) for i in range(cluster.num_tasks("ps"))]
    tables = TableClient(addresses, credentials=credentials, timeout=timeout)
    try:
        tables.fuse(views)
        for config in configs:  # every table the checkpoint names is on the ps
            try:
                tables.status(config, 0)
            except TowerflowError as exc:
                raise InvalidArgumentError(
                    f"The cluster does not hold table {config.name!r} of the newest "
                    f"checkpoint ({exc}); export once the job has checkpointed this model, or "
                    "export the checkpoint itself (leave out --cluster).") from None
        groups[TABLES_GROUP] = export_tables(tables, configs, part_bytes=part_bytes)
        metadata["strategy"][TABLES_KEY] = dict(checkpoint_metadata.get(TABLES_KEY, {}))
        log.info("reading the live state of %d ps task(s) at step %d", placement.num_shards,
                 snaps[0].step)
        yield groups, metadata
    finally:
        tables.close()
