"""Subprocesses a module's fixture waits for (a wheel build, a script that measures several
models), started in the background as soon as collection has selected one of the module's
tests, so that they run beside the tests before them instead of stalling the session when
their fixture is reached.

A test module lists its jobs in ``BACKGROUND_JOBS``, each named after the fixture that waits
for it; ``conftest.py`` queues every job whose fixture a selected test uses (a session that
runs only the module's other tests leaves it alone) on the session's queue (``SESSION``), in
collection order, and
one worker thread runs them one at a time (pytest itself keeps one core busy; a second job
would take the core from it). A fixture calls ``SESSION.finished(job)``: it waits for the job,
starting it next if it has not started, and gets its ``subprocess.CompletedProcess`` and its
output folder. What a job cannot start with (a ``pytest.skip`` while making its command) is
raised again there, in the fixture.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
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


class JobQueue:
    """Jobs run one at a time by a worker thread, in the order queued."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._runs: dict[Job, _Run] = {}
        self._queue: list[Job] = []
        self._worker: threading.Thread | None = None
        self._root: Path | None = None
        self._stopping = False

    def queue(self, jobs: Iterable[Job]) -> None:
        """Runs `jobs`, in order, after those queued before (each once however often it is
        queued)."""
        with self._lock:
            if self._stopping:
                raise RuntimeError("the background jobs were stopped")
            for job in jobs:
                if job not in self._runs:
                    self._runs[job] = _Run(out=self._fresh_folder(job))
                    self._queue.append(job)
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name="background-jobs",
                                                daemon=True)
                self._worker.start()
            self._wake.notify()

    def finished(self, job: Job) -> tuple[subprocess.CompletedProcess, Path]:
        """The job's completed process and output folder, once it has ended; a job not
        started yet goes next."""
        self.queue([job])
        with self._lock:
            run = self._runs[job]
            if job in self._queue:
                self._queue.remove(job)
                self._queue.insert(0, job)
        run.done.wait()
        if run.error is not None:
            raise run.error
        assert run.result is not None
        return run.result, run.out

    def stop(self) -> None:
        """Ends the jobs (killing a running one with every process it started), fails the
        waits of those that never ran, and removes their folders."""
        with self._lock:
            self._stopping = True
            for job in self._queue:
                self._runs[job].error = RuntimeError("the background jobs were stopped")
                self._runs[job].done.set()
            self._queue.clear()
            running = [r.process for r in self._runs.values()
                       if r.process and r.process.poll() is None]
            self._wake.notify()
        for process in running:
            with contextlib.suppress(ProcessLookupError):  # it may have just ended
                os.killpg(process.pid, signal.SIGKILL)  # its own session: cargo, rustc, ...
            process.wait()
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)

    def _fresh_folder(self, job: Job) -> Path:
        if self._root is None:
            self._root = Path(tempfile.mkdtemp(prefix="recompute-planner-tests-"))
        out = self._root / job.name
        out.mkdir()
        return out

    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._stopping:
                    self._wake.wait()
                if self._stopping:
                    return
                job = self._queue.pop(0)
                run = self._runs[job]
            try:
                self._run(job, run)
            except BaseException as e:  # noqa: BLE001 - raised again in the fixture's thread
                run.error = e
            finally:
                run.done.set()

    def _run(self, job: Job, run: _Run) -> None:
        """Runs the job with its output in files (a pipe nobody reads yet would fill and
        stall it)."""
        argv = job.command(run.out)
        env = {**os.environ, **job.env()}
        stdout, stderr = run.out / "stdout.txt", run.out / "stderr.txt"
        with stdout.open("w") as out, stderr.open("w") as err, self._lock:
            if self._stopping:
                raise RuntimeError("the background jobs were stopped")
            run.process = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=out, stderr=err,
                                           start_new_session=True)
        run.process.wait()
        run.result = subprocess.CompletedProcess(
            argv, run.process.returncode, stdout.read_text(), stderr.read_text()
        )


#: The session's jobs (conftest.py queues them and stops them at the end).
SESSION = JobQueue()
