"""scikit-learn digits: shapes, scaling, stratified deterministic split."""

from __future__ import annotations

import pytest
import torch

from towerflow.data import load_digits
from towerflow.errors import InvalidArgumentError


def test_images_are_float_nchw_in_unit_range_and_labels_int64() -> None:
    train = load_digits("train")
    assert train.images.dtype == torch.float32 and train.images.shape[1:] == (1, 8, 8)
    assert float(train.images.min()) == 0.0 and float(train.images.max()) == 1.0
    assert train.labels.dtype == torch.int64 and train.num_classes == 10


def test_split_is_disjoint_complete_and_stratified() -> None:
    train, test = load_digits("train", test_fraction=0.25), load_digits("test", test_fraction=0.25)
    assert len(train) + len(test) == 1797
    assert len(test) == 450
    both = torch.cat([train.images.flatten(1), test.images.flatten(1)])
    assert torch.unique(both, dim=0).shape[0] >= 1797 - 30  # (the set has a few duplicate images)
    train_share = torch.bincount(train.labels, minlength=10) / len(train)
    test_share = torch.bincount(test.labels, minlength=10) / len(test)
    assert torch.allclose(train_share, test_share, atol=0.01)


def test_same_seed_same_split_other_seed_other_split() -> None:
    a, b, c = load_digits("test", seed=1), load_digits("test", seed=1), load_digits("test", seed=2)
    assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.images, c.images)


def test_bad_split_and_fraction_are_refused() -> None:
    with pytest.raises(InvalidArgumentError, match=r"Digits split 'val' does not exist"):
        load_digits("val")
    with pytest.raises(InvalidArgumentError, match=r"test_fraction=1.0 must be between 0 and 1"):
        load_digits(test_fraction=1.0)
