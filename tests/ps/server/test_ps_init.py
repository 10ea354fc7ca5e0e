"""Init headers: one strict check before anything is allocated or changed (in-process service)."""

from __future__ import annotations

import re

import numpy as np
import psutil
import pytest

from towerflow.errors import DataLossError, InvalidArgumentError
from towerflow.ps import PSService
from towerflow.ps.server.dense.initspec import MAX_ELEMENTS
from towerflow.ps.wire import ps_pb2 as pb

NUMEL = 6


def request(**fields) -> pb.InitRequest:
    req = pb.InitRequest(
        shard=0, optimizer=pb.OptimizerSpec(name="sgd"),
        aggregation=pb.AggregationSpec(mode="async", total_num_replicas=2),
        segments=[pb.Segment(name="w", shape=[NUMEL], var_shape=[NUMEL], numel=NUMEL,
                             num_parts=1)])
    for name, value in fields.items():
        if isinstance(value, list):
            del getattr(req, name)[:]
            getattr(req, name).extend(value)
        elif hasattr(value, "SerializeToString"):
            getattr(req, name).CopyFrom(value)
        else:
            setattr(req, name, value)
    return req


def live_service() -> PSService:
    service = PSService(0, replicas=2)
    service.init(iter([request().SerializeToString(), np.ones(NUMEL, np.float32).tobytes()]))
    assert service.shard.state.step == 0
    return service


def segment(shape, numel=None, **kw) -> pb.Segment:
    n = numel if numel is not None else int(np.prod(shape)) if shape else 1
    return pb.Segment(name=kw.pop("name", "w"), shape=shape, var_shape=kw.pop("var_shape", shape),
                      numel=n, **kw)


def refused(service: PSService, req: pb.InitRequest | bytes, payload=()) -> str:
    generation, shard = service._generation, service._shard
    data = req if isinstance(req, bytes) else req.SerializeToString()
    with pytest.raises(InvalidArgumentError) as info:
        service.init(iter([data, *payload]))
    assert service._generation == generation and service._shard is shard  # nothing changed
    return str(info.value)


@pytest.mark.parametrize(("shape", "numel", "pattern"), [
    ([2**32, 2**32], 0, r"segments\[0\]\.shape = \[4294967296, 4294967296\] is invalid: its "
                        rf"\d+\+ elements exceed {MAX_ELEMENTS}"),
    ([3037000500, 3037000500], -1, r"segments\[0\]\.shape = .* elements exceed"),
    ([-1, 4], -4, r"segments\[0\]\.shape dimension = -1 is invalid: it must be between 0 and"),
    ([2, 3], 5, r"segments\[0\]\.numel = 5 is invalid: the product of its shape \[2, 3\] is 6"),
    ([1] * 40, 1, r"segments\[0\]\.shape rank = 40 is invalid: at most 32 dimensions"),
])
def test_sizes_are_checked_in_exact_arithmetic(shape, numel, pattern) -> None:
    service = live_service()
    bad = request(segments=[])
    bad.segments.append(segment(shape, numel))
    assert re.search(pattern, refused(service, bad))


@pytest.mark.parametrize(("fields", "pattern"), [
    ({"optimizer": pb.OptimizerSpec(name="")}, r"optimizer\.name = '' is invalid: one of sgd"),
    ({"optimizer": pb.OptimizerSpec(name="rmsprop")}, r"optimizer\.name = 'rmsprop'"),
    ({"optimizer": pb.OptimizerSpec(name="adam", beta1=1.5)}, r"optimizer\.beta1 = 1\.5 .*< 1"),
    ({"optimizer": pb.OptimizerSpec(name="sgd", momentum=float("nan"))}, r"optimizer\.momentum"),
    ({"aggregation": pb.AggregationSpec(mode="", total_num_replicas=2)}, r"aggregation\.mode"),
    ({"aggregation": pb.AggregationSpec(mode="sync", total_num_replicas=3)},
     r"aggregation\.total_num_replicas = 3 is invalid: it must be between 1 and 2"),
    ({"aggregation": pb.AggregationSpec(mode="sync", total_num_replicas=2,
                                        timeout=float("inf"))},
     r"aggregation\.timeout = inf is invalid: a finite number of seconds >= 0 .*wait_forever"),
    ({"aggregation": pb.AggregationSpec(mode="sync", total_num_replicas=2,
                                        replicas_to_aggregate=-1)},
     r"aggregation\.replicas_to_aggregate = -1"),
    ({"slots": ["exp_avg"]}, r"slots = \['exp_avg'\] is invalid: sgd keeps no state"),
    ({"step": -5}, r"Init field step = -5 is invalid"),
    ({"pushes": [pb.PushRecord(worker_id=9, incarnation=1, seq=1, status="applied")]},
     r"pushes\[0\]\.worker_id = 9"),
])
def test_bad_fields_are_refused_naming_the_field_and_the_limit(fields, pattern) -> None:
    service = live_service()
    assert re.search(pattern, refused(service, request(**fields)))


def test_an_empty_init_never_replaces_a_live_shard() -> None:
    service = live_service()
    assert "optimizer.name = ''" in refused(service, b"")
    np.testing.assert_array_equal(service.shard.state.params, 1.0)


def test_duplicate_variable_parts_are_refused() -> None:
    service = live_service()
    twice = request(segments=[])
    twice.segments.extend([segment([2]), segment([2])])
    assert "part 0 of it is listed twice" in refused(service, twice)


def test_wait_forever_is_spelled_explicitly() -> None:
    service = PSService(0, replicas=2)
    spec = pb.AggregationSpec(mode="sync", total_num_replicas=2, wait_forever=True)
    service.init(iter([request(aggregation=spec).SerializeToString(),
                       np.zeros(NUMEL, np.float32).tobytes()]))
    assert service.shard.config.timeout is None
    default = pb.AggregationSpec(mode="sync", total_num_replicas=2)
    service.init(iter([request(aggregation=default).SerializeToString(),
                       np.zeros(NUMEL, np.float32).tobytes()]))
    assert service.shard.config.timeout == 120.0


def test_an_init_announcing_a_gib_of_state_allocates_only_what_arrives() -> None:
    numel = 1 << 28  # 1 GiB of params and 1 GiB of Adagrad state announced
    if psutil.virtual_memory().available < 4 * (4 * numel):
        pytest.skip("needs 4 GiB of free memory for the ps's own check to pass")
    service = PSService(0, replicas=2)
    req = request(optimizer=pb.OptimizerSpec(name="adagrad", initial_accumulator_value=0.1),
                  segments=[segment([numel])], slots=["sum"])
    process = psutil.Process()
    before = process.memory_info().rss
    growth = []

    def payload():
        yield req.SerializeToString()
        for _ in range(8):  # 8 MiB of the 2 GiB, then the sender goes away
            growth.append(process.memory_info().rss - before)
            yield np.ones(1 << 18, np.float32).tobytes()
        growth.append(process.memory_info().rss - before)

    with pytest.raises(DataLossError, match=r"ended after 8388608 of 2147483648 bytes"):
        service.init(payload())
    assert max(growth) < 64 << 20, growth  # not the 1-2 GiB announced
    assert service._shard is None
