"""How the replicas run: the strategy (:func:`replica_strategy`, :func:`decided_layout`) and the replica axis
(``replica_axis``): inside one jitted round every replica at once (``vmap``), one after another (``map``) or
``B`` at a time (``map:B``), or a host loop over the replicas' own rounds (``loop``, :func:`runs_looped`), and how
many fit in memory (:func:`fit_replica_axis`).
:mod:`~fedpartial._src.experiment.replicas` says why each is chosen."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from fedpartial._src.core import memory
from fedpartial._src.engine import strategy as engine_strategy
from fedpartial._src.experiment.config import REPLICA_FLAGS, ConfigError, RunConfig
from fedpartial._src.experiment.parts import choose_conv

#: the flags that make a run a set of replicas, as refusals name them
REPLICAS_NAMED = ", ".join(f"--{f.replace('_', '-')}" for f in REPLICA_FLAGS[:-1]) + \
    f" or --{REPLICA_FLAGS[-1].replace('_', '-')}"


def replica_strategy(strategy: str) -> str:
    """The fused strategy the replicas run for ``--strategy`` (``auto`` → ``fused``); refuses host-loop ones."""
    if strategy == "auto":
        return "fused"
    try:
        kind = engine_strategy.parse_strategy(strategy).kind
    except ValueError as e:
        raise ConfigError(f"--{e}") from None
    if kind != "fused":
        raise ConfigError(f"--strategy {strategy} cannot run with {REPLICAS_NAMED}: the replicas run the fused "
                          "round as one jitted function over the replicas; use auto, fused, fused:N or fused-unrolled.")
    return strategy


#: the fused strategy stacked replicas run for the cohort layout ``--conv-impl auto`` measured (a single run's
#: ``loop``, a host loop of one client at a time, is one client at a time inside the program here)
LAYOUT_STRATEGIES = {"vmap": "fused", "map": "fused:1", "loop": "fused:1"}


def decided_layout(config: RunConfig, dataset, stacked: bool = True) -> tuple[str, str] | None:
    """``(strategy, conv_impl)`` for replicas of ``config`` whose ``--strategy auto`` follows the lowering and
    layout a single run of it measures (:func:`~fedpartial._src.experiment.parts.choose_conv`, once for every
    replica); None when nothing was measured (a named strategy or lowering, a model without convolutions).

    ``stacked``: the replicas run stacked on a replica axis inside one jitted round, so the strategy is of the
    fused family (:data:`LAYOUT_STRATEGIES`); otherwise it is the single run's own strategy
    (:func:`~fedpartial._src.engine.strategy.default_strategy` of the layout: ``fused``, ``fused:1`` or
    ``stepwise:1``), which replicas other than ``fused`` run in a host loop (:func:`runs_looped`)."""
    if config.strategy != "auto":
        return None
    choice = choose_conv(config, dataset)
    if choice.layout is None:
        return None
    if stacked:
        return LAYOUT_STRATEGIES[choice.layout], choice.impl
    return str(engine_strategy.default_strategy(layout=choice.layout)), choice.impl


def runs_looped(decided: tuple[str, str] | None) -> bool:
    """Whether replicas of the single run's ``decided`` layout (:func:`decided_layout` with ``stacked`` False, the
    replica axis left to ``auto``) run in a host loop over the replicas (:data:`LOOP`): every layout but the
    vmapped fused round.  Stacked
    onto a loop inside the program, XLA:CPU runs convolution gradients several times slower than as the
    top-level jitted calls a single run makes (``benchmarks/results/replica-layout-cpu-2026-12-03.json``:
    ``fused:1`` replicas of the 28x28 CNN took 19x the steady time of two separate ``stepwise:1`` runs)."""
    return decided is not None and decided[0] != "fused"


#: the replica axis of replicas run one after another by the host, each replica's round the single run's
#: compiled round called with its own state, cohort and key (:mod:`~fedpartial._src.experiment.replica_loop`)
LOOP = ("loop", None)


REPLICA_AXES = ("auto", "vmap", "map")


def platform() -> str:
    """The platform the replicas run on (what ``auto`` decides by)."""
    return jax.devices()[0].platform


def parse_replica_axis(axis: str, platform: str) -> tuple[str, int | None]:
    """``(kind, batch)`` for ``axis``: ``vmap`` (every replica at once), ``map`` or ``map:N`` (a loop:
    one replica, or N vmapped together, after another inside the one jitted round; :func:`over_replicas`) or
    ``auto``.

    ``auto`` is ``map`` on CPU and ``vmap`` on an accelerator.  On CPU a vmapped round over replicas
    batches the per-replica weights into each matmul and convolution, which XLA:CPU runs slower than
    the replicas one after another (``benchmarks/results/seeds-cpu-2026-11-23-map.json``, 4 seeds: the
    steady rounds took 0.47 s mapped vs 1.02 s vmapped for the MLP, 28 s vs 49 s for cnn2c1f); an
    accelerator has the parallelism to run them at once (not measured yet).
    """
    kind, _, batch = axis.partition(":")
    if kind not in REPLICA_AXES or (batch and (kind != "map" or not batch.isdigit() or int(batch) < 1)):
        raise ConfigError(f"replica axis {axis!r} is not allowed: choose auto, vmap, map or map:N with N >= 1.")
    if kind == "auto":
        kind = "map" if platform == "cpu" else "vmap"
    return kind, int(batch) if batch else None


def over_replicas(fn: Callable, kind: str, batch: int | None = None) -> Callable:
    """``fn(state, *args) -> (state, *outputs)`` of one replica lifted to arguments with a leading replica
    axis: ``jax.vmap`` for ``vmap``; for ``map`` a ``lax.scan`` inside the jitted function over the replicas,
    ``batch`` of them vmapped at a time (one, un-vmapped, for None) and the remainder vmapped after.  The
    result is the same either way; ``fn``'s new state has its state's shapes.

    The scan carries the stacked state and writes each batch's new rows over the old ones, so that with the
    state donated it exists once; ``jax.lax.map`` stacked its outputs into new buffers, which with every
    replica's own state beside them (:class:`Replicas`) held three copies (FedSPU, 4 replicas: 13.9 GiB)."""
    if kind == "vmap":
        return jax.vmap(fn)
    group = fn if batch is None else jax.vmap(fn)

    def rows(tree, start, size):
        if batch is None:
            return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, start, keepdims=False), tree)
        return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, start, size), tree)

    def write(state, start, new):
        new = jax.tree.map(lambda r: r[None], new) if batch is None else new
        return jax.tree.map(lambda a, r: jax.lax.dynamic_update_slice_in_dim(a, r, start, 0), state, new)

    def mapped(state, *args):
        count = jax.tree.leaves(state)[0].shape[0]
        size = min(batch or 1, count)
        full, rest = divmod(count, size)

        def body(state, g):
            start = g * size
            new, *outs = group(rows(state, start, size), *rows(args, start, size))
            return write(state, start, new), tuple(outs)

        state, outs = jax.lax.scan(body, state, jnp.arange(full))
        if batch is not None:  # [groups, size, ...] -> [groups × size, ...]
            outs = jax.tree.map(lambda o: o.reshape((full * size,) + o.shape[2:]), outs)
        if rest:  # the last rows, vmapped together
            new, *tail = jax.vmap(fn)(*jax.tree.map(lambda a: a[full * size:], (state, *args)))
            state = jax.tree.map(lambda a, r: a.at[full * size:].set(r), state, new)
            outs = jax.tree.map(lambda o, t: jnp.concatenate([o, t]), outs, tuple(tail))
        return (state, *outs)

    return mapped


