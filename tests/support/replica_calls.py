"""Raw calls of the ps service for the replica tests: a push, a pull, Promote and Status
naming a shard and a term, on an authenticated channel to one ps task."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from towerflow.cluster.transport import unary, unary_stream
from towerflow.ps.wire import ps_pb2 as pb
from towerflow.ps.wire.calls import method_path
from towerflow.ps.wire.framing import pack, unpack
from towerflow.ps.wire.messages import PushHeader, encode_push_header, parse_message

TIMEOUT = 10.0


def push(channel: Any, layout: Any, *, seq: int, shard: int = -1, term: int = 0,
         value: float | np.ndarray = 1.0, worker: int = 0, incarnation: int = 7,
         lr: float = 0.1, token: int = 0) -> pb.PushReply:
    """One dense push of ``value`` in every element of ``layout`` (or of the array ``value``)
    computed on step ``token`` (``PushPullSmall``)."""
    header = PushHeader(worker, seq, token, lr, layout.numel, incarnation=incarnation,
                        segments=layout.signature, term=term, shard=shard)
    payload = np.broadcast_to(np.asarray(value, np.float32), (layout.numel,)).tobytes()
    data = unary(channel, method_path("PushPullSmall"),
                 pack(encode_push_header(header), payload), timeout=TIMEOUT)
    head, _ = unpack(data)
    return parse_message(pb.PushReply, head, "PushReply")


def pull(channel: Any, *, shard: int = -1, term: int = 0) -> np.ndarray:
    """The parameters of ``shard`` (-1: the task's own) as the task serves them."""
    request = pb.PullRequest(term=term)
    if shard >= 0:
        request.shard = shard
    replies = list(unary_stream(channel, method_path("Pull"), request.SerializeToString(),
                                timeout=TIMEOUT))
    return np.frombuffer(b"".join(replies[1:]), np.float32)


def promote(channel: Any, shard: int) -> pb.PromoteReply:
    """Promote the task's copy of ``shard`` to its primary."""
    data = unary(channel, method_path("Promote"),
                 pb.PromoteRequest(shard=shard).SerializeToString(), timeout=TIMEOUT)
    return parse_message(pb.PromoteReply, data, "PromoteReply")


def done(channel: Any, worker: int) -> None:
    """Worker ``worker`` says it has finished (``Done``)."""
    unary(channel, method_path("Done"), pb.DoneRequest(worker_id=worker).SerializeToString(),
          timeout=TIMEOUT)


def serve_ps(cluster: Any, task: int, credentials: Any, *, replica_timeout: float = 5.0
             ) -> tuple[Any, Any]:
    """A dense ps service of ``task`` (2 ps tasks, 64-byte chunks) in a started ``Server`` of
    this process -> (server, service); the caller stops the server."""
    from towerflow.cluster import Server
    from towerflow.ps import PSService

    server = Server(cluster, "ps", task, credentials=credentials, start=False)
    service = PSService(task, chunk_bytes=64, num_ps=2, replica_timeout=replica_timeout,
                        peer_channel=lambda k: server.channel("ps", k))
    server.add_handlers([service.handlers()])
    server.start()
    return server, service


def status(channel: Any) -> pb.StatusReply:
    """The task's ``Status``."""
    return parse_message(pb.StatusReply, unary(channel, method_path("Status"), b"",
                                               timeout=TIMEOUT), "StatusReply")


class Clicks(nn.Module):
    """A click model with a table on the ps (``sparse=True``) and a dense layer."""

    def __init__(self) -> None:
        super().__init__()
        self.item = nn.Embedding(50, 4, sparse=True)
        self.out = nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.item(ids)).squeeze(1)
