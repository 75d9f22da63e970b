"""The ``planner`` command the package installs (``[project.scripts]``): the planner's command
line (``plan``, ``diff``, ``pareto``, ``inspect``, ``convert``) run by the native extension,
the same code as the Rust binary. Importing the package for it loads no torch."""

from __future__ import annotations

import os
import signal
import sys

from . import _native

__all__ = ["main"]


def main() -> int:
    """Runs ``planner`` with this process's arguments; returns its exit status."""
    # The planner does not return to Python until it is done: Ctrl-C ends the process at once,
    # as it ends the binary.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    return _native.planner_main([b"planner", *map(os.fsencode, sys.argv[1:])])
