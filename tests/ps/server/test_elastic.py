"""Elastic workers: Join, pushes under the given id, Done retires it; refusals; the live view.

The ps tasks are served in this process (real gRPC on 127.0.0.1) and the
workers are ``ParameterServer`` strategies of this process; the run with
real processes and ``towerflow train --join`` is in test_elastic_cluster.py.
"""

from __future__ import annotations

import contextlib
import io
import json
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from towerflow.cluster import ClusterSpec, Server, TaskInfo
from towerflow.cluster.transport import Credentials, make_channel, unary
from towerflow.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    ResourceExhaustedError,
    UnavailableError,
)
from towerflow.models.linear import LinearRegression, mse_loss, regression_data
from towerflow.ps import PSClient, PSService
from towerflow.ps.server.elastic import ElasticMembers, confirm_with_task0
from towerflow.ps.wire import ps_pb2 as pb
from towerflow.ps.wire.calls import ELASTIC_BASE, ELASTIC_LIMIT, REFUSED, method_path
from towerflow.ps.wire.messages import AggregationConfig
from towerflow.ps.worker.observe import ClusterObserver
from towerflow.strategies import OptimizerConfig
from towerflow.strategies.parameter_server import ParameterServer

SECRET = Credentials(secret=b"elastic-secret")
DATA = regression_data(32, noise=0.0)
SGD = OptimizerConfig("sgd", lr=0.05)


@pytest.fixture
def job(free_ports):
    """Two ps tasks served here (replicas: one worker); ``job.stop()`` ends them."""
    ports = free_ports(3)
    spec = ClusterSpec({"ps": [f"127.0.0.1:{p}" for p in ports[:2]],
                        "worker": [f"127.0.0.1:{ports[2]}"]})
    channels: list = []

    def to_task0():  # type: ignore[no-untyped-def]
        if not channels:
            channels.append(make_channel(spec.task_address("ps", 0), SECRET))
        return channels[0]

    services = [PSService(i, replicas=1,
                          confirm_join=None if i == 0 else confirm_with_task0(to_task0))
                for i in range(2)]
    servers = []
    for i, service in enumerate(services):
        server = Server(spec, "ps", i, credentials=SECRET, start=False)
        server.add_handlers([service.handlers()])
        server.start()
        servers.append(server)

    class Job:
        cluster = spec

        @staticmethod
        def stop() -> None:
            for channel in channels:
                channel.close()
            for server in servers:
                server.stop()

    Job.services = services
    try:
        yield Job
    finally:
        Job.stop()


def chief(spec, mode: str = "async", **kw) -> ParameterServer:
    """Worker 0 (the chief), initialised and one step trained."""
    strategy = ParameterServer(spec, TaskInfo("worker", 0), mode=mode, credentials=SECRET,
                               device="cpu", server=False, **kw)
    strategy.prepare(LinearRegression(), SGD)
    strategy.run_step(mse_loss, DATA)
    return strategy


def joiner(spec, **kw) -> ParameterServer:
    return ParameterServer(spec, join=True, credentials=SECRET, device="cpu", **kw)


def test_an_elastic_worker_joins_pushes_and_its_done_retires_the_id(job) -> None:
    first = chief(job.cluster)
    extra = joiner(job.cluster)
    try:
        extra.prepare(LinearRegression(), SGD)
        assert extra.worker_id == ELASTIC_BASE  # given by ps task 0, told to ps task 1
        assert not extra.is_chief and (extra.rank, extra.world_size) == (0, 1)
        before = first.global_step
        result = extra.run_step(mse_loss, DATA)
        assert result.applied and result.global_step > before
        for service in job.services:  # its push is in every shard's ledger, under its id
            ledger = pb.LedgerReply.FromString(service.ledger(b""))
            assert ELASTIC_BASE in {e.worker_id for e in ledger.entries}
            (stat,) = [w for w in pb.StatusReply.FromString(service.status(b"")).workers
                       if w.elastic]
            assert stat.worker_id == ELASTIC_BASE and stat.pushes == 1 and not stat.done
            assert re.fullmatch(r".+:\d+", stat.name)
    finally:
        extra.shutdown()
    for service in job.services:
        (stat,) = [w for w in pb.StatusReply.FromString(service.status(b"")).workers
                   if w.elastic]
        assert stat.done and ELASTIC_BASE not in service.elastic
    # a later push under the retired id is refused, and changes nothing
    placement = first.client.placement
    late = PSClient(job.cluster, placement, worker_id=ELASTIC_BASE, credentials=SECRET,
                    on_bad_gradient="skip")
    try:
        step = first.global_step
        grads = [np.ones(s.numel, np.float32) for s in placement.shards]
        outcome = late.push(grads, lr=0.1)
        assert outcome.statuses == (REFUSED, REFUSED) and first.global_step == step
        assert f"from worker {ELASTIC_BASE} was refused" in outcome.messages[0]
        assert "one counts from its Join to its Done" in outcome.messages[0]
    finally:
        late.close(done=False)
        first.shutdown()


