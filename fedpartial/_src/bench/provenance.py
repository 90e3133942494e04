"""When and how a result file was made, recorded in the file itself (no JAX: a benchmark's parent process may
import this before it sets the environment its workers' JAX reads)."""

from __future__ import annotations

import datetime
import pathlib
import shlex
import sys


def command_line(argv: list[str] | None = None) -> str:
    """The command that is running, as a person would type it: ``python -m benchmarks.NAME ARGS`` for a
    benchmark script, ``fedpartial ARGS`` for the console script.  ``argv``: the arguments (default
    ``sys.argv[1:]``)."""
    program = pathlib.Path(sys.argv[0])
    args = sys.argv[1:] if argv is None else list(argv)
    if program.parent.name == "benchmarks" and program.suffix == ".py":
        head = f"python -m benchmarks.{program.stem}"
    elif program.name == "fedpartial":
        head = "fedpartial"
    else:
        head = f"python {program.name}"
    return " ".join([head, *map(shlex.quote, args)])


def stamp(report: dict, argv: list[str] | None = None) -> dict:
    """``report`` with when and how it was made, unless it says so already: ``time`` (UTC, ISO 8601) and
    ``command`` (:func:`command_line`), which ``benchmarks/render_docs.py`` shows beside every table."""
    out = dict(report)
    out.setdefault("time", datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    out.setdefault("command", command_line(argv))
    return out
