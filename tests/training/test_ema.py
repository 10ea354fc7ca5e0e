"""Moving averages of the parameters with TensorFlow's num_updates warm-up."""

from __future__ import annotations

import pytest
import torch

from towerflow.errors import InvalidArgumentError
from towerflow.training.ema import ExponentialMovingAverage, ema_decay


def test_decay_is_capped_by_the_num_updates_rule() -> None:
    assert ema_decay(0.9999, 0) == pytest.approx(0.1)
    assert ema_decay(0.9999, 10) == pytest.approx(11 / 20)
    assert ema_decay(0.9999, 10 ** 6) == 0.9999
    assert ema_decay(0.9, None) == 0.9


def test_shadow_follows_the_recurrence_over_several_updates() -> None:
    param = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    ema = ExponentialMovingAverage({"w": param}, decay=0.5)
    expected = param.detach().clone()
    for n, value in enumerate([3.0, 5.0, -1.0]):
        with torch.no_grad():
            param.fill_(value)
        ema.update(num_updates=n)
        d = min(0.5, (1 + n) / (10 + n))
        expected = expected - (1 - d) * (expected - value)
    torch.testing.assert_close(ema.shadow["w"], expected)


def test_without_warmup_the_full_decay_applies_from_the_start() -> None:
    param = torch.nn.Parameter(torch.zeros(1))
    ema = ExponentialMovingAverage({"w": param}, decay=0.9, num_updates_warmup=False)
    with torch.no_grad():
        param.fill_(1.0)
    ema.update(num_updates=0)
    assert float(ema.shadow["w"]) == pytest.approx(0.1)


def test_state_round_trips_and_mismatches_are_refused() -> None:
    params = {"a": torch.nn.Parameter(torch.ones(2))}
    ema = ExponentialMovingAverage(params)
    other = ExponentialMovingAverage({"a": torch.nn.Parameter(torch.zeros(2))})
    other.load_state_dict(ema.state_dict())
    torch.testing.assert_close(other.shadow["a"], torch.ones(2))
    with pytest.raises(InvalidArgumentError, match=r"missing \['a'\], unexpected \['b'\]"):
        other.load_state_dict({"b": torch.ones(2)})
    with pytest.raises(InvalidArgumentError, match=r"'a' has shape \(3,\) in the checkpoint"):
        other.load_state_dict({"a": torch.ones(3)})


def test_decay_outside_zero_one_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="decay must be in \\[0, 1\\), got 1.0"):
        ExponentialMovingAverage({}, decay=1.0)
