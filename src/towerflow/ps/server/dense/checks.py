"""Whether a push fits a dense ps shard, and the sentences that say why not.

- :func:`check_header` — a push header's dtype, variables, size and learning
  rate against the shard's layout (a push that fails registers nothing);
- :func:`nonfinite_message` — the refusal of a gradient with a NaN / inf,
  naming the variable it is in.

Example:
    >>> from towerflow.ps.placement import plan_placement
    >>> from towerflow.ps.protocol import PushHeader
    >>> layout = plan_placement({"w": (2,)}, 1).shards[0]
    >>> header = PushHeader(worker_id=3, seq=1, token=0, lr=0.1, numel=2)
    >>> nonfinite_message(layout, header, 1).split(";")[0]
    "Gradient pushed by worker 3 to ps shard 0 contains NaN or inf in variable 'w' (shape [2])"
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from towerflow.errors import InvalidArgumentError
from towerflow.ps.placement import ShardLayout
from towerflow.ps.protocol import PushHeader, bounded

__all__ = ["check_header", "nonfinite_message"]

Signature = Sequence[tuple[str, tuple[int, ...]]]


def check_header(layout: ShardLayout, expected: Signature, header: PushHeader) -> None:
    """Raise :class:`InvalidArgumentError` unless the push matches the layout.

    Args:
        layout: the shard's layout.
        expected: ``layout.signature`` (the shard keeps it; computing it costs a pass).
        header: the push's header.
    """
    who = f"worker {header.worker_id}"
    if header.dtype != "float32":
        raise InvalidArgumentError(bounded(
            f"Gradient pushed by {who} to ps shard {layout.index} has dtype "
            f"{bounded(header.dtype, 64)}; the parameters are float32. Cast gradients to float32."
        ))
    if header.segments and header.segments != expected:
        raise InvalidArgumentError(_describe_mismatch(layout.index, expected, header, who))
    if header.numel != layout.numel:
        raise InvalidArgumentError(
            f"Gradient pushed by {who} to ps shard {layout.index} has {header.numel} "
            f"elements but the shard holds {layout.numel} "
            f"({_listing(expected)}); push gradients of the same model."
        )
    if not np.isfinite(header.lr) or header.lr <= 0:
        raise InvalidArgumentError(
            f"Learning rate {header.lr!r} pushed by {who} is not a positive number."
        )


def _describe_mismatch(index: int, signature: Signature, header: PushHeader, who: str) -> str:
    got = dict(header.segments)
    expected = dict(signature)
    problems = []
    for name, shape in signature:
        if name not in got:
            problems.append(f"variable {name!r} {list(shape)} is missing")
        elif tuple(got[name]) != tuple(shape):
            problems.append(f"variable {name!r} has shape {list(got[name])} but the "
                            f"parameter has shape {list(shape)}")
    problems += [f"unexpected variable {name!r} {list(shape)}"
                 for name, shape in header.segments if name not in expected]
    if not problems:
        problems.append("the variables are in a different order")
    shown = "; ".join(bounded(p, 200) for p in problems[:8])
    if len(problems) > 8:
        shown += f"; and {len(problems) - 8} more differences"
    return bounded(f"Gradient pushed by {who} to ps shard {index} does not "
                   f"match its parameters: {shown}. It was refused and the parameters "
                   "are unchanged; push gradients of the same model.")


def _listing(items: Signature) -> str:
    shown = ", ".join(f"{n} {list(s)}" for n, s in items[:8])
    return shown + (", ..." if len(items) > 8 else "")


def nonfinite_message(layout: ShardLayout, header: PushHeader, index: int) -> str:
    """The refusal message for a NaN / inf at buffer element ``index`` of the shard."""
    seg = layout.segment_at(index)
    return (f"Gradient pushed by worker {header.worker_id} to ps shard {layout.index} "
            f"contains NaN or inf in variable {seg.label!r} (shape {list(seg.shape)}); it "
            "was refused and the parameters are unchanged. Lower the learning rate or clip "
            "the gradients.")
