"""Shared pieces of the neuron-level personalised methods (FedSPU and the dropout family).

* **Client tiers** (docs/decisions.md#fedspu): the population is split into equal clusters by client
  id, cluster ``c`` having keep ratio ``tiers[c]`` (default 0.2, 0.4, 0.6, 0.8, 1.0 —
  clients ``0 … N/5-1`` keep 20%).  Ratios become per-layer neuron *counts* through a
  static table, so every cohort runs the same compiled code whatever its tiers.
* **Neuron choices** with a per-client count: uniformly at random, leftmost (ordered
  dropout) or by a score.  Every choice keeps all of the classifier's output units.
* **Personal models**: ``[N]``-stacked variables, merged with the global model on
  the elements a client receives (:func:`merge`).

Every function is pure and jittable; counts and choices are array data.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedpartial._src.core import masks
from fedpartial._src.core.errors import UserError
from fedpartial._src.core.masks import Mask
from fedpartial._src.methods import selection
from fedpartial._src.methods.base import MethodContext, RoundView, broadcast_clients
from fedpartial._src.methods.registry import Option, ratios, ratios_in_unit_interval
from fedpartial._src.core.structure import ModelStructure

#: The FedSPU paper's five equal client clusters.
DEFAULT_TIERS = (0.2, 0.4, 0.6, 0.8, 1.0)
ROUNDINGS = ("round", "ceil")
TIERS_OPTION = Option("tiers", ratios, DEFAULT_TIERS,
                      "FedSPU / dropout methods: keep ratios of equal client clusters, e.g. 0.2,0.4,0.6,0.8,1.0",
                      ratios_in_unit_interval)


def check_tiers(name: str, tiers: Sequence[float]) -> tuple[float, ...]:
    """Validates keep ratios now, with a sentence naming the bad value."""
    tiers = tuple(tiers)
    if not tiers:
        raise UserError(f"{name}: give at least one keep ratio.")
    for p in tiers:
        if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0 < p <= 1:
            raise UserError(f"{name}: keep ratio {p!r} must be a number in (0, 1].")
    return tuple(float(p) for p in tiers)


def tier_of(client_ids: jax.Array, num_clients: int, num_tiers: int) -> jax.Array:
    """Each client's cluster: ``floor(id · tiers / N)`` (equal clusters by client id)."""
    return (jnp.asarray(client_ids, jnp.int32) * num_tiers) // num_clients


def kept_units(ratio: float, units: int, rounding: str = "round") -> int:
    """Neurons a layer keeps: ``max(1, round(p·u))`` (halves up) or ``ceil(p·u)`` (FjORD)."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding {rounding!r} is unknown; use one of {ROUNDINGS}.")
    if rounding == "ceil":
        # p·u computed in float can land a hair above an integer (0.6·5 = 3.0000000000000004).
        return max(1, math.ceil(round(ratio * units, 9)))
    return masks.keep_count(ratio, units)


def keep_table(structure: ModelStructure, tiers: Sequence[float], rounding: str = "round") -> np.ndarray:
    """``[tiers, L]`` static neuron counts; the classifier keeps all its units."""
    table = np.array([[kept_units(p, u, rounding) for u in structure.units] for p in tiers], np.int32)
    table[:, -1] = structure.units[-1]
    return table


def cohort_counts(ctx: MethodContext, tiers: Sequence[float], client_ids: jax.Array,
                  rounding: str = "round") -> tuple[jax.Array, ...]:
    """Per layer, each cohort client's number of kept neurons (``[K]`` int32 each)."""
    table = jnp.asarray(keep_table(ctx.structure, tiers, rounding))
    rows = table[tier_of(client_ids, ctx.num_clients, len(tiers))]  # [K, L]
    return tuple(rows[:, layer] for layer in range(ctx.structure.num_layers))


def random_neurons(key: jax.Array, counts: Sequence[jax.Array], units: Sequence[int],
                   client_ids: jax.Array | None = None) -> tuple[jax.Array, ...]:
    """Per layer, ``counts[l][k]`` neurons of client ``k`` drawn uniformly without replacement.

    Each client draws from the round key folded with its id (its cohort position if
    ``client_ids`` is None), so its draw does not depend on who else is in the cohort.
    """
    k = counts[0].shape[0]
    ids = jnp.arange(k) if client_ids is None else jnp.asarray(client_ids)
    client_keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(ids)
    out = []
    for layer, (c, u) in enumerate(zip(counts, units)):
        scores = jax.vmap(lambda kk: jax.random.uniform(jax.random.fold_in(kk, layer), (u,)))(client_keys)
        out.append(selection.top_count_per_row(scores, c))
    return tuple(out)


