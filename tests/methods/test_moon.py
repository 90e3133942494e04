"""MOON: the projection head, the contrastive term, a plain-Python MOON the engine must match, μ = 0 is FedAvg."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedpartial._src.core.errors import UserError
from fedpartial._src.engine.round import FederatedRound
from fedpartial._src.engine.strategy import fused
from fedpartial._src.experiment.config import RunConfig
from fedpartial._src.experiment.parts import build_model
from fedpartial._src.experiment.simulation import Simulation
from fedpartial._src.methods.basic.fedavg import fedavg
from fedpartial._src.methods.basic.moon import contrastive_loss, moon
from fedpartial._src.methods.catalog import get_method
from fedpartial._src.models import heads
from fedpartial._src.models.adapter import from_linen
from fedpartial._src.models.zoo import MLP
from tests.conftest import make_cohort

# Rounds of a few steps, each test its own programs: compiled at -O0 (tests/conftest.py says why that changes
# nothing here)
pytestmark = pytest.mark.usefixtures("engine_compiled_at_o0")

N, K = 5, 3
LR, MOMENTUM, MU, TAU = 0.1, 0.9, 1.0, 0.5
IDS = ([0, 1, 3], [1, 2, 4])  # client 1 trains twice: its second round has a negative


@pytest.fixture(scope="module")
def plain():
    return from_linen(MLP(num_classes=3, hidden=(5,)), input_shape=(4,), num_classes=3, sequential=True)


@pytest.fixture(scope="module")
def model(plain):
    return heads.with_projection_head(plain, dim=3)


def cohorts():
    return [make_cohort((4,), k=K, steps=3, batch=5, seed=t, real_steps=[3, 1, 2], real_examples=[5, 3, 4],
                        client_ids=IDS[t]) for t in range(2)]


def build(model, method):
    return FederatedRound(model, method, num_clients=N, cohort_size=K,
                          client_optimizer=optax.sgd(LR, momentum=MOMENTUM), strategy=fused())


def run(r, data):
    """Host copies of the state before and after every round."""
    state = r.init(jax.random.key(0))
    history = [jax.device_get(state)]
    for t, c in enumerate(data):
        state, _ = r(state, c, jax.random.key(t))
        history.append(jax.device_get(state))
    return history


# ---- the plain-Python reference -----------------------------------------------------------


def dense(p, x):
    return x @ p["kernel"] + p["bias"][None]


def forward(p, x):
    """(projection z, logits) of the MLP with a projection head, written out by hand."""
    h = jax.nn.relu(dense(p["fc1"], x))
    z = dense(p["proj"]["l2"], jax.nn.relu(dense(p["proj"]["l1"], h)))
    return z, dense(p["head"], z)


def cosine(a, b, eps=1e-8):
    """torch.nn.CosineSimilarity: a·b / max(||a||·||b||, eps)."""
    return jnp.sum(a * b, -1) / jnp.sqrt(jnp.maximum(jnp.sum(a * a, -1) * jnp.sum(b * b, -1), eps**2))


@jax.jit
def moon_grad(p, x, y, g, prev, has_prev, mu):
    """The reference's loss: CE + μ · CE over the logits [sim(z, z_glob), sim(z, z_prev)] / τ with label 0
    (only the positive logit when there is no previous model)."""

    def loss(q):
        z, logits = forward(q, x)
        ce = -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(len(y)), y])
        pos = cosine(z, forward(g, x)[0]) / TAU
        neg = cosine(z, forward(prev, x)[0]) / TAU
        with_negative = -jax.nn.log_softmax(jnp.stack([pos, neg], -1))[:, 0]
        only_positive = -jax.nn.log_softmax(pos[:, None])[:, 0]
        return ce + mu * jnp.mean(jnp.where(has_prev, with_negative, only_positive))

    return jax.grad(loss)(p)


def reference_round(params, previous, cohort, mu):
    """MOON one client at a time; ``previous``: client id -> its last trained params (absent: none yet)."""
    def to64(tree):
        return jax.tree.map(lambda a: np.array(a, np.float64), tree)
    def to32(tree):
        return jax.tree.map(lambda a: np.asarray(a, np.float32), tree)
    models, n = [], []
    for k in range(K):
        i = int(cohort.info.client_ids[k])
        prev = previous.get(i, params)  # without a previous model its value is never used
        p, buf = to64(params), None
        for s in range(cohort.data.step_mask.shape[1]):
            if not cohort.data.step_mask[k, s]:
                continue
            real = cohort.data.example_mask[k, s]
            x, y = cohort.data.x[k, s][real], cohort.data.y[k, s][real]
            grad = to64(moon_grad(to32(p), x, y, to32(params), to32(prev), i in previous, mu))
            buf = grad if buf is None else jax.tree.map(lambda b, d: MOMENTUM * b + d, buf, grad)
            p = jax.tree.map(lambda v, b: v - LR * b, p, buf)
        models.append(p)
        n.append(float(cohort.info.num_samples[k]))
    for k in range(K):
        previous[int(cohort.info.client_ids[k])] = models[k]
    w = np.array(n) / np.sum(n)
    return jax.tree.map(lambda *ps: sum(wi * v for wi, v in zip(w, ps)), *models), previous


# ---- tests --------------------------------------------------------------------------------


def test_contrastive_term_by_hand():
    z, glob, prev = jnp.array([[1.0, 0.0]]), jnp.array([[2.0, 0.0]]), jnp.array([[0.0, 3.0]])
    # sim(z, glob) = 1, sim(z, prev) = 0: −log(e^{1/τ} / (e^{1/τ} + e^0)) = log(1 + e^{−2}) at τ = 0.5.
    np.testing.assert_allclose(contrastive_loss(z, glob, prev, 0.5, jnp.array(True)), [np.log1p(np.exp(-2.0))],
                               rtol=1e-6)
    # No previous model: only the positive logit, whose cross-entropy is 0.
    np.testing.assert_array_equal(contrastive_loss(z, glob, prev, 0.5, jnp.array(False)), [0.0])


def test_projection_head_replaces_the_classifier(plain, model):
    assert model.stage_names == ("fc1", "proj", "head")
    assert model.structure.layer_names == ("fc1", "proj/l1", "proj/l2", "head")
    assert model.structure.units == (5, 5, 3, 3)  # l1 as wide as the encoder's output (ModelFedCon), l2 = dim
    assert [layer.feeds_from for layer in model.structure.layers] == [None, 0, 1, 2]
    ours, theirs = jax.jit(model.init_variables)(jax.random.key(0)), jax.jit(plain.init_variables)(jax.random.key(0))
    jax.tree.map(np.testing.assert_array_equal, ours["params"]["fc1"], theirs["params"]["fc1"])  # same encoder start
    x = jnp.ones((2, 4))
    z, (logits, _) = jax.jit(lambda v: heads.classifier_input(model, lambda: model.apply(v, x, False)))(ours)
    ref_z, ref_logits = forward(ours["params"], x)
    np.testing.assert_allclose(z, ref_z, rtol=1e-6)
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-6)


def test_without_a_head_the_classifier_input_is_the_penultimate_representation(mlp):
    variables = jax.jit(mlp.init_variables)(jax.random.key(1))
    x = np.random.default_rng(2).normal(size=(4, 4)).astype(np.float32)

    @jax.jit
    def both(v):
        return heads.classifier_input(mlp, lambda: mlp.apply(v, x, False))[0], mlp.intermediates(v, x)["fc2"]

    z, fc2 = both(variables)
    np.testing.assert_allclose(z, jax.nn.relu(fc2), rtol=1e-6)
    with pytest.raises(UserError, match="single stage"):
        heads.with_projection_head(mlp)


def test_engine_matches_plain_python_moon(model):
    data = cohorts()
    history = run(build(model, moon(mu=MU, temperature=TAU)), data)
    params, previous = history[0].variables["params"], {}
    without = None
    for t, c in enumerate(data):
        if t == 1:  # what round 2 would give without the contrastive term
            without, _ = reference_round(params, dict(previous), c, 0.0)
        params, previous = reference_round(params, previous, c, MU)
        got = history[t + 1]
        def close(a, b):
            return np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5)
        jax.tree.map(close, got.variables["params"], params)
        stored = got.method_state.clients
        np.testing.assert_array_equal(stored.exists, [i in previous for i in range(N)])
        for i, p in previous.items():
            jax.tree.map(close, jax.tree.map(lambda a, i=i: a[i], stored.variables["params"]), p)
    # Round 1 had no negatives (so μ changed nothing); in round 2 client 1's negative did.
    gap = max(np.max(np.abs(a - b)) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(without)))
    assert gap > 1e-4
    first_no_mu, _ = reference_round(history[0].variables["params"], {}, data[0], 0.0)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5),
                 history[1].variables["params"], first_no_mu)


def test_mu_zero_is_fedavg(model):
    data = cohorts()
    ours, theirs = run(build(model, moon(mu=0.0)), data), run(build(model, fedavg()), data)
    for a, b in zip(jax.tree.leaves(ours[-1].variables), jax.tree.leaves(theirs[-1].variables)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_simulation_gives_moon_its_projection_head():
    config = RunConfig(method="moon", dataset="synthetic", num_clients=4, cohort_size=2, rounds=1, local_steps=1,
                       local_epochs=None, out_dir=None, options={"projection_dim": 8})
    sim = Simulation(config)
    assert sim.model.stage_names[-2:] == heads.PROJECTION_STAGES and sim.model.structure.units[-2] == 8
    own = build_model(config.model, sim.dataset)
    assert Simulation(config, sim.dataset, model=own).model is own  # a model passed in is used as it is (cached: fast)
    with pytest.raises(UserError, match="--moon-tau"):
        get_method("moon", temperature=0.0)
