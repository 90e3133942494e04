"""What a run setting is: its section, meaning, unit, default and command-line flag, said once.

Every field of :class:`~fedpartial.RunConfig` is declared with :func:`setting`, so one description
feeds the class's documentation (``help(fp.RunConfig)``), the flags of ``fedpartial run`` and their
``--help`` (:mod:`fedpartial._src.cli.flags` builds them from :func:`fields`), the keys of a ``--config``
TOML file (the flags without ``--``), the sentences that refuse a bad value (they name the flag:
:func:`flag_of`), and the configuration reference page ``docs/configuration.md``
(:func:`reference_markdown`; a test keeps the page equal to it).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterable
from typing import NamedTuple

import numpy as np

from fedpartial._src.core.errors import UserError

#: the sections of a run's settings, in the order the documentation and ``--help`` show them: title, summary
SECTIONS = {
    "data": ("Data and population", "which data, how it is split over the clients, and the seed of every "
                                    "random choice"),
    "model": ("Model", "the network every client trains"),
    "training": ("Local training", "what each client does with its data in a round"),
    "method": ("Method", "the federated method, its options and the wrappers around it"),
    "server": ("Server", "how many rounds, and how the server applies the round's aggregate"),
    "privacy": ("Differential privacy", "DP-FedAvg around the method (the Differential privacy page); off unless --dp-clip is "
                                        "given"),
    "time": ("Simulated time: devices, deadlines and availability",
             "the device model that gives each client its simulated time (the Device time and FLOPs page), "
             "deadlines, stragglers and who may be sampled (the Deadlines and availability page); deadlines are off by default"),
    "async": ("Asynchronous aggregation", "C clients in flight, the server steps on every M arrivals "
                                          "(the Asynchronous aggregation page); off by default"),
    "execution": ("Execution", "how the round runs on this machine: the strategy, where data and per-client state "
                               "live, and how many devices; none of these change what is computed"),
    "output": ("Evaluation and output", "how often the model is tested, and what is written where"),
}


class ConfigError(UserError):
    """An invalid run configuration; the message is one sentence for a person."""


def is_int(value) -> bool:
    """Whether a setting's value is a whole number (numpy's too; never a bool)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def is_finite(value) -> bool:
    """Whether a setting's value is a finite number (numpy's too; never a bool, NaN or ±inf)."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool) \
        and math.isfinite(value)


class Allowed(NamedTuple):
    """The values a number setting takes, declared with the setting (:func:`setting`'s ``allowed``): ``test`` on
    the value, said as ``says`` in the refusal; ``whole``: whole numbers only (else finite numbers)."""

    test: Callable[[float], bool]
    says: str
    whole: bool = False

    def refusal(self, value, optional: bool) -> str | None:
        """What ``value`` must be when it is not allowed, else None (None is allowed where ``optional``)."""
        if value is None and optional:
            return None
        if self.whole:
            return None if is_int(value) and self.test(value) else self.says
        return None if is_finite(value) and self.test(value) else f"a finite number {self.says}"


def whole(low: int) -> Allowed:
    """Whole numbers from ``low``."""
    return Allowed(lambda v: v >= low, f"a whole number ≥ {low}", whole=True)


def finite(test: Callable[[float], bool], says: str) -> Allowed:
    """Finite numbers that pass ``test`` (NaN and ±inf never do), said as ``says`` (``"> 0"``)."""
    return Allowed(test, says)


#: the ranges most number settings take
POSITIVE, NON_NEGATIVE = finite(lambda v: v > 0, "> 0"), finite(lambda v: v >= 0, "≥ 0")
IN_OPEN_UNIT, COUNT = finite(lambda v: 0 < v < 1, "in (0, 1)"), whole(1)


@dataclasses.dataclass(frozen=True)
class Setting:
    """The description of one :class:`~fedpartial.RunConfig` field.

    Attributes:
      section: one of :data:`SECTIONS`.
      help: what the setting means, one phrase (shown by ``--help`` and the reference page).
      unit: the unit of a quantity (``seconds``, ``bytes/s``), or None.
      flag: its command-line flag; None: ``--`` and the field's name with ``-`` for ``_``; ``""``: no flag.
      metavar: how ``--help`` names the value (None: argparse's default).
      default_text: the default in words, where the field's value alone would mislead (None: the value).
      exclusive: fields sharing this name are mutually exclusive on the command line.
      allowed: the values a number setting takes (:class:`Allowed`), checked by ``RunConfig.validate``; None: its
        checks are of a kind a range cannot say (names, combinations).
    """

    section: str
    help: str
    unit: str | None = None
    flag: str | None = None
    metavar: str | None = None
    default_text: str | None = None
    exclusive: str | None = None
    allowed: Allowed | None = None


def setting(default=dataclasses.MISSING, *, section: str, help: str, factory=dataclasses.MISSING, **described):
    """A :class:`~fedpartial.RunConfig` field described by a :class:`Setting` (``described``: its other
    attributes); ``factory`` for a mutable default."""
    if section not in SECTIONS:
        raise ValueError(f"unknown settings section {section!r}; sections are {', '.join(SECTIONS)}")
    meta = {"setting": Setting(section=section, help=help, **described)}
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def described(field: dataclasses.Field) -> Setting:
    """The field's :class:`Setting`."""
    return field.metadata["setting"]


def fields(cls, section: str | None = None) -> list[dataclasses.Field]:
    """The described fields of the dataclass ``cls`` (of one ``section``), in declaration order."""
    return [f for f in dataclasses.fields(cls) if "setting" in f.metadata
            and (section is None or described(f).section == section)]


def flag_of(field: dataclasses.Field | str, cls=None) -> str:
    """The command-line flag of a field (by object, or by name with its class): what messages name."""
    if isinstance(field, str):
        found = {f.name: f for f in dataclasses.fields(cls)} if cls is not None else {}
        if field not in found:
            return "--" + field.replace("_", "-")
        field = found[field]
    flag = described(field).flag
    return "--" + field.name.replace("_", "-") if flag is None else flag


def kind(field: dataclasses.Field) -> str:
    """What the field takes: ``int``, ``float``, ``bool``, ``str`` or ``dict`` (from its annotation)."""
    annotation = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
    base = annotation.replace(" ", "").replace("|None", "").replace("None|", "")
    if base not in ("int", "float", "bool", "str", "dict"):
        raise TypeError(f"RunConfig field {field.name} has annotation {annotation!r}; settings take int, float, "
                        "bool, str or dict")
    return base


def default_text(field: dataclasses.Field) -> str:
    """The field's default as the documentation says it."""
    text = described(field).default_text
    if text is not None:
        return text
    value = field.default if field.default is not dataclasses.MISSING else field.default_factory()
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value) if value != {} else "{}"


_KIND_WORDS = {"int": "a whole number", "float": "a number", "bool": "a switch", "str": "text",
               "dict": "a mapping"}


def attributes_doc(cls) -> str:
    """A Google-style ``Attributes:`` section of every described field, section by section (for ``help()`` and
    the API reference; the sections' titles are on the configuration page)."""
    lines = ["Attributes:"]
    for name in SECTIONS:
        for f in fields(cls, name):
            s = described(f)
            unit = f" [{s.unit}]" if s.unit else ""
            flag = f"; flag {flag_of(f)}" if flag_of(f) else ""
            lines.append(f"  {f.name}: {s.help}{unit} (default {default_text(f)}{flag}).")
    return "\n".join(lines)


# In a setting's words (written for ``--help``, so plain text): a flag, a ``fedpartial list|run`` command, and an
# environment variable, home path or import string, which a documentation page shows as code.
_COMMAND = re.compile(r"fedpartial list [a-z]+|fedpartial run(?: --[\w-]+(?: [A-Z]+)?)+")
_FLAG = re.compile(r"(?<![\w`-])--[a-z][\w-]*[a-z0-9]")
_PATHLIKE = re.compile(r"(?<![\w`])(?:\$[A-Z_]+|~)(?:/[\w.-]+)*|\bpackage\.module:[a-z]+")


def code_marked(text: str) -> str:
    """A setting's plain words as Markdown: its flags, commands and paths as code spans."""
    parts = _COMMAND.sub(lambda m: f"`{m.group(0)}`", text).split("`")  # odd parts are code already
    for i in range(0, len(parts), 2):
        parts[i] = _PATHLIKE.sub(lambda m: f"`{m.group(0)}`", _FLAG.sub(lambda m: f"`{m.group(0)}`", parts[i]))
    return "`".join(parts)


def _cell(text: str) -> str:
    return code_marked(text).replace("|", "\\|").replace("\n", " ")


def reference_markdown(cls, method_specs: Iterable = ()) -> str:
    """The configuration reference page: a table per section (field, flag, meaning, unit, default), then the
    options of each method of ``method_specs``."""
    out = ["# Configuration reference", "",
           "<!-- generated by python -m fedpartial._src.experiment.config, written to docs/configuration.md; "
           "a test keeps this page equal to the code -->", "",
           "Every setting of a run, by section. Each is a field of `fedpartial.RunConfig` (its Python name), "
           "a flag of `fedpartial run` (and `fedpartial compare`, except the per-run ones), and a key of a "
           "`--config` TOML file (the flag without `--`; `-` and `_` alike). A method's own options are flags "
           "too (below); in Python they go in `RunConfig(options={...})` under the option's name.", ""]
    for name, (title, summary) in SECTIONS.items():
        group = fields(cls, name)
        out += [f"## {title}", "", summary[0].upper() + summary[1:] + ".", "",
                "| field | flag | meaning | unit | default |", "|---|---|---|---|---|"]
        for f in group:
            s = described(f)
            flag = f"`{flag_of(f)}`" if flag_of(f) else "(in Python only)"
            meaning = f"{s.help} ({_KIND_WORDS[kind(f)]})" if s.allowed is None else \
                f"{s.help}: {s.allowed.says if s.allowed.whole else _KIND_WORDS[kind(f)] + ' ' + s.allowed.says}"
            out.append(f"| `{f.name}` | {flag} | {_cell(meaning)} | {s.unit or ''} | "
                       f"{_cell(default_text(f))} |")
        out.append("")
    specs = [s for s in method_specs if s.options]
    if specs:
        out += ["## Method options", "",
                "Each applies to the methods named; `fedpartial run --method NAME --help` and "
                "`fedpartial list options NAME` show one method's.", "",
                "| method | flag | meaning | default |", "|---|---|---|---|"]
        for spec in specs:
            for opt in spec.options:
                default = ",".join(map(str, opt.default)) if isinstance(opt.default, tuple) else opt.default
                choices = f" (one of {', '.join(map(str, opt.choices))})" if opt.choices else ""
                out.append(f"| `{spec.name}` | `{opt.cli_flag}` | {_cell(opt.help)}{choices} | "
                           f"{_cell(str('none' if default is None else default))} |")
        out.append("")
    return "\n".join(out)


def optional(field: dataclasses.Field) -> bool:
    """Whether the field takes None (``int | None``)."""
    return "None" in (field.type if isinstance(field.type, str) else str(field.type))
