"""The flags several subcommands share: the value parsers, the help formatter and the parser class of every
subcommand, the ``run`` flags (which ``compare`` takes too, as the same argparse actions), the per-method
option flags built from the methods' :class:`~fedpartial._src.methods.registry.MethodSpec` options, and
:func:`config_from_args`, which turns the parsed flags into a :class:`RunConfig`.

A flag's ``type`` function says in its ``toml_kind`` attribute what the flag takes in a ``--config`` file
(:mod:`fedpartial._src.cli.config_file`).
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
from collections.abc import Iterable

from fedpartial._src.core.errors import UserError
from fedpartial._src.experiment.config import DEFAULT_LOCAL_EPOCHS, RunConfig
import dataclasses

from fedpartial._src.methods.catalog import METHODS, all_methods, find_method
from fedpartial._src.methods.registry import MethodSpec, boolean, ratios


def whole_number(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed: it must be a whole number") from None


whole_number.toml_kind = "integer"  # what the flag takes in a --config file (fedpartial._src.cli.config_file)
positive_int = whole_number  # the old name; ranges are checked by RunConfig.validate, naming the flag


def number(text: str) -> float:
    try:
        return float(text)  # NaN and ±inf parse; RunConfig.validate refuses them naming the flag
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed: it must be a number") from None


number.toml_kind = "number"


class Formatter(argparse.HelpFormatter):
    """Shows ``(default: X)`` after every flag's help (``none`` for None), unless the help already says."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS or not action.option_strings \
                or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            return text
        shown = "none" if action.default is None else action.default
        return f"{text} (default: {shown})".strip()


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one sentence, exit status 2, no usage dump
        # argparse says "argument --lr: 'x' is not ..."; people typed "--lr x"
        match = re.fullmatch(r"argument (\S+?)(?:/\S+)?: (.*)", message, re.S)
        if match:
            flag, rest = match.groups()
            message = f"{flag} {rest}" if rest.startswith("'") else f"{flag}: {rest}"
        sys.stderr.write(f"fedpartial: error: {message.rstrip('.')}.\n")
        sys.exit(2)


def method_specs(names: Iterable[str] = ()) -> list[MethodSpec]:
    """The methods whose options become flags: the built-in and installed ones (entry points), and each of
    ``names`` given as ``package.module:factory`` (under that name; one that cannot be loaded is left out here
    and refused in one sentence when the run is checked)."""
    try:
        specs = dict(all_methods())
    except UserError:  # a broken installed plugin: its sentence comes when a run names it, not on every command
        specs = dict(METHODS)
    for name in names:
        if ":" in name and name not in specs:
            try:
                specs[name] = dataclasses.replace(find_method(name), name=name)
            except UserError:
                pass
    return list(specs.values())


def named_methods(argv: Iterable[str]) -> list[str]:
    """The method names ``--method`` / ``--methods`` give in ``argv`` (before parsing: their options need flags)."""
    argv, names = list(argv), []
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag in ("--method", "--methods"):
            value = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            names += [n.strip() for n in value.split(",") if n.strip()]
    return names


