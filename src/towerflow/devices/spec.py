"""``DeviceSpec``: TensorFlow's device names as an immutable value object.

A device name has up to five parts, each optional::

    /job:worker/replica:0/task:1/device:GPU:0
     ^^^^^^^^^^ ^^^^^^^^^ ^^^^^^ ^^^^^^^^^^^^
     job        replica   task   device type and index

The parser accepts every spelling the TensorFlow articles use (``/gpu:0``,
``/GPU:0``, ``/device:GPU:1``, ``GPU:1``, ``/cpu:0``) and PyTorch's
(``cuda:1``, ``cpu``), plus partial specs such as ``/job:ps/task:0``.
Parsing is cached, so turning the same string into a spec twice costs one
dictionary lookup.

Merge rule (as ``tf.DeviceSpec.make_merged_spec``): every field that is set in
the *other* spec wins; fields it leaves unset keep this spec's value. That is
how an inner ``towerflow.device`` scope is filled from the outer one.

Example:
    >>> DeviceSpec.from_string("/job:worker/task:1").make_merged_spec(
    ...     DeviceSpec.from_string("/gpu:0")).to_string()
    '/job:worker/task:1/device:GPU:0'
"""

from __future__ import annotations

from typing import Any

import torch

from towerflow.errors import InvalidArgumentError

__all__ = ["DeviceSpec", "ACCEPTED_FORMS"]

ACCEPTED_FORMS = (
    "'/job:<name>/replica:<n>/task:<n>/device:<CPU|GPU>:<n>' (any part may be left out), "
    "'/cpu:0', '/gpu:0', '/GPU:0', '/device:GPU:1', 'GPU:1', 'cuda:1' or 'cpu'"
)

# lower-case spelling -> canonical TensorFlow device type
_DEVICE_TYPES = {"cpu": "CPU", "gpu": "GPU", "cuda": "GPU"}
_FIELDS = ("job", "replica", "task", "device_type", "device_index")
_PARSE_CACHE: dict[str, DeviceSpec] = {}
_PARSE_CACHE_LIMIT = 4096


class _ParseError(Exception):
    """Internal: the reason a device string is malformed."""


