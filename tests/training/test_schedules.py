"""Staircase exponential learning-rate decay (tf.train.exponential_decay)."""

from __future__ import annotations

import pytest

from towerflow.errors import InvalidArgumentError
from towerflow.training.schedules import ExponentialDecay, decay_steps_for_epochs


def test_staircase_drops_once_per_period() -> None:
    schedule = ExponentialDecay(0.1, decay_steps=10, decay_rate=0.1)
    assert [schedule(s) for s in (0, 9, 10, 19, 20)] == pytest.approx(
        [0.1, 0.1, 0.01, 0.01, 0.001])


def test_without_staircase_the_rate_decays_continuously() -> None:
    schedule = ExponentialDecay(0.1, decay_steps=10, decay_rate=0.1, staircase=False)
    assert schedule(5) == pytest.approx(0.1 * 0.1 ** 0.5)


def test_article_decay_steps_for_350_epochs_of_cifar10() -> None:
    # num_batches_per_epoch = 50000 / 128 / num_gpus; decay_steps = int(that * 350)
    assert decay_steps_for_epochs(50000, 128, 350.0) == int(50000 / 128 * 350)
    assert decay_steps_for_epochs(50000, 256, 350.0) == int(50000 / 256 * 350)


def test_schedule_round_trips_through_checkpoint_metadata() -> None:
    schedule = ExponentialDecay(0.05, decay_steps=7, decay_rate=0.5)
    assert ExponentialDecay.from_dict(schedule.as_dict()) == schedule


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"initial": 0.0, "decay_steps": 1}, "Initial learning rate must be a positive number, got 0.0"),
    ({"initial": 0.1, "decay_steps": 0}, "decay_steps must be at least 1, got 0"),
    ({"initial": 0.1, "decay_steps": 1, "decay_rate": -1.0}, "decay_rate must be positive"),
])
def test_invalid_schedules_are_refused(kwargs, message) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        ExponentialDecay(**kwargs)


def test_unknown_schedule_kind_in_metadata_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="Unknown learning-rate schedule 'cosine'"):
        ExponentialDecay.from_dict({"kind": "cosine"})
