"""The one aggregation formula of SPEC §1, and the server optimizer step.

For every element: ``new = Σ_k w_k m_k θ_k / Σ_k w_k m_k``; where nobody uploaded
the element (``Σ_k w_k m_k = 0``) the previous global value is kept.  Every method
aggregates through :func:`aggregate`; they differ only in the masks and weights.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import optax

from fedpartial import masks as masks_lib
from fedpartial.structure import ModelStructure


def masked_weighted_mean(global_tree: Any, cohort_tree: Any, element_masks: Any, weights: jax.Array,
                         *, with_received: bool = False) -> Any:
    """The SPEC §1 formula on already-expanded masks.

    Args:
      global_tree: previous global values (no client axis).
      cohort_tree: client values ``[K, ...]``.
      element_masks: booleans ``[K, ...]`` (same structure), True where uploaded.
      weights: ``[K]`` non-negative client weights (``n_k`` by default).

    Returns:
      The aggregated tree; elements with zero total weight keep the global value.
      With ``with_received``, also a boolean tree: True where some weight arrived.
    """

    def leaf(g, theta, m):
        num, den = _sums(theta, m, weights)
        return mean_or_global(g, num, den)

    pairs = jax.tree.map(leaf, global_tree, cohort_tree, element_masks)
    is_pair = lambda x: isinstance(x, tuple)  # noqa: E731
    new = jax.tree.map(lambda p: p[0], pairs, is_leaf=is_pair)
    if not with_received:
        return new
    return new, jax.tree.map(lambda p: p[1], pairs, is_leaf=is_pair)


def _sums(theta: jax.Array, m: jax.Array, weights: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One leaf's numerator ``Σ_k w_k m_k θ_k`` and denominator ``Σ_k w_k m_k``."""
    w = weights.astype(theta.dtype)
    # Contract the client axis with a dot product: XLA on CPU reduces a leading
    # axis with jnp.sum an order of magnitude slower than it runs a tensordot.
    num = jnp.tensordot(w, jnp.where(m, theta, jnp.zeros_like(theta)), axes=(0, 0))
    den = jnp.tensordot(w, m.astype(theta.dtype), axes=(0, 0))
    return num, den


def mean_or_global(g: jax.Array, num: jax.Array, den: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``num / den`` where some weight arrived (``den > 0``), else the global value ``g``; and ``den > 0``."""
    safe = jnp.where(den > 0, den, jnp.ones_like(den))
    return jnp.where(den > 0, num / safe, g), den > 0


def _element_masks(structure: ModelStructure, upload: masks_lib.Mask, g: Any, collection: str) -> Any:
    return jax.vmap(lambda m: masks_lib.expand(structure, m, g, collection))(upload)


def add_sums(structure: ModelStructure, sums: dict, global_vars: dict, cohort_vars: dict, upload: masks_lib.Mask,
             weights: jax.Array, collections: Sequence[str] = ("params", "batch_stats")) -> dict:
    """Folds a part of the cohort (``[C]`` rows) into running sums of the one formula.

    ``sums`` maps each collection to ``(numerator tree, denominator tree)`` (start from
    :func:`zero_sums`); the result is ``sums`` plus this part's ``Σ w m θ`` and ``Σ w m``.
    :func:`finish_sums` turns them into :func:`aggregate`'s result, so a cohort
    streamed part by part aggregates to what it would all at once (up to float
    summation order) while only one part's ``[C, model]`` exists at a time.
    """
    out = dict(sums)
    for collection in sums:
        g = global_vars[collection]
        masks = _element_masks(structure, upload, g, collection)
        part = jax.tree.map(lambda theta, m: _sums(theta, m, weights), cohort_vars[collection], masks)
        is_pair = lambda x: isinstance(x, tuple)  # noqa: E731
        num = jax.tree.map(lambda a, p: a + p[0], sums[collection][0], part, is_leaf=is_pair)
        den = jax.tree.map(lambda a, p: a + p[1], sums[collection][1], part, is_leaf=is_pair)
        out[collection] = (num, den)
    return out


def zero_sums(global_vars: dict, collections: Sequence[str] = ("params", "batch_stats")) -> dict:
    """Empty running sums (zeros shaped like the global model) of the named collections it has."""
    zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)  # noqa: E731
    return {c: (zeros(global_vars[c]), zeros(global_vars[c])) for c in collections if global_vars.get(c)}


def finish_sums(global_vars: dict, sums: dict) -> tuple[dict, Any]:
    """``(new_vars, received)`` from running sums, as :func:`aggregate` returns them."""
    out = dict(global_vars)
    received = jax.tree.map(lambda a: jnp.zeros(jnp.shape(a), bool), global_vars.get("params", {}))
    for collection, (num, den) in sums.items():
        pairs = jax.tree.map(mean_or_global, global_vars[collection], num, den)
        is_pair = lambda x: isinstance(x, tuple)  # noqa: E731
        out[collection] = jax.tree.map(lambda p: p[0], pairs, is_leaf=is_pair)
        if collection == "params":
            received = jax.tree.map(lambda p: p[1], pairs, is_leaf=is_pair)
    return out, received


def aggregate(
    structure: ModelStructure,
    global_vars: dict,
    cohort_vars: dict,
    upload: masks_lib.Mask,
    weights: jax.Array,
    collections: Sequence[str] = ("params", "batch_stats"),
) -> dict:
    """Aggregates the named collections under structured upload masks ``[K]``.

    Collections not named are returned unchanged from ``global_vars``.  The masks
    are expanded client by client (vmapped) right where they are consumed.

    Returns:
      ``(new_vars, received)``: ``received`` is a boolean tree shaped like the
      ``params`` collection, True where at least one client's weight arrived.
    """
    out = dict(global_vars)
    received = jax.tree.map(lambda a: jnp.zeros(jnp.shape(a), bool), global_vars.get("params", {}))
    for collection in collections:
        g = global_vars.get(collection)
        if not g:
            continue
        element_masks = _element_masks(structure, upload, g, collection)
        out[collection], got = masked_weighted_mean(g, cohort_vars[collection], element_masks, weights,
                                                    with_received=True)
        if collection == "params":
            received = got
    return out, received


def server_update(optimizer: optax.GradientTransformation, opt_state: Any, global_params: Any, aggregated: Any,
                  received: Any = None):
    """Applies ``optimizer`` to the pseudo-gradient ``global - aggregated``.

    With ``optax.sgd(1.0)`` this returns ``aggregated`` (FedAvg); FedAdam/FedYogi
    are ``optax.adam`` / ``optax.yogi`` here.  Elements not ``received`` (nobody
    uploaded them) keep their global value bit for bit: a stateful optimizer would
    otherwise keep moving them on stale momentum.
    """
    pseudo_grad = jax.tree.map(jnp.subtract, global_params, aggregated)
    updates, opt_state = optimizer.update(pseudo_grad, opt_state, global_params)
    new = optax.apply_updates(global_params, updates)
    if received is not None:
        new = jax.tree.map(jnp.where, received, new, global_params)
    return new, opt_state
