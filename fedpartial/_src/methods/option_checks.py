"""The checks an :class:`~fedpartial._src.methods.registry.Option` declares (ranges, choices, whole numbers,
probabilities, switches) and the parsers of option values; ``registry`` re-exports them.

Each check is ``check(value) -> None`` when the value is allowed, else the phrase saying what is allowed
(``"must be a number ≥ 0"``), which :class:`~fedpartial._src.methods.registry.Option` turns into the one
sentence a user reads.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Callable

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


def is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def shown(value) -> str:
    """A value as people type it on the command line: 3, 0.05, nan, inf, 'text', 0.2,0.4."""
    if isinstance(value, float):
        return f"{value:g}" if value.is_integer() and abs(value) < 1e15 else repr(value)
    if isinstance(value, (tuple, list)):
        return ",".join(shown(v) for v in value)
    return repr(value) if isinstance(value, str) else str(value)


@dataclasses.dataclass(frozen=True)
class Range:
    """A declarative check of an option's value (an ``Option``'s ``check``): a number (a whole one with
    ``integer``) from ``low`` to ``high``, either end open or unbounded (None).

    Args:
      value: called with a value, it returns None when the value is allowed, else the phrase saying what is
        (``"must be a number ≥ 0"``), which the option turns into the one sentence a user reads.
    """

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    integer: bool = False
    allowed: str = ""  # the phrase said when a value is refused (default: built from the bounds)

    def __call__(self, value) -> str | None:
        kind_ok = (isinstance(value, numbers.Integral) and not isinstance(value, bool)) if self.integer \
            else is_number(value)
        inside = kind_ok and (self.low is None or (value > self.low if self.low_open else value >= self.low)) \
            and (self.high is None or (value < self.high if self.high_open else value <= self.high))
        return None if inside else self.allowed or self.describe()

    def describe(self) -> str:
        what = "an integer" if self.integer else "a number"
        if self.low is not None and self.high is not None:
            return (f"must be {what} in {'(' if self.low_open else '['}{self.low:g}, "
                    f"{self.high:g}{')' if self.high_open else ']'}")
        if self.low is not None:
            return f"must be {what} {'>' if self.low_open else '≥'} {self.low}"
        if self.high is not None:
            return f"must be {what} {'<' if self.high_open else '≤'} {self.high}"
        return f"must be {what}"


@dataclasses.dataclass(frozen=True)
class OneOf:
    """A declarative check: the value is one of ``choices`` (also an ``Option``'s ``choices=``).

    Args:
      value: called with a value, it returns None when the value is one of ``choices``, else the phrase saying
        which are allowed.
    """

    choices: tuple

    def __call__(self, value) -> str | None:
        return None if value in self.choices else f"must be one of {', '.join(map(str, self.choices))}"


def at_least(low: float, allowed: str = "") -> Range:
    """A number ≥ ``low``.

    Args:
      low: the smallest value allowed.
      allowed: the phrase a refusal says instead of ``must be a number ≥ low``.
    """
    return Range(low, allowed=allowed)


def above(low: float, allowed: str = "") -> Range:
    """A number > ``low``.

    Args:
      low: the bound, itself not allowed.
      allowed: the phrase a refusal says instead of ``must be a number > low``.
    """
    return Range(low, low_open=True, allowed=allowed)


def between(low: float, high: float, *, low_open: bool = False, high_open: bool = False, allowed: str = "") -> Range:
    """A number from ``low`` to ``high``.

    Args:
      low: the lower end.
      high: the upper end.
      low_open: leave ``low`` itself out.
      high_open: leave ``high`` itself out.
      allowed: the phrase a refusal says instead of ``must be a number in [low, high]``.
    """
    return Range(low, high, low_open, high_open, allowed=allowed)


def whole_number(low: int = 0, allowed: str = "") -> Range:
    """An integer ≥ ``low``.

    Args:
      low: the smallest whole number allowed.
      allowed: the phrase a refusal says instead of ``must be an integer ≥ low``.
    """
    return Range(low, integer=True, allowed=allowed or f"must be an integer ≥ {low}")


def one_of(*choices) -> OneOf:
    """One of ``choices`` (said in the refusal: ``must be one of a, b``).

    Args:
      choices: the values allowed.
    """
    return OneOf(tuple(choices))


#: [0, 1]: a probability or a mixing weight
probability = between(0, 1)
#: (0, 1]: a fraction of something that must keep at least a part
in_unit_interval = between(0, 1, low_open=True)
#: [0, 1): a rate of dropping, pruning or momentum (all would leave nothing)
rate = between(0, 1, high_open=True)
#: 1, 2, 3, ...: a count of steps, layers or clients
positive_int = Range(1, integer=True, allowed="must be a positive integer")


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
    return None if isinstance(v, (tuple, list)) and len(v) and all(is_number(p) and 0 < p <= 1 for p in v) \
        else "must be keep ratios in (0, 1], e.g. 0.2,0.4,0.6,0.8,1.0"


def not_finite(value) -> bool:
    """A NaN or ±inf anywhere in ``value`` (a number or a sequence of them): every comparison with NaN is
    False, so a range check alone would let it through."""
    values = value if isinstance(value, (tuple, list)) else (value,)
    return any(is_number(v) and not math.isfinite(v) for v in values)
