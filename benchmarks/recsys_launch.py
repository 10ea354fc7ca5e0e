"""Recommendation models as their authors write them, under plain ``towerflow launch``.

Every cluster run is ``towerflow launch --ps 2 --workers 2 -- python
benchmarks/recsys_launch.py --role task ...`` with no environment set by hand
(``OMP_NUM_THREADS`` removed from the environment: the thread share is
launch's), the model built as its author would and trained under
``ParameterServer(...)`` with its default options (async, Adagrad). Two
workloads:

``click`` (``--workload click``): a 1M x 32 float32 table, batches of 512
examples x 16 ids drawn from Zipf(1.2), sum bags, a linear layer, sigmoid
cross entropy, Adagrad (lr 0.1, initial accumulator 0.1) — the workload of
``sparse_embedding.py`` — written three ways:

- ``sparse``: ``nn.EmbeddingBag(1_000_000, 32, mode="sum", sparse=True)``;
- ``plain``: ``nn.EmbeddingBag(1_000_000, 32, mode="sum")`` (128 MB: above the
  default size of a swapped embedding);
- ``sharded``: ``towerflow.ps.ShardedEmbedding(1_000_000, 32, mode="sum")``;
- ``replicated``: ``sparse`` under ``ParameterServer(replicas=1)`` (each ps task's
  shards with a live copy on the other: the cost of a replica, against ``sparse``);

against the one-process ceiling loop of ``sparse_embedding.py`` (one thread)
and, with ``--tf-python``, TensorFlow 1's ps runtime (``sparse_embedding_tf.py``).

``deepfm`` (``--workload deepfm``): ``towerflow.models.DeepFM`` over 26 fields
with Criteo-like cardinalities (10 to 1,000,000 rows; 52 ``nn.Embedding(...,
sparse=True)`` tables: 26 of 16 values per row and 26 of one) and 13 dense
features, MLP 200-200-200, batches of 512 with Zipf(1.2) ids per field:

- ``default``: the path the defaults choose (the tables' rows on the ps);
- ``dense``: ``sparse_threshold_bytes=None`` (every table shipped whole, as
  dense parameters) — with ``--dense-rows-cap`` the cardinalities are capped
  so that the dense path can run at all;
- ``twotables``: the same model with its fields fused into two tables by hand
  (ids offset per field), what a many-table model must cost about as much as;
- ``rows``: ``whole_table_bytes=None`` (every table's rows on the ps, small ones too);

against the same model in one process with one thread (``torch.optim.Adagrad``
over its sparse and dense gradients).

``movielens`` (``--workload movielens``): the MovieLens-100k-shaped DeepFM of
``towerflow train movielens`` (7 fields: users 944, movies 1,683, age 8, gender 3,
occupation 22, zip 1,001 and a bag of 3 of 23 genres; 14 tables of 16 and of 1
values, 3 to 1,683 rows), batches of 512, Adagrad, written two ways:

- ``sparse``: ``DeepFM(..., sparse=True)`` (its ``nn.Embedding(sparse=True)``);
- ``plain``: ``DeepFM(..., sparse=False)`` (plain ``nn.Embedding``);
- ``rows``: ``sparse=True`` with ``whole_table_bytes=None`` (every table's rows on the
  ps, the path ``sparse=True`` took before small tables travelled whole);
- ``plain-replicated``: ``plain`` under ``ParameterServer(replicas=1)``: every variable
  dense on the ps, each dense shard with a live copy on the other ps task (the cost of a
  replica for a dense model, against ``plain``);

against the plain model in one process with one thread.

Each round runs every variant and the baselines one after the other; the
figures are the medians over rounds. Commands::

    python benchmarks/recsys_launch.py --workload click --tf-python /tmp/tfvenv/bin/python --repeats 3
    python benchmarks/recsys_launch.py --workload deepfm --repeats 3        # default, twotables
    python benchmarks/recsys_launch.py --workload deepfm --variants default,dense --dense-rows-cap 20000
    python benchmarks/recsys_launch.py --workload movielens --variants sparse,plain,rows --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from sparse_embedding import ceiling, labels_of, measure_tensorflow, zipf_batches
from torch import nn

#: Criteo display-advertising's 26 categorical cardinalities, capped to 10 .. 1,000,000
CRITEO_ROWS = [1460, 583, 1_000_000, 1_000_000, 305, 24, 12517, 633, 10, 93145, 5683,
               1_000_000, 3194, 27, 14992, 1_000_000, 10, 5652, 2173, 10, 1_000_000, 18, 15,
               286181, 105, 142572]
DEEPFM_BATCH, DEEPFM_DIM, DENSE = 512, 16, 13


# -- the models, as their authors write them ---------------------------------------------------
def click_model(variant: str, rows: int) -> nn.Module:
    if variant == "sharded":
        from towerflow.ps import ShardedEmbedding

        table: nn.Module = ShardedEmbedding(rows, 32, mode="sum")
    else:
        table = nn.EmbeddingBag(rows, 32, mode="sum", sparse=variant in ("sparse", "replicated"))
    return nn.Sequential(table, nn.Linear(32, 1))


def click_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(model(ids).squeeze(1), labels_of(ids))


def deepfm_rows(cap: int | None) -> list[int]:
    return [min(n, cap) if cap else n for n in CRITEO_ROWS]


def deepfm_batches(rows: list[int], count: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        fields = [torch.from_numpy((rng.zipf(1.2, size=DEEPFM_BATCH) - 1) % n) for n in rows]
        dense = torch.from_numpy(rng.standard_normal((DEEPFM_BATCH, DENSE)).astype(np.float32))
        labels = ((fields[0] + fields[1]) % 2).float()
        out.append((fields, dense, labels))
    return out


def deepfm_model(rows: list[int]) -> nn.Module:
    from towerflow.models.deepfm import DeepFM

    torch.manual_seed(0)
    return DeepFM(rows, DEEPFM_DIM, dense_features=DENSE)


class TwoTableDeepFM(nn.Module):
    """The same DeepFM with its fields fused by hand into two tables (ids offset per field):
    what a user had to write before; the figure a many-table model must match."""

    def __init__(self, rows: list[int]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.register_buffer("offsets", torch.tensor([0, *rows[:-1]]).cumsum(0),
                             persistent=False)
        self.embeddings = nn.Embedding(sum(rows), DEEPFM_DIM, sparse=True)
        self.weights = nn.Embedding(sum(rows), 1, sparse=True)
        for table in (self.embeddings, self.weights):
            nn.init.normal_(table.weight, std=0.01)
        self.bias = nn.Parameter(torch.zeros(1))
        self.dense = nn.Linear(DENSE, 1)
        layers: list[nn.Module] = []
        width = len(rows) * DEEPFM_DIM + DENSE
        for size in (200, 200, 200):
            layers += [nn.Linear(width, size), nn.ReLU()]
            width = size
        self.mlp = nn.Sequential(*layers, nn.Linear(width, 1))

    def forward(self, fields, dense: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ids = torch.stack(list(fields), 1) + self.offsets
        vectors = self.embeddings(ids)
        first = self.weights(ids).sum((1, 2))
        second = 0.5 * (vectors.sum(1).pow(2) - vectors.pow(2).sum(1)).sum(1)
        deep = torch.cat([vectors.flatten(1), dense], 1)
        return self.bias + first + second + self.dense(dense).squeeze(1) + self.mlp(deep).squeeze(1)


#: the MovieLens-100k fields' rows (users, movies, age, gender, occupation, zip, genres)
MOVIELENS_ROWS = [944, 1683, 8, 3, 22, 1001, 23]


def movielens_batches(count: int, seed: int) -> list:
    """Batches of the MovieLens-shaped DeepFM: one id per field, a bag of 3 genres."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        fields = [torch.from_numpy(rng.integers(1, n, size=DEEPFM_BATCH))
                  for n in MOVIELENS_ROWS[:-1]]
        fields.append(torch.from_numpy(rng.integers(1, MOVIELENS_ROWS[-1],
                                                    size=(DEEPFM_BATCH, 3))))
        out.append((fields, None, ((fields[0] + fields[1]) % 2).float()))
    return out


