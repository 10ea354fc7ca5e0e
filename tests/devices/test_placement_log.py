"""The placement log against TensorFlow's: no internal noise, unique names, parameter
initialisation under its module, gradient lines, wrappers unwrapped, one header per
process, and torch.compile'd modules logged as compiled regions."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from test_placement import collect_placement_log
from torch import nn

import towerflow
from towerflow.devices import placer

CPU = "/job:localhost/replica:0/task:0/device:CPU:0"


@pytest.fixture
def placement_log() -> Iterator[list[str]]:
    yield from collect_placement_log()


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 2, 3)
        self.fc = nn.Linear(2, 3)
        nn.init.normal_(self.fc.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.relu(self.conv1(x)).mean((2, 3)))


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    model(torch.ones(1, 1, 4, 4)).sum().backward()
    optimizer.step()


def test_a_training_step_logs_no_internal_noise(placement_log: list[str]) -> None:
    model = ConvNet()
    _train_step(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    noise = [line for line in placement_log
             if "profiler::" in line or "_record_function" in line or "grad_enabled" in line]
    assert noise == []
    assert placement_log


def test_parameter_initialisation_is_named_under_its_module(placement_log: list[str]) -> None:
    model = ConvNet()
    model(torch.ones(1, 1, 4, 4))
    init = placement_log[:placement_log.index(f"ones: (aten::ones): {CPU}")]
    assert init == [
        f"conv1/weight: (aten::empty): {CPU}",
        f"conv1/bias: (aten::empty): {CPU}",
        f"conv1/weight/kaiming_uniform_: (aten::uniform_): {CPU}",
        f"conv1/bias/uniform_: (aten::uniform_): {CPU}",
        f"fc/weight: (aten::empty): {CPU}",
        f"fc/bias: (aten::empty): {CPU}",
        f"fc/weight/kaiming_uniform_: (aten::uniform_): {CPU}",
        f"fc/bias/uniform_: (aten::uniform_): {CPU}",
        f"fc/weight/normal_: (aten::normal_): {CPU}",
    ]


def test_optimizer_updates_are_named_after_the_parameter(placement_log: list[str]) -> None:
    model = ConvNet()
    _train_step(model, torch.optim.SGD(model.parameters(), lr=0.1, foreach=False))
    model(torch.ones(1, 1, 4, 4))  # the next step shows the held update lines
    assert f"conv1/weight/add_: (aten::add_): {CPU}" in placement_log
    assert f"fc/bias/add_: (aten::add_): {CPU}" in placement_log


def test_gradients_are_logged_as_tensorflow_logs_them(placement_log: list[str]) -> None:
    model = ConvNet()
    model(torch.ones(1, 1, 4, 4)).sum().backward()
    assert f"gradients/conv1/conv2d_grad: (aten::convolution_backward): {CPU}" in placement_log
    assert f"gradients/relu_grad: (aten::threshold_backward): {CPU}" in placement_log
    assert f"gradients/fc/linear_grad: (aten::mm): {CPU}" in placement_log
    assert placement_log.index(f"gradients/fc/linear_grad: (aten::mm): {CPU}") < \
        placement_log.index(f"gradients/conv1/conv2d_grad: (aten::convolution_backward): {CPU}")


def test_names_are_unique_within_a_step_and_the_same_every_step(
    placement_log: list[str],
) -> None:
    model = nn.Sequential(nn.ReLU())
    for _ in range(2):
        a = torch.tensor([1.0], requires_grad=True)
        out = model(a)
        b = torch.tensor([2.0])
        torch.add(out, b).sum().backward()
    lines = [line.split(":")[0] for line in placement_log]
    step = ["tensor", "0/relu", "tensor_1", "add", "sum", "gradients/sum_grad",
            "gradients/add_grad", "gradients/0/relu_grad"]
    assert lines == step * 2


def test_names_are_unique_between_two_calls_of_a_model_without_backward(
    placement_log: list[str],
) -> None:
    model = nn.Sequential(nn.ReLU())
    a = torch.tensor([1.0])
    model(a)
    b = torch.tensor([2.0])
    model(b)
    assert [line.split(":")[0] for line in placement_log] == [
        "tensor", "0/relu", "tensor_1", "0/relu"]


def test_a_ddp_wrapper_adds_no_module_prefix(placement_log: list[str], free_ports) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_ports(1)[0]}",
                            rank=0, world_size=1)
    try:
        model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(2, 2)))
        del placement_log[:]
        model(torch.ones(1, 2)).sum().backward()
    finally:
        dist.destroy_process_group()
    assert f"0/linear: (aten::addmm): {CPU}" in placement_log
    assert not [line for line in placement_log if line.startswith("module/")]


def test_the_device_mapping_header_is_written_once_per_process(
    python: str, subprocess_env: dict[str, str],
) -> None:
    code = ("import torch, towerflow\n"
            "for _ in range(3):\n"
            "    with towerflow.configure(log_device_placement=True):\n"
            "        torch.ones(1).sum()\n")
    done = subprocess.run([python, "-c", code], capture_output=True, text=True,
                          env=subprocess_env, timeout=120, check=True)
    assert done.stderr.count("Device mapping:") == 1
    assert done.stderr.count(f"sum: (aten::sum): {CPU}") == 3


def test_a_compiled_module_runs_with_the_log_on_and_is_logged_as_compiled(
    placement_log: list[str],
) -> None:
    # backend "aot_eager": the same dynamo tracing and autograd as inductor, without the
    # C++ compile that makes inductor take ~15 s on this CPU
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(2, 3)
    out = compiled(x)
    out.sum().backward()
    torch.testing.assert_close(out, model(x))
    assert f"compiled: (torch.compile): {CPU}" in placement_log
    assert f"gradients/compiled_grad: (torch.compile): {CPU}" in placement_log
    assert not [line for line in placement_log if "_orig_mod" in line]


@pytest.mark.parametrize("active", ["log", "scope"])
def test_a_compiled_module_does_not_depend_on_the_placers_cache(
    active: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The placer classifies each torch function once and caches its kind (placer._KINDS),
    # a dict that grows as new functions are met, also while compiled code runs. Dynamo
    # traces the placer's __torch_function__: any read of that dict in a traced frame
    # guards the compiled code on its size, a guard that fails (recompiles, or errors as it
    # is built, as on a GPU with torch 2.11) whenever a function is classified. Compiled
    # with nothing classified, called again after the cache grew and after it was emptied,
    # the module must be compiled once, as one graph, and never again.
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    monkeypatch.setattr(placer, "_KINDS", {})  # nothing classified yet
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    x = torch.randn(2, 3)
    expected = model(x)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter)
    scope = towerflow.device("/cpu:0") if active == "scope" else None
    lines: list[str] = []
    with contextlib.ExitStack() as stack:
        stack.callback(torch._dynamo.reset)
        if scope is not None:
            stack.enter_context(scope)
        else:
            lines = stack.enter_context(contextlib.contextmanager(collect_placement_log)())
        compiled(x).sum().backward()
        torch.cos(x).tanh_()  # more functions classified: the cache grows
        with torch._dynamo.config.patch(error_on_recompile=True):
            out = compiled(x)
            placer._KINDS.clear()
            out_after_clear = compiled(x)
        out_after_clear.sum().backward()
    assert counter.frame_count == 1  # one graph, compiled once
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(out_after_clear, expected)
    if active == "log":
        assert lines.count(f"compiled: (torch.compile): {CPU}") == 3
        assert lines.count(f"gradients/compiled_grad: (torch.compile): {CPU}") == 2
        assert f"cos: (aten::cos): {CPU}" in lines
        assert not [line for line in lines if "_orig_mod" in line]