def test_join_is_refused_in_sync_mode_saying_why_and_what_to_do(job) -> None:
    first = chief(job.cluster, mode="sync")
    extra = joiner(job.cluster)
    try:
        with pytest.raises(FailedPreconditionError, match=(
                r"Join of elastic worker '.+' was refused: ps shard 0 trains in sync mode, where "
                r"a sync step averages the gradients of a fixed number of replicas "
                r"\(total_num_replicas=1\), so workers cannot come and go\. Add the worker to "
                r"the cluster as a task and restart the job, or train the job with "
                r"mode='async'\.")):
            extra.prepare(LinearRegression(), SGD)
    finally:
        extra.shutdown()
        first.shutdown()


def test_join_is_bounded_and_the_refusal_names_the_limit(job) -> None:
    first = chief(job.cluster, max_elastic_workers=1)
    extras = [joiner(job.cluster), joiner(job.cluster)]
    try:
        extras[0].prepare(LinearRegression(), SGD)
        with pytest.raises(ResourceExhaustedError, match=(
                r"admits at most 1 elastic worker\(s\) at once \(max_elastic_workers=1\), and "
                rf"holds {ELASTIC_BASE} \(.+\)\. Wait for one to leave, or raise the cap")):
            extras[1].prepare(LinearRegression(), SGD)
        extras[0].shutdown()  # its Done frees the place
        again = joiner(job.cluster)
        again.prepare(LinearRegression(), SGD)
        assert again.worker_id == ELASTIC_BASE + 1  # ids are never given twice
        again.shutdown()
    finally:
        for extra in extras:
            extra.shutdown()
        first.shutdown()


def test_an_elastic_worker_gets_a_clear_error_once_the_job_has_ended(job) -> None:
    first = chief(job.cluster)
    extra = joiner(job.cluster, timeout=2.0)  # a push retries an unreachable ps this long
    try:
        extra.prepare(LinearRegression(), SGD)
        extra.run_step(mse_loss, DATA)
        job.stop()
        with pytest.raises(UnavailableError, match=(
                rf"^Elastic worker {ELASTIC_BASE} cannot reach the ps tasks \(.+\); the job it "
                r"joined has probably ended")):
            extra.run_step(mse_loss, DATA)
    finally:
        extra.shutdown()
        first.shutdown()


@contextlib.contextmanager
def _joined(cluster):  # type: ignore[no-untyped-def]
    """The chief and an elastic worker that has trained one step; both shut down after."""
    first = chief(cluster)
    extra = joiner(cluster)
    try:
        extra.prepare(LinearRegression(), SGD)
        extra.run_step(mse_loss, DATA)
        yield extra
    finally:
        extra.shutdown()
        first.shutdown()


