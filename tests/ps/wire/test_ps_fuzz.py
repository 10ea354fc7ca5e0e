"""Property-based fuzz of every ps method's header: refused cleanly or applied correctly.

Each example calls one method of a live in-process :class:`PSService` with a
generated request (well-formed protobuf with extreme field values, or raw
bytes). The property: the call returns, or raises a ``TowerflowError`` (a gRPC
status, never ``INTERNAL``); a refused call changes nothing; an applied push
changes the parameters by exactly its gradient, once.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from towerflow.errors import TowerflowError
from towerflow.ps import PSService
from towerflow.ps.wire import ps_pb2 as pb
from towerflow.ps.wire.framing import pack

NUMEL = 8
SIGNATURE = [pb.SegmentSignature(name="w", shape=[NUMEL])]
FUZZ = settings(max_examples=60, deadline=2000, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])

int32 = st.one_of(st.integers(-3, 3), st.sampled_from([-(2**31), 2**31 - 1]))
int64 = st.one_of(st.integers(-3, 12), st.sampled_from([-(2**63), 2**63 - 1, 2**32, 2**62]))
uint64 = st.one_of(st.integers(0, 12), st.sampled_from([2**64 - 1, 2**63, 2**32]))
real = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.5, 1e-3]))
name = st.one_of(st.sampled_from(["", "w", "params", "sum", "float32", "w/part_0_of_2"]),
                 st.text(max_size=12))
shape = st.lists(int64, max_size=4)


def good_init(numel: int = NUMEL) -> bytes:
    return pb.InitRequest(
        shard=0, optimizer=pb.OptimizerSpec(name="sgd"),
        aggregation=pb.AggregationSpec(mode="async", total_num_replicas=2),
        segments=[pb.Segment(name="w", shape=[numel], var_shape=[numel], numel=numel,
                             num_parts=1)]).SerializeToString()


def live() -> PSService:
    service = PSService(0, replicas=2)
    service.init(iter([good_init(), np.linspace(-1, 1, NUMEL, dtype=np.float32).tobytes()]))
    return service


def snapshot(service: PSService) -> tuple:
    state = service.shard.state
    return (service._generation, state.step, state.params.copy(), state.admission.ledger_total)


def call(fn, *args) -> object:
    """Run a handler (draining a streamed reply); a TowerflowError is a clean refusal."""
    try:
        result = fn(*args)
        return result if isinstance(result, bytes) else b"".join(result)
    except TowerflowError as exc:
        return exc


def mostly(valid: st.SearchStrategy, other: st.SearchStrategy) -> st.SearchStrategy:
    """``valid`` three times in four, else ``other`` (so that many pushes get through)."""
    return st.one_of(valid, valid, valid, other)


push_header = st.builds(
    pb.PushRequest, worker_id=mostly(st.sampled_from([0, 1]), int32), incarnation=uint64,
    seq=uint64, token=int64, lr=mostly(st.sampled_from([0.5, 0.25]), real),
    dtype=mostly(st.sampled_from(["", "float32"]), name),
    numel=mostly(st.just(NUMEL), int64),
    segments=mostly(st.sampled_from([SIGNATURE, []]), st.lists(st.builds(
        pb.SegmentSignature, name=name, shape=shape), max_size=3)),
    want_params=st.booleans(), finite=st.booleans())
payload = st.one_of(
    st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True),
             min_size=NUMEL, max_size=NUMEL).map(lambda v: np.array(v, np.float32).tobytes()),
    st.lists(st.floats(-4, 4, width=32), min_size=NUMEL, max_size=NUMEL).map(
        lambda v: np.array(v, np.float32).tobytes()),
    st.binary(max_size=3 * NUMEL * 4))


def check_push(service: PSService, before: tuple, req: pb.PushRequest, data: bytes,
               reply: object) -> None:
    generation, step, params, ledger = before
    state = service.shard.state
    assert service._generation == generation
    if isinstance(reply, bytes):
        head = reply if req.want_params is False else reply
        status = parse_reply(head)
        if status.status == "applied" and not status.duplicate:
            grad = np.frombuffer(data, np.float32)
            expected = params - grad * req.lr
            np.testing.assert_array_equal(state.params, expected)
            assert state.step == step + 1 and state.admission.ledger_total == ledger + 1
            return
    np.testing.assert_array_equal(state.params, params)
    assert state.step == step and state.admission.ledger_total == ledger


def parse_reply(data: bytes) -> pb.PushReply:
    """The PushReply at the head of a Push / PushPull reply (or a packed small reply)."""
    for candidate in (data, data[4:4 + int.from_bytes(data[:4], "little")]):
        try:
            reply = pb.PushReply.FromString(candidate)
        except Exception:  # noqa: BLE001 - try the other framing
            continue
        if reply.status:
            return reply
    raise AssertionError(f"no PushReply in {data[:40]!r}")


@FUZZ
@given(req=push_header, data=payload, method=st.sampled_from(["Push", "PushPull", "Small",
                                                             "SmallStream"]))
def test_push_headers_are_refused_cleanly_or_applied_exactly_once(req, data, method) -> None:
    service = live()
    before = snapshot(service)
    head = req.SerializeToString()
    if method == "Push":
        reply = call(service.push, iter([head, data]))
    elif method == "PushPull":
        reply = call(lambda: [next(service.push_pull(iter([head, data])))])
    elif method == "Small":
        reply = call(service.push_pull_small, pack(head, data))
    else:
        reply = call(lambda: [next(service.push_pull_small_stream(iter([pack(head, data)])))])
    check_push(service, before, req, data, reply)


init_header = st.builds(
    pb.InitRequest, shard=st.one_of(st.just(0), int32),
    segments=st.lists(st.builds(pb.Segment, name=name, shape=shape, var_shape=shape,
                                start=int64, numel=int64, part=int32, num_parts=int32),
                      max_size=3),
    optimizer=st.builds(pb.OptimizerSpec, name=name, momentum=real, weight_decay=real,
                        beta1=real, beta2=real, eps=real, initial_accumulator_value=real),
    aggregation=st.builds(pb.AggregationSpec, mode=st.sampled_from(["async", "sync", "ssp", ""]),
                          total_num_replicas=int32, replicas_to_aggregate=int32,
                          staleness=int32, timeout=real, wait_forever=st.booleans()),
    step=int64, slots=st.lists(name, max_size=2), optimizer_step=int64,
    pushes=st.lists(st.builds(pb.PushRecord, worker_id=int32, incarnation=uint64, seq=uint64,
                              status=name), max_size=2))


@FUZZ
@given(req=st.one_of(init_header.map(lambda r: r.SerializeToString()), st.binary(max_size=64)),
       data=st.binary(max_size=64))
def test_init_headers_are_refused_cleanly_or_replace_the_shard_whole(req, data) -> None:
    service = live()
    generation, _, params, _ = snapshot(service)
    reply = call(service.init, iter([req, data]))
    if isinstance(reply, bytes):  # accepted: a whole new shard from exactly this payload
        state = service.shard.state
        assert service._generation == generation + 1
        assert len(data) == 4 * state.layout.numel * (1 + len(state.optimizer.slots)) or \
            len(data) == 4 * state.layout.numel * (1 + len(pb.InitRequest.FromString(req).slots))
        np.testing.assert_array_equal(
            state.params, np.frombuffer(data[:4 * state.layout.numel], np.float32))
    else:
        assert service._generation == generation
        np.testing.assert_array_equal(service.shard.state.params, params)


@FUZZ
@given(method=st.sampled_from(["Status", "Pull", "Done", "Ledger"]),
       req=st.one_of(
           st.builds(pb.PullRequest, worker_id=int32, buffer=name).map(
               lambda r: r.SerializeToString()),
           st.builds(pb.DoneRequest, worker_id=int32).map(lambda r: r.SerializeToString()),
           st.builds(pb.LedgerRequest, since=int64).map(lambda r: r.SerializeToString()),
           st.binary(max_size=32)))
def test_other_requests_are_answered_or_refused_cleanly_and_change_no_parameters(
        method, req) -> None:
    service = live()
    generation, step, params, ledger = snapshot(service)
    handler = {"Status": service.status, "Pull": service.pull, "Done": service.done,
               "Ledger": service.ledger}[method]
    call(handler, req)
    assert snapshot(service)[0:2] == (generation, step)
    np.testing.assert_array_equal(service.shard.state.params, params)
