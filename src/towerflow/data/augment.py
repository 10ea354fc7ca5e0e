"""Batched, on-device image distortions ("distorted inputs") and eval preprocessing.

The CIFAR-10 tutorial distorts every training image before use: a random
24x24 crop, a random horizontal flip, a random brightness change, a random
contrast change, then per-image standardisation. Here the whole batch is
distorted at once on the batch's device — one gather does the crops and flips
for every image, the pixel arithmetic is broadcast over the batch — so a GPU
does the work that the tutorial's CPU reader threads did.

Pixels of uint8 images are scaled to [0, 1] first; float images are taken as
already in [0, 1]. Brightness moves every pixel of an image by the same
``delta`` in ``[-63/255, 63/255]``; contrast scales each channel's deviation
from its mean by a factor in ``[0.2, 1.8]``; standardisation maps each image
to ``(x - mean) / max(std, 1 / sqrt(numel))`` as TensorFlow's
``per_image_standardization`` does.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping

import torch

from towerflow.errors import InvalidArgumentError

__all__ = ["Distortion", "distort_images", "eval_images", "standardize"]

MAX_BRIGHTNESS_DELTA = 63.0 / 255.0
CONTRAST_RANGE = (0.2, 1.8)


def _as_unit_float(images: torch.Tensor, crop: int) -> torch.Tensor:
    if images.dim() != 4:
        raise InvalidArgumentError(
            f"Images must be a (N, C, H, W) batch, got shape {list(images.shape)}."
        )
    if not 0 < crop <= min(images.shape[2], images.shape[3]):
        raise InvalidArgumentError(
            f"Crop size {crop} does not fit {images.shape[2]}x{images.shape[3]} images; "
            "use a crop between 1 and the image size."
        )
    if images.dtype == torch.uint8:
        return images.to(torch.float32).div_(255.0)
    return images.to(torch.float32)


def standardize(images: torch.Tensor) -> torch.Tensor:
    """Per-image standardisation: zero mean, unit variance per image.

    ``(x - mean) / max(std, 1 / sqrt(numel))`` over each image's C*H*W values.

    Example:
        >>> x = standardize(torch.rand(2, 3, 4, 4))
        >>> [round(v, 4) for v in x.mean(dim=(1, 2, 3)).abs().tolist()]
        [0.0, 0.0]
    """
    flat = images.flatten(1)
    mean = flat.mean(dim=1, keepdim=True)
    std = flat.std(dim=1, correction=0, keepdim=True)
    floor = 1.0 / math.sqrt(flat.shape[1])
    return ((flat - mean) / std.clamp_min(floor)).view_as(images)


def _uniform(
    n: int, low: float, high: float, device: torch.device, generator: torch.Generator | None
) -> torch.Tensor:
    where = generator.device if generator is not None else device
    return torch.empty(n, device=where).uniform_(low, high, generator=generator).to(device)


def _offsets(
    n: int, span: int, device: torch.device, generator: torch.Generator | None
) -> torch.Tensor:
    where = generator.device if generator is not None else device
    return torch.randint(0, span + 1, (n,), device=where, generator=generator).to(device)


def _crop_flip(
    x: torch.Tensor, top: torch.Tensor, left: torch.Tensor, flip: torch.Tensor, crop: int
) -> torch.Tensor:
    """Crop every image at its own (top, left), mirrored where ``flip``; one gather."""
    n, c = x.shape[:2]
    steps = torch.arange(crop, device=x.device)
    rows = top[:, None] + steps  # (N, crop)
    cols = left[:, None] + torch.where(flip[:, None], crop - 1 - steps, steps)
    batch = torch.arange(n, device=x.device)[:, None, None, None]
    chans = torch.arange(c, device=x.device)[None, :, None, None]
    return x[batch, chans, rows[:, None, :, None], cols[:, None, None, :]]


def distort_images(
    images_uint8: torch.Tensor, generator: torch.Generator | None = None, *, crop: int = 24
) -> torch.Tensor:
    """Randomly crop, flip, brighten, contrast and standardise a batch.

    Args:
        images_uint8: ``(N, C, H, W)`` uint8 (or float in [0, 1]) on any device.
        generator: Random source (on the images' device, or the CPU); the
            same generator state gives the same distortions.
        crop: Output height and width.

    Returns:
        float32 ``(N, C, crop, crop)`` on the images' device.
    """
    x = _as_unit_float(images_uint8, crop)
    n, _, h, w = x.shape
    dev = x.device
    top = _offsets(n, h - crop, dev, generator)
    left = _offsets(n, w - crop, dev, generator)
    flip = _uniform(n, 0.0, 1.0, dev, generator) < 0.5
    x = _crop_flip(x, top, left, flip, crop)
    delta = _uniform(n, -MAX_BRIGHTNESS_DELTA, MAX_BRIGHTNESS_DELTA, dev, generator)
    x = x + delta[:, None, None, None]
    factor = _uniform(n, *CONTRAST_RANGE, dev, generator)[:, None, None, None]
    mean = x.mean(dim=(2, 3), keepdim=True)
    x = (x - mean) * factor + mean
    return standardize(x)


class Distortion:
    """:func:`distort_images` as a pipeline transform whose randomness follows the data position.

    Before each batch the prefetcher calls :meth:`seek` with the batch's
    position (``{"epoch": e, "offset": o}``); the generator is then seeded
    from ``(seed, epoch, offset)``. The distortions of a batch depend only on
    where it is in the data, so a run resumed from a checkpoint distorts every
    later batch exactly as the run that was not interrupted would have.

    Args:
        device: where the images are distorted (the generator lives there).
        seed: decides every batch's distortions (give each replica its own).
        crop: output height and width.

    Example:
        >>> d = Distortion(torch.device("cpu"), seed=3)
        >>> d.seek({"epoch": 0, "offset": 5})
        >>> a, _ = d(torch.zeros(2, 3, 32, 32, dtype=torch.uint8), torch.zeros(2))
        >>> d.seek({"epoch": 0, "offset": 5})
        >>> b, _ = d(torch.zeros(2, 3, 32, 32, dtype=torch.uint8), torch.zeros(2))
        >>> bool(torch.equal(a, b)), tuple(a.shape)
        (True, (2, 3, 24, 24))
    """

    def __init__(self, device: torch.device, seed: int, *, crop: int = 24) -> None:
        self.seed = int(seed)
        self.crop = crop
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(self.seed)

    def seek(self, position: Mapping[str, int]) -> None:
        """Seed the generator for the batch at ``position`` (epoch and offset)."""
        key = f"{self.seed}:{int(position.get('epoch', 0))}:{int(position.get('offset', 0))}"
        digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
        self.generator.manual_seed(int.from_bytes(digest, "little") >> 1)

    def __call__(self, images: torch.Tensor,
                 labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return distort_images(images, self.generator, crop=self.crop), labels


def eval_images(images_uint8: torch.Tensor, crop: int = 24) -> torch.Tensor:
    """Centrally crop and standardise a batch (the evaluation preprocessing).

    Example:
        >>> eval_images(torch.zeros(2, 3, 32, 32, dtype=torch.uint8)).shape
        torch.Size([2, 3, 24, 24])
    """
    x = _as_unit_float(images_uint8, crop)
    top = (x.shape[2] - crop) // 2
    left = (x.shape[3] - crop) // 2
    return standardize(x[:, :, top : top + crop, left : left + crop])
