"""Hessian spectrum by Lanczos, and FedAD's eigen-gap dropout-rate criterion (FedDHAD §5.2.1).

The paper sorts the eigenvalues ``E^1 ≤ … ≤ E^h`` of the Hessian ``H(W'_k)`` of a
client's local loss at its trained model (``h`` = rank of the Hessian), takes the
first ``m`` with ``E^{m+1} − E^m > 4·L_k`` and sets the client's rate ``d_k = m/h``;
the server then averages ``d_avg = Σ n_k d_k / Σ n_k`` over the selected clients.

Decisions taken where the paper is vague:

* **The Hessian is never formed.** :func:`hvp` is forward-over-reverse
  (``jax.jvp`` of ``jax.grad``); :func:`hessian_spectrum` runs :func:`lanczos`
  on the flattened parameters (``jax.flatten_util.ravel_pytree``) and returns the
  Ritz values.  With ``num_iter < dim`` these are a ``num_iter``-point
  approximation of the spectrum (the extremes converge first, interior clusters
  are represented by a few Ritz values), so ``m/h`` is measured on that
  approximation, not on all ``dim`` eigenvalues; ``num_iter = dim`` gives the
  exact spectrum up to float round-off.
* **Full re-orthogonalisation** (classical Gram-Schmidt, twice) against the stored
  basis ``[num_iter, dim]`` keeps the basis orthonormal in float32, so no ghost
  copies of converged eigenvalues appear.
* **Breakdown.**  When the residual ``β_j`` falls below ``breakdown_tol · ‖A‖``
  (``‖A‖`` estimated by the largest ``‖A q_i‖`` seen so far), the Krylov space is an
  invariant subspace (repeated eigenvalues, or the null space of a softmax layer's
  shift invariance).  The iteration then *restarts* with a fresh Gaussian vector
  orthogonalised against the basis and records ``β_j = 0``: the tridiagonal becomes
  block diagonal and every extra Ritz value is a genuine eigenvalue of the operator
  restricted to the orthogonal complement, not a spurious zero.  The dropped
  coupling is below the tolerance, so Ritz values move by at most that much.
* **"The Lipschitz constant of B_k"** (``B_k(Δ_k) = H(W'_k) − ∇L(W_k)``, not
  well-defined as written) is estimated by :func:`secant_lipschitz`: the secant
  Lipschitz constant of the local gradient along the client's update, from the
  round's start model ``W_k`` to its trained model ``W'_k``:
  ``‖∇L(W'_k) − ∇L(W_k)‖ / ‖W'_k − W_k‖`` (two gradients, cheap).
* **Rank and zero eigenvalues.**  ``h`` is the numerical rank: eigenvalues with
  ``|e| ≤ rank_tol · max|e|`` are treated as zeros and excluded; the gaps are taken
  between consecutive *kept* eigenvalues in ascending order (so a gap may straddle
  the excluded zeros when the spectrum has negative eigenvalues).  No qualifying
  gap, or ``h < 2``, gives ``d = 0``.  Since ``L`` lies within the spectrum's range
  along the update, a gap above ``4L`` needs a well-separated cluster of eigenvalues;
  on small random models ``d = 0`` is the usual outcome (the paper's criterion, kept as is).

Everything is pure and jittable with fixed iteration counts (``lax.scan``), and
vmaps over a client axis: FedAD runs it for every client of a cohort inside a
jitted round (:func:`eigengap_dropout_rate` is that per-client composition).
``num_iter`` must be a Python int.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from fedpartial._src.core.errors import UserError


def hvp(loss_fn: Callable[[Any], jax.Array], params: Any, v: Any) -> Any:
    """Hessian-vector product ``H(params) · v`` by forward-over-reverse differentiation.

    Args:
      loss_fn: scalar function of the parameter pytree.
      params: point where the Hessian is taken.
      v: tangent pytree with the structure of ``params``.

    Returns:
      ``H v`` as a pytree with the structure of ``params``.
    """
    return jax.jvp(jax.grad(loss_fn), (params,), (v,))[1]


def _check_iterations(num_iter: Any, dim: Any) -> None:
    if not isinstance(dim, int) or dim < 1:
        raise UserError(f"dim={dim!r} is not allowed: the vector space dimension must be a positive Python int.")
    if not isinstance(num_iter, int) or isinstance(num_iter, bool) or not 1 <= num_iter <= dim:
        raise UserError(f"num_iter={num_iter!r} is not allowed: it must be a Python int between 1 and dim={dim}.")


def _orthogonalise(basis: jax.Array, w: jax.Array) -> jax.Array:
    # Classical Gram-Schmidt twice ("twice is enough"); rows not yet filled are zero and project nothing.
    w = w - basis.T @ (basis @ w)
    return w - basis.T @ (basis @ w)


def _normalise(w: jax.Array) -> jax.Array:
    norm = jnp.linalg.norm(w)
    return w / jnp.where(norm > 0, norm, jnp.ones_like(norm))


def lanczos(
    matvec: Callable[[jax.Array], jax.Array],
    dim: int,
    num_iter: int,
    key: jax.Array,
    dtype: Any = jnp.float32,
    *,
    breakdown_tol: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Symmetric Lanczos with full re-orthogonalisation; returns the tridiagonal ``T``.

    Args:
      matvec: symmetric linear map on vectors ``[dim]``.
      dim: dimension of the vector space (Python int).
      num_iter: number of Lanczos steps ``m`` (Python int, ``1 ≤ m ≤ dim``).
      key: PRNG key; the start vector and the restart candidates used after a
        breakdown are normalised Gaussians drawn from it.
      dtype: floating dtype of the basis and of ``T``.
      breakdown_tol: a residual ``β_j ≤ breakdown_tol · ‖A‖`` counts as an exhausted
        invariant subspace (default ``sqrt(eps(dtype))``); the iteration then
        restarts orthogonally and records ``β_j = 0`` (see the module docstring).

    Returns:
      ``(alphas [m], betas [m-1])``: diagonal and off-diagonal of ``T = Qᵀ A Q``;
      its eigenvalues are the Ritz values.
    """
    _check_iterations(num_iter, dim)
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise UserError(f"dtype={dtype} is not allowed: Lanczos needs a floating dtype such as float32.")
    tol = float(jnp.finfo(dtype).eps) ** 0.5 if breakdown_tol is None else float(breakdown_tol)
    # One draw for the start vector and every restart candidate: the random generator stays out of the loop
    # body, and a single generator instance keeps compilation cheap.
    gaussians = jax.random.normal(key, (num_iter + 1, dim), dtype)
    q0 = _normalise(gaussians[0])

    def step(carry, xs):
        j, fresh = xs
        basis, q, anorm = carry
        basis = basis.at[j].set(q)
        w = jnp.asarray(matvec(q), dtype)
        alpha = jnp.vdot(q, w)
        anorm = jnp.maximum(anorm, jnp.linalg.norm(w))
        # Against the whole basis (q and its predecessor included), so no three-term recurrence is needed.
        w = _orthogonalise(basis, w)
        beta = jnp.linalg.norm(w)
        broke = beta <= tol * anorm
        fresh = _normalise(_orthogonalise(basis, fresh))
        q_next = jnp.where(broke, fresh, w / jnp.where(broke, jnp.ones_like(beta), beta))
        return (basis, q_next, anorm), (alpha, jnp.where(broke, jnp.zeros_like(beta), beta))

    init = (jnp.zeros((num_iter, dim), dtype), q0, jnp.zeros((), dtype))
    _, (alphas, betas) = jax.lax.scan(step, init, (jnp.arange(num_iter), gaussians[1:]))
    # The last residual only matters for a step that is never taken.
    return alphas, betas[:-1]


