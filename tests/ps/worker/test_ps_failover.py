"""A worker's route to each shard with ``replicas=1`` (:mod:`towerflow.ps.worker.failover`,
:mod:`towerflow.ps.worker.tables.routing`): requests name the shard and term, re-framed after
a switch; and the sentence when no switch is possible (the switch itself, with real ps processes:
``tests/faults/test_faults_ps_failover.py``)."""

from __future__ import annotations

import numpy as np
import pytest

from towerflow.cluster.transport import Credentials
from towerflow.errors import DeadlineExceededError, FailedPreconditionError, UnavailableError
from towerflow.ps import plan_placement
from towerflow.ps.wire import ps_pb2 as pb
from towerflow.ps.wire import tables_pb2 as tpb
from towerflow.ps.wire.framing import pack, pack_parts, split_parts, unpack
from towerflow.ps.wire.messages import PushHeader, encode_push_header
from towerflow.ps.worker.failover import ShardRoute, failover_worthy, routed_push
from towerflow.ps.worker.tables.batch import Call
from towerflow.ps.worker.tables.routing import TableRouting

SECRET = Credentials(secret=b"failover-secret")
PLAN = plan_placement({"a": (64,), "b": (64,)}, 2)


def _push(term: int = 0, shard: int = -1) -> bytes:
    header = PushHeader(3, 9, 0, 0.5, 4, incarnation=11, term=term, shard=shard)
    return pack(encode_push_header(header), np.ones(4, np.float32).tobytes())


def test_a_push_named_at_its_term_is_sent_as_it_is():
    request = _push(term=2, shard=0)
    assert routed_push(request, 0, 2) is request


def test_a_resent_push_names_the_new_term_and_keeps_its_identity_and_payload():
    routed = routed_push(_push(term=1, shard=0), 0, 2)
    head, payload = unpack(routed)
    named = pb.PushRequest.FromString(head)
    assert (named.term, named.shard) == (2, 0)
    assert (named.worker_id, named.incarnation, named.seq) == (3, 11, 9)
    assert bytes(payload) == np.ones(4, np.float32).tobytes()


def test_a_row_batch_and_the_dense_push_it_carries_name_the_new_term():
    dense = _push(term=1, shard=1)
    request = tpb.RowBatchRequest(dense=True, term=1)
    request.parts.extend([3, len(dense)])
    call = Call(1, "Dense", pack_parts(request.SerializeToString(), [b"abc", dense]), True, [])
    routing = TableRouting([None, None], replicas=1)
    assert routing.payload(call) is call.payload  # term 1: as it is
    routing.routes[1].term = 2
    head, payload = unpack(routing.payload(call))
    routed = tpb.RowBatchRequest.FromString(head)
    parts = split_parts(payload, routed.parts, "RowBatchRequest")
    assert routed.term == 2 and bytes(parts[0]) == b"abc"
    assert pb.PushRequest.FromString(unpack(bytes(parts[1]))[0]).term == 2


def test_without_replicas_table_calls_go_to_their_own_task_unchanged():
    routing = TableRouting(["task0", "task1"])
    call = Call(1, "Dense", b"payload", True, [])
    assert (routing.channel(1), routing.payload(call), routing.where(1)) == \
        ("task1", b"payload", None)


@pytest.mark.parametrize(("error", "worthy"), [
    (UnavailableError("gone"), True), (DeadlineExceededError("stalled"), True),
    (FailedPreconditionError("ps task 0 is no longer the primary of shard 0 (term 1)"), True),
    (FailedPreconditionError("ps task 0 holds only a replica of shard 0 (term 2)"), True),
    (FailedPreconditionError("ps shard 0 is not initialised yet; the chief ..."), True),
    (FailedPreconditionError("the chief failed"), False)])
def test_what_makes_a_worker_consider_a_switch(error, worthy):
    assert failover_worthy(error) is worthy


def test_a_shard_on_its_copy_fails_over_back_to_its_own_task_where_its_copy_rejoins():
    route = ShardRoute(0, 3, lambda task: None)
    assert route.successor == 1
    route.task, route.term = 1, 2
    assert route.successor == 0
    last = ShardRoute(2, 3, lambda task: None)
    assert last.successor == 0
    last.task = 0
    assert last.successor == 2
