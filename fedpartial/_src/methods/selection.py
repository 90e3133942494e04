"""Scoring and selection pieces shared by the upload-selecting methods (FedLDF and its baselines).

Everything here is pure and jittable, with shapes fixed by static Python numbers:

* :func:`layer_divergence` — ``[L, K]`` per-layer distances ``||θ_{k,l} - θ_l||₂`` of a
  stacked cohort from the global model (FedLDF's feedback);
* :func:`neuron_update_norms` — per output neuron, the norm of a client's update
  (FedADP's score);
* :func:`top_n_per_row` / :func:`random_n_per_row` — exactly ``n`` winners per row as a
  boolean mask (never a gather of a variable-size subset);
* :func:`top_fraction_neurons` — per client and layer, the largest ``keep_count``
  neurons;
* :func:`keep_count` — ``max(1, round(fraction · units))`` with the rounding stated.

Example::

    scores = jnp.array([[3.0, 1.0, 2.0, 2.0]])
    top_n_per_row(scores, 2)          # [[True, False, True, False]]: tie 2.0 → lowest index
"""

from __future__ import annotations

import numbers
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from fedpartial._src.core.masks import keep_count
from fedpartial._src.core.structure import ModelStructure, leaf_paths


def _cohort_leaves(structure: ModelStructure, trained_params: Any, global_params: Any):
    """(layer, trained leaf [K, ...], global leaf [...]) for every parameter leaf."""
    flat_global = leaf_paths(global_params)
    flat_trained = jax.tree.leaves(trained_params)
    if len(flat_trained) != len(flat_global):
        raise ValueError("trained and global parameters must have the same tree structure.")
    return [(structure.role("params", path).layer, t, g) for (path, g), t in zip(flat_global, flat_trained)]


def layer_divergence(structure: ModelStructure, trained_params: Any, global_params: Any) -> jax.Array:
    """Per layer and client, ``||θ_{k,l} - θ_l||₂`` over all of the layer's parameters.

    A layer's parameters are every leaf of the ``params`` collection the structure
    assigns to it: kernel, bias and the scale/bias of a normaliser that follows it.
    Running statistics are not parameters and do not count.

    Args:
      structure: the model's layer structure.
      trained_params: the cohort's parameters, leaves ``[K, ...]``.
      global_params: the previous global parameters (no client axis).

    Returns:
      ``[L, K]`` float32 divergences (rows are layers, as FedLDF's divergence matrix).
    """
    leaves = _cohort_leaves(structure, trained_params, global_params)
    k = leaves[0][1].shape[0]
    sq = jnp.zeros((structure.num_layers, k), jnp.float32)
    for layer, theta, g in leaves:
        diff = (theta - g[None]).astype(jnp.float32).reshape((k, -1))
        sq = sq.at[layer].add(jnp.sum(diff * diff, axis=1))
    return jnp.sqrt(sq)


def neuron_norms(structure: ModelStructure, params: Any, ord: int = 2) -> tuple[jax.Array, ...]:
    """Per client and output neuron, the L1 (``ord=1``) or L2 norm of that neuron's parameters.

    A neuron's parameters are the slice at its index of the last axis of every leaf of
    its layer: the kernel column (all inputs, all spatial taps), the bias, and the
    normaliser's scale and bias.  A pre-norm's leaves (on the layer's inputs) and
    whole-layer leaves (a low-rank factor) belong to no single neuron and are left out.

    Args:
      structure: the model's layer structure.
      params: a cohort's parameters (or updates, or gradients), leaves ``[K, ...]``.
      ord: 1 or 2.

    Returns:
      One ``[K, units_l]`` float32 array per layer.
    """
    if ord not in (1, 2):
        raise ValueError(f"neuron norm order must be 1 or 2, got {ord!r}.")
    roles = [(structure.role("params", path), leaf) for path, leaf in leaf_paths(params)]
    k = roles[0][1].shape[0]
    acc = [jnp.zeros((k, u), jnp.float32) for u in structure.units]
    # a pre-norm's leaves sit on the layer's inputs and a low-rank factor's last axis is its rank: neither is
    # part of one output neuron, so neither counts towards a neuron's norm
    flat = [(role.layer, leaf) for role, leaf in roles if role.units_axis and not role.on_input]
    for layer, leaf in flat:
        units = leaf.shape[-1]
        if units != structure.units[layer]:
            raise ValueError(
                f"a leaf of layer {structure.layer_names[layer]} has {units} entries on its last axis, "
                f"not the layer's {structure.units[layer]} units."
            )
        v = leaf.astype(jnp.float32).reshape((k, -1, units))
        acc[layer] = acc[layer] + (jnp.sum(jnp.abs(v), axis=1) if ord == 1 else jnp.sum(v * v, axis=1))
    return tuple(acc) if ord == 1 else tuple(jnp.sqrt(a) for a in acc)


