"""``ParameterServer``: parameters and optimizer state on ps tasks, gradients from workers.

Article 003's roles: ps tasks hold the variables and apply updates; every worker pulls the
parameters, computes gradients on its own device (its GPU when it has one) and pushes them;
the chief (the ``chief`` job's task, else worker 0) creates the sparse tables on the ps tasks
before :meth:`~ParameterServer.prepare` returns (a forward, an evaluation or a checkpoint
works from then on) and initialises the dense parameters, or restores both from a checkpoint,
at its first forward, step or checkpoint; the other workers' ``prepare`` waits until it has.

On the worker, each ps shard's parameters and gradients are one flat buffer (``.data`` and
``.grad`` are views into them): a push sends the gradient buffer without a gather, and brings
the fresh parameters back in the same round trip, landing in place (rows: pinned on a GPU).

A worker runs its task's :class:`~towerflow.cluster.Server` while it trains (its own, started
by :meth:`~ParameterServer.prepare`, stopped by :meth:`~ParameterServer.shutdown`, or
``server=``), so the ps tasks' heartbeats reach it and a dead or suspended worker is named.

An **elastic worker** (``join=True``; ``towerflow train --join``) joins a running ``async``
job with no task of its own (:mod:`~towerflow.strategies.ps_elastic`). A model's sparse
tables are bound, created, checkpointed and moved by :mod:`~towerflow.strategies.ps_tables`;
``dense="allreduce"`` keeps the dense layers on the workers (:mod:`~towerflow.strategies.hybrid`).

Example (in a worker process of a cluster with a ps job)::

    strategy = ParameterServer(cluster, TaskInfo("worker", 1), mode="sync")
    model = strategy.prepare(model, OptimizerConfig("momentum", lr=0.05, momentum=0.9))
    result = strategy.run_step(loss_fn, batch)      # result.global_step, result.applied
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

import torch
from torch import nn

from towerflow.devices.transfer import compute_device, inputs_follow, move_to_device
from towerflow.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    UnavailableError,
)
from towerflow.ps.placement import DEFAULT_PS_STRATEGY
from towerflow.ps.wire.calls import DEFAULT_MAX_ELASTIC
from towerflow.ps.worker.dense.variables import (
    DenseRestore,
    FlatBuffers,
    consistent_snapshot,
    dense_groups,
    dense_restore,
)
from towerflow.ps.worker.tables.prefetch import host_copies
from towerflow.ps.worker.tables.swap import DEFAULT_SPARSE_THRESHOLD, SMALL_TABLE_BYTES
from towerflow.strategies.base import LossFn, OptimizerConfig, StepResult, Strategy
from towerflow.strategies.ps_carry import DenseCarrier
from towerflow.strategies.ps_elastic import join_running_job, joining_cluster
from towerflow.strategies.ps_peers import task_server, wait_for_workers
from towerflow.strategies.ps_placement import (
    DenseModes,
    check_dense_mode,
    check_replicas,
    check_trainable,
    plan_variables,
)
from towerflow.strategies.ps_tables import (
    attach_tables,
    check_whole_tables,
    start_tables,
    table_groups,
    tables_from_weights,
    tables_to_restore,
)
from towerflow.strategies.single import as_ps_optimizer_state

__all__ = ["ParameterServer"]

log = logging.getLogger("towerflow.ps")


class ParameterServer(DenseModes, Strategy):
    """Train with parameters held by the cluster's ps tasks.

    Args:
        cluster: the ``ClusterSpec`` (default: resolved from the environment).
        task: this process's ``TaskInfo`` (a ``chief`` or ``worker`` task).
        mode: ``async``, ``sync`` or ``ssp``.
        replicas_to_aggregate: sync: gradients averaged per step (default: all
            replicas; fewer leaves the rest as backup workers).
        staleness: ssp: how many pushes a worker may run ahead of the slowest.
        device: where this worker computes (default: ``TOWERFLOW_DEVICE`` when set, else
            its first GPU when it has one, else the CPU).
        credentials: the cluster credentials (default: from the environment).
        ps_strategy: placement of variables: ``greedy`` (default: each on the ps task
            holding the fewest bytes so far) or ``round_robin`` (in turn). A
            ``device_setter`` given instead places them by its own rule.
        partition_threshold_bytes: variables above this are split across ps tasks.
        timeout: deadline of each call to a ps task, seconds.
        step_timeout: how long a sync / ssp push may wait for the other workers, seconds;
            None: for ever (sent again after each call deadline, logged every few tries).
        init_timeout: how long a non-chief waits for the chief to initialise.
        on_bad_gradient: ``raise`` or ``skip`` a NaN / inf gradient.
        prefetch: push and pull in the background while the loop prepares the next batch.
        is_chief: override the cluster's rule (the ``chief`` task, else worker 0).
        device_setter: a :func:`towerflow.replica_device_setter` result (its placement and
            worker device; a model built under it keeps the ps tasks it was given).
        server: this task's running ``Server`` (used, not stopped); True (default): start
            one in :meth:`prepare` and stop it in :meth:`shutdown` — if it cannot listen (the
            port is taken, or a non-loopback address has no cluster secret) training goes on
            without it and a warning says the heartbeats will miss this task; False: none.
        bind_host: the interface the server started here listens on instead of the host
            the cluster names (``ServerOptions.bind_host``, e.g. ``"0.0.0.0"`` in a pod whose
            Service name resolves only once it runs); one that cannot listen there is an error.
        sparse_threshold_bytes: every ``nn.Embedding`` / ``nn.EmbeddingBag``
            declared ``sparse=True`` or whose weight has this many bytes or more
            (default 64 MiB) becomes a sparse table on the ps tasks (only a
            batch's rows travel; ``towerflow.ps.worker.tables.swap``), starting
            from the module's own values, announced by one line each; None:
            none (only explicit ``ShardedEmbedding`` modules). One module stays
            dense with ``towerflow.ps.keep_dense(module)``.
        whole_table_bytes: a ``sparse=True`` embedding under this (256 KiB) travels whole with
            the dense variables when its optimizer updates it alike (faster); None: rows.
        table_part_bytes: bytes of a sparse table's rows and slots per checkpoint
            file (default 64 MiB): saving or restoring a table holds one such part.
        join: join a running async job as an elastic worker (see above; ``task`` None).
        max_elastic_workers: (the chief) how many elastic workers each ps task
            admits at once (async mode; 0: none).
        dense_with_rows: async, a model with tables and small dense shards (a click
            model): each step's dense push travels with the next step's table pull,
            one request per ps task and step (``towerflow.strategies.ps_carry``;
            ``StepResult.global_step`` as with ``prefetch``; the model lags this step's
            dense update until then, :meth:`settle`). False: in its own.
        dense: ``ps`` (default) or ``allreduce``: hybrid training, the tables on the ps
            tasks and the dense layers all-reduced among the workers
            (:mod:`towerflow.strategies.hybrid`, with ``embedding_staleness`` and
            ``backend``).
        replicas: (the chief) live copies of each dense shard: 0 (default) none; 1: shard
            ``i``'s on ps task ``(i + 1) % n``, a push (sync: its step) acknowledged once it
            has it (``towerflow.ps.server.terms``; every mode; no dynamic tables yet).
    """

    name = "ps"

    def __init__(self, cluster: Any = None, task: Any = None, mode: str = "async", *,
                 replicas_to_aggregate: int | None = None, staleness: int = 2,
                 device: str | torch.device | None = None, credentials: Any = None,
                 ps_strategy: str | None = None, partition_threshold_bytes: int | None = None,
                 timeout: float = 30.0, step_timeout: float | None = 120.0,
                 init_timeout: float = 300.0, on_bad_gradient: str = "raise",
                 prefetch: bool = False, is_chief: bool | None = None,
                 device_setter: Any = None, server: Any = True,
                 bind_host: str | None = None,
                 sparse_threshold_bytes: int | None = DEFAULT_SPARSE_THRESHOLD,
                 whole_table_bytes: int | None = SMALL_TABLE_BYTES,
                 table_part_bytes: int | None = None, join: bool = False,
                 max_elastic_workers: int = DEFAULT_MAX_ELASTIC,
                 dense_with_rows: bool = True, dense: str = "ps",
                 embedding_staleness: int | None = None, backend: str | None = None,
                 replicas: int = 0) -> None:
        from towerflow.cluster import resolve_cluster
        from towerflow.ps.wire.messages import AggregationConfig

        if join:
            cluster = joining_cluster(cluster, task, mode, is_chief)
        elif cluster is None or task is None:
            cluster, task = resolve_cluster(cluster, getattr(task, "job_name", None),
                                            getattr(task, "task_index", None))
        if cluster is None or (task is None and not join) or "ps" not in cluster.jobs:
            raise InvalidArgumentError(
                "ParameterServer needs a cluster with a 'ps' job and this task's job and index; "
                "pass cluster= and task=, or start the process with TF_CONFIG "
                "(towerflow launch --ps 1 --workers 2 -- ...)."
            )
        self._staleness, self._backend = check_dense_mode(
            dense, embedding_staleness, backend, mode=mode, join=join, prefetch=prefetch)
        if on_bad_gradient not in ("raise", "skip"):
            raise InvalidArgumentError(f"on_bad_gradient={on_bad_gradient!r}; use 'raise' or 'skip'.")
        self.cluster, self.task, self._elastic = cluster, task, bool(join)
        if join:  # a replica of its own data; no chief, no server
            self._rank, self._world, self._chief = 0, 1, False
        else:
            self._rank, self._world = cluster.replica_index(task), cluster.num_replicas
            self._chief = cluster.is_chief(task) if is_chief is None else bool(is_chief)
        self.aggregation = AggregationConfig(
            mode=mode, total_num_replicas=max(1, cluster.num_replicas),
            replicas_to_aggregate=replicas_to_aggregate, staleness=staleness,
            timeout=step_timeout, max_elastic_workers=max_elastic_workers,
            replicas=check_replicas(replicas, cluster.num_tasks("ps")))
        self._setter = device_setter
        if device_setter is not None:
            ps_strategy = ps_strategy or device_setter.strategy
            if partition_threshold_bytes is None:
                partition_threshold_bytes = device_setter.partition_threshold_bytes
            if device is None:
                device = device_setter.worker_device  # no device type: this task's default
        self._device = compute_device(device)
        self._credentials, self._bind_host = credentials, bind_host
        self._ps_strategy = ps_strategy or (None if device_setter is not None
                                            else DEFAULT_PS_STRATEGY)
        self._threshold = partition_threshold_bytes
        self._timeout, self._init_timeout = timeout, init_timeout
        self._policy, self._prefetch = on_bad_gradient, prefetch
        self._dense_with_rows = dense_with_rows
        self._carrier: DenseCarrier | None = None  # the dense push with the next table pull
        self._client: Any = None
        self._server, self._owns_server = (None if isinstance(server, bool) else server), False
        self._serve = server is True and not join
        self._sigterm: Any = None  # an elastic worker's SIGTERM handler replaced
        self._model: nn.Module | None = None
        self._hooks: list[Any] = []  # on the model: inputs to the device, settle(), the Init
        self._pending: Future | None = None
        self._unfinished = False  # stopped on an error (a missing peer...): no Done at shutdown
        self._checkpoint_step: int | None = None  # the chief's final checkpoint, for its Done
        self._needs_init = self._initialised = False  # the chief: Init to send / sent
        self._failure = ""  # the chief's error when it stopped before initialising: its Done says it
        self._restore: DenseRestore | None = None
        self._step, self._meta = 0, {}
        self._sparse_threshold, self._tables = sparse_threshold_bytes, None
        self._whole_below = whole_table_bytes
        self._table_part_bytes, self._table_restore = table_part_bytes, None

    # -- facts ---------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    @property
    def batches_per_step(self) -> int:
        """One worker's batch per global step (async, ssp); ``replicas_to_aggregate`` in sync."""
        return self.aggregation.required if self.aggregation.mode == "sync" else 1

    @property
    def is_chief(self) -> bool:
        return self._chief

    @property
    def worker_id(self) -> int:
        """The id this worker's pushes carry: its replica index, or the id an elastic
        worker was given when it joined (from ``towerflow.ps.wire.calls.ELASTIC_BASE`` up)."""
        client = self._client
        return client.worker_id if client is not None else self._rank

    @property
    def model(self) -> nn.Module:
        """The prepared model (its parameters are views of the flat buffers)."""
        return self._prepared(self._model)

    @property
    def client(self) -> Any:
        """The :class:`~towerflow.ps.worker.dense.client.PSClient` (after :meth:`prepare`)."""
        return self._prepared(self._client)

    @staticmethod
    def _prepared(value: Any) -> Any:
        if value is None:
            raise FailedPreconditionError(
                "ParameterServer has no model yet; call prepare(model, optimizer) first.")
        return value

    # -- setup -----------------------------------------------------------------------------
    def prepare(self, model: nn.Module,
                optimizer: OptimizerConfig | torch.optim.Optimizer) -> nn.Module:
        """Place the parameters on the ps tasks; the chief initialises, others wait.

        A ``torch.optim`` optimizer's parameter groups keep their settings: a
        table takes its weight's group's, a dense variable its group's learning
        rate (the ps task applies one of each other setting to all it holds).
        """
        from towerflow.ps.worker.dense.client import PSClient
        from towerflow.strategies.optim import check_dense_groups

        optimizer = self._bind_tables(model, optimizer)
        check_trainable(list(model.named_parameters()), elastic=self._elastic, tables=bool(self._tables))
        model.to(self._device)  # (on another kind of device: new Parameter objects)
        self._hooks = [inputs_follow(model, self._device),  # a program's own model(x) too
                       model.register_state_dict_pre_hook(lambda *_: self.settle())]
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        check_dense_groups(optimizer, [n for n, _ in params])
        placement = plan_variables(params, model, self.cluster.num_tasks("ps"),
                                   setter=self._setter, ps_strategy=self._ps_strategy,
                                   threshold=self._threshold)
        self._buffers = FlatBuffers(placement, dict(params), self._device)
        self._opt = optimizer
        self._start_server()
        self._client = PSClient(
            self.cluster, placement, worker_id=-1 if self._elastic else self._rank,
            credentials=self._credentials, timeout=self._timeout, push_timeout=self._push_timeout(),
            push_wait=self.aggregation.timeout, on_bad_gradient=self._policy,
            sync=self.aggregation.mode == "sync", replicas=self.aggregation.replicas)
        if self._tables:  # one route per shard: a switch to its replica serves both clients
            self._tables.share_routes([shard.route for shard in self._client.shards])
        self._model = model
        if self._dense_with_rows and not self._prefetch \
                and DenseCarrier.wanted(self._tables, self.client, self.aggregation):
            self._carrier = DenseCarrier(model, self._tables, self.client,
                                         lambda result_of: self._take(self._outcome(result_of)),
                                         self._buffers.host_param_arrays)
        if self._chief:  # tables now; the dense Init after a possible restore (load_state)
            if self._tables:
                start_tables(self._tables, None)
            def _initialise(*_: Any) -> None:  # the first forward inits, before the tables' pulls
                self._ensure_initialized()  # (a closure, so that deepcopy(model) works)
            self._hooks.append(model.register_forward_pre_hook(_initialise, prepend=True))
            self._needs_init = True
        else:
            self._step = self._client.wait_until_initialized(self._init_timeout)
            if self._elastic:
                self._sigterm = join_running_job(self._client)
            self._pull()
        return model

    def _bind_tables(self, model: nn.Module, optimizer: Any) -> Any:
        """Bind the model's sparse tables (:attr:`_tables`); the ``OptimizerConfig``."""
        from towerflow.strategies.optim import as_optimizer_config

        if not isinstance(model, nn.Module):
            raise InvalidArgumentError(f"prepare() needs a torch.nn.Module, got {type(model).__name__}.")
        config = as_optimizer_config(optimizer, model)
        self._tables = attach_tables(
            model, config, cluster=self.cluster, sparse_threshold=self._sparse_threshold,
            whole_below=self._whole_below, chief=self._chief, credentials=self._credentials,
            worker_id=self._rank, timeout=self._timeout, aggregation=self.aggregation,
            pinned=self._device.type == "cuda")
        return config

    def _push_timeout(self) -> float:
        """A push attempt's deadline: step timeout + a call's (None: a call's; resent, once)."""
        wait = self.aggregation.timeout  # (an elastic worker's async pushes never wait)
        return self._timeout if wait is None or self._elastic else wait + self._timeout

    @property
    def server(self) -> Any:
        """This task's ``Server`` (given or started by :meth:`prepare`), or None."""
        return self._server

    def _start_server(self) -> None:
        """Serve this task (so the ps tasks' heartbeats reach it), unless given one."""
        if self._serve and self._server is None:
            self._server = task_server(self.cluster, self.task, self._credentials,
                                       self._bind_host)
            self._owns_server = self._server is not None

    def _ensure_initialized(self) -> None:
        if not self._needs_init:
            return
        buffers = self._buffers
        restore = self._restore or DenseRestore(buffers.host_params(), [], 0, 0, [])
        pending, self._table_restore = self._table_restore, None  # tables: made at prepare,
        if self._tables and (pending or self._tables.holds_starts()):  # restored here if need be
            start_tables(self._tables, pending, again=True)
        self.client.initialize(restore.params, optimizer=self._opt, aggregation=self.aggregation,
                               step=restore.step, slots=restore.slots,
                               optimizer_step=restore.optimizer_step, pushes=restore.pushes)
        self._needs_init, self._restore, self._step = False, None, restore.step
        self._initialised = True
        log.info("chief initialised %d ps task(s) at step %d (mode %s)",
                 buffers.placement.num_shards, restore.step, self.aggregation.mode)
        self._pull()

    def _pull(self) -> None:
        self._step = self.client.pull(self._buffers.host_param_arrays)
        self._buffers.params_to_device()

    # -- steps ---------------------------------------------------------------------------------
    def run_step(self, loss_fn: LossFn, batch: Any, *, lr: float | None = None) -> StepResult:
        """Gradients of ``batch`` on this worker's device, pushed; fresh parameters back.

        ``batch`` is handed to ``loss_fn`` on :attr:`device`
        (:func:`~towerflow.devices.move_to_device`); a table's ids are read from the
        batch's host copy, never copied back from the device."""
        if self._model is None:
            raise FailedPreconditionError("ParameterServer.run_step before prepare(model, optimizer).")
        self._ensure_initialized()
        self._drain(carried=False)  # a carried dense push goes with this step's table pull
        buffers = self._buffers
        buffers.zero_grads()
        twins: dict[int, torch.Tensor] = {}  # a moved batch tensor's host copy: the tables' ids
        batch = move_to_device(batch, self._device, twins if self._tables else None)
        if self._tables:
            self._tables.forget()
        with host_copies(twins):
            loss = loss_fn(self._model, batch)
        loss.backward()
        rate = float(lr if lr is not None else self._opt.lr)
        rows = self._tables.take() if self._tables else []
        bad = buffers.nonfinite_gradient() or (self._tables.nonfinite(rows) if rows else None)
        if bad is not None:
            message = (f"Gradient of {bad!r} on worker {self._rank} contains NaN or inf; it was "
                       "not pushed and the parameters are unchanged. Lower the learning rate "
                       "or clip the gradients.")
            if self._policy == "raise":
                raise InvalidArgumentError(message)
            log.warning("%s", message)
            return StepResult(loss=loss.detach(), global_step=self._step, applied=False)
        if not self.client.reserve():  # the run's last steps are the other workers' pushes
            log.info("worker %d stops: the other workers pushed the run's last steps (to "
                     "global step %d)", self._rank, self.client.last_step)
            return StepResult(loss=loss.detach(), global_step=self._step, applied=False,
                              stopped=True)
        if rows:  # (unique ids, summed row gradients) to the owning shards
            self._tables.push(rows, lr=rate, step=self._step + 1)
        grads = buffers.grads_to_host()
        if self._carrier is not None:  # sent with the next forward's table pull
            if self._carrier.carry(grads, rate):
                return StepResult(loss=loss.detach(), global_step=self._step + 1)
            self._carrier = None  # it stopped (no forward of the model): pushed below
        if self._prefetch:
            self._pending = self.client.push_async(grads, rate, pull_into=buffers.host_param_arrays)
            return StepResult(loss=loss.detach(), global_step=self._step + 1)
        result = self._outcome(lambda: self.client.push(grads, rate,
                                                        pull_into=buffers.host_param_arrays))
        self._take(result)
        return StepResult(loss=loss.detach(), global_step=result.global_step,
                          applied=result.applied)

    def _take(self, result: Any) -> None:
        """Adopt a push's outcome: its global step and the fresh parameters it pulled."""
        self._step = result.global_step
        self._buffers.params_to_device()

    def _drain(self, *, carried: bool = True) -> None:
        """Finish the push of the last step (in the background; ``carried``: also one
        waiting for the next table pull)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._take(self._outcome(pending.result))
        if carried and self._carrier is not None:
            self._carrier.send()

    def _outcome(self, push: Any) -> Any:
        """``push()``'s result; a push that failed for a missing peer leaves this worker
        unfinished: it sends no ``Done`` at :meth:`shutdown` (a sync step waits for it)."""
        try:
            return push()
        except UnavailableError as exc:
            self._unfinished = True
            if self._elastic:
                raise UnavailableError(
                    f"Elastic worker {self.worker_id} cannot reach the ps tasks ({exc}); the job "
                    "it joined has probably ended (a ps task ends when the cluster's replicas "
                    "finish, not its elastic workers). Join the next job.") from None
            raise
        except DeadlineExceededError:
            self._unfinished = True
            raise

    @property
    def global_step(self) -> int:
        if self._model is not None:
            self._ensure_initialized()
            self._drain()
        return self._step

    def settle(self) -> None:
        """Finish the pushes in flight and a carried dense push (``model.state_dict()`` too)."""
        if self._client is not None:
            self._drain()

    # -- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The parameters and optimizer state pulled from the ps tasks, plus local buffers.

        Sparse tables are a chunked group (``ps_tables``), streamed from the ps
        shards part by part while the checkpoint is written, never gathered.
        """
        self._ensure_initialized()
        self._drain()
        snaps = consistent_snapshot(self.client, sync=self.aggregation.mode == "sync",
                                    timeout=self._timeout)
        groups = dense_groups(self._buffers.placement, snaps)
        for name, tensor in self.model.state_dict().items():
            groups["model"].setdefault(name, tensor.detach().cpu())
        self._meta = {"global_step": snaps[0].step, "optimizer_step": snaps[0].optimizer_step,
                      "optimizer": self._opt.name, "mode": self.aggregation.mode}
        if self._tables:
            table_group, description = table_groups(self._tables, self._table_part_bytes)
            groups.update(table_group)
            self._meta.update(description)
        return groups

    def missing_peers(self, timeout: float = 2.0) -> list[str]:
        """The other training tasks not answering a ping now, with why (none: ``[]``)."""
        others = [t for t in self.cluster.replicas if t != self.task]
        return [] if self._server is None else self._server.unanswering(others, timeout)

    def state_metadata(self) -> dict[str, Any]:
        return dict(self._meta)

    def load_state_dict(self, groups: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        self.load_state(groups, None)

    def load_state(self, groups: Mapping[str, Any],
                   metadata: Mapping[str, Any] | None = None) -> None:
        """Restore a checkpoint: the chief sends it to the ps tasks; others keep local buffers.

        Sparse tables come from the ``ps_tables`` chunked group (a
        :class:`~towerflow.checkpoint.ChunkedReader`), imported part by part
        into the ps tasks, however many there are now, before the dense Init.
        """
        from towerflow.checkpoint import load_into_module

        if self._model is None:
            raise FailedPreconditionError("load_state before prepare(model, optimizer).")
        model_group = groups.get("model")
        if model_group is None:
            raise InvalidArgumentError(
                f"The checkpoint has no 'model' group (groups: {sorted(groups)})."
            )
        check_whole_tables(self._model, metadata)
        rest = tables_from_weights(self._tables, groups, model_group, chief=self._chief)
        load_into_module(self._model, rest)  # checks names, shapes, dtypes
        if not self._chief:
            return
        metadata = dict(metadata or {})
        groups, metadata = as_ps_optimizer_state(self._model, self._opt, groups, metadata)
        if self._tables and len(rest) == len(model_group):  # (else they start from weights)
            self._table_restore = tables_to_restore(groups, metadata)
        self._restore = dense_restore(self._buffers.placement, groups, metadata, self._opt.name)
        self._buffers.load_from(self._restore.params)
        self._needs_init = True

    # -- lifetime ----------------------------------------------------------------------------
    def stop_at(self, last_step: int | None) -> None:
        """An asynchronous run ends at ``last_step`` exactly: no push is sent without a step
        of it kept by ps task 0 (:mod:`towerflow.ps.server.dense.reservations`)."""
        if self.aggregation.mode == "async" and self._client is not None:
            self._client.stop_at(last_step)

    def wait_for_peers(self, timeout: float) -> bool:
        """The chief of an asynchronous job, before its final checkpoint: wait (at most
        ``timeout`` s) until every other worker said ``Done`` (or the ps's heartbeats find
        it dead), so that the checkpoint holds all their acknowledged pushes; True when it
        waited for one."""
        if not self._chief or self.aggregation.mode == "sync" or self._client is None \
                or self._world <= 1:
            return False
        return wait_for_workers(self._client.shards[0].status, self._rank, self._world, timeout)

    def end_training(self, *, finished: bool, checkpoint_step: int | None = None,
                     error: BaseException | None = None) -> None:
        """Say how training ended (see :meth:`Strategy.end_training`): an unfinished worker
        sends no ``Done`` at :meth:`shutdown`; the chief's ``Done`` carries ``checkpoint_step``.

        A chief that stopped on ``error`` (an exception, not a signal) before it
        initialised the ps tasks sends it in its ``Done``: the ps tasks tell the
        waiting workers, and every task of the job ends with the chief's error.
        """
        self._unfinished = not finished
        self._checkpoint_step = checkpoint_step if finished else None
        if self._chief and not finished and not self._initialised and isinstance(error, Exception):
            self._failure = f"{type(error).__name__}: {error}"

    def shutdown(self) -> None:
        """Finish a pending push, tell the ps tasks this worker is done (not when it stopped
        on an error: they go on counting it; the chief's ``Done`` carries its final
        checkpoint's step), close channels, stop the server :meth:`prepare` started."""
        client = self._client
        try:
            if client is not None:  # the last step's push (in the background, or carried)
                self._drain()
            if self._tables:  # deferred row pushes (and the tables' Done) before this Done
                self._outcome(self._tables.flush if self._unfinished else self._tables.done)
        finally:
            self._client = None
            carrier, self._carrier = self._carrier, None
            if carrier is not None:
                carrier.close()
            if client is not None:  # an elastic worker always leaves: nothing waits for it
                client.close(done=not self._unfinished or self._elastic,
                             checkpoint_step=self._checkpoint_step, failure=self._failure)
            elif self._failure:  # it failed before it had a client
                from towerflow.ps.worker.dense.client import tell_chief_failure

                tell_chief_failure(self.cluster, self._credentials, self._failure,
                                   timeout=min(self._timeout, 5.0))
            if self._sigterm is not None:
                signal.signal(signal.SIGTERM, self._sigterm)
                self._sigterm = None
            if self._tables:
                self._tables.close()
            hooks, self._hooks = self._hooks, []
            for hook in hooks:
                hook.remove()
            server, owned, self._owns_server = self._server, self._owns_server, False
            if owned:
                self._server = None
                server.stop(grace=1.0)

