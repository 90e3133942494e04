"""FlexLoRA and FLoRA against a plain-numpy reference: one Dense layer 4 → 3 with a rank-2 adapter (its kernel and
bias the frozen base), three clients of unequal data, two local SGD steps each, ranks 1, 2, 2 or all 2."""

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

from fedpartial._src.core.errors import UserError
from fedpartial._src.core.structure import FROZEN
from fedpartial._src.engine.asynchronous import async_refusal
from fedpartial._src.engine.round import FederatedRound
from fedpartial._src.engine.strategy import stepwise, streamed
from fedpartial._src.methods.catalog import get_method
from fedpartial._src.methods.privacy.dp_fedavg import dp_fedavg
from fedpartial._src.models.adapter import from_linen
from fedpartial._src.models.lora import lora
from fedpartial._src.models.lora_ranks import with_lora_ranks
from tests.conftest import make_cohort

# Rounds of a few steps, each test its own programs: compiled at -O0 (tests/conftest.py says why that changes
# nothing here)
pytestmark = pytest.mark.usefixtures("engine_compiled_at_o0")

LR, N, K, SCALE = 0.5, 3, 3, 1.5  # alpha 3, rank 2


class OneDense(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        return nn.Dense(3, name="fc")(x)


def model(ranks=None):
    m = lora(from_linen(OneDense(), input_shape=(4,), num_classes=3), 2, alpha=3.0, targets=["fc"])
    return m if ranks is None else with_lora_ranks(m, ranks)


def cohort():
    return make_cohort((4,), k=K, steps=2, batch=4, real_steps=[2, 2, 1], real_examples=[4, 3, 2], seed=5)


def local_training(w, bias, a, b, rank, x, y, em, sm):
    """Two SGD steps of mean cross-entropy on ``x W + bias + s·(x A_r) B_r`` (components past ``rank`` dropped)."""
    keep = (np.arange(2) < rank).astype(np.float64)
    a, b = a * keep, b * keep[:, None]
    for s in range(2):
        if not sm[s]:
            continue
        xs, ys = x[s][em[s]], y[s][em[s]]
        logits = xs @ w + bias + SCALE * (xs @ a) @ b
        prob = np.exp(logits - logits.max(1, keepdims=True))
        prob /= prob.sum(1, keepdims=True)
        g = (prob - np.eye(3)[ys]) / len(ys)
        grad_b = SCALE * (xs @ a).T @ g
        grad_a = SCALE * xs.T @ g @ b.T
        a, b = (a - LR * grad_a) * keep, (b - LR * grad_b) * keep[:, None]
    return a, b


def reference_updates(v, ranks, c):
    """Every client's ``ΔW_k = s·A_k B_k`` and the shares ``p_k = n_k / Σ n``, in float64."""
    f, p = v[FROZEN]["fc"], v["params"]["fc"]
    w, bias = np.float64(f["kernel"]), np.float64(f["bias"])
    a0, b0 = np.float64(p["lora_a"]["kernel"]), np.float64(p["lora_b"]["kernel"])
    d = c.data
    updates = [SCALE * np.matmul(*local_training(w, bias, a0, b0, r, np.float64(d.x[k]), d.y[k], d.example_mask[k],
                                                  d.step_mask[k])) for k, r in enumerate(ranks)]
    n = np.asarray(c.info.num_samples, np.float64)
    return np.array(updates), n / n.sum()


def one_round(method, m, strategy=None):
    r = FederatedRound(m, get_method(method), num_clients=N, cohort_size=K, client_optimizer=optax.sgd(LR),
                       **({} if strategy is None else {"strategy": strategy}))
    state = r.init(jax.random.key(0))
    c = cohort()
    new, metrics = r(state, c, jax.random.key(1))
    return jax.device_get(state.variables), jax.device_get(new.variables), jax.device_get(metrics), c


@pytest.fixture(scope="module", params=[None, (1, 2, 2)], ids=["equal", "ranks1-2-2"])
def ranks(request):
    return request.param


@pytest.fixture(scope="module")
def flora_round(ranks):
    return one_round("flora", model(ranks))


@pytest.fixture(scope="module")
def flexlora_round(ranks):
    return one_round("flexlora", model(ranks))


def test_flora_merges_the_exact_mean_update_into_the_base(flora_round, ranks):
    old, new, metrics, c = flora_round
    updates, p = reference_updates(old, ranks or (2, 2, 2), c)
    merged = np.float64(old[FROZEN]["fc"]["kernel"]) + np.tensordot(p, updates, 1)
    np.testing.assert_allclose(new[FROZEN]["fc"]["kernel"], merged, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(new[FROZEN]["fc"]["bias"], old[FROZEN]["fc"]["bias"])  # not a target: frozen
    # fresh adapters: B zero, A drawn anew (not the old one), within lora()'s init range ±1/√4
    assert not np.any(new["params"]["fc"]["lora_b"]["kernel"])
    a = new["params"]["fc"]["lora_a"]["kernel"]
    assert not np.allclose(a, old["params"]["fc"]["lora_a"]["kernel"]) and np.abs(a).max() <= 0.5
    assert float(metrics["lora_aggregation_error"]) < 1e-6


def test_flexlora_gives_the_truncated_svd_of_the_mean_update(flexlora_round, ranks):
    old, new, metrics, c = flexlora_round
    updates, p = reference_updates(old, ranks or (2, 2, 2), c)
    u, s, vt = np.linalg.svd(np.tensordot(p, updates, 1))
    a, b = np.float64(new["params"]["fc"]["lora_a"]["kernel"]), np.float64(new["params"]["fc"]["lora_b"]["kernel"])
    for r in (1, 2):  # a client of rank r computes with the first r components: the rank-r truncated SVD
        np.testing.assert_allclose(SCALE * a[:, :r] @ b[:r], (u[:, :r] * s[:r]) @ vt[:r], rtol=1e-4, atol=1e-6)
    # split evenly: A = U √S / √s, B = √S Vᵀ / √s (up to each component's sign)
    np.testing.assert_allclose(np.abs(a), np.abs(u[:, :2] * np.sqrt(s[:2] / SCALE)), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.abs(b), np.abs(np.sqrt(s[:2] / SCALE)[:, None] * vt[:2]), rtol=1e-4, atol=1e-6)
    for coll in (FROZEN,):
        for x, y in zip(jax.tree.leaves(old[coll]), jax.tree.leaves(new[coll])):
            np.testing.assert_array_equal(x, y)


class Square(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        return nn.Dense(2, name="fc")(x)


def test_flexlora_at_full_rank_computes_floras_model():
    """Rank = min(in, out): the truncated SVD is exact, so FlexLoRA's global model (W + s·A B) is FLoRA's merged
    one (W + Σ p_k ΔW_k), both FedAvg of the full updates."""
    m = lora(from_linen(Square(), input_shape=(2,), num_classes=2), 2, targets=["fc"])
    c = make_cohort((2,), k=K, steps=2, batch=4, num_classes=2, real_examples=[4, 3, 2], seed=6)
    got = {}
    for name in ("flexlora", "flora"):
        r = FederatedRound(m, get_method(name), num_clients=N, cohort_size=K, client_optimizer=optax.sgd(LR))
        state, _ = r(r.init(jax.random.key(0)), c, jax.random.key(1))
        v = jax.device_get(state.variables)
        got[name] = v[FROZEN]["fc"]["kernel"] + np.matmul(v["params"]["fc"]["lora_a"]["kernel"],
                                                          v["params"]["fc"]["lora_b"]["kernel"])
    np.testing.assert_allclose(got["flexlora"], got["flora"], rtol=1e-5, atol=1e-6)


def test_fedits_aggregation_error_is_what_flora_removes():
    m = model()
    _, _, fedit_metrics, _ = one_round("fedit", m)
    _, _, flora_metrics, _ = one_round("flora", m)
    assert float(fedit_metrics["lora_aggregation_error"]) > 1e-3
    assert float(flora_metrics["lora_aggregation_error"]) < 1e-6


def test_the_stacking_methods_are_refused_where_they_cannot_run(mlp):
    with pytest.raises(UserError, match="has none; add --lora"):
        FederatedRound(mlp, get_method("flora"), num_clients=N, cohort_size=K, client_optimizer=optax.sgd(LR)).init(
            jax.random.key(0))
    for name in ("flora", "flexlora"):
        with pytest.raises(UserError, match="cannot be streamed"):
            FederatedRound(model(), get_method(name), num_clients=N, cohort_size=K, client_optimizer=optax.sgd(LR),
                           strategy=streamed(2))
    with pytest.raises(UserError, match="between 1 and the adapters' rank 2"):
        model((1, 3))
    with pytest.raises(UserError, match="rewrites the global model from every client's update"):
        dp_fedavg(get_method("flora"), clip=1.0, noise_multiplier=1.0)
    assert "rewrites the global model" in async_refusal(get_method("flora").with_capabilities(asynchronous=True))


def test_stepwise_equals_fused():
    old, new, _, _ = one_round("flora", model((1, 2, 2)), strategy=stepwise(1))
    _, fused, _, _ = one_round("flora", model((1, 2, 2)))
    for x, y in zip(jax.tree.leaves(new), jax.tree.leaves(fused)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_a_run_with_rank_tiers_counts_its_flops_at_the_full_rank():
    """--lora 4 --lora-ranks 1,4 through the driver: the device model counts the rank tiers' sub-models (it cannot
    scale a LoRA model's adapter layers) at the full rank, and the round runs."""
    import fedpartial as fp

    config = fp.RunConfig(method="flora", model="mlp", dataset="digits", num_clients=4, cohort_size=2, rounds=1,
                          local_steps=1, lora=4, lora_ranks="1,4", out_dir=None, seed=0, strategy="fused")
    sim = fp.Simulation(config)
    (record,) = list(sim.rounds())
    assert sim.model.lora.ranks == (1, 4) and record["client_flops"] > 0
    assert record["lora_aggregation_error"] < 1e-6
