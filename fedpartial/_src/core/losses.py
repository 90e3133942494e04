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


#: a label that counts nowhere: a padded position of a sequence's targets (:func:`label_weights`)
IGNORED_LABEL = -1


def label_weights(labels: jax.Array, example_mask: jax.Array) -> jax.Array:
    """float32 shaped like ``labels``: 1 for each label of a real example that is not ignored (negative), else 0.

    ``labels`` is one class per example (``[B]``) or one per position (``[B, T]``: a language model's next
    tokens, :data:`IGNORED_LABEL` where the target is padding); ``example_mask`` (``[B]``) marks the real
    examples.  Every loss and accuracy weighs its labels by it, so a sequence's positions count like examples.
    """
    mask = example_mask.reshape(example_mask.shape + (1,) * (labels.ndim - example_mask.ndim))
    return (mask & (labels >= 0)).astype(jnp.float32)


def masked_cross_entropy(logits: jax.Array, labels: jax.Array, example_mask: jax.Array) -> jax.Array:
    """Mean cross-entropy over the real labels (:func:`label_weights`; 0 when there are none)."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), jnp.maximum(labels, 0))
    w = label_weights(labels, example_mask)
    return jnp.sum(ce * w) / jnp.maximum(jnp.sum(w), 1.0)


def count_correct(logits: jax.Array, labels: jax.Array, example_mask: jax.Array) -> jax.Array:
    """int32: the real labels (:func:`label_weights`) that the logits' arg-max gets right."""
    hit = (jnp.argmax(logits, -1) == labels) & (label_weights(labels, example_mask) > 0)
    return jnp.sum(hit, dtype=jnp.int32)


def count_labels(labels: jax.Array, example_mask: jax.Array) -> jax.Array:
    """float32: how many real labels (:func:`label_weights`) there are: the examples, or the sequences' targets."""
    return jnp.sum(label_weights(labels, example_mask))


def model_loss(model: ModelLike, variables: dict, x: jax.Array, y: jax.Array, example_mask: jax.Array, *,
               train: bool = False, submodel: Mask | None = None,
               unit_scale: Sequence[jax.Array] | None = None) -> tuple[jax.Array, jax.Array]:
    """``(mean loss, number correct)`` of one model on one batch of real + padded examples (per label:
    :func:`label_weights`).

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
    return masked_cross_entropy(logits, y, example_mask), count_correct(logits, y, example_mask)


# ---- several exits (depth-scaled models, :mod:`fedpartial._src.models.exits`) ----------------------


def exit_cross_entropies(logits: jax.Array, labels: jax.Array, example_mask: jax.Array) -> jax.Array:
    """``[E]``: each exit's mean cross-entropy over real examples, from logits ``[E, B, C]``."""
    return jax.vmap(masked_cross_entropy, in_axes=(0, None, None))(logits, labels, example_mask)


def mutual_distillation(logits: jax.Array, example_mask: jax.Array, temperature: float = 1.0) -> jax.Array:
    """DepthFL's mutual self-distillation among ``E`` exits, logits ``[E, B, C]``::

        Σ_i 1/(E-1) Σ_{j≠i} T² · KL(p_j ‖ p_i),   p = softmax(logits / T)

    each exit a student of every other, the teacher ``p_j`` held fixed (no gradient), averaged over
    real examples (every position of a sequence model's); 0 with a single exit.  ``T²`` keeps the gradient's
    scale independent of ``T``.
    """
    e = logits.shape[0]
    if e < 2:
        return jnp.zeros((), jnp.float32)
    log_p = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)  # [E, B, C]
    teacher = jax.lax.stop_gradient(log_p)
    # kl[j, i, b] = KL(p_j ‖ p_i) for example b
    kl = jnp.sum(jnp.exp(teacher)[:, None] * (teacher[:, None] - log_p[None, :]), axis=-1)
    off_diagonal = (1.0 - jnp.eye(e, dtype=kl.dtype)).reshape((e, e) + (1,) * (kl.ndim - 2))  # no self-teaching
    per_example = jnp.sum(kl * off_diagonal, axis=(0, 1)) * temperature**2 / (e - 1)  # [B] or [B, T]
    w = jnp.broadcast_to(example_mask.reshape(example_mask.shape + (1,) * (per_example.ndim - example_mask.ndim)),
                         per_example.shape).astype(per_example.dtype)
    return jnp.sum(per_example * w) / jnp.maximum(jnp.sum(w), 1.0)
