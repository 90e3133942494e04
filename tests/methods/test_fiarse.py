"""FIARSE: a plain-Python reference over three rounds (top-r_k by |global|, TCB-GD with momentum, each element
averaged over its holders), the reduction to FedAvg, upload bytes by hand, exactly ⌊r·P⌋ held under ties, the
TCB-GD gradient, and bad options in one sentence."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedpartial._src.core.errors import UserError
from fedpartial._src.core.types import MethodContext, client_sgd
from fedpartial._src.engine.metrics import traffic_totals
from fedpartial._src.engine.round import FederatedRound
from fedpartial._src.engine.strategy import stepwise
from fedpartial._src.methods.catalog import get_method
from fedpartial._src.methods.submodel.fiarse import extract, fiarse, kept_count, threshold_masked
from tests.conftest import make_cohort
from tests.methods.test_heterofl import LR, MOMENTUM, SMALL, _narrow_grad, adapt, build, start

# Rounds of a few steps, each test its own programs: compiled at -O0 (tests/conftest.py says why that changes
# nothing here)
pytestmark = pytest.mark.usefixtures("engine_compiled_at_o0")

N = 4
RATIOS = (0.25, 0.5, 0.75, 1.0)  # one tier per client id (equal clusters of one)
IDS = ([0, 2, 3], [1, 2, 3], [0, 1, 3])
P = 4 * 6 + 6 + 6 * 5 + 5 + 5 * 3 + 3  # SMALL's ranked elements: every kernel and bias (83)


def cohorts(rounds=3):
    return [make_cohort((4,), k=3, steps=3, batch=5, seed=t, real_steps=[3, 2, 3], real_examples=[5, 3, 4],
                        client_ids=IDS[t]) for t in range(rounds)]


def held_by_hand(g, ratio):
    """The ``⌊r·P⌋`` elements of largest |g| (ties: the lower flat index) as a params-shaped tree, and τ."""
    leaves = jax.tree.leaves(g)
    magnitude = np.abs(np.concatenate([np.asarray(a, np.float32).ravel() for a in leaves]))
    order = sorted(range(magnitude.size), key=lambda i: (-magnitude[i], i))
    n = max(1, int(np.floor(round(ratio * magnitude.size, 9))))
    flat = np.zeros(magnitude.size, bool)
    flat[order[:n]] = True
    out, offset = [], 0
    for a in leaves:
        out.append(flat[offset:offset + a.size].reshape(a.shape))
        offset += a.size
    return jax.tree.unflatten(jax.tree.structure(g), out), 0.0 if ratio >= 1 else float(magnitude[order[n - 1]])


def reference(global_params, data):
    """FIARSE as the paper writes it, one client at a time: hold the top r_k of |global|, train with TCB-GD
    (forward θ·m, m = held ∧ |θ| ≥ τ; a kept element's gradient × (1 + 2τ|θ|/(|θ|+τ)²)) and momentum SGD on
    the held elements only (the others keep value and momentum 0), then average each element over its holders
    with n_k weights."""
    g = jax.tree.map(lambda a: np.array(a, np.float64), global_params)
    for c in data:
        g = jax.tree.map(lambda a: a.astype(np.float32).astype(np.float64), g)  # the server's model is float32
        d, num, den = c.data, jax.tree.map(np.zeros_like, g), jax.tree.map(np.zeros_like, g)
        for k, client in enumerate(c.info.client_ids):
            held, tau = held_by_hand(g, RATIOS[client * len(RATIOS) // N])
            p, v = jax.tree.map(np.copy, g), jax.tree.map(np.zeros_like, g)
            for s in range(d.step_mask.shape[1]):
                if not d.step_mask[k, s]:
                    continue
                on = jax.tree.map(lambda h, a: h & (np.abs(a) >= tau), held, p)
                w = jax.tree.map(lambda a, m: np.where(m, a, 0.0).astype(np.float32), p, on)
                grads = _narrow_grad(w, d.x[k, s], d.y[k, s], d.example_mask[k, s].astype(np.float32), 1.0)
                for path in ((a, b) for a in p for b in p[a]):
                    a, m, h = p[path[0]][path[1]], on[path[0]][path[1]], held[path[0]][path[1]]
                    factor = 1.0 + (2 * tau * np.abs(a) / (np.abs(a) + tau) ** 2 if tau > 0 else 0.0)
                    grad = np.where(m, np.asarray(grads[path[0]][path[1]]) * factor, 0.0)
                    vel = v[path[0]][path[1]]
                    vel[h] = MOMENTUM * vel[h] + grad[h]
                    a[h] -= LR * vel[h]
            n = float(c.info.num_samples[k])
            num = jax.tree.map(lambda t, h, a: t + n * h * a, num, held, p)
            den = jax.tree.map(lambda t, h: t + n * h, den, held)
        g = jax.tree.map(lambda a, t, w: np.where(w > 0, t / np.where(w > 0, w, 1.0), a), g, num, den)
    return g


def test_engine_matches_a_plain_python_reference():
    r = FederatedRound(adapt(SMALL, (4,)), get_method("fiarse", ratios=RATIOS), num_clients=N, cohort_size=3,
                       client_optimizer=client_sgd(LR, momentum=MOMENTUM), strategy=stepwise(1))
    state = start(r)
    expected = reference(jax.device_get(state.variables["params"]), cohorts())
    for t, c in enumerate(cohorts()):
        state, _ = r(state, c, jax.random.key(t))
    chex.assert_trees_all_close(jax.device_get(state.variables["params"]), expected, rtol=2e-5, atol=2e-6)


def test_every_ratio_one_is_fedavg():
    model = adapt(SMALL, (4,))
    results = []
    for method in (get_method("fiarse", ratios=(1.0,)), get_method("fedavg")):
        r = build(model, method, n=N, k=3)
        state = start(r)
        for t, c in enumerate(cohorts(2)):
            state, _ = r(state, c, jax.random.key(t))
        results.append(jax.device_get(state.variables))
    chex.assert_trees_all_close(*results, rtol=1e-6, atol=1e-7)


def test_upload_and_download_bytes_by_hand():
    """Per client: 4 bytes a held value, plus per leaf min(bitmap ⌈size/8⌉, 4 bytes an index)."""
    r = build(adapt(SMALL, (4,)), get_method("fiarse", ratios=RATIOS), n=N, k=3)
    state = start(r)
    c = cohorts(1)[0]
    want = []
    for client in c.info.client_ids:
        held, _ = held_by_hand(jax.device_get(state.variables["params"]), RATIOS[client])
        want.append(sum(4 * int(h.sum()) + min(-(-h.size // 8), 4 * int(h.sum())) for h in jax.tree.leaves(held)))
    assert [kept_count(RATIOS[i], P) for i in c.info.client_ids] == [20, 62, 83]
    _, m = r(state, c, jax.random.key(0))
    traffic = traffic_totals(m)
    np.testing.assert_array_equal(traffic["upload_bytes_per_client"], want)
    np.testing.assert_array_equal(traffic["download_bytes_per_client"], want)


def test_exactly_the_floor_of_r_times_p_held_under_ties():
    """Many equal magnitudes: each client holds exactly max(1, ⌊r·P⌋), the ties going to the lower flat index;
    τ is the last held magnitude (0 at ratio 1), and the sub-models are nested."""
    model = adapt(SMALL, (4,))
    ctx = MethodContext(model, 5, 5)
    rng = np.random.default_rng(0)
    shapes = jax.eval_shape(model.init_variables, jax.random.key(0))["params"]
    params = jax.tree.map(lambda s: jnp.asarray(rng.choice([-0.5, 0.5, 0.25, -1.0], s.shape), jnp.float32), shapes)
    ratios = (0.001, 0.29, 0.5, 0.9, 1.0)
    elements, tau = extract(ctx, params, ratios, jnp.arange(5))
    for k, ratio in enumerate(ratios):
        mine = jax.tree.map(lambda e, k=k: np.asarray(e[k]), elements)
        want, want_tau = held_by_hand(params, ratio)
        assert sum(int(e.sum()) for e in jax.tree.leaves(mine)) == max(1, int(ratio * P + 1e-9)) == kept_count(ratio, P)
        jax.tree.map(np.testing.assert_array_equal, mine, want)
        assert float(tau[k]) == want_tau
        if k:
            jax.tree.map(lambda a, b: np.testing.assert_array_equal(a & b, a), *(jax.tree.map(
                lambda e, i=i: np.asarray(e[i]), elements) for i in (k - 1, k)))
    assert kept_count(0.29, 100) == 29 and kept_count(0.36, 100) == 36


def test_the_tcb_gd_gradient():
    """Forward θ·m with m = held ∧ |θ| ≥ τ; the gradient of a kept element is g·(1 + 2τ|θ|/(|θ|+τ)²)."""
    theta = jnp.asarray([0.8, -0.5, 0.3, -2.0, 0.0, 0.6])
    held = jnp.asarray([True, True, True, True, True, False])
    coef = jnp.asarray([1.0, 2.0, -1.0, 0.5, 3.0, 1.0])
    tau = jnp.float32(0.5)
    out = threshold_masked(theta, held, tau)
    np.testing.assert_array_equal(out, np.float32([0.8, -0.5, 0.0, -2.0, 0.0, 0.0]))
    grad = jax.grad(lambda t: jnp.sum(coef * threshold_masked(t, held, tau)))(theta)
    a = np.abs(np.asarray(theta))
    on = np.asarray(held) & (a >= 0.5)
    np.testing.assert_allclose(grad, np.where(on, np.asarray(coef) * (1 + a / (a + 0.5) ** 2), 0.0), rtol=1e-6)
    # τ = 0 (a ratio of 1): the plain gradient, 0 included
    np.testing.assert_array_equal(jax.grad(lambda t: jnp.sum(coef * threshold_masked(t, held, 0.0)))(theta),
                                  np.where(np.asarray(held), coef, 0.0))


def test_bad_options_are_one_sentence():
    with pytest.raises(UserError, match=r"^fiarse: --ratios = \(0\.0, 1\.0\) must be keep ratios in \(0, 1\], "):
        get_method("fiarse", ratios=(0.0, 1.0))
    with pytest.raises(UserError, match=r"^fiarse: --ratios = \(1\.5,\) must be keep ratios in \(0, 1\]"):
        fiarse(ratios=(1.5,))  # the factory called directly checks too
