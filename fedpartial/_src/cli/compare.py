"""``fedpartial compare``: several methods on the same partitions and seeds, then a table and figures
(:mod:`fedpartial._src.analysis.compare`)."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console

from fedpartial._src.cli.display import duration, mb
from fedpartial._src.cli.flags import OPTIONS, Formatter, Parser, config_from_args, refuse_flag_clashes
from fedpartial._src.core.errors import UserError

#: ``run`` flags that ``compare`` does not take: it sets them per run, or they concern one run only
NOT_COMPARED = ("help", "method", "seed", "seeds", "lrs", "server_lrs", "out", "name", "resume",
                "checkpoint_every")


def add_parser(subparsers, run: Parser) -> Parser:
    """``compare`` takes every ``run`` flag common to all methods, declared again as ``run`` declared them and
    with the help ``run``'s ``--help`` gives them (so they stay in step with ``run``), except
    :data:`NOT_COMPARED` and the per-method option flags, which become ``--option METHOD:NAME=VALUE``."""
    compare = subparsers.add_parser(
        "compare", help="several methods on the same partitions and seeds: table and figures",
        # a usage of its own: argparse's generated one, over this many flags, fails an assertion of its own
        usage="fedpartial compare --methods A,B,... [--seeds S,S,...] [--option METHOD:NAME=VALUE] "
              "[FLAG VALUE ...]",
        formatter_class=Formatter)
    compare.add_argument("--methods", default=None,
                         help="methods, comma-separated, e.g. fedavg,fedldf,fedspu (required, here or in --config)")
    compare.add_argument("--seeds", default="0", help="seeds, comma-separated, e.g. 0,1,2")
    compare.add_argument("--option", action="append", default=[], metavar="METHOD:NAME=VALUE",
                         help="a method's option, e.g. fedldf:n=2 (repeat for more; others keep their defaults); "
                              "METHOD is everything before the last ':' ahead of the '=', so a method of your own "
                              "is addressed as it is named, e.g. my_package.module:factory:k=2")
    compare.add_argument("--out", default=None,
                         help="a new or empty directory for the runs, table and figures "
                              "(default: runs/compare-YYYYmmdd-HHMMSS)")
    compare.add_argument("--resume", default=None, metavar="DIR",
                         help="continue an interrupted comparison in DIR: finished runs are kept, interrupted ones "
                              "resumed, missing ones run; then the table and figures are written again")
    # Mutually exclusive flags stay so, in groups of compare itself (argparse shows their flags under options).
    exclusive = {}
    for group in run.exclusive:
        twin = compare.add_mutually_exclusive_group(required=group.required)
        exclusive.update({action: twin for action in group.actions})
    for group in run.groups:
        kept = [a for a in group.actions if a.dest not in NOT_COMPARED and not a.dest.startswith("option:")]
        target = compare if group.title == OPTIONS else (compare.add_argument_group(group.title, group.description)
                                                         if kept else None)
        for action in kept:
            args, kwargs = run.declared[action]
            exclusive.get(action, target).add_argument(*args, **{**kwargs, "help": action.help})
    return compare


def _compare_flags(argv: list[str] | None) -> tuple[Parser, list[str]]:
    """A fresh ``compare`` parser (as ``fedpartial``'s own) and the tokens given after ``compare``."""
    from fedpartial._src.cli import run as run_cli

    tokens = list(sys.argv[1:] if argv is None else argv)
    subparsers = Parser(prog="fedpartial").add_subparsers(parser_class=Parser)
    return add_parser(subparsers, run_cli.add_parser(subparsers)), tokens[tokens.index("compare") + 1:]


def handle(args, console: Console, argv: list[str] | None = None) -> int:
    """``fedpartial compare``; ``--config FILE.toml`` gives flags as ``run`` reads them (methods and seeds
    too), the command line winning."""
    from fedpartial._src.analysis import compare
    from fedpartial._src.experiment import summaries

    if args.resume is not None:
        return _resume(args, console, argv)
    if getattr(args, "config", None) is not None:  # the file's values where the command line gave none
        from fedpartial._src.cli import config_file

        config_file.merge(args, *_compare_flags(argv), args.config)
    if args.methods is None:
        raise UserError("--methods is required (e.g. --methods fedavg,fedldf), on the command line or as methods = "
                        "\"…\" in a --config file.")
    methods = compare.parse_methods(args.methods)
    refuse_flag_clashes(methods)
    seeds = compare.parse_seeds(args.seeds)
    options = compare.parse_options(args.option, methods)
    out_dir = compare.fresh_out_dir(args.out)
    args = argparse.Namespace(**{**vars(args), "method": methods[0], "seed": seeds[0], "out": out_dir,
                                 "name": None, "record_decisions": getattr(args, "record_decisions", False)})
    base = config_from_args(args)
    configs = compare.plan(base, methods, seeds, options, out_dir)  # every bad value before any run
    total = len(methods) * len(seeds)
    console.print(f"comparing {', '.join(methods)} on seeds {', '.join(map(str, seeds))}: {total} runs "
                  f"in {out_dir}")

    def on_run(i, config, result):
        console.print(f"  {i + 1}/{total} {config.method} seed {config.seed}: final accuracy "
                      f"{result['final_test_accuracy']:.4f}, upload {mb(result['total_upload_bytes'])}, "
                      f"simulated {duration(result['total_simulated_time_s'])}")

    done = compare.compare(base, methods, seeds, options, out_dir, on_run=on_run, configs=configs)
    print(summaries.table_markdown(done["rows"]), end="")
    console.print(f"table: {', '.join(done['table_files'])}; figures: {out_dir}")
    return 0


def _resume(args, console: Console, argv: list[str] | None) -> int:
    """``fedpartial compare --resume DIR``: every other flag is the job's own (its job.json), so refused."""
    import os

    from fedpartial._src.analysis import compare
    from fedpartial._src.cli import config_file
    from fedpartial._src.experiment import signals, summaries

    parser, tokens = _compare_flags(argv)
    given = config_file.given_on_command_line(parser, tokens) - {"resume", "quiet"}
    if given:
        flag = parser.flag(min(given)).option_strings[0]
        raise UserError(f"{flag} cannot be combined with compare --resume: a resumed comparison keeps the methods, "
                        f"seeds and settings it started with (its job.json).")

    def on_run(i, total, result):
        what = ("complete, kept" if not result["resumed"] else result["status"] if "error" not in result
                else f"{result['status']}: {result['error']}")
        console.print(f"  {i + 1}/{total} {os.path.basename(result['run_dir'])}: {what}", markup=False)

    with signals.StopFlag() as stop:
        done = compare.resume(args.resume, stop=stop, on_run=on_run)
    print(summaries.table_markdown(done["rows"]), end="")
    console.print(f"table: {', '.join(done['table_files'])}; figures: {args.resume}", markup=False)
    return 1 if any(r["status"] != "complete" for r in done["results"]) else 0
