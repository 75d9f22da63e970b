"""Subprocesses a module's fixture waits for (a wheel build, a script that measures several
models), started in the background as soon as collection has selected one of the module's
tests, so that they run beside the tests before them instead of stalling the session when
their fixture is reached.

A test module lists its jobs in ``BACKGROUND_JOBS``; ``conftest.py`` queues the jobs of every
module with a selected test, in collection order, and one worker thread runs them one at a
time (pytest itself keeps one core busy; a second job would take the core from it). A fixture
calls ``finished(job)``: it waits for the job, starting it at once if nothing queued it, and
gets its ``subprocess.CompletedProcess`` and its output folder. What a job cannot start with (a
``pytest.skip`` while making its command) is raised again there, in the fixture.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from export_support import REPO_ROOT


@dataclass(frozen=True, eq=False)
class Job:
    """A command run in the repository root: ``command(out)`` gives its argv (``out`` is a
    fresh folder of its own) and ``env()`` the variables added to the session's."""

    name: str
    command: Callable[[Path], list[str]]
    env: Callable[[], dict[str, str]] = field(default=lambda: {})


@dataclass
class _Run:
    out: Path
    done: threading.Event = field(default_factory=threading.Event)
    process: subprocess.Popen | None = None
    result: subprocess.CompletedProcess | None = None
    error: BaseException | None = None


_lock = threading.Lock()
_runs: dict[Job, _Run] = {}
_queue: list[Job] = []
_wake = threading.Condition(_lock)
_worker: threading.Thread | None = None
_root: Path | None = None
_stopping = False


def queue(jobs: Iterable[Job]) -> None:
    """Runs `jobs`, in order, in the background (each once however often it is queued)."""
    global _worker
    with _lock:
        for job in jobs:
            if job not in _runs:
                _runs[job] = _Run(out=_fresh_folder(job))
                _queue.append(job)
        if _worker is None:
            _worker = threading.Thread(target=_work, name="background-jobs", daemon=True)
            _worker.start()
        _wake.notify()


def finished(job: Job) -> tuple[subprocess.CompletedProcess, Path]:
    """The job's completed process and output folder, once it has ended."""
    queue([job])
    with _lock:
        run = _runs[job]
        if job in _queue:  # not started yet: it goes next
            _queue.remove(job)
            _queue.insert(0, job)
    run.done.wait()
    if run.error is not None:
        raise run.error
    assert run.result is not None
    return run.result, run.out


def stop() -> None:
    """Ends the session's jobs (killing a running one) and removes their folders."""
    global _stopping
    with _lock:
        _stopping = True
        _queue.clear()
        running = [r.process for r in _runs.values() if r.process and r.process.poll() is None]
        _wake.notify()
    for process in running:
        process.kill()
        process.wait()
    if _root is not None:
        shutil.rmtree(_root, ignore_errors=True)


def _fresh_folder(job: Job) -> Path:
    global _root
    if _root is None:
        _root = Path(tempfile.mkdtemp(prefix="recompute-planner-tests-"))
    out = _root / job.name
    out.mkdir()
    return out


def _work() -> None:
    while True:
        with _lock:
            while not _queue and not _stopping:
                _wake.wait()
            if _stopping:
                return
            job = _queue.pop(0)
            run = _runs[job]
        try:
            _run(job, run)
        except BaseException as e:  # noqa: BLE001 - raised again in the fixture's thread
            run.error = e
        finally:
            run.done.set()


def _run(job: Job, run: _Run) -> None:
    """Runs the job with its output in files (a pipe nobody reads yet would fill and stall
    it)."""
    argv = job.command(run.out)
    env = {**os.environ, **job.env()}
    stdout, stderr = run.out / "stdout.txt", run.out / "stderr.txt"
    with stdout.open("w") as out, stderr.open("w") as err, _lock:
        if _stopping:
            return
        run.process = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=out, stderr=err)
    run.process.wait()
    run.result = subprocess.CompletedProcess(
        argv, run.process.returncode, stdout.read_text(), stderr.read_text()
    )