def movielens_model(variant: str) -> nn.Module:
    from towerflow.models.deepfm import DeepFM

    torch.manual_seed(0)
    return DeepFM(MOVIELENS_ROWS, DEEPFM_DIM, sparse=variant == "sparse")


def deepfm_loss(model: nn.Module, batch) -> torch.Tensor:  # noqa: ANN001
    fields, dense, labels = batch
    return F.binary_cross_entropy_with_logits(model(fields, dense), labels)


# -- one task under launch -----------------------------------------------------------------------
def task(args: argparse.Namespace) -> None:
    import towerflow
    from towerflow.cluster import resolve_cluster
    from towerflow.strategies import OptimizerConfig
    from towerflow.strategies.parameter_server import ParameterServer

    cluster, info = resolve_cluster()
    if info.job_name == "ps":
        towerflow.Server(cluster, job_name="ps", task_index=info.task_index).join()
        return
    options = {"dense": {"sparse_threshold_bytes": None},
               "rows": {"whole_table_bytes": None},
               "replicated": {"replicas": 1},
               "plain-replicated": {"replicas": 1}}.get(args.variant, {})
    strategy = ParameterServer(cluster, info, **options)
    if args.workload == "click":
        model = click_model(args.variant, args.rows)
        batches: list = zipf_batches(args.rows, 50, info.task_index)
        loss = click_loss
        examples = 512
    elif args.workload == "movielens":
        model = movielens_model("plain" if args.variant in ("plain", "plain-replicated")
                                else "sparse")
        batches = movielens_batches(20, info.task_index)
        loss, examples = deepfm_loss, DEEPFM_BATCH
    else:
        rows = deepfm_rows(args.dense_rows_cap)
        model = TwoTableDeepFM(rows) if args.variant == "twotables" else deepfm_model(rows)
        batches = deepfm_batches(rows, 20, info.task_index)
        loss = deepfm_loss
        examples = DEEPFM_BATCH
    strategy.prepare(model, OptimizerConfig("adagrad", lr=0.05, initial_accumulator_value=0.1))
    for batch in batches[:3]:
        strategy.run_step(loss, batch)
    steps, start, cpu = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - start < args.seconds:
        strategy.run_step(loss, batches[steps % len(batches)])
        steps += 1
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    tables = strategy._tables
    report = {"examples_per_s": steps * examples / elapsed, "steps": steps,
              "cpu_ms_per_step": 1e3 * cpu / steps, "threads": torch.get_num_threads(),
              "omp": os.environ.get("OMP_NUM_THREADS"),
              "table_requests": None if not tables else
              sum(c for c, _, _ in tables.client.wire.values())}
    strategy.shutdown()
    Path(args.report_dir, f"worker{info.task_index}.json").write_text(json.dumps(report))


