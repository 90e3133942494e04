"""``fedpartial`` command line: ``fedpartial run [options]``, ``fedpartial compare``, ``fedpartial plot``,
``fedpartial list``, ``fedpartial capacity``.

Invalid input exits with status 2 and one sentence on stderr naming the flag as typed
("--lr nan is not allowed: it must be a finite number > 0."), before any data or model is
set up; nothing already written is touched (each run writes to a fresh directory).
A bare ``fedpartial`` prints the usage on stderr and exits 2 (no command is a usage error,
as for any missing argument); ``--version`` and ``--help`` exit 0.  Every flag's help shows
its default.  ``docs/validation.md`` lists every checked input and its message.

One module per subcommand (``run``, ``compare``, ``plot``, ``bench``, ``capacity``, ``listing`` for ``list``),
each with ``add_parser(subparsers)`` and ``handle(args, console, argv)``; the flags they share are in
:mod:`fedpartial._src.cli.flags`, ``--config FILE.toml`` in :mod:`fedpartial._src.cli.config_file`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings

from rich.console import Console

from fedpartial._src.cli import bench, capacity, compare, listing, plot, run
from fedpartial._src.cli.flags import Parser, config_from_args, method_specs, named_methods
from fedpartial._src.core.errors import NothingTrainedWarning, UserError
from fedpartial._src.experiment.run_files import is_diverged
from fedpartial._src.experiment.signals import RunInterrupted
from fedpartial._src.version import __version__

__all__ = ["build_parser", "config_from_args", "main"]

#: each command's handler, ``handler(args, console, argv) -> exit status``
_COMMANDS = {"run": run.handle, "compare": compare.handle, "plot": plot.handle, "capacity": capacity.handle,
             "list": listing.handle, "bench": bench.handle}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The whole command line; ``argv`` names the methods (``--method package.module:factory``) whose options
    need flags besides the built-in and installed methods' ones."""
    parser = Parser(prog="fedpartial", description="Federated learning with partial model training.")
    parser.add_argument("--version", action="version", version=f"fedpartial {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    argv = sys.argv[1:] if argv is None else argv
    named = named_methods(argv)
    asked_help = any(a in ("-h", "--help", "--help-all") for a in argv)  # the named methods' options only
    run_parser = run.add_parser(sub, method_specs(named), shown=named if asked_help else (),
                                brief="--help-all" not in argv)
    compare.add_parser(sub, run_parser)
    plot.add_parser(sub)
    capacity.add_parser(sub)
    bench.add_parser(sub)
    listing.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The ``fedpartial`` command; returns the exit status (argparse's exits included)."""
    parser = build_parser(argv)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version (0) and usage errors (2), returned so callers need no try
        return e.code if isinstance(e.code, int) else 0 if e.code is None else 2
    if args.command is None:
        parser.print_usage(sys.stderr)
        sys.stderr.write("fedpartial: error: a command is required: run, compare, plot, bench, list or capacity "
                         "(fedpartial --help says more).\n")
        return 2
    console = Console()
    warnings.simplefilter("ignore", NothingTrainedWarning)  # said under the closing table instead
    logging.getLogger("absl").setLevel(logging.ERROR)  # tfds warnings would bury our one sentence
    try:
        handler = _COMMANDS.get(args.command)
        if handler is not None:
            return handler(args, console, argv)
    except RunInterrupted as e:  # SIGINT/SIGTERM: the run stopped between rounds and says what it kept
        sys.stderr.write(f"fedpartial: {e.message}\n")
        return e.exit_code
    except UserError as e:  # the project's own input errors are meant for people; others keep a traceback
        if is_diverged(e):  # training diverged: not bad input, exit 1; the last good checkpoint is kept
            sys.stderr.write(f"fedpartial: diverged: {str(e).strip().splitlines()[0]}\n")
            return 1
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        sys.stderr.write(f"fedpartial: error: {message}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("fedpartial: interrupted; results written so far are kept.\n")
        return 130
    except BrokenPipeError:  # e.g. `fedpartial list | head`: the reader left; nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