def test_the_live_view_lists_elastic_workers_after_the_replicas(job) -> None:
    with _joined(job.cluster) as extra:
        with ClusterObserver(job.cluster, SECRET, probe_tasks=False) as observer:
            observer.snapshot()
            extra.run_step(mse_loss, DATA)
            snap = observer.snapshot()
            assert [w["job"] for w in snap["workers"]] == ["worker", "elastic"]
            view = snap["workers"][1]
            assert view["replica"] == ELASTIC_BASE and view["elastic"] and not view["left"]
            assert view["state"] == "joined" and view["steps"] == 2
            assert view["steps_per_sec"] > 0 and view["last_push_age"] < 30
            assert view["name"] and view["name"] in view["task"]
            assert re.search(rf"{ELASTIC_BASE} +│ elastic worker {ELASTIC_BASE} \({view['name']}"
                             r"\) +│ joined +│ 2 ", _table(snap)), _table(snap)
            extra.shutdown()
            snap = observer.snapshot()
            view = snap["workers"][1]
            assert view["left"] and view["state"] == "left"
            assert re.search(rf"{ELASTIC_BASE} .+│ left +│ 2 ", _table(snap)), _table(snap)
            json.dumps(snap)


def _table(snapshot: dict) -> str:
    """``towerflow status``'s tables of ``snapshot``, as text."""
    from rich.console import Console

    from towerflow.cli.status import render

    console = Console(width=250, record=True, file=io.StringIO())
    console.print(render(snapshot))
    return console.export_text()


# -- one shard's members --------------------------------------------------------------------
def _join(members: ElasticMembers, worker_id: int = 0, name: str = "spare:1",
          incarnation: int = 1, ticket: bytes = b"", **config):
    return members.join(pb.JoinRequest(worker_id=worker_id, name=name, incarnation=incarnation,
                                       ticket=ticket), AggregationConfig(**config))


def _pair() -> tuple[ElasticMembers, ElasticMembers]:
    """Ps task 0's members and ps task 1's, which asks task 0 to confirm an id."""
    zero = ElasticMembers(0)

    def confirm(request) -> None:  # type: ignore[no-untyped-def]
        assert zero.join(request, AggregationConfig())[0].worker_id == request.worker_id

    return zero, ElasticMembers(1, confirm=confirm)


def test_ids_come_from_ps_task_0_and_a_repeated_join_gets_the_same_id() -> None:
    zero, one = _pair()
    member, _ = _join(zero)
    assert _join(zero)[0] is member and len(zero) == 1  # its reply was lost: asked again
    with pytest.raises(InvalidArgumentError, match=r"ps task 1 admits an elastic worker under "
                       r"the id ps task 0 gave it; call Join on ps task 0 first"):
        _join(one)
    assert _join(one, member.worker_id, ticket=member.ticket)[0].worker_id == member.worker_id
    with pytest.raises(InvalidArgumentError, match=r"that id is held by elastic worker "
                       r"'spare:1' \(its name, incarnation and ticket must match\); ask ps task 0"):
        _join(one, member.worker_id, name="other:2", ticket=member.ticket)
    for bad in (5, ELASTIC_BASE - 1, -3):  # a replica's id is never an elastic worker's
        with pytest.raises(InvalidArgumentError, match=rf"as {bad} was refused: elastic worker "
                           rf"ids are {ELASTIC_BASE} \.\. "):
            _join(one, bad)
    assert one.leave(member.worker_id, member.ticket)
    assert not one.leave(member.worker_id, member.ticket)
    with pytest.raises(InvalidArgumentError, match=rf"worker {member.worker_id} has left the "
                       r"job; a worker that joins again asks ps task 0 for a new id"):
        _join(one, member.worker_id, ticket=member.ticket)


@settings(max_examples=40, deadline=None)
@given(worker_id=st.integers(ELASTIC_BASE, ELASTIC_LIMIT - 1), ticket=st.binary(max_size=32),
       name=st.text(min_size=1, max_size=40).filter(str.isprintable))
def test_no_join_names_an_id_ps_task_0_did_not_give_nor_uses_the_ids_up(worker_id, ticket, name):
    zero, one = _pair()
    given_ = _join(zero)[0]
    for members in (zero, one):
        if worker_id == given_.worker_id and ticket == given_.ticket and name == given_.name:
            continue  # the worker itself
        with pytest.raises(InvalidArgumentError, match=r"was refused"):
            _join(members, worker_id, name=name, ticket=ticket)
    assert _join(zero, name="next:1")[0].worker_id == given_.worker_id + 1  # the count moved once
    assert given_.worker_id not in one or one.known(given_.worker_id).ticket == given_.ticket


