"""Losses shared by local training, evaluation and methods that score clients.

Kept apart from :mod:`fedpartial._src.engine.client` so methods (which the client module
imports) can compute a client's loss without an import cycle.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import optax

from fedpartial._src.core import masks
from fedpartial._src.core.masks import Mask
from fedpartial._src.core.types import ModelLike


def masked_cross_entropy(logits: jax.Array, labels: jax.Array, example_mask: jax.Array) -> jax.Array:
    """Mean cross-entropy over real examples (0 when there are none)."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    w = example_mask.astype(ce.dtype)
    return jnp.sum(ce * w) / jnp.maximum(jnp.sum(w), 1.0)


def model_loss(model: ModelLike, variables: dict, x: jax.Array, y: jax.Array, example_mask: jax.Array, *,
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


# ---- several exits (depth-scaled models, :mod:`fedpartial._src.models.exits`) ----------------------


def exit_cross_entropies(logits: jax.Array, labels: jax.Array, example_mask: jax.Array) -> jax.Array:
    """``[E]``: each exit's mean cross-entropy over real examples, from logits ``[E, B, C]``."""
    return jax.vmap(masked_cross_entropy, in_axes=(0, None, None))(logits, labels, example_mask)


def mutual_distillation(logits: jax.Array, example_mask: jax.Array, temperature: float = 1.0) -> jax.Array:
    """DepthFL's mutual self-distillation among ``E`` exits, logits ``[E, B, C]``::

        Σ_i 1/(E-1) Σ_{j≠i} T² · KL(p_j ‖ p_i),   p = softmax(logits / T)

    each exit a student of every other, the teacher ``p_j`` held fixed (no gradient), averaged over
    real examples; 0 with a single exit.  ``T²`` keeps the gradient's scale independent of ``T``.
    """
    e = logits.shape[0]
    if e < 2:
        return jnp.zeros((), jnp.float32)
    log_p = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)  # [E, B, C]
    teacher = jax.lax.stop_gradient(log_p)
    # kl[j, i, b] = KL(p_j ‖ p_i) for example b
    kl = jnp.sum(jnp.exp(teacher)[:, None] * (teacher[:, None] - log_p[None, :]), axis=-1)
    off_diagonal = 1.0 - jnp.eye(e, dtype=kl.dtype)[:, :, None]  # no exit is its own teacher
    per_example = jnp.sum(kl * off_diagonal, axis=(0, 1)) * temperature**2 / (e - 1)
    w = example_mask.astype(per_example.dtype)
    return jnp.sum(per_example * w) / jnp.maximum(jnp.sum(w), 1.0)