def leftmost_neurons(counts: Sequence[jax.Array], units: Sequence[int]) -> tuple[jax.Array, ...]:
    """Per layer, the first ``counts[l][k]`` neurons (ordered dropout)."""
    return tuple(jnp.arange(u)[None, :] < c[:, None] for c, u in zip(counts, units))


def strongest_neurons(scores: Sequence[jax.Array], counts: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
    """Per layer, each client's ``counts[l][k]`` highest-scoring neurons (ties: lowest index)."""
    return tuple(selection.top_count_per_row(s, c) for s, c in zip(scores, counts))


def neuron_mask(structure: ModelStructure, neurons: Sequence[jax.Array]) -> Mask:
    """A wired neuron mask with the classifier's output units on."""
    return masks.protect_output(masks.from_neurons(structure, neurons))


def merge(structure: ModelStructure, received: Mask, global_vars: dict, personal: dict) -> dict:
    """One client's model: global values on the ``received`` elements, its own elsewhere.

    Args:
      structure: the model's layers (``ctx.structure``).
      received: one client's mask (no leading axis) of what it receives from the server.
      global_vars: the global variables.
      personal: the client's own variables, shaped as ``global_vars``.

    Returns:
      The merged variables (a ``client_start`` hook returns this).
    """
    take = masks.expand_variables(structure, received, global_vars)
    return jax.tree.map(jnp.where, take, global_vars, personal)


class SubmodelState(NamedTuple):
    """A sub-model client's personal state, ``[N]``: its last trained model and which
    neurons that sub-model had (all on for a client that never trained)."""

    variables: dict
    neurons: tuple[jax.Array, ...]


def stack_population(ctx: MethodContext, global_vars: dict) -> dict:
    """Every client starts from the initial global model (the server broadcasts ``w⁰``)."""
    masks.uses_neurons(ctx.structure)
    return broadcast_clients(global_vars, ctx.num_clients)


def schedule(start: float, end: float, round_index: jax.Array, rounds: int | None) -> jax.Array:
    """Linear ramp from ``start`` (first round) to ``end`` (last planned round)."""
    if rounds is None or rounds <= 1:
        return jnp.asarray(end, jnp.float32)
    frac = jnp.clip(jnp.asarray(round_index).astype(jnp.float32) / (rounds - 1), 0.0, 1.0)
    return start + (end - start) * frac


def schedule_counts(structure: ModelStructure, start: float, end: float, rounds: int | None,
                    round_index: jax.Array) -> tuple[jax.Array, ...]:
    """Per layer, ``max(1, round(f_t·u))`` for the linear ramp ``f_t`` of :func:`schedule`.

    The counts come from a static ``[rounds, L]`` table built with
    :func:`fedpartial._src.core.masks.keep_count` (exact halves round up), indexed
    by the traced round, so no float32 rounding decides a count.
    """
    steps = max(rounds or 1, 1)
    fractions = [start + (end - start) * t / (steps - 1) if steps > 1 else end for t in range(steps)]
    table = np.array([[masks.keep_count(f, u) for u in structure.units] for f in fractions], np.int32)
    row = jnp.asarray(table)[jnp.clip(round_index, 0, steps - 1)]
    return tuple(row[layer] for layer in range(structure.num_layers))


def broadcast_counts(counts: Sequence[jax.Array], k: int) -> tuple[jax.Array, ...]:
    return tuple(jnp.broadcast_to(c, (k,)) for c in counts)


def active_fraction(ctx: MethodContext, view: RoundView) -> dict:
    """Per-round metric: each client's share of hidden neurons it trained or kept (``[K]``)."""
    mask = view.plan.dropout if view.plan.dropout is not None else view.plan.train
    on = sum(jnp.sum(n, axis=-1, dtype=jnp.int32) for n in mask.neurons[:-1])
    return {"active_neuron_fraction": on / max(sum(ctx.structure.units[:-1]), 1)}


def first_batch(data: Any) -> Any:
    """Each client's first local step ``[K, B, ...]`` of a cohort's ``[K, S, B, ...]`` data."""
    return jax.tree.map(lambda a: a[:, 0], data)
