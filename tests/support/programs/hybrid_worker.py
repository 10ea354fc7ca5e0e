"""A worker of a hybrid job (tables on the ps, dense layers all-reduced), for the tests.

A click model written the plain PyTorch way (``nn.EmbeddingBag(sparse=True)`` and two
linear layers), trained with ``ParameterServer(..., dense="allreduce")`` on its own
deterministic batches. It records, in ``--out`` as ``worker-<i>.json`` and
``worker-<i>.safetensors``:

- after every step, the SHA-256 of its dense parameters' bytes (equal on every worker);
- every row gradient it pushed, times the learning rate, summed per row (the tables'
  updates it is owed);
- when each step's forward began and when each background push ended (the staleness bound);
- worker 0 also the table's rows before training and after every worker's pushes.

Usage: python hybrid_worker.py CLUSTER_JSON INDEX OUT_DIR --steps N [--staleness N]
[--slow-push SECONDS] [--die-after STEP] [--device cuda] [--checkpoint-at STEP]
[--slow-forward SECONDS] [--stall-after STEP] [--step-timeout SECONDS] [--ahead]
[--die-in-pause]

``--ahead``: each step is told the next step's batch first (``strategy.ahead``, as the
``Trainer`` does), and the record says when each pull began and which pulled ahead.
``--die-in-pause``: the worker dies inside a checkpoint's pause (``--checkpoint-at``), a
peer then waiting in the store: the chief once it paused the others (they wait for its go),
another worker once paused (the chief waits for its word that its pushes are applied).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from towerflow.cluster import ClusterSpec, TaskInfo
from towerflow.cluster.transport import Credentials
from towerflow.strategies import OptimizerConfig
from towerflow.strategies.parameter_server import ParameterServer

ROWS, DIM, IDS, BATCH = 500, 8, 6, 64


class Click(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=True)
        self.hidden = nn.Linear(DIM, 16)
        self.out = nn.Linear(16, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(self.emb(ids)))).squeeze(-1)


def click_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    ids, labels = batch
    return F.binary_cross_entropy_with_logits(model(ids), labels)


def batches(index: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1000 + index)
    out = []
    for _ in range(count):
        ids = torch.randint(0, ROWS, (BATCH, IDS), generator=gen)
        out.append((ids, (ids[:, 0] % 2 == 0).float()))
    return out


def dense_digest(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        digest.update(name.encode())
        digest.update(param.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("cluster")
    parser.add_argument("index", type=int)
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--staleness", type=int, default=0)
    parser.add_argument("--slow-push", type=float, default=0.0)
    parser.add_argument("--die-after", type=int, default=0)
    parser.add_argument("--stall-after", type=int, default=0)
    parser.add_argument("--step-timeout", type=float, default=60.0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--checkpoint-at", type=int, default=0)
    parser.add_argument("--slow-forward", type=float, default=0.0)
    parser.add_argument("--ahead", action="store_true")
    parser.add_argument("--die-in-pause", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    cluster = ClusterSpec(json.loads(args.cluster))
    torch.manual_seed(0)
    model = Click()
    torch.manual_seed(1 + args.index)  # each worker's dense layers start apart: worker 0's win
    model.hidden.reset_parameters()
    start_rows = model.emb.weight.detach().clone()
    strategy = ParameterServer(cluster, TaskInfo("worker", args.index), dense="allreduce",
                               embedding_staleness=args.staleness,
                               credentials=Credentials.from_env(), device=args.device,
                               step_timeout=args.step_timeout, timeout=10.0)
    lr = 0.5
    strategy.prepare(model, OptimizerConfig("sgd", lr=lr))
    if args.die_in_pause:
        side = "_pause" if args.index == 0 else "_paused"
        pause = getattr(strategy, side)

        def die_in_pause() -> None:
            if args.index == 0:
                pause()  # the others paused, waiting for the chief's go
            os._exit(9)  # dies without a word, as a killed process

        setattr(strategy, side, die_in_pause)
    strategy.stop_at(args.steps)  # as the Trainer says the run's last step
    tables = strategy._tables
    owed = torch.zeros(ROWS, DIM, dtype=torch.float64)
    push, flush = tables.push, tables.flush
    began: list[float] = []
    pushed: list[float] = []
    lock = threading.Lock()

    def record_push(taken, *, lr: float, step: int) -> None:  # noqa: ANN001
        for _, ids, grads in taken:
            owed.index_add_(0, ids.cpu(), grads.double().cpu() * lr)
        push(taken, lr=lr, step=step)

    def slow_flush() -> None:
        if args.slow_push and args.index:
            time.sleep(args.slow_push)  # a slowed worker (1): its pushes take this long
        flush()
        with lock:
            pushed.append(time.monotonic())

    tables.push, tables.flush = record_push, slow_flush
    # each pull of a forward's rows: when it began, whether ahead, and the steps whose pushes
    # were applied on the ps when it read its rows (sent before it, or carried by it)
    pulls: list[tuple[float, bool, list[int]]] = []
    prefetch, later, client = tables._prefetch, tables.pull_later, tables.client
    applied: set[int] = set()

    def deferred_steps() -> set[int]:
        with client._deferred_lock:
            return {push.header.step for push in client._deferred.values()}

    def sending(call):  # noqa: ANN001, ANN202
        def send(*args):  # noqa: ANN002, ANN202
            steps = deferred_steps()
            out = call(*args)
            with lock:
                applied.update(steps)
            return out
        return send

    client.pull_with_dense, client.flush = sending(client.pull_with_dense), sending(client.flush)

    def timed_prefetch(lookups) -> None:  # noqa: ANN001
        start = time.monotonic()
        prefetch(lookups)
        pulls.append((start, False, sorted(applied)))

    def timed_later(lookups, submit):  # noqa: ANN001, ANN202
        def timed(pull):  # noqa: ANN001, ANN202
            def run():  # noqa: ANN202
                start = time.monotonic()
                out = pull()
                pulls.append((start, True, sorted(applied)))
                return out
            return submit(run)
        return later(lookups, timed)

    tables.pull_later = timed_later
    if tables.prefetcher is not None:
        tables.prefetcher._pull = timed_prefetch

    def timed_loss(model: nn.Module, batch) -> torch.Tensor:  # noqa: ANN001
        if args.slow_forward and args.index:
            time.sleep(args.slow_forward)  # a slow worker: its pull (and push) come late
        began.append(time.monotonic())
        return click_loss(model, batch)

    digests = []
    tensors: dict[str, torch.Tensor] = {}
    mine = batches(args.index, args.steps)
    for number, batch in enumerate(mine, 1):
        if args.ahead and number < len(mine):
            strategy.ahead(mine[number])
        result = strategy.run_step(timed_loss, batch)
        assert result.global_step == number, (result.global_step, number)
        digests.append(dense_digest(model))
        if number == args.checkpoint_at:
            tensors["owed_at"] = owed.clone()  # this worker's pushes up to the step
            if args.index == 0:  # a checkpoint: the tables as they are at its step
                strategy.state_dict()
                with torch.no_grad():
                    tensors["rows_at"] = model.emb(torch.arange(ROWS).unsqueeze(1)).double().cpu()
        print(f"step {number}", flush=True)
        if args.die_after and number >= args.die_after:
            os._exit(9)  # dies without a word, as a killed process
        if args.stall_after and number >= args.stall_after:
            os.kill(os.getpid(), signal.SIGSTOP)  # stalls, as a suspended process
    strategy.settle()
    strategy.barrier()  # every worker's pushes applied on the ps tasks
    record = {"digests": digests, "began": began, "pushed": pushed, "pulls": pulls,
              "reads_ahead": strategy.reads_ahead,
              "global_step": strategy.global_step, "device": str(strategy.device),
              "backend": strategy._backend}
    tensors["owed"] = owed
    if args.index == 0:
        with torch.no_grad():
            tensors["rows"] = model.emb(torch.arange(ROWS).unsqueeze(1)).double().cpu()
        tensors["start"] = start_rows.double()
    strategy.barrier()  # worker 0 read the rows before anyone leaves
    strategy.shutdown()
    save_file(tensors, str(args.out / f"worker-{args.index}.safetensors"))
    (args.out / f"worker-{args.index}.json").write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