def tridiagonal_eigenvalues(alphas: jax.Array, betas: jax.Array) -> jax.Array:
    """Ascending eigenvalues of the symmetric tridiagonal matrix with diagonal ``alphas`` and off-diagonal ``betas``."""
    t = jnp.diag(alphas) + jnp.diag(betas, 1) + jnp.diag(betas, -1)
    return jnp.linalg.eigvalsh(t)


def hessian_spectrum(loss_fn: Callable[[Any], jax.Array], params: Any, num_iter: int, key: jax.Array) -> jax.Array:
    """Ascending Ritz values ``[num_iter]`` of the Hessian of ``loss_fn`` at ``params``, by Hessian-vector products.

    ``params`` is flattened with ``ravel_pytree``; the Hessian is never formed.  With
    ``num_iter`` equal to the number of parameters the Ritz values are the eigenvalues.
    """
    flat, unravel = ravel_pytree(params)
    dtype = jnp.promote_types(flat.dtype, jnp.float32)
    # Linearise the gradient once: each Lanczos step is then one forward-mode pass, no recomputed primal.
    _, grad_jvp = jax.linearize(jax.grad(loss_fn), params)

    def matvec(x):
        return ravel_pytree(grad_jvp(unravel(x.astype(flat.dtype))))[0].astype(dtype)

    alphas, betas = lanczos(matvec, int(flat.size), num_iter, key, dtype)
    return tridiagonal_eigenvalues(alphas, betas)