def add_run_flags(run: argparse.ArgumentParser, specs: Iterable[MethodSpec] | None = None) -> None:
    """Every flag of ``fedpartial run``, in the order ``--help`` shows them (``compare`` copies most of them);
    ``specs``: the methods whose options become flags (default :func:`method_specs`)."""
    d = RunConfig()
    specs = method_specs() if specs is None else list(specs)
    run.add_argument("--config", default=None, metavar="TOML",
                     help="read run flags from a TOML file (keys are these flags without --; the command line "
                          "overrides them)")
    run.add_argument("--quiet", action="store_true",
                     help="no progress and no summary table: print only the run directory")
    run.add_argument("--method", default=d.method,
                     help=", ".join(s.name for s in specs if ":" not in s.name) + " or package.module:factory")
    run.add_argument("--dataset", default=d.dataset, help="digits (offline), synthetic, mnist, cifar10, ...")
    run.add_argument("--data-dir", default=d.data_dir,
                     help="tensorflow-datasets data directory (default: tensorflow-datasets' own)")
    run.add_argument("--model", default=d.model, help="'auto' or a zoo model name")
    run.add_argument("--partition", default=d.partition, help="iid, dirichlet, shards or natural")
    run.add_argument("--alpha", type=number, default=d.alpha, help="Dirichlet α (also Synthetic α and β)")
    run.add_argument("--max-samples", type=whole_number, default=None, metavar="N",
                     help="synthetic: cap each client's examples at N (fewer per client, e.g. for 1,000,000 clients)")
    run.add_argument("--classes-per-client", type=whole_number, default=d.classes_per_client,
                     help="classes per client of the shards partition")
    run.add_argument("--clients", type=whole_number, default=d.num_clients, help="population size N")
    run.add_argument("--cohort", type=whole_number, default=d.cohort_size, help="clients per round K")
    run.add_argument("--rounds", type=whole_number, default=d.rounds, help="communication rounds (with --resume: extend the run to this many, more than it planned)")
    local = run.add_mutually_exclusive_group()
    local.add_argument("--local-steps", type=whole_number, default=None,
                       help="local steps per round (default: none, --local-epochs sets the local work)")
    local.add_argument("--local-epochs", type=number, default=None,
                       help=f"local epochs per round (default: {DEFAULT_LOCAL_EPOCHS:g} when --local-steps "
                            "is not given)")
    run.add_argument("--batch-size", type=whole_number, default=d.batch_size, help="client batch size")
    run.add_argument("--lr", type=number, default=d.client_lr, help="client learning rate")
    run.add_argument("--momentum", type=number, default=d.momentum, help="client SGD momentum, in [0, 1)")
    run.add_argument("--weight-decay", type=number, default=d.weight_decay, help="client L2 weight decay")
    run.add_argument("--server-opt", default=d.server_optimizer, help="sgd, adam, yogi, adagrad")
    run.add_argument("--server-lr", type=number, default=d.server_lr, help="server learning rate")
    method_option_flags(run, specs)
    run.add_argument("--es", action="store_true",
                     help="early stopping: a client stops for good when its λ-mixed train/val loss rises")
    run.add_argument("--train-fraction", type=number, default=None,
                     help="λ: each client's training share, the rest held out "
                          "(default: 0.7 for personalised methods and --es, else 1)")
    run.add_argument("--upload-codec", default=None, metavar="CODEC",
                     help="compress what each client uploads: topk:F (the largest fraction F of its update, with "
                          "error feedback), qsgd:B (B-bit QSGD, unbiased) or sign (scaled sign, error feedback); "
                          "traffic is counted in bits")
    run.add_argument("--sparse-flops", action="store_true",
                     help="count the FLOPs of a client that trains an element mask (feddst, fiarse) as if it computed "
                          "only the weights it trains (default: dense, as the engine computes)")
    privacy = run.add_argument_group(
        "differential privacy (DP-FedAvg around the method, docs/privacy.md: each client's update is clipped to "
        "norm C, Gaussian noise of std z·C is added to their sum, ε at δ is reported every round)")
    privacy.add_argument("--dp-clip", type=number, default=None, metavar="C",
                         help="clip each client's update (on what it uploads) to this L2 norm; turns DP on")
    privacy.add_argument("--dp-noise-multiplier", type=number, default=None, metavar="Z",
                         help="noise std over the clipping norm (0: clipping only, no privacy)")
    privacy.add_argument("--dp-clip-per-layer", action="store_true",
                         help="clip each layer to C/√L (L layers) instead of the whole upload to C")
    privacy.add_argument("--dp-delta", type=number, default=None,
                         help="the δ at which ε is reported (default: 1/N, N the population)")
    privacy.add_argument("--dp-target-quantile", type=number, default=None, metavar="Q",
                         help="adaptive clipping (Andrew et al. 2021): C follows this quantile of the clients' "
                              "update norms, starting from --dp-clip")
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
    run.add_argument("--devices", type=whole_number, default=d.devices, metavar="N",
                     help="split each round's cohort over N local devices (fused strategy; the cohort is padded "
                          "to a multiple of N with clients that weigh nothing); default: all local devices for "
                          "the fused strategy on a GPU/TPU, else 1")
    hosts = run.add_argument_group(
        "several processes (multi-host: every process runs the same command with its own --process-id; "
        "the cohort is split over every process's devices; see docs/multihost.md)")
    hosts.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                       help="address of process 0, for jax.distributed.initialize")
    hosts.add_argument("--num-processes", type=whole_number, default=None, metavar="P", help="processes in all")
    hosts.add_argument("--process-id", type=whole_number, default=None, metavar="I", help="this process, 0 to P-1")
    run.add_argument("--seed", type=whole_number, default=d.seed, help="seed of every random choice")
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
    run.add_argument("--eval-every", type=whole_number, default=d.eval_every, help="test every this many rounds")
    run.add_argument("--out", default=d.out_dir, help="directory for run folders")
    run.add_argument("--name", default=None,
                     help="run folder name, made unique (default: METHOD-DATASET-seedSEED)")
    run.add_argument("--record-decisions", action="store_true",
                     help="save every round's plan and selection masks to RUN_DIR/decisions/round-NNNNN.npz")
    run.add_argument("--checkpoint-every", type=positive_int, default=None, metavar="N",
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
    devices.add_argument("--target-accuracy", type=number, default=None,
                         help="report the simulated time (and round) at which test accuracy first reaches this")
    timed = run.add_argument_group(
        "deadlines, stragglers and availability (docs/deadlines.md: each client's time is predicted before the round "
        "from the device model)")
    deadline = timed.add_mutually_exclusive_group()
    deadline.add_argument("--round-deadline", type=number, default=None, metavar="SECONDS",
                          help="a round waits this many simulated seconds for its clients")
    deadline.add_argument("--deadline-quantile", type=number, default=None, metavar="Q",
                          help="the deadline is this quantile of the cohort's predicted times, each round")
    timed.add_argument("--straggler-policy", default=d.straggler_policy,
                       help="a client past the deadline: drop (its work is lost) or partial (it trains the steps "
                            "that fit and uploads them)")
    timed.add_argument("--over-select", type=number, default=d.over_select, metavar="F",
                       help="sample ceil(F·K) clients and keep the first K to report")
    timed.add_argument("--availability", default=d.availability,
                       help="who may be sampled: always, a probability (e.g. 0.7), diurnal[:LOW:HIGH[:PERIOD_S]] "
                            "or a CSV trace with columns client_id,start_s,end_s")
    asynchronous = run.add_argument_group(
        "asynchronous aggregation (docs/async.md: C clients in flight, the server steps on every M arrivals)")
    asynchronous.add_argument("--mode", choices=("sync", "async"), default=d.mode,
                              help="sync: rounds of a cohort; async: buffered asynchronous (FedBuff; M = 1 FedAsync)")
    asynchronous.add_argument("--concurrency", type=whole_number, default=d.concurrency, metavar="C",
                              help="async: clients in flight at once (default: the buffer)")
    asynchronous.add_argument("--buffer", type=whole_number, default=d.buffer, metavar="M",
                              help="async: the server steps when M updates have arrived (default: --cohort)")
    asynchronous.add_argument("--staleness", default=d.staleness,
                              help="async: weight of an update τ server steps old: constant, poly[:A] ((1+τ)^-A, "
                                   "A 0.5) or hinge:A:B (1 up to B, then 1/(A(τ-B)+1))")


def method_flag_users(specs: Iterable[MethodSpec]) -> dict[str, list]:
    """Every method option's flag -> [(method name, Option), ...] (methods may share a flag).  A plug-in's
    option that :func:`flag_clash` refuses has no flag: the built-in one keeps its own type."""
    specs = list(specs)
    flags: dict[str, list] = {}
    for spec in specs:
        for opt in spec.options:
            if spec.name in METHODS or _clash(spec.name, opt) is None:
                flags.setdefault(opt.cli_flag, []).append((spec.name, opt))
    return flags


@functools.cache
def _run_flag_strings() -> frozenset[str]:
    """The flags of ``fedpartial run`` that are not method options (``--seed``, ``--rounds``, ...)."""
    parser = argparse.ArgumentParser(add_help=True)
    add_run_flags(parser, specs=())
    return frozenset(s for action in parser._actions for s in action.option_strings)


def _kind(opt) -> str:
    return {float: "a number", int: "a whole number", str: "text", boolean: "a switch",
            ratios: "comma-separated numbers"}.get(
        opt.type, getattr(opt.type, "__name__", "a value"))


def _clash(method: str, opt) -> str | None:
    """Why ``opt`` of the plug-in ``method`` cannot have its flag: the flag is one of ``run``'s own, or a
    built-in method's option of another type (else parsed as the built-in's, it would fail later)."""
    flag = opt.cli_flag
    if flag in _run_flag_strings():
        return (f"option {opt.name!r} of method {method!r} would take the flag {flag}, which is fedpartial run's own; "
                f"give the option another flag (Option(..., flag=...)) or its argument another name.")
    owners = [(name, o) for name, spec in METHODS.items() for o in spec.options if o.cli_flag == flag]
    if owners and owners[0][1].type is not opt.type:
        names = ", ".join(name for name, _ in owners)
        return (f"option {opt.name!r} of method {method!r} ({_kind(opt)}) would take the flag {flag}, which the "
                f"built-in {names} own{'s' if len(owners) == 1 else ''} for {_kind(owners[0][1])}; give the option "
                f"another flag (Option(..., flag=...)) or its argument another name.")
    return None


def flag_clash(spec: MethodSpec) -> str | None:
    """The sentence refusing a plug-in method (not a built-in one) one of whose options would take a flag
    that a built-in method owns for another type, or that ``run`` owns; None when every option has its flag."""
    if spec.name in METHODS:
        return None
    return next((why for opt in spec.options if (why := _clash(spec.name, opt))), None)


def _option_type(opt):
    kind = {float: "a number", int: "a whole number"}.get(opt.type, f"a value as its help says ({opt.help})")

    def parse(text):
        try:
            return opt.type(text)
        except (ValueError, UserError):
            raise argparse.ArgumentTypeError(f"{text!r} is not allowed: it must be {kind}") from None
    parse.toml_kind = {float: "number", int: "integer", str: "text"}.get(opt.type, "list")
    return parse


def method_option_flags(parser: argparse.ArgumentParser, specs: Iterable[MethodSpec]) -> None:
    """One flag per method option of ``specs`` (the methods' own descriptions), stored as ``option:FLAG``.

    The one place where method flags are made: ``run`` passes :func:`method_specs`.
    """
    group = parser.add_argument_group("method options (each applies to the methods named)")
    for flag, users in method_flag_users(specs).items():
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


def method_options(args: argparse.Namespace, specs: Iterable[MethodSpec] | None = None) -> dict:
    """The chosen method's options from the flags given; a flag of another method is an error."""
    users = method_flag_users(method_specs([args.method]) if specs is None else specs)
    given = {key.split(":", 1)[1]: value for key, value in vars(args).items() if key.startswith("option:")}
    options = {}
    for flag, value in given.items():
        mine = [opt for name, opt in users[flag] if name == args.method]
        if not mine:
            owners = ", ".join(name for name, _ in users[flag])
            raise UserError(f"{flag} is an option of {owners}, not of method {args.method!r}.")
        options[mine[0].name] = value
    return options


def refuse_flag_clashes(names: Iterable[str]) -> None:
    """A plug-in method among ``names`` whose option would take a built-in flag of another type is refused in
    one sentence naming both owners (before anything runs)."""
    for spec in method_specs(names):
        if spec.name in names and (why := flag_clash(spec)):
            raise UserError(why)


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """The :class:`RunConfig` of parsed ``run`` (or ``compare``) flags."""
    refuse_flag_clashes([args.method])
    local_steps, local_epochs = args.local_steps, args.local_epochs
    options = method_options(args)
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
        upload_codec=args.upload_codec, sparse_flops=args.sparse_flops,
        dp_clip=args.dp_clip, dp_noise_multiplier=args.dp_noise_multiplier, dp_clip_per_layer=args.dp_clip_per_layer,
        dp_delta=args.dp_delta, dp_target_quantile=args.dp_target_quantile,
        round_deadline=args.round_deadline, deadline_quantile=args.deadline_quantile,
        straggler_policy=args.straggler_policy, over_select=args.over_select, availability=args.availability,
        mode=args.mode, concurrency=args.concurrency, buffer=args.buffer, staleness=args.staleness,
    )
