"""Serving: a trained model and its tables exported for inference, and updated by deltas.

- :func:`export` writes an export from a train dir's newest checkpoint: the dense
  parameters and every table's keys and rows as safetensors, with a manifest of digests
  (:mod:`towerflow.serving.layout`), published atomically; with ``since=`` a delta of the
  rows changed and the ids removed since an earlier export.
- :func:`load` fills the user's model, built anew, from an export or a chain (a full
  export and its deltas): the dense parameters, and each table as a local lookup
  (:class:`FixedLookup`, :class:`DynamicLookup`). The result passes ``torch.export``.

It reads the checkpoint format only; it imports no server or cluster code.

Example::

    towerflow.export("runs/click", "exports/full-00001000")
    model = towerflow.serving.load("exports/full-00001000", ClickNet(1_000_000, 32))
"""

from __future__ import annotations

from towerflow.serving.chain import resolve_chain
from towerflow.serving.exporting import Source, export, export_source, source_from_state
from towerflow.serving.layout import describe, export_name, table_entry, write_export
from towerflow.serving.load import load
from towerflow.serving.lookup import DynamicLookup, FixedLookup

__all__ = ["DynamicLookup", "FixedLookup", "Source", "describe", "export", "export_name",
           "export_source", "load", "resolve_chain", "source_from_state", "table_entry",
           "write_export"]
