"""Methods that describe themselves: name, factory, options (type, default, check, help).

The command line builds one flag per option from these descriptions and the
simulation validates a run's options with them, so neither holds a per-method
table.  A method module declares its :class:`MethodSpec` next to its factory;
:data:`fedpartial.methods.METHODS` collects them.

Example::

    from fedpartial._src.methods.registry import MethodSpec, Option, at_least

    SPEC = MethodSpec("fedprox", fedprox, "FedAvg plus a proximal term μ/2·||w − w_global||².",
                      options=(Option("mu", float, 0.01, "proximal coefficient μ", at_least(0.0)),))
    method = SPEC.build(mu=0.1)      # checks 0.1, fills the defaults, calls fedprox(mu=0.1)
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Callable

from fedpartial._src.core.types import Method
from fedpartial._src.core.errors import UserError

#: ``check(value) -> None`` when allowed, else the phrase saying what is allowed
Check = Callable[[Any], "str | None"]


def ratios(text: str | Any) -> tuple[float, ...]:
    """Parses ``'0.2,0.4'`` (or passes a sequence through) into a tuple of floats."""
    if isinstance(text, str):
        try:
            return tuple(float(t) for t in text.split(","))
        except ValueError:
            raise UserError(f"{text!r} is not a comma-separated list of numbers.") from None
    return tuple(float(t) for t in text)


def _number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def at_least(low: float) -> Check:
    return lambda v: None if _number(v) and v >= low else f"must be a number ≥ {low}"


def in_unit_interval(v) -> str | None:
    """(0, 1]."""
    return None if _number(v) and 0 < v <= 1 else "must be a number in (0, 1]"


def positive_int(v) -> str | None:
    return None if isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 1 \
        else "must be a positive integer"


def boolean(text: str | bool) -> bool:
    """Parses a switch: a bool passes through, text ``true``/``false`` (also ``yes``/``no``, ``on``/``off``,
    ``1``/``0``) is read.  On the command line an option of this type is the flag pair ``--name`` / ``--no-name``."""
    if isinstance(text, bool):
        return text
    word = str(text).strip().lower()
    if word in ("true", "yes", "on", "1"):
        return True
    if word in ("false", "no", "off", "0"):
        return False
    raise UserError(f"{text!r} is not true or false.")


def is_boolean(v) -> str | None:
    return None if isinstance(v, bool) else "must be True or False"


def ratios_in_unit_interval(v) -> str | None:
    return None if len(v) and all(_number(p) and 0 < p <= 1 for p in v) \
        else "must be keep ratios in (0, 1], e.g. 0.2,0.4,0.6,0.8,1.0"


@dataclasses.dataclass(frozen=True)
class Option:
    """One option of a method.

    Attributes:
      name: the factory's keyword argument.
      type: parses a command-line string (``float``, ``int``, :func:`ratios`); :func:`boolean` makes
        the option a switch (``--name`` / ``--no-name``, no value).
      default: the factory's default.
      help: one line for ``--help``.
      check: validates a value (see :data:`Check`); None: anything the type parses.
      flag: the command-line flag (default ``--name`` with ``_`` → ``-``); methods
        that share a flag (e.g. ``--tiers``) must agree on its type and default.
    """

    name: str
    type: Callable[[str], Any]
    default: Any
    help: str
    check: Check | None = None
    flag: str | None = None

    @property
    def cli_flag(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """A registered method: ``build(**options)`` checks the options and calls ``factory``.

    ``run_settings`` names settings of the run (fields of
    :class:`fedpartial._src.experiment.simulation.RunConfig`) that the factory also takes as keyword
    arguments — e.g. FedNova's ``momentum``, which must be the clients' optimizer's.
    They are not options (no flag of their own): ``RunConfig.build_method`` passes the
    run's values, and ``build`` / :func:`~fedpartial.methods.get_method` leave the
    factory's defaults.
    """

    name: str
    factory: Callable[..., Method]
    summary: str
    options: tuple[Option, ...] = ()
    run_settings: tuple[str, ...] = ()

    def option(self, name: str) -> Option:
        for opt in self.options:
            if opt.name == name:
                return opt
        known = ", ".join(o.name for o in self.options) or "none"
        raise UserError(f"method {self.name!r} has no option {name!r} (its options: {known}).")

    def check(self, options: dict) -> dict:
        """Every option of this method, given values checked and the others at their defaults."""
        out = {}
        for name, value in options.items():
            opt = self.option(name)
            problem = opt.check(value) if opt.check else None
            if problem:
                raise UserError(f"{self.name}: {opt.cli_flag} = {value!r} {problem}.")
            out[name] = value
        return {**{o.name: o.default for o in self.options}, **out}

    def build(self, **options) -> Method:
        return self.factory(**self.check(options))