class DeviceSpec:
    """An immutable, hashable device name (TensorFlow's ``DeviceSpec``).

    Attributes:
        job: job name (``"worker"``, ``"ps"``, ``"localhost"``) or ``None``.
        replica: replica index or ``None``.
        task: task index within the job or ``None``.
        device_type: ``"CPU"`` or ``"GPU"`` (upper case, TensorFlow style) or ``None``.
        device_index: index of the device of that type or ``None`` (any).

    Example:
        >>> spec = DeviceSpec.from_string("/gpu:1")
        >>> spec.to_string(), spec.to_torch()
        ('/device:GPU:1', device(type='cuda', index=1))
    """

    __slots__ = ("job", "replica", "task", "device_type", "device_index", "_hash")

    job: str | None
    replica: int | None
    task: int | None
    device_type: str | None
    device_index: int | None

    def __init__(
        self,
        job: str | None = None,
        replica: int | None = None,
        task: int | None = None,
        device_type: str | None = None,
        device_index: int | None = None,
    ) -> None:
        values = _validated(job, replica, task, device_type, device_index)
        for name, value in zip(_FIELDS, values, strict=True):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_hash", hash(values))

    # ----------------------------------------------------------------- parsing
    @classmethod
    def from_string(cls, spec: str | DeviceSpec | torch.device | None) -> DeviceSpec:
        """Parse a device name; ``None`` or ``""`` give the empty spec.

        Raises:
            InvalidArgumentError: the string is malformed; the message names it
                and lists the accepted forms.
        """
        if isinstance(spec, DeviceSpec):
            return spec
        if spec is None:
            return _EMPTY
        if isinstance(spec, torch.device):
            return cls._from_torch(spec)
        if not isinstance(spec, str):
            raise InvalidArgumentError(
                f"Invalid device specification {spec!r}: expected a string, a DeviceSpec, "
                f"a torch.device or None; accepted forms are {ACCEPTED_FORMS}."
            )
        cached = _PARSE_CACHE.get(spec)
        if cached is not None:
            return cached
        try:
            parsed = cls(**_parse(spec))
        except _ParseError as exc:
            raise InvalidArgumentError(
                f"Invalid device specification {spec!r}: {exc}; accepted forms are "
                f"{ACCEPTED_FORMS}."
            ) from None
        if len(_PARSE_CACHE) < _PARSE_CACHE_LIMIT:
            _PARSE_CACHE[spec] = parsed
        return parsed

    @classmethod
    def _from_torch(cls, device: torch.device) -> DeviceSpec:
        device_type = _DEVICE_TYPES.get(device.type)
        if device_type is None:
            raise InvalidArgumentError(
                f"Invalid device specification {str(device)!r}: towerflow places operations "
                f"on CPU and GPU (cuda) devices only; accepted forms are {ACCEPTED_FORMS}."
            )
        index = device.index
        if device_type == "CPU" and index is None:
            index = 0
        return cls(device_type=device_type, device_index=index)

    # --------------------------------------------------------------- behaviour
    def to_string(self) -> str:
        """Return TensorFlow's canonical form, e.g. ``/job:worker/replica:0/task:1/device:GPU:0``.

        Example:
            >>> DeviceSpec.from_string("cuda:1").to_string()
            '/device:GPU:1'
        """
        parts = []
        if self.job is not None:
            parts.append(f"/job:{self.job}")
        if self.replica is not None:
            parts.append(f"/replica:{self.replica}")
        if self.task is not None:
            parts.append(f"/task:{self.task}")
        if self.device_type is not None:
            index = "*" if self.device_index is None else str(self.device_index)
            parts.append(f"/device:{self.device_type}:{index}")
        return "".join(parts)

    def replace(self, **fields: Any) -> DeviceSpec:
        """Return a copy with the given fields replaced (validated like the constructor).

        Example:
            >>> DeviceSpec.from_string("/gpu:0").replace(device_index=3).to_string()
            '/device:GPU:3'
        """
        unknown = sorted(set(fields) - set(_FIELDS))
        if unknown:
            raise InvalidArgumentError(
                f"DeviceSpec.replace got unknown field(s) {unknown}; the fields are "
                f"{', '.join(_FIELDS)}."
            )
        values = {name: getattr(self, name) for name in _FIELDS}
        values.update(fields)
        return DeviceSpec(**values)

    def make_merged_spec(self, other: DeviceSpec) -> DeviceSpec:
        """Return this spec with every field that ``other`` sets taken from ``other``.

        Example:
            >>> outer = DeviceSpec.from_string("/job:ps/task:0/cpu:0")
            >>> outer.make_merged_spec(DeviceSpec.from_string("/gpu:1")).to_string()
            '/job:ps/task:0/device:GPU:1'
        """
        other = DeviceSpec.from_string(other)
        values = {}
        for name in _FIELDS:
            value = getattr(other, name)
            values[name] = getattr(self, name) if value is None else value
        return DeviceSpec(**values)

    def to_torch(self) -> torch.device:
        """Return the local ``torch.device``: GPU:i -> ``cuda:i``, CPU or no type -> ``cpu``.

        The job, replica and task parts are placement metadata and do not
        change the local device.
        """
        if self.device_type == "GPU":
            return torch.device("cuda", self.device_index) if self.device_index is not None \
                else torch.device("cuda")
        return torch.device("cpu")

    @property
    def is_empty(self) -> bool:
        """True when no field is set."""
        return all(getattr(self, name) is None for name in _FIELDS)

    # ------------------------------------------------------------ value object
    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"DeviceSpec is immutable; use replace({name}=...) instead")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("DeviceSpec is immutable")

    def _key(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in _FIELDS)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DeviceSpec):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return self._hash  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        return f"DeviceSpec({self.to_string()!r})"

    def __str__(self) -> str:
        return self.to_string()

    def __reduce__(self) -> tuple[Any, ...]:
        return (DeviceSpec, self._key())


