"""A wide-and-deep click model whose embedding tables live on the ps tasks, on planted click logs.

The click logs are synthetic with a known truth, so the model's accuracy can
be checked: each example has one bag of ids per categorical field (``--rows``:
the rows of each field's table; the first, the main field, gets ``--bag`` ids
per example, the others one), each id drawn from a Zipf(``--zipf``)
distribution over its field's rows (hot ids spread over the table by a seeded
permutation), and the click is drawn from a logistic model of the ids: a
weight per id (drawn from a seeded generator) summed with a bias chosen so that
about ``--ctr`` of the examples click. No model can beat the truth's own
probabilities, so the example ends by printing the model's AUC on a held-out
set, the truth's AUC on the same set, and the gap. The logs and the AUC are
``towerflow.data.clicks``'s (``ClickLogs``, ``auc``), as ``towerflow train
click`` uses them for its one-table model.

The model (``WideAndDeep``) is wide and deep: a wide part, a sparse linear
term per feature id (one dim-1 table over every field's ids, trained with
FTRL-Proximal as ``tf.train.FtrlOptimizer``), and a deep part, a ``sum``
embedding bag per field (trained with row-wise Adagrad, the counterpart of the
dense optimizer) concatenated into an MLP (Adagrad on the ps). Each table is a
``towerflow.ps.ShardedEmbedding``: its rows are sharded over the ps tasks by
``id % num_ps`` and a worker pulls and pushes only the rows of its batch, so
``--rows 1000000,...`` trains with workers that never hold a table. Every
optimizer takes ``--lr`` (one rate per step for the dense part and all the
tables) and starts its accumulator at ``--initial_accumulator``: 1e-4, as
TensorFlow's default of 0.1 would dwarf the small gradients of the rare ids
(a mean loss over 512 examples) and stall them. With the defaults (2,000
steps of 512 examples) the model ends about 0.01 AUC below the truth.

2 ps tasks and 2 workers at once (each gets its role through TF_CONFIG)::

    towerflow launch --ps 2 --workers 2 -- python examples/click_model.py

A larger vocabulary (a 1M-row main field) takes more steps to learn its rarer ids::

    towerflow launch --ps 2 --workers 2 -- python examples/click_model.py \\
        --rows 1000000,10000,1000,100 --steps 20000

Or one terminal per role (ports 2222-2225 of localhost; ``--ps_hosts`` and
``--worker_hosts`` to choose)::

    python examples/click_model.py --job_name ps --task_index 0
    python examples/click_model.py --job_name ps --task_index 1
    python examples/click_model.py --job_name worker --task_index 0
    python examples/click_model.py --job_name worker --task_index 1

With no cluster (no TF_CONFIG, no ``--job_name``) it trains in this process
alone: the same model with ``nn.EmbeddingBag(sparse=True)`` tables and
Adagrad throughout (FTRL is the ps tasks' row-wise optimizer)::

    python examples/click_model.py

Worker 0 is the chief: it initialises the ps tasks, writes checkpoints and
summaries to ``log/click_model`` under the current directory (``--logdir`` to
choose) and evaluates at the end.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

import towerflow
from towerflow.cluster import TaskInfo, resolve_cluster
from towerflow.data.clicks import HELD_OUT_SEED, Batch, ClickLogs, auc
from towerflow.strategies import OptimizerConfig

TableFactory = Callable[[int, int, str], nn.Module]


# -- the model -------------------------------------------------------------------------------
class WideAndDeep(nn.Module):
    """A sparse linear term per id (wide) plus per-field embedding bags into an MLP (deep).

    Args:
        rows: rows of each field's table.
        dim: values per deep embedding row.
        hidden: width of the MLP's two hidden layers.
        table: ``table(num_rows, dim, role)`` builds a sum-bag table; ``role``
            is ``"wide"`` (the dim-1 table over all fields' ids) or ``"deep"``.
    """

    def __init__(self, rows: Sequence[int], dim: int, hidden: int, table: TableFactory) -> None:
        super().__init__()
        offsets = torch.tensor([0, *rows[:-1]]).cumsum(0)
        self.register_buffer("offsets", offsets, persistent=False)
        self.wide = table(sum(rows), 1, "wide")
        self.deep = nn.ModuleList(table(n, dim, "deep") for n in rows)
        self.mlp = nn.Sequential(nn.Linear(len(rows) * dim, hidden), nn.ReLU(),
                                 nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, fields: list[torch.Tensor]) -> torch.Tensor:
        """The click log-odds of each example (``fields``: one ``(batch, ids)`` per field)."""
        wide_ids = torch.cat([ids + off for ids, off in zip(fields, self.offsets, strict=True)], 1)
        deep = torch.cat([emb(ids) for emb, ids in zip(self.deep, fields, strict=True)], 1)
        return (self.wide(wide_ids) + self.mlp(deep)).squeeze(1)


def click_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    fields, clicks = batch
    return nn.functional.binary_cross_entropy_with_logits(model(fields), clicks)


def sharded_tables(initial_accumulator: float) -> TableFactory:
    """Tables on the ps tasks: FTRL from zero for the wide part, row-wise Adagrad deep.

    A table with no optimizer of its own (the deep ones) takes the row-wise
    counterpart of the dense optimizer, with its accumulator start.
    """
    from towerflow.ps.spec import SparseFtrl
    from towerflow.ps.worker.tables.embedding import ShardedEmbedding

    def table(num_rows: int, dim: int, role: str) -> nn.Module:
        if role == "wide":
            ftrl = SparseFtrl(initial_accumulator_value=initial_accumulator)
            return ShardedEmbedding(num_rows, dim, mode="sum", optimizer=ftrl,
                                    initializer={"kind": "constant", "value": 0.0})
        return ShardedEmbedding(num_rows, dim, mode="sum")

    return table


def local_table(num_rows: int, dim: int, role: str) -> nn.Module:
    """A table in this process (sparse gradients), started as the ps tables are."""
    table = nn.EmbeddingBag(num_rows, dim, mode="sum", sparse=True)
    with torch.no_grad():
        if role == "wide":
            table.weight.zero_()
        else:
            table.weight.uniform_(-0.05, 0.05)
    return table


def describe_tables(model: nn.Module) -> None:
    """Print each table: where its rows live and the optimizer that updates them."""
    for path, module in model.named_modules():
        if isinstance(module, nn.EmbeddingBag):
            print(f"table {path}: {module.num_embeddings} x {module.embedding_dim} in this "
                  "process, sparse gradients", flush=True)
        elif getattr(module, "config", None) is not None:  # a ShardedEmbedding, bound
            config = module.config
            print(f"table {path}: {module.num_rows} x {module.dim} sharded over "
                  f"{config.partitioner.num_shards} ps tasks ({config.partitioner.kind}), "
                  f"row-wise {config.optimizer['name']}", flush=True)


@torch.no_grad()
def held_out_auc(model: nn.Module, fields: list[torch.Tensor], clicks: torch.Tensor,
                 batch_size: int = 8192) -> float:
    """The model's AUC on the held-out examples."""
    model.eval()
    scores = torch.cat([model([f[i:i + batch_size] for f in fields])
                        for i in range(0, len(clicks), batch_size)])
    model.train()
    return auc(scores, clicks)


# -- training --------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job_name", default=None, help="ps or worker (default: from TF_CONFIG)")
    parser.add_argument("--task_index", type=int, default=0)
    parser.add_argument("--ps_hosts", default="localhost:2222,localhost:2223")
    parser.add_argument("--worker_hosts", default="localhost:2224,localhost:2225")
    parser.add_argument("--logdir", default="log/click_model",
                        help="the chief's checkpoints and summaries (default: under this directory)")
    parser.add_argument("--steps", type=int, default=2000, help="stop at this global step")
    parser.add_argument("--batch_size", type=int, default=512)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--initial_accumulator", type=float, default=1e-4,
                        help="Adagrad's and FTRL's accumulator start (TensorFlow's default "
                             "0.1 stalls the rare ids, whose gradients are small)")
    parser.add_argument("--mode", default="async", choices=("async", "sync", "ssp"))
    parser.add_argument("--rows", default="20000,2000,500,100",
                        help="rows of each field's table, comma-separated (the first: main field)")
    parser.add_argument("--bag", type=int, default=4, help="ids of the main field per example")
    parser.add_argument("--dim", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--zipf", type=float, default=1.2)
    parser.add_argument("--ctr", type=float, default=0.15, help="the planted click rate")
    parser.add_argument("--weight_std", type=float, default=0.5)
    parser.add_argument("--eval_examples", type=int, default=50000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.rows = [int(n) for n in args.rows.split(",")]
    return args


def fit(sv: towerflow.Supervisor, sess, stream: Iterator[Batch], steps: int) -> int:  # noqa: ANN001
    """Train until the global step reaches ``steps`` (or a stop); return the local steps."""
    local_steps, losses = 0, []
    while not sv.should_stop() and sess.global_step < steps:
        result = sess.run_step(click_loss, next(stream))
        local_steps += 1
        losses.append(float(result.loss))
        if local_steps % 200 == 0:
            mean = sum(losses) / len(losses)
            sv.summary_computed(sess, {"loss": mean}, global_step=result.global_step)
            print(f"step {result.global_step}, loss = {mean:.4f}", flush=True)
            losses = []
    return local_steps


def train(args: argparse.Namespace, server: towerflow.Server | None, task: TaskInfo) -> None:
    """A worker (or the one local process): train, then the chief compares with the truth."""
    torch.manual_seed(args.seed)
    logs = ClickLogs(args.rows, bag=args.bag, zipf=args.zipf, ctr=args.ctr,
                     weight_std=args.weight_std, seed=args.seed)
    model = WideAndDeep(args.rows, args.dim, args.hidden,
                        local_table if server is None else sharded_tables(args.initial_accumulator))
    is_chief = task.task_index == 0
    options = {} if server is None else {"mode": args.mode}  # ps options for a cluster only
    sv = towerflow.Supervisor(is_chief=is_chief, logdir=args.logdir, save_model_secs=30,
                              max_to_keep=1, **options)
    with sv.managed_session(server, model=model,
                            optimizer=OptimizerConfig("adagrad", lr=args.lr,
                                                      initial_accumulator_value=args.initial_accumulator)
                            ) as sess:
        print(f"sess ok; starting at global step {sess.global_step}", flush=True)
        if is_chief:
            describe_tables(sess.model)
        stream = logs.stream(args.batch_size, seed=1000 * (args.seed + 1) + task.task_index)
        local_steps = fit(sv, sess, stream, args.steps)
        print(f"finished: {local_steps} local steps, global step {sess.global_step}", flush=True)
        if is_chief:
            fields, clicks = logs.sample(args.eval_examples, torch.Generator().manual_seed(HELD_OUT_SEED + args.seed))
            model_auc = held_out_auc(sess.model, fields, clicks)
            truth_auc = auc(logs.logits(fields), clicks)
            print(f"held-out click rate {clicks.mean().item():.3f}: model AUC {model_auc:.4f}, "
                  f"truth AUC {truth_auc:.4f}, gap {truth_auc - model_auc:.4f}", flush=True)
    sv.stop()


def main() -> None:
    args = parse_args()
    cluster, task = resolve_cluster()  # TF_CONFIG when started by `towerflow launch`
    if args.job_name is not None:
        cluster = towerflow.ClusterSpec({"ps": args.ps_hosts.split(","),
                                         "worker": args.worker_hosts.split(",")})
        task = TaskInfo(args.job_name, args.task_index)
    if cluster is None:
        train(args, None, TaskInfo("worker", 0))  # no cluster: this process alone
        return
    server = towerflow.Server(cluster, job_name=task.job_name, task_index=task.task_index)
    if task.job_name == "ps":
        server.join()  # the ps holds the tables' rows and the dense parameters until done
    else:
        train(args, server, task)
    server.stop()


if __name__ == "__main__":
    main()
