"""``ParameterServer(replicas=...)``, ``--ps-replicas`` and run.yaml's ``ps_replicas``: checked
before anything starts, and carried to the ps tasks in the chief's Init (real ps tasks served
from this process, authenticated gRPC on 127.0.0.1)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import replica_calls as calls
import torch
from rich.console import Console
from torch import nn

from towerflow.cli._train_options import strategy_options
from towerflow.cli.status import render
from towerflow.cluster import ClusterSpec, TaskInfo
from towerflow.cluster.transport import Credentials, make_channel, unary_stream
from towerflow.errors import InvalidArgumentError
from towerflow.ps.wire import tables_pb2 as tpb
from towerflow.ps.worker.observe import ClusterObserver
from towerflow.strategies import OptimizerConfig
from towerflow.strategies.parameter_server import ParameterServer
from towerflow.testing.inprocess import ps_tasks
from towerflow.training.runconfig import MAY_CHANGE

SECRET = Credentials(secret=b"replicas-secret")
SPEC = ClusterSpec({"chief": ["h:1"], "worker": ["h:2"], "ps": ["h:4", "h:5"]})


def strategy(spec: ClusterSpec = SPEC, **kw) -> ParameterServer:
    return ParameterServer(spec, TaskInfo("worker", 0), device="cpu", server=False,
                           credentials=SECRET, **kw)


@pytest.mark.parametrize(("replicas", "message"), [
    (2, "replicas=2 with 2 ps task(s): a shard's live copies live on other ps tasks, so "
        "replicas is an integer from 0 to 1."),
    (-1, "replicas=-1 with 2 ps task(s)"),
    ("1", "replicas='1' with 2 ps task(s)"),
    (True, "replicas=True with 2 ps task(s)"),
])
def test_replicas_outside_0_to_the_ps_tasks_less_one_are_refused(replicas, message) -> None:
    with pytest.raises(InvalidArgumentError, match=re.escape(message)) as info:
        strategy(replicas=replicas)
    assert "start at least 2 ps tasks for replicas=1" in str(info.value)


def test_one_ps_task_has_nowhere_to_keep_a_replica() -> None:
    one = ClusterSpec({"worker": ["h:2"], "ps": ["h:4"]})
    with pytest.raises(InvalidArgumentError, match=re.escape(
            "replicas=1 with 1 ps task(s): a shard's live copies live on other ps tasks, so "
            "replicas is an integer from 0 to 0.")):
        strategy(one, replicas=1)
    assert strategy(one).aggregation.replicas == 0  # the default: as before


@pytest.mark.parametrize("mode", ["sync", "ssp"])
def test_sync_and_ssp_shards_have_replicas_too(mode) -> None:
    run = strategy(mode=mode, replicas=1)
    assert (run.aggregation.mode, run.aggregation.replicas) == (mode, 1)


def test_more_than_one_replica_is_not_built_yet() -> None:
    three = ClusterSpec({"worker": ["h:2"], "ps": ["h:4", "h:5", "h:6"]})
    with pytest.raises(InvalidArgumentError, match=re.escape(
            "replicas=2: one live copy per shard is built so far")):
        strategy(three, replicas=2)


def test_the_flag_and_the_run_file_reach_the_strategy() -> None:
    import argparse

    from towerflow.cli._train_options import add_train_arguments

    args = add_train_arguments(argparse.ArgumentParser()).parse_args(
        ["digits", "--ps-replicas", "1"])
    assert strategy_options(args, "ps")["replicas"] == 1
    assert "ps_replicas" in MAY_CHANGE  # a resumed run may change it (the format is the same)


@contextlib.contextmanager
def channel_to(address: str) -> Iterator[Any]:
    channel = make_channel(address, SECRET)
    try:
        yield channel
    finally:
        channel.close()


@pytest.mark.parametrize("mode", ["async", "sync", "ssp"])
def test_training_with_one_replica_keeps_each_shard_on_the_next_ps_task(mode) -> None:
    with ps_tasks(SECRET) as spec:
        one = ClusterSpec({"ps": spec.job_tasks("ps"), "worker": spec.job_tasks("worker")[:1]})
        run = strategy(one, replicas=1, mode=mode)
        model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 1))
        try:
            run.prepare(model, OptimizerConfig("adam", lr=0.01))
            g = torch.Generator().manual_seed(0)
            for _ in range(5):
                x = torch.randn(16, 6, generator=g)
                result = run.run_step(lambda m, b: m(b).square().mean(), x)
            assert result.global_step == 5
        finally:
            run.shutdown()
        ps = spec.job_tasks("ps")
        with channel_to(ps[0]) as first, channel_to(ps[1]) as second:
            statuses = [calls.status(first), calls.status(second)]
            assert [(s.term, s.role) for s in statuses] == [(1, "primary")] * 2
            assert [[(r.shard, r.role) for r in s.replicas] for s in statuses] == [
                [(1, "replica")], [(0, "replica")]]
            for task, status in enumerate(statuses):  # each copy is at its primary's step
                assert status.replicas[0].step == statuses[1 - task].step == 5
            primary = calls.pull(first)
            promoted = calls.promote(second, 0)
            assert (promoted.term, promoted.step) == (2, 5)
            np.testing.assert_array_equal(calls.pull(second, shard=0, term=2), primary)
        with ClusterObserver(spec, SECRET) as observer:  # what `towerflow status` shows
            snapshot = observer.snapshot()
        assert [(v["shard"], v["role"], v["term"], v["copies"]) for v in snapshot["ps"]] == [
            (0, "primary", 1, [{"shard": 1, "role": "replica", "term": 1, "step": 5,
                                "alone": False}]),
            (1, "primary", 1, [{"shard": 0, "role": "primary", "term": 2, "step": 5,
                                "alone": True}])]  # promoted: no copy until ps task 0 is back
        console = Console(width=120, record=True)
        console.print(render(snapshot))
        assert re.search(r"shard replicas.*\n(.*\n)*.*0 +│ +1 +│ +primary +│ +2 +│ +5 +│ +none: "
                         r"alone until its task rejoins",
                         console.export_text()), console.export_text()


def export(channel: Any, table: str, shard: int) -> list[bytes]:
    """Table ``table``'s shard ``shard`` as the task serves it: each chunk's rows and slots."""
    chunks = unary_stream(channel, "/towerflow.ps.Tables/ExportRows", tpb.ExportRowsRequest(
        table=table, shard=shard).SerializeToString(), timeout=10.0)
    return [part for data in chunks for chunk in [tpb.RowChunk.FromString(data)]
            for part in (chunk.ids, chunk.rows, *chunk.slots)]


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_click_model_trains_with_its_table_shards_replicated(mode) -> None:
    with ps_tasks(SECRET) as spec:
        one = ClusterSpec({"ps": spec.job_tasks("ps"), "worker": spec.job_tasks("worker")[:1]})
        run = strategy(one, replicas=1, whole_table_bytes=None, mode=mode)
        try:
            run.prepare(calls.Clicks(), OptimizerConfig("adagrad", lr=0.1))
            g = torch.Generator().manual_seed(1)
            for _ in range(4):
                ids = torch.randint(0, 50, (16,), generator=g)
                run.run_step(lambda m, b: m(b).square().mean(), ids)
            run.settle()
            (name,) = [module.config.name for _, module in run._tables.modules]
        finally:
            run.shutdown()
        ps = spec.job_tasks("ps")
        with channel_to(ps[0]) as first, channel_to(ps[1]) as second:
            primary = export(first, name, 0)
            calls.promote(second, 0)
            assert export(second, name, 0) == primary  # rows and adagrad slots, bit for bit
