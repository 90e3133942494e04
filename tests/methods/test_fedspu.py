"""FedSPU: personal models, random active neurons, frozen-but-present parameters, masked aggregation."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedpartial._src.core import aggregation, masks
from fedpartial._src.costs import footprint as costs
from fedpartial._src.engine.metrics import traffic_totals
from fedpartial._src.engine.round import FederatedRound
from fedpartial._src.engine.strategy import fused, stepwise
from fedpartial._src.methods.base import ClientPlan, CohortInfo, MethodContext, MethodState, RoundView
from fedpartial._src.methods.basic.fedavg import fedavg
from fedpartial._src.methods.submodel import common as submodel
from fedpartial._src.methods.submodel.fedspu import fedspu
from fedpartial._src.models.adapter import from_linen
from tests.conftest import TinyMLP, make_cohort

# Rounds of a few steps, each test its own programs: compiled at -O0 (tests/conftest.py says why that changes
# nothing here)
pytestmark = pytest.mark.usefixtures("engine_compiled_at_o0")

N, K = 10, 4
IDS = [0, 3, 5, 9]  # tiers 0.2, 0.4, 0.6, 1.0 with N = 10 and five tiers


def _round(model, method, strategy=None, opt=None, k=K):
    return FederatedRound(model, method, num_clients=N, cohort_size=k,
                          client_optimizer=opt or optax.sgd(0.1, momentum=0.9),
                          strategy=strategy or stepwise(1))


def _perturbed(state, scale=0.3, seed=1):
    """Personal models that differ from the global model (as after earlier rounds)."""
    leaves, tree = jax.tree.flatten(state.method_state.clients)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    leaves = [a + scale * jax.random.normal(k, a.shape) for a, k in zip(leaves, keys)]
    return state._replace(method_state=state.method_state._replace(clients=jax.tree.unflatten(tree, leaves)))


def _row(tree, i):
    return jax.tree.map(lambda a: a[i], tree)


def test_every_client_at_p1_is_fedavg(mlp):
    cohort = make_cohort((4,), k=K, client_ids=IDS)
    a = _round(mlp, fedspu(tiers=(1.0,)))
    b = _round(mlp, fedavg())
    sa, sb = a.init(jax.random.key(0)), b.init(jax.random.key(0))
    for t in range(2):
        sa, _ = a(sa, cohort, jax.random.key(t))
        sb, _ = b(sb, cohort, jax.random.key(t))
    for x, y in zip(jax.tree.leaves(sa.variables), jax.tree.leaves(sb.variables)):
        np.testing.assert_allclose(x, y, atol=1e-6)


def test_active_counts_follow_tiers_and_output_is_never_masked(mlp):
    r = _round(mlp, fedspu())
    state = r.init(jax.random.key(0))
    plan = r.preview(state, make_cohort((4,), k=K, client_ids=IDS), jax.random.key(3)).plan
    # fc1 has 6 units, fc2 5: round-half-up of p·u, at least 1.
    np.testing.assert_array_equal(plan.train.neurons[0].sum(1), [1, 2, 4, 6])  # 1.2→1, 2.4→2, 3.6→4, 6
    np.testing.assert_array_equal(plan.train.neurons[1].sum(1), [1, 2, 3, 5])  # 1, 2, 3, 5
    assert bool(plan.train.neurons[2].all())
    # The server sends the active parameters and the active-neuron indices.
    np.testing.assert_array_equal(plan.extra_download_bytes, costs.index_bytes(mlp.structure, plan.train))


def test_frozen_parameters_bit_identical_and_inactive_global_elements_unchanged(mlp):
    opt = optax.chain(optax.add_decayed_weights(1e-2), optax.sgd(0.1, momentum=0.9))
    r = _round(mlp, fedspu(), opt=opt)
    state = _perturbed(r.init(jax.random.key(0)))
    ids = [0, 1, 2, 4]  # tiers 0.2, 0.2, 0.4, 0.4: some elements are active for nobody
    cohort = make_cohort((4,), k=K, client_ids=ids)
    key = jax.random.key(7)
    plan = r.preview(state, cohort, key).plan
    new, _ = r(state, cohort, key)
    anyone = np.zeros(0)
    for i, cid in enumerate(ids):
        elem = masks.expand_variables(mlp.structure, _row(plan.train, i), state.variables)
        before, after = _row(state.method_state.clients, cid), _row(new.method_state.clients, cid)
        for e, b, a in zip(jax.tree.leaves(elem["params"]), jax.tree.leaves(before["params"]),
                           jax.tree.leaves(after["params"])):
            e = np.asarray(e)
            np.testing.assert_array_equal(np.asarray(a)[~e], np.asarray(b)[~e])  # frozen: personal, untouched
            assert not np.array_equal(np.asarray(a)[e], np.asarray(b)[e])  # active: merged global, then trained
    # Elements no client had active keep the previous global value exactly.
    stacked = jax.vmap(lambda m: masks.expand_variables(mlp.structure, m, state.variables))(plan.train)
    for e, g0, g1 in zip(jax.tree.leaves(stacked["params"]), jax.tree.leaves(state.variables["params"]),
                         jax.tree.leaves(new.variables["params"])):
        nobody = ~np.asarray(e).any(0)
        anyone = np.concatenate([anyone, np.asarray(e).any(0).ravel()])
        np.testing.assert_array_equal(np.asarray(g1)[nobody], np.asarray(g0)[nobody])
    assert 0 < anyone.mean() < 1
    # Clients outside the cohort keep their personal models.
    for cid in set(range(N)) - set(ids):
        for a, b in zip(jax.tree.leaves(_row(state.method_state.clients, cid)),
                        jax.tree.leaves(_row(new.method_state.clients, cid))):
            np.testing.assert_array_equal(a, b)


def _toy_view(mlp, plan, trained, global_vars, personal, n):
    k = len(n)
    info = CohortInfo(client_ids=jnp.arange(k, dtype=jnp.int32), num_samples=jnp.asarray(n, jnp.float32),
                      valid=jnp.ones((k,), bool))
    return RoundView(key=jax.random.key(0), round=jnp.zeros((), jnp.int32), global_vars=global_vars,
                     method_state=MethodState(clients=personal), client_state=personal, cohort=info,
                     data=None, plan=plan, trained_vars=trained)


def test_hand_computed_three_client_round(mlp):
    """Global 0, client k's personal model and trained model all (k+1); n = (1, 2, 3)."""
    method = fedspu()
    ctx = MethodContext(model=mlp, num_clients=3, cohort_size=3)
    g = jax.tree.map(jnp.zeros_like, mlp.init_variables(jax.random.key(0)))
    personal = {c: jax.tree.map(lambda a: jnp.stack([jnp.full_like(a, k + 1.0) for k in range(3)]), t)
                for c, t in g.items()}
    fc1 = jnp.array([[1, 1, 0, 0, 0, 0], [0, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]], bool)
    fc2 = jnp.array([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 1, 0, 0, 0]], bool)
    active = submodel.neuron_mask(mlp.structure, (fc1, fc2, jnp.zeros((3, 3), bool)))
    plan = ClientPlan(train=active, download=active)

    # Merge: a client starts from the global value (0) on its active elements, its own elsewhere.
    start = method.client_start(ctx, g, _row(personal, 1), _row(plan, 1))
    k1 = np.asarray(start["params"]["fc2"]["kernel"])
    assert k1[1, 0] == 0 and k1[2, 1] == 0  # fc1 unit 1,2 active and fc2 unit 0,1 active
    assert k1[0, 0] == 2 and k1[1, 2] == 2  # fc1 unit 0 inactive / fc2 unit 2 inactive: personal (k+1 = 2)
    assert np.asarray(start["params"]["head"]["kernel"])[3, 0] == 2  # fc2 unit 3 inactive
    assert np.asarray(start["params"]["head"]["bias"]).tolist() == [0, 0, 0]  # classifier always active
    np.testing.assert_array_equal(start["batch_stats"]["bn1"]["mean"], [2, 0, 0, 2, 2, 2])

    trained = personal  # client k returns the value k+1 everywhere
    view = _toy_view(mlp, plan, trained, g, personal, n=[1.0, 2.0, 3.0])
    sel = method.select(ctx, view)
    agg = aggregation.aggregate(mlp.structure, g, trained, sel.upload, sel.weights, ("params", "batch_stats"))[0]
    p = agg["params"]
    # fc1 bias unit 1: active for all three: (1·1 + 2·2 + 3·3) / 6 = 14/6.
    np.testing.assert_allclose(p["fc1"]["bias"][1], 14 / 6, rtol=1e-6)
    # fc1 bias unit 0: clients 0 and 2: (1·1 + 3·3) / 4 = 2.5;  unit 3: client 2 only: 3.
    np.testing.assert_allclose(np.asarray(p["fc1"]["bias"])[[0, 3]], [2.5, 3.0], rtol=1e-6)
    # fc2 kernel [1, 0]: fc1 unit 1 and fc2 unit 0 active for clients 0, 1: (1·1 + 2·2) / 3 = 5/3.
    np.testing.assert_allclose(p["fc2"]["kernel"][1, 0], 5 / 3, rtol=1e-6)
    # fc2 kernel [2, 1]: fc1 unit 2 with fc2 unit 1: clients 1, 2: (2·2 + 3·3) / 5 = 13/5.
    np.testing.assert_allclose(p["fc2"]["kernel"][2, 1], 13 / 5, rtol=1e-6)
    # fc2 kernel [0, 1]: fc1 unit 0 active for 0 and 2, fc2 unit 1 for 1 and 2 → client 2 only: 3.
    np.testing.assert_allclose(p["fc2"]["kernel"][0, 1], 3.0, rtol=1e-6)
    # fc2 unit 2..4 active for nobody: the global value 0 stays.
    np.testing.assert_array_equal(p["fc2"]["kernel"][:, 2:], 0.0)
    # head row 0 (fc2 unit 0: clients 0, 1): (1 + 4) / 3;  head row 4: nobody → 0.
    np.testing.assert_allclose(p["head"]["kernel"][0], [5 / 3] * 3, rtol=1e-6)
    np.testing.assert_array_equal(p["head"]["kernel"][4], 0.0)
    # BatchNorm statistics follow their layer's neurons: bn1 mean unit 0: (1 + 9) / 4.
    np.testing.assert_allclose(agg["batch_stats"]["bn1"]["mean"][0], 2.5, rtol=1e-6)

    # The trained models become the personal models.
    new_state = method.update(ctx, view._replace(method_state=MethodState(clients=jax.tree.map(
        jnp.zeros_like, personal))))
    np.testing.assert_array_equal(new_state.clients["params"]["fc2"]["kernel"][2], 3.0)


