"""The article's CIFAR-10 network, its weight decay and local response norm; the digits net."""

from __future__ import annotations

import pytest
import torch

from towerflow.models import Cifar10Net, DigitsNet, LocalResponseNorm, weight_decay_loss


def test_cifar10_layers_have_the_articles_names_and_shapes() -> None:
    shapes = {name: tuple(p.shape) for name, p in Cifar10Net().named_parameters()}
    assert shapes == {
        "conv1.weight": (64, 3, 5, 5), "conv1.bias": (64,),
        "conv2.weight": (64, 64, 5, 5), "conv2.bias": (64,),
        "local3.weight": (384, 2304), "local3.bias": (384,),
        "local4.weight": (192, 384), "local4.bias": (192,),
        "softmax_linear.weight": (10, 192), "softmax_linear.bias": (10,),
    }
    assert Cifar10Net()(torch.zeros(3, 3, 24, 24)).shape == (3, 10)


def test_cifar10_initialisation_follows_the_original() -> None:
    torch.manual_seed(0)
    net = Cifar10Net()
    assert net.conv1.weight.abs().max() <= 2 * 5e-2
    # a normal truncated at 2 standard deviations keeps 88% of its standard deviation
    assert float(net.local3.weight.detach().std()) == pytest.approx(0.04 * 0.88, rel=0.05)
    assert torch.all(net.conv2.bias == 0.1) and torch.all(net.softmax_linear.bias == 0)


def test_local_response_norm_matches_tensorflows_formula() -> None:
    x = torch.randn(2, 12, 3, 3)
    radius, bias, alpha, beta = 4, 1.0, 0.001 / 9.0, 0.75
    padded = torch.nn.functional.pad(x.pow(2), (0, 0, 0, 0, radius, radius))
    sqr_sum = torch.stack([padded[:, c:c + 2 * radius + 1].sum(1) for c in range(12)], dim=1)
    expected = x / (bias + alpha * sqr_sum) ** beta
    got = LocalResponseNorm(radius, bias, alpha, beta)(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_weight_decay_is_half_the_squared_norm_of_local3_and_local4_times_0_004() -> None:
    net = Cifar10Net()
    expected = 0.004 * (net.local3.weight.pow(2).sum() + net.local4.weight.pow(2).sum()) / 2
    torch.testing.assert_close(weight_decay_loss(net), expected)


def test_weight_decay_sees_through_a_wrapper_and_gradients_reach_the_weights() -> None:
    class Wrapper(torch.nn.Module):
        def __init__(self, module: torch.nn.Module) -> None:
            super().__init__()
            self.module = module

    net = Cifar10Net()
    weight_decay_loss(Wrapper(net)).backward()
    torch.testing.assert_close(net.local3.weight.grad, 0.004 * net.local3.weight.detach())
    assert net.conv1.weight.grad is None


def test_a_model_without_weight_decays_has_zero_decay() -> None:
    assert float(weight_decay_loss(torch.nn.Linear(2, 2))) == 0.0


def test_digits_net_maps_8x8_images_to_10_logits() -> None:
    assert DigitsNet()(torch.zeros(5, 1, 8, 8)).shape == (5, 10)
