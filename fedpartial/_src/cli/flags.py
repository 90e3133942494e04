"""The flags several subcommands share: the value parsers, the help formatter and the parser class of every
subcommand (which keeps a public record of the flags it holds), the ``run`` flags (which ``compare`` declares
again, but for those it sets itself), the per-method option flags built from the methods'
:class:`~fedpartial._src.methods.registry.MethodSpec` options, and :func:`config_from_args`, which turns the
parsed flags into a :class:`RunConfig`.

A flag's ``type`` function says in its ``toml_kind`` attribute what the flag takes in a ``--config`` file
(:mod:`fedpartial._src.cli.config_file`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import re
import sys
import textwrap
from collections.abc import Iterable

from fedpartial._src.core.errors import UserError
from fedpartial._src.experiment import settings
from fedpartial._src.experiment.config import RunConfig
from fedpartial._src.methods.catalog import METHODS, all_methods, find_method
from fedpartial._src.methods.registry import MethodSpec, boolean, ratios


def whole_number(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed: it must be a whole number") from None


whole_number.toml_kind = "integer"  # what the flag takes in a --config file (fedpartial._src.cli.config_file)


def number(text: str) -> float:
    try:
        return float(text)  # NaN and ±inf parse; RunConfig.validate refuses them naming the flag
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed: it must be a number") from None


number.toml_kind = "number"


class Formatter(argparse.HelpFormatter):
    """Shows ``(default: X)`` after every flag's help (``none`` for None), unless the help already says; never
    breaks a line inside a flag (``--dp-`` / ``delta``)."""

    def _split_lines(self, text, width):
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _fill_text(self, text, width, indent):
        return textwrap.fill(" ".join(text.split()), width, initial_indent=indent, subsequent_indent=indent,
                             break_on_hyphens=False)

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS or not action.option_strings:
            return text  # --help and --version have no default (argparse.SUPPRESS)
        shown = "none" if action.default is None else action.default
        return f"{text} (default: {shown})".strip()


#: what --resume does, said the same way in ``--help`` and on the Running experiments page (a test compares them)
RESUME_HELP = ("continue a stopped run from its newest checkpoint, with the configuration in RUN_DIR/config.json; "
               "other run flags are refused, except --checkpoint-every, --quiet, --rounds (to extend the run) and "
               "the several-processes flags")


#: the title of the group of a parser's general flags (--help, --config, ...): argparse's own for it
OPTIONS = "options"


class Group:
    """An argument group, or mutually exclusive group, of a :class:`Parser`: adds through argparse's own
    group and records each flag in :attr:`actions`, in its enclosing group's and in the parser's
    :attr:`Parser.flags`.

    Attributes:
      parser: the parser it belongs to.
      actions: its flags, in the order they were added (a mutually exclusive group's inside it included).
      group: argparse's group it adds to.
    """

    def __init__(self, parser: Parser, group, enclosing: Group | None = None):
        self.parser, self.group, self.enclosing = parser, group, enclosing
        self.actions: list[argparse.Action] = []

    @property
    def title(self) -> str | None:
        """The group's heading in ``--help`` (None for a mutually exclusive group)."""
        return self.group.title

    @property
    def description(self) -> str | None:
        """The text ``--help`` shows under the heading."""
        return self.group.description

    @description.setter
    def description(self, text: str | None) -> None:
        self.group.description = text

    @property
    def required(self) -> bool:
        """Whether one flag of a mutually exclusive group must be given (False for an argument group)."""
        return getattr(self.group, "required", False)

    def add_argument(self, *args, **kwargs) -> argparse.Action:
        """As :meth:`argparse.ArgumentParser.add_argument`, recording the flag (and how it was declared)."""
        action = self.group.add_argument(*args, **kwargs)
        group = self
        while group is not None:
            group.actions.append(action)
            group = group.enclosing
        self.parser.record(action, args, kwargs)
        return action

    def add_mutually_exclusive_group(self, **kwargs) -> Group:
        """A mutually exclusive group inside this one; its flags are shown in this group."""
        group = Group(self.parser, self.group.add_mutually_exclusive_group(**kwargs), enclosing=self)
        self.parser.exclusive.append(group)
        return group


class Parser(argparse.ArgumentParser):
    """The parser of ``fedpartial`` and of each subcommand: one-sentence errors, and a public record of what
    was added to it, for the code that reads flags back (``--config`` files, ``--resume``, ``compare``).

    Attributes:
      flags: every flag, in the order added (argparse's own ``--help`` included).
      declared: each flag -> the ``(args, kwargs)`` it was declared with (to declare it again elsewhere).
      groups: each argument group (a :class:`Group`), in the order added.
      exclusive: each mutually exclusive group (a :class:`Group`).
      subcommands: the action of :meth:`add_subparsers` (its ``choices``: name -> parser), or None.
    """

    def __init__(self, *args, **kwargs):
        self.flags: list[argparse.Action] = []
        self.declared: dict[argparse.Action, tuple[tuple, dict]] = {}
        self.groups: list[Group] | None = None  # argparse's own groups, made while it sets up, stay its own
        self.exclusive: list[Group] = []
        self.subcommands = None
        super().__init__(*args, **kwargs)  # adds --help through add_argument: recorded
        self.groups = []

    def record(self, action: argparse.Action, args: tuple, kwargs: dict) -> None:
        """Records ``action``, declared with ``args`` and ``kwargs``."""
        self.flags.append(action)
        self.declared[action] = (args, dict(kwargs))

    def add_argument(self, *args, **kwargs) -> argparse.Action:
        """As argparse's, recording the flag (and how it was declared)."""
        action = super().add_argument(*args, **kwargs)
        self.record(action, args, kwargs)
        return action

    def add_argument_group(self, *args, **kwargs) -> Group:
        """As argparse's, as a :class:`Group` that records its flags."""
        if self.groups is None:
            return super().add_argument_group(*args, **kwargs)
        group = Group(self, super().add_argument_group(*args, **kwargs))
        self.groups.append(group)
        return group

    def add_mutually_exclusive_group(self, **kwargs) -> Group:
        """As argparse's, as a :class:`Group` that records its flags; they are shown under ``options``."""
        group = Group(self, super().add_mutually_exclusive_group(**kwargs))
        self.exclusive.append(group)
        return group

    def add_subparsers(self, **kwargs):
        """As argparse's, keeping the action in :attr:`subcommands`."""
        self.subcommands = super().add_subparsers(**kwargs)
        return self.subcommands

    def command(self, name: str) -> Parser:
        """The parser of the subcommand ``name``."""
        return self.subcommands.choices[name]

    def flag(self, dest: str) -> argparse.Action:
        """The flag that stores into ``dest``."""
        return next(action for action in self.flags if action.dest == dest)

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


#: the types of generated flags, by what the field takes (a switch has none)
_PARSERS = {"int": whole_number, "float": number, "str": None}


def _setting_flag(parser, field) -> None:
    """The flag of one RunConfig field, from its description (:mod:`fedpartial._src.experiment.settings`)."""
    s = settings.described(field)
    flag, kind = settings.flag_of(field), settings.kind(field)
    unit = f" [{s.unit}]" if s.unit else ""
    help_text = f"{s.help}{unit} (default: {settings.default_text(field)})"
    if kind == "bool":  # a switch; one that is on by default has its --no- form
        on = field.default is True
        parser.add_argument(flag, action=argparse.BooleanOptionalAction if on else "store_true", default=on,
                            help=help_text)
        return
    default = field.default if field.default is not dataclasses.MISSING else None
    parser.add_argument(flag, type=_PARSERS[kind], default=default, metavar=s.metavar, help=help_text)


#: the groups ``fedpartial run --help`` names by their flags only (``--help-all`` shows their help too)
BRIEF_GROUPS = ("differential privacy", "simulated time: devices, deadlines and availability",
                "asynchronous aggregation", "execution", "several processes")


def add_run_flags(run: Parser, specs: Iterable[MethodSpec] | None = None,
                  shown: Iterable[str] | None = None, brief: bool = False) -> None:
    """Every flag of ``fedpartial run``, in the order ``--help`` shows them (``compare`` declares most of them
    again): the options of the methods ``shown`` if any (the answer to the question asked comes first), the
    flags of the command itself, then a group per section of :class:`RunConfig`, each flag generated from its
    field's description, with the method options after the method's section.  ``run``: made without
    argparse's ``--help`` (``add_help=False``), which is added here, after the methods' options; with it, the
    command's own flags go in its group.  ``specs``: the methods whose options become flags (default
    :func:`method_specs`); ``shown``: the methods whose options ``--help`` shows (default none: it says how to
    see a method's); ``brief``: the groups of :data:`BRIEF_GROUPS` list their flags only."""
    specs = method_specs() if specs is None else list(specs)
    shown = list(shown or ())
    if shown:
        method_option_flags(run, specs, shown)
    own = run
    if not run.add_help:
        own = run.add_argument_group(OPTIONS)
        own.add_argument("-h", "--help", action="help", help="show this help message and exit")
    own.add_argument("--help-all", action="help", help="show every flag with its help (--help lists the rarer "
                                                      "groups' flags only)")
    own.add_argument("--config", default=None, metavar="TOML",
                     help="read run flags from a TOML file (keys are these flags without --; the command line "
                          "overrides them)")
    own.add_argument("--quiet", action="store_true",
                     help="no progress and no summary table: print only the run directory")
    for name, (title, summary) in settings.SECTIONS.items():
        group = run.add_argument_group(title.lower(), summary[0].upper() + summary[1:])
        exclusive = {}
        for field in settings.fields(RunConfig, name):
            if not settings.flag_of(field):
                continue
            key = settings.described(field).exclusive
            if key is not None and key not in exclusive:
                exclusive[key] = group.add_mutually_exclusive_group()
            target = group if key is None else exclusive[key]
            _setting_flag(target, field)
        if name == "method" and not shown:
            method_option_flags(run, specs)
        if name == "data":
            _replica_flags(group)
        if name == "execution":
            _process_flags(run)
    runs = run.add_argument_group("checkpoints")
    runs.add_argument("--checkpoint-every", type=whole_number, default=None, metavar="N",
                      help="save the whole simulation state to RUN_DIR/checkpoints every N rounds "
                           "(the final state is always saved)")
    runs.add_argument("--resume", default=None, metavar="RUN_DIR",
                      help=RESUME_HELP)
    if brief:
        _shorten(run)


def _shorten(run: Parser) -> None:
    """The groups of :data:`BRIEF_GROUPS` name their flags in their description instead of a line each."""
    for group in run.groups:
        if group.title in BRIEF_GROUPS and group.actions:
            flags = [action.option_strings[0] for action in group.actions]
            for action in group.actions:
                action.help = argparse.SUPPRESS
            group.description = (f"{group.description.rstrip('.')}. Flags: {', '.join(flags)} "
                                 "(fedpartial run --help-all, or the Configuration reference page, says what "
                                 "each takes)")


def _replica_flags(group) -> None:
    """``--seeds``, ``--lrs``, ``--server-lrs``: replicas run as one simulation (not RunConfig fields)."""
    group.add_argument("--seeds", default=None, metavar="S,S,...",
                       help="one replica per seed, e.g. 0,1,2,3, run as one simulation (the fused round, jitted "
                            "once): a run folder per seed and a mean ± std summary (instead of --seed)")
    group.add_argument("--lrs", default=None, metavar="LR,LR,...",
                       help="one replica per client learning rate (with every seed of --seeds), e.g. 0.01,0.05,0.1, "
                            "run as one simulation like --seeds: a run folder each and a mean ± std row per rate "
                            "(instead of --lr)")
    group.add_argument("--server-lrs", default=None, metavar="LR,LR,...",
                       help="one replica per server learning rate (with every client rate of --lrs and every seed "
                            "of --seeds), e.g. 0.3,1.0, run as one simulation like --seeds: a run folder each and a "
                            "mean ± std row per rate (instead of --server-lr)")


def _process_flags(run) -> None:
    hosts = run.add_argument_group(
        "several processes", "multi-host: every process runs the same command with its own --process-id; the "
        "cohort is split over every process's devices (the Several processes page)")
    hosts.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                       help="address of process 0, for jax.distributed.initialize")
    hosts.add_argument("--num-processes", type=whole_number, default=None, metavar="P", help="processes in all")
    hosts.add_argument("--process-id", type=whole_number, default=None, metavar="I", help="this process, 0 to P-1")


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
    parser = Parser(add_help=False)
    add_run_flags(parser, specs=())
    return frozenset(s for action in parser.flags for s in action.option_strings)


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