def secant_lipschitz(grad_fn: Callable[[Any], Any], start: Any, end: Any) -> jax.Array:
    """``‖∇L(end) − ∇L(start)‖ / ‖end − start‖`` over flattened pytrees; 0 when ``end == start``."""
    step = ravel_pytree(end)[0] - ravel_pytree(start)[0]
    change = ravel_pytree(grad_fn(end))[0] - ravel_pytree(grad_fn(start))[0]
    dist = jnp.linalg.norm(step)
    moved = dist > 0
    return jnp.where(moved, jnp.linalg.norm(change) / jnp.where(moved, dist, jnp.ones_like(dist)), jnp.zeros_like(dist))


def eigengap_rate(eigenvalues_ascending: jax.Array, lipschitz: jax.Array, rank_tol: float = 1e-5) -> jax.Array:
    """FedAD's rate ``d = m/h`` from an ascending spectrum.

    Args:
      eigenvalues_ascending: ``[n]`` eigenvalues (or Ritz values) in ascending order.
      lipschitz: scalar Lipschitz estimate ``L``.
      rank_tol: eigenvalues with ``|e| ≤ rank_tol · max|e|`` count as zero and are excluded.

    Returns:
      Scalar ``m / h``: ``h`` the number of kept eigenvalues, ``m`` (1-based) the first
      index among them with ``e[m+1] − e[m] > 4 L``; 0 when there is no such gap.
    """
    e = jnp.asarray(eigenvalues_ascending)
    if e.ndim != 1:
        raise UserError(f"eigenvalues_ascending has shape {e.shape}: a 1-D array of eigenvalues is required.")
    scale = jnp.max(jnp.abs(e))
    keep = jnp.abs(e) > rank_tol * scale
    h = jnp.sum(keep)
    # A stable sort on "dropped" moves the kept values to the front, still ascending.
    kept = e[jnp.argsort(~keep, stable=True)]
    idx = jnp.arange(e.shape[0] - 1)
    qualifies = (idx + 1 < h) & (kept[1:] - kept[:-1] > 4 * lipschitz)
    m = jnp.argmax(qualifies) + 1
    found = jnp.any(qualifies)
    rate_dtype = jnp.promote_types(e.dtype, jnp.float32)
    return jnp.where(found, m.astype(rate_dtype) / jnp.maximum(h, 1).astype(rate_dtype), jnp.zeros((), rate_dtype))


def eigengap_dropout_rate(
    loss_fn: Callable[[Any], jax.Array],
    start: Any,
    trained: Any,
    num_iter: int,
    key: jax.Array,
    rank_tol: float = 1e-5,
) -> jax.Array:
    """One client's ``d_k``: eigen-gap rate of the Hessian at ``trained``, ``L`` the secant estimate from ``start``."""
    spectrum = hessian_spectrum(loss_fn, trained, num_iter, key)
    return eigengap_rate(spectrum, secant_lipschitz(jax.grad(loss_fn), start, trained), rank_tol)
