"""Per-unit importance for FedAD: HRank of conv filters, input-weight sums of dense neurons.

Decisions: docs/decisions.md#feddhad; the FedDHAD paper's §5.2.1.

FedAD turns these values into per-neuron dropout rates (a softmax over all conv
units and, separately, over all dense units), so it needs one value per output
unit of every layer:

* **Conv filter** -- HRank (Lin et al. 2020): the matrix rank of the filter's
  post-activation feature map (one ``H x W`` matrix per image), averaged over the
  real images of one or several batches.
* **Dense neuron** -- the sum of its input weights, ``kernel[:, j].sum()``,
  *signed*, as the paper writes it ("the sum of its corresponding input
  parameters"); no absolute value is taken.  For a kernel of higher rank (a
  layer counted as dense, see below) every axis but the last is summed.
* **Classifier** (``structure.layers[-1]``) -- never dropped, so it has no
  importance: :func:`unit_importance` returns zeros for it, only so that the
  result has one ``[units]`` entry per layer; callers ignore it.

Decisions taken where the paper is vague:

* Which layers are "conv", the post-activation map, the matrix rank and the data:
  :mod:`fedpartial._src.methods.adaptive.hrank`.
* Ties: maps are small (a 4x4 map has rank <= 4), so many filters tie.  To each
  filter's average rank we add ``0.5 / B · t_c``, where ``B`` is the number of
  real images and ``t_c in [0, 1]`` is the filter's mean absolute activation
  divided by the largest over the layer's filters.  Averages over ``B`` images
  are multiples of ``1/B``, so two distinct averages differ by at least ``1/B``
  > ``0.5/B``: **a strictly higher rank always stays higher**, and among equal
  ranks the filter with larger activations is more important; equal
  activations stay exactly equal (also deterministic).  Only
  :func:`unit_importance` adds it; :func:`~fedpartial._src.methods.adaptive.hrank.filter_ranks` is the plain average.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp

from fedpartial._src.core.structure import Path
from fedpartial._src.methods.adaptive.hrank import conv_statistics, subtree, importance_kinds
from fedpartial._src.models.adapter import Model

# importance_kinds (from hrank) is part of this API too: FedAD groups its units by it
__all__ = ["dense_weight_sums", "importance_kinds", "unit_importance"]


def dense_weight_sums(model: Model, params: Mapping[str, Any]) -> tuple[jax.Array | None, ...]:
    """Signed sum of each dense neuron's input weights: float32 ``[units]`` per dense layer, None per conv.

    ``params`` is ``variables['params']``.  The sum runs over every kernel axis
    but the last (``kernel.sum(0)`` for a Dense kernel); the bias is not an input
    weight.  The classifier gets its sums too (:func:`unit_importance` zeros it).
    """
    out = []
    for kind, layer in zip(importance_kinds(model), model.structure.layers, strict=True):
        if kind == "conv":
            out.append(None)
            continue
        kernel = jnp.asarray(_kernel(params, layer.path), jnp.float32)
        out.append(kernel.reshape((-1, kernel.shape[-1])).sum(axis=0))
    return tuple(out)


def unit_importance(
    model: Model, variables: Mapping[str, Any], x: jax.Array, example_mask: jax.Array | None = None
) -> tuple[jax.Array, ...]:
    """FedAD's importance of every unit: float32 ``[units]`` per layer.

    A conv layer gets its filters' average ranks plus the tie-breaker ``0.5/B ·
    t_c`` (module docstring: ties go to larger activations, a higher rank always
    stays higher); a dense layer its neurons' signed input-weight sums; the
    classifier zeros (never dropped; present only so there is one entry per
    layer).  Arguments as for
    :func:`~fedpartial._src.methods.adaptive.hrank.filter_ranks`; ``x`` is not run through the
    model when it has no conv layer.
    """
    ranks, activity, count = conv_statistics(model, variables, x, example_mask)
    sums = dense_weight_sums(model, variables["params"])
    out = []
    for r, a, s in zip(ranks, activity, sums, strict=True):
        if r is None:
            out.append(s)
            continue
        top = a.max()
        t = jnp.where(top > 0, a / jnp.where(top > 0, top, 1.0), 0.0)  # in [0, 1]
        out.append(r + (0.5 / jnp.maximum(count, 1.0)) * t)
    last = model.structure.layers[-1].units
    out[-1] = jnp.zeros((last,), jnp.float32)
    return tuple(out)


def _kernel(params, path: Path):
    """The module's kernel: its ``kernel`` leaf, else its highest-rank leaf (as the structure picks units)."""
    leaves = subtree(params, path)
    if "kernel" in leaves:
        return leaves["kernel"]
    return max(leaves.values(), key=lambda a: (jnp.ndim(a), jnp.size(a)))