def test_a_done_without_the_ids_ticket_stops_no_one() -> None:
    zero, one = _pair()
    member, _ = _join(zero)
    _join(one, member.worker_id, ticket=member.ticket)
    for members in (zero, one):
        with pytest.raises(InvalidArgumentError, match=rf"Done for elastic worker "
                           rf"{member.worker_id} \('spare:1'\) was refused: it does not carry the "
                           r"ticket ps task 0 gave that worker"):
            members.leave(member.worker_id, b"forged")
        assert member.worker_id in members
    assert zero.leave(member.worker_id, member.ticket) and member.worker_id not in zero


@pytest.mark.parametrize("mode", ["sync", "ssp"])
def test_sync_and_ssp_shards_refuse_join_and_never_count_an_elastic_id(mode) -> None:
    members = ElasticMembers(0)
    with pytest.raises(FailedPreconditionError, match=rf"trains in {mode} mode, where .+ fixed"):
        _join(members, mode=mode)
    config = AggregationConfig(mode=mode, total_num_replicas=2)
    with pytest.raises(InvalidArgumentError, match=r"replicas of this job are 0 \.\. 1"):
        config.check_replica(ELASTIC_BASE, "Push 1", {ELASTIC_BASE})


def test_a_silent_member_gives_its_place_up_and_a_bad_name_is_refused() -> None:
    members = ElasticMembers(0, expiry=0.0)
    gone, _ = _join(members, max_elastic_workers=1)
    member, count = _join(members, name="spare:2", max_elastic_workers=1)
    assert count == 1 and gone.left == "expired" and gone.worker_id not in members
    assert members.known(gone.worker_id) is gone and member.worker_id in members
    with pytest.raises(ResourceExhaustedError, match=r"admits at most 0 elastic worker"):
        _join(ElasticMembers(0), max_elastic_workers=0)
    with pytest.raises(InvalidArgumentError, match=r"Join needs the worker's name"):
        _join(members, name="")
    with pytest.raises(FailedPreconditionError, match=r"not initialised yet"):
        members.join(pb.JoinRequest(name="x:1"), None)


def test_join_options_that_cannot_hold_are_refused(monkeypatch) -> None:
    spec = {"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}
    with pytest.raises(InvalidArgumentError, match=r"join=True with mode='sync': an elastic "
                       r"worker joins a running asynchronous job"):
        ParameterServer(spec, join=True, mode="sync")
    with pytest.raises(InvalidArgumentError, match=r"join=True with is_chief=True"):
        ParameterServer(spec, join=True, is_chief=True)
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": spec,
                                               "task": {"type": "worker", "index": 0}}))
    with pytest.raises(InvalidArgumentError, match=r"TF_CONFIG names task .+; remove its "
                       r"\"task\", or run that task without join"):
        ParameterServer(join=True)
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": spec}))
    strategy = ParameterServer(join=True, device="cpu")
    assert strategy.cluster.as_dict() == spec and strategy.task is None
    assert strategy.world_size == 1 and not strategy.is_chief


def test_an_elastic_worker_refuses_a_model_with_sparse_tables(job) -> None:
    from towerflow.ps import ShardedEmbedding  # noqa: F401 - the sparse module exists

    first = chief(job.cluster)
    model = torch.nn.Sequential(torch.nn.EmbeddingBag(1000, 8), torch.nn.Linear(8, 1))
    extra = ParameterServer(job.cluster, join=True, credentials=SECRET, device="cpu",
                            sparse_threshold_bytes=1024)
    try:
        with pytest.raises(InvalidArgumentError, match=r"trains dense models only"):
            extra.prepare(model, OptimizerConfig("adagrad", lr=0.1))
    finally:
        extra.shutdown()
        first.shutdown()


