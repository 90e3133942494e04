"""Lanczos Hessian spectrum against the dense Hessian, and FedAD's eigen-gap rate on hand-computed spectra."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

from fedpartial._src.core.errors import UserError
from fedpartial._src.methods.adaptive.hessian import (
    eigengap_dropout_rate,
    eigengap_rate,
    hessian_spectrum,
    hvp,
    lanczos,
    secant_lipschitz,
    tridiagonal_eigenvalues,
)


def _mlp_params(key):
    k1, k2, k3, k4 = jax.random.split(key, 4)
    return {"w1": 0.8 * jax.random.normal(k1, (4, 5)), "b1": 0.3 * jax.random.normal(k2, (5,)),
            "w2": 0.8 * jax.random.normal(k3, (5, 3)), "b2": 0.3 * jax.random.normal(k4, (3,))}


def _mlp_loss(params, x, y):
    """4 → tanh(5) → 3 softmax cross-entropy: 43 parameters; the logit shift invariance gives a 6-dim null space."""
    logits = jnp.tanh(x @ params["w1"] + params["b1"][None]) @ params["w2"] + params["b2"][None]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))


def _data(seed):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.normal(size=(16, 4)), jnp.float32), jnp.asarray(rng.integers(0, 3, 16), jnp.int32)


# Jitted so that each spectrum costs one compilation rather than an op-by-op trace of the linearised gradient.
_spectrum = jax.jit(hessian_spectrum, static_argnums=(0, 2))


@pytest.fixture(scope="module")
def problem():
    x, y = _data(0)
    params = _mlp_params(jax.random.key(0))
    loss = lambda p: _mlp_loss(p, x, y)  # noqa: E731
    flat, unravel = ravel_pytree(params)
    dense = jax.jit(jax.hessian(lambda f: loss(unravel(f))))(flat)
    eigs = np.linalg.eigvalsh(np.asarray(dense, np.float64))
    return loss, params, np.asarray(dense), eigs


def test_hvp_equals_dense_hessian_times_v(problem):
    loss, params, dense, _ = problem
    v = _mlp_params(jax.random.key(7))
    product = jax.jit(hvp, static_argnums=0)(loss, params, v)
    chex.assert_trees_all_equal_structs(product, params)
    got = ravel_pytree(product)[0]
    np.testing.assert_allclose(got, dense @ np.asarray(ravel_pytree(v)[0]), rtol=1e-4, atol=1e-5)


def test_full_lanczos_matches_dense_spectrum(problem):
    loss, params, _, eigs = problem
    dim = eigs.size
    scale = np.abs(eigs).max()
    # The shift-invariance null space has multiplicity 6: the Krylov space is exhausted before dim steps,
    # so matching all eigenvalues needs the restart after breakdown.
    assert np.sum(np.abs(eigs) < 1e-5 * scale) >= 6
    ritz = _spectrum(loss, params, dim, jax.random.key(1))
    chex.assert_shape(ritz, (dim,))
    np.testing.assert_allclose(ritz, eigs, rtol=1e-3, atol=1e-3 * scale)


def test_half_lanczos_matches_extreme_eigenvalues(problem):
    loss, params, _, eigs = problem
    ritz = np.asarray(_spectrum(loss, params, eigs.size // 2, jax.random.key(1)))
    chex.assert_shape(ritz, (eigs.size // 2,))
    assert np.all(np.diff(ritz) >= 0)
    scale = np.abs(eigs).max()
    np.testing.assert_allclose(ritz[[0, -1]], eigs[[0, -1]], rtol=1e-3, atol=1e-3 * scale)
    # Ritz values interlace inside the spectrum.
    assert eigs[0] - 1e-4 * scale <= ritz.min() and ritz.max() <= eigs[-1] + 1e-4 * scale


def test_lanczos_restarts_on_repeated_eigenvalues():
    # diag(1,1,1,2,2,3): a Krylov space holds one vector per distinct eigenvalue, so it is exhausted after
    # 3 steps ({1,2,3}), the restart's after 2 more ({1,2}), the last restart finds the remaining 1.
    d = jnp.array([1.0, 1.0, 1.0, 2.0, 2.0, 3.0])
    alphas, betas = jax.jit(lambda key: lanczos(lambda v: d * v, 6, 6, key))(jax.random.key(0))
    chex.assert_shape((alphas, betas), ((6,), (5,)))
    np.testing.assert_array_equal(np.asarray(betas) == 0, [False, False, True, False, True])
    np.testing.assert_allclose(tridiagonal_eigenvalues(alphas, betas), [1, 1, 1, 2, 2, 3], atol=1e-5)


def test_lanczos_zero_operator_is_all_zeros_and_finite():
    alphas, betas = jax.jit(lambda key: lanczos(jnp.zeros_like, 5, 5, key))(jax.random.key(3))
    np.testing.assert_array_equal(alphas, np.zeros(5))
    np.testing.assert_array_equal(betas, np.zeros(4))


def test_tridiagonal_eigenvalues_by_hand():
    # [[2,1],[1,2]] has eigenvalues 1 and 3.
    np.testing.assert_allclose(tridiagonal_eigenvalues(jnp.array([2.0, 2.0]), jnp.array([1.0])), [1.0, 3.0], atol=1e-6)


BASE = [1.0, 1.1, 1.2, 5.0, 5.1, 9.0]  # gaps 0.1, 0.1, 3.8, 0.1, 3.9


@pytest.mark.parametrize("eigs, lipschitz, rank_tol, expected", [
    (BASE, 0.5, 1e-5, 3 / 6),              # 4L = 2: first gap above is 1.2 → 5 (m = 3)
    (BASE, 0.96, 1e-5, 5 / 6),             # 4L = 3.84: 3.8 is not enough, 5.1 → 9 is (m = 5)
    (BASE, 1.0, 1e-5, 0.0),                # 4L = 4: no gap
    (BASE, 0.0, 1e-5, 1 / 6),              # every positive gap qualifies: the first one
    ([0.0, 0.0] + BASE, 0.5, 1e-5, 3 / 6),  # zeros are excluded from h and from the gaps
    ([-4.0, -1e-8, 0.0, 1.0, 1.1], 0.5, 1e-5, 1 / 3),  # kept -4, 1, 1.1: the gap straddles the zeros
    ([1e-3, 1.0, 1.1, 9.0], 0.5, 1e-5, 3 / 4),   # 1e-3 is above the rank tolerance: gaps .999, .1, 7.9
    ([1e-3, 1.0, 1.1, 9.0], 0.5, 1e-2, 2 / 3),   # ... and below this one: kept 1, 1.1, 9
    ([1.0, 3.0], 0.5, 1e-5, 0.0),          # gap exactly 4L is not larger
    ([0.0, 0.0, 0.0, 5.0], 0.0, 1e-5, 0.0),  # h = 1 < 2
    ([0.0, 0.0, 0.0], 0.0, 1e-5, 0.0),     # zero Hessian: h = 0
])
def test_eigengap_rate_by_hand(eigs, lipschitz, rank_tol, expected):
    rate = eigengap_rate(jnp.asarray(eigs, jnp.float32), jnp.float32(lipschitz), rank_tol)
    chex.assert_shape(rate, ())
    np.testing.assert_allclose(rate, expected, rtol=1e-6)


def test_secant_lipschitz_on_quadratic():
    rng = np.random.default_rng(3)
    m = rng.normal(size=(4, 4))
    a = jnp.asarray(m + m.T, jnp.float32)
    split = lambda x: {"u": x[:2], "v": x[2:]}  # noqa: E731
    grad_fn = jax.grad(lambda p: 0.5 * ravel_pytree(p)[0] @ a @ ravel_pytree(p)[0])
    s, e = rng.normal(size=4).astype(np.float32), rng.normal(size=4).astype(np.float32)
    expected = np.linalg.norm(np.asarray(a) @ (e - s)) / np.linalg.norm(e - s)
    np.testing.assert_allclose(secant_lipschitz(grad_fn, split(s), split(e)), expected, rtol=1e-5)
    assert float(secant_lipschitz(grad_fn, split(s), split(s))) == 0.0


def test_eigengap_dropout_rate_end_to_end_on_diagonal_quadratic():
    # Spectrum 0, 0, 1, 1.1, 1.2, 5, 5.1, 9; the update moves (√3, 1) along the eigenvalues (0, 1), so the
    # secant Lipschitz is 1 / 2; 4L = 2 → m = 3 among h = 6 non-zero eigenvalues → d = 1/2.
    lam = jnp.array([0.0, 0.0, 1.0, 1.1, 1.2, 5.0, 5.1, 9.0])
    loss = lambda p: 0.5 * jnp.sum(lam * p["x"] ** 2)  # noqa: E731
    start = {"x": jnp.full((8,), 0.25)}
    trained = {"x": start["x"].at[0].add(np.sqrt(3.0)).at[2].add(1.0)}
    np.testing.assert_allclose(secant_lipschitz(jax.grad(loss), start, trained), 0.5, rtol=1e-6)
    rate = jax.jit(eigengap_dropout_rate, static_argnums=(0, 3))(loss, start, trained, 8, jax.random.key(0))
    np.testing.assert_allclose(rate, 0.5, rtol=1e-6)


def test_vmap_over_clients_equals_separate_calls_and_jit_is_deterministic():
    num_iter = 12
    xs, ys = zip(*[_data(s) for s in (1, 2)])
    starts = [_mlp_params(jax.random.key(s)) for s in (10, 11)]
    # Moving only w1 keeps L small (~0.2) while a penalty 5·‖b2‖² lifts three eigenvalues to ~10, so the
    # 12 Ritz values split 9 | 3 around a gap far above 4L: d = 9/12 for both clients, a non-trivial rate.
    trained = [dict(p, w1=p["w1"] + 0.05) for p in starts]
    keys = jax.random.split(jax.random.key(5), 2)

    def client(start, params, x, y, key):
        loss = lambda p: _mlp_loss(p, x, y) + 5.0 * jnp.sum(p["b2"] ** 2)  # noqa: E731
        # The composition eigengap_dropout_rate performs, spelled out so the spectrum is computed once.
        spectrum = hessian_spectrum(loss, params, num_iter, key)
        return spectrum, eigengap_rate(spectrum, secant_lipschitz(jax.grad(loss), start, params))

    stack = lambda trees: jax.tree.map(lambda *a: jnp.stack(a), *trees)  # noqa: E731
    args = (stack(starts), stack(trained), jnp.stack(xs), jnp.stack(ys), keys)
    batched = jax.jit(jax.vmap(client))
    spectra, rates = batched(*args)
    chex.assert_shape((spectra, rates), ((2, num_iter), (2,)))
    chex.assert_tree_all_finite((spectra, rates))
    np.testing.assert_allclose(rates, [0.75, 0.75], rtol=1e-6)
    single = jax.jit(client)  # one compilation for both clients
    for k in range(2):
        one_spectrum, one_rate = single(starts[k], trained[k], xs[k], ys[k], keys[k])
        np.testing.assert_allclose(spectra[k], one_spectrum, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(rates[k], one_rate, rtol=1e-6)
    again = batched(*args)
    chex.assert_trees_all_equal(again, (spectra, rates))


@pytest.mark.parametrize("num_iter", [0, 7, 2.0, True])
def test_bad_num_iter_is_a_user_error(num_iter):
    with pytest.raises(UserError, match="num_iter"):
        lanczos(lambda v: v, 6, num_iter, jax.random.key(0))


def test_bad_inputs_are_user_errors():
    with pytest.raises(UserError, match="dtype"):
        lanczos(lambda v: v, 3, 3, jax.random.key(0), dtype=jnp.int32)
    with pytest.raises(UserError, match="eigenvalues_ascending"):
        eigengap_rate(jnp.ones((2, 2)), 1.0)