def test_conv_to_dense_expansion_element_by_element(cnn):
    r = _round(cnn, fedspu())
    state = r.init(jax.random.key(0))
    plan = r.preview(state, make_cohort((4, 4, 1), k=K, client_ids=IDS), jax.random.key(5)).plan
    for i in range(K):
        mask_i = _row(plan.train, i)
        conv1, conv2, _ = (np.asarray(n) for n in mask_i.neurons)
        e = masks.expand_variables(cnn.structure, mask_i, state.variables)
        head = np.asarray(e["params"]["head"]["kernel"])  # [2·2·4, 3], NHWC flatten: row r ← channel r % 4
        for row in range(head.shape[0]):
            assert (head[row] == conv2[row % 4]).all(), (i, row)
        k2 = np.asarray(e["params"]["conv2"]["kernel"])  # [3, 3, 3 in, 4 out]
        for cin in range(3):
            for cout in range(4):
                assert (k2[:, :, cin, cout] == (conv1[cin] and conv2[cout])).all()
        k1 = np.asarray(e["params"]["conv1"]["kernel"])  # input side of the first layer is always active
        for cout in range(3):
            assert (k1[..., cout] == conv1[cout]).all()
        np.testing.assert_array_equal(np.asarray(e["params"]["bn1"]["scale"]), conv1)
        np.testing.assert_array_equal(np.asarray(e["batch_stats"]["bn1"]["var"]), conv1)
        np.testing.assert_array_equal(np.asarray(e["params"]["head"]["bias"]), True)


