"""``fedpartial`` command line: ``fedpartial run [options]``, ``fedpartial compare``, ``fedpartial plot``,
``fedpartial list``, ``fedpartial capacity``.

Invalid input exits with status 2 and one sentence on stderr naming the flag as typed
("--lr nan is not allowed: it must be a finite number > 0."), before any data or model is
set up; nothing already written is touched (each run writes to a fresh directory).
A bare ``fedpartial`` prints the usage on stderr and exits 2 (no command is a usage error,
as for any missing argument); ``--version`` and ``--help`` exit 0.  Every flag's help shows
its default.  ``docs/validation.md`` lists every checked input and its message.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import re
import sys
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table

from fedpartial._src.version import __version__
from fedpartial._src.bench import suite as bench
from fedpartial._src.experiment.checkpoint import RunInterrupted, is_diverged
from fedpartial._src.data.sources import DATASETS
from fedpartial._src.core.errors import UserError
from fedpartial._src.methods.catalog import METHODS
from fedpartial._src.methods.registry import boolean
from fedpartial._src.models.registry import MODELS
from fedpartial._src.experiment.config import DATASET_SHAPES, DEFAULT_LOCAL_EPOCHS, DEFAULT_MODELS, RunConfig

#: one line per dataset for ``fedpartial list datasets`` (the shape and default model are added)
DATASET_SUMMARIES = {
    "digits": "scikit-learn's handwritten digits, 10 classes, offline",
    "mnist5k": "5,000 MNIST digits bundled with the package, 10 classes, offline",
    "synthetic": "Synthetic(α, β) of the FedProx paper: 60 features, 10 classes, naturally partitioned (offline)",
    "mnist": "MNIST handwritten digits, 10 classes (tensorflow-datasets)",
    "fashion_mnist": "Fashion-MNIST clothing images, 10 classes (tensorflow-datasets)",
    "emnist": "EMNIST byclass letters and digits, 62 classes (tensorflow-datasets)",
    "cifar10": "CIFAR-10 colour images, 10 classes (tensorflow-datasets)",
    "cifar100": "CIFAR-100 colour images, 100 classes (tensorflow-datasets)",
    "svhn_cropped": "SVHN house-number digits, 10 classes (tensorflow-datasets)",
    "synthetic_text": "generated token sequences, 2 classes, offline",
    "imdb_reviews": "IMDB movie reviews as token ids, 2 classes (tensorflow-datasets)",
}


def _whole_number(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed: it must be a whole number") from None


_whole_number.toml_kind = "integer"  # what the flag takes in a --config file (fedpartial._src.experiment.records)
_positive_int = _whole_number  # the old name; ranges are checked by RunConfig.validate, naming the flag


def _float(text: str) -> float:
    try:
        return float(text)  # NaN and ±inf parse; RunConfig.validate refuses them naming the flag
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed: it must be a number") from None


_float.toml_kind = "number"


class _Formatter(argparse.HelpFormatter):
    """Shows ``(default: X)`` after every flag's help (``none`` for None), unless the help already says."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS or not action.option_strings \
                or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            return text
        shown = "none" if action.default is None else action.default
        return f"{text} (default: {shown})".strip()


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one sentence, exit status 2, no usage dump
        # argparse says "argument --lr: 'x' is not ..."; people typed "--lr x"
        match = re.fullmatch(r"argument (\S+?)(?:/\S+)?: (.*)", message, re.S)
        if match:
            flag, rest = match.groups()
            message = f"{flag} {rest}" if rest.startswith("'") else f"{flag}: {rest}"
        sys.stderr.write(f"fedpartial: error: {message.rstrip('.')}.\n")
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    d = RunConfig()
    parser = _Parser(prog="fedpartial", description="Federated learning with partial model training.")
    parser.add_argument("--version", action="version", version=f"fedpartial {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    run = sub.add_parser("run", help="run a federated simulation", formatter_class=_Formatter,
                         epilog="A --config file holds run flags as TOML keys without the leading -- (- or _ "
                                "alike), method options included, e.g. method = \"fedldf\", rounds = 20, lr = 0.05, "
                                "n = 4, es = true; flags given on the command line win.  A run directory holds "
                                "config.toml to repeat the run: fedpartial run --config RUN_DIR/config.toml")
    run.add_argument("--config", default=None, metavar="TOML",
                     help="read run flags from a TOML file (keys are these flags without --; the command line "
                          "overrides them)")
    run.add_argument("--quiet", action="store_true",
                     help="no progress and no summary table: print only the run directory")
    run.add_argument("--method", default=d.method, help=", ".join(METHODS))
    run.add_argument("--dataset", default=d.dataset, help="digits (offline), synthetic, mnist, cifar10, ...")
    run.add_argument("--data-dir", default=d.data_dir,
                     help="tensorflow-datasets data directory (default: tensorflow-datasets' own)")
    run.add_argument("--model", default=d.model, help="'auto' or a zoo model name")
    run.add_argument("--partition", default=d.partition, help="iid, dirichlet, shards or natural")
    run.add_argument("--alpha", type=_float, default=d.alpha, help="Dirichlet α (also Synthetic α and β)")
    run.add_argument("--max-samples", type=_whole_number, default=None, metavar="N",
                     help="synthetic: cap each client's examples at N (fewer per client, e.g. for 1,000,000 clients)")
    run.add_argument("--classes-per-client", type=_whole_number, default=d.classes_per_client,
                     help="classes per client of the shards partition")
    run.add_argument("--clients", type=_whole_number, default=d.num_clients, help="population size N")
    run.add_argument("--cohort", type=_whole_number, default=d.cohort_size, help="clients per round K")
    run.add_argument("--rounds", type=_whole_number, default=d.rounds, help="communication rounds")
    local = run.add_mutually_exclusive_group()
    local.add_argument("--local-steps", type=_whole_number, default=None,
                       help="local steps per round (default: none, --local-epochs sets the local work)")
    local.add_argument("--local-epochs", type=_float, default=None,
                       help=f"local epochs per round (default: {DEFAULT_LOCAL_EPOCHS:g} when --local-steps "
                            "is not given)")
    run.add_argument("--batch-size", type=_whole_number, default=d.batch_size, help="client batch size")
    run.add_argument("--lr", type=_float, default=d.client_lr, help="client learning rate")
    run.add_argument("--momentum", type=_float, default=d.momentum, help="client SGD momentum, in [0, 1)")
    run.add_argument("--weight-decay", type=_float, default=d.weight_decay, help="client L2 weight decay")
    run.add_argument("--server-opt", default=d.server_optimizer, help="sgd, adam, yogi, adagrad")
    run.add_argument("--server-lr", type=_float, default=d.server_lr, help="server learning rate")
    _add_method_options(run)
    run.add_argument("--es", action="store_true",
                     help="early stopping: a client stops for good when its λ-mixed train/val loss rises")
    run.add_argument("--train-fraction", type=_float, default=None,
                     help="λ: each client's training share, the rest held out "
                          "(default: 0.7 for personalised methods and --es, else 1)")
    run.add_argument("--bn-policy", default=d.bn_policy, help="global or static")
    run.add_argument("--strategy", default=d.strategy, help="auto, fused[:chunk], stepwise[:chunk], stream:chunk, "
                     "stream-stepwise:chunk, debug")
    run.add_argument("--data-placement", default=d.data_placement,
                     help="where the training data lives: device (placed once, batches gathered on the device), "
                          "host (packed every round) or auto (device on a GPU/TPU when it takes at most a quarter "
                          "of its free memory, else host)")
    run.add_argument("--client-state", default=d.client_state,
                     help="where the method's per-client state (e.g. FedSPU's N personal models) lives: device, "
                          "host (RAM; only the cohort's rows travel each round), disk (memory-mapped files in the "
                          "temporary folder, $TMPDIR) or auto (device while it takes at most half the device's free "
                          "memory, then host, then disk)")
    run.add_argument("--devices", type=_whole_number, default=d.devices, metavar="N",
                     help="split each round's cohort over N local devices (fused strategy; the cohort is padded "
                          "to a multiple of N with clients that weigh nothing); default: all local devices for "
                          "the fused strategy on a GPU/TPU, else 1")
    hosts = run.add_argument_group(
        "several processes (multi-host: every process runs the same command with its own --process-id; "
        "the cohort is split over every process's devices; see docs/multihost.md)")
    hosts.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                       help="address of process 0, for jax.distributed.initialize")
    hosts.add_argument("--num-processes", type=_whole_number, default=None, metavar="P", help="processes in all")
    hosts.add_argument("--process-id", type=_whole_number, default=None, metavar="I", help="this process, 0 to P-1")
    run.add_argument("--seed", type=_whole_number, default=d.seed, help="seed of every random choice")
    run.add_argument("--seeds", default=None, metavar="S,S,...",
                     help="one replica per seed, e.g. 0,1,2,3, run as one simulation (the fused round, jitted once): "
                          "a run folder per seed and a mean ± std summary (instead of --seed)")
    run.add_argument("--lrs", default=None, metavar="LR,LR,...",
                     help="one replica per client learning rate (with every seed of --seeds), e.g. 0.01,0.05,0.1, "
                          "run as one simulation like --seeds: a run folder each and a mean ± std row per rate "
                          "(instead of --lr)")
    run.add_argument("--server-lrs", default=None, metavar="LR,LR,...",
                     help="one replica per server learning rate (with every client rate of --lrs and every seed of "
                          "--seeds), e.g. 0.3,1.0, run as one simulation like --seeds: a run folder each and a "
                          "mean ± std row per rate (instead of --server-lr)")
    run.add_argument("--eval-every", type=_whole_number, default=d.eval_every, help="test every this many rounds")
    run.add_argument("--out", default=d.out_dir, help="directory for run folders")
    run.add_argument("--name", default=None,
                     help="run folder name, made unique (default: METHOD-DATASET-seedSEED)")
    run.add_argument("--record-decisions", action="store_true",
                     help="save every round's plan and selection masks to RUN_DIR/decisions/round-NNNNN.npz")
    run.add_argument("--checkpoint-every", type=_positive_int, default=None, metavar="N",
                     help="save the whole simulation state to RUN_DIR/checkpoints every N rounds "
                          "(the final state is always saved)")
    run.add_argument("--resume", default=None, metavar="RUN_DIR",
                     help="continue a stopped run from its newest checkpoint, with the configuration in "
                          "RUN_DIR/config.json (other run options are ignored, except --checkpoint-every)")
    devices = run.add_argument_group(
        "device model (simulated time: a client takes FLOPs/speed + bytes down/bandwidth + bytes up/bandwidth, "
        "a round its slowest client; DIST is a number, lognormal:MEDIAN:SIGMA or uniform:LOW:HIGH)")
    devices.add_argument("--device-profiles", default=None, metavar="CSV",
                         help="device profiles with columns compute_flops_per_s, download_bytes_per_s, "
                              "upload_bytes_per_s; client i gets row i mod rows (replaces the distributions)")
    devices.add_argument("--compute-speed", default=d.compute_speed, metavar="DIST", help="FLOP/s per client")
    devices.add_argument("--download-bandwidth", default=d.download_bandwidth, metavar="DIST",
                         help="bytes/s per client")
    devices.add_argument("--upload-bandwidth", default=d.upload_bandwidth, metavar="DIST", help="bytes/s per client")
    devices.add_argument("--target-accuracy", type=_float, default=None,
                         help="report the simulated time (and round) at which test accuracy first reaches this")
    _add_compare_and_plot(sub, run)
    cap = sub.add_parser("capacity", help="parameters, activations and capacity of each client tier of a model",
                         formatter_class=_Formatter)
    cap.add_argument("--model", default="resnet20", help="a staged zoo model, e.g. resnet20, femnist_cnn, bilstm")
    cap.add_argument("--input-shape", default=None,
                     help="one example's shape, e.g. 32,32,3 (default: the model's dataset in the paper)")
    cap.add_argument("--classes", type=_whole_number, default=None, help="number of classes (default: as above)")
    cap.add_argument("--batch-size", type=_whole_number, default=32, help="activations are counted per batch")
    cap.add_argument("--cut", default=None, help="first trained stage of moderate and weak clients, e.g. 4,7 "
                                                  "(default: the paper's)")
    bench.add_arguments(sub.add_parser(
        "bench", help="throughput: rounds/s of every method and strategy next to a plain per-client loop",
        formatter_class=_Formatter))
    lister = sub.add_parser("list", help="the methods, models or datasets, one line each", formatter_class=_Formatter)
    lister.add_argument("what", nargs="?", choices=("methods", "models", "datasets"), default=None,
                        help="what to list (default: all three)")
    return parser


