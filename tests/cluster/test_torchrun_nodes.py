"""A real two-node torchrun job on loopback: each "node" is one torchrun with its own train dir.

The nodes share no file system: node 0 (the chief) writes the checkpoints to
its train dir; node 1's train dir holds an older checkpoint of another run,
which is never read. The first run starts fresh on both nodes (the chief has
no checkpoint); when the job runs again, both replicas resume from the
chief's step with the chief's parameters, bit for bit. The addresses of their
tasks come from torchrun's rendezvous store (``TOWERFLOW_HOSTS`` unset).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# One replica: a small digits network trained with momentum by the Trainer under
# the environment's strategy (Mirrored, from torchrun's variables). Each rank starts
# from its own random initialisation, so only DDP and the restore make them equal.
_NODE = r"""
import hashlib, json, os, sys, torch, towerflow
from towerflow.cluster import resolve_cluster
from towerflow.data import Dataset
from towerflow.models import DigitsNet, cross_entropy_loss
from towerflow.strategies.base import OptimizerConfig
from towerflow.training.hooks import Hook

train_dir, max_steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]

def digest(model):
    h = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        h.update(name.encode() + value.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()

class Report(Hook):
    def begin(self, trainer):
        self.start = [trainer.global_step, trainer.restored_from, digest(trainer.model)]

g = torch.Generator().manual_seed(0)
data = Dataset(torch.rand(256, 1, 8, 8, generator=g), torch.randint(0, 10, (256,), generator=g), 10)
torch.manual_seed(100 + int(os.environ["RANK"]))
report = Report()
with towerflow.Trainer(DigitsNet(), cross_entropy_loss, data, train_dir=train_dir,
                       optimizer=OptimizerConfig("momentum", lr=0.05, momentum=0.9),
                       batch_size=16, checkpoint_every=2, summary_every=0, log_every=1000,
                       hooks=[report]) as trainer:
    result = trainer.fit(max_steps)
    spec, task = resolve_cluster()
    facts = {"rank": trainer.strategy.rank, "strategy": type(trainer.strategy).__name__,
             "start": report.start, "step": result.step, "end": digest(trainer.model),
             "cluster": spec.as_dict(), "task": task.device_name}
with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump(facts, f)
"""


def _run_two_nodes(tmp_path: Path, program: Path, dirs: list[Path], max_steps: int, out: Path,
                   ports: list[int], timeout: float = 90.0) -> list[dict]:
    """Both nodes' torchrun (static rendezvous, node ranks 0 and 1); every rank's facts."""
    out.mkdir()
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    for name in ("TF_CONFIG", "TOWERFLOW_HOSTS", "RANK", "WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "SLURM_PROCID"):
        env.pop(name, None)
    procs: list[subprocess.Popen[str]] = []
    try:
        for node in (0, 1):
            command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                       "--nproc-per-node", "1", "--node-rank", str(node), "--master-addr",
                       "127.0.0.1", "--master-port", str(ports[0]), "--local-addr", "127.0.0.1",
                       str(program), str(dirs[node]), str(max_steps), str(out)]
            # one machine plays two: each node's tasks listen on ports of their own
            node_env = dict(env, TOWERFLOW_PORT=str(ports[1 + node]))
            procs.append(subprocess.Popen(command, env=node_env, text=True, cwd=tmp_path,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outputs)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def _older_checkpoint(train_dir: Path) -> None:
    """Another run's checkpoint at step 1, for the same model: what node 1 must not read."""
    import towerflow
    from towerflow.data import Dataset
    from towerflow.models import DigitsNet, cross_entropy_loss
    from towerflow.strategies.single import SingleDevice

    torch.manual_seed(5)
    data = Dataset(torch.rand(64, 1, 8, 8), torch.randint(0, 10, (64,)), 10)
    with towerflow.Trainer(DigitsNet(), cross_entropy_loss, data, strategy=SingleDevice("cpu"),
                           train_dir=train_dir, batch_size=16, summary_every=0,
                           progress=False) as trainer:
        trainer.fit(1)


@pytest.mark.slow
def test_two_torchrun_nodes_resume_from_the_chief_without_a_shared_file_system(
        tmp_path: Path, free_ports) -> None:
    from towerflow.checkpoint import latest_checkpoint

    program = tmp_path / "node.py"
    program.write_text(_NODE)
    dirs = [tmp_path / "node0" / "train", tmp_path / "node1" / "train"]
    _older_checkpoint(dirs[1])  # node 1's disk holds another run; node 0's is empty
    ports = free_ports(3)
    first = _run_two_nodes(tmp_path, program, dirs, 4, tmp_path / "first", ports)
    assert [f["strategy"] for f in first] == ["Mirrored", "Mirrored"]
    # the chief found no checkpoint: every replica started fresh, from the chief's parameters
    assert [f["start"][:2] for f in first] == [[0, None], [0, None]]
    assert first[0]["start"][2] == first[1]["start"][2]
    assert [f["step"] for f in first] == [4, 4] and first[0]["end"] == first[1]["end"]
    # the addresses come from the store: each node's rank on its own TOWERFLOW_PORT
    want = {"worker": [f"127.0.0.1:{ports[1]}", f"127.0.0.1:{ports[2]}"]}
    assert [f["cluster"] for f in first] == [want, want]
    assert latest_checkpoint(dirs[0]).name == "ckpt-00000004"

    again = _run_two_nodes(tmp_path, program, dirs, 6, tmp_path / "again", free_ports(3))
    chief = first[0]["end"]
    assert [f["start"] for f in again] == [[4, 4, chief], [4, 4, chief]]
    assert [f["step"] for f in again] == [6, 6] and again[0]["end"] == again[1]["end"]
    assert latest_checkpoint(dirs[0]).name == "ckpt-00000006"
    # the chief alone writes checkpoints: node 1 still holds only the other run's
    assert latest_checkpoint(dirs[1]).name == "ckpt-00000001"