def neuron_update_norms(structure: ModelStructure, trained_params: Any, reference_params: Any) -> tuple[jax.Array, ...]:
    """Per client and output neuron, the L2 norm of the update ``θ_k - θ_ref`` of that neuron.

    ``reference_params`` is one model (e.g. the global model) or ``[K]``-stacked like
    ``trained_params`` (e.g. each client's own starting point).

    Returns:
      One ``[K, units_l]`` float32 array per layer.
    """
    diff = jax.tree.map(lambda t, r: t - (r if r.ndim == t.ndim else r[None]), trained_params, reference_params)
    return neuron_norms(structure, diff, ord=2)


def top_n_per_row(scores: jax.Array, n: int, valid: jax.Array | None = None) -> jax.Array:
    """Exactly ``n`` True per row: the highest scores, ties to the lowest column index.

    Invalid columns (padding clients) come after every valid one, so they are never
    chosen while a valid column is left; when fewer than ``n`` columns are valid only
    the valid ones are True.  A NaN score counts as the lowest possible score.

    The order is a full lexicographic sort on (invalid, -score, index), so it is
    deterministic on every backend; the first ``n`` of each row are scattered into
    a boolean mask.

    Args:
      scores: ``[R, C]`` scores (e.g. the ``[L, K]`` divergence matrix).
      n: static number of winners per row, ``1 ≤ n ≤ C``.
      valid: optional ``[C]`` booleans (False: never chosen while enough are valid).

    Returns:
      ``[R, C]`` booleans.

    Raises:
      ValueError: ``n`` is not between 1 and the number of columns.
    """
    rows, cols = scores.shape
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or not 1 <= n <= cols:
        raise ValueError(f"top-n needs 1 ≤ n ≤ {cols} (the number of candidates), got n = {n!r}.")
    n = int(n)
    scores = jnp.where(jnp.isnan(scores), -jnp.inf, scores)
    index = jnp.broadcast_to(jnp.arange(cols), (rows, cols))
    if valid is None:
        invalid = jnp.zeros((rows, cols), bool)
    else:
        invalid = jnp.broadcast_to(~jnp.asarray(valid, bool), (rows, cols))
    # lexsort: the last key is the primary one.  0 - s (not -s) keeps -0.0 out of the keys.
    order = jnp.lexsort((index, 0.0 - scores, invalid), axis=-1)
    winners = order[:, :n]
    mask = jnp.zeros((rows, cols), bool).at[jnp.arange(rows)[:, None], winners].set(True)
    return mask if valid is None else mask & ~invalid


def random_n_per_row(key: jax.Array, rows: int, cols: int, n: int, valid: jax.Array | None = None) -> jax.Array:
    """``n`` columns per row drawn uniformly at random without replacement (valid ones only).

    Each row ranks independent uniform scores with :func:`top_n_per_row`, i.e. it
    takes the first ``n`` of a uniformly random permutation of its columns.
    """
    return top_n_per_row(jax.random.uniform(key, (rows, cols)), n, valid)


def top_count_per_row(scores: jax.Array, counts: jax.Array) -> jax.Array:
    """Per row, the ``counts[row]`` highest scores (ties to the lowest column index).

    Like :func:`top_n_per_row` but with a per-row number of winners given as array
    data (e.g. each client's keep ratio), so one compiled function serves every cohort.

    Args:
      scores: ``[R, C]`` scores; NaN counts as the lowest.
      counts: ``[R]`` integers; values above ``C`` keep the whole row.

    Returns:
      ``[R, C]`` booleans with ``min(counts[r], C)`` True in row ``r``.
    """
    rows, cols = scores.shape
    scores = jnp.where(jnp.isnan(scores), -jnp.inf, scores)
    index = jnp.broadcast_to(jnp.arange(cols), (rows, cols))
    order = jnp.lexsort((index, 0.0 - scores), axis=-1)
    rank = jnp.zeros((rows, cols), jnp.int32).at[jnp.arange(rows)[:, None], order].set(index.astype(jnp.int32))
    return rank < jnp.asarray(counts, jnp.int32)[:, None]


def top_fraction_neurons(norms: Sequence[jax.Array], fraction: float) -> tuple[jax.Array, ...]:
    """Per client and layer, the :func:`keep_count` neurons with the largest scores.

    Every layer is treated alike, the classifier included: this selects what a client
    *uploads* (FedADP prunes uploads, not the model), so leaving some output units out
    of one client's upload is harmless — nobody's output unit is dropped from training,
    and an output unit no client uploads keeps its global value.

    Args:
      norms: one ``[K, units_l]`` score array per layer (:func:`neuron_update_norms`).
      fraction: the kept fraction, in (0, 1].

    Returns:
      One ``[K, units_l]`` boolean array per layer, exactly ``keep_count`` True per row.
    """
    return tuple(top_n_per_row(s, keep_count(fraction, s.shape[-1])) for s in norms)
