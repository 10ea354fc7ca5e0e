"""scikit-learn's bundled handwritten digits: a real data set that needs no network.

1797 grey 8x8 images of the digits 0..9 (pixel values 0..16), shipped inside
scikit-learn. :func:`load_digits` splits them into train and test sets,
stratified by class and the same for the same seed.
"""

from __future__ import annotations

import torch

from towerflow.data.dataset import Dataset
from towerflow.errors import FailedPreconditionError, InvalidArgumentError

__all__ = ["load_digits"]

NUM_CLASSES = 10


def load_digits(split: str = "train", *, test_fraction: float = 0.2, seed: int = 0) -> Dataset:
    """Load the train or test part of the digits data set.

    Args:
        split: ``"train"`` or ``"test"``.
        test_fraction: Share of the examples (0 < f < 1) held out for test.
        seed: Decides the split; the same seed gives the same split.

    Returns:
        Images float32 ``(N, 1, 8, 8)`` in [0, 1] and int64 labels.

    Example:
        >>> ds = load_digits("test")
        >>> ds.images.shape, ds.images.dtype, float(ds.images.max())
        (torch.Size([360, 1, 8, 8]), torch.float32, 1.0)
    """
    if split not in ("train", "test"):
        raise InvalidArgumentError(f"Digits split {split!r} does not exist; use 'train' or 'test'.")
    if not 0.0 < test_fraction < 1.0:
        raise InvalidArgumentError(f"test_fraction={test_fraction} must be between 0 and 1 (exclusive).")
    try:
        from sklearn.datasets import load_digits as _sk_load
        from sklearn.model_selection import train_test_split
    except ImportError as exc:
        raise FailedPreconditionError(
            "The digits data set needs scikit-learn; install it with `pip install towerflow[digits]`."
        ) from exc
    bunch = _sk_load()
    train_idx, test_idx = train_test_split(
        list(range(len(bunch.target))),
        test_size=test_fraction,
        random_state=seed,
        stratify=bunch.target,
    )
    index = torch.tensor(sorted(train_idx if split == "train" else test_idx), dtype=torch.int64)
    images = torch.from_numpy(bunch.images).to(torch.float32).div_(16.0).unsqueeze(1)
    labels = torch.from_numpy(bunch.target).to(torch.int64)
    return Dataset(images[index].contiguous(), labels[index].contiguous(), NUM_CLASSES)
