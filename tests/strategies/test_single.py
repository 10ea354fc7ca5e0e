"""SingleDevice: one step is plain SGD; its state restores optimizer and step exactly."""

from __future__ import annotations

import pytest
import torch

from towerflow.errors import FailedPreconditionError, InvalidArgumentError
from towerflow.strategies.base import OptimizerConfig
from towerflow.strategies.single import SingleDevice


def _loss(model, batch):
    return torch.nn.functional.mse_loss(model(batch[0]), batch[1])


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 3, generator=g), torch.randn(8, 1, generator=g)


def test_one_step_is_a_gradient_descent_update_at_the_given_rate() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    strategy = SingleDevice("/cpu:0")
    strategy.prepare(model, OptimizerConfig(lr=1.0))
    x, y = _batch()
    reference = torch.nn.Linear(3, 1)
    reference.load_state_dict(before)
    _loss(reference, (x, y)).backward()
    result = strategy.run_step(_loss, (x, y), lr=0.5)
    assert result.global_step == 1 and result.applied
    for name, p in reference.named_parameters():
        torch.testing.assert_close(model.get_parameter(name), before[name] - 0.5 * p.grad)


def test_restored_state_continues_exactly_like_an_uninterrupted_run() -> None:
    config = OptimizerConfig("momentum", lr=0.1, momentum=0.9)
    torch.manual_seed(0)
    straight = SingleDevice("/cpu:0")
    straight.prepare(torch.nn.Linear(3, 1), config)
    for _ in range(2):
        straight.run_step(_loss, _batch())
    groups, meta = straight.state_dict(), straight.state_metadata()
    assert any("momentum_buffer" in name for name in groups["optimizer"])
    resumed = SingleDevice("/cpu:0")
    resumed.prepare(torch.nn.Linear(3, 1), config)
    resumed.load_state(groups, meta)
    assert resumed.global_step == 2
    for strategy in (straight, resumed):
        strategy.run_step(_loss, _batch())
    for name, p in straight.model.named_parameters():
        torch.testing.assert_close(resumed.model.get_parameter(name), p, rtol=0, atol=0)


def test_stepping_before_prepare_is_refused() -> None:
    with pytest.raises(FailedPreconditionError, match=r"call prepare\(model, optimizer\) first"):
        SingleDevice("/cpu:0").run_step(_loss, _batch())


def test_restoring_without_a_model_group_is_refused() -> None:
    strategy = SingleDevice("/cpu:0")
    strategy.prepare(torch.nn.Linear(3, 1), OptimizerConfig())
    with pytest.raises(InvalidArgumentError, match="no 'model' group"):
        strategy.load_state({"optimizer": {}}, {})


def test_device_names_resolve_to_torch_devices() -> None:
    assert SingleDevice("/cpu:0").device == torch.device("cpu")
    assert SingleDevice().device.type == ("cuda" if torch.cuda.is_available() else "cpu")
