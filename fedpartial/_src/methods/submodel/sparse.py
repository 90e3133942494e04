"""FedDST's sparse steps: the random initial mask, prune/regrow on the clients, the sparse aggregation.

A client prunes and regrows ``k_l`` weights per kernel (:func:`prune_and_regrow`; over
a whole model :func:`adjust_leaves`, with the gradient of :func:`last_batch_grad`); the
server aggregates element-wise over the clients holding an element and re-prunes each
kernel to its ``n_l`` (:func:`aggregate_sparse`; over a whole model
:func:`aggregate_leaves`).  The counts ``n_l`` are the static
:class:`~fedpartial._src.methods.submodel.erk.Layout`; the method is
:func:`fedpartial._src.methods.submodel.feddst.feddst`.

Decisions:

* **Prune / regrow** happens once, after local training (the reference adjusts at
  the end of the round's last epoch).  The regrowth gradient is the client's
  cross-entropy gradient on its **last real local batch**, at its trained (masked)
  model, in train mode (BatchNorm on that batch's statistics), as the reference
  recomputes it on the last batch.  Regrowth candidates are the weights that were
  inactive during the round: a weight pruned now is not regrown now (the reference
  may regrow it, reset to zero), so every adjustment moves exactly
  ``k_l = min(⌊α_t · n_l⌋, size_l − n_l)`` weights out and as many in.  Ties (equal
  magnitudes) go to the lower flat index.
* **Votes and re-pruning.**  ``min_votes`` (default 1) counts clients with non-zero
  weight holding the element; 1 is the reference's default 0 (its threshold is
  "more than 0", on n-weighted votes).  Candidates are ranked by |aggregated value|,
  then by votes (regrown weights arrive as zeros: among equal magnitudes, the ones
  more clients regrew win), then by index.  If fewer than n_l elements have enough
  votes (only possible with ``min_votes`` > 1), the layer is filled with the best
  of the others in the same order, so the sparsity is always exact (the reference
  leaves such a layer sparser).  When no client has weight, the mask is unchanged.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from fedpartial._src.core.losses import masked_cross_entropy
from fedpartial._src.methods.base import Batch
from fedpartial._src.methods.submodel.erk import Layout
from fedpartial._src.models.adapter import Model


def _rank(score: jax.Array) -> jax.Array:
    """Each element's position when ``score`` (flat) is sorted ascending; ties: lower index first."""
    order = jnp.argsort(score, stable=True)
    return jnp.zeros(score.shape, jnp.int32).at[order].set(jnp.arange(score.size, dtype=jnp.int32))


def random_mask(params: Any, lay: Layout, key: jax.Array) -> Any:
    """The initial mask: per kernel exactly its count of positions drawn uniformly at random (the key folded
    with the leaf's index); True on dense leaves."""
    leaves = []
    for i, (a, sparse, count) in enumerate(zip(_flat(params), lay.sparse, lay.counts)):
        if not sparse:
            leaves.append(jnp.ones(jnp.shape(a), bool))
            continue
        score = jax.random.uniform(jax.random.fold_in(key, i), (a.size,))
        leaves.append((_rank(score) < count).reshape(a.shape))
    return _unflat(params, leaves)


def cohort_elements(mask: Any, lay: Layout, k: int) -> Any:
    """The element train mask of a cohort of ``k`` clients: the global ``mask`` per kernel, every dense leaf on."""
    return _unflat(mask, [jnp.broadcast_to(m, (k, *m.shape)) if sparse else jnp.ones((k,), bool)
                          for m, sparse in zip(_flat(mask), lay.sparse)])


def prune_and_regrow(mask: jax.Array, weights: jax.Array, grads: jax.Array, k: jax.Array
                     ) -> tuple[jax.Array, jax.Array]:
    """One kernel of one client: drop the ``k`` active weights of smallest |w|, regrow ``k`` of the
    weights inactive before (largest |g|).  Returns ``(new mask, kept)``; ``kept`` is the mask
    after pruning (regrown weights start at zero, so a client's values are ``where(kept, w, 0)``).
    ``k`` may be traced; it must not exceed the active or the inactive count."""
    m, w, g = mask.reshape(-1), weights.reshape(-1), grads.reshape(-1)
    inf = jnp.array(jnp.inf, jnp.float32)
    pruned = m & (_rank(jnp.where(m, jnp.abs(w).astype(jnp.float32), inf)) < k)
    grown = ~m & (_rank(jnp.where(m, inf, -jnp.abs(g).astype(jnp.float32))) < k)
    kept = m & ~pruned
    return (kept | grown).reshape(mask.shape), kept.reshape(mask.shape)


