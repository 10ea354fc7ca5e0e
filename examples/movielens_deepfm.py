"""DeepFM on MovieLens, as GroupLens publishes it: will a user rate a movie 4 stars or more?

The model is written the plain PyTorch way: one ``nn.Embedding(sparse=True)``
per field (user, movie, age group, gender, occupation, zip prefix, genres),
a factorization machine's pairwise term and an MLP, binary cross entropy
(``towerflow.models.deepfm``). The data is read from the publisher's files
(``towerflow.data.movielens``; ``--data-dir`` holds ``ml-100k/`` or gets the
archive from GroupLens, its MD5 checked); the latest 20% of the ratings are
the test split, on which the chief prints scikit-learn's AUC and logloss.

One process (the CPU, or the first GPU)::

    python examples/movielens_deepfm.py --data-dir data --train-dir runs/deepfm

2 ps tasks and 2 workers on one machine (each task gets its role through
TF_CONFIG; the ps tasks hold the parameters, embeddings included, and apply
Adagrad; worker 0 is the chief)::

    towerflow launch --ps 2 --workers 2 -- \\
        python examples/movielens_deepfm.py --data-dir data --train-dir runs/deepfm-ps

Under Slurm, one task per node (task 0 the ps, the others workers; the data
and the train dir on a shared file system; see docs/slurm.md for the secret
and TLS every task needs across machines)::

    #SBATCH --nodes=3 --ntasks=3
    export TOWERFLOW_NUM_PS=1 TOWERFLOW_PORT=2222
    srun --kill-on-bad-exit=1 python examples/movielens_deepfm.py \\
        --data-dir /shared/data --train-dir /shared/runs/deepfm

Running the same command again resumes from the latest checkpoint in
``--train-dir``. ``towerflow train movielens`` is the same model as a
built-in task (``towerflow eval`` then prints the AUC and logloss).
"""

from __future__ import annotations

import argparse
import sys

import torch
from sklearn.metrics import log_loss, roc_auc_score

import towerflow
from towerflow.cluster import resolve_cluster
from towerflow.data.movielens import load_movielens
from towerflow.data.recsys import FieldBatches, FieldData
from towerflow.models.deepfm import DeepFM, deepfm_loss
from towerflow.strategies import OptimizerConfig
from towerflow.training import TrainConfig, default_strategy


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default="data", help="holds ml-100k/ (fetched if absent)")
    parser.add_argument("--variant", default="ml-100k",
                        choices=("ml-100k", "ml-1m", "ml-20m", "ml-25m"))
    parser.add_argument("--train-dir", default="runs/deepfm")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--dim", type=int, default=16, help="values per embedding row")
    parser.add_argument("--lr", type=float, default=0.05)
    return parser.parse_args(argv)


@torch.no_grad()
def evaluate(model: torch.nn.Module, test: FieldData, batch_size: int = 4096) -> str:
    """AUC and logloss of the predicted probabilities on the test split."""
    model.eval()
    device = next(model.parameters()).device
    probs = []
    for start in range(0, len(test), batch_size):
        fields, dense, _ = test.batch(slice(start, start + batch_size))
        probs.append(torch.sigmoid(model([f.to(device) for f in fields], dense.to(device))))
    p = torch.cat(probs).double().cpu().numpy()
    labels = test.labels.numpy()
    return f"AUC = {roc_auc_score(labels, p):.4f}, logloss = {log_loss(labels, p):.4f}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cluster, task = resolve_cluster()  # TF_CONFIG (towerflow launch), Slurm, or none
    if cluster is not None and task.job_name == "ps":
        from towerflow.training.ps_train import serve_task

        return serve_task(cluster, task)  # serves its shard until the workers are done
    strategy = default_strategy()  # ParameterServer with a ps job, else one device
    train = load_movielens(args.data_dir, "train", variant=args.variant, download=True)
    model = DeepFM(train.rows, args.dim, hidden=(128, 64))  # nn.Embedding(sparse=True) per field
    batches = FieldBatches(train, batch_size=args.batch_size, seed=0, rank=strategy.rank,
                           world_size=strategy.world_size)
    config = TrainConfig(train_dir=args.train_dir, max_steps=args.steps,
                         batch_size=args.batch_size, log_every=100)
    optimizer = OptimizerConfig("adagrad", lr=args.lr, initial_accumulator_value=1e-4)
    with towerflow.Trainer(model, deepfm_loss, batches, strategy=strategy, optimizer=optimizer,
                           config=config) as trainer:
        trainer.fit()
        if strategy.is_chief:
            test = load_movielens(args.data_dir, "test", variant=args.variant)
            print(f"step {trainer.global_step}: {evaluate(model, test)}", flush=True)
    strategy.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