def launch(args: argparse.Namespace, variant: str) -> dict:
    """One variant through ``towerflow launch`` (2 ps + 2 workers); the workers' reports."""
    out = Path(tempfile.mkdtemp(prefix="recsys-"))
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    command = [sys.executable, "-m", "towerflow", "launch", "--ps", "2", "--workers", "2",
               "--", sys.executable, __file__, "--role", "task", "--workload", args.workload,
               "--variant", variant, "--seconds", str(args.seconds), "--rows", str(args.rows),
               "--report-dir", str(out)]
    if args.dense_rows_cap:
        command += ["--dense-rows-cap", str(args.dense_rows_cap)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True,
                          timeout=args.seconds * 4 + 900)
    reports = [out / f"worker{i}.json" for i in range(2)]
    if proc.returncode != 0 or not all(r.exists() for r in reports):
        raise SystemExit(f"{variant}: launch failed ({proc.returncode}):\n{proc.stdout[-3000:]}"
                         f"\n{proc.stderr[-3000:]}")
    workers = [json.loads(r.read_text()) for r in reports]
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "thread" in ln.lower()]
    return {"examples_per_s": sum(w["examples_per_s"] for w in workers), "workers": workers,
            "thread_lines": lines[:4]}


def deepfm_ceiling(args: argparse.Namespace) -> float:
    """Examples/s of the same DeepFM in one process, one thread, plain PyTorch."""
    torch.set_num_threads(1)
    if args.workload == "movielens":  # the plain model: the faster one in one process
        model, batches = movielens_model("plain"), movielens_batches(20, 0)
    else:
        rows = deepfm_rows(args.dense_rows_cap)
        model, batches = deepfm_model(rows), deepfm_batches(rows, 20, 0)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.05, initial_accumulator_value=0.1)
    for batch in batches[:3]:
        optimizer.zero_grad()
        deepfm_loss(model, batch).backward()
        optimizer.step()
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        optimizer.zero_grad()
        deepfm_loss(model, batches[steps % len(batches)]).backward()
        optimizer.step()
        steps += 1
    return steps * DEEPFM_BATCH / (time.perf_counter() - start)