#: ``run`` flags that ``compare`` does not take: it sets them per run, or they concern one run only
_NOT_COMPARED = ("help", "method", "seed", "seeds", "lrs", "server_lrs", "out", "name", "resume",
                 "checkpoint_every")


def _add_compare_and_plot(sub, run: argparse.ArgumentParser) -> None:
    """``compare`` takes every ``run`` flag common to all methods (the same argparse actions, so they stay in
    step with ``run``) except :data:`_NOT_COMPARED` and the per-method option flags, which become
    ``--option METHOD:NAME=VALUE``; ``plot`` reads run directories."""
    compare = sub.add_parser("compare", help="several methods on the same partitions and seeds: table and figures",
                             formatter_class=_Formatter)
    compare.add_argument("--methods", required=True,
                         help="methods, comma-separated, e.g. fedavg,fedldf,fedspu (required, no default)")
    compare.add_argument("--seeds", default="0", help="seeds, comma-separated, e.g. 0,1,2")
    compare.add_argument("--option", action="append", default=[], metavar="METHOD:NAME=VALUE",
                         help="a method's option, e.g. fedldf:n=2 (repeat for more; others keep their defaults)")
    compare.add_argument("--out", default=None,
                         help="a new or empty directory for the runs, table and figures "
                              "(default: runs/compare-YYYYmmdd-HHMMSS)")
    # The same action objects in matching groups, as argparse's ``parents`` does (which cannot leave some out).
    exclusive = {}
    for group in run._mutually_exclusive_groups:
        twin = compare.add_mutually_exclusive_group(required=group.required)
        exclusive.update({id(action): twin for action in group._group_actions})
    groups = {id(run._positionals): compare._positionals, id(run._optionals): compare._optionals}
    for group in run._action_groups:
        kept = [a for a in group._group_actions if a.dest not in _NOT_COMPARED and not a.dest.startswith("option:")]
        target = groups.get(id(group)) or (compare.add_argument_group(group.title, group.description) if kept
                                           else None)
        for action in kept:
            exclusive.get(id(action), target)._add_action(action)
    plot = sub.add_parser("plot", help="accuracy against round, upload bytes and simulated time of run directories",
                          formatter_class=_Formatter)
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories written by fedpartial run")
    plot.add_argument("--out", default=None, help="directory for the figures (default: runs/plot-YYYYmmdd-HHMMSS)")


