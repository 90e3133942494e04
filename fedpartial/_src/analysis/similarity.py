"""Layer similarity between client models: SVCCA (Raghu et al., 2017), as EmbracingFL's Fig. 1/3 use it.

``svcca(a, b)`` compares two activation matrices of the same examples:

1. centre every unit (column) of each matrix;
2. keep each matrix's top-``k`` singular directions (the paper uses 4): the data
   projected onto them, ``U_k · S_k``;
3. CCA between the two reduced matrices — the canonical correlations are the
   singular values of ``Q_aᵀ Q_b`` for orthonormal bases ``Q`` of their columns;
4. report the mean canonical correlation (1: the top subspaces match up to a
   linear map; ≈ 0: unrelated).

Conv maps ``[n, H, W, C]`` are read as ``n·H·W`` points of ``C`` units (each spatial
position is a data point, as Google's SVCCA code does for conv layers).
:func:`layer_svcca` runs two models on the same inputs and compares one layer
(or stage output), e.g. two clients' models after local training, from a
notebook.  Everything is plain jnp; wrap it in ``jax.jit`` if used in a loop.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fedpartial._src.core.errors import UserError
from fedpartial._src.models.adapter import Model


def _points(a: jax.Array) -> jax.Array:
    a = jnp.asarray(a, jnp.float32)
    return a.reshape((-1, a.shape[-1])) if a.ndim > 2 else a.reshape((a.shape[0], -1))


def _top_directions(a: jax.Array, k: int) -> jax.Array:
    a = a - jnp.mean(a, axis=0, keepdims=True)
    u, s, _ = jnp.linalg.svd(a, full_matrices=False)
    return u[:, :k] * s[None, :k]


def canonical_correlations(a: jax.Array, b: jax.Array, eps: float = 1e-6) -> jax.Array:
    """Canonical correlations (descending) between the columns of ``a`` and ``b`` ([n, d] each)."""
    def basis(m):
        m = m - jnp.mean(m, axis=0, keepdims=True)
        q, r = jnp.linalg.qr(m)
        # A direction with no variance spans nothing: drop it from the basis.
        return q * (jnp.abs(jnp.diagonal(r)) > eps * jnp.max(jnp.abs(jnp.diagonal(r))))[None, :]

    rho = jnp.linalg.svd(basis(a).T @ basis(b), compute_uv=False)
    return jnp.clip(rho, 0.0, 1.0)


def svcca(a: jax.Array, b: jax.Array, k: int = 4) -> jax.Array:
    """Mean CCA coefficient of the top-``k`` singular directions of two activation matrices.

    Args:
      a, b: activations of the same examples, ``[n, units]`` or ``[n, ..., channels]``
        (unit counts may differ).
      k: singular directions kept from each (EmbracingFL: 4).
    """
    a, b = _points(a), _points(b)
    if a.shape[0] != b.shape[0]:
        raise UserError(f"SVCCA compares the same examples: got {a.shape[0]} and {b.shape[0]} data points.")
    k = int(k)
    if not 1 <= k <= min(a.shape[1], b.shape[1], a.shape[0] - 1):
        raise UserError(f"k = {k} singular directions must be between 1 and {min(a.shape[1], b.shape[1])} "
                        f"(the fewer units of the two) and fewer than the {a.shape[0]} data points.")
    return jnp.mean(canonical_correlations(_top_directions(a, k), _top_directions(b, k))[:k])


def layer_svcca(model: Model, variables_a: dict, variables_b: dict, x: jax.Array, layer: str, k: int = 4) -> jax.Array:
    """SVCCA of one layer's output (a layer name or ``"stage:<name>"``) under two models, on inputs ``x``."""
    out_a = model.intermediates(variables_a, x)
    if layer not in out_a:
        raise UserError(f"{layer!r} is not a layer or stage output of {model.name}; choose one of "
                        f"{', '.join(sorted(out_a))}.")
    return svcca(out_a[layer], model.intermediates(variables_b, x)[layer], k)
