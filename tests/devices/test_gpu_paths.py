"""The GPU paths end to end on a real CUDA device (every test here skips without one).

Placement of a real PyTorch operation that has no CUDA kernel, the memory cap
at half of the GPU, ``CUDA_VISIBLE_DEVICES`` in a fresh process, a ps worker
computing on the GPU against variables and tables on CPU ps tasks (article
001's topology), and the command line on one GPU: ``--num-gpus 1``, with a
ps task, and the mirrored strategy over NCCL under torchrun.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator

import pytest
import torch
from test_placement import collect_placement_log
from test_ps_worker_model import SECRET, _Click, _loss
from torch import nn

import towerflow
from towerflow import PlacementError, configure, device
from towerflow.cluster import TaskInfo
from towerflow.ps import ShardedEmbedding
from towerflow.strategies import OptimizerConfig
from towerflow.strategies.parameter_server import ParameterServer

pytestmark = pytest.mark.gpu


CUDA0 = torch.device("cuda", 0)
#: an operation PyTorch implements on the CPU only (torch.histogram; CUDA has torch.histc)
CPU_ONLY_OP = "aten::histogram.bins_tensor"


@pytest.fixture
def placement_log() -> Iterator[list[str]]:
    yield from collect_placement_log()


def test_a_torch_op_with_no_cuda_kernel_is_refused_on_the_gpu_unless_soft(
        placement_log: list[str]) -> None:
    assert not torch._C._dispatch_has_kernel_for_dispatch_key(CPU_ONLY_OP, "CUDA"), (
        f"this PyTorch has a CUDA kernel for {CPU_ONLY_OP}: pick another CPU-only op")
    values = torch.linspace(0, 1, 100)
    edges = torch.linspace(0, 1, 5)
    with device("/gpu:0"):
        with pytest.raises(PlacementError, match=r"Cannot assign a device for operation "
                                                 r"'histogram.*'/device:GPU:0'.*no supported "
                                                 r"kernel for GPU devices.*allow_soft_placement"):
            torch.histogram(values, edges)
        with configure(allow_soft_placement=True):
            hist, _ = torch.histogram(values, edges)
    assert hist.device == torch.device("cpu") and hist.sum().item() == 100
    assert any(re.search(r"histogram.*device:CPU:0 \(soft placement: no GPU kernel\)$", line)
               for line in placement_log), placement_log


def test_half_the_memory_stops_an_allocation_past_half() -> None:
    total = torch.cuda.get_device_properties(0).total_memory
    with configure(gpu_memory_fraction=0.5):
        assert towerflow.list_local_devices()[1].memory_limit == total // 2
        with pytest.raises(torch.OutOfMemoryError, match=r"out of memory"):
            torch.empty(int(total * 0.55), dtype=torch.uint8, device=CUDA0)
        kept = torch.empty(int(total * 0.45), dtype=torch.uint8, device=CUDA0)
        assert kept.numel() == int(total * 0.45)
        del kept
    torch.cuda.empty_cache()


@pytest.mark.parametrize("visible, expected", [("", ["/device:CPU:0"]),
                                               ("0", ["/device:CPU:0", "/device:GPU:0"]),
                                               ("-1", ["/device:CPU:0"])])
def test_cuda_visible_devices_decides_what_a_process_lists(python, subprocess_env, visible,
                                                           expected) -> None:
    env = dict(subprocess_env, CUDA_VISIBLE_DEVICES=visible)
    proc = subprocess.run([python, "-m", "towerflow", "devices", "--json"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert [d["name"] for d in json.loads(proc.stdout)] == expected


@pytest.fixture
def ps_servers(start_ps_tasks):
    """Two ps tasks (dense and table services) in this process, serving after Done."""
    return start_ps_tasks(SECRET)


def test_a_gpu_worker_trains_dense_variables_and_table_rows_held_on_cpu_ps_tasks(
        ps_servers) -> None:
    torch.manual_seed(0)
    local = _Click(nn.EmbeddingBag(50, 4, mode="sum")).to(CUDA0)
    model = _Click(nn.EmbeddingBag(50, 4, mode="sum", sparse=True))
    model.load_state_dict({k: v.cpu() for k, v in local.state_dict().items()})
    strategy = ParameterServer(ps_servers, TaskInfo("worker", 0), credentials=SECRET,
                               device="cuda:0", server=False, sparse_threshold_bytes=100)
    optimizer = torch.optim.SGD(local.parameters(), lr=0.5)
    try:
        strategy.prepare(model, OptimizerConfig("sgd", lr=0.5))
        assert isinstance(model.emb, ShardedEmbedding)  # rows on the ps tasks
        assert model.hidden.weight.device == CUDA0
        assert strategy.global_step == 0  # the chief has created the tables
        with torch.no_grad():  # the local copy starts from the table's rows
            local.emb.weight.copy_(model.emb.client.pull(model.emb.config, torch.arange(50)))
        for step in range(3):
            ids = torch.randint(0, 50, (16, 5), device=CUDA0)
            labels = torch.randint(0, 2, (16,), device=CUDA0).float()
            with torch.no_grad():
                assert model(ids).device == CUDA0
            result = strategy.run_step(_loss, (ids, labels))
            assert result.global_step == step + 1
            optimizer.zero_grad()
            _loss(local, (ids, labels)).backward()
            optimizer.step()
        rows = model.emb.client.pull(model.emb.config, torch.arange(50))
        assert rows.device == torch.device("cpu")  # the table never left the ps tasks
        torch.testing.assert_close(rows, local.emb.weight.detach().cpu(), rtol=1e-5, atol=1e-6)
        # the last step's dense push rides with the next table pull: settled here
        strategy.settle()
        torch.testing.assert_close(model.out.weight, local.out.weight, rtol=1e-5, atol=1e-6)
    finally:
        strategy.shutdown()


def test_a_gpu_worker_fed_pinned_cpu_batches_copies_them_once_and_reads_ids_on_the_host(
        ps_servers) -> None:
    from test_ps_worker_model import _IdsBack
    from test_transfer import _Copies

    from towerflow.devices import move_to_device

    pinned = torch.arange(6).pin_memory()
    with _Copies() as copies:
        moved = move_to_device({"ids": pinned, "dense": torch.ones(2)}, CUDA0)
    assert moved["ids"].device == CUDA0 and moved["ids"].dtype == torch.int64
    assert [(src.type, non_blocking) for src, _, non_blocking in copies.calls] == [("cpu", True),
                                                                           ("cpu", False)]
    assert move_to_device(moved, CUDA0) is moved  # already there: no copy
    torch.manual_seed(0)
    model = _Click(nn.EmbeddingBag(50, 4, mode="sum", sparse=True))
    strategy = ParameterServer(ps_servers, TaskInfo("worker", 0), credentials=SECRET,
                               server=False, sparse_threshold_bytes=100)  # GPU first
    try:
        strategy.prepare(model, OptimizerConfig("sgd", lr=0.5))
        assert strategy.device.type == "cuda" and model.hidden.weight.device.type == "cuda"
        ids_back = _IdsBack()
        for step in range(3):
            batch = (torch.randint(0, 50, (16, 5)).pin_memory(), torch.ones(16))
            with ids_back:
                assert strategy.run_step(_loss, batch).global_step == step + 1
        assert ids_back.copies == []
        with torch.no_grad():  # the program's own call with CPU inputs: moved too
            assert model(torch.randint(0, 50, (4, 5))).device.type == "cuda"
    finally:
        strategy.shutdown()


def _train(python: str, env: dict[str, str], *argv: str, timeout: float = 300) -> str:
    proc = subprocess.run([python, *argv], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _cifar10(tmp_path, *flags: str) -> list[str]:
    return ["train", "cifar10", "--data", "synthetic", "--synthetic-examples", "512",
            "--train-dir", str(tmp_path / "run"), "--max-steps", "20", "--batch-size", "32",
            "--log-every", "10", "--summary-every", "0", "--no-progress", *flags]


@pytest.mark.slow
@pytest.mark.parametrize("flags", [["--num-gpus", "1"], ["--num-gpus", "1", "--ps", "1"]],
                         ids=["one-gpu", "gpu-worker-cpu-ps"])
def test_cifar10_trains_on_one_gpu_and_evaluates(tmp_path, python, subprocess_env,
                                                 flags) -> None:
    out = _train(python, subprocess_env, "-m", "towerflow", *_cifar10(tmp_path, *flags))
    assert re.search(r"step 20, loss = [\d.]+ \([\d.]+ examples/sec", out), out[-2000:]
    evaluated = _train(python, subprocess_env, "-m", "towerflow", "eval", "cifar10",
                       "--train-dir", str(tmp_path / "run"), "--device", "/gpu:0")
    assert re.search(r"precision @ 1 = [\d.]+", evaluated), evaluated[-2000:]


NCCL_PROGRAM = """
import torch
from torch import nn
from towerflow.strategies import OptimizerConfig
from towerflow.strategies.mirrored import Mirrored

strategy = Mirrored()  # under torchrun: cuda:LOCAL_RANK, and NCCL on a GPU
assert strategy.backend == "nccl" and strategy.device == torch.device("cuda", 0), strategy
model = nn.Linear(4, 1)
strategy.prepare(model, OptimizerConfig("sgd", lr=0.1))
before = model.weight.detach().clone()
x, y = torch.randn(8, 4, device="cuda:0"), torch.randn(8, 1, device="cuda:0")
result = strategy.run_step(lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), (x, y))
assert model.weight.device == torch.device("cuda", 0)
assert not torch.equal(model.weight.detach(), before)
print("trained", repr(strategy), float(result.loss))
strategy.shutdown()
"""


@pytest.mark.slow
def test_mirrored_replica_all_reduces_over_nccl_under_torchrun(tmp_path, python,
                                                               subprocess_env) -> None:
    program = tmp_path / "nccl_step.py"
    program.write_text(NCCL_PROGRAM)
    out = _train(python, subprocess_env, "-m", "torch.distributed.run", "--standalone",
                 "--nproc-per-node", "1", str(program))
    assert re.search(r"trained Mirrored\(rank=0, world_size=1, device='cuda:0', "
                     r"backend='nccl'\) [\d.]+", out), out[-2000:]