def _compare(args, console: Console) -> int:
    from fedpartial._src.analysis import compare
    from fedpartial._src.experiment import summaries

    methods = compare.parse_methods(args.methods)
    seeds = compare.parse_seeds(args.seeds)
    options = compare.parse_options(args.option, methods)
    out_dir = compare.fresh_out_dir(args.out)
    args = argparse.Namespace(**{**vars(args), "method": methods[0], "seed": seeds[0], "out": out_dir,
                                 "name": None, "record_decisions": getattr(args, "record_decisions", False)})
    base = config_from_args(args)
    compare.plan(base, methods, seeds, options, out_dir)  # every bad value before any run
    total = len(methods) * len(seeds)
    console.print(f"comparing {', '.join(methods)} on seeds {', '.join(map(str, seeds))}: {total} runs "
                  f"in {out_dir}")

    def on_run(i, config, result):
        console.print(f"  {i + 1}/{total} {config.method} seed {config.seed}: final accuracy "
                      f"{result['final_test_accuracy']:.4f}, upload {_mb(result['total_upload_bytes'])}, "
                      f"simulated {_duration(result['total_simulated_time_s'])}")

    done = compare.compare(base, methods, seeds, options, out_dir, on_run=on_run)
    print(summaries.table_markdown(done["rows"]), end="")
    console.print(f"table: {', '.join(done['table_files'])}; figures: {out_dir}")
    return 0


