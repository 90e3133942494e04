"""FedIT, FFA-LoRA and FedSA-LoRA against a plain-Python reference (one client at a time, numpy SGD and means),
FedIT's aggregation error by hand, FFA-LoRA's traffic, and the refusal of a model without adapters."""

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

from fedpartial._src.core.errors import UserError
from fedpartial._src.core.structure import FROZEN, leaf_paths
from fedpartial._src.engine.round import FederatedRound
from fedpartial._src.engine.strategy import fused
from fedpartial._src.methods.basic.fedavg import fedavg
from fedpartial._src.methods.lora.fedit import fedit
from fedpartial._src.methods.lora.fedsa_lora import fedsa_lora
from fedpartial._src.methods.lora.ffa_lora import ffa_lora
from fedpartial._src.methods.privacy.dp_fedavg import dp_fedavg
from fedpartial._src.models.adapter import from_linen
from fedpartial._src.models.lora import lora
from tests.conftest import make_cohort

# Rounds of a few steps, each test its own programs: compiled at -O0 (tests/conftest.py says why that changes
# nothing there); not the test that expects FedIT's round (the module's
# shared run, built at -O1) to equal FedAvg's bit for bit
AT_O0 = pytest.mark.usefixtures("engine_compiled_at_o0")

LR, N, K = 0.2, 5, 3


