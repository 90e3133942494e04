"""``fedpartial bench``: throughput, rounds/s of every method and strategy next to a plain per-client loop;
the flags and the work are :mod:`fedpartial._src.bench.suite`'s."""

from __future__ import annotations

import argparse

from rich.console import Console

from fedpartial._src.bench import suite
from fedpartial._src.cli.flags import Formatter


def add_parser(subparsers) -> argparse.ArgumentParser:
    bench = subparsers.add_parser(
        "bench", help="throughput: rounds/s of every method and strategy next to a plain per-client loop",
        formatter_class=Formatter)
    suite.add_arguments(bench)
    return bench


def handle(args, console: Console, argv: list[str] | None = None) -> int:
    """``fedpartial bench``."""
    return suite.main(args)