def _plot(args, console: Console) -> int:
    from fedpartial._src.analysis import compare
    from fedpartial._src.analysis import plots as plotting
    from fedpartial._src.experiment import summaries

    for run_dir in args.run_dirs:
        summaries.load_run(run_dir)  # a path that is not a run directory: one sentence before anything is drawn
    out_dir = args.out or compare.default_out_dir().replace("compare-", "plot-", 1)
    paths = plotting.plot_runs(args.run_dirs, out_dir)
    console.print(f"{len(paths)} figures in {out_dir}")
    return 0


def _method_flags() -> dict[str, list]:
    """Every method option's flag -> [(method name, Option), ...] (methods may share a flag)."""
    flags: dict[str, list] = {}
    for spec in METHODS.values():
        for opt in spec.options:
            flags.setdefault(opt.cli_flag, []).append((spec.name, opt))
    return flags


def _option_type(opt):
    kind = {float: "a number", int: "a whole number"}.get(opt.type, f"a value as its help says ({opt.help})")

    def parse(text):
        try:
            return opt.type(text)
        except (ValueError, UserError):
            raise argparse.ArgumentTypeError(f"{text!r} is not allowed: it must be {kind}") from None
    parse.toml_kind = {float: "number", int: "integer", str: "text"}.get(opt.type, "list")
    return parse


