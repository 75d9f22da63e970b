"""The generated protobuf modules follow the .proto files (recompute_planner.proto)."""

from __future__ import annotations

import shutil

from recompute_planner import proto


def _isolated(monkeypatch, tmp_path):
    """Points the generator at a copy of proto/ and an empty output folder under tmp_path."""
    protos = tmp_path / "proto"
    shutil.copytree(proto.PROTO_DIR, protos)
    monkeypatch.setattr(proto, "PROTO_DIR", protos)
    monkeypatch.setattr(proto, "GENERATED_DIR", tmp_path / "generated")
    return protos


def test_modules_are_generated_when_missing_and_reused_when_current(monkeypatch, tmp_path):
    _isolated(monkeypatch, tmp_path)
    assert proto.ensure_generated() is True
    generated = tmp_path / "generated"
    expected = {"graph_pb2.py", "plan_pb2.py", proto.HASH_FILE_NAME}
    assert expected <= {p.name for p in generated.iterdir()}
    assert (generated / proto.HASH_FILE_NAME).read_text().strip() == proto.proto_hash()
    assert proto.ensure_generated() is False


def test_modules_are_regenerated_when_a_proto_file_changes(monkeypatch, tmp_path):
    protos = _isolated(monkeypatch, tmp_path)
    proto.ensure_generated()
    before = proto.proto_hash()
    graph_proto = protos / "graph.proto"
    graph_proto.write_text(graph_proto.read_text() + "\nmessage AddedForTheTest {}\n")
    assert proto.proto_hash() != before
    assert proto.ensure_generated() is True
    assert "_ADDEDFORTHETEST" in (tmp_path / "generated" / "graph_pb2.py").read_text()


def test_the_package_modules_are_current():
    assert proto.ensure_generated() is False
    assert proto.graph_pb2.Graph.DESCRIPTOR.full_name == "recompute.ir.v1.Graph"
    assert proto.plan_pb2.DESCRIPTOR.package == "recompute.plan.v1"
