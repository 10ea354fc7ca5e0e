"""The dense shard's store: its parameters, optimizer state and their update.

A :class:`DenseStore` holds the parameters of the variables placed on this ps
task in **one contiguous float32 buffer** (layout in
:class:`~towerflow.ps.placement.ShardLayout`) and the server-side optimizer
with its state buffers, and applies updates to them. It knows nothing of who
pushed: the push table, the staging memory, the ledger and the waits are the
shard's admission (:mod:`~towerflow.ps.server.dense.admission`).

The buffer is guarded by one lock per partition of :data:`PARTITION`
elements, not by one lock for the shard: an update, a sum into a sync
accumulator or a pull's copy of a range takes the locks of that range only
(in ascending order), so several workers' pushes to one shard proceed side by
side and each range a pull copies is never half updated.

Example:
    >>> import numpy as np
    >>> from towerflow.ps.placement import plan_placement
    >>> from towerflow.ps.server.dense.optimizers import make_optimizer
    >>> layout = plan_placement({"w": (2,)}, 1).shards[0]
    >>> store = DenseStore(layout, np.zeros(2, np.float32), make_optimizer("sgd", 2))
    >>> store.apply(np.ones(2, np.float32), lr=0.5)
    >>> store.params.tolist()
    [-0.5, -0.5]
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator, Sequence

import numpy as np

from towerflow.errors import InvalidArgumentError
from towerflow.ps.placement import ShardLayout
from towerflow.ps.server.dense.optimizers import RESULT_LIMIT, ServerOptimizer, absmax
from towerflow.ps.wire.calls import bounded
from towerflow.ps.wire.finite import CHECK_BLOCK, first_nonfinite, scan_gradient
from towerflow.ps.wire.framing import CHUNK_BYTES, ITEM

__all__ = ["DenseStore", "PARTITION"]

#: elements per range lock of the flat buffer (one streamed chunk)
PARTITION = CHUNK_BYTES // ITEM


class DenseStore:
    """Parameters and optimizer of one ps task, and their update under range locks.

    Args:
        layout: the segments this shard holds.
        params: the initial values, ``layout.numel`` float32 elements (owned).
        optimizer: the server-side optimizer over the same number of elements.
    """

    def __init__(self, layout: ShardLayout, params: np.ndarray,
                 optimizer: ServerOptimizer) -> None:
        if params.dtype != np.float32 or params.ndim != 1 or params.size != layout.numel:
            raise InvalidArgumentError(
                f"Shard {layout.index} needs {layout.numel} float32 initial values in a flat "
                f"buffer, got {params.size} {params.dtype} values of shape {list(params.shape)}."
            )
        if optimizer.numel != layout.numel:
            raise InvalidArgumentError(
                f"The optimizer covers {optimizer.numel} elements but shard {layout.index} "
                f"holds {layout.numel}."
            )
        self.layout = layout
        self.params = params
        self.optimizer = optimizer
        #: one lock per PARTITION elements: guards those values of params, slots and sums
        self._range_locks = [threading.Lock()
                             for _ in range(max(1, -(-layout.numel // PARTITION)))]
        #: guards the optimizer's update count and its magnitude bounds
        self._optimizer_lock = threading.Lock()
        self._zeros = np.zeros(min(layout.numel, CHECK_BLOCK) or 1, np.float32)

    # -- updates ----------------------------------------------------------------
    @contextlib.contextmanager
    def ranges(self, first: int, stop: int) -> Iterator[None]:
        """Hold the range locks of elements ``first .. stop - 1`` (taken in ascending order)."""
        locks = self._range_locks[first // PARTITION:max(first, stop - 1) // PARTITION + 1]
        with contextlib.ExitStack() as stack:
            for lock in locks:
                stack.enter_context(lock)
            yield

    def apply(self, grad: np.ndarray, lr: float) -> None:
        """Apply the whole gradient ``grad`` with rate ``lr`` as one update of the optimizer.

        Each partition is updated under its range lock: a pull never sees
        part of the update applied to a range it copies.
        """
        update = self.begin_update()
        for start in range(0, grad.size, PARTITION):
            self.apply_range(start, grad[start:start + PARTITION], lr, update)

    def begin_update(self) -> int:
        """Number one more update of the optimizer (a gradient applied in pieces takes one)."""
        with self._optimizer_lock:
            return self.optimizer.begin()

    def apply_range(self, first: int, values: np.ndarray, lr: float, update: int) -> None:
        """Apply ``values`` to elements ``first ..`` as part of update number ``update``."""
        with self.ranges(first, first + values.size):
            self.optimizer.apply_range(self.params, first, values, lr, update)

    def add_range(self, into: np.ndarray, first: int, values: np.ndarray) -> None:
        """Add ``values`` to elements ``first ..`` of ``into`` (a sum over this shard's layout)."""
        with self.ranges(first, first + values.size):
            into[first:first + values.size] += values

    # -- the finite checks of an update ---------------------------------------------
    def find_nonfinite(self, values: np.ndarray, base: int = 0) -> int | None:
        """Index (in the shard buffer) of the first NaN / inf of ``values``, else None.

        ``values`` holds the buffer's elements from ``base`` on. The scan is a
        dot product with zeros (``x * 0`` is 0 for every finite ``x`` and NaN
        otherwise), which reads the values once and writes nothing.
        """
        bad = first_nonfinite(values, self._zeros)
        return None if bad is None else base + bad

    def scan(self, values: np.ndarray, base: int = 0) -> tuple[int | None, float]:
        """:meth:`find_nonfinite` and the sum of the squares of ``values``, in one pass
        (:func:`~towerflow.ps.wire.finite.scan_gradient`)."""
        bad, squares = scan_gradient(values, self._zeros)
        return (None if bad is None else base + bad), squares

    def check_update(self, parts: Sequence[tuple[int, np.ndarray]], lr: float, who: str,
                     grad_bound: float | None = None, applied: str = "nothing was applied"
                     ) -> None:
        """Raise unless applying ``parts`` with ``lr`` keeps every parameter and slot finite.

        ``grad_bound``: an upper bound of the gradient's magnitudes known already
        (the root of its squares' sum, from :meth:`scan`); else it is measured.
        An async push is checked chunk by chunk, each chunk as one update (the
        bounds kept are then looser than the buffers, and measured again when
        too loose); ``applied`` says in the refusal what of the push was applied.

        Raises:
            InvalidArgumentError: the update could overflow float32 (finite
                inputs, non-finite result); ``parts`` were not applied.
        """
        def measured() -> float:
            return max((absmax(values) for _, values in parts), default=0.0)

        loose = grad_bound is not None and math.isfinite(grad_bound)
        grad_max = grad_bound if loose else measured()
        with self._optimizer_lock:
            bound = self.optimizer.check_result(self.params, grad_max, lr)
            if bound is not None and loose:  # the root of the squares' sum was too loose
                grad_max = measured()
                bound = self.optimizer.check_result(self.params, grad_max, lr)
        if bound is not None:
            raise InvalidArgumentError(
                f"The update of {who} to ps shard {self.layout.index} (learning rate {lr:g}, "
                f"largest gradient {grad_max:.3g}) could take a parameter or optimizer slot of "
                f"{self.optimizer.name} to {bound:.3g}, past {RESULT_LIMIT:.3g} (float32 ends at "
                f"3.4e38); it was refused and {applied}. Lower the learning rate or clip the "
                "gradients."
            )

    # -- reads ----------------------------------------------------------------------
    def buffer(self, name: str) -> np.ndarray:
        """``params`` or one optimizer slot buffer by name."""
        if name == "params":
            return self.params
        slot = self.optimizer.slots.get(name)
        if slot is None:
            raise InvalidArgumentError(
                f"Shard {self.layout.index} has no buffer {bounded(repr(name), 100)}; it has "
                f"params{''.join(', ' + k for k in self.optimizer.slots)}."
            )
        return slot

    def read_chunks(self, name: str = "params", chunk_bytes: int = CHUNK_BYTES
                    ) -> Iterator[bytes]:
        """Yield a copy of buffer ``name`` in chunks, each copied under its range locks.

        The ``bytes`` of a chunk are the one copy a reply needs (gRPC sends
        ``bytes``): each is a consistent snapshot of its range.
        """
        raw = self.buffer(name).view(np.uint8)
        for start in range(0, raw.size, chunk_bytes):
            stop = min(start + chunk_bytes, raw.size)
            with self.ranges(start // ITEM, -(-stop // ITEM)):
                data = raw[start:stop].tobytes()
            yield data