def adjust_leaves(mask: Any, values: Any, grads: Any, lay: Layout, fraction: jax.Array) -> tuple[Any, Any]:
    """Every client's prune/regrow of every kernel: ``(masks, values)`` ``[K, ...]`` per leaf from the global
    ``mask``, the clients' masked ``values`` and ``grads``; ``k_l = min(⌊α_t · n_l⌋, size_l − n_l)``."""
    masks_out, values_out = [], []
    for m, v, g, sparse, count in zip(_flat(mask), _flat(values), _flat(grads), lay.sparse, lay.counts):
        if not sparse:
            masks_out.append(jnp.broadcast_to(m, v.shape))
            values_out.append(v)
            continue
        # Snapped: α_t = 0.25 computes as 0.2499999 in float32 and must still move 1/4.
        moved = jnp.minimum(jnp.floor(fraction * count + 1e-3).astype(jnp.int32), m.size - count)
        new, kept = jax.vmap(lambda vk, gk: prune_and_regrow(m, vk, gk, moved))(v, g)  # noqa: B023
        masks_out.append(new)
        values_out.append(jnp.where(kept, v, jnp.zeros_like(v)))
    return _unflat(mask, masks_out), _unflat(mask, values_out)


def moved_counts(mask: Any, client_masks: Any) -> jax.Array:
    """``[K]`` weights each client pruned (and regrew): active in the global ``mask``, not in its own."""
    return sum(jnp.sum((m[None] & ~c).reshape(c.shape[0], -1), axis=1, dtype=jnp.int32)
               for m, c in zip(_flat(mask), _flat(client_masks)))


def aggregate_sparse(values: jax.Array, masks: jax.Array, weights: jax.Array, count: int, min_votes: int
                     ) -> tuple[jax.Array, jax.Array]:
    """One kernel: ``Σ w m θ / Σ w m`` over ``[K, ...]`` clients, then the ``count`` elements to keep.

    Elements held by at least ``min_votes`` clients of non-zero weight come first, by
    |aggregate|, then by votes, then by index.  Returns ``(mask, value)`` with ``value``
    zero outside ``mask``; elements nobody holds aggregate to 0.
    """
    shape = values.shape[1:]
    w = weights.astype(jnp.float32)
    on = masks.astype(jnp.float32)
    den = jnp.tensordot(w, on, axes=(0, 0))
    num = jnp.tensordot(w, jnp.where(masks, values, 0).astype(jnp.float32), axes=(0, 0))
    agg = jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)
    votes = jnp.tensordot((weights > 0).astype(jnp.float32), on, axes=(0, 0)).reshape(-1)
    ineligible = (votes < min_votes).astype(jnp.int32)
    index = jnp.arange(votes.size, dtype=jnp.int32)
    order = jnp.lexsort((index, -votes, -jnp.abs(agg).reshape(-1), ineligible))  # last key first
    keep = jnp.zeros(votes.shape, bool).at[order[:count]].set(True).reshape(shape)
    return keep, jnp.where(keep, agg, 0.0).astype(values.dtype)


def aggregate_leaves(mask: Any, global_params: Any, aggregated: Any, client_masks: Any, client_values: Any,
                     weights: jax.Array, lay: Layout, min_votes: int) -> tuple[Any, Any]:
    """``(new global params, new global mask)``: every kernel aggregated sparsely (:func:`aggregate_sparse`),
    dense leaves as the engine aggregated them; when no client has weight, the mask and kernels are unchanged."""
    anyone = jnp.sum(weights) > 0
    new_masks, new_params = [], []
    for m, g, a, cmk, cvk, sparse, count in zip(
            _flat(mask), _flat(global_params), _flat(aggregated), _flat(client_masks), _flat(client_values),
            lay.sparse, lay.counts):
        if not sparse:
            new_masks.append(m)
            new_params.append(a)
            continue
        keep, value = aggregate_sparse(cvk, cmk, weights, count, min_votes)
        new_masks.append(jnp.where(anyone, keep, m))
        new_params.append(jnp.where(anyone, value, g))
    return _unflat(mask, new_params), _unflat(mask, new_masks)


def last_batch_grad(model: Model, variables: dict, data: Batch) -> Any:
    """One client's cross-entropy gradient w.r.t. ``params`` on its last real batch ``[S, B, ...]``
    (train mode: BatchNorm normalises with that batch's statistics; padded examples excluded)."""
    steps = data.step_mask.shape[0]
    last = jnp.max(jnp.where(data.step_mask, jnp.arange(steps), 0))
    batch = jax.tree.map(lambda a: a[last], data)

    def loss(p):
        logits, _ = model.apply({**variables, "params": p}, batch.x, True, batch.example_mask)
        return masked_cross_entropy(logits, batch.y, batch.example_mask)

    return jax.grad(loss)(variables["params"])


def _flat(tree) -> list:
    return jax.tree.leaves(tree)


def _unflat(like, leaves) -> Any:
    return jax.tree.unflatten(jax.tree.structure(like), leaves)


def masked(params: Any, mask: Any) -> Any:
    """``params`` with every element outside ``mask`` set to zero."""
    return jax.tree.map(lambda p, m: jnp.where(m, p, jnp.zeros_like(p)), params, mask)