class Plain(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.relu(nn.Dense(6, name="fc1")(x.reshape((x.shape[0], -1))))
        x = nn.relu(nn.Dense(5, name="fc2")(x))
        return nn.Dense(3, name="head")(x)


@pytest.fixture(scope="module")
def model():
    return lora(from_linen(Plain(), input_shape=(4,), num_classes=3, name="plain"), 2, alpha=4.0)


@pytest.fixture(scope="module")
def cohorts():
    return [make_cohort((4,), k=K, steps=3, batch=4, seed=t, real_steps=[3, 1, 2], real_examples=[4, 2, 3],
                        client_ids=ids) for t, ids in enumerate(([0, 2, 4], [1, 2, 3]))]


def is_a(path):
    return "lora_a" in path


def is_b(path):
    return "lora_b" in path


_GRADIENTS = {}


def gradient(model):
    """The cross-entropy gradient of ``model``'s trained leaves (flattened), jitted once per model."""
    if id(model) not in _GRADIENTS:
        shapes = jax.eval_shape(model.init_variables, jax.random.key(0))["params"]

        def loss(flat, frozen, x, y):
            p = jax.tree.unflatten(jax.tree.structure(shapes), flat)
            logits, _ = model.apply({"params": p, FROZEN: frozen, "batch_stats": {}}, x, True)
            return -jax.nn.log_softmax(logits)[np.arange(len(y)), y].mean()

        _GRADIENTS[id(model)] = jax.jit(jax.grad(loss))
    return _GRADIENTS[id(model)]


def reference(model, global_vars, cohorts, *, frozen_a=False, personal_b=False):
    """The method written plainly: per round, per client, SGD steps on its real examples (gradients by
    jax.grad of the model, everything else numpy float64), then the n_k-weighted mean of what is shared."""
    f64 = lambda t: jax.tree.map(lambda a: np.array(a, np.float64), t)  # noqa: E731
    g = f64(global_vars)
    own_b = {i: {p: v for p, v in leaf_paths(g["params"]) if is_b(p)} for i in range(N)}
    errors = []
    for cohort in cohorts:
        results, weights = [], []
        for k, cid in enumerate(cohort.info.client_ids):
            params = dict(leaf_paths(g["params"]))
            if personal_b:
                params.update(own_b[int(cid)])
            for s in range(cohort.data.step_mask.shape[1]):
                if not cohort.data.step_mask[k, s]:
                    continue
                real = cohort.data.example_mask[k, s]
                x, y = cohort.data.x[k, s][real], cohort.data.y[k, s][real]

                paths = [p for p, _ in leaf_paths(g["params"])]
                grads = gradient(model)([params[p].astype(np.float32) for p in paths],
                                        jax.tree.map(lambda a: a.astype(np.float32), g[FROZEN]), x, y)
                for p, gr in zip(paths, grads):
                    if not (frozen_a and is_a(p)):
                        params[p] = params[p] - LR * np.asarray(gr, np.float64)
            results.append(params)
            weights.append(float(cohort.info.num_samples[k]))
            if personal_b:
                own_b[int(cid)] = {p: v for p, v in params.items() if is_b(p)}
        w = np.array(weights) / np.sum(weights)
        errors.append(aggregation_error(model, results, w))
        new = {p: sum(wi * r[p] for wi, r in zip(w, results)) for p in results[0]}
        for p, v in new.items():
            if not ((frozen_a and is_a(p)) or (personal_b and is_b(p))):
                node = g["params"]
                for key in p[:-1]:
                    node = node[key]
                node[p[-1]] = v
    return g, own_b, errors


def aggregation_error(model, results, w):
    total = 0.0
    for adapter in model.lora.adapters:
        a = [r[(*adapter.path, "lora_a", "kernel")] for r in results]
        b = [r[(*adapter.path, "lora_b", "kernel")] for r in results]
        mean_of_products = sum(wi * ai @ bi for wi, ai, bi in zip(w, a, b))
        product_of_means = sum(wi * ai for wi, ai in zip(w, a)) @ sum(wi * bi for wi, bi in zip(w, b))
        total += np.sum((model.lora.scale * (product_of_means - mean_of_products)) ** 2)
    return np.sqrt(total)


def run(model, method, cohorts):
    r = FederatedRound(model, method, num_clients=N, cohort_size=K, client_optimizer=optax.sgd(LR), strategy=fused())
    state = r.init(jax.random.key(0))
    first, metrics = jax.device_get(state), []
    for t, c in enumerate(cohorts):
        state, m = r(state, c, jax.random.key(t))
        metrics.append(jax.device_get(m))
    return r, first, jax.device_get(state), metrics


@pytest.fixture(scope="module")
def fedit_run(model, cohorts):
    return run(model, fedit(), cohorts)


def assert_close(got, expected):
    for (path, e), gv in zip(leaf_paths(expected), jax.tree.leaves(got)):
        np.testing.assert_allclose(gv, e, rtol=2e-4, atol=2e-5, err_msg="/".join(path))


@AT_O0
def test_fedit_matches_the_plain_reference_and_reports_its_aggregation_error(model, cohorts, fedit_run):
    _, first, state, metrics = fedit_run
    expected, _, errors = reference(model, first.variables, cohorts)
    assert_close(state.variables["params"], expected["params"])
    np.testing.assert_array_equal(state.variables[FROZEN]["fc1"]["kernel"], first.variables[FROZEN]["fc1"]["kernel"])
    assert errors[1] > 1e-6  # the clients' adapters differ: averaging A and B apart is not averaging B·A
    np.testing.assert_allclose([m["lora_aggregation_error"] for m in metrics], errors, rtol=2e-3, atol=1e-7)


def test_fedit_is_fedavg_on_a_lora_model(model, cohorts, fedit_run):
    _, _, state, _ = fedit_run
    _, _, plain, _ = run(model, fedavg(), cohorts)
    for a, b in zip(jax.tree.leaves(plain.variables), jax.tree.leaves(state.variables)):
        np.testing.assert_array_equal(a, b)


@AT_O0
def test_ffa_lora_matches_the_reference_keeps_a_and_sends_b_only(model, cohorts, fedit_run):
    _, first, state, metrics = run(model, ffa_lora(), cohorts)
    expected, _, _ = reference(model, first.variables, cohorts, frozen_a=True)
    assert_close(state.variables["params"], expected["params"])
    for adapter in model.lora.adapters:
        np.testing.assert_array_equal(state.variables["params"][adapter.path[0]]["lora_a"]["kernel"],
                                      first.variables["params"][adapter.path[0]]["lora_a"]["kernel"])
    ffa_up = metrics[0]["upload_bytes_per_layer"]
    fedit_up = fedit_run[3][0]["upload_bytes_per_layer"]
    a_layers, b_layers = list(model.lora.a_layers), list(model.lora.b_layers)
    assert not ffa_up[:, a_layers].any()
    np.testing.assert_array_equal(ffa_up[:, b_layers], fedit_up[:, b_layers])
    # A is [in, 2] and B [2, out]: A of 4·2 and 6·2, B of 2·6 and 2·5 floats; the adapters' upload drops A's 20
    np.testing.assert_array_equal(fedit_up[0, a_layers + b_layers].sum() - ffa_up[0, a_layers + b_layers].sum(),
                                  4 * (4 * 2 + 6 * 2))


@AT_O0
def test_ffa_lora_runs_with_dp_and_a_stays_put(model, cohorts):
    method = dp_fedavg(ffa_lora(), clip=0.5, noise_multiplier=1.0)
    _, first, state, _ = run(model, method, cohorts[:1])
    np.testing.assert_array_equal(state.variables["params"]["fc1"]["lora_a"]["kernel"],
                                  first.variables["params"]["fc1"]["lora_a"]["kernel"])
    assert np.abs(state.variables["params"]["fc1"]["lora_b"]["kernel"]).sum() > 0


@AT_O0
def test_fedsa_lora_matches_the_reference_with_personal_b(model, cohorts):
    r, first, state, _ = run(model, fedsa_lora(), cohorts)
    expected, own_b, _ = reference(model, first.variables, cohorts, personal_b=True)
    assert_close(state.variables["params"], expected["params"])  # A and head averaged, B the global start value
    clients = state.method_state.clients["params"]
    for cid in range(N):
        for path, value in own_b[cid].items():
            node = clients
            for key in path:
                node = node[key]
            np.testing.assert_allclose(node[cid], value, rtol=2e-4, atol=2e-5)
    assert FROZEN not in state.method_state.clients  # no per-client copy of the base
    personal = r.method.personal(r.ctx, state.method_state, state.variables)
    assert personal.variables[FROZEN]["fc1"]["kernel"].shape == (4, 6)  # one base beside the [N] personal parts


@AT_O0
@pytest.mark.parametrize("method", [fedit, ffa_lora, fedsa_lora])
def test_a_model_without_adapters_is_refused_in_one_sentence(method):
    plain = from_linen(Plain(), input_shape=(4,), num_classes=3, name="plain")
    with pytest.raises(UserError, match="add --lora RANK"):
        FederatedRound(plain, method(), num_clients=N, cohort_size=K, client_optimizer=optax.sgd(LR)).init(
            jax.random.key(0))


@AT_O0
def test_rank_tiers_train_and_send_each_clients_leading_components(model, cohorts):
    from fedpartial._src.methods.lora.ranks import rank_tiers
    from fedpartial._src.models.lora_ranks import with_lora_ranks

    # N = 5 clients in two tiers by id (0-2: rank 1, 3-4: rank 2); the first cohort is ids 0, 2, 4
    tiered = with_lora_ranks(model, (1, 2))
    r, first, state, metrics = run(tiered, rank_tiers(fedit()), cohorts)
    assert r.trace_count == 1  # one compiled round serves every tier
    up = metrics[0]["upload_bytes_per_layer"]
    fc1_a, fc1_b = model.lora.adapters[0].a_layer, model.lora.adapters[0].b_layer
    np.testing.assert_array_equal(up[:, fc1_a], 4 * np.array([4 * 1, 4 * 1, 4 * 2]))
    np.testing.assert_array_equal(up[:, fc1_b], 4 * np.array([1 * 6, 1 * 6, 2 * 6]))
    # each client receives its own rank's components too (and the whole trained head)
    down = metrics[0]["download_bytes_per_layer"]
    np.testing.assert_array_equal(down[:, fc1_a], up[:, fc1_a])
    np.testing.assert_array_equal(down[:, fc1_b], up[:, fc1_b])
    np.testing.assert_array_equal(down[:, -1], 4 * (5 * 3 + 3))
    _, _, full, _ = run(model, fedit(), cohorts[:1])
    one_round = run(tiered, rank_tiers(fedit()), cohorts[:1])[2]
    a = one_round.variables["params"]["fc1"]["lora_a"]["kernel"]
    # component 2 was trained by client 4 alone, component 1 by all three: both differ from FedIT's
    assert not np.allclose(a, full.variables["params"]["fc1"]["lora_a"]["kernel"])
    assert not np.allclose(a[:, 1], first.variables["params"]["fc1"]["lora_a"]["kernel"][:, 1])
