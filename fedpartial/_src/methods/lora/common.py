"""What the federated LoRA methods share: the refusal of a model without adapters, masks over the adapters'
A and B layers, and FedIT's aggregation error.

A LoRA model (:func:`fedpartial.models.lora`) trains only its ``params``: two layers per wrapped Dense,
``<name>/lora_a`` (``A [in, r]``, units: the rank components) and ``<name>/lora_b`` (``B [r, out]``), and its
output layer; the base is frozen and held once.  So a method here is FedAvg's pieces with layer masks over
those layers (:func:`layers_except`), nothing more.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fedpartial._src.core import masks
from fedpartial._src.core.errors import UserError
from fedpartial._src.methods.base import MethodContext, RoundView


def lora_spec(name: str, ctx: MethodContext):
    """The model's :class:`~fedpartial.models.LoraSpec`; a model without adapters is one sentence."""
    spec = ctx.model.lora
    if spec is None:
        raise UserError(f"method {name} trains LoRA adapters, but model {ctx.model.name} has none; add --lora RANK "
                        "(or wrap the model with fedpartial.models.lora).")
    return spec


def adapter_layers(ctx: MethodContext, factor: str) -> np.ndarray:
    """``[L]`` bool: the layers holding every adapter's ``factor`` (``"a"`` or ``"b"``)."""
    spec = ctx.model.lora
    picked = set(spec.a_layers if factor == "a" else spec.b_layers)
    return np.array([i in picked for i in range(ctx.structure.num_layers)])


def layers_except(ctx: MethodContext, off: np.ndarray, batch_shape=()) -> masks.Mask:
    """A layer mask ``[*batch_shape]`` with the layers ``off`` marks off and every other layer on."""
    on = jnp.broadcast_to(jnp.asarray(~off), (*batch_shape, len(off)))
    return masks.from_layers(ctx.structure, on)


def aggregation_error(ctx: MethodContext, params: dict, weights: jax.Array) -> jax.Array:
    """FedIT's aggregation error: ``‖mean(ΔW) − ΔW(mean A, mean B)‖`` over every adapter (the Frobenius norm of
    all of them together), the means weighted by ``weights`` ``[K]`` over the cohort's adapters ``params``
    ``[K, ...]``; ``ΔW = (α/r)·A B``.  Zero when every client's adapters are equal; FLoRA's stacking removes it.

    ``Σ_k w_k A_k B_k`` is one product of the ``[in, K·r]`` and ``[K·r, out]`` concatenations: no ``[K, in, out]``
    intermediate.
    """
    spec = ctx.model.lora
    w = weights / jnp.maximum(jnp.sum(weights), 1e-30)
    total = jnp.zeros((), jnp.float32)
    for _, a, b in spec.pairs(params):  # a [K, in, r], b [K, r, out]
        k, fan_in, r = a.shape
        mean_of_products = jnp.matmul(jnp.moveaxis(a * w[:, None, None], 0, 1).reshape(fan_in, k * r),
                                      b.reshape(k * r, -1))
        product_of_means = jnp.matmul(jnp.tensordot(w, a, 1), jnp.tensordot(w, b, 1))
        total = total + jnp.sum(jnp.square(spec.scale * (product_of_means - mean_of_products)))
    return jnp.sqrt(total)


def aggregation_error_metric(ctx: MethodContext, view: RoundView) -> dict:
    """``{"lora_aggregation_error": …}`` of the round's uploaded adapters (NaN under the streamed strategy, which
    never holds the cohort's adapters together)."""
    if view.trained_vars is None:
        return {"lora_aggregation_error": jnp.asarray(jnp.nan, jnp.float32)}
    weights = jnp.where(view.cohort.valid, view.selection.weights, 0.0)
    return {"lora_aggregation_error": aggregation_error(ctx, view.trained_vars["params"], weights)}
