"""Nested state (optimizer state dicts, schedules) <-> flat tensors + JSON.

safetensors holds flat ``name -> tensor`` maps; an optimizer's ``state_dict()``
is a tree of dicts (with integer keys), lists, tuples, numbers, strings, None
and tensors. :func:`flatten_state` splits such a tree into the tensors (named
by their path) and a JSON description of everything else that says where each
tensor goes; :func:`unflatten_state` puts the tree back together exactly —
integer keys stay integers, tuples stay tuples, ``nan``/``inf`` floats survive.

The JSON uses plain objects and arrays where it can, and single-key tagged
objects where JSON has no equivalent::

    {"__tensor__": "state.0.exp_avg"}   a tensor, by name
    {"__tuple__": [0.9, 0.999]}         a tuple
    {"__float__": "nan"}                a non-finite float
    {"__dict__": [[0, {...}], ...]}     a dict whose keys are not all plain strings

Nothing in it is ever evaluated: unflattening only builds dicts, lists and
tuples, and looks tensors up by name.

Example:
    >>> import torch
    >>> tensors, meta = flatten_state({"state": {0: {"step": torch.tensor(3.0)}}, "lr": 0.1})
    >>> sorted(tensors)
    ['state.0.step']
    >>> unflatten_state(tensors, meta)
    {'state': {0: {'step': tensor(3.)}}, 'lr': 0.1}
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from towerflow.checkpoint.format import dtype_name
from towerflow.errors import CheckpointError, InvalidArgumentError

__all__ = ["STATE_FORMAT", "flatten_state", "load_into_module", "unflatten_state"]

STATE_FORMAT = "towerflow.state/1"
_TAGS = ("__tensor__", "__tuple__", "__float__", "__dict__")


def _encode_float(value: float) -> Any:
    if math.isfinite(value):
        return value
    return {"__float__": repr(value)}  # 'nan', 'inf', '-inf'


class _Flattener:
    """One walk over a state tree, collecting tensors under unique names."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.tensors: dict[str, torch.Tensor] = {}

    def name_for(self, path: list[str]) -> str:
        base = self.prefix + ".".join(path)
        name, n = base, 1
        while name in self.tensors:
            name, n = f"{base}#{n}", n + 1
        return name

    def encode(self, value: Any, path: list[str]) -> Any:
        if isinstance(value, torch.Tensor):
            name = self.name_for(path)
            self.tensors[name] = value
            return {"__tensor__": name}
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, numbers.Integral):  # int, numpy integers
            return int(value)
        if isinstance(value, numbers.Real):  # float, numpy floats
            return _encode_float(float(value))
        if isinstance(value, tuple):
            return {"__tuple__": [self.encode(v, [*path, str(i)]) for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [self.encode(v, [*path, str(i)]) for i, v in enumerate(value)]
        if isinstance(value, Mapping):
            return self.encode_mapping(value, path)
        where = ".".join(path) or "<root>"
        raise InvalidArgumentError(
            f"State entry {where!r} is a {type(value).__name__}, which a checkpoint cannot hold; "
            "use tensors, numbers, strings, booleans, None, lists, tuples and dicts."
        )

    def encode_mapping(self, value: Mapping[Any, Any], path: list[str]) -> Any:
        plain = all(isinstance(k, str) and not k.startswith("__") for k in value)
        if plain:
            return {k: self.encode(v, [*path, k]) for k, v in value.items()}
        items = []
        for k, v in value.items():
            if isinstance(k, bool) or not isinstance(k, (str, int)):
                where = ".".join(path) or "<root>"
                raise InvalidArgumentError(
                    f"State dict at {where!r} has a key {k!r} of type {type(k).__name__}; "
                    "only string and integer keys can be saved."
                )
            items.append([k, self.encode(v, [*path, str(k)])])
        return {"__dict__": items}


def flatten_state(
    state: Mapping[str, Any], prefix: str = ""
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split a nested state into named tensors and a JSON description.

    Args:
        state: A tree such as ``optimizer.state_dict()``.
        prefix: Prepended verbatim to every tensor name (e.g. ``"opt."``), so
            several states can share one checkpoint group.

    Returns:
        ``(tensors, meta)``: tensors named by their path in the tree, and a
        JSON-able dict to store in the checkpoint metadata.
    """
    if not isinstance(state, Mapping):
        raise InvalidArgumentError(
            f"flatten_state expects a mapping such as optimizer.state_dict(), got {type(state).__name__}."
        )
    walker = _Flattener(prefix)
    tree = walker.encode(state, [])
    return walker.tensors, {"format": STATE_FORMAT, "tree": tree}


def _decode(node: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(node, list):
        return [_decode(v, tensors) for v in node]
    if not isinstance(node, dict):
        return node
    if len(node) == 1:
        (tag, body), = node.items()
        if tag == "__tensor__":
            if body not in tensors:
                raise CheckpointError(
                    f"Saved state refers to tensor {body!r}, which the checkpoint does not hold; "
                    "the checkpoint is incomplete."
                )
            return tensors[body]
        if tag == "__tuple__":
            return tuple(_decode(v, tensors) for v in body)
        if tag == "__float__":
            if body not in ("nan", "inf", "-inf"):
                raise CheckpointError(f"Saved state holds an unknown float {body!r}.")
            return float(body)
        if tag == "__dict__":
            return {k: _decode(v, tensors) for k, v in body}
    return {k: _decode(v, tensors) for k, v in node.items()}


def unflatten_state(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> dict[str, Any]:
    """Rebuild the tree that :func:`flatten_state` split.

    Raises:
        CheckpointError: ``meta`` is not a flattened state, or names a tensor
            that ``tensors`` lacks.
    """
    if not isinstance(meta, Mapping) or meta.get("format") != STATE_FORMAT or "tree" not in meta:
        raise CheckpointError(
            f"State description is not in the {STATE_FORMAT!r} format; pass the meta that "
            "flatten_state returned."
        )
    try:
        tree = _decode(meta["tree"], tensors)
    except (TypeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"Saved state description is malformed ({exc}).") from exc
    if not isinstance(tree, dict):
        raise CheckpointError("Saved state description does not describe a dict.")
    return tree


def _differences(module: nn.Module, tensors: Mapping[str, torch.Tensor], strict: bool) -> list[str]:
    own = module.state_dict()
    lines = []
    if strict:
        missing = [k for k in own if k not in tensors]
        unexpected = [k for k in tensors if k not in own]
        if missing:
            lines.append("missing from the checkpoint: " + ", ".join(missing))
        if unexpected:
            lines.append("not in the module: " + ", ".join(unexpected))
    for name, t in tensors.items():
        mine = own.get(name)
        if mine is None:
            continue
        if tuple(t.shape) != tuple(mine.shape):
            lines.append(
                f"shape of {name}: checkpoint {list(t.shape)}, module {list(mine.shape)}"
            )
        if t.dtype != mine.dtype:
            lines.append(
                f"dtype of {name}: checkpoint {dtype_name(t.dtype)}, module {dtype_name(mine.dtype)}"
            )
    return lines


def load_into_module(
    module: nn.Module, tensors: Mapping[str, torch.Tensor], strict: bool = True
) -> None:
    """Copy checkpoint tensors into a module's parameters and buffers.

    Every difference is checked before anything is copied, so a refused
    checkpoint leaves the module unchanged.

    Args:
        module: The model; its tensors keep their device.
        tensors: Name -> tensor, e.g. a checkpoint's ``"model"`` group.
        strict: Refuse names missing on either side (shapes and dtypes must
            match either way).

    Raises:
        InvalidArgumentError: listing every missing, unexpected, shape and
            dtype difference.
    """
    lines = _differences(module, tensors, strict)
    if lines:
        listing = "\n  ".join(lines)
        raise InvalidArgumentError(
            f"The checkpoint does not match the {type(module).__name__} module:\n  {listing}\n"
            "Load a checkpoint saved from the same model (or pass strict=False to skip names "
            "present on one side only)."
        )
    module.load_state_dict(dict(tensors), strict=strict)
