"""Placement scopes, the placer mode, the placement log and soft placement."""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import _get_current_function_mode_stack

import towerflow
from towerflow.devices import configure, current_scope, device, resolve_device
from towerflow.errors import InvalidArgumentError, PlacementError

CPU = "/job:localhost/replica:0/task:0/device:CPU:0"
GPU0 = "/job:localhost/replica:0/task:0/device:GPU:0"


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def placement_log() -> Iterator[list[str]]:
    """Turn the placement log on, collecting its lines (header dropped)."""
    yield from collect_placement_log()


def collect_placement_log() -> Iterator[list[str]]:
    """The body of the ``placement_log`` fixture (shared with other test modules)."""
    logger = logging.getLogger("towerflow.placement")
    handler = _ListHandler()
    logger.addHandler(handler)
    try:
        with configure(log_device_placement=True):
            del handler.lines[:]
            yield handler.lines
    finally:
        logger.removeHandler(handler)


class SmallNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 2, 3)
        self.fc = nn.Linear(2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = x.mean((2, 3))
        return self.fc(x) + self.fc(x)


def _placer_installed() -> bool:
    return any(type(m).__name__ == "_Placer" for m in _get_current_function_mode_stack())


def test_no_mode_is_installed_without_a_scope_or_log() -> None:
    assert not _placer_installed()
    with device("/cpu:0"):
        assert _placer_installed()
    assert not _placer_installed()


def test_factories_and_module_parameters_go_to_the_scope_device() -> None:
    with device("/cpu:0"):
        layer = nn.Linear(3, 2)
        x = torch.zeros(2, 3)
        y = layer(x)
    assert {p.device for p in layer.parameters()} == {torch.device("cpu")}
    assert y.device == torch.device("cpu") and y.shape == (2, 2)


def test_nested_scopes_merge_inner_wins_and_restore() -> None:
    assert current_scope() is None
    with device("/job:worker/task:1/cpu:0") as outer:
        assert outer.to_string() == "/job:worker/task:1/device:CPU:0"
        with device("/gpu:1") as inner:
            assert inner.to_string() == "/job:worker/task:1/device:GPU:1"
            with device("/job:ps") as innermost:
                assert innermost.to_string() == "/job:ps/task:1/device:GPU:1"
            assert current_scope() == inner
        with device(None) as cleared:
            assert cleared is None and current_scope() is None
        assert current_scope() == outer
    assert current_scope() is None


def test_scope_is_restored_after_an_exception() -> None:
    with pytest.raises(ValueError, match="inside"):
        with device("/cpu:0"), device("/gpu:3"):
            raise ValueError("inside")
    assert current_scope() is None
    assert not _placer_installed()


def test_bad_scope_string_fails_at_the_with_statement() -> None:
    with pytest.raises(InvalidArgumentError, match=r"Invalid device specification '/gpu:x'"):
        device("/gpu:x")


def test_missing_device_is_a_placement_error_naming_the_operation() -> None:
    a = torch.ones(2)
    missing = torch.cuda.device_count() + 2
    available = ", ".join(
        [CPU] + [f"{GPU0[:-1]}{i}" for i in range(torch.cuda.device_count())])
    with device(f"/gpu:{missing}"), pytest.raises(PlacementError) as info:
        torch.add(a, a)
    assert str(info.value) == (
        "Cannot assign a device for operation 'add': Could not satisfy explicit device "
        f"specification '/device:GPU:{missing}' because no devices matching that specification "
        f"are registered in this process; available devices: {available}. Set "
        "allow_soft_placement=True to fall back to a device that exists."
    )
    assert isinstance(info.value, InvalidArgumentError)


def test_missing_cpu_index_is_an_error_too() -> None:
    with device("/cpu:1"), pytest.raises(
        PlacementError, match=r"Cannot assign a device for operation 'zeros': Could not "
                              r"satisfy explicit device specification '/device:CPU:1'"):
        torch.zeros(1)


def test_soft_placement_runs_on_cpu_and_the_log_says_so(placement_log: list[str]) -> None:
    missing = torch.cuda.device_count() + 2
    with configure(allow_soft_placement=True), device(f"/gpu:{missing}"):
        a = torch.tensor([1.0, 2.0])
        c = a + a
    assert c.device == torch.device("cpu") and c.tolist() == [2.0, 4.0]
    note = f" (soft placement: no device matches '/device:GPU:{missing}')"
    assert placement_log == [
        f"tensor: (aten::lift_fresh): {CPU}{note}",
        f"add: (aten::add): {CPU}{note}",
    ]


def test_log_lines_for_a_small_model(placement_log: list[str]) -> None:
    with device("/cpu:0"):
        model = SmallNet()
    del placement_log[:]
    model(torch.zeros(1, 1, 4, 4))
    assert placement_log == [
        f"zeros: (aten::zeros): {CPU}",
        f"conv1/conv2d: (aten::convolution): {CPU}",
        f"relu: (aten::relu): {CPU}",
        f"mean: (aten::mean): {CPU}",
        f"fc/linear: (aten::addmm): {CPU}",
        f"fc/linear: (aten::addmm): {CPU}",
        f"add: (aten::add): {CPU}",
    ]


def test_log_names_are_unique_within_a_scope_and_restart_per_model_call(
    placement_log: list[str],
) -> None:
    a = torch.ones(2)
    torch.matmul(a, a)
    torch.matmul(a, a)
    model = nn.Sequential(nn.ReLU(), nn.ReLU())
    model(a)
    model(a)
    assert placement_log == [
        f"ones: (aten::ones): {CPU}",
        f"matmul: (aten::dot): {CPU}",
        f"matmul_1: (aten::dot): {CPU}",
        f"0/relu: (aten::relu): {CPU}",
        f"1/relu: (aten::relu): {CPU}",
        f"0/relu: (aten::relu): {CPU}",
        f"1/relu: (aten::relu): {CPU}",
    ]


def test_log_without_scope_reports_where_pytorch_ran(placement_log: list[str]) -> None:
    x = torch.arange(3.0)
    x.add_(1)
    assert x.sum().item() == 6.0
    assert placement_log == [
        f"arange: (aten::arange): {CPU}",
        f"add_: (aten::add_): {CPU}",
        f"sum: (aten::sum): {CPU}",
    ]


def test_log_turned_off_removes_the_mode_and_hooks() -> None:
    with configure(log_device_placement=True):
        assert _placer_installed()
    assert not _placer_installed()
    assert not torch.nn.modules.module._global_forward_hooks
    assert not torch.nn.modules.module._global_forward_pre_hooks


def test_scope_with_the_log_off_does_no_naming_or_logging_work() -> None:
    from towerflow.devices import loglines as placement_log_module
    from towerflow.devices import placer

    logger = logging.getLogger("towerflow.placement")
    handler = _ListHandler()
    handler.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    saved_level = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        top = placement_log_module._frames.stack[0]
        top.counts.clear()
        with device("/cpu:0"):
            assert _placer_installed()
            out = SmallNet()(torch.ones(1, 1, 4, 4))
            torch.add(out, out).sum().backward()
        assert handler.lines == []
        assert top.counts == {}  # no op was given a log name
        assert len(placement_log_module._frames.stack) == 1  # no module hooks ran
        assert torch.add in placer._KINDS  # each op kind classified once, then looked up
    finally:
        logger.setLevel(saved_level)
        logger.removeHandler(handler)


def test_training_step_inside_a_scope_matches_plain_pytorch() -> None:
    def step(model: nn.Module) -> list[torch.Tensor]:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        x = torch.linspace(-1, 1, 8).reshape(2, 1, 2, 2).repeat(1, 1, 2, 2)
        loss = F.cross_entropy(model(x), torch.tensor([0, 2]))
        loss.backward()
        optimizer.step()
        return [p.detach().clone() for p in model.parameters()]

    torch.manual_seed(0)
    plain = step(SmallNet())
    torch.manual_seed(0)
    with device("/cpu:0"):
        scoped = step(SmallNet())
    assert all(torch.equal(a, b) for a, b in zip(plain, scoped, strict=True))


def test_scopes_are_per_thread() -> None:
    seen: list[object] = []
    with device("/job:worker/cpu:0"):
        worker = threading.Thread(target=lambda: seen.append(current_scope()))
        worker.start()
        worker.join(timeout=10)
    assert seen == [None]


def test_op_without_a_kernel_on_the_scope_device_is_a_placement_error() -> None:
    library = torch.library.Library("towerflow_placement_test", "DEF")
    try:
        library.define("gpu_only(Tensor x) -> Tensor")
        library.impl("gpu_only", lambda x: x * 2, "CUDA")
        with device("/cpu:0"), pytest.raises(
            PlacementError,
            match=r"Cannot assign a device for operation 'gpu_only': Could not satisfy "
                  r"explicit device specification '/device:CPU:0' because no supported "
                  r"kernel for CPU devices is available \(Could not run "
                  r"'towerflow_placement_test::gpu_only'",
        ):
            torch.ops.towerflow_placement_test.gpu_only(torch.ones(2))
    finally:
        library._destroy()


def test_resolve_device_validates_and_falls_back() -> None:
    assert resolve_device("/cpu:0") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    missing = torch.cuda.device_count() + 9
    with pytest.raises(PlacementError, match=rf"Cannot assign a device for device "
                                             rf"'/gpu:{missing}': Could not satisfy explicit "
                                             rf"device specification '/device:GPU:{missing}'"):
        resolve_device(f"/gpu:{missing}")
    with configure(allow_soft_placement=True):
        assert resolve_device(f"/gpu:{missing}") == torch.device("cpu")
    with device("/cpu:0"):
        assert resolve_device(None) == torch.device("cpu")
    expected = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    assert resolve_device(None) == expected
    assert resolve_device("/job:ps/task:0") == expected


def test_default_device_cpu_installs_the_placer_until_cleared() -> None:
    with configure(default_device="cpu"):
        assert _placer_installed()
        assert torch.ones(1).device == torch.device("cpu")
    assert not _placer_installed()


@pytest.mark.gpu
def test_scope_places_tensors_ops_and_parameters_on_cuda(placement_log: list[str]) -> None:
    a_cpu = torch.ones(2)
    del placement_log[:]
    with device("/gpu:0"):
        layer = nn.Linear(2, 2)
        b = torch.ones(2)
        c = a_cpu + b
    assert layer.weight.device == torch.device("cuda", 0)
    assert b.device == c.device == torch.device("cuda", 0)
    expected = [
        rf"ones(_\d+)?: \(aten::ones\): {GPU0}",
        rf"add(_\d+)?/input_copy: \(aten::_to_copy\): {GPU0} \(from {CPU}\)",
        rf"add(_\d+)?: \(aten::add\): {GPU0}",
    ]
    assert len(placement_log) >= 3
    for pattern, line in zip(expected, placement_log[-3:], strict=True):
        assert re.fullmatch(pattern, line), (pattern, line)


@pytest.mark.gpu
def test_log_header_maps_each_gpu(monkeypatch) -> None:
    from towerflow.devices import log

    monkeypatch.setattr(log._log_state, "header", None)  # written once per process
    logger = logging.getLogger("towerflow.placement")
    handler = _ListHandler()
    logger.addHandler(handler)
    try:
        with configure(log_device_placement=True):
            pass
    finally:
        logger.removeHandler(handler)
    assert handler.lines[0] == "Device mapping:"
    for index in range(torch.cuda.device_count()):
        assert re.fullmatch(
            rf"{GPU0[:-1]}{index} -> device: {index}, name: .+, pci bus id: "
            rf"[0-9a-f]{{4}}:[0-9a-f]{{2}}:[0-9a-f]{{2}}\.0, compute capability: \d+\.\d+",
            handler.lines[1 + index])


@pytest.mark.gpu
def test_auto_default_puts_ops_on_the_first_gpu(placement_log: list[str]) -> None:
    with configure(default_device="auto"):
        a = torch.ones(2)
        c = torch.add(a, a)
        with device("/cpu:0"):
            d = torch.ones(2)
    assert a.device == c.device == torch.device("cuda", 0)
    assert d.device == torch.device("cpu")
    assert f"add: (aten::add): {GPU0}" in placement_log


@pytest.mark.gpu
def test_soft_placement_moves_an_op_without_gpu_kernel_to_cpu(placement_log: list[str]) -> None:
    library = torch.library.Library("towerflow_placement_gpu_test", "DEF")
    try:
        library.define("cpu_only(Tensor x) -> Tensor")
        library.impl("cpu_only", lambda x: x * 2, "CPU")
        op = torch.ops.towerflow_placement_gpu_test.cpu_only
        with device("/gpu:0"):
            with pytest.raises(PlacementError, match=r"no supported kernel for GPU devices"):
                op(torch.ones(2))
            with configure(allow_soft_placement=True):
                out = op(torch.ones(2))
        assert out.device == torch.device("cpu") and out.tolist() == [2.0, 2.0]
        assert any(line.endswith(f"{CPU} (soft placement: no GPU kernel)")
                   for line in placement_log)
    finally:
        library._destroy()


def test_default_device_that_does_not_exist_is_refused_unless_soft() -> None:
    missing = torch.cuda.device_count() + 3
    with pytest.raises(PlacementError, match=rf"Cannot assign a device for "
                                             rf"default_device='/device:GPU:{missing}'"):
        configure(default_device=f"/gpu:{missing}")
    assert towerflow.devices.get_config().default_device is None
    with configure(default_device=f"/gpu:{missing}", allow_soft_placement=True):
        assert torch.ones(1).device == torch.device("cpu")
        assert resolve_device(None) == torch.device("cpu")
