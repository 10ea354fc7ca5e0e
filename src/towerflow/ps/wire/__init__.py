"""The ps wire room: everything a ps task and a worker agree on, and nothing else.

Both halves (:mod:`towerflow.ps.server`, :mod:`towerflow.ps.worker`) import
this package; it imports neither of them (an import contract in
``pyproject.toml`` says so). The map:

- ``ps.proto`` / ``tables.proto`` — the control messages of the dense shard
  service (``towerflow.ps.PS``) and of the sparse tables (``towerflow.ps.Tables``),
  with their generated modules :mod:`~towerflow.ps.wire.ps_pb2` and
  :mod:`~towerflow.ps.wire.tables_pb2` (regenerate them with
  ``python -m grpc_tools.protoc -Isrc --python_out=src
  src/towerflow/ps/wire/ps.proto src/towerflow/ps/wire/tables.proto``;
  ``tests/ps/wire/test_ps_wire_protos.py`` checks they match);
- :mod:`~towerflow.ps.wire.calls` — the service's name and methods, the call
  sequence by role, the status codes of a push, the aggregation modes and the
  elastic worker ids;
- :mod:`~towerflow.ps.wire.framing` — how bytes travel: streamed chunks of a
  flat float32 buffer (:func:`~towerflow.ps.wire.framing.chunks`,
  :func:`~towerflow.ps.wire.framing.receive_into`) and one-message frames of a
  header and raw parts (:func:`~towerflow.ps.wire.framing.pack`,
  :func:`~towerflow.ps.wire.framing.unpack`,
  :func:`~towerflow.ps.wire.framing.pack_parts`,
  :func:`~towerflow.ps.wire.framing.split_parts`);
- :mod:`~towerflow.ps.wire.messages` — protobuf messages <-> Python values:
  :class:`~towerflow.ps.wire.messages.PushHeader`,
  :class:`~towerflow.ps.wire.messages.PushOutcome`,
  :class:`~towerflow.ps.wire.messages.AggregationConfig`, layouts, optimizer
  specs and push records, and the parsing of received messages;
- :mod:`~towerflow.ps.wire.tensors` — tensors as raw little-endian buffers:
  one encode (:func:`~towerflow.ps.wire.tensors.encode`, or its view
  :func:`~towerflow.ps.wire.tensors.raw_bytes`) and one decode
  (:func:`~towerflow.ps.wire.tensors.decode`) for the tables of both halves
  (this module and :mod:`~towerflow.ps.wire.tables` import torch; the others do not);
- :mod:`~towerflow.ps.wire.finite` — the NaN / inf scans of a push's float32
  payload, run by the sender (``PushRequest.finite``) and by the shard.

Nothing on the wire is pickled. This package's ``__init__`` imports nothing:
import the module that holds a name.
"""
