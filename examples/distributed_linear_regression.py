"""Article 003: distributed linear regression with 1 ps and 2 workers on one machine.

Every task starts a ``towerflow.Server``. The ps holds the parameters and
only serves (``server.join()``); worker 0 is the chief: it initialises the
parameters (or restores them from the latest checkpoint in --logdir: stop the
run half way and start it again), saves a checkpoint every 5 seconds and
writes summaries; worker 1 only computes. Training is asynchronous, so the
global steps a worker sees are not consecutive.

All three tasks at once (each gets its role through TF_CONFIG)::

    towerflow launch --ps 1 --workers 2 -- python examples/distributed_linear_regression.py

Or one terminal per role, with the article's fixed ports 1681-1683::

    python examples/distributed_linear_regression.py --job_name ps --task_index 0
    python examples/distributed_linear_regression.py --job_name worker --task_index 0
    python examples/distributed_linear_regression.py --job_name worker --task_index 1

Checkpoints and summaries go to ``log/linear_regression`` under the current
directory (``--logdir`` to choose). TensorBoard: ``tensorboard --logdir log/linear_regression``.
"""

import argparse

import torch

import towerflow
from towerflow.cluster import TaskInfo, resolve_cluster
from towerflow.models.linear import LinearRegression, mse_loss, regression_data
from towerflow.strategies import OptimizerConfig

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--job_name", default=None, help="ps or worker (default: from TF_CONFIG)")
parser.add_argument("--task_index", type=int, default=0)
parser.add_argument("--logdir", default="log/linear_regression",
                    help="the chief's checkpoints and summaries (default: under this directory)")
parser.add_argument("--steps", type=int, default=2000, help="stop at this global step")
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--noise", type=float, default=0.3)
parser.add_argument("--mode", default="async", choices=("async", "sync", "ssp"))
args = parser.parse_args()


def fit(sv: towerflow.Supervisor, sess, model: LinearRegression, data) -> int:  # noqa: ANN001
    """Train until the global step reaches --steps (or a stop); return the local steps."""
    local_steps = 0
    while not sv.should_stop() and int(sv.global_step_tensor) < args.steps:
        result = sess.run_step(mse_loss, data)
        local_steps += 1
        sv.summary_computed(sess, {"loss_function": result.loss}, global_step=result.global_step)
        if local_steps % 100 == 0:
            print(f"step {result.global_step}, loss = {float(result.loss):.4f}, "
                  f"W = {model.weight.item():.4f}, b = {model.bias.item():.4f}", flush=True)
    return local_steps


def train(server: towerflow.Server, task: TaskInfo) -> None:
    """A worker: variables on the ps (by the setter), computation here; worker 0 is the chief."""
    setter = towerflow.replica_device_setter(worker_device=f"/job:worker/task:{task.task_index}",
                                             cluster=server.cluster)
    train_x, train_y = regression_data(100, noise=args.noise)
    model = LinearRegression()  # weight ~ N(0, 1), bias 0; placed on the ps by the setter
    global_step = torch.zeros((), dtype=torch.int64)
    sv = towerflow.Supervisor(is_chief=(task.task_index == 0), logdir=args.logdir,
                              save_model_secs=5, max_to_keep=1, global_step=global_step,
                              mode=args.mode, device_setter=setter)
    with sv.managed_session(server, model=model,
                            optimizer=OptimizerConfig("sgd", lr=args.lr)) as sess:
        print(f"sess ok; starting at global step {int(global_step)}", flush=True)
        if int(global_step) >= args.steps:
            print(f"{args.logdir} already holds global step {int(global_step)} >= --steps "
                  f"{args.steps}: nothing to train (raise --steps or use another --logdir)",
                  flush=True)
        else:
            local_steps = fit(sv, sess, model, (train_x, train_y))
            print(f"finished: {local_steps} local steps, global step {int(global_step)}, "
                  f"W = {model.weight.item():.4f}, b = {model.bias.item():.4f}", flush=True)
        if sv.is_chief:
            sv.save(sess)  # a manual save still works next to the automatic ones
    sv.stop()


cluster, task = resolve_cluster()  # TF_CONFIG when started by `towerflow launch`
if cluster is None or args.job_name is not None:
    cluster = towerflow.ClusterSpec({"ps": ["localhost:1681"],
                                     "worker": ["localhost:1682", "localhost:1683"]})
    task = TaskInfo(args.job_name or "worker", args.task_index)
server = towerflow.Server(cluster, job_name=task.job_name, task_index=task.task_index)
if task.job_name == "ps":
    server.join()  # the ps serves the parameters until stopped; it computes nothing
elif task.job_name == "worker":
    train(server, task)
server.stop()
