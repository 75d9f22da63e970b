"""Python bindings of the IR (``proto/graph.proto``) and the plan (``proto/plan.proto``).

``graph_pb2`` and ``plan_pb2`` are built on import from the file descriptors the native
extension carries (``_native.DESCRIPTORS``, compiled from the ``.proto`` files when the
extension was built), exactly as a protoc-generated ``_pb2`` module builds itself from the
descriptor it embeds. So the Python messages are the planner's own schema, and nothing runs
protoc or writes a file at import: an installed wheel works offline in a read-only
site-packages.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

from google.protobuf import descriptor_pool
from google.protobuf.internal import builder

from . import _native


def _module(name: str, serialized: bytes) -> ModuleType:
    """The ``_pb2`` module ``name`` of one serialized ``FileDescriptorProto``, registered as
    ``recompute_planner.proto.NAME`` so its messages pickle and import by that name."""
    qualified = f"{__name__}.{name}"
    module = ModuleType(qualified)
    namespace = module.__dict__
    namespace["DESCRIPTOR"] = descriptor_pool.Default().AddSerializedFile(serialized)
    builder.BuildMessageAndEnumDescriptors(namespace["DESCRIPTOR"], namespace)
    builder.BuildTopDescriptorsAndMessages(namespace["DESCRIPTOR"], qualified, namespace)
    sys.modules[qualified] = module
    return module


_MODULES = {name: _module(name, serialized) for name, serialized in _native.DESCRIPTORS}
# Their message classes exist only once built: to a type checker they are `Any`.
graph_pb2: Any = _MODULES["graph_pb2"]
plan_pb2: Any = _MODULES["plan_pb2"]

__all__ = ["graph_pb2", "plan_pb2"]
