"""Property tests of the manifest reader: refused with CheckpointError or read right, nothing else.

Every manifest here carries a correct digest, so that what is tested is the
reader behind the digest — the bounded JSON decoder and the manifest
validation — as a forger who recomputes the digest would reach it.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from towerflow.checkpoint.files import json_depth_exceeds
from towerflow.checkpoint.format import (
    DIGEST_NAME,
    MANIFEST_NAME,
    digest_line,
    read_checkpoint_dir,
    write_checkpoint_dir,
)
from towerflow.errors import CheckpointError

TENSORS = {"w": torch.arange(6.0).reshape(2, 3), "n": torch.tensor([7], dtype=torch.int64)}

json_scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
                | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8))
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12,
)


@pytest.fixture(scope="module")
def checkpoint() -> Iterator[tuple[Path, bytes]]:
    with tempfile.TemporaryDirectory() as tmp:
        path = write_checkpoint_dir(Path(tmp) / "ckpt", 5, {"model": TENSORS}, {"lr": 0.5})
        yield path, (path / MANIFEST_NAME).read_bytes()


def _install(path: Path, manifest: bytes) -> None:
    (path / MANIFEST_NAME).write_bytes(manifest)
    (path / DIGEST_NAME).write_bytes(digest_line(manifest))


def _read_refused_or_right(path: Path) -> None:
    """The one property: a CheckpointError, or a checkpoint that agrees with the manifest."""
    try:
        ckpt = read_checkpoint_dir(path)
    except CheckpointError:
        return
    manifest = json.loads((path / MANIFEST_NAME).read_bytes())
    assert type(ckpt.step) is int and ckpt.step == manifest["step"] >= 0
    assert isinstance(ckpt.metadata, dict)
    assert ckpt.groups == {"model": ckpt.groups["model"]}
    for name, tensor in TENSORS.items():
        assert torch.equal(ckpt.groups["model"][name], tensor)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _paths(item, (*prefix, i))


def _mutate(manifest: dict[str, Any], where: tuple[Any, ...], op: str, value: Any) -> Any:
    if not where:
        return value
    parent = manifest
    for key in where[:-1]:
        parent = parent[key]
    last = where[-1]
    if op == "delete":
        del parent[last]
    elif op == "add" and isinstance(parent, dict):
        parent[f"{last}x"] = value
    else:
        parent[last] = value
    return manifest


SETTINGS = settings(max_examples=300, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(data=st.data(), op=st.sampled_from(["replace", "delete", "add"]), value=json_values)
def test_a_structurally_mutated_manifest_is_refused_or_read_right(checkpoint, data, op, value):
    path, original = checkpoint
    manifest = json.loads(original)
    where = data.draw(st.sampled_from(list(_paths(manifest))))
    mutated = _mutate(manifest, where, op, value)
    _install(path, json.dumps(mutated).encode())
    _read_refused_or_right(path)


@SETTINGS
@given(data=st.data(), chunk=st.binary(max_size=8), cut=st.integers(0, 8))
def test_a_byte_mutated_manifest_is_refused_or_read_right(checkpoint, data, chunk, cut):
    path, original = checkpoint
    at = data.draw(st.integers(0, len(original)))
    _install(path, original[:at] + chunk + original[at + cut:])
    _read_refused_or_right(path)


@SETTINGS
@given(raw=st.binary(max_size=256) | st.text(alphabet="[]{}\"\\:,0123456789", max_size=4000)
       .map(str.encode))
def test_arbitrary_bytes_as_a_manifest_are_refused(checkpoint, raw):
    path, _ = checkpoint
    _install(path, raw)
    with pytest.raises(CheckpointError):
        read_checkpoint_dir(path)


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


@settings(max_examples=300, deadline=None)
@given(value=json_values, limit=st.integers(0, 6))
def test_the_depth_scan_agrees_with_the_json_it_scans(value, limit):
    text = json.dumps(value).encode()
    assert json_depth_exceeds(text, limit) == (_depth(value) > limit)
