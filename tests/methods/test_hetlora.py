"""HetLoRA against a plain-numpy reference: one Dense layer 4 → 4 with a rank-4 adapter (its kernel and bias the
frozen base), three clients of ranks 2, 4, 4 and unequal data, two local SGD steps each, from global adapters whose
B is not zero; without pruning, and with self-pruning at γ = 0.5 and a penalty λ on the prunable tail.
Tolerance: rtol 1e-5, atol 1e-6 (float32 against float64)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedpartial._src.core import aggregation, masks
from fedpartial._src.core.errors import UserError
from fedpartial._src.core.records import MethodState, Selection
from fedpartial._src.core.structure import FROZEN
from fedpartial._src.core.types import MethodContext
from fedpartial._src.core.views import RoundView
from fedpartial._src.engine.asynchronous import async_refusal
from fedpartial._src.engine.round import FederatedRound
from fedpartial._src.engine.strategy import streamed
from fedpartial._src.methods.catalog import get_method
from fedpartial._src.methods.privacy.dp_fedavg import dp_fedavg
from fedpartial._src.models.adapter import from_linen
from fedpartial._src.models.lora import lora
from fedpartial._src.models.lora_ranks import with_lora_ranks
from tests.conftest import make_cohort

# Rounds of a few steps, each test its own programs: compiled at -O0 (tests/conftest.py says why that changes
# nothing here)
pytestmark = pytest.mark.usefixtures("engine_compiled_at_o0")

LR, N, K, R, SCALE = 0.5, 3, 3, 4, 1.5  # alpha 6, rank 4
RANKS = (2, 4, 4)  # client i of 3 is in tier i


class OneDense(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        return nn.Dense(4, name="fc")(x)


def model(ranks=RANKS):
    m = lora(from_linen(OneDense(), input_shape=(4,), num_classes=4), R, alpha=6.0, targets=["fc"])
    return m if ranks is None else with_lora_ranks(m, ranks)


def cohort():
    return make_cohort((4,), k=K, steps=2, batch=4, real_steps=[2, 2, 1], real_examples=[4, 3, 2], seed=5,
                       num_classes=4)


def start_state(r):
    """The initial state with B drawn non-zero (a later round's adapters), so the tails have a norm to lose."""
    state = r.init(jax.random.key(0))
    v = jax.device_get(state.variables)
    b = np.random.default_rng(3).normal(size=(R, 4)).astype(np.float32) * 0.5
    params = {"fc": {**v["params"]["fc"], "lora_b": {"kernel": b}}, **{k: x for k, x in v["params"].items()
                                                                     if k != "fc"}}
    return state._replace(variables={**v, "params": params})


def norm(a, b, keep):
    return SCALE * np.linalg.norm((a * keep) @ (b * keep[:, None]))


def local_training(w, bias, a, b, rank, gamma, lam, x, y, em, sm):
    """Two SGD steps of mean cross-entropy on ``x W + bias + s·(x A_r) B_r`` plus ``λ‖s·A_tail B_tail‖_F``."""
    keep = (np.arange(R) < rank).astype(np.float64)
    tail = keep * (np.arange(R) >= max(int(np.floor(gamma * rank)), 1))
    a, b = a * keep, b * keep[:, None]
    for s in range(2):
        if not sm[s]:
            continue
        xs, ys = x[s][em[s]], y[s][em[s]]
        logits = xs @ w + bias + SCALE * (xs @ a) @ b
        prob = np.exp(logits - logits.max(1, keepdims=True))
        prob /= prob.sum(1, keepdims=True)
        g = (prob - np.eye(4)[ys]) / len(ys)
        grad_b, grad_a = SCALE * (xs @ a).T @ g, SCALE * xs.T @ g @ b.T
        if gamma > 0 and lam > 0:  # d‖M‖ = s·M B_tᵀ / ‖M‖ and s·A_tᵀ M / ‖M‖, M = s·A_t B_t
            at, bt = a * tail, b * tail[:, None]
            m = SCALE * at @ bt
            grad_a += lam * SCALE * (m @ bt.T) / np.linalg.norm(m) * tail
            grad_b += lam * SCALE * (at.T @ m) / np.linalg.norm(m) * tail[:, None]
        a, b = (a - LR * grad_a) * keep, (b - LR * grad_b) * keep[:, None]
    return a, b


def reference(v, c, gamma, lam):
    """The new global A, B and each client's rank after the round, in float64."""
    f, p = v[FROZEN]["fc"], v["params"]["fc"]
    a0, b0 = np.float64(p["lora_a"]["kernel"]), np.float64(p["lora_b"]["kernel"])
    d, new_ranks, factors = c.data, [], []
    for k, r in enumerate(RANKS):
        a, b = local_training(np.float64(f["kernel"]), np.float64(f["bias"]), a0, b0, r, gamma, lam,
                              np.float64(d.x[k]), d.y[k], d.example_mask[k], d.step_mask[k])
        if gamma > 0:
            low = max(int(np.floor(gamma * r)), 1)
            tail = (np.arange(R) >= low) & (np.arange(R) < r)
            if norm(a, b, tail) < norm(a0, b0, tail):
                r = low
        keep = (np.arange(R) < r).astype(np.float64)
        new_ranks.append(r)
        factors.append((a * keep, b * keep[:, None]))  # zero-padded past the client's (pruned) rank
    s = np.array([norm(a, b, np.ones(R)) for a, b in factors])
    q = s / s.sum()  # hand-checkable: each client's share of the summed update norms
    held = np.arange(R) < max(new_ranks)  # a component nobody holds keeps its global value
    new_a = np.where(held, sum(qk * a for qk, (a, _) in zip(q, factors)), a0)
    new_b = np.where(held[:, None], sum(qk * b for qk, (_, b) in zip(q, factors)), b0)
    return new_a, new_b, new_ranks, q


# γ 0.5, λ 0.05: clients 0 and 2 prune (to ranks 1 and 2), client 1 keeps rank 4; λ 0.2: every client prunes, so
# components 2 and 3 are nobody's this round and keep their global values.
@pytest.fixture(scope="module", params=[(0.0, 0.0), (0.5, 0.05), (0.5, 0.2)],
                ids=["no-pruning", "some-prune", "all-prune"])
def pruning(request):
    return request.param


@pytest.fixture(scope="module")
def hetlora_round(pruning):
    gamma, lam = pruning
    r = FederatedRound(model(), get_method("hetlora", prune_gamma=gamma, prune_lambda=lam), num_clients=N,
                       cohort_size=K, client_optimizer=optax.sgd(LR))
    state = start_state(r)
    c = cohort()
    new, metrics = r(state, c, jax.random.key(1))
    return jax.device_get(state.variables), jax.device_get(new), jax.device_get(metrics), c


def test_hetlora_matches_the_numpy_reference(hetlora_round, pruning):
    old, new, metrics, c = hetlora_round
    want_a, want_b, want_ranks, q = reference(old, c, *pruning)
    got = new.variables["params"]["fc"]
    np.testing.assert_allclose(got["lora_a"]["kernel"], want_a, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["lora_b"]["kernel"], want_b, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(new.method_state.clients, want_ranks)
    assert float(metrics["lora_mean_rank"]) == pytest.approx(np.mean(want_ranks))
    assert not np.allclose(q, q[0])  # the norms weigh the clients unequally
    assert want_ranks == {0.0: [2, 4, 4], 0.05: [1, 4, 2], 0.2: [1, 2, 2]}[pruning[1]]
    np.testing.assert_array_equal(new.variables[FROZEN]["fc"]["kernel"], old[FROZEN]["fc"]["kernel"])


def test_equal_norms_and_ranks_reduce_to_fedavg_of_the_factors():
    """Equal ranks, equal update norms (client 2's factors are client 1's turned by an orthogonal Q: A Q, Qᵀ B),
    equal n_k, no pruning: HetLoRA's aggregation is FedIT's (the engine's n_k-weighted mean of the factors)."""
    m = model(None)
    ctx = MethodContext(model=m, num_clients=2, cohort_size=2)
    v = jax.device_get(m.init_variables(jax.random.key(0)))
    rng = np.random.default_rng(0)
    a1, b1 = rng.normal(size=(4, R)).astype(np.float32), rng.normal(size=(R, 4)).astype(np.float32)
    q_mat = np.linalg.qr(rng.normal(size=(R, R)))[0].astype(np.float32)
    head = {k: np.stack([x, x + 1]) for k, x in v["params"].items() if k != "fc"}
    uploaded = {**jax.tree.map(lambda x: np.stack([x, x + 1.0]), head),
                "fc": {"lora_a": {"kernel": np.stack([a1, a1 @ q_mat])},
                       "lora_b": {"kernel": np.stack([b1, q_mat.T @ b1])}}}
    upload = masks.full(m.structure, (2,))
    weights = jnp.ones((2,))
    view = RoundView(key=jax.random.key(0), round=jnp.zeros((), jnp.int32), global_vars=v,
                     method_state=MethodState(clients=jnp.array([R, R])), client_state=jnp.array([R, R]),
                     cohort=make_cohort((4,), k=2).info, data=None, uploaded=uploaded,
                     selection=Selection(upload=upload, weights=weights, extra_upload_bytes=jnp.zeros((2,))),
                     carried={"select": jnp.array([R, R])})
    got, _ = get_method("hetlora").aggregate(ctx, view)
    (want, _), _ = aggregation.aggregate(m.structure, v, {"params": uploaded}, upload, weights, ("params",)), None
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want["params"])):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_bad_options_and_models_are_refused(mlp):
    with pytest.raises(UserError, match="prune-gamma"):
        get_method("hetlora", prune_gamma=1.0)
    with pytest.raises(UserError, match="prune-lambda"):
        get_method("hetlora", prune_lambda=-1.0)
    with pytest.raises(UserError, match="has none; add --lora"):
        FederatedRound(mlp, get_method("hetlora"), num_clients=N, cohort_size=K,
                       client_optimizer=optax.sgd(LR)).init(jax.random.key(0))
    with pytest.raises(UserError, match="cannot be streamed"):
        FederatedRound(model(), get_method("hetlora"), num_clients=N, cohort_size=K, client_optimizer=optax.sgd(LR),
                       strategy=streamed(2))
    with pytest.raises(UserError, match="aggregates its own way"):
        dp_fedavg(get_method("hetlora"), clip=1.0, noise_multiplier=1.0)
    assert "--mode sync" in async_refusal(get_method("hetlora"))
