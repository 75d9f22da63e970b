"""Fixtures shared by the Python tests."""

import pytest

import export_support


@pytest.fixture(scope="session")
def planner_bin() -> str:
    """The planner CLI: $PLANNER_BIN, else built with cargo in the repository root."""
    return str(export_support.planner_bin())
