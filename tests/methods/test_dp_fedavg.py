"""DP-FedAvg around a method: clipping on a hand-computed toy, the fixed denominator, the noise's std over many
draws, adaptive clipping, and ``z = 0, C = ∞`` bit for bit the wrapped method."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fedpartial as fp
from fedpartial._src.core import masks
from fedpartial._src.core.errors import UserError
from fedpartial._src.engine.program import carry
from fedpartial._src.methods.catalog import get_method
from fedpartial._src.methods.privacy.dp_fedavg import count_noise_std, sum_noise_multiplier
from tests.conftest import make_cohort

K = 3
WEIGHTS = np.array([1.0, 5.0, 10.0], np.float32)  # n_k: DP ignores them (each clipped update counts once)
# TinyMLP's layers: 0 = fc1 (+ bn1), 1 = fc2, 2 = head.  Client 2 does not upload the head, nobody uploads fc2.
UPLOAD = np.array([[1, 0, 1], [1, 0, 1], [1, 0, 0]], bool)


# Tests of a few tiny rounds compared with a tolerance or checked for a property: compiled at -O0
# (tests/conftest.py); not the test that expects z = 0, C = ∞ to equal the wrapped method bit for bit: two different
# programs, which the -O1 default compiles alike
AT_O0 = pytest.mark.usefixtures("engine_compiled_at_o0")


def round_of(mlp, method):
    return fp.FederatedRound(mlp, method, num_clients=6, cohort_size=K, client_optimizer=fp.client_sgd(0.1),
                             bn_policy="static")


def toy_view(rnd, upload=UPLOAD, deltas=None, key=0):
    """The view after training: client 0 moved fc1.kernel[0,0] by 3 and head.bias[0] by 4 (norm 5), client 1
    fc1.bias[1] by 0.3, client 2 fc1.kernel[1,1] by 3 and head.bias[2] by 4 (uploads only fc1: norm 3)."""
    state = rnd.init(jax.random.key(0))
    g = state.variables
    if deltas is None:
        deltas = jax.tree.map(lambda a: np.zeros((K, *a.shape), np.float32), g["params"])
        deltas["fc1"]["kernel"][0, 0, 0] = 3.0
        deltas["head"]["bias"][0, 0] = 4.0
        deltas["fc1"]["bias"][1, 1] = 0.3
        deltas["fc1"]["kernel"][2, 1, 1] = 3.0
        deltas["head"]["bias"][2, 2] = 4.0
    trained = {**g, "params": jax.tree.map(lambda a, d: a[None] + d, g["params"], deltas)}
    info = fp.CohortInfo(jnp.arange(K, dtype=jnp.int32), jnp.asarray(WEIGHTS), jnp.ones((K,), bool))
    selection = fp.Selection(masks.from_layers(rnd.ctx.structure, upload), jnp.asarray(WEIGHTS),
                             jnp.zeros((K,), jnp.int32))
    return fp.RoundView(key=jax.random.key(key), round=state.round, global_vars=g, method_state=state.method_state,
                        client_state=(), cohort=info, data=None, trained_vars=trained, start_vars=None,
                        selection=selection)


def moved(new, view):
    """``new − global`` per leaf (float64)."""
    return jax.tree.map(lambda n, g: np.asarray(n, np.float64) - np.asarray(g, np.float64), new,
                        view.global_vars["params"])


def aggregate(rnd, view):
    """The method's aggregate as the round calls it: ``(params, received)``, and the view that carries what it
    hands on to ``update`` and ``metrics`` (the clip factors, norms and upload counts)."""
    return carry("aggregate", rnd.method.aggregate(rnd.ctx, view), view)


@AT_O0
@pytest.mark.parametrize("per_layer", [False, True], ids=["flat", "per-layer"])
def test_clipping_and_the_fixed_denominator_on_a_toy(mlp, per_layer):
    # A noise multiplier of 1e-30 is the noised path with noise far below float32's resolution here.
    rnd = round_of(mlp, fp.dp_fedavg(fp.methods.fedavg(), clip=1.0, noise_multiplier=1e-30, per_layer=per_layer))
    view = toy_view(rnd)
    new, received = jax.jit(lambda v: aggregate(rnd, v)[0])(view)
    d = moved(new, view)
    # Flat: client 0's upload (norm 5) × 0.2, client 1's (0.3) kept, client 2's (norm 3 on what it uploads) × 1/3.
    # Per layer: each layer to C/√3 (client 1's 0.3 is within it).  Then / the uploaders of each element:
    # 3 for fc1, 2 for the head (clients 0 and 1), and fc1's weights n_k are not used.
    c = 1 / math.sqrt(3)
    want = {("fc1", "kernel", (0, 0)): (c if per_layer else 0.6) / 3, ("fc1", "bias", (1,)): 0.1,
            ("fc1", "kernel", (1, 1)): (c if per_layer else 1.0) / 3,
            ("head", "bias", (0,)): (c if per_layer else 0.8) / 2}
    for (layer, leaf, index), value in want.items():
        assert d[layer][leaf][index] == pytest.approx(value, rel=1e-6), (layer, leaf, index)
    # Everything else stays (client 2's head was not uploaded: 0 / 2); nobody uploads fc2: not received.
    total = sum(float(np.sum(np.abs(x))) for x in jax.tree.leaves(d))
    assert total == pytest.approx(sum(want.values()), rel=1e-6)
    assert not np.any(received["fc2"]["kernel"])
    assert np.all(received["fc1"]["kernel"]) and np.all(received["head"]["bias"])
    np.testing.assert_array_equal(new["fc2"]["kernel"], view.global_vars["params"]["fc2"]["kernel"])


@AT_O0
def test_without_noise_the_clipped_models_take_the_methods_own_formula(mlp):
    rnd = round_of(mlp, fp.dp_fedavg(fp.methods.fedavg(), clip=1.0, noise_multiplier=0.0))
    view = toy_view(rnd)
    new, received = jax.jit(lambda v: aggregate(rnd, v)[0])(view)
    d = moved(new, view)
    # Σ w m θ' / Σ w m over the actual uploaders, weights 1, 5, 10: fc1 by all (16), the head by clients 0, 1 (6).
    assert d["fc1"]["kernel"][0, 0] == pytest.approx(0.6 / 16, rel=1e-5)
    assert d["fc1"]["bias"][1] == pytest.approx(5 * 0.3 / 16, rel=1e-5)
    assert d["fc1"]["kernel"][1, 1] == pytest.approx(10 * 1.0 / 16, rel=1e-5)
    assert d["head"]["bias"][0] == pytest.approx(0.8 / 6, rel=1e-5)
    assert not np.any(received["fc2"]["kernel"])


@AT_O0
def test_the_denominator_is_the_mean_upload_count_over_rounds(mlp):
    rnd = round_of(mlp, fp.dp_fedavg(fp.methods.fedavg(), clip=100.0, noise_multiplier=1e-30))
    first = toy_view(rnd)
    state = jax.jit(lambda v: rnd.method.update(rnd.ctx, aggregate(rnd, v)[1]))(first).server[1]
    assert int(state.rounds) == 1 and float(state.uploads["head"]["bias"][0]) == 2.0
    # Round 2: only client 0 uploads the head (1 uploader): the head's denominator is (2 + 1) / 2.
    second = toy_view(rnd, upload=np.array([[1, 0, 1], [1, 0, 0], [1, 0, 0]], bool))
    second = second._replace(method_state=second.method_state._replace(
        server=(second.method_state.server[0], state)))
    new, _ = jax.jit(lambda v: aggregate(rnd, v)[0])(second)
    assert moved(new, second)["head"]["bias"][0] == pytest.approx(4.0 / 1.5, rel=1e-6)
    assert moved(new, second)["fc1"]["kernel"][0, 0] == pytest.approx(3.0 / 3, rel=1e-6)  # 3 every round


@AT_O0
def test_noise_std_over_many_draws(mlp):
    # No update at all: what moves is the noise, std z·C over each element's expected uploaders — 3 for fc1
    # and fc2, 1 for the head (only client 0 uploads it).
    z, clip, draws = 1.0, 2.0, 4000
    rnd = round_of(mlp, fp.dp_fedavg(fp.methods.fedavg(), clip=clip, noise_multiplier=z))
    zeros = jax.tree.map(lambda a: np.zeros((K, *a.shape), np.float32), rnd.init(jax.random.key(0)).variables["params"])
    view = toy_view(rnd, upload=np.array([[1, 1, 1], [1, 1, 0], [1, 1, 0]], bool), deltas=zeros)
    keys = jax.random.split(jax.random.key(7), draws)
    new = jax.jit(jax.vmap(lambda k: aggregate(rnd, view._replace(key=k))[0][0]))(keys)
    d = jax.tree.map(lambda n, g: np.asarray(n, np.float64) - np.asarray(g, np.float64)[None], new,
                     view.global_vars["params"])
    body = np.concatenate([d[n][leaf].reshape(draws, -1) for n in ("fc1", "fc2", "bn1") for leaf in d[n]], axis=1)
    head = np.concatenate([d["head"][leaf].reshape(draws, -1) for leaf in d["head"]], axis=1)
    measured = {"body": float(body.std()), "head": float(head.std())}
    print(f"noise std over {draws} draws: {measured} (expected {z * clip / 3:.4f} and {z * clip:.4f})")
    assert measured["body"] == pytest.approx(z * clip / 3, rel=0.01)  # 308,000 samples: 0.13% standard error
    assert measured["head"] == pytest.approx(z * clip, rel=0.015)  # 72,000 samples: 0.26%
    assert abs(body.mean()) < 4 * (z * clip / 3) / math.sqrt(body.size)
    # Independent across elements and draws: neighbouring elements are uncorrelated.
    assert abs(np.corrcoef(body[:, 0], body[:, 1])[0, 1]) < 0.05


@AT_O0
def test_adaptive_clipping_follows_the_target_quantile(mlp):
    rnd = round_of(mlp, fp.dp_fedavg(fp.methods.fedavg(), clip=10.0, noise_multiplier=0.0, target_quantile=0.5))
    state = jax.jit(lambda v: rnd.method.update(rnd.ctx, aggregate(rnd, v)[1]))(toy_view(rnd)).server[1]
    # Every client's upload norm (5, 0.3, 3) is within 10: b = 1, so C ← 10 · exp(−0.2 · (1 − 0.5)).
    assert float(state.clip) == pytest.approx(10 * math.exp(-0.1), rel=1e-6)
    # With noise, the count takes at most a tenth of the budget and sum + count cost one Gaussian of z.
    for z, k in ((1.0, 10), (0.5, 1000)):
        sigma_b = float(count_noise_std(z, k))
        assert sigma_b == pytest.approx(max(k / 20, z * math.sqrt(10) / 2))
        assert (float(sum_noise_multiplier(z, sigma_b)) ** -2 + (2 * sigma_b) ** -2) ** -0.5 == pytest.approx(z)


@pytest.mark.parametrize("name", ["fedldf", "fedspu"])
def test_zero_noise_and_infinite_clip_are_the_method_bit_for_bit(mlp, name):
    """``z = 0`` aggregates as the method does and ``C = ∞`` clips nothing: every state leaf is bit-identical."""
    make = (lambda: get_method("fedldf", n=2)) if name == "fedldf" else (lambda: get_method("fedspu"))
    results = []
    for method in (make(), fp.dp_fedavg(make(), clip=math.inf, noise_multiplier=0.0)):
        rnd = round_of(mlp, method)
        state = rnd.init(jax.random.key(0))
        for t in range(2):
            ids = np.sort(np.random.default_rng(t).choice(6, K, replace=False))
            state, _ = rnd(state, make_cohort((4,), k=K, steps=2, seed=t, client_ids=ids), jax.random.key(t))
        inner = state.method_state if method.aggregate is None else state.method_state._replace(
            server=state.method_state.server[0])
        results.append(jax.device_get((state.variables, state.opt_state, inner)))
    for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1])):
        np.testing.assert_array_equal(a, b)


def test_refusals(mlp):
    with pytest.raises(UserError, match="cannot wrap fednova: its server step"):
        fp.dp_fedavg(fp.methods.fednova(), clip=1.0, noise_multiplier=1.0)
    with pytest.raises(UserError, match="finite when there is noise"):
        fp.dp_fedavg(fp.methods.fedavg(), clip=math.inf, noise_multiplier=1.0)
    with pytest.raises(UserError, match="noise multiplier"):
        fp.dp_fedavg(fp.methods.fedavg(), clip=1.0, noise_multiplier=-1.0)
    with pytest.raises(UserError, match="target quantile"):
        fp.dp_fedavg(fp.methods.fedavg(), clip=1.0, noise_multiplier=1.0, target_quantile=1.0)
    # BatchNorm running statistics under the 'global' policy would be uploaded unclipped and without noise.
    rnd = fp.FederatedRound(mlp, fp.dp_fedavg(fp.methods.fedavg(), clip=1.0, noise_multiplier=1.0), num_clients=6,
                            cohort_size=K, client_optimizer=fp.client_sgd(0.1))
    with pytest.raises(UserError, match="'static' BatchNorm policy"):
        rnd.init(jax.random.key(0))


@AT_O0
def test_the_clip_factors_are_computed_once_a_round(mlp, monkeypatch):
    """aggregate hands its clip factors, norms and counts on (Carry): update and metrics do not clip again."""
    from fedpartial._src.methods.privacy import dp_fedavg as module

    calls = []
    counted = module.clip_factors
    monkeypatch.setattr(module, "clip_factors", lambda *a, **k: calls.append(1) or counted(*a, **k))
    for z in (0.0, 1.0):
        calls.clear()
        rnd = round_of(mlp, fp.dp_fedavg(fp.methods.fedavg(), clip=1.0, noise_multiplier=z, target_quantile=0.5))
        state, metrics = rnd(rnd.init(jax.random.key(0)), make_cohort((4,), k=K, steps=2), jax.random.key(1))
        assert len(calls) == 1, z  # one trace of the round, one clipping
        assert np.isfinite(float(metrics["dp_clipped_fraction"]))
