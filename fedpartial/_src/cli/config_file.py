"""``fedpartial run --config FILE.toml``: run flags read from a TOML file, merged under the command line.

A run config file::

    # exp.toml: every key is a flag of `fedpartial run`, without the leading --
    method = "fedldf"
    dataset = "digits"
    rounds = 20
    lr = 0.05
    local-steps = 5        # or local_steps: - and _ are the same in keys
    n = 4                  # a method option is a flag like any other (here FedLDF's --n)
    es = true              # a switch is true / false

Decisions taken (issue 13):

* **One flat scheme.**  Keys are the long flags of ``fedpartial run`` as typed on the command line
  (``clients``, not the field name ``num_clients``), method options included (``n``, ``mu``, ``tiers``);
  there are no tables.  ``config`` and ``resume`` cannot be set from a file.  Flags given on the command
  line win over the file; giving one of two exclusive flags there (``--local-steps`` / ``--local-epochs``)
  drops the other from the file.
* **Types are strict.**  Whole-number flags take TOML integers; number flags integers or floats
  (``nan``/``inf`` parse, and are refused by :meth:`RunConfig.validate` like on the command line);
  switches take ``true``/``false``; text flags take strings; list-valued method options take a string
  ``"0.2,0.4"`` or an array ``[0.2, 0.4]``.  Every refusal is one sentence naming the file and the key,
  e.g. ``exp.toml: lr = nan is not allowed: it must be a finite number > 0.`` (:func:`attribute` rewrites
  :meth:`RunConfig.validate`'s messages, which name flags, for values that came from the file).

The flags are the ``run`` parser's own argparse actions, as its record lists them
(:class:`fedpartial._src.cli.flags.Parser`), so a file takes exactly what the command line takes.  A run
directory's ``config.toml`` is such a file (:func:`fedpartial._src.experiment.records.to_toml`).
"""

from __future__ import annotations

import argparse
import difflib
import re
import tomllib
from typing import TYPE_CHECKING

from fedpartial._src.core.errors import UserError

if TYPE_CHECKING:
    from fedpartial._src.cli.flags import Parser

#: flags a config file cannot set
_NOT_IN_FILES = ("config", "resume")
#: what each kind of flag takes, for messages
_KINDS = {
    "integer": "a whole number",
    "number": "a number",
    "boolean": "true or false",
    "text": "a string",
    "list": "a string or an array, e.g. \"0.2,0.4\" or [0.2, 0.4]",
}


def toml_kind(action: argparse.Action) -> str:
    """What a run flag takes in a TOML file: integer, number, boolean, text or list.

    A flag's ``type`` function may say so in its ``toml_kind`` attribute (the command line's parsers do);
    a flag without a ``type`` takes text, a switch a boolean.
    """
    if action.nargs == 0:  # store_true / BooleanOptionalAction: no value on the command line
        return "boolean"
    return getattr(action.type, "toml_kind", "text")


def _key(flag: str) -> str:
    return flag[2:]


def _shown(value) -> str:
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_shown(v) for v in value) + "]"
    return str(value)


