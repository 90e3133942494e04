"""FIARSE (Wu, Wang, Wang, Liu, Su & Gao, NeurIPS 2024, "FIARSE: Model-Heterogeneous Federated Learning via
Importance-Aware Submodel Extraction"): each client holds the share ``r_k`` of the global model's parameters
of largest magnitude, trains that sub-model and uploads it; the server averages each element over its holders.

A round, for client ``k`` of keep ratio ``r_k``:

1. **Extraction** (the plan, once for the cohort): the importance of an element is ``|θ|`` of the global
   model.  The threshold is **global over the whole model** (every kernel, bias and embedding ranked
   together; normaliser scales and biases are always held and never ranked), as the paper's main code
   (HarliWu/FIARSE, ``fiarse/``: ``generate_mask`` ranks one concatenated vector; a layer-wise variant
   lives apart in ``fiarse_layerwise/`` and is not built here).  The client holds the ``n_k = max(1,
   ⌊r_k·P⌋)`` elements of largest ``|θ|`` (``P`` ranked elements; the code's ``topk(k=int(P·r))``), ties
   to the lower flat index so that exactly ``n_k`` are held; ``τ_k`` is the ``n_k``-th largest ``|θ|``.
   Sub-models are nested: a larger ratio holds every element a smaller one holds.
2. **Training with TCB-GD** (the paper's threshold-controlled biased gradient descent; the surrogate below is
   its code's ``Bern`` function): the forward pass runs ``θ ⊙ m`` with ``m = held ∧ (|θ| ≥ τ_k)`` re-evaluated on the
   client's current values, so a held element whose magnitude falls below ``τ_k`` drops out of its
   sub-model; the mask's surrogate derivative ``∂m/∂|θ| = 2τ/(|θ|+τ)²`` makes the gradient of a kept element
   ``g · (1 + 2τ|θ| / (|θ|+τ)²)`` (between 1 and 1.5), and zero for the others.  Elements not held are
   frozen (the train mask), so they stay bit for bit.
3. **Upload and aggregation**: the client uploads its held elements (values and their positions: a bitmap
   or int32 indices per leaf, whichever is smaller); the engine's one formula averages each element over
   the clients that hold it, an element nobody holds keeping its global value.

Decisions where the paper and its code leave room:

* **Weights.**  The code divides each element's summed update by the number of clients whose update of it
  is non-zero (unweighted); we weight holders by ``n_k`` (the engine's formula, as FedAvg), and count a
  holder whose update happens to be exactly zero.
* **Ratio 1.**  The code's training script thresholds a full-size client too (``τ = min |θ|``); a client of
  ratio 1 here holds the whole model with ``τ = 0`` (the code's non-top-k branch), so its TCB-GD gradient is
  the plain gradient and FIARSE with every ratio 1 is FedAvg.
* **Ratios.**  ``--ratios r,r,...``: the keep ratios of equal client clusters by id (:mod:`.common`'s tiers),
  as the paper gives its clients (``--model-size 1.0 0.25 0.0625 0.015625 --model-dist 25 25 25 25`` in the
  authors' README, i.e. ``--ratios 1,0.25,0.0625,0.015625``; also ``1, 0.64, 0.36, 0.16, 0.04``); the
  default is the tiers' ``0.2, …, 1.0``.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp

from fedpartial._src.core import masks
from fedpartial._src.core.structure import leaf_paths
from fedpartial._src.methods.base import (
    Capabilities, ClientPlan, Method, MethodContext, RoundView, cross_entropy, make_method)
from fedpartial._src.methods.registry import MethodSpec, Option, check_values, ratios_in_unit_interval
from fedpartial._src.methods.registry import ratios as parse_ratios
from fedpartial._src.methods.submodel.common import DEFAULT_TIERS, tier_of

OPTIONS = (Option("ratios", parse_ratios, DEFAULT_TIERS, "FIARSE: keep ratios r_k of equal client clusters by id, "
                  "e.g. 1,0.25,0.0625,0.015625 (the paper's)", ratios_in_unit_interval),)


def kept_count(ratio: float, size: int) -> int:
    """Elements a sub-model of ``ratio`` holds among ``size``: ``max(1, ⌊ratio·size⌋)`` (the paper's code).
    ``ratio·size`` is snapped first: in float it can land a hair below an integer (0.29·100 = 28.999…96)."""
    return max(1, math.floor(round(ratio * size, 9)))


def ranked(ctx: MethodContext, params) -> list[bool]:
    """Per ``params`` leaf, whether it is ranked by magnitude (every leaf but a normaliser's)."""
    return [not ctx.structure.role("params", path).norm for path, _ in leaf_paths(params)]


def extract(ctx: MethodContext, params, ratios: Sequence[float], client_ids: jax.Array):
    """The cohort's held elements (a params-shaped tree: ``[K, *shape]`` for a ranked leaf, ``[K]`` for a
    normaliser's, always on) and each client's threshold ``τ`` (``[K]``; 0 for a ratio of 1)."""
    leaves, which = jax.tree.leaves(params), ranked(ctx, params)
    magnitude = jnp.concatenate([jnp.abs(a).ravel() for a, r in zip(leaves, which) if r])
    size = magnitude.shape[0]
    order = jnp.argsort(-magnitude, stable=True)  # descending; equal magnitudes: the lower index first
    rank = jnp.zeros((size,), jnp.int32).at[order].set(jnp.arange(size, dtype=jnp.int32))
    counts = jnp.asarray([kept_count(r, size) for r in ratios], jnp.int32)
    thresholds = jnp.where(jnp.asarray(ratios) >= 1, 0.0, magnitude[order][counts - 1])
    tier = tier_of(client_ids, ctx.num_clients, len(ratios))
    held, offset = [], 0
    for a, r in zip(leaves, which):
        if not r:
            held.append(jnp.ones(tier.shape, bool))
            continue
        leaf_rank = rank[offset:offset + a.size].reshape(a.shape)
        held.append(leaf_rank[None] < counts[tier].reshape((-1,) + (1,) * a.ndim))
        offset += a.size
    return jax.tree.unflatten(jax.tree.structure(params), held), thresholds[tier]


@jax.custom_vjp
def threshold_masked(theta: jax.Array, held: jax.Array, tau: jax.Array) -> jax.Array:
    """``θ ⊙ m``, ``m = held ∧ (|θ| ≥ τ)``, differentiated as TCB-GD (the paper code's ``Bern``)."""
    return jnp.where(held & (jnp.abs(theta) >= tau), theta, jnp.zeros_like(theta))


def _forward(theta, held, tau):
    on = held & (jnp.abs(theta) >= tau)
    return jnp.where(on, theta, jnp.zeros_like(theta)), (theta, on, tau)


def _backward(saved, g):
    theta, on, tau = saved
    a = jnp.abs(theta)
    denominator = jnp.square(a + tau)
    # d(θ·m)/dθ = m + |θ|·∂m/∂|θ| with ∂m/∂|θ| = 2τ/(|θ|+τ)²; at θ = τ = 0 the term is 0 (the code's nan_to_num).
    factor = 1.0 + jnp.where(denominator > 0, 2.0 * tau * a / jnp.where(denominator > 0, denominator, 1.0), 0.0)
    return jnp.where(on, g * factor, jnp.zeros_like(g)), None, jnp.zeros_like(tau)


threshold_masked.defvjp(_forward, _backward)


def objective(ctx: MethodContext, params, step):
    """Cross-entropy of the client's current sub-model; ranked leaves go through :func:`threshold_masked`."""
    tau, held, which = step.plan.extra, jax.tree.leaves(step.plan.train.elements), ranked(ctx, params)
    sub = [threshold_masked(p, h, tau) if r else p for p, h, r in zip(jax.tree.leaves(params), held, which)]
    return cross_entropy(ctx, jax.tree.unflatten(jax.tree.structure(params), sub), step)


def fiarse(ratios: Sequence[float] = DEFAULT_TIERS) -> Method:
    """FIARSE: each client holds, trains (TCB-GD) and uploads the ``r_k`` of the global model's parameters of
    largest magnitude, ``r_k`` from ``ratios`` (equal client clusters by id); each element averaged over its
    holders with ``n_k`` weights.

    Args:
      ratios: keep ratios ``r`` in (0, 1], assigned to equal clusters of clients by id (``--ratios``).

    Returns:
      The :class:`~fedpartial.Method` (``--method fiarse``).
    """
    check_values("fiarse", OPTIONS, ratios=ratios)
    ratios = tuple(float(r) for r in ratios)

    def plan(ctx: MethodContext, view: RoundView) -> ClientPlan:
        elements, thresholds = extract(ctx, view.global_vars["params"], ratios, view.cohort.client_ids)
        held = masks.with_elements(masks.full(ctx.structure, thresholds.shape), elements)
        # It receives only what it holds (with positions) and may change only that.
        return ClientPlan(train=held, download=held, extra=thresholds)

    # select is FedAvg's: the held elements (what was trained), n_k weights; row k depends on client k only.
    return make_method("fiarse", plan=plan, objective=objective,
                       capabilities=Capabilities(streamable="per_client", asynchronous=True))


SPEC = MethodSpec("fiarse", fiarse, "Each client holds, trains (TCB-GD) and uploads its r_k of the global model's "
                                    "parameters of largest magnitude (one global threshold).", OPTIONS)
