"""Every table of a model pulled in one request per ps task, as the model is written.

A model with many tables (one per field: DeepFM, wide-and-deep) looks them
up one after the other in its ``forward``; each lookup would be a request to
every ps task it touches, waited for before the next. Here the ids of every
lookup are known before the forward runs, so that all the tables' rows (and
their deferred pushes) travel in one ``RowBatch`` request per ps task
(:meth:`~towerflow.ps.worker.tables.client.TableClient.pull_many`).

How the ids are known: the first forward runs as written, and a
``TorchFunctionMode`` records the torch operations that produce each
table's ids from the forward's input tensors (``fields[3]``, ``x[:, 2]``,
``ids.long()``, ...): a *recipe*, which Python's control flow, lists and
shapes have already been decided for, since it is recorded from a real run.
Each later forward replays the recipe on its own inputs (a few indexing
operations) before the model's code runs, pulls every table's rows at once
and leaves them with the tables; a table's lookup takes them only when its
ids equal the predicted ones (``torch.equal``), else it pulls its own rows
as without prefetching. So a recipe that does not hold any more (a forward
whose control flow depends on the data) costs a wasted pull, never a wrong
row: the recipe is then recorded again, and after :data:`MAX_RECORDINGS`
recordings that do not hold, the model's tables are pulled one by one
with one log line that says so.

A recipe is refused (one line, tables pulled one by one) when the ids come
from an operation that draws random numbers (replaying it would change the
model's random stream) or writes into a tensor in place, or from the output
of a table.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from towerflow.ps.worker.tables.groups import Pulled, RowGroup

__all__ = ["Prefetcher", "MAX_RECORDINGS", "pull_ahead", "recording", "host_copies", "host_copy"]

log = logging.getLogger("towerflow.ps")

#: recordings of a recipe that did not hold before the tables are pulled one by one
MAX_RECORDINGS = 3
#: operations that draw random numbers: a recipe holding one is not replayed
_RANDOM = ("rand", "randn", "randint", "randperm", "bernoulli", "multinomial", "normal",
           "uniform", "dropout", "poisson", "exponential", "geometric", "cauchy", "log_normal",
           "random", "shuffle")

_local = threading.local()


def recording() -> _Recorder | None:
    """The recorder of the forward this thread runs, or None."""
    return getattr(_local, "recorder", None)


@contextlib.contextmanager
def host_copies(twins: Mapping[int, torch.Tensor]) -> Iterator[None]:
    """While the block runs (a step's forward), a batch tensor moved to the model's device
    has its host copy known (``twins``: ``id(moved) -> host tensor``, as
    :func:`towerflow.devices.move_to_device` fills it): the tables pull the rows of ids
    read from the host copy, not copied back from the device."""
    previous = getattr(_local, "twins", None)
    _local.twins = twins
    try:
        yield
    finally:
        _local.twins = previous


def host_copy(tensor: torch.Tensor) -> torch.Tensor | None:
    """The host copy of ``tensor`` (a batch tensor moved to the device this step), or None."""
    twins = getattr(_local, "twins", None)
    return None if not twins else twins.get(id(tensor))


class _Ref:
    """A value of a recipe: the forward's input tensor ``index``, or output ``index`` of step
    ``step`` (a tensor the forward did not make and got from elsewhere is kept as it is)."""

    __slots__ = ("step", "index")

    def __init__(self, step: int, index: int) -> None:
        self.step, self.index = step, index


class _Recorder(TorchFunctionMode):
    """Records the torch operations of one forward and where each table's ids come from."""

    def __init__(self, inputs: Sequence[Any]) -> None:
        super().__init__()
        self.made: dict[int, _Ref] = {}      # id(tensor) -> where it comes from
        self.keep: list[Any] = []            # every recorded tensor, alive (ids stay unique)
        self.steps: list[tuple[Callable[..., Any], Any, bool]] = []
        self.opaque: set[int] = set()        # ids of table outputs
        self.sites: list[tuple[nn.Module, _Ref | None]] = []
        self.suspended = 0
        for index, value in enumerate(inputs):
            if isinstance(value, torch.Tensor):
                self.made[id(value)] = _Ref(-1, index)
                self.keep.append(value)

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.suspended:
            return out
        leaves, _ = pytree.tree_flatten(out)
        made = [t for t in leaves if isinstance(t, torch.Tensor)]
        if not made:
            return out
        name = getattr(func, "__name__", "")
        unsafe = (name.endswith("_") and not name.endswith("__")) or "out" in kwargs \
            or any(word in name for word in _RANDOM)
        refs = pytree.tree_map(self._ref, (args, kwargs))
        step = len(self.steps)
        self.steps.append((func, refs, unsafe))
        for index, tensor in enumerate(leaves):
            if isinstance(tensor, torch.Tensor):
                self.made[id(tensor)] = _Ref(step, index)
                self.keep.append(tensor)
        return out

    def _ref(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return self.made.get(id(value), value)
        return value

    def site(self, module: nn.Module, ids: torch.Tensor) -> None:
        """A table's lookup of ``ids`` (called by the table's forward)."""
        ref = self.made.get(id(ids))
        self.sites.append((module, ref))

    def table_output(self, tensor: torch.Tensor) -> None:
        """A table's rows: ids made from them cannot be known before the forward."""
        self.opaque.add(id(tensor))
        self.keep.append(tensor)
        self.made.pop(id(tensor), None)

    def recipe(self, min_sites: int = 2) -> _Recipe | str:
        """The recipe of the recorded forward, or why there is none (fewer than
        ``min_sites`` lookups: nothing to gain)."""
        if len(self.sites) < min_sites:
            return "one table lookup" if self.sites else "no table lookup"
        needed: set[int] = set()
        stack = [ref.step for _, ref in self.sites if ref is not None and ref.step >= 0]
        if any(ref is None for _, ref in self.sites):
            return "a table's ids were not made by torch operations on the forward's inputs"
        while stack:
            step = stack.pop()
            if step in needed:
                continue
            needed.add(step)
            func, refs, unsafe = self.steps[step]
            if unsafe:
                return f"a table's ids come through {getattr(func, '__name__', func)!s}, " \
                       "which draws random numbers or writes in place"
            for leaf in pytree.tree_leaves(refs):
                if isinstance(leaf, _Ref) and leaf.step >= 0:
                    stack.append(leaf.step)
                elif isinstance(leaf, torch.Tensor) and id(leaf) in self.opaque:
                    return "a table's ids are made from another table's rows"
        order = sorted(needed)
        steps = [(self.steps[s][0], self.steps[s][1]) for s in order]
        renumber = {s: i for i, s in enumerate(order)}
        return _Recipe(steps, renumber, [(m, ref) for m, ref in self.sites])


class _Recipe:
    """The operations that make each table's ids from the forward's inputs."""

    def __init__(self, steps: list[tuple[Callable[..., Any], Any]], renumber: dict[int, int],
                 sites: list[tuple[nn.Module, _Ref]]) -> None:
        def local(value: Any) -> Any:
            if isinstance(value, _Ref) and value.step >= 0:
                return _Ref(renumber[value.step], value.index)
            return value

        self.steps = [(func, pytree.tree_map(local, refs)) for func, refs in steps]
        self.sites = [(module, local(ref)) for module, ref in sites]

        #: host copies of the recipe's tensors on a device (a buffer of offsets): id -> (version,
        #: tensor, copy); copied again when the tensor was changed in place
        self._host: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}

    def _on_host(self, tensor: torch.Tensor) -> torch.Tensor:
        kept = self._host.get(id(tensor))
        if kept is None or kept[1] is not tensor or kept[0] != tensor._version:
            kept = (tensor._version, tensor, tensor.detach().cpu())
            self._host[id(tensor)] = kept
        return kept[2]

    def replay(self, inputs: Sequence[Any], *,
               host: bool = False) -> list[tuple[nn.Module, torch.Tensor]]:
        """Each table's ids for a forward of ``inputs`` (flattened); ``host``: the inputs are
        the host copies of the forward's, and the recipe's own tensors on a device (a
        buffer) are taken from their host copies too."""
        results: list[list[Any]] = []

        def value(ref: Any) -> Any:
            if not isinstance(ref, _Ref):
                if host and isinstance(ref, torch.Tensor) and ref.device.type != "cpu":
                    return self._on_host(ref)
                return ref
            return inputs[ref.index] if ref.step < 0 else results[ref.step][ref.index]

        for func, refs in self.steps:
            args, kwargs = pytree.tree_map(value, refs)
            results.append(pytree.tree_leaves(func(*args, **kwargs)))
        return [(module, value(ref)) for module, ref in self.sites]


class Prefetcher:
    """Pulls all of a model's tables in one request per ps task before its forward.

    Installed on the model's root module (forward hooks) by the strategy when
    the model has at least two tables, or one table whose pull carries the
    dense push (``min_sites=1``).

    Args:
        model: the model.
        pull: ``pull_many([(table module, ids), ...])`` -> rows, one per lookup.
        min_sites: the fewest table lookups a forward's recipe is kept for.
        clear: forgets every table's rows pulled ahead (before a forward's are left).
    """

    def __init__(self, model: nn.Module, pull: Callable[[list[tuple[nn.Module, torch.Tensor]]],
                                                         None], *, min_sites: int = 2,
                 clear: Callable[[], None] = lambda: None) -> None:
        self._pull = pull
        self._clear = clear
        self._min_sites = min_sites
        self._recipe: _Recipe | None = None
        self._spec: Any = None
        self._recorder: _Recorder | None = None
        self.recordings = 0
        self.enabled = True
        self._stale = False
        #: this step's batch, the next step's (its host copy) and how its rows are pulled now
        #: (:meth:`feed`), the rows of this forward pulled during the step before
        self._batch: list[Any] = []
        self._upcoming: tuple[list[Any], Callable[[Any], Any]] | None = None
        self._ready: Any = None
        self.ahead_off: str | None = None  # why the next step's rows are not pulled ahead
        self._handles = [
            model.register_forward_pre_hook(self._before, with_kwargs=True),
            model.register_forward_hook(self._after, with_kwargs=True, always_call=True),
        ]

    def remove(self) -> None:
        """Take the hooks off the model."""
        for handle in self._handles:
            handle.remove()

    def missed(self) -> None:
        """A table's ids were not the predicted ones: the recipe is recorded again."""
        self._stale = True

    def feed(self, batch: Any, *, ready: bool, upcoming: Any = None,
             later: Callable[[list[tuple[nn.Module, torch.Tensor]]], Any] | None = None) -> None:
        """The step about to run: ``batch`` (the forward's tensors are among its tensors);
        ``ready``: the rows pulled during the step before are this batch's (else they are
        dropped); ``upcoming``: the next step's batch, whose rows ``later(lookups)`` pulls
        while this step runs (a future of ``[(module, entry)]``, :func:`pull_ahead`'s
        ``placed``). The next batch's ids are the recipe's replayed on it, the forward's
        inputs taken from the same places of the batch as this step's."""
        self._batch = [leaf for leaf in pytree.tree_leaves(batch) if isinstance(leaf, torch.Tensor)]
        if not ready:
            self._ready = None
        self._upcoming = None
        if upcoming is not None and later is not None:
            self._upcoming = ([leaf for leaf in pytree.tree_leaves(upcoming)
                               if isinstance(leaf, torch.Tensor)], later)

    def _install_ready(self) -> bool:
        """This forward's rows pulled during the step before, left with the tables."""
        ready, self._ready = self._ready, None
        if ready is None:
            return False
        placed = ready.result()
        self._clear()
        for module, entry in placed:
            module.prefetched.append(entry)
        return True

    def _pull_upcoming(self, leaves: list[Any]) -> None:
        """Replay the recipe on the next step's batch and have its rows pulled now."""
        upcoming, self._upcoming = self._upcoming, None
        if upcoming is None or self._recipe is None or self._stale:
            return
        batch, (later_batch, later) = self._batch, upcoming
        where = {id(t): j for j, t in enumerate(batch)}
        inputs: list[Any] = []
        for leaf in leaves:
            if not isinstance(leaf, torch.Tensor):
                inputs.append(leaf)
            elif id(leaf) in where and len(later_batch) == len(batch):
                nxt = later_batch[where[id(leaf)]]
                inputs.append(nxt if nxt.device.type == "cpu" else nxt.cpu())
            else:
                if self.ahead_off is None:
                    self.ahead_off = ("a tensor the forward is given is not one of the batch's "
                                      "as the step got it (made in the loss function?)")
                    log.info("the next step's rows are pulled at its start, not while this "
                             "step runs: %s", self.ahead_off)
                return
        try:
            with torch.no_grad():
                lookups = self._recipe.replay(inputs, host=True)
        except Exception as exc:  # noqa: BLE001 - the next batch's rows pulled at its step
            log.info("the next batch's table ids not predicted (%s)", str(exc)[:200])
            return
        self._ready = later(lookups)

    def _before(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if not self.enabled or recording() is not None or self._recorder is not None:
            return
        leaves, spec = pytree.tree_flatten((args, kwargs))
        installed = self._install_ready()
        if self._recipe is not None and not self._stale and spec == self._spec:
            if not installed:
                lookups = self._replay(self._recipe, leaves)
                if lookups is not None:
                    self._pull(lookups)
            self._pull_upcoming(leaves)
            return
        if self.recordings >= MAX_RECORDINGS:
            self.enabled = False
            log.warning("the model's tables are pulled with one request each per step: their "
                        "ids did not follow the same torch operations from the forward's "
                        "inputs in %d recorded steps", self.recordings)
            return
        self.recordings += 1
        self._stale, self._recipe, self._spec = False, None, spec
        self._recorder = _Recorder(leaves)
        _local.recorder = self._recorder
        self._recorder.__enter__()

    @staticmethod
    def _replay(recipe: _Recipe, leaves: list[Any]) -> list[tuple[nn.Module, torch.Tensor]] | None:
        """Each table's ids for this forward: replayed on the host copies of the inputs moved
        to the model's device this step (no ids back from the device), else on the inputs;
        None when the recipe does not apply (one line)."""
        hosts = [host_copy(leaf) if isinstance(leaf, torch.Tensor) else None for leaf in leaves]
        tries = [(leaves, False)]
        if any(host is not None for host in hosts):
            tries.insert(0, ([leaf if host is None else host
                              for leaf, host in zip(leaves, hosts, strict=True)], True))
        error: Exception | None = None
        for inputs, on_host in tries:
            try:
                with torch.no_grad():
                    return recipe.replay(inputs, host=on_host)
            except Exception as exc:  # noqa: BLE001 - a recipe that no longer applies
                error = exc
        log.info("table ids not predicted for this batch (%s); pulled one by one",
                 str(error)[:200])
        return None

    def _after(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        recorder, self._recorder = self._recorder, None
        if recorder is None:
            return
        recorder.__exit__(None, None, None)
        _local.recorder = None
        recipe = recorder.recipe(self._min_sites)
        if isinstance(recipe, str):
            self.enabled = False
            if len(recorder.sites) >= 2:
                log.warning("the model's %d table lookups are pulled with one request each per "
                            "step: %s", len(recorder.sites), recipe)
            return
        self._recipe = recipe


def pull_ahead(client: Any, views: Mapping[str, Any],
               lookups: Sequence[tuple[nn.Module, torch.Tensor]],
               unique: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
               dense: Mapping[int, bytes] | None = None,
               placed: list[tuple[nn.Module, Any]] | None = None) -> dict[int, bytes]:
    """Pull the rows of every ``(table module, ids)`` in one request per ps task and leave
    each table ``(ids, rows)`` in ``module.prefetched`` (``rows``: a
    :class:`~towerflow.ps.worker.tables.groups.Pulled`, or ``(RowGroup, member)`` for
    tables fused on the ps, looked up together; ``placed``: appended there as
    ``(module, (ids, rows))`` instead, for a later forward); each
    task's request also carries ``dense[task]`` (a dense push-and-pull): their replies.

    The lookups of tables fused on the ps (``views``: their offsets) are made
    unique together, as the ids of one table (one sort for all of them); each
    lookup's ids are checked against its own table first, so that no id reaches
    past its table into the next one's rows.
    """
    def put(module: nn.Module, entry: Any) -> None:
        if placed is None:
            module.prefetched.append(entry)
        else:
            placed.append((module, entry))

    groups: dict[Any, list[tuple[nn.Module, torch.Tensor, torch.Tensor]]] = {}
    for index, (module, ids) in enumerate(lookups):
        flat = module.config.partitioner.check(ids.reshape(-1).to("cpu", torch.int64))
        view = views.get(module.config.name)
        key = index if view is None else view.table.name  # a table alone, or its fused one
        groups.setdefault(key, []).append((module, ids, flat))
    pulls: list[tuple[Any, torch.Tensor]] = []
    plans: list[Callable[[torch.Tensor], None]] = []
    for members in groups.values():
        view = views.get(members[0][0].config.name)
        offsets = [] if view is None else [views[m.config.name].offset for m, _, _ in members]
        if view is None or len(set(offsets)) < len(members):  # a table alone, or looked up twice
            for module, ids, flat in members:
                ids_unique, inverse = unique(flat)
                pulls.append((module.config, ids_unique))
                plans.append(lambda rows, m=module, i=ids, u=ids_unique, v=inverse:
                             put(m, (i, Pulled(u, v, rows))))
            continue
        shifted = torch.cat([flat + offset for (_, _, flat), offset in
                             zip(members, offsets, strict=True)])
        together, inverse = unique(shifted)
        pulls.append((view.table, together))
        plans.append(lambda rows, t=view.table, ms=members, os=offsets, u=together, v=inverse:
                     _share(t, ms, os, u, v, rows, put))
    pulled, replies = client.pull_with_dense(pulls, dense or {})
    for plan, rows in zip(plans, pulled, strict=True):
        plan(rows)
    return replies


def _share(table: Any, members: Sequence[tuple[nn.Module, torch.Tensor, torch.Tensor]],
           offsets: Sequence[int], together: torch.Tensor, inverse: torch.Tensor,
           rows: torch.Tensor, put: Callable[[nn.Module, Any], None]) -> None:
    """Hand each fused table its part of the rows pulled for all of them together: the
    :class:`~towerflow.ps.worker.tables.groups.RowGroup` that looks them all up as one."""
    bounds = torch.tensor([[o, o + m.config.num_rows] for (m, _, _), o in
                           zip(members, offsets, strict=True)], dtype=torch.int64)
    starts, stops = (b.tolist() for b in torch.searchsorted(together, bounds).unbind(1))
    group = RowGroup(table, together, rows, inverse, [flat.numel() for _, _, flat in members],
                     list(zip(starts, stops, strict=True)), offsets)
    for member, (module, ids, _) in enumerate(members):
        put(module, (ids, (group, member)))
