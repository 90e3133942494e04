"""DepthFL and InclusiveFL: a plain-Python reference of a round each, their reductions to FedAvg, depths, refusals."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedpartial._src.core.errors import UserError
from fedpartial._src.core.losses import exit_cross_entropies
from fedpartial._src.core.types import LossAux
from fedpartial._src.engine.round import FederatedRound
from fedpartial._src.engine.strategy import stepwise
from fedpartial._src.methods.base import make_method
from fedpartial._src.methods.basic.fedavg import fedavg
from fedpartial._src.methods.tiered.depth import Tiers, resolve_depths, transfer_pairs
from fedpartial._src.methods.tiered.depthfl import depthfl
from fedpartial._src.methods.tiered.inclusivefl import inclusivefl
from fedpartial._src.models.adapter import from_linen, from_stages
from fedpartial._src.models.registry import build_model
from tests.conftest import make_cohort

# Rounds of a few steps, each test its own programs: compiled at -O0 (tests/conftest.py says why that changes
# nothing here)
pytestmark = pytest.mark.usefixtures("engine_compiled_at_o0")

LR, K = 0.3, 3


class DenseRelu(nn.Module):
    units: int

    @nn.compact
    def __call__(self, x, train: bool = False):
        return nn.relu(nn.Dense(self.units, name="fc")(x))


@pytest.fixture(scope="module")
def chain():
    """b1 (4→5), b2, b3 (5→5) with ReLU and a Dense head: default depths moderate 2, weak 1 (exits after b1, b2)."""
    return from_stages([DenseRelu(5), DenseRelu(5), DenseRelu(5), nn.Dense(3)], input_shape=(4,), num_classes=3,
                       names=("b1", "b2", "b3", "head"), name="chain")


def run(model, method, cohorts, *, strategy=stepwise(1), n=K, k=K):
    r = FederatedRound(model, method, num_clients=n, cohort_size=k, client_optimizer=optax.sgd(LR), strategy=strategy)
    state = r.init(jax.random.key(0))
    start = jax.device_get(state.variables["params"])
    for t, c in enumerate(cohorts):
        state, _ = r(state, c, jax.random.key(5 + t))
    return r, start, jax.device_get(state)


def cohorts(rounds=1):
    """One client per tier (ids 0 strong, 1 moderate, 2 weak), unequal real examples."""
    return [make_cohort((4,), k=K, steps=2, seed=t, real_examples=[5, 3, 4], client_ids=[0, 1, 2])
            for t in range(rounds)]


# ---- the plain-Python reference ------------------------------------------------------------------------------

BLOCKS = ("b1", "b2", "b3")
EXITS = (("exit_b1", 0), ("exit_b2", 1), ("head", 2))  # (module, block it reads)
DEPTHS = (4, 2, 1)  # strong, moderate, weak: stages held


def held(depth, own_exit_only):
    """Parameter modules a client of ``depth`` stages trains: its blocks and exits (or its deepest exit)."""
    exits = [e for e, i in EXITS if i < depth and (e != "head" or depth == 4)]
    return [b for i, b in enumerate(BLOCKS) if i < depth] + (exits[-1:] if own_exit_only else exits)


def softmax(z, t=1.0):
    e = np.exp((z - z.max(-1, keepdims=True)) / t)
    return e / e.sum(-1, keepdims=True)


def local_sgd(p, xs, ys, masks, depth, exit_grads, own_exit_only=False):
    """SGD over the steps on the modules the client trains; ``exit_grads(logits, y, m) -> dlogits`` per exit."""
    p = jax.tree.map(lambda a: np.array(a, np.float64), {m: p[m] for m in held(depth, own_exit_only)})
    for x, y, m in zip(xs, ys, masks):
        hs, pre = [x.astype(np.float64)], []
        for b in BLOCKS[:min(depth, 3)]:
            pre.append(hs[-1] @ p[b]["fc"]["kernel"] + p[b]["fc"]["bias"])
            hs.append(np.maximum(pre[-1], 0.0))
        outs = [(e, i) for e, i in EXITS if e in p]
        dlogits = exit_grads([hs[i + 1] @ p[e]["kernel"] + p[e]["bias"] for e, i in outs], y, m)
        grads = {e: {"kernel": hs[i + 1].T @ d, "bias": d.sum(0)} for (e, i), d in zip(outs, dlogits)}
        dh = [np.zeros_like(h) for h in hs]
        for (e, i), d in zip(outs, dlogits):
            dh[i + 1] += d @ p[e]["kernel"].T
        for i in reversed(range(len(pre))):
            dpre = dh[i + 1] * (pre[i] > 0)
            grads[BLOCKS[i]] = {"fc": {"kernel": hs[i].T @ dpre, "bias": dpre.sum(0)}}
            dh[i] += dpre @ p[BLOCKS[i]]["fc"]["kernel"].T
        p = jax.tree.map(lambda a, g: a - LR * g, p, {m: grads[m] for m in p})
    return p


def ce_grad(z, y, m):
    return (softmax(z) - np.eye(z.shape[1])[y]) * m[:, None] / m.sum()


def depthfl_grads(distill, temperature):
    """d/dlogits of Σ_i CE_i + λ/(E−1) Σ_i Σ_{j≠i} T²·KL(q_j ‖ q_i), teachers fixed: T·(q_i − q_j) per pair."""
    def grads(logits, y, m):
        e, q = len(logits), [softmax(z, temperature) for z in logits]
        out = []
        for i, z in enumerate(logits):
            d = ce_grad(z, y, m)
            for j in range(e):
                if j != i:
                    d = d + distill / (e - 1) * temperature * (q[i] - q[j]) * m[:, None] / m.sum()
            out.append(d)
        return out
    return grads


def own_exit_grads(logits, y, m):
    [z] = logits
    return [ce_grad(z, y, m)]


def aggregate(start, trained, weights):
    """Each leaf the weighted mean over the clients holding it (everything is held by someone here)."""
    out = {}
    for m in start:
        holders = [(w, t[m]) for w, t in zip(weights, trained) if m in t]
        total = sum(w for w, _ in holders)
        out[m] = jax.tree.map(lambda *leaves: sum(w * a for (w, _), a in zip(holders, leaves)) / total,
                              *[t for _, t in holders])
    return out


def client_data(c, k):
    d = c.data
    return np.asarray(d.x[k]), np.asarray(d.y[k]), np.asarray(d.example_mask[k], np.float64)


def assert_tree_close(got, want, atol=2e-5):
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), w, atol=atol, rtol=1e-4, err_msg=jax.tree_util.keystr(path))


def test_depthfl_round_matches_the_plain_python_reference(chain):
    method = depthfl(tier_mix=(1, 1, 1), distill=0.7, temperature=2.0)
    model = method.adapt_model(chain)
    [c] = cohorts()
    _, start, state = run(model, method, [c])
    trained = [local_sgd(start, *client_data(c, k), depth, depthfl_grads(0.7, 2.0)) for k, depth in enumerate(DEPTHS)]
    assert_tree_close(state.variables["params"], aggregate(start, trained, np.asarray(c.info.num_samples)))


def test_inclusivefl_rounds_match_the_plain_python_reference(chain):
    """Two rounds: each tier trains its own exit; in round 2 the top stage of weak (b1) takes β of moderate's
    round-1 update of b2 (its biases: no b2 kernel has b1's shape) and moderate's top stage (b2) β of strong's
    round-1 update of b3, in place of its own update."""
    beta = 0.4
    method = inclusivefl(tier_mix=(1, 1, 1), beta=beta)
    model = method.adapt_model(chain)
    data = cohorts(2)
    _, start, state = run(model, method, data)
    g = start
    momentum = None
    for c in data:
        w = np.asarray(c.info.num_samples, np.float64)
        trained = [local_sgd(g, *client_data(c, k), depth, own_exit_grads, True) for k, depth in enumerate(DEPTHS)]
        new = aggregate(g, trained, w)
        update = [jax.tree.map(lambda a, b: a - b, t, {m: g[m] for m in t}) for t in trained]
        if momentum is not None:  # tier t's share of the holders of its top stage: W_t / W
            for t, top, transfer in ((2, "b1", momentum[0]), (1, "b2", momentum[1])):
                share = w[t] / w[:t + 1].sum()
                for leaf, m in transfer.items():
                    new[top]["fc"][leaf] = new[top]["fc"][leaf] + beta * share * (m - update[t][top]["fc"][leaf])
        momentum = ({"bias": update[1]["b2"]["fc"]["bias"]}, update[0]["b3"]["fc"])
        g = new
    assert_tree_close(state.variables["params"], g)


def test_transfer_pairs_match_names_and_shapes(chain):
    method = inclusivefl(tier_mix=(1, 1, 1))
    r = FederatedRound(method.adapt_model(chain), method, num_clients=3, cohort_size=3, client_optimizer=optax.sgd(1))
    pairs = transfer_pairs(Tiers(r.ctx, (1, 1, 1), None, None, "inclusivefl"))
    assert [(t, u, sorted(s)) for t, u, s in pairs] == [  # (tier, deeper tier, parameters of its top stage)
        (1, 0, [("b2", "fc", "bias"), ("b2", "fc", "kernel")]), (2, 1, [("b1", "fc", "bias")])]
    assert pairs[0][2][("b2", "fc", "kernel")] == [("b3", "fc", "kernel")]


# ---- reductions ------------------------------------------------------------------------------------------------


def test_depthfl_all_strong_without_distillation_is_fedavg_on_the_model_with_exits(chain):
    """Every client at the deepest tier, λ = 0: FedAvg (its plan, selection and n_k aggregation) on the model with
    exits, whose loss is the sum of the exits' cross-entropies."""
    method = depthfl(tier_mix=(3, 0, 0), distill=0.0)
    model = method.adapt_model(chain)

    def exits_ce(ctx, params, step):
        logits, stats = ctx.model.exit_logits({"params": params, "batch_stats": {}}, step.batch.x, train=True,
                                              example_mask=step.batch.example_mask)
        ce = exit_cross_entropies(logits, step.batch.y, step.batch.example_mask)
        return jnp.sum(ce), LossAux(loss=jnp.mean(ce), batch_stats=stats)

    data = cohorts(2)
    _, _, got = run(model, method, data)
    _, _, want = run(model, make_method("fedavg", objective=exits_ce), data)
    assert_tree_close(got.variables, want.variables, atol=1e-6)


def test_inclusivefl_all_strong_is_fedavg_on_the_model_with_exits(chain):
    method = inclusivefl(tier_mix=(3, 0, 0))
    model = method.adapt_model(chain)  # its output is the model's own classifier: FedAvg's loss trains that alone
    data = cohorts(2)
    _, _, got = run(model, method, data)
    _, _, want = run(model, fedavg(), data)
    assert_tree_close(got.variables, want.variables, atol=1e-6)


# ---- depths, tiers and refusals -------------------------------------------------------------------------------


def zoo(name, shape, classes=10):
    return from_linen(build_model(name, classes, shape), input_shape=shape, num_classes=classes, name=name)


def test_default_depths_train_as_many_stages_as_embracingfl_tiers(chain):
    assert resolve_depths(chain) == (4, 2, 1)
    for name, shape, depths in [("resnet20", (8, 8, 3), (11, 7, 4)), ("femnist_cnn", (28, 28, 1), (4, 2, 1)),
                                ("lenet5", (32, 32, 3), (5, 3, 2)), ("mlp", (8, 8, 1), (3, 2, 1)),
                                ("vgg9", (32, 32, 3), (9, 5, 1)), ("bilstm", (16,), (3, 2, 2))]:
        assert resolve_depths(zoo(name, shape)) == depths, name
    assert resolve_depths(chain, "b3,b1") == (4, 3, 1) == resolve_depths(chain, (3, 1))


def test_bad_depths_and_models_are_refused_in_one_sentence(chain, mlp):
    for depths, match in [("b2,nope", "not a stage of chain"), ("4,1", "between 1 and 3"),
                          ("1,2", "no more stages than a moderate"), ("7", "two depths")]:
        with pytest.raises(UserError, match=match):
            resolve_depths(chain, depths)
    with pytest.raises(UserError, match="single stage"):
        depthfl().adapt_model(mlp)
    with pytest.raises(UserError, match="has none; build it with fedpartial.models.with_exits"):
        FederatedRound(chain, depthfl(), num_clients=3, cohort_size=3, client_optimizer=optax.sgd(1))
    with pytest.raises(UserError, match="--kd-weight = -1.0"):  # a direct call: the option's check too
        depthfl(distill=-1.0)
    with pytest.raises(UserError, match="--md-beta = 2"):
        inclusivefl(beta=2)


def test_each_tier_trains_its_prefix_and_only_its_stages_travel(chain):
    """Weak clients hold b1 and its exit, moderate ones b1, b2 and both exits; InclusiveFL trains one exit each."""
    for method, weak, moderate in [(depthfl(tier_mix=(1, 1, 1)), {"b1", "exit_b1"}, {"b1", "b2", "exit_b1", "exit_b2"}),
                                   (inclusivefl(tier_mix=(1, 1, 1)), {"b1", "exit_b1"}, {"b1", "b2", "exit_b2"})]:
        model = method.adapt_model(chain)
        r = FederatedRound(model, method, num_clients=3, cohort_size=3, client_optimizer=optax.sgd(1))
        assert [(g.name, g.size) for g in r.groups] == [("strong", 1), ("moderate", 1), ("weak", 1)]
        layers = np.asarray(method.plan(r.ctx, None).train.layers)
        names = np.array([layer.path[0] for layer in model.structure.layers])
        assert set(names[layers[2]]) == weak and set(names[layers[1]]) == moderate
        assert layers[0].sum() == (len(names) if method.name == "depthfl" else len(names) - 2)
