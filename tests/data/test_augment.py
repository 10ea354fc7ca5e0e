"""Batched on-device distortions and eval preprocessing."""

from __future__ import annotations

import math

import pytest
import torch

from towerflow.data import distort_images, eval_images, standardize
from towerflow.errors import InvalidArgumentError


def _images(n: int, c: int = 3, size: int = 32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, c, size, size), generator=gen, dtype=torch.uint8)


def test_distorted_batch_is_float_cropped_and_standardised() -> None:
    out = distort_images(_images(6), torch.Generator().manual_seed(0))
    assert out.dtype == torch.float32 and out.shape == (6, 3, 24, 24)
    flat = out.flatten(1)
    assert torch.allclose(flat.mean(1), torch.zeros(6), atol=1e-5)
    assert torch.allclose(flat.std(1, correction=0), torch.ones(6), atol=1e-4)


def test_same_generator_state_same_distortions() -> None:
    images = _images(4)
    a = distort_images(images, torch.Generator().manual_seed(1))
    b = distort_images(images, torch.Generator().manual_seed(1))
    c = distort_images(images, torch.Generator().manual_seed(2))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_each_image_is_a_crop_of_itself_possibly_mirrored() -> None:
    # With one channel, brightness and contrast are undone by standardisation
    # (the image's std stays above the 1/sqrt(numel) floor even at contrast 0.2),
    # so every output must be the standardised crop (or mirrored crop) of its input.
    images = _images(40, c=1, size=28, seed=3)
    out = distort_images(images, torch.Generator().manual_seed(4), crop=24)
    seen_offsets, seen_flips = set(), set()
    for i in range(len(images)):
        x = images[i : i + 1].float() / 255
        matches = [
            (top, left, flip)
            for top in range(5)
            for left in range(5)
            for flip in (False, True)
            if torch.allclose(
                out[i : i + 1],
                standardize(_crop(x, top, left, 24, flip)),
                atol=1e-4,
            )
        ]
        assert matches, f"image {i} is not a crop of its input"
        seen_offsets.add(matches[0][:2])
        seen_flips.add(matches[0][2])
    assert len(seen_offsets) >= 10 and seen_flips == {False, True}


def _crop(x: torch.Tensor, top: int, left: int, size: int, flip: bool) -> torch.Tensor:
    patch = x[:, :, top : top + size, left : left + size]
    return patch.flip(-1) if flip else patch


def test_contrast_changes_colour_images_per_channel() -> None:
    # Three channels: contrast acts per channel, so it is visible after standardisation.
    images = _images(1, seed=5).expand(64, -1, -1, -1).contiguous()
    out = distort_images(images, torch.Generator().manual_seed(6), crop=32)
    distinct = {tuple(o.flatten()[:8].round(decimals=3).tolist()) for o in out}
    assert len(distinct) > 8


def test_standardize_matches_the_per_image_formula_with_its_floor() -> None:
    x = torch.rand(2, 3, 4, 4, dtype=torch.float64)
    x[1] = 0.5  # a constant image: std 0, divided by 1/sqrt(numel) instead
    out = standardize(x)
    for i in range(2):
        values = x[i].flatten()
        std = max(values.std(correction=0).item(), 1 / math.sqrt(values.numel()))
        assert torch.allclose(out[i].flatten(), (values - values.mean()) / std)
    assert torch.equal(out[1], torch.zeros(3, 4, 4, dtype=torch.float64))


def test_eval_images_take_the_central_crop() -> None:
    images = _images(3)
    out = eval_images(images)
    expected = standardize(images[:, :, 4:28, 4:28].float() / 255)
    assert torch.allclose(out, expected)


def test_float_images_are_taken_as_unit_range() -> None:
    x = torch.rand(2, 1, 8, 8)
    assert torch.allclose(eval_images(x, crop=8), standardize(x))


def test_a_crop_larger_than_the_image_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match=r"Crop size 40 does not fit 32x32 images"):
        distort_images(_images(1), crop=40)
    with pytest.raises(InvalidArgumentError, match=r"must be a \(N, C, H, W\) batch"):
        eval_images(torch.zeros(3, 32, 32, dtype=torch.uint8))


@pytest.mark.gpu
def test_distortion_runs_on_the_gpu_with_a_gpu_generator() -> None:
    images = _images(8).to("cuda:0")
    gen = torch.Generator(device="cuda:0").manual_seed(0)
    out = distort_images(images, gen)
    assert out.device == images.device and out.shape == (8, 3, 24, 24)
    assert torch.allclose(out.flatten(1).mean(1), torch.zeros(8, device="cuda:0"), atol=1e-5)
