"""Whether a push fits a dense ps shard, and the sentences that say why not.

- :func:`check_header` — a push header's dtype, variables, size and learning
  rate against the shard's layout (a push that fails registers nothing);
- :func:`nonfinite_message` — the refusal of a gradient with a NaN / inf,
  naming the variable it is in and what of the push was applied before it;
- :func:`voided_message` — why a sync step holding such a gradient was voided.

Example:
    >>> from towerflow.ps.placement import plan_placement
    >>> from towerflow.ps.wire.messages import PushHeader
    >>> layout = plan_placement({"w": (2,)}, 1).shards[0]
    >>> header = PushHeader(worker_id=3, seq=1, token=0, lr=0.1, numel=2)
    >>> "in variable 'w' (shape [2]), at element 1 of the shard" in nonfinite_message(
    ...     layout, header, 1)
    True
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from towerflow.errors import InvalidArgumentError
from towerflow.ps.placement import ShardLayout
from towerflow.ps.wire.calls import bounded
from towerflow.ps.wire.messages import PushHeader

__all__ = ["check_header", "nonfinite_message", "voided_message"]

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


def nonfinite_message(layout: ShardLayout, header: PushHeader, index: int,
                      applied: int = 0) -> str:
    """The refusal message for a NaN / inf at buffer element ``index`` of the shard.

    ``applied``: elements of the push applied before the chunk that holds it
    (an async push is applied chunk by chunk; that chunk and the rest are not).
    """
    seg = layout.segment_at(index)
    if applied:
        fate = (f"its first {applied} of {header.numel} values were applied before the chunk "
                "that holds it, the rest was refused (the parameters hold no NaN or inf)")
    else:
        fate = "it was refused and the parameters are unchanged"
    return (f"Gradient pushed by worker {header.worker_id} to ps shard {layout.index} "
            f"contains NaN or inf in variable {seg.label!r} (shape {list(seg.shape)}), at "
            f"element {index} of the shard; {fate}. Lower the learning rate or clip the "
            "gradients.")


def voided_message(layout: ShardLayout, header: PushHeader, index: int, step: int) -> str:
    """Why a sync step was voided: a push of it held a NaN / inf at buffer element ``index``."""
    seg = layout.segment_at(index)
    return (f"step {step} of ps shard {layout.index} was voided: the gradient pushed by worker "
            f"{header.worker_id} contains NaN or inf at element {index} in variable "
            f"{seg.label!r} (shape {list(seg.shape)}); no gradient of the step was applied. "
            "Compute the step again; lower the learning rate or clip the gradients.")
