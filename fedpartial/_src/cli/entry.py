"""The ``fedpartial`` command's entry point (``[project.scripts]`` and ``python -m fedpartial``).

It imports nothing heavy itself: the command line (and with it JAX) is imported here while Ctrl-C exits at
once with one sentence — nothing has been written yet, and a KeyboardInterrupt raised inside an extension's
initialisation would surface as an ImportError traceback, or be swallowed by a garbage-collector callback.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

#: what a Ctrl-C while the command line loads says
STARTING = "fedpartial: interrupted while starting; nothing was written.\n"


def _exit_at_once(signum, frame) -> None:
    os.write(2, STARTING.encode())
    os._exit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    """Imports and runs :func:`fedpartial._src.cli.main.main`; a Ctrl-C before it runs exits 130."""
    guard = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, _exit_at_once) if guard else None
    try:
        from fedpartial._src.cli.main import main as command
    finally:
        if guard:
            signal.signal(signal.SIGINT, previous)
    try:
        return command(argv)
    except KeyboardInterrupt:  # while the command line is parsed; a command's own Ctrl-C is answered inside it
        sys.stderr.write("fedpartial: interrupted; results written so far are kept.\n")
        return 130


def importable_working_directory(path: list[str], here: str) -> list[str]:
    """``path`` (``sys.path``) with the working directory ``here`` on it, as ``python -m fedpartial`` has it, so
    that ``--method my_module:factory`` finds ``my_module.py`` where the command is run.  It goes last: unlike
    ``python -m``, an installed package is never shadowed by a folder of the same name."""
    return path if here in path or "" in path else [*path, here]


def console() -> None:
    """The console script: exits with the command's status."""
    sys.path[:] = importable_working_directory(sys.path, os.getcwd())
    sys.exit(main())
