"""Which clients may be sampled at a moment of the simulated clock (``--availability``, docs/deadlines.md).

Four models, all host numpy ``[N]`` and seeded (a round's draw depends on the run's seed, the round and the
clock only, so a resumed run draws the same clients):

* ``always``: every client, every round (the default; nothing is drawn).
* a probability ``p`` in (0, 1]: each client is available in a round with probability ``p``, independently
  of the others and of other rounds.
* ``diurnal[:LOW:HIGH[:PERIOD_S]]``: client ``i`` is available with probability
  ``p_i(t) = LOW + (HIGH − LOW) · (1 + cos(2π (t − φ_i) / PERIOD)) / 2`` at clock ``t``: a sinusoid of the
  simulated clock with its peak at the client's phase ``φ_i``, drawn once per run from a normal distribution
  around ``t = 0`` with a standard deviation of ``PERIOD / 6`` (time zones and habits spread the peaks by about
  4 hours of a day).  Defaults: ``LOW`` 0.1, ``HIGH`` 0.9, ``PERIOD`` 86,400 s (a day); the clock starts at the
  population's mean peak.  Each round draws who is available from these probabilities.
* a CSV trace (columns ``client_id,start_s,end_s``, as FedScale's traces): client ``client_id`` is available
  at clock ``t`` when ``start_s ≤ t < end_s`` for one of its rows; a client without rows never is.  Rows of ids
  outside the population (``≥ N``) are ignored, so a large trace serves a smaller population.

When no client may be sampled at a round's start the server waits: until the next interval of the trace
opens (:meth:`Availability.next_start`; none left ends the run), or, for the drawn models, it asks again
:data:`POLL_S` simulated seconds later (a fresh draw; diurnal: a minute of its period's day, ``PERIOD / 1440``).
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import numpy as np

from fedpartial._src.core.errors import UserError
from fedpartial._src.costs import devices

#: simulated seconds the server waits before it draws availability again when nobody was available
POLL_S = 60.0
DIURNAL_DEFAULTS = (0.1, 0.9, 86_400.0)  # LOW, HIGH, PERIOD_S
TRACE_COLUMNS = ("client_id", "start_s", "end_s")
ALLOWED = ("always, a probability in (0, 1], diurnal[:LOW:HIGH[:PERIOD_S]] or a CSV file with the columns "
           "client_id,start_s,end_s")


class Trace(NamedTuple):
    """Available intervals, host numpy, one row each: client ``client[r]`` from ``start[r]`` to ``end[r]``."""

    client: np.ndarray  # int64
    start: np.ndarray  # float64 seconds
    end: np.ndarray


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def parse(text) -> tuple[str, tuple]:
    """``(kind, parameters)`` of an ``--availability`` value: ``("always", ())``, ``("probability", (p,))``,
    ``("diurnal", (low, high, period_s))`` or ``("trace", (path,))``; the file is not read here.

    Raises:
      UserError: one sentence naming the value and what is allowed.
    """
    if not isinstance(text, str) or not text.strip():
        raise UserError(f"--availability {text!r} is not allowed: it must be {ALLOWED}.")
    text = text.strip()
    if text == "always":
        return "always", ()
    value = _number(text)
    if value is not None:
        if not (math.isfinite(value) and 0 < value <= 1):
            raise UserError(f"--availability {text} is not allowed: a probability must be in (0, 1].")
        return "probability", (value,)
    if text == "diurnal" or text.startswith("diurnal:"):
        parts = text.split(":")[1:]
        values = [_number(p) for p in parts]
        if len(parts) not in (0, 2, 3) or any(v is None or not math.isfinite(v) for v in values):
            raise UserError(f"--availability {text!r} is not allowed: write diurnal, diurnal:LOW:HIGH or "
                            "diurnal:LOW:HIGH:PERIOD_S with numbers.")
        low, high, period = (values + list(DIURNAL_DEFAULTS[len(values):])) if values else DIURNAL_DEFAULTS
        if not (0 <= low <= high <= 1 and high > 0 and period > 0):
            raise UserError(f"--availability {text!r} is not allowed: it needs 0 ≤ LOW ≤ HIGH ≤ 1, HIGH > 0 and "
                            "PERIOD_S > 0.")
        return "diurnal", (float(low), float(high), float(period))
    if not os.path.exists(text):
        raise UserError(f"--availability {text!r} is not allowed: it must be {ALLOWED} (no such file).")
    return "trace", (text,)


def load_trace(path: str) -> Trace:
    """The intervals of a CSV trace (header ``client_id,start_s,end_s`` in any order; other columns ignored).

    Raises:
      UserError: one sentence naming the file (and the row, counted from 1 after the header): it cannot be
        read, lacks a column or has no rows, or a row's id is not a whole number ≥ 0 or its times are not
        finite numbers with ``0 ≤ start_s < end_s``.
    """
    clients, starts, ends = [], [], []
    for i, texts in enumerate(devices.read_csv_columns(path, TRACE_COLUMNS, "availability trace"), start=1):
        client, start, end = (_number(t) for t in texts)
        if client is None or not math.isfinite(client) or client < 0 or client != int(client):
            raise UserError(f"availability trace {path}: row {i} has client_id = {texts[0]!r}, which must "
                            "be a whole number ≥ 0.")
        if start is None or end is None or not (math.isfinite(start) and math.isfinite(end)) or not 0 <= start < end:
            raise UserError(f"availability trace {path}: row {i} has start_s = {texts[1]!r} and end_s = "
                            f"{texts[2]!r}, which must be finite numbers with 0 ≤ start_s < end_s.")
        clients.append(int(client))
        starts.append(start)
        ends.append(end)
    if not clients:
        raise UserError(f"availability trace {path} has no rows; give at least one interval.")
    return Trace(np.asarray(clients, np.int64), np.asarray(starts, np.float64), np.asarray(ends, np.float64))


def diurnal_phases(num_clients: int, seed: int, period_s: float) -> np.ndarray:
    """``[N]`` each client's peak time ``φ_i`` in seconds: normal around 0 with std ``period_s / 6``."""
    return np.random.default_rng([seed, 0xD1A1]).normal(0.0, period_s / 6, num_clients)