def read_toml(path: str) -> dict:
    """The TOML file's top level; one sentence (:class:`UserError`) when it is missing, unreadable or invalid."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise UserError(f"--config {path!r} does not exist; give a TOML file of run flags.") from None
    except IsADirectoryError:
        raise UserError(f"--config {path!r} is a directory; give a TOML file of run flags.") from None
    except OSError as e:
        raise UserError(f"--config {path!r} cannot be read ({e.strerror or e}).") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"--config {path!r} is not valid TOML: {str(e).rstrip('.')}.") from None
    except UnicodeDecodeError:
        raise UserError(f"--config {path!r} is not valid TOML: it is not UTF-8 text.") from None


def file_values(path: str, parser: Parser) -> dict[str, tuple[str, object]]:
    """The file's values as ``{dest: (key, value)}`` of ``parser``'s flags, each parsed as on the command line.

    Raises :class:`UserError` (one sentence naming the file and key) for an unknown key, a table, a value
    of the wrong type, or a value the flag's own parser refuses.
    """
    actions = {_key(s): a for a in parser.flags for s in a.option_strings if s.startswith("--")}
    allowed = sorted(k for k in actions if k not in _NOT_IN_FILES and k not in ("help",))
    values: dict[str, tuple[str, object]] = {}
    for key, value in read_toml(path).items():
        if isinstance(value, dict):
            raise UserError(f"{path}: [{key}] is a table, which run configs do not use; write every key at the "
                            "top level (method options too, e.g. n = 4).")
        flag = key.replace("_", "-")
        action = actions.get(flag)
        if action is None or flag in _NOT_IN_FILES or flag == "help":
            from fedpartial._src.experiment import settings
            from fedpartial._src.experiment.config import RunConfig

            own = {f.name: settings.flag_of(f)[2:] for f in settings.fields(RunConfig)}.get(key)  # num_clients
            near = [own] if own in allowed else difflib.get_close_matches(flag, allowed, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else "; keys are the flags of fedpartial run without --"
            if flag in _NOT_IN_FILES:
                hint = f"; give --{flag} on the command line"
            raise UserError(f"{path}: key {key!r} is not a run setting{hint}.")
        if isinstance(action, argparse.BooleanOptionalAction) and flag.startswith("no-"):
            raise UserError(f"{path}: key {key!r} is not a run setting; write {flag[3:]} = false instead.")
        kind = toml_kind(action)
        wrong = f"{path}: {key} = {_shown(value) if not isinstance(value, dict) else '[table]'} is not allowed: " \
                f"it must be {_KINDS[kind]}."
        if kind == "boolean":
            if not isinstance(value, bool):
                raise UserError(wrong)
            values[action.dest] = (key, value)
            continue
        if kind == "integer" and not (isinstance(value, int) and not isinstance(value, bool)):
            raise UserError(wrong)
        if kind == "number" and not (isinstance(value, (int, float)) and not isinstance(value, bool)):
            raise UserError(wrong)
        if kind == "text" and not isinstance(value, str):
            raise UserError(wrong)
        if kind == "list":
            if isinstance(value, list) and value and all(
                    isinstance(v, (int, float, str)) and not isinstance(v, bool) for v in value):
                value = ",".join(map(str, value))
            elif not isinstance(value, str):
                raise UserError(wrong)
        text = str(value)
        if action.type is not None:
            try:
                text = action.type(text)
            except (argparse.ArgumentTypeError, ValueError, TypeError, UserError) as e:
                reason = str(e).split(" is not allowed: ", 1)[-1].rstrip(".")
                raise UserError(f"{path}: {key} = {_shown(value)} is not allowed: {reason}.") from None
        if action.choices is not None and text not in action.choices:
            raise UserError(f"{path}: {key} = {_shown(value)} is not allowed: it must be one of "
                            f"{', '.join(map(str, action.choices))}.")
        values[action.dest] = (key, text)
    return values


class _Unset(list):
    """The value of a flag not given: a list, so that a flag that appends (compare's ``--option``) adds to a
    copy of it, which is then not :data:`_UNSET`."""

    def __repr__(self):
        return "<unset>"


_UNSET = _Unset()


def given_on_command_line(parser: Parser, argv: list[str]) -> set[str]:
    """The dests of ``parser``'s flags that ``argv`` gives (``parser`` is left as it was)."""
    # argparse fills in a default only where the namespace has no value yet
    unset = argparse.Namespace(**{a.dest: _UNSET for a in parser.flags if a.option_strings})
    args = parser.parse_args(argv, namespace=unset)
    return {dest for dest, value in vars(args).items() if value is not _UNSET}


def merge(args: argparse.Namespace, parser: Parser, argv: list[str], path: str) -> dict[str, str]:
    """Fills ``args`` (parsed from ``argv`` by ``parser``) with the config file's values where the command
    line gave none; returns ``{flag: key}`` of the values taken from the file (see :func:`attribute`)."""
    values = file_values(path, parser)
    given = given_on_command_line(parser, argv)
    for group in parser.exclusive:  # the command line's choice wins the whole group
        dests = {a.dest for a in group.actions}
        if dests & given:
            given |= dests
    taken = {}
    for dest, (key, value) in values.items():
        if dest in given:
            continue
        setattr(args, dest, value)
        taken[parser.flag(dest).option_strings[0]] = key
    return taken


def attribute(message: str, taken: dict[str, str], path: str) -> str:
    """A message naming flags, rewritten to name the file's keys for the values that came from the file:
    ``--lr nan is not allowed: …`` → ``exp.toml: lr = nan is not allowed: …``; unchanged otherwise."""
    for flag, key in taken.items():
        rest = message[len(flag) + 1:]
        if message.startswith(flag + " ") and re.match(r"\S+ (is|must|needs|cannot)\b", rest):
            return f"{path}: {key} = {rest}"
    named = [key for flag, key in taken.items() if re.search(re.escape(flag) + r"(?![\w-])", message)]
    if named:
        return f"{message.rstrip('.')} ({', '.join(named)} set in {path})."
    return message

