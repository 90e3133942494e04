"""What the methods that form the clients' full updates share: each client's rank (``--lora-ranks``), the plan
that trains only its leading rank components, and the weighted sum of the clients' products ``Σ_k p_k ΔW_k``.

A client of rank ``r_k`` computes with the first ``r_k`` components of every rank-``r_max`` adapter: the plan's
sub-model mask over the A layers' units (:meth:`~fedpartial.models.LoraSpec.rank_mask`) drops the rest from its
forward pass, its training and its upload, so its update is ``ΔW_k = (α/r)·A_k[:, :r_k] B_k[:r_k]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fedpartial._src.core.types import ClientPlan, MethodContext, RoundView
from fedpartial._src.models.lora_ranks import client_ranks


def cohort_ranks(ctx: MethodContext, view: RoundView) -> jax.Array:
    """``[K]`` int32: every cohort client's rank."""
    return client_ranks(ctx.model, view.cohort.client_ids, ctx.num_clients)


def rank_plan(ctx: MethodContext, view: RoundView) -> ClientPlan:
    """Every client trains its rank's leading components of every adapter (everything, without rank tiers)."""
    spec = ctx.model.lora
    if spec is None or spec.ranks is None:
        return ClientPlan()
    return ClientPlan(dropout=spec.rank_mask(ctx.structure, cohort_ranks(ctx, view)))


def shares(view: RoundView) -> jax.Array:
    """``[K]`` the aggregation weights ``p_k`` of the clients that count (valid), summing to 1 (all 0 when none)."""
    w = jnp.where(view.cohort.valid, view.selection.weights, 0.0)
    return w / jnp.maximum(jnp.sum(w), 1e-30)


def mean_update(a: jax.Array, b: jax.Array, ranks: jax.Array, p: jax.Array, scale: float) -> jax.Array:
    """``Σ_k p_k·scale·A_k[:, :r_k] B_k[:r_k]`` ``[in, out]`` of the cohort's factors ``a [K, in, r]``, ``b [K, r, out]``.

    One product of the stacked factors (FLoRA's stacking): ``[p_1 A_1, …, p_K A_K]`` ``[in, K·r]`` times
    ``[B_1; …; B_K]`` ``[K·r, out]``, the components past each client's rank zeroed; no ``[K, in, out]`` copy.
    """
    k, fan_in, r = a.shape
    keep = (jnp.arange(r)[None, :] < ranks[:, None]).astype(a.dtype)  # [K, r]
    stacked_a = jnp.moveaxis(a * (p[:, None] * keep)[:, None, :], 0, 1).reshape(fan_in, k * r)
    return scale * jnp.matmul(stacked_a, b.reshape(k * r, -1))


def components(r: int, low: jax.Array, high: jax.Array) -> jax.Array:
    """``[..., r]`` 1.0 for the rank components ``low ≤ j < high`` (``low``, ``high``: any matching shape)."""
    low, high = jnp.broadcast_arrays(jnp.asarray(low), jnp.asarray(high))
    j = jnp.arange(r).reshape((1,) * low.ndim + (r,))
    return ((j >= low[..., None]) & (j < high[..., None])).astype(jnp.float32)


def product_norm(a: jax.Array, b: jax.Array, keep: jax.Array, scale: float) -> jax.Array:
    """``‖scale·A[:, keep] B[keep]‖_F`` over any leading axes (``a [..., in, r]``, ``b [..., r, out]``,
    ``keep [..., r]`` 0/1).

    From the ``r × r`` Gram matrices, ``‖A B‖² = Σ (AᵀA) ∘ (B Bᵀ)``: no ``[in, out]`` product.  Its gradient is 0,
    not NaN, where the product is 0 (fresh adapters: B is zero).
    """
    a, b = a * keep[..., None, :].astype(a.dtype), b * keep[..., :, None].astype(b.dtype)
    gram = jnp.einsum("...ir,...is->...rs", a, a) * jnp.einsum("...ro,...so->...rs", b, b)
    square = jnp.sum(gram, axis=(-2, -1))
    return scale * jnp.where(square > 0, jnp.sqrt(jnp.where(square > 0, square, 1.0)), 0.0)


def pruned_ranks(ranks: jax.Array, gamma: float) -> jax.Array:
    """HetLoRA's rank after self-pruning at decay ``gamma``: ``max(⌊γ r⌋, 1)`` (int32, ``ranks``'s shape)."""
    return jnp.maximum(jnp.floor(gamma * jnp.asarray(ranks)).astype(jnp.int32), 1)


def norm_weighted_factors(a: jax.Array, b: jax.Array, ranks: jax.Array, p: jax.Array,
                          scale: float) -> tuple[jax.Array, jax.Array]:
    """HetLoRA's sparsity-weighted sum of the zero-padded factors: ``(Σ_k q_k A_k, Σ_k q_k B_k)``, client ``k``'s
    components past ``ranks[k]`` zero, ``q_k = S_k / Σ S`` with ``S_k = ‖scale·A_k B_k‖_F`` over the clients that
    count (``p > 0``; the shares ``p`` themselves when every such update is zero)."""
    keep = components(a.shape[-1], 0, ranks)
    norms = jnp.where(p > 0, product_norm(a, b, keep, scale), 0.0)
    total = jnp.sum(norms)
    q = jnp.where(total > 0, norms / jnp.where(total > 0, total, 1.0), p)
    return (jnp.tensordot(q, a * keep[:, None, :].astype(a.dtype), 1).astype(a.dtype),
            jnp.tensordot(q, b * keep[:, :, None].astype(b.dtype), 1).astype(b.dtype))
