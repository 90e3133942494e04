"""Losses shared by local training, evaluation and methods that score clients.

Kept apart from :mod:`fedpartial._src.engine.client` so methods (which the client module
imports) can compute a client's loss without an import cycle.
"""

from __future__ import annotations

from typing import Sequence, TYPE_CHECKING

import jax
import jax.numpy as jnp
import optax

from fedpartial._src.core import masks
from fedpartial._src.core.masks import Mask

if TYPE_CHECKING:  # the model layer sits above core: types only
    from fedpartial._src.models.adapter import Model


def masked_cross_entropy(logits: jax.Array, labels: jax.Array, example_mask: jax.Array) -> jax.Array:
    """Mean cross-entropy over real examples (0 when there are none)."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    w = example_mask.astype(ce.dtype)
    return jnp.sum(ce * w) / jnp.maximum(jnp.sum(w), 1.0)


def model_loss(model: Model, variables: dict, x: jax.Array, y: jax.Array, example_mask: jax.Array, *,
               train: bool = False, submodel: Mask | None = None,
               unit_scale: Sequence[jax.Array] | None = None) -> tuple[jax.Array, jax.Array]:
    """``(mean loss, number correct)`` of one model on one batch of real + padded examples.

    ``submodel`` (a neuron mask, optionally with ``unit_scale``) runs the client's
    sub-model: dropped units are removed from the forward pass.  ``train=True``
    normalises with the batch's own statistics (the 'static' BatchNorm policy) —
    running statistics are not kept.
    """
    params = variables["params"]
    if submodel is not None:
        scale = masks.submodel_scale(model.structure, submodel, params, unit_scale)
        params = jax.tree.map(jnp.multiply, params, scale)
    logits, _ = model.apply({**variables, "params": params}, x, train, example_mask if train else None)
    correct = jnp.sum((jnp.argmax(logits, -1) == y) & example_mask)
    return masked_cross_entropy(logits, y, example_mask), correct
