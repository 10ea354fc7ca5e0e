"""``towerflow.serving.load``: an export (or a chain) into the user's model, for inference.

The model is the class that was trained, built anew (its embeddings may be built on the
``meta`` device: their weights are replaced). Each table of the export is found in it by
name — the module whose ``table_name`` is the table's name, else the module at the path
the name spells (a swapped ``nn.Embedding`` / ``nn.EmbeddingBag`` and an unnamed table
are named by their path) — checked against the export (rows, dim) and replaced by a local
lookup (:mod:`towerflow.serving.lookup`) called as the module it replaces; the dense
parameters and buffers are loaded into the rest. Everything is read, verified and
matched before the model is touched, so a refused export leaves the model as it was.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from towerflow.errors import InvalidArgumentError
from towerflow.serving.chain import resolve_chain, table_state
from towerflow.serving.lookup import DynamicLookup, FixedLookup

__all__ = ["load", "table_modules"]

log = logging.getLogger("towerflow.serving")

_TABLE_ATTRS = ("num_rows", "dim", "table_name")


def _looks_like_table(module: nn.Module) -> bool:
    """A table of the ps tasks (``ShardedEmbedding`` and its kind): rows held elsewhere."""
    return all(hasattr(module, a) for a in _TABLE_ATTRS) and not isinstance(
        module, FixedLookup | DynamicLookup)


def _shape_of(module: nn.Module) -> tuple[int | None, int | None]:
    if isinstance(module, nn.Embedding | nn.EmbeddingBag):
        return module.num_embeddings, module.embedding_dim
    return getattr(module, "num_rows", None), getattr(module, "dim", None)


def table_modules(model: nn.Module, names: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """Which module of ``model`` each table is (table name -> module path), and problems.

    A problem: a table with no module, or a table module of the model with no table.
    """
    by_name = {getattr(m, "table_name", None): p for p, m in model.named_modules()
               if _looks_like_table(m) and getattr(m, "table_name", None)}
    modules = dict(model.named_modules())
    found: dict[str, str] = {}
    problems: list[str] = []
    for name in names:
        path = by_name.get(name, name)
        module = modules.get(path)
        if path and module is not None and (
                _looks_like_table(module) or isinstance(module, nn.Embedding | nn.EmbeddingBag)):
            found[name] = path
        else:
            problems.append(f"table {name!r} is no embedding module of the model (no module "
                            f"named {name!r}, none at that path)")
    taken = set(found.values())
    problems += [f"the model's table {p!r} is not in the export" for p, m in modules.items()
                 if _looks_like_table(m) and p not in taken]
    return found, problems


def _lookup(state: Any, module: nn.Module) -> nn.Module:
    mode = getattr(module, "mode", None)
    if state.weight is not None:
        return FixedLookup(state.weight, mode=mode)
    default = state.description.get("default")
    dtype = state.rows.dtype
    return DynamicLookup(state.keys, state.rows, mode=mode,
                         default=None if default is None else torch.tensor(default, dtype=dtype))


def _dense_problems(model: nn.Module, dense: dict[str, torch.Tensor],
                    paths: set[str]) -> list[str]:
    def inside(key: str) -> bool:
        return any(key == p or key.startswith(p + ".") for p in paths)

    want = {k: v for k, v in model.state_dict().items() if not inside(k)}
    problems = [f"{k} is missing from the export" for k in want if k not in dense]
    problems += [f"{k} is in the export, not in the model" for k in dense if k not in want]
    problems += [f"{k} has shape {tuple(dense[k].shape)} {dense[k].dtype} in the export, "
                 f"{tuple(want[k].shape)} {want[k].dtype} in the model"
                 for k in dense if k in want and (dense[k].shape != want[k].shape
                                                  or dense[k].dtype != want[k].dtype)]
    return problems


def load(path_or_chain: str | Path | Sequence[str | Path], model: nn.Module) -> nn.Module:
    """Fill ``model`` from an export (or a chain of them) for one-process inference.

    Args:
        path_or_chain: an export directory (a delta brings its chain, found by the base
            names it records), a directory of exports (its newest), or a list: a full
            export, then deltas in order.
        model: the trained model's class, built anew.

    Returns:
        ``model``, in eval mode with no parameter requiring a gradient, each table a :class:`~towerflow.serving.lookup.FixedLookup`
        or :class:`~towerflow.serving.lookup.DynamicLookup`: an ordinary ``nn.Module``
        that ``torch.export.export`` accepts.

    Raises:
        NotFoundError / CheckpointError: an export is missing, incomplete or damaged
            (the message names the file).
        InvalidArgumentError: the chain is out of order, or the model's tables or dense
            parameters do not match the export's (every difference listed).

    Example::

        model = towerflow.serving.load("exports/", ClickNet(1_000_000, 32))
        scores = model(ids)
    """
    chain = resolve_chain(path_or_chain)
    last = chain[-1]
    names = list(last.description["tables"])
    found, problems = table_modules(model, names)
    for name, path in found.items():
        rows, dim = _shape_of(model.get_submodule(path))
        table = last.description["tables"][name]
        want = (table["num_rows"] if table["kind"] == "fixed" else rows, table["dim"])
        if (rows, dim) != want:
            problems.append(f"table {name!r} is {want[0]} x {want[1]} in the export, "
                            f"{rows} x {dim} in the model ({path!r})")
    problems += _dense_problems(model, last.dense, set(found.values()))
    if problems:
        raise InvalidArgumentError(
            f"The model ({type(model).__name__}) does not match the export "
            f"{str(last.path)!r}: " + "; ".join(problems) + ". Load the export into the "
            "model class that was trained, built with the same sizes.")
    lookups = {path: _lookup(table_state(chain, name), model.get_submodule(path))
               for name, path in found.items()}
    for path, lookup in lookups.items():  # every check passed: now the model changes
        parent, _, attr = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, lookup)
    meta = any(t.is_meta for t in model.state_dict().values())
    model.load_state_dict(last.dense, strict=False, assign=meta)
    log.info("loaded serving export %s (step %d, %d table(s)) into %s", last.path, last.step,
             len(lookups), type(model).__name__)
    return model.eval().requires_grad_(False)  # inference: outputs carry no autograd graph
