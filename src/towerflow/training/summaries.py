"""TensorBoard summaries: scalars and histograms as event files in the train dir.

Article 001 writes the loss, the learning rate and histograms of every
variable and its gradient every 100 steps; :class:`SummaryWriter` does the
same through ``torch.utils.tensorboard`` (real ``events.out.tfevents.*``
files that TensorBoard reads).

Example:
    >>> import tempfile, torch
    >>> with SummaryWriter(tempfile.mkdtemp()) as writer:
    ...     writer.scalars(100, {"loss": 2.3, "learning_rate": 0.1})
    ...     writer.histograms(100, {"conv1.weight": torch.randn(8)})
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import nn

__all__ = ["SummaryWriter", "parameter_histograms"]


class SummaryWriter:
    """A TensorBoard event-file writer for one train dir.

    The event file is created with the first summary written: a run that
    writes none (a resumed run with nothing left to train) leaves no empty one.

    Args:
        logdir: the directory (created when missing).
        flush_secs: how often pending events reach the disk.
    """

    __slots__ = ("logdir", "_writer", "_flush_secs")

    def __init__(self, logdir: str | Path, flush_secs: int = 30) -> None:
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        self._flush_secs = flush_secs
        self._writer: Any = None

    def _events(self) -> Any:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter as _TBWriter

            self._writer = _TBWriter(log_dir=str(self.logdir), flush_secs=self._flush_secs)
        return self._writer

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        """Write one scalar summary per entry."""
        writer = self._events()
        for tag, value in values.items():
            writer.add_scalar(tag, value, global_step=step)

    def histograms(self, step: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Write one histogram per tensor (copied to the CPU)."""
        for tag, tensor in tensors.items():
            values = tensor.detach().float().cpu()
            if values.numel() and bool(torch.isfinite(values).all()):
                self._events().add_histogram(tag, values, global_step=step)

    def flush(self) -> None:
        """Write pending events now."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        if self._writer is not None:
            self._writer.close()

    def __enter__(self) -> SummaryWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def parameter_histograms(named: Iterable[tuple[str, nn.Parameter]]) -> dict[str, torch.Tensor]:
    """Tags as in article 001: ``conv1.weight`` for a value, ``conv1.weight/gradients``.

    Example:
        >>> lin = torch.nn.Linear(2, 1)
        >>> sorted(parameter_histograms(lin.named_parameters()))
        ['bias', 'weight']
    """
    tensors: dict[str, torch.Tensor] = {}
    for name, param in named:
        tensors[name] = param.detach()
        if param.grad is not None:  # a sparse gradient: its rows' values
            grad = param.grad.detach()
            tensors[f"{name}/gradients"] = grad.coalesce().values() if grad.is_sparse else grad
    return tensors