# -- towerflow train --join / --max-elastic-workers; towerflow status's table ----------------
def test_train_join_builds_an_elastic_worker_and_the_chief_takes_the_cap(monkeypatch) -> None:
    from towerflow.cli import build_parser
    from towerflow.cli.train import _joining_strategy, build_strategy

    spec = {"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": spec}))
    args = build_parser().parse_args(["train", "digits", "--join", "--device", "cpu"])
    strategy = _joining_strategy(args)
    assert strategy.cluster.as_dict() == spec and strategy.task is None
    assert not strategy.is_chief and strategy.aggregation.mode == "async"
    args = build_parser().parse_args(["train", "digits", "--join", "--bind", "0.0.0.0"])
    with pytest.raises(InvalidArgumentError, match=r"^--bind 0.0.0.0 does not apply to --join"):
        _joining_strategy(args)
    args = build_parser().parse_args(["train", "digits", "--join", "--mode", "sync"])
    with pytest.raises(InvalidArgumentError, match=r"^--join does not apply: this run trains "
                       r"with --mode sync; remove it, or train with --mode async"):
        _joining_strategy(args)
    chief_env = {"TF_CONFIG": json.dumps({"cluster": spec, "task": {"type": "worker",
                                                                    "index": 0}})}
    args = build_parser().parse_args(["train", "digits", "--max-elastic-workers", "3"])
    assert build_strategy(args, env=chief_env).aggregation.max_elastic_workers == 3



def test_the_ps_task_ends_with_its_replicas_not_waiting_for_an_elastic_worker(free_ports) -> None:
    from towerflow.testing.faults import wait_until

    ports = free_ports(2)
    spec = ClusterSpec({"ps": [f"127.0.0.1:{ports[0]}"], "worker": [f"127.0.0.1:{ports[1]}"]})
    with Server(spec, "ps", 0, credentials=SECRET) as ps:  # ends when its job has finished
        (host,) = [s for s in ps.services if hasattr(s, "lifecycle")]
        first = chief(spec)
        extra, gone = joiner(spec, timeout=2.0), joiner(spec)
        try:
            gone.prepare(LinearRegression(), SGD)
            gone.shutdown()  # an elastic worker's Done is no replica's: the job goes on
            assert host.lifecycle.finished == {} and not ps.stopped
            assert first.run_step(mse_loss, DATA).applied
            extra.prepare(LinearRegression(), SGD)
            extra.run_step(mse_loss, DATA)
            first.shutdown()  # the only replica's Done: the job is over
            wait_until(lambda: ps.stopped, timeout=30, what="the ps task to end")
            with pytest.raises(UnavailableError, match=r"the job it joined has probably ended"):
                extra.run_step(mse_loss, DATA)
        finally:
            for strategy in (extra, gone, first):
                strategy.shutdown()


def test_over_the_wire_a_forged_join_or_done_changes_no_membership(job) -> None:
    with _joined(job.cluster) as extra:
        mine = extra.client.worker_id

        def call(task: int, method: str, request) -> bytes:  # type: ignore[no-untyped-def]
            with make_channel(job.cluster.task_address("ps", task), SECRET) as channel:
                return unary(channel, method_path(method), request.SerializeToString(), timeout=10)

        with pytest.raises(InvalidArgumentError, match=r"ps task 0 did not confirm that it gave"):
            call(1, "Join", pb.JoinRequest(worker_id=mine + 7, name="rogue:1", incarnation=1))
        with pytest.raises(InvalidArgumentError, match=r"ps task 0 did not give that id"):
            call(0, "Join", pb.JoinRequest(worker_id=ELASTIC_LIMIT - 1, name="rogue:1"))
        for task in (0, 1):
            with pytest.raises(InvalidArgumentError, match=r"does not carry the ticket"):
                call(task, "Done", pb.DoneRequest(worker_id=mine))
        extra.run_step(mse_loss, DATA)  # still a member everywhere: its push is applied
        assert all(mine in service.elastic for service in job.services)
        reply = pb.JoinReply.FromString(call(0, "Join", pb.JoinRequest(name="next:1")))
        assert reply.worker_id == mine + 1  # the forged ids moved no count


def test_the_live_view_shows_a_name_holding_markup_as_it_is() -> None:
    snapshot = {"time": 0.0, "tasks": [], "ps": [{"shard": 0, "error": "[/]bad[bold"}],
                "workers": [{"replica": ELASTIC_BASE, "task": "elastic worker 1 ([/]x[red])",
                             "state": "joined", "heartbeat": "[/]"}]}
    text = _table(snapshot)
    assert "elastic worker 1 ([/]x[red])" in text and "[/]bad[bold" in text
