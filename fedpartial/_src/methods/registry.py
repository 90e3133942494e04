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
from typing import Any, Callable

from fedpartial._src.core.types import Method
from fedpartial._src.core.errors import UserError
from fedpartial._src.methods.option_checks import (  # noqa: F401  (re-exported: the checks options declare)
    Check,
    OneOf,
    Range,
    not_finite,
    is_number,
    above,
    at_least,
    between,
    boolean,
    in_unit_interval,
    is_boolean,
    one_of,
    positive_int,
    probability,
    rate,
    ratios,
    ratios_in_unit_interval,
    shown,
    whole_number,
)

@dataclasses.dataclass(frozen=True)
class Option:
    """One option of a method.

    Attributes:
      name: the factory's keyword argument.
      type: parses a command-line string (``float``, ``int``, ``ratios``); ``boolean`` makes
        the option a switch (``--name`` / ``--no-name``, no value).
      default: the factory's default.
      help: one line for ``--help``.
      check: validates a value (see ``Check``): a declarative ``Range`` (``at_least``,
        ``between``, ``probability``, ``positive_int``, ...), ``one_of``, or any function
        of your own; None: anything the type parses.
      flag: the command-line flag (default ``--name`` with ``_`` → ``-``); methods
        that share a flag (e.g. ``--tiers``) must agree on its type and default.
      choices: the values allowed, when they are few (said in ``--help``; checked as ``one_of``).

    :meth:`problem` is the one place an option's value is judged: NaN and ±inf are never allowed, a
    ``None`` default stays allowed (the option left unset), then ``choices`` and ``check`` decide.
    """

    name: str
    type: Callable[[str], Any]
    default: Any
    help: str
    check: Check | None = None
    flag: str | None = None
    choices: tuple | None = None

    def described(self) -> str:
        """Its help as ``--help`` and ``fedpartial list`` show it: the help, the choices, and the default unless
        the help already says it."""
        choices = f"; one of {', '.join(map(str, self.choices))}" if self.choices else ""
        if "default" in self.help:
            return f"{self.help}{choices}"
        default = ",".join(map(str, self.default)) if isinstance(self.default, tuple) else self.default
        return f"{self.help}{choices} (default: {'none' if default is None else default})"

    @property
    def cli_flag(self) -> str:
        """The option's flag of ``fedpartial run``: ``flag``, or ``--`` and its name with ``-`` for ``_``."""
        return self.flag or "--" + self.name.replace("_", "-")

    def problem(self, value) -> str | None:
        """None when ``value`` is allowed, else the phrase saying what is (``must be ...``)."""
        if value is None and self.default is None:
            return None
        if not_finite(value):
            return "must be finite numbers" if isinstance(value, (tuple, list)) else "must be a finite number"
        if self.choices is not None and (found := OneOf(tuple(self.choices))(value)):
            return found
        return self.check(value) if self.check else None

    def refusal(self, value, method: str, *, typed: bool = False) -> str | None:
        """The one sentence refusing ``value`` for ``method`` (None when allowed); ``typed``: as the command
        line says it, the flag followed by the value as typed."""
        problem = self.problem(value)
        if problem is None:
            return None
        if typed:  # a NaN is wrong for any method: the sentence does not name one
            scope = "" if not_finite(value) else f" for {method}"
            return f"{self.cli_flag} {shown(value)} is not allowed{scope}: it {problem}."
        return f"{method}: {self.cli_flag} = {value!r} {problem}."


def check_values(method: str, options: tuple[Option, ...], **values) -> None:
    """Raises :class:`UserError` for the first of ``values`` its option refuses: a factory called directly (not
    through :meth:`MethodSpec.build`) checks its arguments with the options that describe them."""
    by_name = {o.name: o for o in options}
    for name, value in values.items():
        refusal = by_name[name].refusal(value, method)
        if refusal:
            raise UserError(refusal)


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """A registered method: ``build(**options)`` checks the options and calls ``factory``.

    ``run_settings`` names settings of the run (fields of
    :class:`~fedpartial.RunConfig`) that the factory also takes as keyword
    arguments — e.g. FedNova's ``momentum``, which must be the clients' optimizer's.
    They are not options (no flag of their own): ``RunConfig.build_method`` passes the
    run's values, and ``build`` / :func:`~fedpartial.methods.get_method` leave the
    factory's defaults.

    Attributes:
      name: the ``--method`` name.
      factory: the function that builds the :class:`~fedpartial.Method` from the options.
      summary: one line for ``fedpartial list methods``.
      options: the method's :class:`Option` s (its flags).
      run_settings: the run's settings the factory also takes (see above).

    Examples:
      >>> from fedpartial.methods import METHODS
      >>> METHODS["fedldf"].build(n=4).name
      'fedldf'
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

    def check(self, options: dict, *, typed: bool = False) -> dict:
        """Every option of this method, given values checked (:meth:`Option.problem`) and the others at their
        defaults; ``typed``: a refusal names the flag and value as the command line does."""
        out = {}
        for name, value in options.items():
            opt = self.option(name)
            refusal = opt.refusal(value, self.name, typed=typed)
            if refusal:
                raise UserError(refusal)
            out[name] = value
        return {**{o.name: o.default for o in self.options}, **out}

    def build(self, **options) -> Method:
        return self.factory(**self.check(options))