def at_once(axis: tuple[str, int | None], count: int) -> int:
    """How many of ``count`` replicas train together on the replica ``axis`` (``(kind, batch)``)."""
    kind, batch = axis
    return count if kind == "vmap" else min(batch or 1, count)


def describe(axis: tuple[str, int | None], count: int) -> str:
    together = at_once(axis, count)
    if axis == LOOP:
        return "one after another (host loop)"
    return "all at once (vmap)" if axis[0] == "vmap" else "one at a time" if together == 1 else f"{together} at a time"


def fit_replica_axis(est: memory.MemoryEstimate, count: int, axis: tuple[str, int | None], available: int | None,
                     where: str, *, auto: bool) -> tuple[tuple[str, int | None], str | None]:
    """The replica axis for ``count`` replicas of one replica's estimate ``est`` within ``available`` bytes of
    ``where``, and why it is not ``axis`` (None: it is).  ``auto`` (the axis was not named): when ``axis`` does
    not fit, the most replicas at a time that do (``map:B``); a named axis that does not fit, or replicas that
    do not fit even one at a time, are refused (:class:`ConfigError`) with the estimate and what fits."""
    if available is None:
        return axis, None
    together = at_once(axis, count)
    need = memory.for_replicas(est, count, together)
    if memory.fits(need, available):
        return axis, None
    head = (f"{count} replicas {describe(axis, count)} would need about {memory.gib(need.total)} but "
            f"{memory.gib(available)} of {where} is available")
    smaller = next((b for b in range(together - 1, 0, -1)
                    if memory.fits(memory.for_replicas(est, count, b), available)), None)
    if smaller is not None and auto:
        return ("map", smaller if smaller > 1 else None), f"auto runs {smaller} of the replicas at a time: {head}"
    if smaller is not None:
        raise ConfigError(f"{head}; use replica_axis='map' (one at a time)." if smaller == 1 else
                          f"{head}; use replica_axis='map:{smaller}' ({smaller} at a time).")
    fewer = next((c for c in range(count - 1, 0, -1) if memory.fits(memory.for_replicas(est, c, 1), available)), 0)
    if fewer:
        raise ConfigError(f"{head}, and too much even one at a time (every replica's state and cohort stay on the "
                          f"device); run at most {fewer} of them together and the rest in another run "
                          "(fedpartial compare reads them all).")
    raise ConfigError(f"{head}, and too much even one at a time; use a smaller --cohort or fewer --clients.")


def axis_name(axis: tuple[str, int | None]) -> str:
    """``vmap``, ``map`` or ``map:B`` (the replica axis as :func:`parse_replica_axis` reads it), or ``loop``
    (:data:`LOOP`, which ``auto`` decides for a single run's host-loop layout)."""
    kind, batch = axis
    return kind if batch is None else f"{kind}:{batch}"