def diurnal_probability(clock_s: float, phases: np.ndarray, low: float, high: float, period_s: float) -> np.ndarray:
    """``[N]`` ``p_i(t) = low + (high − low) · (1 + cos(2π (t − φ_i) / period)) / 2``."""
    return low + (high - low) * (1 + np.cos(2 * np.pi * (clock_s - phases) / period_s)) / 2


def drawn(probability, num_clients: int, seed: int, round: int, attempt: int) -> np.ndarray:
    """``[N]`` who is available: each client with its ``probability`` (a number or ``[N]``), from the stream
    ``(seed, round, attempt)`` (attempt: the server's polls within the round's wait)."""
    return np.random.default_rng([seed, 0xA7A1, round, attempt]).random(num_clients) < probability


def in_trace(trace: Trace, num_clients: int, clock_s: float) -> np.ndarray:
    """``[N]`` who is inside one of their intervals at ``clock_s`` (ids ``≥ N`` ignored)."""
    available = np.zeros(num_clients, bool)
    open_ = (trace.start <= clock_s) & (clock_s < trace.end) & (trace.client < num_clients)
    available[trace.client[open_]] = True
    return available


class Availability:
    """A run's availability model (``--availability``) over a population of ``num_clients``."""

    def __init__(self, text: str, num_clients: int, seed: int):
        self.kind, self.params = parse(text)
        self.num_clients, self.seed = num_clients, seed
        if self.kind == "trace":
            self.trace = load_trace(self.params[0])
        if self.kind == "diurnal":
            self.phases = diurnal_phases(num_clients, seed, self.params[2])

    @property
    def always(self) -> bool:
        return self.kind == "always"

    def available(self, clock_s: float, round: int, attempt: int = 0) -> np.ndarray:
        """``[N]`` who may be sampled at ``clock_s`` in round ``round`` (the ``attempt``-th poll of its wait)."""
        n = self.num_clients
        if self.kind == "always":
            return np.ones(n, bool)
        if self.kind == "trace":
            return in_trace(self.trace, n, clock_s)
        p = self.params[0] if self.kind == "probability" else diurnal_probability(clock_s, self.phases, *self.params)
        return drawn(p, n, self.seed, round, attempt)

    def next_start(self, clock_s: float, among: np.ndarray) -> float | None:
        """A trace's next interval start after ``clock_s`` of a client in ``among`` (``[N]`` bool); None when
        there is none.  Drawn models: when the server asks again, :data:`POLL_S` later (diurnal: a minute of its
        day, ``PERIOD · 60 / 86,400``)."""
        if self.kind == "diurnal":  # a minute of the model's day
            return clock_s + self.params[2] * POLL_S / 86_400
        if self.kind != "trace":
            return clock_s + POLL_S
        t = self.trace
        ours = (t.client < self.num_clients)
        ours[ours] = among[t.client[ours]]
        later = t.start[ours & (t.start > clock_s)]
        return float(later.min()) if later.size else None

    def wait(self, clock_s: float, round: int, among: np.ndarray,
             max_polls: int = 1_000_000) -> tuple[np.ndarray, float] | None:
        """Who of ``among`` (``[N]`` bool) may be sampled in round ``round`` and how long the server waited for
        anyone, from ``clock_s``: ``(available ∧ among, seconds waited)``; None when a trace has nobody left."""
        start, attempt = clock_s, 0
        while True:
            may = self.available(clock_s, round, attempt) & among
            if may.any() or not among.any():
                return may, clock_s - start
            clock_s = self.next_start(clock_s, among)
            attempt += 1
            if clock_s is None:
                return None
            if attempt > max_polls:  # drawn models with HIGH > 0 end much sooner
                raise RuntimeError(f"no client became available within {max_polls} polls")
