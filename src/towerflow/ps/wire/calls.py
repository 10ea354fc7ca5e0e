"""The ps shard service's names, call sequence and status codes (``towerflow.ps.PS``).

Both halves speak them: the ps task (:mod:`~towerflow.ps.server.dense.service`)
and the worker (:mod:`~towerflow.ps.worker.dense.client`). Plain constants: this
module imports nothing of torch, grpc or protobuf.

Service ``towerflow.ps.PS`` (raw-bytes handlers of
:func:`towerflow.cluster.transport.raw_handlers`, so every call is
authenticated by the cluster's credentials):

=======================  ===============  =====================================
method                   kind             messages
=======================  ===============  =====================================
``Init``                 stream -> unary  ``InitRequest``, then the params and
                                          slot buffers -> ``Empty``
``Status``               unary            ``StatusRequest`` -> ``StatusReply``
``Join``                 unary            ``JoinRequest`` -> ``JoinReply``
``Pull``                 unary -> stream  ``PullRequest`` -> ``PullReply`` +
                                          buffer chunks
``Push``                 stream -> unary  ``PushRequest``, gradient chunks ->
                                          ``PushReply``
``PushPull``             stream -> stream as ``Push``; replies ``PushReply`` +
                                          param chunks
``PushPullSmall``        unary            ``PushPull`` in one message each way,
                                          for a shard that fits in one chunk
                                          (:func:`~towerflow.ps.wire.framing.pack`)
``PushPullSmallStream``  stream           many ``PushPullSmall`` round trips on
                                          one long-lived call
``Done``                 unary            ``DoneRequest`` -> ``Empty``
``Ledger``               unary            ``LedgerRequest`` -> ``LedgerReply``
``Reserve``              unary            ``ReserveRequest`` -> ``ReserveReply``
                                          (ps task 0: a step of an async run's
                                          end kept for a worker's next push)
``ReplicaInit``          stream -> unary  (a primary to its replica's ps task)
                                          ``InitRequest`` + payload ->
                                          ``ReplicateReply``
``Replicate``            stream -> unary  ``ReplicateRequest``, params and slot
                                          chunks -> ``ReplicateReply``
``ReplicateStream``      stream           many ``Replicate`` on one long-lived
                                          call (each header and payload packed)
``Promote``              unary            ``PromoteRequest`` -> ``PromoteReply``
                                          (the copy becomes the primary)
=======================  ===============  =====================================

The call sequence by role:

1. The **chief** calls ``Init`` on every ps task (the variables, optimizer,
   aggregation, step, optimizer state and push table, from a checkpoint or
   fresh). A later ``Init`` replaces the shard whole; pushes it had answered
   stay answered.
2. Every **worker** (the chief too, once it has initialised) calls
   ``Status`` until each shard is initialised with its own layout's
   fingerprint, then ``Pull``, then ``Push`` / ``PushPull`` (or their small
   forms) once per step, and ``Done`` when it finishes (the chief's ``Done``
   names the step of its final checkpoint). A worker that stopped on an error
   sends no ``Done``.
3. An **elastic worker** (a process with the cluster and its credentials but
   no task of its own in it) joins a running ``async`` job: after ``Status``
   says every shard is initialised it calls ``Join`` on ps task 0, which
   gives it a worker id from :data:`ELASTIC_BASE` up (counted up, never a
   replica's and never given twice by one ps task) and the id's random
   ticket, then ``Join`` with that id and ticket on every other ps task
   (which asks ps task 0 to confirm them); then ``Pull``, ``Push`` /
   ``PushPull`` as a worker, and ``Done`` with the ticket when it leaves (its
   id is retired: a later push from it is refused). Each shard admits at most
   :attr:`~towerflow.ps.wire.messages.AggregationConfig.max_elastic_workers` at once. A sync or ssp shard
   refuses ``Join``: its steps and bound count a fixed set of replicas. The
   job's end is the replicas' (every replica's ``Done``): a ps task does not
   wait for its elastic workers.
4. Anyone holding the cluster's credentials may call ``Status`` and
   ``Ledger`` (``towerflow status``, audits); a checkpoint ``Pull`` s the
   slot buffers by name.

Status codes of a push (``PushReply.status``): :data:`APPLIED` (the gradient
is in the parameters), :data:`STALE` (sync: computed on an older step;
dropped and counted), :data:`REFUSED` (wrong shape, dtype, NaN / inf, a
worker that is neither a replica nor an admitted elastic worker: nothing
changed; its retry is checked afresh)
and :data:`VOIDED` (sync: its step was abandoned when the shard was
re-initialised). A retry of a push answered already gets the same answer
with ``duplicate`` set.

Example:
    >>> method_path("Push"), APPLIED in FINAL, REFUSED in FINAL
    ('/towerflow.ps.PS/Push', True, False)
"""

