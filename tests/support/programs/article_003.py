"""Article 003's program as a TensorFlow reader writes it, one task per process.

    python article_003.py PORTS JOB INDEX LOGDIR MANUALDIR STEPS {scope|argument}

PORTS is ``ps,worker0,worker1``. The chief saves every 5 s to LOGDIR, and by
hand to MANUALDIR at the end (``sv.save(sess, directory=...)``). The last
argument says how the setter is given: as a device scope around the model's
creation (``with towerflow.device(setter):``) or as ``device_setter=``.
"""

import sys

import torch

import towerflow
from towerflow.models.linear import LinearRegression, mse_loss, regression_data
from towerflow.strategies import OptimizerConfig

ports, job_name, task_index = sys.argv[1].split(","), sys.argv[2], int(sys.argv[3])
logdir, manual_dir, steps, how = sys.argv[4], sys.argv[5], int(sys.argv[6]), sys.argv[7]
cluster = towerflow.ClusterSpec({"ps": [f"localhost:{ports[0]}"],
                                 "worker": [f"localhost:{p}" for p in ports[1:]]})
server = towerflow.Server(cluster, job_name=job_name, task_index=task_index)
if job_name == "ps":
    server.join()
    sys.exit(0)

setter = towerflow.replica_device_setter(worker_device=f"/job:worker/task:{task_index}",
                                         cluster=cluster)
if how == "scope":
    with towerflow.device(setter):
        model = LinearRegression(torch.Generator().manual_seed(task_index))
    options = {}
else:
    model = LinearRegression(torch.Generator().manual_seed(task_index))
    options = {"device_setter": setter}
train_x, train_y = regression_data(100, noise=0.0)
global_step = torch.zeros((), dtype=torch.int64)
sv = towerflow.Supervisor(is_chief=(task_index == 0), logdir=logdir, summary_op=None,
                          global_step=global_step, save_model_secs=5, max_to_keep=1, **options)
seen = []
with sv.managed_session(server.target, model=model,
                        optimizer=OptimizerConfig("sgd", lr=0.05)) as sess:
    print(f"sess ok {int(global_step)} {type(sess.strategy).__name__}", flush=True)
    while not sv.should_stop() and int(global_step) < steps:
        result = sess.run_step(mse_loss, (train_x, train_y))
        seen.append(result.global_step)
        sv.summary_computed(sess, {"loss_function": result.loss}, global_step=result.global_step)
        if len(seen) % 50 == 0:
            print(f"step {result.global_step}", flush=True)
    print("seen " + ",".join(map(str, seen)), flush=True)
    print(f"finished W={model.weight.item():.4f} b={model.bias.item():.4f}", flush=True)
    sv.save(sess, directory=manual_dir)
sv.stop()
server.stop()