def _validated(
    job: str | None,
    replica: int | None,
    task: int | None,
    device_type: str | None,
    device_index: int | None,
) -> tuple[Any, ...]:
    if job is not None and (not isinstance(job, str) or not job or "/" in job or ":" in job):
        raise InvalidArgumentError(
            f"Invalid job name {job!r}: expected a non-empty name without '/' or ':'."
        )
    for name, value in (("replica", replica), ("task", task), ("device_index", device_index)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 0
        ):
            raise InvalidArgumentError(
                f"Invalid {name} {value!r}: expected a non-negative integer or None."
            )
    if device_type is not None:
        canonical = _DEVICE_TYPES.get(str(device_type).lower())
        if canonical is None:
            raise InvalidArgumentError(
                f"Invalid device type {device_type!r}: expected 'CPU' or 'GPU'."
            )
        device_type = canonical
    return (job, replica, task, device_type, device_index)


def _parse_index(text: str, what: str) -> int | None:
    if text == "*":
        return None
    if not text.isdigit() or not text.isascii():
        raise _ParseError(f"{what} {text!r} is not a non-negative integer")
    return int(text)


def _parse_torch_style(spec: str) -> dict[str, Any] | None:
    """``cpu``, ``cuda``, ``cuda:1``, ``gpu:1``, ``CPU:0`` (no leading slash)."""
    name, _, index = spec.partition(":")
    device_type = _DEVICE_TYPES.get(name.lower())
    if device_type is None or "/" in spec:
        return None
    if not index:
        if ":" in spec:
            raise _ParseError("the device index is missing after ':'")
        return {"device_type": device_type, "device_index": 0 if device_type == "CPU" else None}
    return {"device_type": device_type, "device_index": _parse_index(index, "device index")}


def _parse(spec: str) -> dict[str, Any]:
    text = spec.strip()
    if not text:
        return {}
    if not text.startswith("/"):
        torch_style = _parse_torch_style(text)
        if torch_style is not None:
            return torch_style
        text = "/" + text
    fields: dict[str, Any] = {}
    for part in text[1:].split("/"):
        _parse_part(part, fields)
    return fields


def _set_once(fields: dict[str, Any], name: str, value: Any, part: str) -> None:
    if name in fields:
        what = "two device types" if name == "device_type" else f"{name} given twice"
        raise _ParseError(f"{what} (at {part!r})")
    fields[name] = value


def _parse_part(part: str, fields: dict[str, Any]) -> None:
    if not part:
        raise _ParseError("empty component (a doubled or trailing '/')")
    key, _, rest = part.partition(":")
    lower = key.lower()
    if lower == "job":
        if not rest or ":" in rest:
            raise _ParseError(f"job name missing or malformed in {part!r}")
        _set_once(fields, "job", rest, part)
    elif lower in ("replica", "task"):
        if not rest:
            raise _ParseError(f"{lower} index missing in {part!r}")
        _set_once(fields, lower, _parse_index(rest, f"{lower} index"), part)
    elif lower == "device":
        device_type, _, index = rest.partition(":")
        if device_type.lower() not in _DEVICE_TYPES:
            raise _ParseError(f"unknown device type {device_type!r} in {part!r}")
        _set_once(fields, "device_type", _DEVICE_TYPES[device_type.lower()], part)
        fields["device_index"] = _parse_index(index, "device index") if index else None
    elif lower in _DEVICE_TYPES:
        _set_once(fields, "device_type", _DEVICE_TYPES[lower], part)
        fields["device_index"] = _parse_index(rest, "device index") if rest else None
    else:
        raise _ParseError(f"unknown field {key!r}")


_EMPTY = DeviceSpec()