def method_option_flags(parser: Parser, specs: Iterable[MethodSpec],
                        shown: Iterable[str] | None = None) -> None:
    """One flag per method option of ``specs`` (the methods' own descriptions), stored as ``option:FLAG``;
    ``--help`` shows those of the methods ``shown`` (none by default: it says how to see them).

    The one place where method flags are made: ``run`` passes :func:`method_specs`.
    """
    shown = set(shown or ())
    names = ", ".join(sorted(shown))
    group = parser.add_argument_group(
        f"options of {names}" if shown else "method options",
        "each method's own options, with their defaults" if shown else
        "each method has its own options: fedpartial run --method NAME --help shows them (or fedpartial list "
        "options NAME)")
    for flag, users in method_flag_users(specs).items():
        opt = users[0][1]
        metavar = flag.lstrip("-").upper().replace("-", "_")
        mine = [o for name, o in users if name in shown]
        if mine:
            opt = mine[0]
            text = opt.described()
        else:
            text = argparse.SUPPRESS  # another method's option: parsed (to refuse it by name), not shown
        if opt.type is boolean:  # a switch: --name / --no-name, no value
            group.add_argument(flag, dest=f"option:{flag}", action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=text)
            continue
        group.add_argument(flag, dest=f"option:{flag}", type=_option_type(opt), default=argparse.SUPPRESS,
                           metavar=metavar, help=text)


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
    """The :class:`RunConfig` of parsed ``run`` (or ``compare``) flags: each field from its flag."""
    refuse_flag_clashes([args.method])
    values = {}
    for field in settings.fields(RunConfig):
        flag = settings.flag_of(field)
        if flag:
            values[field.name] = getattr(args, flag[2:].replace("-", "_"))
    return RunConfig(**values, options=method_options(args))
