"""The background jobs fixtures wait for (background.py): run one at a time in the order
queued, each once, and what a job could not start with is raised in the fixture. Each test
has a queue of its own, apart from the session's."""

import sys
from collections.abc import Iterator

import pytest

import background


@pytest.fixture
def jobs() -> Iterator[background.JobQueue]:
    queue = background.JobQueue()
    yield queue
    queue.stop()


def _job(name: str, code: str) -> background.Job:
    return background.Job(name, lambda out: [sys.executable, "-c", code])


def test_jobs_run_once_each_one_at_a_time_in_the_order_queued(jobs, tmp_path):
    log = tmp_path / "log"
    # Each job notes its start and end: a job started before the previous one ended would
    # interleave the lines.
    queued = [
        _job(
            f"order-{i}",
            f"import time; f = open({str(log)!r}, 'a'); f.write('start {i}\\n'); f.flush(); "
            f"time.sleep(0.2); f.write('end {i}\\n')",
        )
        for i in range(3)
    ]
    jobs.queue(queued)
    jobs.queue(queued[:1])  # queued again: not run again
    for job in queued:
        done, out = jobs.finished(job)
        assert done.returncode == 0, done.stderr
        assert out.is_dir()
    assert log.read_text().split("\n")[:-1] == [
        f"{edge} {i}" for i in range(3) for edge in ("start", "end")
    ]


def test_a_job_nothing_queued_runs_when_its_fixture_asks_for_it(jobs):
    done, _ = jobs.finished(_job("unqueued", "print('ran')"))
    assert done.stdout.strip() == "ran"


def test_a_skip_while_making_the_command_skips_the_waiting_fixture(jobs):
    def skipped(out):
        pytest.skip("no tool")

    with pytest.raises(pytest.skip.Exception, match="no tool"):
        jobs.finished(background.Job("skipped", skipped))