def _reference_round(model, state, cohort, plan, lr):
    """Plain-Python FedSPU round: loop over clients, numpy merge, masked SGD, the one aggregation formula."""
    g = jax.tree.map(np.asarray, state.variables)
    num, den = jax.tree.map(np.zeros_like, g["params"]), jax.tree.map(np.zeros_like, g["params"])
    x, y, ex, st = (np.asarray(a) for a in cohort.data)
    personal_out = []
    for i, cid in enumerate(np.asarray(cohort.info.client_ids)):
        elem = jax.tree.map(np.asarray, masks.expand_variables(model.structure, _row(plan.train, i), g))
        own = jax.tree.map(lambda a: np.asarray(a)[cid], state.method_state.clients)
        v = jax.tree.map(lambda m, a, b: np.where(m, a, b), elem, g, own)
        for s in range(x.shape[1]):
            if not st[i, s]:
                continue

            def loss(p):
                logits, stats = model.apply({"params": p, "batch_stats": v["batch_stats"]}, x[i, s], True, ex[i, s])
                ce = optax.softmax_cross_entropy_with_integer_labels(logits, y[i, s])
                return jnp.sum(ce * ex[i, s]) / jnp.maximum(ex[i, s].sum(), 1), stats

            grads, stats = jax.grad(loss, has_aux=True)(v["params"])
            v = {"params": jax.tree.map(lambda p, gr, m: np.where(m, p - lr * np.asarray(gr), p),
                                        v["params"], grads, elem["params"]),
                 "batch_stats": jax.tree.map(np.asarray, stats)}
        personal_out.append(v)
        n = float(cohort.info.num_samples[i])
        num = jax.tree.map(lambda a, m, p: a + n * m * p, num, elem["params"], v["params"])
        den = jax.tree.map(lambda a, m: a + n * m, den, elem["params"])
    new = jax.tree.map(lambda a, d, old: np.where(d > 0, a / np.maximum(d, 1e-30), old), num, den, g["params"])
    return new, personal_out


