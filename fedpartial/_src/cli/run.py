"""``fedpartial run``: one federated simulation, or replicas of it (``--seeds``, ``--lrs``, ``--server-lrs``)
run as one; ``--config FILE.toml`` reads the flags from a file (:mod:`fedpartial._src.cli.config_file`)."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table

from fedpartial._src.cli import progress as progress_lib
from fedpartial._src.cli.flags import Formatter, Parser, add_run_flags, config_from_args
from fedpartial._src.core.errors import UserError
from fedpartial._src.experiment.config import REPLICA_FLAGS


def add_parser(subparsers, specs=None, shown=(), brief=False) -> Parser:
    """The ``run`` subcommand and its flags; returns its parser (``compare`` takes most of its flags).
    ``specs``: the methods whose options become flags (default: the built-in and installed ones); ``shown``:
    the methods whose options ``--help`` shows; ``brief``: the rarer groups list their flags only."""
    run = subparsers.add_parser("run", help="run a federated simulation", formatter_class=Formatter,
                                add_help=False,  # add_run_flags adds --help, after the options asked about
                                usage="fedpartial run [--method NAME] [--dataset NAME] [FLAG VALUE ...] "
                                      "(fedpartial run --method NAME --help: that method's options too)",
                         epilog="A --config file holds run flags as TOML keys without the leading -- (- or _ "
                                "alike), method options included, e.g. method = \"fedldf\", rounds = 20, lr = 0.05, "
                                "n = 4, es = true; flags given on the command line win.  A run directory holds "
                                "config.toml to repeat the run: fedpartial run --config RUN_DIR/config.toml")
    add_run_flags(run, specs, shown, brief)
    return run


def _run_flags(argv: list[str] | None) -> tuple[Parser, list[str]]:
    """A fresh ``run`` parser (as ``fedpartial``'s own) and the tokens given after ``run`` on the command line."""
    tokens = list(sys.argv[1:] if argv is None else argv)
    subparsers = Parser(prog="fedpartial").add_subparsers(parser_class=Parser)
    return add_parser(subparsers), tokens[tokens.index("run") + 1:]


def handle(args, console: Console, argv: list[str] | None = None) -> int:
    """``fedpartial run``: ``argv`` is the command line as given (None: ``sys.argv[1:]``), for ``--config``."""
    from fedpartial._src.cli import config_file  # tomllib only when a run starts
    from fedpartial._src.experiment import run_files

    args.argv = list(sys.argv[1:] if argv is None else argv)  # as given: what a restart runs again
    args.from_file = {}  # flag -> key of the values the --config file gave, so messages name the file's key
    if args.config is not None:
        if args.resume is not None:
            raise UserError("--config cannot be combined with --resume: a resumed run keeps its own config.json.")
        args.from_file = config_file.merge(args, *_run_flags(argv), args.config)
    if _replicas_asked(args):  # --seed / --lr / --server-lr on the command line conflict
        given = config_file.given_on_command_line(*_run_flags(argv))  # (a config file's values are replaced)
        args.seed_given, args.lr_given, args.server_lr_given = ("seed" in given, "lr" in given,
                                                                "server_lr" in given)
    try:
        if args.resume is not None:
            _check_resume(args, *_run_flags(argv))
        return _run_checked(args, console)
    except RunComplete as done:
        print(str(done), flush=True)  # plain: a path is neither wrapped nor read as markup
        return 0
    except UserError as e:
        if not args.from_file or run_files.is_diverged(e):
            raise
        raise UserError(config_file.attribute(str(e).strip(), args.from_file, args.config)) from None


def _run_checked(args, console: Console) -> int:
    from fedpartial._src.experiment import driver, signals

    driver.check_checkpoint_every(args.checkpoint_every)
    # Signals from here on only set a flag: the run stops between rounds, never inside JAX.
    with signals.StopFlag() as stop:
        return _run_stoppable(args, console, stop)


def _join_processes(args) -> None:
    """``jax.distributed.initialize`` when --coordinator, --num-processes and --process-id are given (all or none)."""
    given = {"--coordinator": args.coordinator, "--num-processes": args.num_processes,
             "--process-id": args.process_id}
    if all(v is None for v in given.values()):
        return
    missing = [flag for flag, v in given.items() if v is None]
    if missing:
        raise UserError(f"a run over several processes needs --coordinator, --num-processes and --process-id; "
                        f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing.")
    if args.num_processes < 1:
        raise UserError(f"--num-processes {args.num_processes} is not allowed: it must be a whole number ≥ 1.")
    if not args.process_id < args.num_processes:
        raise UserError(f"--process-id {args.process_id} is not allowed: it must be between 0 and "
                        f"{args.num_processes - 1} (--num-processes {args.num_processes}).")
    import jax

    jax.distributed.initialize(args.coordinator, num_processes=args.num_processes, process_id=args.process_id)


#: what may be given with --resume: how this session runs, not what the run is (that is its config.json)
RESUME_FLAGS = ("resume", "checkpoint_every", "quiet", "coordinator", "num_processes", "process_id", "rounds")


def _check_resume(args, parser: Parser, tokens: list[str]) -> None:
    """A run flag given with --resume would be dropped without a word: refused, naming it.  A completed run
    is left as it is (:class:`RunComplete`)."""
    from fedpartial._src.cli import config_file
    from fedpartial._src.experiment import run_files

    given = config_file.given_on_command_line(parser, tokens)
    if given & set(REPLICA_FLAGS):
        return  # replicas cannot be resumed at all: their own sentence, below
    extra = sorted((a for a in parser.flags if a.dest in given and a.dest not in RESUME_FLAGS),
                   key=lambda a: a.dest == "out")  # a flag that changes the run is named before --out
    if extra:
        raise UserError(f"{extra[0].option_strings[0]} cannot be combined with --resume: a resumed run keeps its own "
                        f"config.json (only --checkpoint-every, --quiet and --rounds, to extend it, may be given).")
    args.extend_to = args.rounds if "rounds" in given else None
    status = run_files.read_status(args.resume) if os.path.isdir(args.resume) else None
    planned = None
    if args.extend_to is not None and status is not None:
        from fedpartial._src.experiment.run_directory import load_config, refuse_shortening

        planned = load_config(args.resume).rounds
        refuse_shortening(args.resume, args.extend_to, planned)  # before anything is built (RunWriter: Python's)
    if status is not None and status.get("status") == "complete" and args.extend_to in (None, planned):
        raise RunComplete(f"{args.resume} is complete ({status.get('round')} rounds): nothing to resume, its "
                          f"results are left as they are.")


def _restart_split_over_cores(args, config, console: Console):
    """``--strategy auto`` on a CPU of several cores: unless one device measures faster than the cohort split
    over them (:mod:`fedpartial._src.experiment.core_split`), this command runs again on them in place of this process,
    before anything is written.  Returns the dataset loaded to decide (None: the split was not considered)."""
    from fedpartial._src.experiment import core_split, parts, population
    from fedpartial._src.experiment.plan import build_method

    if core_split.skip_reason(config) is not None:
        return None
    second_order = build_method(config).capabilities.second_order
    with_population, dataset = population.run_dataset(config)
    split = parts.choose_core_split(with_population, dataset, second_order)
    if split is None:
        return dataset
    if not args.quiet:
        console.print(f"note: --strategy auto runs {split.describe()}; starting again on them.")
    core_split.restart(split, args.argv)


class RunComplete(Exception):
    """``--resume`` of a completed run: said in one sentence, exit 0, nothing written."""


def _run_stoppable(args, console: Console, stop) -> int:
    from fedpartial._src.experiment import jobs, run_directory, simulation
    from fedpartial._src.experiment.preflight import preflight
    from fedpartial._src.experiment.runs import simulation_for

    _join_processes(args)  # before anything touches a JAX backend
    if args.resume is not None and jobs.is_job_folder(args.resume):
        return _resume_replicas(args, console, stop)
    if _replicas_asked(args):
        if getattr(args, "mode", "sync") == "async":
            raise UserError("--mode async runs one replica at a time; give one --seed, --lr and --server-lr.")
        return _run_seeds(args, console, stop)
    if args.resume is not None:
        config = run_directory.load_config(args.resume)
        if getattr(args, "extend_to", None) is not None:  # more rounds than planned: the run is extended
            config = dataclasses.replace(config, rounds=args.extend_to)
    else:
        config = config_from_args(args)
    config.validate(check_model=True)  # every bad value, path and combination before any set-up
    preflight(config)  # then whether this machine holds it: memory, devices, --out
    t0 = time.perf_counter()
    dataset = _restart_split_over_cores(args, config, console)
    sim = simulation_for(config, dataset)  # data and model errors surface before the progress bar
    config = sim.config  # with what the data decided (leaf, hf: --clients from the files)
    if sim.holdout_note and not args.quiet:  # a default that changes what is trained on is said, not silent
        console.print(f"note: {sim.holdout_note}.")
    # Progress: a live rich line on a terminal; otherwise plain lines (one per round, at most ~50 in all,
    # and always the last round) so logs stay readable; --quiet: nothing but the run directory at the end.
    live = not args.quiet and console.is_terminal
    progress = Progress(
        TextColumn("[bold]round"), MofNCompleteColumn(), BarColumn(),
        TextColumn("acc {task.fields[acc]}"), TextColumn("train loss {task.fields[loss]}"),
        TextColumn("traffic {task.fields[traffic]}"), TextColumn("{task.fields[rate]} rounds/s"),
        TextColumn("ETA {task.fields[eta]}"),
        console=console, transient=False,
    ) if live else None
    every = max(1, math.ceil(config.rounds / 50))
    shown = {"acc": "–"}
    clock = progress_lib.RoundClock(config.rounds)
    if not live and not args.quiet:
        print("compiling the round… (the first round includes it; the ETA counts the rounds after it)", flush=True)

    def on_round(r):
        if "test_accuracy" in r:
            shown["acc"] = f"{r['test_accuracy']:.4f}"
        fields = progress_lib.round_fields(r, shown["acc"], clock)
        if progress is not None:
            progress.update(task, completed=r["round"], **{k: v for k, v in fields.items() if k != "compile"})
        elif not args.quiet and (r["round"] % every == 0 or r["round"] == config.rounds):
            print(progress_lib.round_line(r, config.rounds, fields), flush=True)

    with progress if progress is not None else contextlib.nullcontext():
        if progress is not None:
            task = progress.add_task("run", total=config.rounds, acc="–", loss="–", traffic="0 MB", rate="–",
                                     eta=progress_lib.COMPILING)
        summary = simulation.run(config, on_round=on_round, sim=sim, checkpoint_every=args.checkpoint_every,
                                 resume=args.resume, stop=stop)
    summary["wall_time_s"] = time.perf_counter() - t0
    if args.quiet:
        print(summary["run_dir"], flush=True)
        return 0
    table = Table(title=f"fedpartial {config.method} on {summary['dataset']}", show_header=False)
    capabilities = sim.method.capabilities
    personal = bool(capabilities.personalised or capabilities.finetune_epochs)
    for k, v in progress_lib.closing_rows(config, summary, personal):
        table.add_row(k, v)
    console.print(table)
    for warning in progress_lib.closing_warnings(summary, getattr(sim.model, "num_classes", None)):
        console.print(f"warning: {warning}", markup=False)
    return 0


def _resume_replicas(args, console: Console, stop) -> int:
    """``fedpartial run --resume PARENT`` of ``--seeds``/``--lrs`` replicas: each replica folder that did not
    complete is resumed on its own, then ``seeds_summary`` is written again from all of them."""
    from fedpartial._src.experiment import jobs

    if getattr(args, "extend_to", None) is not None:
        raise UserError(f"--rounds cannot extend the replicas in {args.resume}; extend each replica's run folder "
                        f"on its own (fedpartial run --resume RUN_DIR --rounds N).")

    def on_run(i, total, result):
        if not args.quiet:
            what = ("complete, kept" if not result["resumed"] else result["status"] if "error" not in result
                    else f"{result['status']}: {result['error']}")
            console.print(f"  {i + 1}/{total} {os.path.basename(result['run_dir'])}: {what}", markup=False)

    done = jobs.resume_replicas(args.resume, stop=stop, on_run=on_run)
    failed = [r for r in done["results"] if r["status"] != "complete"]
    if args.quiet:
        print(done["out_dir"], flush=True)
    else:
        with open(os.path.join(done["out_dir"], "seeds_summary.md")) as f:
            print(f.read(), end="")
        console.print(f"results: {done['out_dir']}", markup=False)
    return 1 if failed else 0


def _one_sentence(error) -> str:
    """A replica's error as one line: a :class:`UserError`'s sentence, else the exception's type and first line."""
    if error is None:
        return "stopped before its last round"
    if isinstance(error, UserError):
        return str(error).strip()
    first = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def _replicas_asked(args) -> bool:
    return any(getattr(args, name, None) is not None for name in ("seeds", "lrs", "server_lrs"))


def _run_seeds(args, console: Console, stop) -> int:
    """``fedpartial run --seeds`` / ``--lrs`` / ``--server-lrs``: the replicas as one simulation
    (:mod:`fedpartial._src.experiment.replicas`)."""
    from fedpartial._src.analysis import compare
    from fedpartial._src.experiment import replica_axis, replicas
    from fedpartial._src.experiment.preflight import preflight

    flag = "--seeds" if args.seeds is not None else "--lrs" if args.lrs is not None else "--server-lrs"
    seeds = compare.parse_seeds(args.seeds) if args.seeds is not None else [args.seed]
    lrs = replicas.parse_lrs(args.lrs) if args.lrs is not None else None
    server_lrs = replicas.parse_lrs(args.server_lrs, "--server-lrs") if args.server_lrs is not None else None
    if args.resume is not None:
        raise UserError(f"{flag} cannot be combined with --resume; resume the replicas' folder as it is "
                        "(fedpartial run --resume PARENT) or one replica's run folder (--resume RUN_DIR).")
    if args.seeds is not None and getattr(args, "seed_given", False):
        raise UserError("--seeds cannot be combined with --seed; give every seed in --seeds.")
    if lrs is not None and getattr(args, "lr_given", False):
        raise UserError("--lrs cannot be combined with --lr; give every learning rate in --lrs.")
    if server_lrs is not None and getattr(args, "server_lr_given", False):
        raise UserError("--server-lrs cannot be combined with --server-lr; give every server learning rate in "
                        "--server-lrs.")
    config = config_from_args(args)
    config.validate(check_model=True)
    preflight(config)
    replica_axis.replica_strategy(config.strategy)
    every = max(1, math.ceil(config.rounds / 50))

    labels = progress_lib.replica_labels(replicas.replica_settings(seeds, lrs, server_lrs), args.seeds is not None)
    if not args.quiet:
        print(f"compiling one round for the {len(labels)} replicas…", flush=True)

    def on_round(t, records):
        due = (t + 1) % every == 0 or t + 1 == config.rounds
        if args.quiet or not due or all(r is None for r in records):
            return
        print(progress_lib.replica_line(t, config.rounds, labels, records), flush=True)

    done = replicas.run_seeds(config, seeds, on_round=on_round, stop=stop, checkpoint_every=args.checkpoint_every,
                              lrs=lrs, server_lrs=server_lrs)
    failed = [(os.path.basename(r["run_dir"] or "?"), r) for r in done["results"] if r["status"] != "complete"]
    for name, r in failed:  # whatever the verbosity: a failed run says why, in its one sentence
        print(f"{name}: {r['status']}: {_one_sentence(r.get('error'))}", file=sys.stderr, flush=True)
    if args.quiet:
        print(done["out_dir"], flush=True)
    else:
        if done["out_dir"]:
            with open(os.path.join(done["out_dir"], "seeds_summary.md")) as f:
                print(f.read(), end="")
        how = ("one after another, each in the same compiled round" if done["replica_axis"] == "loop" else
               "in one jitted round")
        console.print(f"{len(labels)} replicas {how} (replica axis: {done['replica_axis']}), "
                      f"data on the {done['data_placement']}"
                      + (f" ({done['note']})" if done["note"] else ""), markup=False)
        for name, r in failed:
            console.print(f"{name}: {r['status']} ({r['run_dir']})")
        console.print(f"results: {done['out_dir']}")
    return 1 if failed else 0