from __future__ import annotations

__all__ = [
    "SERVICE_NAME",
    "METHODS",
    "method_path",
    "APPLIED",
    "STALE",
    "REFUSED",
    "VOIDED",
    "FINAL",
    "MODES",
    "ELASTIC_BASE",
    "ELASTIC_LIMIT",
    "DEFAULT_MAX_ELASTIC",
    "DEFAULT_TIMEOUT",
    "MESSAGE_LIMIT",
    "bounded",
    "CHIEF_REPLICA",
    "failure_line",
    "replica_of",
    "partner_of",
    "DEPOSED_MARK",
    "REPLICA_MARK",
    "NOT_INITIALISED_MARK",
]

SERVICE_NAME = "towerflow.ps.PS"
#: the service's methods, in the order of the call sequence
METHODS = ("Init", "Status", "Join", "Pull", "Push", "PushPull", "PushPullSmall",
           "PushPullSmallStream", "Done", "Ledger", "Reserve", "ReplicaInit", "Replicate",
           "ReplicateStream", "Promote")

APPLIED = "applied"      # the gradient changed the parameters
STALE = "stale"          # sync: computed on an older step; dropped and counted
REFUSED = "refused"      # wrong shape / dtype / NaN / inf; parameters unchanged
VOIDED = "voided"        # sync: the step was abandoned (its shard re-initialised)
#: outcomes a retry is answered with (a refused push may be sent again)
FINAL = (APPLIED, STALE, VOIDED)

#: characters of a refusal message a shard keeps and replies with
MESSAGE_LIMIT = 1024


def method_path(method: str) -> str:
    """The gRPC path of one of :data:`METHODS` (``/towerflow.ps.PS/<method>``)."""
    return f"/{SERVICE_NAME}/{method}"


def bounded(message: str, limit: int = MESSAGE_LIMIT) -> str:
    """``message`` cut to ``limit`` characters (saying how much was left out)."""
    if len(message) <= limit:
        return message
    return f"{message[:limit]}... ({len(message) - limit} more characters)"


#: the replica that initialises the shards (the chief: replica 0 of the cluster)
CHIEF_REPLICA = 0


def failure_line(error: str) -> str:
    """The first line of a chief's error as a ``Done`` carries it: printable, bounded.

    Example:
        >>> failure_line("CheckpointError: bad\\x07 digest\\nTraceback ...")
        'CheckpointError: bad  digest'
    """
    lines = error.strip().splitlines()
    text = "".join(c if c.isprintable() else " " for c in (lines[0] if lines else ""))
    return bounded(text) if text else "an error it did not name"


def replica_of(shard: int, num_ps: int) -> int:
    """The ps task holding the live copy of ``shard`` (``replicas=1``): the next one.

    Example:
        >>> replica_of(0, 3), replica_of(2, 3)
        (1, 0)
    """
    return (shard + 1) % num_ps


def partner_of(shard: int, task: int, num_ps: int) -> int:
    """The ps task that holds (or takes) the copy of ``shard`` while ps task ``task`` serves
    it: a shard lives on the pair of its own task and the next one, one of them its primary
    and the other its copy (a replacement of the task that died rejoins as the copy).

    Example:
        >>> partner_of(0, 0, 3), partner_of(0, 1, 3)
        (1, 0)
    """
    return replica_of(shard, num_ps) if task == shard else shard


#: the words of a deposed primary's refusal (``FAILED_PRECONDITION``) that tell a worker
#: to send the shard's calls to its replica (which took it over)
DEPOSED_MARK = "is no longer the primary of shard"
#: the words of a ps task's refusal of a shard it holds only a copy of (it rejoined as the
#: shard's replica after its replica took the shard over): send to the shard's primary
REPLICA_MARK = "holds only a replica of shard"
#: the words of a ps task's refusal before the chief initialised its shard (after a push
#: had been answered: the task restarted, and its shard's copy serves it)
NOT_INITIALISED_MARK = "is not initialised yet"


#: the aggregation modes of a job (``AggregationSpec.mode``)
MODES = ("async", "sync", "ssp")
#: the first elastic worker id: ids from here up are elastic workers', never a replica's
ELASTIC_BASE = 1 << 20
#: one past the last elastic worker id (ids travel as int32)
ELASTIC_LIMIT = (1 << 31) - 1
#: elastic workers a shard admits at once unless the chief says otherwise
DEFAULT_MAX_ELASTIC = 16
#: seconds a sync / ssp push waits by default
DEFAULT_TIMEOUT = 120.0
