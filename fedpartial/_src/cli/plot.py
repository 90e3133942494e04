"""``fedpartial plot``: accuracy against round, upload bytes and simulated time of run directories."""

from __future__ import annotations

import argparse

from rich.console import Console

from fedpartial._src.cli.flags import Formatter


def add_parser(subparsers) -> argparse.ArgumentParser:
    plot = subparsers.add_parser(
        "plot", help="accuracy against round, upload bytes and simulated time of run directories",
        formatter_class=Formatter)
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories written by fedpartial run")
    plot.add_argument("--out", default=None, help="directory for the figures (default: runs/plot-YYYYmmdd-HHMMSS)")
    return plot


def handle(args, console: Console, argv: list[str] | None = None) -> int:
    """``fedpartial plot``."""
    from fedpartial._src.analysis import compare
    from fedpartial._src.analysis import plots as plotting
    from fedpartial._src.experiment import summaries

    for run_dir in args.run_dirs:
        summaries.load_run(run_dir)  # a path that is not a run directory: one sentence before anything is drawn
    out_dir = args.out or compare.default_out_dir().replace("compare-", "plot-", 1)
    plotting.check_out_dir(out_dir)  # a file, an unwritable place or earlier figures: one sentence, nothing drawn
    paths = plotting.plot_runs(args.run_dirs, out_dir)
    console.print(f"{len(paths)} figures in {out_dir}")
    return 0
