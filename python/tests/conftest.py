"""Fixtures shared by the Python tests."""

from collections.abc import Iterator

import pytest

import export_support


@pytest.fixture(scope="session")
def planner_bin() -> str:
    """The planner CLI: $PLANNER_BIN, else built with cargo in the repository root."""
    return str(export_support.planner_bin())


@pytest.fixture
def builders_agree(monkeypatch: pytest.MonkeyPatch) -> Iterator[list]:
    """Every graph the test exports is built by the native builder, without a decline, and
    by the Python builder, with the same bytes (``export_support.check_builders_agree``)."""
    built = export_support.check_builders_agree(monkeypatch)
    yield built
    assert built, "the test built no graph"