@pytest.mark.parametrize("strategy", [fused(), stepwise(1), stepwise(2)],
                         ids=["fused", "stepwise1", "stepwise2"])
def test_matches_plain_python_reference(mlp, strategy):
    lr = 0.2
    r = _round(mlp, fedspu(), strategy=strategy, opt=optax.sgd(lr))
    state = jax.device_get(_perturbed(r.init(jax.random.key(0))))  # host copy: the fused round donates
    cohort = make_cohort((4,), k=K, client_ids=IDS, real_steps=[3, 1, 2, 3], real_examples=[5, 3, 5, 4])
    key = jax.random.key(11)
    plan = r.preview(state, cohort, key).plan
    new, _ = r(state, cohort, key)
    want, personal = _reference_round(mlp, state, cohort, plan, lr)
    for a, b in zip(jax.tree.leaves(new.variables["params"]), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, atol=2e-6)
    for i, cid in enumerate(IDS):
        for a, b in zip(jax.tree.leaves(_row(new.method_state.clients, cid)), jax.tree.leaves(personal[i])):
            np.testing.assert_allclose(a, b, atol=2e-6)


def test_traffic_counts_active_parameters_and_indices(mlp):
    r = _round(mlp, fedspu())
    state = r.init(jax.random.key(0))
    cohort = make_cohort((4,), k=K, client_ids=IDS)
    key = jax.random.key(2)
    plan = r.preview(state, cohort, key).plan
    _, metrics = r(state, cohort, key)
    up = down = 0
    for i in range(K):
        fc1, fc2 = (int(n.sum()) for n in _row(plan.train, i).neurons[:2])
        # fc1: kernel 4·fc1 + bias fc1; bn1 scale, bias, mean, var: 4·fc1 ('global' BN policy);
        # fc2: kernel fc1·fc2 + bias fc2; head: kernel fc2·3 + bias 3.  float32: 4 bytes each.
        params = 4 * fc1 + fc1 + 4 * fc1 + fc1 * fc2 + fc2 + fc2 * 3 + 3
        index = min(4 * fc1, 1) + min(4 * fc2, 1)  # a 6- or 5-unit bit-mask is 1 byte
        up += 4 * params
        down += 4 * params + index
    metrics = traffic_totals(metrics)
    assert int(metrics["upload_bytes"]) == up
    assert int(metrics["download_bytes"]) == down


def test_personal_models_are_the_state_and_cost_n_models(mlp):
    method = fedspu()
    r = _round(mlp, method)
    state = r.init(jax.random.key(0))
    personal = method.personal(r.ctx, state.method_state, state.variables)
    model_bytes = sum(a.nbytes for a in jax.tree.leaves(state.variables))
    assert sum(a.nbytes for a in jax.tree.leaves(personal.variables)) == N * model_bytes
    assert personal.submodel is None and personal.stacked


def test_rejects_bad_tiers_and_non_sequential_models(mlp):
    with pytest.raises(ValueError, match="keep ratio 0"):
        fedspu(tiers=(0.0, 1.0))
    with pytest.raises(ValueError, match="keep ratio 1.5"):
        fedspu(tiers=(1.5,))
    not_sequential = from_linen(TinyMLP(), input_shape=(4,), num_classes=3, sequential=False)
    with pytest.raises(ValueError, match="sequential"):
        _round(not_sequential, fedspu()).init(jax.random.key(0))


def test_personal_model_keeps_its_frozen_part_in_the_forward_pass(mlp):
    """Inactive parameters act in the forward pass: changing them changes the training loss."""
    r = _round(mlp, fedspu(tiers=(0.2,)), opt=optax.sgd(0.0))
    state = _perturbed(r.init(jax.random.key(0)))
    cohort = make_cohort((4,), k=K, client_ids=IDS)
    _, m1 = r(state, cohort, jax.random.key(0))
    state2 = _perturbed(state, scale=1.0, seed=5)
    _, m2 = r(state2, cohort, jax.random.key(0))
    assert abs(float(m1["train_loss"]) - float(m2["train_loss"])) > 1e-3
