"""The background jobs fixtures wait for (background.py): run one at a time in the order
queued, each once, and what a job could not start with is raised in the fixture."""

import sys

import pytest

import background


def _job(name: str, code: str) -> background.Job:
    return background.Job(name, lambda out: [sys.executable, "-c", code])


def test_jobs_run_once_each_one_at_a_time_in_the_order_queued(tmp_path):
    log = tmp_path / "log"
    # Each job notes its start and end: a job started before the previous one ended would
    # interleave the lines.
    jobs = [
        _job(
            f"order-{i}",
            f"import time; f = open({str(log)!r}, 'a'); f.write('start {i}\\n'); f.flush(); "
            f"time.sleep(0.2); f.write('end {i}\\n')",
        )
        for i in range(3)
    ]
    background.queue(jobs)
    background.queue(jobs[:1])  # queued again: not run again
    for job in jobs:
        done, out = background.finished(job)
        assert done.returncode == 0, done.stderr
        assert out.is_dir()
    assert log.read_text().split("\n")[:-1] == [
        f"{edge} {i}" for i in range(3) for edge in ("start", "end")
    ]


def test_a_job_nothing_queued_runs_when_its_fixture_asks_for_it():
    done, _ = background.finished(_job("unqueued", "print('ran')"))
    assert done.stdout.strip() == "ran"


def test_a_skip_while_making_the_command_skips_the_waiting_fixture():
    def skipped(out):
        pytest.skip("no tool")

    with pytest.raises(pytest.skip.Exception, match="no tool"):
        background.finished(background.Job("skipped", skipped))
