"""What a ps task's handlers cost per request, in one process with no gRPC around them.

The sparse click benchmark (``sparse_embedding.py``) measures a ps task's CPU per
request with everything around it (gRPC's Python server, its threads). This script
times the handlers alone on the same request shapes, so the difference is what the
server machinery costs:

- ``rows``: ``TableService.row_batch`` on a framed request of the benchmark's shape
  (a batch of 512 x 16 ids from Zipf(1.2) over 1M rows, made unique, the ids of
  shard 0 of 2: about 1,200 pulled and their row gradients pushed, row-wise
  Adagrad on a 500,000 x 32 shard);
- ``dense``: ``PSService.push_pull_small`` of the benchmark's dense layer (a
  ``Linear(32, 1)``: 33 values, Adagrad), the request a ``RowBatch`` carries.

Each is timed over ``--requests`` calls after 20 unmeasured ones; ``--profile``
prints the handlers' cProfile by own time.

Command::

    python benchmarks/ps_request_costs.py --requests 300
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np
import torch

from towerflow.ps.partition import ModPartitioner
from towerflow.ps.placement import plan_placement
from towerflow.ps.server.dense.service import PSService
from towerflow.ps.server.tables.service import TableService
from towerflow.ps.spec.tables import TableConfig
from towerflow.ps.wire import ps_pb2 as pb
from towerflow.ps.wire import tables_pb2 as tpb
from towerflow.ps.wire.messages import (
    AggregationConfig,
    aggregation_to_proto,
    layout_to_proto,
    optimizer_to_proto,
)
from towerflow.ps.wire.tables import table_spec
from towerflow.ps.worker.dense.shard_client import ShardClient
from towerflow.ps.worker.tables.batch import Item, Push, batch_call
from towerflow.strategies import OptimizerConfig

ROWS, DIM, BATCH, IDS = 1_000_000, 32, 512, 16
WARMUP = 20


def row_requests(count: int) -> tuple[TableService, list[bytes]]:
    config = TableConfig("emb", ModPartitioner(2, num_rows=ROWS), DIM,
                         {"name": "adagrad", "hyper": {"initial_accumulator_value": 0.1}},
                         {"kind": "uniform", "minval": -0.05, "maxval": 0.05, "seed": 1})
    service = TableService(0)
    service.init_table(tpb.InitTableRequest(spec=table_spec(config, 0)).SerializeToString())
    rng = np.random.default_rng(0)
    out = []
    for seq in range(1, count + 1):
        ids = torch.from_numpy(np.unique((rng.zipf(1.2, BATCH * IDS) - 1) % ROWS))
        ids = ids[ids % 2 == 0]
        push = Push(tpb.PushRowsRequest(table="emb", shard=0, worker_id=0, incarnation=1,
                                        seq=seq, lr=0.1, step=seq, num_ids=ids.numel(),
                                        dtype="float32"),
                    ids, torch.full((ids.numel(), DIM), 0.01))
        item = Item("emb", 0, ids=ids, count=ids.numel(), push=push,
                    out=torch.empty(ids.numel(), DIM), positions=torch.arange(ids.numel()))
        out.append(batch_call(0, [item]).payload)
    return service, out


def dense_requests(count: int) -> tuple[PSService, list[bytes]]:
    layout = plan_placement([("out.weight", (1, DIM)), ("out.bias", (1,))], 1).shards[0]
    service = PSService(0)
    optimizer = OptimizerConfig("adagrad", lr=0.1)
    init = pb.InitRequest(
        shard=0, segments=layout_to_proto(layout),
        optimizer=optimizer_to_proto(optimizer, (s.name for s in layout.segments)),
        aggregation=aggregation_to_proto(AggregationConfig(mode="async",
                                                           total_num_replicas=2)))
    service.init(iter([init.SerializeToString(), np.zeros(layout.numel, np.float32).tobytes()]))
    client = ShardClient(None, layout)  # type: ignore[arg-type] - it only encodes here
    grad = np.full(layout.numel, 0.01, np.float32)
    return service, [client.encode_small(grad, worker_id=0, incarnation=1, seq=seq, lr=0.1,
                                         want_params=True) for seq in range(1, count + 1)]


def timed(handler, requests: list[bytes], profile: bool) -> tuple[float, float]:
    for request in requests[:WARMUP]:
        handler(request)
    measured = requests[WARMUP:]
    prof = cProfile.Profile() if profile else None
    wall, cpu = time.perf_counter(), time.process_time()
    if prof is not None:
        prof.enable()
    for request in measured:
        handler(request)
    if prof is not None:
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    return ((time.perf_counter() - wall) / len(measured) * 1e6,
            (time.process_time() - cpu) / len(measured) * 1e6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    service, rows = row_requests(args.requests + WARMUP)
    wall, cpu = timed(service.row_batch, rows, args.profile)
    print(f"rows: {len(rows[0]):,} request bytes; {wall:.0f} us wall, {cpu:.0f} us CPU per "
          "RowBatch")
    dense, small = dense_requests(args.requests * 10 + WARMUP)
    wall, cpu = timed(dense.push_pull_small, small, args.profile)
    print(f"dense: {wall:.1f} us wall, {cpu:.1f} us CPU per PushPullSmall (33 values, Adagrad)")

if __name__ == "__main__":
    main()
