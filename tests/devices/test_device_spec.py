"""DeviceSpec: parsing every spelling, canonical strings, merging, errors."""

from __future__ import annotations

import copy
import re

import pytest
import torch

from towerflow.devices import DeviceSpec
from towerflow.errors import InvalidArgumentError


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ("/job:worker/replica:0/task:1/device:GPU:0", "/job:worker/replica:0/task:1/device:GPU:0"),
        ("/gpu:0", "/device:GPU:0"),
        ("/GPU:0", "/device:GPU:0"),
        ("/device:GPU:1", "/device:GPU:1"),
        ("GPU:1", "/device:GPU:1"),
        ("/cpu:0", "/device:CPU:0"),
        ("/CPU:0", "/device:CPU:0"),
        ("cuda:1", "/device:GPU:1"),
        ("cuda", "/device:GPU:*"),
        ("cpu", "/device:CPU:0"),
        ("/job:ps/task:0", "/job:ps/task:0"),
        ("/job:localhost/replica:0/task:0/cpu:0", "/job:localhost/replica:0/task:0/device:CPU:0"),
        ("/device:GPU:*", "/device:GPU:*"),
        ("", ""),
    ],
)
def test_parses_every_accepted_spelling_to_canonical_form(text: str, canonical: str) -> None:
    assert DeviceSpec.from_string(text).to_string() == canonical


@pytest.mark.parametrize(
    "text",
    ["/job:worker/replica:0/task:1/device:GPU:0", "/job:ps/task:0", "/device:CPU:0",
     "/device:GPU:3", "/job:chief/replica:2"],
)
def test_canonical_string_round_trips(text: str) -> None:
    spec = DeviceSpec.from_string(text)
    assert spec.to_string() == text
    assert DeviceSpec.from_string(spec.to_string()) == spec


def test_fields_of_a_full_spec() -> None:
    spec = DeviceSpec.from_string("/job:worker/replica:0/task:1/device:GPU:3")
    assert (spec.job, spec.replica, spec.task, spec.device_type, spec.device_index) == (
        "worker", 0, 1, "GPU", 3)


def test_from_torch_device_and_none() -> None:
    assert DeviceSpec.from_string(torch.device("cuda", 2)).to_string() == "/device:GPU:2"
    assert DeviceSpec.from_string(torch.device("cpu")).to_string() == "/device:CPU:0"
    assert DeviceSpec.from_string(None).is_empty
    spec = DeviceSpec.from_string("/gpu:1")
    assert DeviceSpec.from_string(spec) is spec


def test_to_torch_maps_gpu_to_cuda_and_the_rest_to_cpu() -> None:
    assert DeviceSpec.from_string("/gpu:1").to_torch() == torch.device("cuda", 1)
    assert DeviceSpec.from_string("/cpu:0").to_torch() == torch.device("cpu")
    assert DeviceSpec.from_string("/job:ps/task:0").to_torch() == torch.device("cpu")


def test_merge_other_fields_win_and_unset_fields_are_kept() -> None:
    outer = DeviceSpec.from_string("/job:worker/task:1/cpu:0")
    inner = DeviceSpec.from_string("/gpu:2")
    assert outer.make_merged_spec(inner).to_string() == "/job:worker/task:1/device:GPU:2"
    assert inner.make_merged_spec(outer).to_string() == "/job:worker/task:1/device:CPU:0"
    assert outer.make_merged_spec(DeviceSpec()).to_string() == outer.to_string()


def test_replace_returns_a_new_spec_and_validates() -> None:
    spec = DeviceSpec.from_string("/job:ps/task:0")
    moved = spec.replace(task=3, device_type="gpu", device_index=1)
    assert moved.to_string() == "/job:ps/task:3/device:GPU:1"
    assert spec.to_string() == "/job:ps/task:0"
    with pytest.raises(InvalidArgumentError, match=r"unknown field\(s\) \['colour'\]"):
        spec.replace(colour="red")
    with pytest.raises(InvalidArgumentError, match=r"Invalid task -1"):
        spec.replace(task=-1)
    with pytest.raises(InvalidArgumentError, match=r"Invalid device type 'TPU'"):
        spec.replace(device_type="TPU")


def test_spec_is_immutable_hashable_and_copyable() -> None:
    spec = DeviceSpec.from_string("/job:worker/task:0/gpu:1")
    with pytest.raises(AttributeError, match="immutable"):
        spec.task = 2  # type: ignore[misc]
    assert not hasattr(spec, "__dict__")
    same = DeviceSpec("worker", None, 0, "GPU", 1)
    assert spec == same and hash(spec) == hash(same)
    assert len({spec, same, DeviceSpec.from_string("/gpu:1")}) == 2
    assert copy.deepcopy(spec) == spec and copy.copy(spec) == spec


def test_parsing_is_cached() -> None:
    assert DeviceSpec.from_string("/gpu:7") is DeviceSpec.from_string("/gpu:7")


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("/gpu:x", r"device index 'x' is not a non-negative integer"),
        ("/job:", r"job name missing or malformed in 'job:'"),
        ("/cpu:0/gpu:0", r"two device types \(at 'gpu:0'\)"),
        ("/device:CPU:0/device:GPU:1", r"two device types"),
        ("/foo:1", r"unknown field 'foo'"),
        ("/job:ps/job:worker", r"job given twice"),
        ("/device:TPU:0", r"unknown device type 'TPU'"),
        ("/gpu:0/", r"empty component"),
        ("/task:one", r"task index 'one' is not a non-negative integer"),
        ("cuda:", r"the device index is missing"),
    ],
)
def test_bad_strings_name_the_string_and_the_accepted_forms(text: str, reason: str) -> None:
    with pytest.raises(InvalidArgumentError, match=r"Invalid device specification ") as info:
        DeviceSpec.from_string(text)
    message = str(info.value)
    assert f"{text!r}" in message
    assert re.search(reason, message)
    assert "accepted forms are '/job:<name>/replica:<n>/task:<n>/device:<CPU|GPU>:<n>'" in message
    assert isinstance(info.value, ValueError)


def test_non_string_is_rejected() -> None:
    with pytest.raises(InvalidArgumentError, match=r"Invalid device specification 3: expected a"):
        DeviceSpec.from_string(3)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match=r"CPU and GPU \(cuda\) devices only"):
        DeviceSpec.from_string(torch.device("meta"))