def baseline(args: argparse.Namespace) -> float:
    """The one-process, one-thread figure, in a fresh process (this one may hold threads)."""
    proc = subprocess.run([sys.executable, __file__, "--role", "ceiling", "--workload",
                           args.workload, "--seconds", str(args.seconds), "--rows",
                           str(args.rows)] + (["--dense-rows-cap", str(args.dense_rows_cap)]
                                              if args.dense_rows_cap else []),
                          capture_output=True, text=True, timeout=args.seconds * 4 + 600)
    if proc.returncode != 0:
        raise SystemExit(f"ceiling failed:\n{proc.stderr[-3000:]}")
    return float(proc.stdout.strip().splitlines()[-1])


#: variants that are references, not ways a user writes the model (left out of the spread)
_REFERENCES = ("rows", "twotables", "dense", "replicated", "plain-replicated")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=("click", "deepfm", "movielens"), default="click")
    parser.add_argument("--variants", default=None,
                        help="comma-separated (click: sparse,plain,sharded,replicated; deepfm: "
                        "default,twotables,"
                        "dense,rows; movielens: sparse,plain,rows,plain-replicated)")
    parser.add_argument("--rows", type=int, default=1_000_000, help="click: the table's rows")
    parser.add_argument("--dense-rows-cap", type=int, default=0,
                        help="deepfm: cap every field's rows (the dense path ships them all)")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--tf-python", default=None)
    parser.add_argument("--role", default="main")
    parser.add_argument("--variant")
    parser.add_argument("--report-dir")
    args = parser.parse_args()
    if args.role == "task":
        task(args)
        return
    if args.role == "ceiling":
        print(ceiling(args.rows, args.seconds) if args.workload == "click"
              else deepfm_ceiling(args))
        return
    variants = (args.variants or {"click": "sparse,plain,sharded", "movielens": "sparse,plain"}
                .get(args.workload, "default,twotables")).split(",")
    figures: dict[str, list[float]] = {v: [] for v in [*variants, "one process", "tensorflow"]}
    threads: dict[str, set] = {v: set() for v in variants}
    for index in range(args.repeats):
        line = []
        for variant in variants:
            result = launch(args, variant)
            figures[variant].append(result["examples_per_s"])
            threads[variant] |= {(w["threads"], w["omp"]) for w in result["workers"]}
            line.append(f"{variant} {result['examples_per_s']:,.0f}")
            if index == 0:
                print(f"  {variant}: {result['thread_lines'][:2]}; table requests per step "
                      f"{[round(w['table_requests'] / max(w['steps'] + 3, 1), 1) if w['table_requests'] else None for w in result['workers']]}; "
                      f"worker CPU ms/step {[round(w['cpu_ms_per_step'], 2) for w in result['workers']]}",
                      flush=True)
        figures["one process"].append(baseline(args))
        line.append(f"one process {figures['one process'][-1]:,.0f}")
        if args.tf_python and args.workload == "click":
            figures["tensorflow"].append(
                measure_tensorflow(args.tf_python, args.rows, args.seconds)["examples_per_s"])
            line.append(f"TensorFlow {figures['tensorflow'][-1]:,.0f}")
        print(f"round {index + 1}: " + ", ".join(line) + " examples/s", flush=True)
    medians = {k: statistics.median(v) for k, v in figures.items() if v}
    base = medians["one process"]
    print(f"medians of {args.repeats} round(s), {args.workload}, 2 ps + 2 workers under "
          "towerflow launch (no environment set):")
    for variant in variants:
        rel = f"{medians[variant] / base:.2f}x one process"
        if "tensorflow" in medians:
            rel += f", {medians[variant] / medians['tensorflow']:.2f}x TensorFlow"
        print(f"  {variant}: {medians[variant]:,.0f} examples/s ({rel}); threads per worker "
              f"{sorted(threads[variant])} (torch threads, OMP_NUM_THREADS)")
    print(f"  one process, one thread: {base:,.0f} examples/s")
    if "tensorflow" in medians:
        print(f"  TensorFlow 1 ps runtime: {medians['tensorflow']:,.0f} examples/s")
    idioms = [v for v in variants if v not in _REFERENCES]  # the ways a user writes the model
    if len(idioms) > 1:
        spread = max(medians[v] for v in idioms) / min(medians[v] for v in idioms)
        print(f"  fastest / slowest of {', '.join(idioms)}: {spread:.2f} (target <= 1.10)")


if __name__ == "__main__":
    main()
