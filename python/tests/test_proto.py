"""The protobuf modules (recompute_planner.proto) are the planner's own schema, built without
protoc: from the descriptors compiled into the native extension."""

from __future__ import annotations

import pickle
import subprocess
import sys

from recompute_planner import _native, proto


def test_the_modules_hold_the_descriptors_the_planner_was_built_with():
    compiled = dict(_native.DESCRIPTORS)
    assert proto.graph_pb2.DESCRIPTOR.serialized_pb == compiled["graph_pb2"]
    assert proto.plan_pb2.DESCRIPTOR.serialized_pb == compiled["plan_pb2"]
    assert proto.graph_pb2.Graph.DESCRIPTOR.full_name == "recompute.ir.v1.Graph"
    assert proto.plan_pb2.DESCRIPTOR.package == "recompute.plan.v1"


def test_messages_import_and_pickle_by_the_modules_name():
    node = proto.graph_pb2.Node(name="mm", op="aten.mm.default", inputs=["a", "b"])
    assert type(node).__module__ == "recompute_planner.proto.graph_pb2"
    assert pickle.loads(pickle.dumps(node)) == node


def test_importing_the_package_runs_no_protoc_and_writes_nothing():
    """Importing grpc_tools fails in the child; the package imports and builds messages."""
    code = (
        "import sys\n"
        "class Refuse:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'grpc_tools':\n"
        "            raise ImportError('grpc_tools is not available')\n"
        "sys.meta_path.insert(0, Refuse())\n"
        "sys.dont_write_bytecode = True\n"
        "import recompute_planner as rp\n"
        "from recompute_planner.proto import graph_pb2, plan_pb2\n"
        "print(graph_pb2.Value(name='x').name, plan_pb2.Plan().joint)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["x", "False"]
