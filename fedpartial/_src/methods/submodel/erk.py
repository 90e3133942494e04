"""FedDST's static layout: which kernels are sparse and how many weights each keeps (ERK), and its bytes.

Every kernel (a ``params`` leaf with an input axis) keeps a fixed number ``n_l`` of its
weights (:func:`layout`: :func:`erk_counts` of :func:`erk_densities`); biases and
normaliser parameters are dense.  :func:`sparse_layer_bytes` is what the sparse model
costs to send.  The method is :func:`fedpartial._src.methods.submodel.feddst.feddst`.

Decisions:

* **Target sparsity and ERK.**  ``sparsity`` s (default 0.8, the paper's headline
  setting) counts kernel weights only (every parameter leaf of rank ≥ 2 that is not
  a normaliser's: Dense and Conv kernels, embeddings; the classifier is treated like
  every other layer).  Densities follow the standard Erdős–Rényi-Kernel rule:
  ``density_l = ε · Σ(kernel dims)/Π(kernel dims)``, ε chosen so that the kept count
  is ``(1 − s)·total``; layers whose density would exceed 1 are fixed dense and ε is
  recomputed for the rest.  (The reference code counts biases into the layer sizes
  and has no dense fix; we do the standard procedure.)
* **Rounding.**  The total kept is ``round_half_up((1 − s) · total)`` exactly; layer
  counts are the floors of ``density_l · size_l`` plus one for the layers with the
  largest fractional parts (largest-remainder apportionment, ties to the kernel
  that comes first in the ``params`` tree), so every round keeps exactly the same
  count per layer.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Sequence

import jax.numpy as jnp
import numpy as np

from fedpartial._src.core.structure import leaf_paths
from fedpartial._src.methods.base import MethodContext


class Layout(NamedTuple):
    """Static facts about the ``params`` leaves (flatten order): which are masked and how many they keep."""

    sparse: tuple[bool, ...]
    counts: tuple[int, ...]  # kept elements per leaf (its size for a dense leaf)


def erk_densities(shapes: Sequence[Sequence[int]], sparsity: float) -> tuple[float, ...]:
    """Erdős–Rényi-Kernel densities of kernels of ``shapes`` at a total ``sparsity``.

    ``density_l = ε · Σ dims_l / Π dims_l``; a layer whose density would exceed 1 is
    fixed dense and ε is solved again over the others (ε only grows when a layer is
    fixed, so fixing every layer over 1 at once is the same as one at a time).
    """
    sizes = [math.prod(s) for s in shapes]
    raw = [sum(s) / n for s, n in zip(shapes, sizes)]
    dense: set[int] = set()
    eps = 0.0
    while len(dense) < len(sizes):
        budget = (1 - sparsity) * sum(sizes) - sum(sizes[i] for i in dense)
        eps = budget / sum(raw[i] * sizes[i] for i in range(len(sizes)) if i not in dense)
        over = {i for i in range(len(sizes)) if i not in dense and raw[i] * eps > 1}
        if not over:
            break
        dense |= over
    return tuple(1.0 if i in dense else raw[i] * eps for i in range(len(sizes)))


def erk_counts(shapes: Sequence[Sequence[int]], sparsity: float) -> tuple[int, ...]:
    """Kept weights per kernel: ERK densities apportioned so the total is exactly
    ``round_half_up((1 − sparsity) · Σ sizes)`` (largest remainders; ties to the earlier kernel in ``shapes``)."""
    sizes = [math.prod(s) for s in shapes]
    # Snap float noise first (0.2·69 = 13.799…98 must not decide a rounding).
    exact = [round(d * n, 9) for d, n in zip(erk_densities(shapes, sparsity), sizes)]
    counts = [min(int(math.floor(e)), n) for e, n in zip(exact, sizes)]
    total = int(math.floor(round((1 - sparsity) * sum(sizes), 9) + 0.5))
    order = sorted((i for i in range(len(sizes)) if counts[i] < sizes[i]), key=lambda i: (counts[i] - exact[i], i))
    for i in order[:max(total - sum(counts), 0)]:
        counts[i] += 1
    return tuple(counts)


def layout(ctx: MethodContext, params: Any, sparsity: float) -> Layout:
    """Which ``params`` leaves are masked (kernels: leaves with an input axis) and their ERK counts."""
    paths = leaf_paths(params)
    sparse = tuple(ctx.structure.role("params", p).has_input_axis for p, _ in paths)
    kernel_counts = iter(erk_counts([jnp.shape(a) for (_, a), s in zip(paths, sparse) if s], sparsity))
    counts = tuple(next(kernel_counts) if s else int(math.prod(jnp.shape(a))) for (_, a), s in zip(paths, sparse))
    return Layout(sparse=sparse, counts=counts)


def sparse_layer_bytes(ctx: MethodContext, variables: dict, sparsity: float) -> np.ndarray:
    """``[L]`` bytes of the sparse model per layer (static): active kernel values + one mask bit per
    kernel element + dense leaves (+ BatchNorm statistics when they are communicated)."""
    params = variables["params"]
    out = np.zeros(ctx.structure.num_layers, np.int64)
    for (path, a), sparse, count in zip(leaf_paths(params), *layout(ctx, params, sparsity)):
        itemsize = jnp.dtype(a.dtype).itemsize
        out[ctx.structure.role("params", path).layer] += count * itemsize + (math.ceil(a.size / 8) if sparse else 0)
    if not ctx.batch_statistics:  # 'global' BatchNorm: running statistics travel too
        for path, a in leaf_paths(variables.get("batch_stats", {})):
            out[ctx.structure.role("batch_stats", path).layer] += a.size * jnp.dtype(a.dtype).itemsize
    return out
