"""Throughput suite: ``python -m benchmarks.throughput [flags]`` is ``fedpartial bench [flags]``.

The suite lives in :mod:`fedpartial._src.bench.suite` (``benchmarks/`` is not installed); see its
docstring for what is measured, and ``fedpartial bench --help`` for the flags.
"""

from __future__ import annotations

import sys

from fedpartial._src.cli import main as cli

if __name__ == "__main__":
    sys.exit(cli.main(["bench", *sys.argv[1:]]))
