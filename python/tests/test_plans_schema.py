"""The typed Python plan (`recompute_planner.plans`) holds exactly the fields of
`proto/plan.proto`: one class per message, one attribute per field, `None` allowed exactly
where the field is `optional`. A field added to the schema fails here until the reader has it.
"""

from __future__ import annotations

import dataclasses

import pytest

import recompute_planner as rp
from graph_walk import GOLDEN_DIR
from recompute_planner import plans
from recompute_planner.proto import plan_pb2

MESSAGES = plan_pb2.DESCRIPTOR.message_types_by_name


def _optional(field) -> bool:
    """A proto3 `optional` scalar (a message field has presence too, but is never null)."""
    return field.has_presence and field.message_type is None


def _dataclass_messages() -> list[str]:
    return [name for name in MESSAGES if name != "Plan"]


@pytest.mark.parametrize("message", _dataclass_messages())
def test_each_plan_message_is_a_dataclass_with_its_fields(message):
    cls = getattr(plans, message, None)
    assert cls is not None and dataclasses.is_dataclass(cls), (
        f"plan.proto's {message} has no dataclass in recompute_planner/plans.py"
    )
    descriptor = MESSAGES[message]
    in_schema = {f.name: _optional(f) for f in descriptor.fields}
    in_reader = {f.name: "None" in str(f.type) for f in dataclasses.fields(cls)}
    assert in_reader.keys() == in_schema.keys(), (
        f"{message}: plan.proto has {sorted(in_schema.keys() - in_reader.keys())} that "
        f"plans.py lacks, plans.py has {sorted(in_reader.keys() - in_schema.keys())} that "
        "plan.proto lacks"
    )
    wrong = sorted(name for name in in_schema if in_schema[name] != in_reader[name])
    assert not wrong, f"{message}: optional in one and not the other: {wrong}"


@pytest.mark.filterwarnings("ignore::recompute_planner.PlannerWarning")
def test_a_read_plan_has_every_top_level_field():
    plan = rp.plan(GOLDEN_DIR / "glm_dsa_ep2.pb", keep=["SAVE_DSA_INDEXER"])
    missing = [f.name for f in MESSAGES["Plan"].fields if not hasattr(plan, f.name)]
    assert not missing, f"recompute_planner.plans.Plan lacks plan.proto's {missing}"
