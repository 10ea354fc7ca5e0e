"""The ps wing's .proto files, their generated modules and the messages they share."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

import towerflow
from towerflow.ps.wire import ps_pb2 as pb
from towerflow.ps.wire import tables_pb2 as tpb
from towerflow.ps.wire.calls import APPLIED, method_path
from towerflow.ps.wire.messages import push_records, push_rows
from towerflow.ps.worker import observe

SRC = Path(towerflow.__file__).resolve().parent.parent


def _file_proto(serialized: bytes) -> descriptor_pb2.FileDescriptorProto:
    """A FileDescriptorProto without json names (generated modules keep only explicit ones)."""
    proto = descriptor_pb2.FileDescriptorProto.FromString(serialized)
    for message in proto.message_type:
        stack = [message]
        while stack:
            current = stack.pop()
            for field in current.field:
                field.ClearField("json_name")
            stack.extend(current.nested_type)
    return proto


@pytest.mark.parametrize("module", [pb, tpb], ids=["ps", "tables"])
def test_generated_module_matches_its_proto(module, tmp_path):
    pytest.importorskip("grpc_tools")
    name = module.DESCRIPTOR.name
    out = tmp_path / "set.pb"
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{SRC}",
                    f"--descriptor_set_out={out}", name], check=True, cwd=SRC, timeout=60)
    files = {f.name: f for f in descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file}
    assert _file_proto(files[name].SerializeToString()) == \
        _file_proto(module.DESCRIPTOR.serialized_pb), f"regenerate {name}'s module with protoc"


def test_tables_use_the_ps_push_record():
    assert not hasattr(tpb, "TablePushRecord")
    assert pb.DESCRIPTOR in tpb.DESCRIPTOR.dependencies
    for message in (tpb.RowChunk, tpb.TableStatusReply):
        assert message.DESCRIPTOR.fields_by_name["pushes"].message_type is pb.PushRecord.DESCRIPTOR


def test_table_push_records_round_trip_through_the_message_helpers():
    rows = [(3, 7, 11, APPLIED), ((1 << 20) + 2, (1 << 63) + 5, (1 << 64) - 1, "stale")]
    chunk = tpb.RowChunk(pushes=push_records(rows))
    again = tpb.RowChunk.FromString(chunk.SerializeToString())
    assert list(push_rows(again.pushes)) == rows
    status = tpb.TableStatusReply(pushes=push_records(rows))
    assert list(push_rows(tpb.TableStatusReply.FromString(
        status.SerializeToString()).pushes)) == rows


def test_push_record_bytes_are_those_of_the_former_table_record():
    # field 3 of RowChunk: (worker_id=5, incarnation=2, seq=9, status="applied"), as sent by
    # a table client built on the former per-table record message.
    record = b"\x08\x05\x10\x02\x18\x09\x22\x07applied"
    chunk = tpb.RowChunk.FromString(b"\x1a" + bytes([len(record)]) + record)
    assert push_rows(chunk.pushes) == ((5, 2, 9, "applied"),)
    assert chunk.SerializeToString() == b"\x1a" + bytes([len(record)]) + record


def test_observe_status_path_is_the_wire_method_path():
    assert observe.STATUS_METHOD == method_path("Status") == "/towerflow.ps.PS/Status"
