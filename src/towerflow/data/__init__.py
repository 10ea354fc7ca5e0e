"""Input data: CIFAR-10 (binary format, download, synthetic), digits, sharding, prefetch.

Recommendation data (pandas, imported when used): :mod:`towerflow.data.movielens`
(GroupLens' MovieLens files), :mod:`towerflow.data.criteo` (Criteo's
display-advertising TSV), both as :class:`towerflow.data.recsys.FieldData`.

- :func:`load_cifar10` / :func:`synthetic_cifar10` / :func:`load_digits` give
  an in-memory :class:`Dataset`.
- :class:`ShardedBatches` cuts it into deterministic, resumable batches of
  indices, one shard per replica.
- :class:`DevicePrefetcher` moves batches to the device in the background.
- :func:`distort_images` / :func:`eval_images` preprocess batches on the device;
  :class:`Distortion` is the training transform (its randomness follows the data position).
"""

from __future__ import annotations

from towerflow.data.augment import Distortion, distort_images, eval_images, standardize
from towerflow.data.cifar10 import (
    CIFAR10_MD5,
    CIFAR10_URL,
    download_cifar10,
    load_cifar10,
    read_batch_file,
    synthetic_cifar10,
    write_batch_file,
)
from towerflow.data.dataset import Dataset
from towerflow.data.digits import load_digits
from towerflow.data.prefetch import DevicePrefetcher
from towerflow.data.sampler import ShardedBatches

__all__ = [
    "CIFAR10_MD5",
    "CIFAR10_URL",
    "Dataset",
    "DevicePrefetcher",
    "ShardedBatches",
    "Distortion",
    "distort_images",
    "download_cifar10",
    "eval_images",
    "load_cifar10",
    "load_digits",
    "read_batch_file",
    "standardize",
    "synthetic_cifar10",
    "write_batch_file",
]
