"""The runner interface: how a strategy runs the round of a :class:`~fedpartial._src.engine.round.FederatedRound`.

A runner is built once with its round's program (``Runner(program)``, a
:class:`~fedpartial._src.engine.program.RoundProgram`, when the round is built) and called every
round as ``runner(state, cohort, key) -> (state, metrics)``, after the round has checked the cohort.
It reads the program's pure pieces (the view, the plan, one client's training, aggregation and update)
and jits them its own way, with :func:`jit`; :meth:`Runner.jitted` lists its jitted functions, whose traces
:func:`count_traces` counts outside any traced code (``FederatedRound.trace_count``).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Iterable

import jax
import numpy as np

from fedpartial._src.engine.types import ClientData, Cohort, ServerState

if TYPE_CHECKING:
    from fedpartial._src.engine.program import RoundProgram

#: XLA:CPU options every jitted round piece is compiled with (a caller's ``compiler_options`` add to them).  Copy
#: insertion by region analysis: without it XLA copied carried parameters and optimizer states every local step (in
#: the peer benchmark's MLP, each kernel's momentum, which the parameter's and the momentum's updates both read), with
#: it about half as many (tests/engine/test_engine.py).  Bit for bit the same results; fedpartial's
#: side of the peer benchmark, medians of 8-15 alternating rounds on one device: mlp:50 ``fused`` 0.459 -> 0.401 s a
#: round, mlp K = 25 ``fused:1`` (one thread) 0.197 -> 0.167 s, cnn K = 5 ``mapped/fused:1`` 0.562 -> 0.512 s,
#: the digits run's ``im2col`` rounds unchanged (docs/decisions.md).
CPU_COMPILER_OPTIONS = {"xla_cpu_copy_insertion_use_region_analysis": True}


def jit(fn, **jit_kwargs):
    """``jax.jit(fn, **jit_kwargs)`` whose traces :func:`count_traces` counts: ``fn``'s Python body runs once per
    trace (each new signature, also inside another jitted function), and never when a compiled program is reused.
    On a CPU a top-level jit (not ``inline``, which takes its options from the program it is inlined into) is
    compiled with :data:`CPU_COMPILER_OPTIONS`."""

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        traced.traces += 1
        return fn(*args, **kwargs)

    traced.traces = 0
    if not jit_kwargs.get("inline") and jax.default_backend() == "cpu":
        jit_kwargs = {**jit_kwargs, "compiler_options": {**CPU_COMPILER_OPTIONS,
                                                         **(jit_kwargs.get("compiler_options") or {})}}
    return jax.jit(traced, **jit_kwargs)


def count_traces(jitted: Iterable[Any]) -> int:
    """How many times the functions ``jitted`` (made by :func:`jit`) were traced, wherever they were called (also
    inside another jitted function, e.g. ``FederatedRound.functions.round`` under a user's ``jit``)."""
    return sum(f.__wrapped__.traces for f in jitted)


class Runner:
    """Runs the rounds of ``program`` one way (a strategy): ``runner(state, cohort, key) -> (state, metrics)``."""

    def __init__(self, program: RoundProgram):
        self.program = program
        # Jitted entry points take raw key data: typed key arrays miss jit's fast C++ dispatch
        # path, which costs ~0.2 ms a call — per local step, in the stepwise strategy.
        self._key_impl = None

    def __call__(self, state: ServerState, cohort: Cohort, key: jax.Array) -> tuple[ServerState, dict]:
        raise NotImplementedError

    def jitted(self) -> tuple:
        """The runner's jitted functions (``jax.jit`` objects) built so far."""
        return ()

    @property
    def trace_count(self) -> int:
        """How many times :meth:`jitted` were traced (:func:`count_traces`)."""
        return count_traces(self.jitted())

    def whole(self, cohort: Cohort) -> Cohort:
        """The cohort with its data all at once (:class:`ClientData` takes every row)."""
        if isinstance(cohort.data, ClientData):
            return cohort._replace(data=cohort.data.take(np.arange(self.program.ctx.cohort_size)))
        return cohort

    def wrap_key(self, key_data: jax.Array) -> jax.Array:
        """The round key from its raw data (jitted pieces take key data: a key's type is not an array type)."""
        return jax.random.wrap_key_data(key_data, impl=self._key_impl)

    def _key_data(self, key: jax.Array) -> jax.Array:
        impl = jax.random.key_impl(key)
        if self._key_impl is None:
            self._key_impl = impl
        elif impl != self._key_impl:
            raise ValueError(f"round keys must all be {self._key_impl} keys, got a {impl} key.")
        return jax.random.key_data(key)