def _add_method_options(run: argparse.ArgumentParser) -> None:
    """One flag per method option, built from the methods' own descriptions."""
    group = run.add_argument_group("method options (each applies to the methods named)")
    for flag, users in _method_flags().items():
        opt = users[0][1]
        names = ", ".join(name for name, _ in users)
        default = ",".join(map(str, opt.default)) if isinstance(opt.default, tuple) else opt.default
        metavar = flag.lstrip("-").upper().replace("-", "_")
        if opt.type is boolean:  # a switch: --name / --no-name, no value
            group.add_argument(flag, dest=f"option:{flag}", action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=f"{opt.help} [{names}] (default: {default})")
            continue
        group.add_argument(flag, dest=f"option:{flag}", type=_option_type(opt), default=argparse.SUPPRESS,
                           metavar=metavar,
                           help=f"{opt.help} [{names}] (default: {default})")


def _method_options(args: argparse.Namespace) -> dict:
    """The chosen method's options from the flags given; a flag of another method is an error."""
    given = {key.split(":", 1)[1]: value for key, value in vars(args).items() if key.startswith("option:")}
    options = {}
    for flag, value in given.items():
        mine = [opt for name, opt in _method_flags()[flag] if name == args.method]
        if not mine:
            owners = ", ".join(name for name, _ in _method_flags()[flag])
            raise UserError(f"{flag} is an option of {owners}, not of method {args.method!r}.")
        options[mine[0].name] = value
    return options


def config_from_args(args: argparse.Namespace) -> RunConfig:
    local_steps, local_epochs = args.local_steps, args.local_epochs
    options = _method_options(args) if args.method in METHODS else {}
    return RunConfig(
        method=args.method, dataset=args.dataset, data_dir=args.data_dir, model=args.model,
        partition=args.partition, alpha=args.alpha, classes_per_client=args.classes_per_client,
        num_clients=args.clients, cohort_size=args.cohort, rounds=args.rounds,
        local_steps=local_steps, local_epochs=local_epochs, batch_size=args.batch_size,
        client_lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay,
        server_optimizer=args.server_opt, server_lr=args.server_lr, options=options,
        early_stopping=args.es, train_fraction=args.train_fraction,
        bn_policy=args.bn_policy, strategy=args.strategy, devices=args.devices,
        data_placement=args.data_placement, client_state=args.client_state, seed=args.seed,
        eval_every=args.eval_every,
        out_dir=args.out, run_name=args.name, record_decisions=args.record_decisions,
        device_profiles=args.device_profiles, compute_speed=args.compute_speed,
        download_bandwidth=args.download_bandwidth, upload_bandwidth=args.upload_bandwidth,
        target_accuracy=args.target_accuracy, max_samples=args.max_samples,
    )


def _mb(n: float) -> str:
    return f"{n / 1e6:,.2f} MB"


