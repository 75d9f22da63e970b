"""Fixtures shared by the Python tests."""

import sys
from collections.abc import Iterator

import pytest

import background
import export_support


@pytest.hookimpl(trylast=True)  # after `-k` and `-m` have deselected tests
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Moves the tests marked ``timed`` (those that compare times measured apart) to the end,
    when the background jobs have ended; then starts the background jobs (``background.py``)
    whose fixtures a selected test uses, in the order the tests run."""
    items.sort(key=lambda item: item.get_closest_marker("timed") is not None)  # stable
    functions = [item for item in items if isinstance(item, pytest.Function)]
    used = {name for item in functions for name in item.fixturenames}
    modules = dict.fromkeys(item.module for item in functions)
    jobs = (
        job
        for module in modules
        for job in getattr(module, "BACKGROUND_JOBS", ())
        if job.name in used
    )
    background.SESSION.queue(jobs)


def pytest_sessionfinish() -> None:
    background.SESSION.stop()


@pytest.fixture(scope="session")
def planner_bin() -> str:
    """The planner CLI: $PLANNER_BIN, else built with cargo in the repository root."""
    return str(export_support.planner_bin())


@pytest.fixture
def builders_agree(monkeypatch: pytest.MonkeyPatch) -> Iterator[list]:
    """Every graph the test exports is built by the native builder and by the Python builder
    the tests keep as its reference, with the same bytes
    (``export_support.check_builders_agree``)."""
    built = export_support.check_builders_agree(monkeypatch)
    yield built
    assert built, "the test built no graph"


@pytest.fixture(autouse=True)
def no_trace_annotation_outlives_its_test() -> Iterator[None]:
    """A test must leave no ``torch.fx.traceback.annotate`` scope open: an annotation left in
    ``current_meta`` tags every op any later trace in the process records (a layer, a module
    path), so later exports would attribute their ops to the wrong layer. The test that leaks
    fails here, by name, and the annotation is cleared for the next one."""
    yield
    traceback = sys.modules.get("torch.fx.traceback")
    left = getattr(traceback, "current_meta", {}).get("custom") if traceback else None
    if left is not None:
        del traceback.current_meta["custom"]
        pytest.fail(f"the test left a trace annotation open: {left}")
