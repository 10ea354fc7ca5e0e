"""Bad inputs thrown at a running ps task: each must be refused and change nothing.

:func:`probe_bad_inputs` initialises the (single) ps shard of a cluster with a
small known model through an honest client, then tries, one after the other:
a gradient of the wrong shape, of the wrong dtype, with NaN, with inf; a call
without credentials and one with the wrong secret; a message over the size
limit; a malformed push header and a payload that disagrees with its header;
an ``Init`` whose tensor header lies; and a corrupt checkpoint. After every
attempt it pulls the parameters back and checks that they are unchanged.

Example (with a ps task serving ``cluster``'s ps job)::

    results = probe_bad_inputs(cluster, credentials, workdir=tmp)
    assert all(r.refused for r in results)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from towerflow.cluster.transport import Credentials, make_channel, stream_unary, unary
from towerflow.errors import (
    DataLossError,
    InvalidArgumentError,
    ResourceExhaustedError,
    TowerflowError,
    UnauthenticatedError,
)

__all__ = ["ProbeResult", "probe_bad_inputs", "PROBE_SHAPES"]

#: the model the probes put on the ps
PROBE_SHAPES = {"w": (16, 4), "b": (4,)}
_PS = "/towerflow.ps.PS/"


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """One bad input and what happened to it.

    Attributes:
        name: what was tried.
        refused: it was refused with an error (or a ``refused`` push status)
            and the parameters were left unchanged.
        detail: the error message, or why the probe failed.
    """

    name: str
    refused: bool
    detail: str


class _Refused(Exception):
    """Raised by a probe whose bad input was refused (carries the reason)."""


def _expect(errors: tuple[type[TowerflowError], ...], call: Callable[[], Any]) -> str:
    try:
        outcome = call()
    except errors as exc:
        return str(exc)
    raise _Refused(f"accepted (returned {outcome!r})")


def _refused_push(result: Any) -> str:
    if getattr(result, "refused", False) or getattr(result, "status", "") == "refused":
        messages = getattr(result, "messages", None) or (getattr(result, "message", ""),)
        return next((m for m in messages if m), "refused")
    raise _Refused(f"accepted (push result {result!r})")


def _grad(client: Any, value: float) -> list[np.ndarray]:
    return [np.full(s.numel, value, np.float32) for s in client.placement.shards]


def _probes(cluster: Any, credentials: Credentials, honest: Any,
            workdir: Path) -> dict[str, Callable[[], str]]:
    from towerflow.ps import PSClient, plan_placement

    address = cluster.task_address("ps", 0)

    def pushing(creds: Credentials, shapes: dict[str, tuple[int, ...]],
                check: Callable[[Callable[[], Any]], str], worker: int = 0) -> str:
        other = PSClient(cluster, plan_placement(shapes, 1), worker_id=worker, credentials=creds,
                         timeout=5.0, on_bad_gradient="skip")
        try:
            return check(lambda: other.push(_grad(other, 1.0), lr=0.1))
        finally:
            other.close(done=False)

    def wrong_shape() -> str:
        return pushing(credentials, {"w": (4, 16), "b": (4,)}, lambda push: _refused_push(push()))

    def wrong_dtype() -> str:
        shard = honest.shards[0]
        grad = np.ones(shard.layout.numel, np.float64)
        return _refused_push(shard.push(grad, worker_id=0, incarnation=honest.incarnation,
                                        seq=1 << 40, lr=0.1))

    def stray_worker() -> str:
        return pushing(credentials, PROBE_SHAPES, lambda push: _refused_push(push()), worker=7)

    def superseded_incarnation() -> str:
        payload_disagrees_with_header()  # registers the honest incarnation, changes nothing
        shard = honest.shards[0]
        grad = np.ones(shard.layout.numel, np.float32)
        return _refused_push(shard.push(grad, worker_id=0, incarnation=honest.incarnation - 1,
                                        seq=1, lr=0.1))

    def unauthenticated(creds: Credentials) -> Callable[[], str]:
        return lambda: pushing(creds, PROBE_SHAPES,
                               lambda push: _expect((UnauthenticatedError,), push))

    def oversized() -> str:  # the client may send it; the ps must refuse it
        channel = make_channel(address, credentials, max_message_bytes=128 << 20)
        try:
            return _expect((ResourceExhaustedError,), lambda: unary(
                channel, _PS + "Status", b"\0" * (65 << 20), timeout=30.0))
        finally:
            channel.close()

    def malformed_push_header() -> str:
        channel = make_channel(address, credentials)
        try:
            return _expect((InvalidArgumentError,), lambda: stream_unary(
                channel, _PS + "Push", [b"\xff\xfe not a protobuf", b"\0" * 16], timeout=10.0))
        finally:
            channel.close()

    def payload_disagrees_with_header() -> str:
        from towerflow.ps.wire import ps_pb2 as pb

        layout = honest.shards[0].layout
        head = pb.PushRequest(worker_id=0, incarnation=honest.incarnation, seq=(1 << 40) + 1,
                              lr=0.1, dtype="float32", numel=layout.numel).SerializeToString()
        channel = make_channel(address, credentials)
        try:
            reply = pb.PushReply.FromString(stream_unary(
                channel, _PS + "Push", [head, b"\0" * 6], timeout=10.0))
        finally:
            channel.close()
        return _refused_push(reply)

    def lying_init(shape: list[int], numel: int) -> Callable[[], str]:
        """A well-formed ``Init`` whose one tensor header lies (16 payload elements follow)."""
        from towerflow.ps.wire import ps_pb2 as pb

        head = pb.InitRequest(
            shard=0, optimizer=pb.OptimizerSpec(name="sgd"),
            aggregation=pb.AggregationSpec(mode="async", total_num_replicas=1),
            segments=[pb.Segment(name="x", shape=shape, var_shape=shape, numel=numel,
                                 num_parts=1)]).SerializeToString()

        def send() -> bytes:
            channel = make_channel(address, credentials)
            try:
                return stream_unary(channel, _PS + "Init", [head, b"\0" * 64], timeout=10.0)
            finally:
                channel.close()

        return lambda: _expect((DataLossError, InvalidArgumentError), send)

    return {
        "wrong shape": wrong_shape,
        "wrong dtype": wrong_dtype,
        "push from a worker outside the replica set": stray_worker,
        "push from a superseded incarnation": superseded_incarnation,
        "NaN": lambda: _refused_push(honest.push(_grad(honest, float("nan")), lr=0.1)),
        "inf": lambda: _refused_push(honest.push(_grad(honest, float("inf")), lr=0.1)),
        "unauthenticated call": unauthenticated(Credentials()),
        "wrong secret": unauthenticated(Credentials(secret=b"not-the-cluster-secret")),
        "oversized message": oversized,
        "malformed push header": malformed_push_header,
        "payload disagreeing with its header": payload_disagrees_with_header,
        "tensor header with a negative dimension": lying_init([-1, 4], 4),
        "tensor header whose size overflows": lying_init([1 << 40, 1 << 40], 4),
        "tensor header with a wrong byte count": lying_init([2], 4),
        "corrupt checkpoint": lambda: _corrupt_checkpoint(workdir),
    }


def _corrupt_checkpoint(workdir: Path) -> str:
    import torch

    from towerflow.checkpoint import read_checkpoint, save

    path = save({"w": torch.ones(64)}, workdir / "probe-checkpoint")
    target = next(p for p in Path(path).rglob("*.safetensors"))
    data = bytearray(target.read_bytes())
    data[-1] ^= 0xFF
    target.write_bytes(bytes(data))
    return _expect((DataLossError,), lambda: read_checkpoint(Path(path)))


def probe_bad_inputs(cluster: Any, credentials: Credentials, *,
                     workdir: str | Path) -> list[ProbeResult]:
    """Initialise ``cluster``'s ps task 0 and throw every bad input at it.

    Args:
        cluster: a cluster whose ``ps`` job has one running, uninitialised task.
        credentials: the cluster's credentials (the honest client's).
        workdir: an empty directory for the checkpoint probe.
    """
    from towerflow.ps import AggregationConfig, PSClient, plan_placement
    from towerflow.ps.wire import ps_pb2 as pb

    workdir = Path(workdir)
    placement = plan_placement(PROBE_SHAPES, 1)
    honest = PSClient(cluster, placement, worker_id=0, credentials=credentials, timeout=10.0,
                      on_bad_gradient="skip")
    try:
        start = [np.linspace(-1, 1, s.numel, dtype=np.float32) for s in placement.shards]
        honest.initialize(start, optimizer=pb.OptimizerSpec(name="sgd"),
                          aggregation=AggregationConfig())
        results = []
        for name, probe in _probes(cluster, credentials, honest, workdir).items():
            try:
                detail, refused = probe(), True
            except _Refused as exc:
                detail, refused = str(exc), False
            current = [np.empty(s.numel, np.float32) for s in placement.shards]
            honest.pull(current)
            if not all(np.array_equal(a, b) for a, b in zip(start, current, strict=True)):
                detail, refused = f"parameters changed after it ({detail})", False
            results.append(ProbeResult(name, refused, detail))
        return results
    finally:
        honest.close(done=False)