def _duration(seconds: float) -> str:
    """Simulated seconds for people: '42.0 s', '12.5 min', '3.20 h'."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:,.2f} h"


def _run_flags(argv: list[str] | None) -> tuple[argparse.ArgumentParser, list[str]]:
    """The ``run`` parser and the tokens given after ``run`` on the command line."""
    tokens = list(sys.argv[1:] if argv is None else argv)
    return build_parser()._subparsers._group_actions[0].choices["run"], tokens[tokens.index("run") + 1:]


def _run(args, console: Console, argv: list[str] | None = None) -> int:
    from fedpartial._src.experiment import checkpoint
    from fedpartial._src.experiment import records as run_config

    args.from_file = {}  # flag -> key of the values the --config file gave, so messages name the file's key
    if args.config is not None:
        if args.resume is not None:
            raise UserError("--config cannot be combined with --resume: a resumed run keeps its own config.json.")
        args.from_file = run_config.merge(args, *_run_flags(argv), args.config)
    if _replicas_asked(args):  # --seed / --lr / --server-lr on the command line conflict
        given = run_config.given_on_command_line(*_run_flags(argv))  # (a config file's values are replaced)
        args.seed_given, args.lr_given, args.server_lr_given = ("seed" in given, "lr" in given,
                                                                "server_lr" in given)
    try:
        return _run_checked(args, console, checkpoint)
    except UserError as e:
        if not args.from_file or checkpoint.is_diverged(e):
            raise
        raise UserError(run_config.attribute(str(e).strip(), args.from_file, args.config)) from None


def _run_checked(args, console: Console, checkpoint) -> int:
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        raise UserError(f"--checkpoint-every must be at least 1, got {args.checkpoint_every}.")
    # Signals from here on only set a flag: the run stops between rounds, never inside JAX.
    with checkpoint.StopFlag() as stop:
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


def _run_stoppable(args, console: Console, stop) -> int:
    from fedpartial._src.experiment import simulation

    _join_processes(args)  # before anything touches a JAX backend
    if _replicas_asked(args):
        return _run_seeds(args, console, stop)
    if args.resume is not None:
        config = simulation.load_config(args.resume)
    else:
        config = config_from_args(args)
    config.validate(check_model=True)  # every bad value, path and combination before any set-up
    t0 = time.perf_counter()
    sim = simulation.Simulation(config)  # data and model errors surface before the progress bar
    # Progress: a live rich line on a terminal; otherwise plain lines (one per round, at most ~50 in all,
    # and always the last round) so logs stay readable; --quiet: nothing but the run directory at the end.
    live = not args.quiet and console.is_terminal
    progress = Progress(
        TextColumn("[bold]round"), MofNCompleteColumn(), BarColumn(),
        TextColumn("acc {task.fields[acc]}"), TextColumn("loss {task.fields[loss]}"),
        TextColumn("traffic {task.fields[traffic]}"), TextColumn("{task.fields[rate]} rounds/s"),
        TextColumn("ETA {task.fields[eta]}"),
        console=console, transient=False,
    ) if live else None
    every = max(1, math.ceil(config.rounds / 50))
    shown = {"acc": "–", "start": None}

    def on_round(r):
        if shown["start"] is None:  # a resumed run starts at its checkpoint: rates count this session's rounds
            shown["start"] = r["round"] - 1
        if "test_accuracy" in r:
            shown["acc"] = f"{r['test_accuracy']:.4f}"
        shown["wall"] = shown.get("wall", 0.0) + r.get("wall_time_s", 0.0)  # each record times its own round
        rate = (r["round"] - shown["start"]) / shown["wall"] if shown["wall"] > 0 else math.nan
        fields = dict(acc=shown["acc"], loss=f"{r['train_loss']:.3f}",
                      traffic=_mb(r["cumulative_upload_bytes"] + r["cumulative_download_bytes"]),
                      rate=f"{rate:.2f}" if math.isfinite(rate) else "–",
                      eta=_duration((config.rounds - r["round"]) / rate) if math.isfinite(rate) and rate > 0 else "–")
        if progress is not None:
            progress.update(task, completed=r["round"], **fields)
        elif not args.quiet and (r["round"] % every == 0 or r["round"] == config.rounds):
            print(f"round {r['round']}/{config.rounds}  acc {fields['acc']}  loss {fields['loss']}  "
                  f"traffic {fields['traffic']}  {fields['rate']} rounds/s  ETA {fields['eta']}", flush=True)

    with progress if progress is not None else contextlib.nullcontext():
        if progress is not None:
            task = progress.add_task("run", total=config.rounds, acc="–", loss="–", traffic="0 MB", rate="–",
                                     eta="–")
        summary = simulation.run(config, on_round=on_round, sim=sim, checkpoint_every=args.checkpoint_every,
                                 resume=args.resume, stop=stop)
    summary["wall_time_s"] = time.perf_counter() - t0
    if args.quiet:
        print(summary["run_dir"], flush=True)
        return 0
    table = Table(title=f"fedpartial {config.method} on {summary['dataset']}", show_header=False)
    rows = [
        ("model", f"{summary['model']} ({summary['num_params']:,} parameters)"),
        ("clients / cohort", f"{config.num_clients} / {config.cohort_size}"),
        ("strategy", f"{summary['strategy']} on {summary['backend']}, data on the {summary['data_placement']}"
                     + (f" ({summary['strategy_note']})" if "strategy_note" in summary else "")
                     + ("" if summary.get("client_state", "device") == "device"
                        else f", clients' state on the {summary['client_state']}")),
        ("rounds", str(summary["rounds"])
         + (f" (early stopping saved {summary['rounds_saved']})" if "rounds_saved" in summary else "")),
        ("final test accuracy", f"{summary['final_test_accuracy']:.4f}"),
        ("best test accuracy", f"{summary['best_test_accuracy']:.4f}"),
        ("final test loss", f"{summary['final_test_loss']:.4f}"),
        *([("personal accuracy (mean ± std over clients)",
             f"{summary['final_personal_accuracy']:.4f} ± {summary['final_personal_accuracy_std']:.4f}"),
            ("global model on clients' held-out data", f"{summary['final_global_client_accuracy']:.4f}"),
            ("personal state", _mb(summary["personal_state_bytes"]))]
          if "final_personal_accuracy" in summary else []),
        ("upload / download", f"{_mb(summary['total_upload_bytes'])} / {_mb(summary['total_download_bytes'])}"),
        ("simulated device time", (f"{_duration(summary['total_simulated_time_s'])} "
                                   f"({summary['total_client_flops'] / 1e9:,.2f} GFLOPs of local work)")),
        *([(f"time to {config.target_accuracy:g} test accuracy",
            f"{_duration(summary['time_to_target_s'])} (round {summary['round_to_target']})"
            if summary["time_to_target_s"] is not None else f"not reached in {summary['rounds']} rounds")]
          if config.target_accuracy is not None else []),
        ("time (rounds/s)", f"{summary['wall_time_s']:.1f} s ({summary['rounds_per_s']:.2f} rounds/s)"),
        ("results", str(summary["run_dir"])),
    ]
    for k, v in rows:
        table.add_row(k, v)
    console.print(table)
    return 0


def _replicas_asked(args) -> bool:
    return any(getattr(args, name, None) is not None for name in ("seeds", "lrs", "server_lrs"))


def _run_seeds(args, console: Console, stop) -> int:
    """``fedpartial run --seeds`` / ``--lrs`` / ``--server-lrs``: the replicas as one simulation
    (:mod:`fedpartial._src.experiment.replicas`)."""
    from fedpartial._src.analysis import compare
    from fedpartial._src.experiment import replicas

    flag = "--seeds" if args.seeds is not None else "--lrs" if args.lrs is not None else "--server-lrs"
    seeds = compare.parse_seeds(args.seeds) if args.seeds is not None else [args.seed]
    lrs = replicas.parse_lrs(args.lrs) if args.lrs is not None else None
    server_lrs = replicas.parse_lrs(args.server_lrs, "--server-lrs") if args.server_lrs is not None else None
    if args.resume is not None:
        raise UserError(f"{flag} cannot be combined with --resume; resume each replica's run folder on its own "
                        "(fedpartial run --resume RUN_DIR).")
    if args.seeds is not None and getattr(args, "seed_given", False):
        raise UserError("--seeds cannot be combined with --seed; give every seed in --seeds.")
    if lrs is not None and getattr(args, "lr_given", False):
        raise UserError("--lrs cannot be combined with --lr; give every learning rate in --lrs.")
    if server_lrs is not None and getattr(args, "server_lr_given", False):
        raise UserError("--server-lrs cannot be combined with --server-lr; give every server learning rate in "
                        "--server-lrs.")
    config = config_from_args(args)
    config.validate(check_model=True)
    replicas.replica_strategy(config.strategy)
    every = max(1, math.ceil(config.rounds / 50))

    def on_round(t, records):
        shown = [r for r in records if r is not None]
        if args.quiet or not shown or not ((t + 1) % every == 0 or t + 1 == config.rounds):
            return
        accs = [f"{r['test_accuracy']:.4f}" if "test_accuracy" in r else "–" for r in shown]
        print(f"round {t + 1}/{config.rounds}  acc {' '.join(accs)}  "
              f"{len(shown)} of {len(records)} replicas running", flush=True)

    done = replicas.run_seeds(config, seeds, on_round=on_round, stop=stop, checkpoint_every=args.checkpoint_every,
                              lrs=lrs, server_lrs=server_lrs)
    failed = [(os.path.basename(r["run_dir"] or "?"), r) for r in done["results"] if r["status"] != "complete"]
    if args.quiet:
        print(done["out_dir"], flush=True)
    else:
        if done["out_dir"]:
            with open(os.path.join(done["out_dir"], "seeds_summary.md")) as f:
                print(f.read(), end="")
        console.print(f"replica axis {done['replica_axis']}, data on the {done['data_placement']}"
                      + (f" ({done['note']})" if done["note"] else ""), markup=False)
        for name, r in failed:
            console.print(f"{name}: {r['status']} ({r['run_dir']})")
        console.print(f"results: {done['out_dir']}")
    return 1 if failed else 0


def _capacity(args, console: Console) -> int:
    from fedpartial._src.analysis import capacity

    shape = None
    if args.input_shape is not None:
        try:
            shape = tuple(int(d) for d in args.input_shape.split(","))
        except ValueError:
            raise UserError(f"--input-shape {args.input_shape!r} must be whole numbers separated by commas, "
                            "e.g. 32,32,3.") from None
    model = capacity.reference_model(args.model, shape, args.classes)
    table = Table(title=f"client tiers of {model.name} {model.input_shape} — activations per batch of "
                        f"{args.batch_size}")
    for col in ("method", "tier", "trains", "parameters", "activations", "capacity", "paper"):
        table.add_column(col, justify="left" if col in ("method", "tier", "trains") else "right")
    for row in capacity.report(model, batch_size=args.batch_size, cut=args.cut):
        table.add_row(row["method"], row["tier"], row["trains"], f"{row['params']:,}", f"{row['activations']:,}",
                      f"{row['capacity']:.3f}", "–" if row["paper"] is None else f"{row['paper']:.2f}")
    Console(width=max(console.width, 110)).print(table)
    return 0


def _list(args) -> int:
    """One plain line per name (no table: easy to grep)."""
    rows = {
        "methods": [(n, s.summary + (" [neuron-level: sequential models only]" if s.build().capabilities.neuron_masks else ""))
                    for n, s in METHODS.items()],
        "models": [(n, s.description + ("" if s.sequential else " [residual: no neuron-level methods]"))
                   for n, s in MODELS.items()],
        "datasets": [(n, f"{DATASET_SUMMARIES.get(n, '')}; examples "
                         f"{'x'.join(map(str, DATASET_SHAPES[n])) if n in DATASET_SHAPES else 'of varying shape'}, "
                         f"default model {DEFAULT_MODELS.get(n, 'mlp')}")
                     for n in DATASETS],
    }
    for what in [args.what] if args.what else list(rows):
        if not args.what:
            print(f"{what}:")
        width = max(len(n) for n, _ in rows[what])
        for name, summary in rows[what]:
            print(f"{'  ' if not args.what else ''}{name:<{width}}  {summary}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """The ``fedpartial`` command; returns the exit status (argparse's exits included)."""
    parser = build_parser()
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
    logging.getLogger("absl").setLevel(logging.ERROR)  # tfds warnings would bury our one sentence
    try:
        if args.command == "run":
            return _run(args, console, argv)
        if args.command == "compare":
            return _compare(args, console)
        if args.command == "plot":
            return _plot(args, console)
        if args.command == "capacity":
            return _capacity(args, console)
        if args.command == "list":
            return _list(args)
        if args.command == "bench":
            return bench.main(args)
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
