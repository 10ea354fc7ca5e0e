"""Hybrid training: the tables on the ps tasks, the dense layers all-reduced among the workers.

``ParameterServer(cluster, task, dense="allreduce")`` (``towerflow train --ps 2
--workers 4 --dense allreduce``), the split recommendation systems moved to
(PERSIA's hybrid mode, HugeCTR, TorchRec):

- the model's sparse tables live on the ps tasks as with ``dense="ps"``: a
  batch's rows pulled in one request per ps task, each step's row gradients
  pushed with the next step's pull, applied exactly once by the ps's
  row-wise optimizers, asynchronously;
- the dense layers are replicated on every worker: their gradients are
  averaged each step by one ``torch.distributed`` all-reduce (NCCL on GPU
  workers, Gloo on CPU workers) and the user's ``torch.optim`` optimizer runs
  on every worker alike (:mod:`~towerflow.strategies.hybrid_dense`), so the
  dense step is synchronous and its parameters equal on every worker;
- ``embedding_staleness=N`` bounds the tables' lag: a worker's rows are
  pulled with at most N of its own steps' pushes not yet applied (0, the
  default: every push goes with the next pull, one request per ps task and
  step; N >= 1: told the next step's batch (``ahead``; the ``Trainer`` reads
  one batch ahead), a worker pulls its rows while this step runs, carrying the
  pushes of the step before, on one background thread
  (:mod:`~towerflow.strategies.hybrid_rows`): rows one step behind this
  worker's pushes, and a step waits for pushes older than N steps).

The workers form their process group from what started them: the chief (the
``chief`` task, else worker 0: rank 0) serves a ``TCPStore`` on a free port of
its host and tells the ps tasks where, in its ``Init``; the other workers read
it from ps task 0 (the authenticated channel they already have) and join. So
``towerflow launch``, torchrun, Slurm, Kubernetes and tasks started by hand all
work without another port. The store and Gloo's connections themselves are not
authenticated (as with ``Mirrored``): keep the workers' network private.

A global step is one synchronous step of every worker (``batches_per_step`` is
the number of workers). A checkpoint holds the dense layers and their optimizer
state from the chief and the tables from the ps tasks, consistent at its global
step: under the ``Trainer`` (which says the run's last step) the chief pauses the
others' next step while it reads the ps tasks, every push of theirs up to the
step applied and none after (:mod:`~towerflow.strategies.hybrid_dense`); a
checkpoint taken by hand between steps holds the tables as of that moment, as
an asynchronous ps job's does. It moves between this mode, ``dense="ps"`` and
one process. When a worker dies the all-reduce cannot go on: within
``step_timeout`` every worker stops with one sentence naming the worker that does
not answer (a worker waiting in the store, not in a collective, within seconds:
:mod:`~towerflow.strategies.hybrid_store`), and the job started again (by hand,
``towerflow launch --max-restarts``, torchrun's elastic restart) resumes from its
last checkpoint; its workers find the new chief's store by its new ``Init``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from towerflow.devices import DEVICE_ENV
from towerflow.devices.transfer import inputs_follow, move_to_device
from towerflow.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    TowerflowError,
    UnavailableError,
)
from towerflow.ps.worker.tables.prefetch import host_copies
from towerflow.ps.worker.tables.swap import WHOLE_ATTRIBUTE
from towerflow.strategies.base import LossFn, OptimizerConfig, StepResult
from towerflow.strategies.hybrid_dense import DenseReplica, sum_within, timedelta_of, worker_device
from towerflow.strategies.hybrid_rows import RowTraffic
from towerflow.strategies.hybrid_store import Words, group_endpoint, reach_store
from towerflow.strategies.mirrored import first_line
from towerflow.strategies.parameter_server import ParameterServer
from towerflow.strategies.ps_placement import check_trainable
from towerflow.strategies.ps_tables import (
    check_whole_tables,
    start_tables,
    table_groups,
    tables_from_weights,
    tables_to_restore,
)
from towerflow.strategies.single import as_ps_optimizer_state, load_ps_slots, optimizer_slots

__all__ = ["HybridParameterServer", "worker_device"]

log = logging.getLogger("towerflow.ps")

#: seconds a collective may wait for the other workers when no step timeout is set
_NO_STEP_TIMEOUT_S = 1800.0
#: seconds the others wait for a chief reading a checkpoint's tables from the ps tasks
_PAUSE_WAIT_S = 3600.0
#: seconds a waiting worker gives a peer's task server to answer "are you there?"
_PING_S = 2.0


class HybridParameterServer(ParameterServer):
    """``ParameterServer(..., dense="allreduce")``: see the module's docstring.

    Takes :class:`ParameterServer`'s arguments; ``mode`` must be ``async`` (the tables'),
    ``join`` and ``prefetch`` are refused; every ``sparse=True`` embedding's rows live on the
    ps tasks, small ones too (``whole_table_bytes`` None unless given: a small table kept
    whole would be all-reduced with the dense layers instead). ``embedding_staleness``: see above;
    ``backend``: ``nccl`` or ``gloo`` (default: NCCL on a GPU worker, else Gloo).
    """

    lockstep = True

    def __init__(self, cluster: Any = None, task: Any = None, mode: str = "async",
                 **options: Any) -> None:
        options.setdefault("whole_table_bytes", None)  # the user asked for tables on the ps
        super().__init__(cluster, task, mode, **options)
        from towerflow.devices.local import gpu_count
        from towerflow.strategies.mirrored import replicas_on_host

        here = replicas_on_host(self.cluster, self.task)
        named = self._device if options.get("device") is not None \
            or options.get("device_setter") is not None or os.environ.get(DEVICE_ENV) else None
        self._device, backend = worker_device(here.index(self.task), len(here), named,
                                              gpu_count(), self._backend)
        if backend not in ("nccl", "gloo") or (backend == "nccl" and self._device.type != "cuda"):
            raise InvalidArgumentError(
                f"backend={backend!r} for a worker on {self._device}: use 'nccl' on a GPU "
                "worker or 'gloo' (any worker).")
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)
        self._backend = backend
        self._dense: DenseReplica | None = None
        self._store: Any = None
        self._owns_group = False
        self._to_sync = True  # the first step gives every worker worker 0's parameters
        self._stop_vote = self._stop_agreed = self._stopping = False
        self._last_step: int | None = None  # said by the Trainer: checkpoints pause before it
        self._paused_at: int | None = None  # the chief paused the others after this step
        self._words: Words | None = None  # what the workers tell each other in the store
        self._starts = 0  # first steps synced (a restore syncs again)
        self._rows: RowTraffic | None = None  # embedding_staleness >= 1: pushes, pulls ahead
        self._upcoming: Any = None  # the next step's batch (ahead()), and the one whose rows
        self._promised: Any = None  # were pulled during the step before

    # -- facts ---------------------------------------------------------------------------
    @property
    def batches_per_step(self) -> int:
        """Every worker's batch: one global step is one synchronous step of all of them."""
        return self._world

    @property
    def embedding_staleness(self) -> int:
        return self._staleness

    @property
    def reads_ahead(self) -> bool:
        """With ``embedding_staleness`` >= 1 the next step's rows are pulled while this step
        runs (its pushes are sent before, on the same thread: no pulled row lags more than
        one step of this worker's pushes)."""
        return self._rows is not None and self._tables.prefetcher is not None

    def ahead(self, batch: Any) -> None:
        self._upcoming = batch

    @property
    def failure_way_out(self) -> str:
        return (" The workers' all-reduce group cannot go on without every worker: start "
                "the job again (every worker; the run resumes from the chief's latest "
                "checkpoint).")

    # -- setup -----------------------------------------------------------------------------
    def prepare(self, model: nn.Module,
                optimizer: OptimizerConfig | torch.optim.Optimizer) -> nn.Module:
        """Put the tables on the ps tasks, keep the dense layers here and join the workers'
        process group (the chief serves its store; the others wait for its ``Init``)."""
        from towerflow.ps.placement import plan_placement
        from towerflow.ps.worker.dense.client import PSClient

        config = self._bind_tables(model, optimizer)
        if not self._tables:
            whole = [path for path, m in model.named_modules() if getattr(m, WHOLE_ATTRIBUTE, False)]
            kept = (f" ({', '.join(map(repr, whole))}: sparse=True but under whole_table_bytes, "
                    "kept with the dense layers; whole_table_bytes=None, --whole-tables off, "
                    "keeps their rows on the ps)") if whole else ""
            raise InvalidArgumentError(
                f"dense='allreduce' (--dense allreduce) needs sparse tables on the ps tasks, and "
                f"{type(model).__name__} has none (no ShardedEmbedding, no nn.Embedding declared "
                f"sparse=True or over sparse_threshold_bytes){kept}. A dense model trains faster "
                "by all-reduce alone: towerflow train --replicas N (the Mirrored strategy).")
        check_trainable(list(model.named_parameters()), elastic=False, tables=True)
        model.to(self._device)
        self._hooks = [inputs_follow(model, self._device),
                       model.register_state_dict_pre_hook(lambda *_: self.settle())]
        self._opt = config
        self._dense = DenseReplica(model, config.build_named(model.named_parameters()),
                                   config.lr, self._device)
        self._start_server()
        num_ps = self.cluster.num_tasks("ps")
        self._client = PSClient(
            self.cluster, plan_placement([], num_ps), worker_id=self._rank,
            credentials=self._credentials, timeout=self._timeout, push_timeout=self._timeout,
            on_bad_gradient=self._policy)
        self._model = model
        if self._staleness:  # pushes, then the next step's pull, on one thread
            self._rows = RowTraffic(self._tables, self._outcome)
            self._tables.pull_ahead_always(model)
        self._join_group()
        return model

    def _join_group(self) -> None:
        """The chief: create the tables, serve the store, ``Init`` the ps tasks with its
        address; the others: wait for that ``Init`` and join at the address it names."""
        from dataclasses import replace

        import numpy as np

        from towerflow.cluster.spec import parse_address

        timeout = self._collective_timeout()
        if self._chief:
            start_tables(self._tables, None)
            job, index = self.task.job_name, self.task.task_index
            host = parse_address(self.cluster.task_address(job, index))[0]
            self._store = group_endpoint(host, self._world, timeout, master=True)
            address = f"{host}:{self._store.port}"
            self.client.initialize(
                [np.empty(0, np.float32)] * self.cluster.num_tasks("ps"), optimizer=self._opt,
                aggregation=replace(self.aggregation, rendezvous=address))
            self._initialised = True
        else:
            address = self._reach_store(timeout)
        if dist.is_initialized():
            raise FailedPreconditionError(
                "A torch.distributed process group already exists in this process; hybrid "
                "training makes its own among the workers. Destroy it first.")
        self._words = Words(self._store, self._rank, self._world)
        self._say("here", "that this worker is here")  # every worker first: the group forms at once
        self._listen("here", range(self._world), self._init_timeout,
                     "every worker to start (--init-timeout)", watch=False)
        try:
            dist.init_process_group(self._backend, store=dist.PrefixStore("towerflow/hybrid",
                                                                          self._store),
                                    rank=self._rank, world_size=self._world,
                                    timeout=timedelta_of(timeout))
        except RuntimeError as exc:  # a peer lost since it said "here", or not reached
            raise self._group_failure(
                exc, f"joining the workers' {self._backend} group at {address}",
                way_out="Check that every worker was started and that the workers reach each "
                "other (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME).") from exc
        self._owns_group = True
        log.info("worker %d joined the workers' %s all-reduce group (%d workers) at %s",
                 self._rank, self._backend, self._world, address)

    def _reach_store(self, timeout: float) -> str:
        """(Not the chief) the chief's store, at the address its ``Init`` named (read again
        from ps task 0 while it does not answer: :func:`~.hybrid_store.reach_store`)."""
        self.client.wait_until_initialized(self._init_timeout)
        self._store, address = reach_store(
            lambda: self.client.shards[0].status(timeout=self._timeout).rendezvous,
            rank=self._rank, world=self._world, timeout_s=timeout,
            init_timeout_s=self._init_timeout)
        return address

    def _collective_timeout(self) -> float:
        """The group's timeout: ``step_timeout`` (what may take longer, the workers wait
        for in the store: :class:`~towerflow.strategies.hybrid_store.Words`)."""
        step = self.aggregation.timeout
        return _NO_STEP_TIMEOUT_S if step is None else float(step)

    def _step_timeout(self) -> Any:
        step = self.aggregation.timeout
        return None if step is None else timedelta_of(float(step))

    def _listen(self, word: str, ranks: Any, timeout: float, what: str, *,
                watch: bool = True) -> None:
        """Wait for ``word`` from ``ranks`` (:class:`~.hybrid_store.Words`); ``watch`` (every
        worker joined): a peer's process gone ends the wait. A wait that fails, the store's
        error included, ends with :meth:`_group_failure`'s sentence."""
        try:
            self._words.hear(word, ranks, timeout,  # type: ignore[union-attr]
                             gone=self._peer_gone if watch else None)
        except RuntimeError as exc:  # NotHeard, or the store's torch.distributed.DistError
            raise self._group_failure(exc, f"the wait for {what}", way_out=None if watch else
                                      "Start every worker of the job (the job started again "
                                      "resumes from its last checkpoint).") from None

    def _say(self, word: str, what: str) -> None:
        """Tell the others ``word``; the store failing (its server, the chief, gone) ends
        with :meth:`_group_failure`'s sentence."""
        try:
            self._words.say(word)  # type: ignore[union-attr]
        except RuntimeError as exc:  # torch.distributed.DistError
            raise self._group_failure(exc, f"telling the others {what}") from None

    def _peer_gone(self) -> bool:
        """Whether the process of another worker is gone now: its task server refuses the
        connection (one that answers late is left to the wait's own timeout)."""
        if self._server is None:
            return False
        for task in self.cluster.replicas:
            if task != self.task:
                try:
                    self._server.ping(task.job_name, task.task_index, timeout=_PING_S)
                except UnavailableError:
                    return True
                except TowerflowError:
                    continue
        return False

    def _start_tables(self) -> None:
        """(The chief) a checkpoint's tables, or rows given since, onto the ps tasks."""
        pending, self._table_restore = self._table_restore, None
        if self._chief and (pending or self._tables.holds_starts()):
            start_tables(self._tables, pending, again=True)

    def _sync(self) -> None:
        """Before the first step (every worker together): the restored tables on the ps,
        then worker 0's parameters, buffers and step on every worker."""
        if not self._to_sync:
            return
        self._start_tables()
        self._starts += 1
        if self._chief:
            self._say(f"start/{self._starts}", "to start")
        self._listen(f"start/{self._starts}", [0], self._init_timeout,
                     "the chief's first step (its restore, its tables on the ps)")
        try:
            self._step = self._dense.broadcast(self._model, self._step, self._device)  # type: ignore[union-attr]
        except RuntimeError as exc:
            raise self._group_failure(exc, "the first step's broadcast") from None
        self._to_sync = False

    def broadcast_model(self) -> None:
        if self._model is not None:
            self._sync()

    # -- steps ---------------------------------------------------------------------------------
    def run_step(self, loss_fn: LossFn, batch: Any, *, lr: float | None = None) -> StepResult:
        """Pull the batch's rows, compute, push the row gradients, all-reduce the dense ones
        and apply them here with the local optimizer."""
        if self._model is None or self._dense is None:
            raise FailedPreconditionError("ParameterServer.run_step before prepare(model, optimizer).")
        self._sync()
        self._release_pause()
        rows_out = self._rows
        if rows_out is not None:
            rows_out.bound(self._step - self._staleness)
        dense, tables = self._dense, self._tables
        dense.zero_grads()
        twins: dict[int, torch.Tensor] = {}
        given, upcoming, self._upcoming = batch, self._upcoming, None
        batch = move_to_device(batch, self._device, twins)
        tables.forget()
        if self.reads_ahead:  # the next batch's rows pulled while this step runs
            ready, self._promised = given is self._promised, upcoming
            tables.prefetcher.feed(  # type: ignore[union-attr]
                batch, ready=ready, upcoming=upcoming,
                later=rows_out.pull_later)  # type: ignore[union-attr]
        with host_copies(twins):
            loss = loss_fn(self._model, batch)
        if rows_out is not None:  # the last step's pushes: with this forward's pull ahead
            rows_out.send_riding()
        loss.backward()
        rate = float(lr if lr is not None else self._opt.lr)
        rows = tables.take()
        bad = tables.nonfinite(rows) if rows else None
        try:
            reduced = dense.all_reduce(bad_tables=bad is not None, stop_vote=self._stop_vote,
                                       world=self._world, paused=self._paused,
                                       timeout=self._step_timeout())
        except RuntimeError as exc:
            raise self._group_failure(exc, f"the dense all-reduce of step {self._step + 1}") \
                from None
        self._stop_agreed = reduced.stop_votes > 0
        bad_dense = dense.nonfinite()
        if reduced.bad_tables or bad_dense:
            what = (f"the dense gradient of {bad_dense!r}" if bad_dense else
                    f"the row gradients of {reduced.bad_tables} worker(s)'s tables"
                    + (f" (here: {bad})" if bad else ""))
            message = (f"Step {self._step + 1}: {what} hold NaN or inf; the dense layers "
                       "are unchanged on every worker and no worker pushed its rows. Lower "
                       "the learning rate or clip the gradients.")
            if self._policy == "raise":
                raise InvalidArgumentError(message)
            log.warning("%s", message)
            return StepResult(loss=loss.detach(), global_step=self._step, applied=False)
        if rows:  # after the all-reduce: no push of this step reaches a paused chief's reading
            tables.push(rows, lr=rate, step=self._step + 1)
            if rows_out is not None:  # in the background: with the next pull ahead, or now
                rows_out.pushed(self._step + 1, ride=self._promised is not None)
        dense.step(lr)
        self._step += 1
        return StepResult(loss=loss.detach(), global_step=self._step)

    # -- a checkpoint consistent at one global step (hybrid_dense's pause) ----------------------
    def _may_pause(self) -> bool:
        """Whether the chief may pause the others' next step: they will take one (the
        ``Trainer`` said the run's last step, it is not reached, no stop was agreed), the
        group is whole and this step was not paused already."""
        return (self._chief and self._world > 1 and self._owns_group and not self._to_sync
                and not self._unfinished and not self._stopping and self._last_step is not None
                and self._step < self._last_step and self._paused_at != self._step)

    def _pause(self) -> None:
        """(The chief, at a checkpoint) hold the others before their next step's pushes, with
        every push of theirs up to this step applied."""
        if not self._may_pause():
            return
        try:
            self._dense.pause(self._step_timeout())  # type: ignore[union-attr]
        except RuntimeError as exc:
            raise self._group_failure(exc, f"the checkpoint's pause at step {self._step}") \
                from None
        self._listen(f"ready/{self._step}", self._words.others, _PAUSE_WAIT_S,  # type: ignore[union-attr]
                     f"the other workers' pushes before the checkpoint of step {self._step}")
        self._paused_at = self._step

    def _paused(self) -> None:
        """(Another worker, in a step the chief paused) this worker's pushes of the steps
        before applied, then wait for the chief's go."""
        self._settle_rows()
        self._say(f"ready/{self._step}", f"its pushes up to step {self._step} are applied")
        self._listen(f"go/{self._step}", [0], _PAUSE_WAIT_S,
                     f"the chief's checkpoint of step {self._step}")

    def _release_pause(self) -> None:
        paused, self._paused_at = self._paused_at, None
        if paused is not None:
            self._say(f"go/{paused}", f"to go on after the checkpoint of step {paused}")

    def _group_failure(self, error: BaseException, what: str,
                       way_out: str | None = None) -> UnavailableError:
        """The one sentence of a collective or a wait in the store that failed (``what``):
        the workers that do not answer, then ``way_out`` (default: every worker stops)."""
        self._unfinished = True
        missing = self.missing_peers()
        who = "; ".join(missing) if missing else "another worker stopped or stalled" + (
            " (no task server to ask which)" if self._server is None else "")
        return UnavailableError(
            f"Worker {self._rank}: {what} failed ({first_line(error)}): {who}. " + (way_out or
            "The workers' all-reduce group cannot go on without it, so every worker stops here."))

    def agree_to_stop(self, requested: bool) -> bool:
        """Every worker stops at the same step: this step's wish travels in the next step's
        all-reduce; the one read here is the wish of the step before."""
        self._stop_vote = bool(requested)
        agreed, self._stop_agreed = self._stop_agreed, False
        self._stopping = self._stopping or agreed
        return agreed

    def stop_at(self, last_step: int | None) -> None:
        """The run's last step (every worker counts the same steps): no checkpoint pauses
        the others there."""
        self._last_step = last_step

    def reduce_mean(self, value: torch.Tensor) -> torch.Tensor:
        total = value.detach().to(self._device, torch.float32).clone()
        try:
            sum_within(total, self._step_timeout(), None)
        except RuntimeError as exc:
            raise self._group_failure(exc, f"the all-reduce of the step log at step {self._step}") \
                from None
        return total / self._world

    def barrier(self) -> None:
        if self._owns_group:
            try:
                dist.barrier(device_ids=[self._device.index]) if self._backend == "nccl" \
                    else dist.barrier()
            except RuntimeError as exc:
                raise self._group_failure(exc, "the workers' barrier") from None

    def restore_checkpoint(self, read: Any) -> Any:
        """The chief reads the checkpoint; the others receive its dense part through the
        process group (no shared file system), so that every worker's optimizer state is the
        same; its tables (parts streamed from disk) go to the ps tasks from the chief."""
        from dataclasses import replace

        from towerflow.strategies.broadcast import share_read

        whole: list[Any] = [None]

        def dense_part() -> Any:
            whole[0] = ckpt = read()
            return None if ckpt is None else replace(ckpt, chunked={})

        def shared(read: Any) -> Any:
            try:
                return share_read(read, rank=self._rank, device=self._device)
            except RuntimeError as exc:  # a peer lost in the broadcast
                raise self._group_failure(exc, "the checkpoint's broadcast") from None

        if self._rank == 0:  # read before the others wait in a collective (the step timeout)
            try:
                part, error = dense_part(), None
            except TowerflowError as exc:
                part, error = None, exc
            self._say("read", "that the checkpoint is read")
            return whole[0] if shared(lambda: _given(part, error)) is not None else None
        self._listen("read", [0], self._init_timeout, "the chief to read its checkpoint")
        return shared(dense_part)

    @property
    def global_step(self) -> int:
        return self._step

    def settle(self) -> None:
        """This worker's pushes in flight and its deferred ones applied on the ps tasks."""
        if self._client is not None and self._tables:
            self._settle_rows()

    def _settle_rows(self) -> None:
        """Every push of this worker applied: the background thread's, then the deferred."""
        if self._rows is not None:
            self._rows.bound(self._step)
            self._rows.drain()
        self._tables.flush()

    # -- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The dense layers and their optimizer state (this worker's: every worker holds the
        same), the state by variable as a ps writes it, and the tables streamed from the ps
        tasks."""
        model, dense = self.model, self._dense
        self._start_tables()
        self._pause()
        self.settle()
        slots, optimizer_step = optimizer_slots(  # a ps's form: every strategy restores it
            dense.optimizer, {id(p): n for n, p in model.named_parameters()})  # type: ignore[union-attr]
        groups: dict[str, Any] = {
            "model": {n: t.detach().cpu() for n, t in model.state_dict().items()},
            "optimizer": slots}
        self._meta = {"global_step": self._step, "optimizer": self._opt.name,
                      "optimizer_step": optimizer_step or self._step, "mode": "async",
                      "dense": "allreduce"}
        table_group, description = table_groups(self._tables, self._table_part_bytes)
        groups.update(table_group)
        self._meta.update(description)
        return groups

    def load_state(self, groups: Mapping[str, Any],
                   metadata: Mapping[str, Any] | None = None) -> None:
        """Restore a checkpoint of any mode (hybrid, ``dense="ps"``, one process): the dense
        layers and their optimizer state here, the tables by the chief before the first step."""
        from towerflow.checkpoint import load_into_module

        if self._model is None or self._dense is None:
            raise FailedPreconditionError("load_state before prepare(model, optimizer).")
        if self._starts:
            raise FailedPreconditionError(
                "A hybrid job restores a checkpoint before its first step, every worker "
                "together (the Trainer and the Supervisor do); this one has trained. Start the "
                "job again to resume from the checkpoint.")
        model_group = groups.get("model")
        if model_group is None:
            raise InvalidArgumentError(
                f"The checkpoint has no 'model' group (groups: {sorted(groups)}).")
        check_whole_tables(self._model, metadata)
        rest = tables_from_weights(self._tables, groups, model_group, chief=self._chief)
        load_into_module(self._model, rest)
        metadata = dict(metadata or {})
        groups, metadata = as_ps_optimizer_state(self._model, self._opt, groups, metadata)
        load_ps_slots(self._model, self._dense.optimizer, str(metadata.get("optimizer", "")),
                       groups.get("optimizer", {}),
                       int(metadata.get("optimizer_step", metadata.get("global_step", 0))))
        if self._chief and len(rest) == len(model_group):
            self._table_restore = tables_to_restore(groups, metadata)
        self._step = int(metadata.get("global_step", 0))
        self._to_sync = True

    # -- lifetime ----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """The pushes in flight, then :meth:`ParameterServer.shutdown`, then leave the group."""
        try:
            with contextlib.suppress(Exception):  # a paused step goes on (and finds no chief)
                self._release_pause()
            rows_out, self._rows = self._rows, None
            if rows_out is not None:
                rows_out.close(wait=not self._unfinished)
            super().shutdown()
        finally:
            if self._owns_group and dist.is_initialized():
                dist.destroy_process_group()
            self._owns_group, self._store, self._dense = False, None, None

    def __repr__(self) -> str:
        return (f"ParameterServer(dense='allreduce', rank={self._rank}, world_size={self._world}, "
                f"device={str(self._device)!r}, backend={self._backend!r}, "
                f"embedding_staleness={self._staleness})")


def _given(ckpt: Any, error: BaseException | None) -> Any:
    """``ckpt``, or ``error`` raised (what the chief read before the others listened)."""
    if error is not None:
        raise error
    return ckpt

