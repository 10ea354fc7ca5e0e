"""What both halves say about a dynamic table: its options and its stats' names.

A dynamic table (:class:`~towerflow.ps.worker.tables.dynamic.DynamicEmbedding`
on a worker, :class:`~towerflow.ps.server.tables.dynamic.DynamicRowStore` on
a ps task) takes any int64 id, makes a row at an id's first admitted update,
and evicts rows; its options travel in ``TableSpec.store`` as
``{"kind": "dynamic", "admit_after", "evict_after_steps", "capacity"}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from towerflow.errors import InvalidArgumentError

__all__ = ["OPTIONS", "STAT_NAMES", "check_options"]

#: a dynamic table's options, in order
OPTIONS = ("admit_after", "evict_after_steps", "capacity")
#: the counters a dynamic table's stats hold
STAT_NAMES = ("rows", "admitted", "evicted", "filtered", "bytes")
_WAYS = {"admit_after": "1 makes a row at an id's first update",
         "evict_after_steps": "None keeps rows however old",
         "capacity": "None bounds nothing"}


def check_options(options: Any) -> dict[str, int | None]:
    """A dynamic table's ``{"admit_after", "evict_after_steps", "capacity"}``, checked.

    Raises:
        InvalidArgumentError: not such a dict; ``admit_after`` not an integer >= 1;
            ``evict_after_steps`` or ``capacity`` neither None nor an integer >= 1.

    Example:
        >>> check_options({"admit_after": 2, "evict_after_steps": None, "capacity": 10})
        {'admit_after': 2, 'evict_after_steps': None, 'capacity': 10}
    """
    if not isinstance(options, Mapping) or set(options) != set(OPTIONS):
        raise InvalidArgumentError(
            f"A dynamic table's options are a dict of exactly {list(OPTIONS)}, got "
            f"{options!r:.200}."
        )
    out: dict[str, int | None] = {}
    for name in OPTIONS:
        value = options[name]
        if value is None and name != "admit_after":
            out[name] = None
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < 2**31:
            raise InvalidArgumentError(
                f"{name}={value!r}: it must be an integer in [1, 2**31) ({_WAYS[name]})."
            )
        out[name] = value
    return out
