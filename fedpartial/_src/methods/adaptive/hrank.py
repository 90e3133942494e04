"""HRank (Lin et al. 2020) of FedAD's conv filters: the matrix rank of each filter's post-activation maps.

FedAD's importance of a conv filter (:func:`fedpartial._src.methods.adaptive.importance.unit_importance`)
is its average HRank over the real images of one or several batches.

Decisions taken where the paper is vague:

* Which layers are "conv": :func:`importance_kinds` -- ``structure.kinds``
  (``'conv'`` for a kernel of rank > 2), except that only 2-D convolutions
  (kernel rank 4, NHWC output) have ``H x W`` maps; a 1-D or 3-D convolution
  is counted as dense (its input-weight sums).  For every 2-D conv model the
  result equals ``structure.kinds``.  FedAD must group units by these kinds.
* Post-activation map: :meth:`Model.intermediates` gives each Conv's output
  before any normaliser.  We apply the layer's BatchNorm (if any) in inference
  form from the variables -- ``(y - mean) * rsqrt(var + 1e-5) * scale + bias``
  with the running statistics in ``batch_stats``; ``1e-5`` is the epsilon of
  the zoo's and of Flax's default BatchNorm -- and then ReLU, as every zoo model
  does.  A conv followed by another normaliser (LayerNorm, GroupNorm: no running
  statistics) raises :class:`UserError`.  In a residual block the ReLU after the
  skip addition is not seen: the map is ``relu(bn(conv))`` of that conv alone.
* Matrix rank: the number of singular values above ``σ_max · max(H, W) ·
  eps(float32)`` (NumPy's and ``jnp.linalg.matrix_rank``'s default tolerance);
  an all-zero map has rank 0.
* Data: ``x`` is one batch ``[B, ...]`` or several ``[S, B, ...]`` (scanned one
  batch at a time); ``example_mask`` (``[B]`` / ``[S, B]``) marks the real
  images, and only those are averaged -- no real image gives ranks 0, not NaN.

Everything is a pure function of arrays with the model static: jit it by
closing over the model, and vmap it over a cohort's client axis.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from fedpartial._src.core.errors import UserError
from fedpartial._src.core.structure import Path
from fedpartial._src.models.adapter import Model

__all__ = ["feature_map_ranks", "filter_ranks", "importance_kinds"]

#: Epsilon of the zoo's BatchNorm (and Flax's default), used to apply it in inference form.
BATCH_NORM_EPSILON = 1e-5

_EPS32 = float(jnp.finfo(jnp.float32).eps)


def importance_kinds(model: Model) -> tuple[str, ...]:
    """Per layer ``'conv'`` (a 2-D convolution: HRank) or ``'dense'`` (input-weight sums).

    ``model.structure.kinds``, with convolutions whose kernel is not of rank 4
    (1-D/3-D: no ``H x W`` feature maps) counted as dense.
    """
    return tuple(
        "conv" if kind == "conv" and layer.kernel_rank == 4 else "dense"
        for kind, layer in zip(model.structure.kinds, model.structure.layers, strict=True)
    )


def feature_map_ranks(maps: jax.Array) -> jax.Array:
    """Matrix rank of every ``[H, W]`` map in ``maps [..., H, W]`` -> int32 ``[...]``.

    Counts singular values above ``σ_max · max(H, W) · eps(float32)``; a zero map
    has rank 0.  No activation is applied here.
    """
    maps = jnp.asarray(maps, jnp.float32)
    h, w = maps.shape[-2:]
    s = jnp.linalg.svd(maps, compute_uv=False)  # batched over all leading axes
    tol = s.max(axis=-1, keepdims=True) * (max(h, w) * _EPS32)
    return (s > tol).sum(axis=-1).astype(jnp.int32)


def filter_ranks(
    model: Model, variables: Mapping[str, Any], x: jax.Array, example_mask: jax.Array | None = None
) -> tuple[jax.Array | None, ...]:
    """HRank of every conv filter: the average rank of its post-activation maps.

    Args:
      model: the model (static).
      variables: ``{'params': ..., 'batch_stats': ...}`` of one model.
      x: one batch ``[B, *input_shape]`` or several ``[S, B, *input_shape]``.
      example_mask: ``[B]`` / ``[S, B]`` booleans marking real images (default: all).

    Returns:
      Per layer, float32 ``[units]`` average ranks over the real images for a conv
      layer (:func:`importance_kinds`), None for a dense layer.
    """
    ranks, _, _ = conv_statistics(model, variables, x, example_mask)
    return ranks


# --------------------------------------------------------------------- internals


@functools.partial(jax.jit, static_argnums=0)  # compiled once per model and shapes, also when called eagerly
def conv_statistics(model, variables, x, example_mask):
    """Per layer ``(average rank [C], mean |activation| [C])`` (None for dense) and the real-image count."""
    kinds = importance_kinds(model)
    n = len(kinds)
    conv = [i for i, k in enumerate(kinds) if k == "conv"]
    if not conv:
        return (None,) * n, (None,) * n, jnp.float32(0.0)
    x = jnp.asarray(x)
    xs, mask = _batched(model, x, example_mask)
    layers = model.structure.layers
    for i in conv:
        _check_norms(variables, layers[i])

    def one_batch(carry, batch):
        xb, mb = batch
        outs = model.intermediates(variables, xb, train=False)
        rank_sums, act_sums = [], []
        for i, r_acc, a_acc in zip(conv, *carry[:2], strict=True):
            y = _post_activation(variables, layers[i], outs[layers[i].name])
            maps = jnp.moveaxis(y, -1, 1)  # [B, C, H, W]
            real = mb[:, None]
            # where, not multiply: a padded image's map may hold anything (even NaN).
            rank_sums.append(r_acc + jnp.where(real, feature_map_ranks(maps), 0).sum(axis=0).astype(jnp.float32))
            act_sums.append(a_acc + jnp.where(real, jnp.abs(y).mean(axis=(1, 2)), 0.0).sum(axis=0))
        return (rank_sums, act_sums, carry[2] + mb.sum().astype(jnp.float32)), None

    zeros = [jnp.zeros((layers[i].units,), jnp.float32) for i in conv]
    (rank_sums, act_sums, count), _ = jax.lax.scan(one_batch, (zeros, list(zeros), jnp.float32(0.0)), (xs, mask))
    denom = jnp.maximum(count, 1.0)  # no real image: sums are 0, so ranks 0 rather than NaN
    ranks, activity = [None] * n, [None] * n
    for i, r, a in zip(conv, rank_sums, act_sums, strict=True):
        ranks[i], activity[i] = r / denom, a / denom
    return tuple(ranks), tuple(activity), count


def _batched(model, x, example_mask):
    """``x`` as ``[S, B, ...]`` and the example mask as ``[S, B]`` booleans."""
    d = len(model.input_shape)
    if x.ndim not in (d + 1, d + 2):
        raise UserError(
            f"importance needs x of shape [B, *{model.input_shape}] or [S, B, *{model.input_shape}], "
            f"got shape {tuple(x.shape)}."
        )
    lead = x.shape[: x.ndim - d]
    if example_mask is None:
        example_mask = jnp.ones(lead, bool)
    example_mask = jnp.asarray(example_mask)
    if example_mask.shape != lead:
        raise UserError(
            f"example_mask of shape {tuple(example_mask.shape)} does not match the leading axes "
            f"{tuple(lead)} of x; it needs one entry per image."
        )
    if x.ndim == d + 1:  # one batch: a scan of length 1
        x, example_mask = x[None], example_mask[None]
    return x, example_mask.astype(bool)


def subtree(tree: Mapping[str, Any], path: Path) -> Mapping[str, Any] | None:
    node = tree
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            return None
        node = node[key]
    return node


def _check_norms(variables, layer) -> None:
    stats = variables.get("batch_stats", {})
    for path in layer.norm_paths:
        s = subtree(stats, path)
        if s is None or "mean" not in s or "var" not in s:
            raise UserError(
                f"conv layer {layer.name} is followed by normaliser {'/'.join(path)} without running "
                "statistics; HRank importance supports only BatchNorm after a convolution."
            )


def _post_activation(variables, layer, y):
    """``relu(bn(y))`` for a conv output ``y [B, H, W, C]``; BatchNorm in inference form when the layer has one."""
    if y.ndim != 4:
        raise UserError(
            f"conv layer {layer.name} outputs shape {tuple(y.shape)}; HRank needs NHWC feature maps of rank 4."
        )
    y = y.astype(jnp.float32)
    c = y.shape[-1]

    def per_channel(v):  # [C] -> [1, 1, 1, C]: explicit, rank promotion is disallowed in tests
        return jnp.asarray(v, jnp.float32).reshape((1, 1, 1, c))

    for path in layer.norm_paths:
        stats = subtree(variables["batch_stats"], path)
        params = subtree(variables.get("params", {}), path) or {}
        mul = jax.lax.rsqrt(per_channel(stats["var"]) + BATCH_NORM_EPSILON)  # Flax's order of operations
        if "scale" in params:
            mul = mul * per_channel(params["scale"])
        y = (y - per_channel(stats["mean"])) * mul
        if "bias" in params:
            y = y + per_channel(params["bias"])
    return jax.nn.relu(y)

