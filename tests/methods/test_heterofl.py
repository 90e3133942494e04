"""HeteroFL (static width reduction): each element averaged over its holders, narrow graphs for moderate and
weak clients, ResNet20's residual stream, FjORD at the same widths, and the paper's Table 10 capacities."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedpartial._src.core import aggregation, masks
from fedpartial._src.core.errors import UserError
from fedpartial._src.core.types import CohortInfo, InitView, MethodContext, RoundView
from fedpartial._src.engine import graphs
from fedpartial._src.engine.metrics import traffic_totals
from fedpartial._src.engine.round import FederatedRound
from fedpartial._src.engine.strategy import fused, stepwise
from fedpartial._src.engine.types import ServerState
from fedpartial._src.experiment.config import RunConfig
from fedpartial._src.experiment.simulation import Simulation
from fedpartial._src.methods.catalog import get_method
from fedpartial._src.methods.submodel.dropout import fjord
from fedpartial._src.methods.tiered.heterofl import DEFAULT_WIDTHS, heterofl, width_mask
from fedpartial._src.methods.tiered.width_capacity import capacity_table
from fedpartial._src.models import resnet, zoo
from fedpartial._src.models.adapter import from_linen
from fedpartial._src.models.registry import build_model
from tests.conftest import make_cohort

# Rounds of a few steps, each test its own programs: compiled at -O0 (tests/conftest.py says why that changes
# nothing here)
pytestmark = pytest.mark.usefixtures("engine_compiled_at_o0")

LR, MOMENTUM = 0.1, 0.9
OPT = optax.sgd(LR, momentum=MOMENTUM)
KEY = jax.random.key(0, impl="rbg")  # initialises conv nets far faster than threefry on CPU
SMALL = zoo.MLP(3, hidden=(6, 5))  # moderate (r=1/2) keeps 3 and 3 units, weak (r=1/4) 2 and 2
RATIOS = (1.0, 0.5, 0.25)


def adapt(module, input_shape, num_classes=3, name="m"):
    return from_linen(module, input_shape=input_shape, num_classes=num_classes,
                      sequential=not isinstance(module, resnet.ResNet20), name=name)


def small_resnet():
    """ResNet20's class at a test size: stem, an identity block (4 channels), a downsampling block with a
    projection shortcut (8 channels), head."""
    return resnet.ResNet20(num_classes=3, stage_features=(4, 8), blocks_per_stage=1)


def build(model, method, *, n=3, k=3, strategy=None, bn_policy="global"):
    return FederatedRound(model, method, num_clients=n, cohort_size=k, client_optimizer=OPT,
                          strategy=strategy or fused(), bn_policy=bn_policy)


def start(r, seed=0):
    """An initial server state with random variables drawn by numpy (an eager flax init of a conv net costs
    seconds on CPU, a jitted one a compilation); the optimizer and method states are the round's own."""
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        name = str(getattr(path[-1], "key", ""))
        if name in ("var", "scale"):  # BatchNorm: around 1
            return jnp.asarray(rng.uniform(0.5, 1.5, leaf.shape), jnp.float32)
        if len(leaf.shape) == 1:  # biases and means: small
            return jnp.asarray(0.1 * rng.normal(size=leaf.shape), jnp.float32)
        return jnp.asarray(rng.normal(size=leaf.shape) / np.sqrt(math.prod(leaf.shape[:-1])), jnp.float32)

    variables = jax.tree_util.tree_map_with_path(draw, jax.eval_shape(r.model.init_variables, KEY))
    return ServerState(round=jnp.zeros((), jnp.int32), variables=variables,
                       opt_state=r.server_optimizer.init(variables["params"]),
                       method_state=r.method.init(r.ctx, InitView(global_vars=variables, key=KEY)))


def cohorts(rounds=2, k=3, shape=(4,), **kw):
    return [make_cohort(shape, k=k, steps=3, batch=5, seed=t, real_steps=[3, 2, 3][:k],
                        real_examples=[5, 3, 4][:k], **kw) for t in range(rounds)]


# ---- options ------------------------------------------------------------------------------------


def test_options_and_errors():
    assert get_method("heterofl", widths="0.5,0.25", weighting="samples").name == "heterofl"
    with pytest.raises(UserError, match="--widths = '0.5' must be two width ratios"):
        get_method("heterofl", widths="0.5")
    with pytest.raises(UserError, match="--widths = \\(0.5, 1.5\\) must be two width ratios in \\(0, 1\\]"):
        get_method("heterofl", widths=(0.5, 1.5))
    with pytest.raises(UserError, match="--heterofl-weights = 'n_k' must be one of uniform, samples"):
        get_method("heterofl", weighting="n_k")
    with pytest.raises(UserError, match="fjord: give either --tiers"):
        get_method("fjord", tiers=(0.5, 1.0), tier_mix="1,1,1")
    assert DEFAULT_WIDTHS == (7 / 16, 3 / 16)


# ---- the width mask -----------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["cnn", "resnet"])
def test_the_width_mask_is_exactly_what_the_narrow_graph_holds(which):
    """Expanded (in full-model coordinates, ResNet20 wired explicitly) it marks exactly the elements the
    narrow graph extracts, and counting it without expanding gives the narrow model's size."""
    module = zoo.CNN2C1F(3, features=(4, 6)) if which == "cnn" else small_resnet()
    model = adapt(module, (8, 8, 3))
    shapes = jax.eval_shape(model.init_variables, KEY)
    for ratio in (0.5, 0.25):
        graph = graphs.width(model, ratio, module=module)
        narrow = graphs.narrow_model(model, ratio, module=module)
        mask = width_mask(model, narrow)
        expanded = jax.jit(lambda m: masks.expand_variables(model.structure, m, shapes))(mask)
        held = graph.insert(jax.tree.map(lambda a: np.zeros(a.shape, bool), shapes),
                            jax.tree.map(lambda a: np.ones(a.shape, bool), jax.eval_shape(graph.extract, shapes)))
        chex.assert_trees_all_equal(expanded, held)
        narrow_shapes = jax.eval_shape(narrow.init_variables, KEY)
        for collection, tree in shapes.items():
            narrow_size = sum(math.prod(a.shape) for a in jax.tree.leaves(narrow_shapes[collection]))
            assert int(masks.count_elements(model.structure, mask, tree, collection)) == narrow_size
    # The full width: every element.
    full = width_mask(model, None)
    assert int(masks.count_elements(model.structure, full, shapes["params"])) == sum(
        math.prod(a.shape) for a in jax.tree.leaves(shapes["params"]))


# ---- aggregation over holders, by hand ----------------------------------------------------------


@pytest.mark.parametrize("weighting", ["uniform", "samples"])
def test_each_element_is_averaged_over_its_holders_by_hand(weighting):
    """Three clients of a Dense(4) MLP at widths 1, 1/2, 1/4 return 1, 2 and 4 on what they hold (n = 1, 2, 5).

    fc1 unit 0 and head row 0 are held by all three, unit / row 1 by strong and moderate, 2–3 by strong only."""
    module = zoo.MLP(3, hidden=(4,))
    model = adapt(module, (2,))
    method = heterofl(tier_mix=(1, 1, 1), widths=(0.5, 0.25), weighting=weighting, module=module)
    ctx = MethodContext(model=model, num_clients=3, cohort_size=3)
    cohort = CohortInfo(jnp.arange(3, dtype=jnp.int32), jnp.asarray([1.0, 2.0, 5.0]), jnp.ones(3, bool))
    global_vars = jax.tree.map(lambda a: jnp.full(a.shape, -1.0), jax.eval_shape(model.init_variables, KEY))

    @jax.jit
    def server(global_vars, cohort):
        trained = []
        for ratio, value in zip(RATIOS, (1.0, 2.0, 4.0)):
            graph = graphs.width(model, ratio, module=module)
            trained.append(graph.insert(global_vars, jax.tree.map(lambda a, v=value: jnp.full(a.shape, v),
                                                                  graph.extract(global_vars))))
        trained = jax.tree.map(lambda *a: jnp.stack(a), *trained)
        view = RoundView(key=None, round=0, global_vars=global_vars, method_state=None, client_state=None,
                         cohort=cohort, data=None)
        plan = method.plan(ctx, view)
        selection = method.select(ctx, view._replace(plan=plan, trained_vars=trained))
        new, _ = aggregation.aggregate(model.structure, global_vars, trained, selection.upload, selection.weights,
                                       ("params",))
        return new, plan, selection

    new, plan, selection = server(global_vars, cohort)
    all3, two, one = (7 / 3, 3 / 2, 1.0) if weighting == "uniform" else (25 / 8, 5 / 3, 1.0)
    units = np.array([all3, two, one, one])
    p = new["params"]
    np.testing.assert_allclose(p["fc1"]["kernel"], np.stack([units, units]), rtol=1e-6)
    np.testing.assert_allclose(p["fc1"]["bias"], units, rtol=1e-6)
    np.testing.assert_allclose(p["head"]["kernel"], np.repeat(units[:, None], 3, axis=1), rtol=1e-6)
    np.testing.assert_allclose(p["head"]["bias"], [all3] * 3, rtol=1e-6)
    # What each client sends and receives: its narrow model, 27 / 15 / 9 float32 values.
    for mask in (plan.download, selection.upload):
        np.testing.assert_array_equal(masks.count_bytes(model.structure, mask, global_vars, ("params",)),
                                      [27 * 4, 15 * 4, 9 * 4])


# ---- the engine against a plain-Python reference ------------------------------------------------


def _narrow_loss(q, x, y, real, r):
    """The narrow MLP's mean cross-entropy over the real examples, hidden outputs ×1/r (written out by hand)."""
    h = jax.nn.relu((x @ q["fc1"]["kernel"] + q["fc1"]["bias"][None]) / r)
    h = jax.nn.relu((h @ q["fc2"]["kernel"] + q["fc2"]["bias"][None]) / r)
    logp = jax.nn.log_softmax(h @ q["head"]["kernel"] + q["head"]["bias"][None])
    ce = -jnp.take_along_axis(logp, y[:, None], axis=1)[:, 0]
    return jnp.sum(ce * real) / jnp.maximum(jnp.sum(real), 1.0)


_narrow_grad = jax.jit(jax.grad(_narrow_loss), static_argnums=4)


def reference_round(global_params, cohort, *, hidden=(6, 5), ratios=RATIOS, weighting="uniform", window=None):
    """HeteroFL as a textbook would write it, one client at a time: slice the leading units, train the
    small MLP (hidden outputs ×1/r) with momentum SGD, then average every element over its holders.
    ``window``: FedRolex's instead, the units ``window, window+1, … (mod units)`` of each hidden layer."""
    g = jax.tree.map(lambda a: np.array(a, np.float64), global_params)
    num = jax.tree.map(np.zeros_like, g)
    den = jax.tree.map(np.zeros_like, g)
    classes = g["head"]["bias"].shape[0]
    for k, r in enumerate(ratios):
        i0 = np.arange(g["fc1"]["kernel"].shape[0])
        i1, i2 = ((np.arange(math.ceil(r * h)) + (window or 0)) % h for h in hidden)
        cut = {"fc1": {"kernel": np.ix_(i0, i1), "bias": i1}, "fc2": {"kernel": np.ix_(i1, i2), "bias": i2},
               "head": {"kernel": np.ix_(i2, np.arange(classes)), "bias": np.arange(classes)}}
        p = {m: {n: g[m][n][cut[m][n]] for n in g[m]} for m in g}
        velocity = jax.tree.map(np.zeros_like, p)
        for s in range(cohort.data.step_mask.shape[1]):
            if not cohort.data.step_mask[k, s]:
                continue  # a padded step: nothing happens
            d = cohort.data
            grads = _narrow_grad(jax.tree.map(lambda a: a.astype(np.float32), p), d.x[k, s], d.y[k, s],
                                 d.example_mask[k, s].astype(np.float32), float(r))
            velocity = jax.tree.map(lambda v, dg: MOMENTUM * v + np.asarray(dg), velocity, grads)
            p = jax.tree.map(lambda a, v: a - LR * v, p, velocity)
        w = 1.0 if weighting == "uniform" else float(cohort.info.num_samples[k])
        for m in g:
            for n in g[m]:
                num[m][n][cut[m][n]] += w * p[m][n]
                den[m][n][cut[m][n]] += w
    return jax.tree.map(lambda n_, d, old: np.where(d > 0, n_ / np.where(d > 0, d, 1), old), num, den, g)


def test_engine_matches_a_plain_python_reference():
    model = adapt(SMALL, (4,))
    r = build(model, heterofl(tier_mix=(1, 1, 1), widths=(0.5, 0.25), module=SMALL))
    assert [g.name for g in r.groups] == ["strong", "moderate", "weak"]
    assert r.clients[2].init(jax.eval_shape(model.init_variables, KEY)).variables["params"]["fc2"]["kernel"].shape \
        == (2, 2)  # a weak client holds only its narrow model
    state = start(r)
    expected = jax.device_get(state.variables["params"])
    for t, c in enumerate(cohorts()):
        expected = reference_round(expected, c)
        state, m = r(state, c, jax.random.key(t))
        if t == 0:
            traces = r.trace_count
    assert r.trace_count == traces, "round 2 retraced"
    chex.assert_trees_all_close(jax.device_get(state.variables["params"]), expected, rtol=2e-5, atol=2e-6)
    assert set(m) >= {"train_loss_strong", "train_loss_moderate", "train_loss_weak"}


def test_all_strong_heterofl_is_fedavg():
    """Every client strong, n_k weights: one group training the whole model, every element averaged over
    everyone — the plain reference with every client at full width is textbook FedAvg."""
    model = adapt(SMALL, (4,))
    r = build(model, heterofl(weighting="samples"))
    assert [(g.name, g.graph) for g in r.groups] == [("strong", None)]
    state = start(r)
    expected = reference_round(jax.device_get(state.variables["params"]), cohorts(1)[0], ratios=(1, 1, 1),
                               weighting="samples")
    state, _ = r(state, cohorts(1)[0], jax.random.key(0))
    chex.assert_trees_all_close(jax.device_get(state.variables["params"]), expected, rtol=2e-5, atol=2e-6)


def test_a_cohort_without_slots_for_a_tier():
    """Every tier has members, but a cohort of 2 leaves the weak tier without a slot: no weak group, and the
    plan's rows are one strong and one moderate width (a tier without members: the run by name below)."""
    model = adapt(SMALL, (4,))
    r = build(model, heterofl(tier_mix=(1, 1, 1), module=SMALL), k=2)
    assert [(g.name, g.size, g.members) for g in r.groups] == [("strong", 1, (0,)), ("moderate", 1, (1,))]
    plan = r.method.plan(r.ctx, None)
    assert [int(n) for n in plan.download.neurons[0].sum(axis=1)] == [6, 3]


def test_without_the_scaler_heterofl_is_fjord_at_the_same_widths():
    """n_k-weighted HeteroFL without the Scaler trains exactly FjORD's ordered-dropout sub-models (masks on the
    full model), so the global models agree; HeteroFL's compiled narrow steps just skip the dropped units.
    Two strong clients and one weak one: the moderate tier has no client (no group) and that works; HeteroFL
    runs the stepwise strategy here (the reference test above runs the fused one)."""
    model = adapt(SMALL, (4,))
    results = []
    for method, strategy in ((heterofl(tier_mix=(2, 0, 1), widths=(0.5, 0.25), weighting="samples", scaler=False,
                                       module=SMALL), stepwise(2)),  # strong: 2 vmapped, weak: 1 alone
                             (fjord(tier_mix=(2, 0, 1), widths=(0.5, 0.25)), fused())):
        r = build(model, method, strategy=strategy)
        if method.name == "heterofl":
            assert [(g.name, g.size, g.members) for g in r.groups] == [("strong", 2, (0, 1)), ("weak", 1, (2,))]
        state = start(r)
        for t, c in enumerate(cohorts()):
            state, m = r(state, c, jax.random.key(t))
        results.append((jax.device_get(state.variables["params"]), traffic_totals(m)))
    chex.assert_trees_all_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-6)
    # FjORD also downloads one int32 width per masked layer; the parameters sent are the same.
    assert (results[1][1]["upload_bytes_per_client"] == results[0][1]["upload_bytes_per_client"]).all()


# ---- ResNet20: the residual stream, BatchNorm policies ------------------------------------------


def test_resnet20_round_with_three_tiers():
    """Round 1: all three tiers train. Round 2: the strong client drops out (weight 0), so every element outside
    the moderate width — parameters and running statistics (global BN) — stays bit-identical."""
    module = small_resnet()
    model = adapt(module, (8, 8, 3), name="resnet20")
    r = build(model, heterofl(tier_mix=(1, 1, 1), module=module))
    moderate = r.clients[1].init(jax.eval_shape(model.init_variables, KEY)).variables
    assert moderate["params"]["stage2_block1"]["shortcut_conv"]["kernel"].shape == (1, 1, 2, 4)  # 7/16 of 4, 8
    assert moderate["params"]["head"]["kernel"].shape == (4, 3)
    c1, c2 = cohorts(2, shape=(8, 8, 3))
    state, m = r(start(r), c1, jax.random.key(0))
    assert all(np.isfinite(m[f"train_loss_{t}"]) for t in ("strong", "moderate", "weak"))
    before = jax.device_get(state.variables)
    c2 = c2._replace(info=c2.info._replace(valid=np.array([False, True, True])))
    state, m = r(state, c2, jax.random.key(1))
    after = jax.device_get(state.variables)
    held = width_mask(model, graphs.narrow_model(model, DEFAULT_WIDTHS[0], module=module))
    changed = []
    for collection in ("params", "batch_stats"):
        inside = jax.jit(lambda m, c=collection: masks.expand(model.structure, m, before[c], c))(held)
        for new, old, on in zip(jax.tree.leaves(after[collection]), jax.tree.leaves(before[collection]),
                                jax.tree.leaves(inside)):
            on = np.asarray(on)
            np.testing.assert_array_equal(new[~on], old[~on])
            changed.extend(new[on] != old[on])
    assert np.mean(changed) > 0.9  # the held ones moved (bar a few a dead ReLU left without gradient)
    assert traffic_totals(m)["upload_bytes_per_client"][0] == 0


# ---- capacity: the paper's Table 10 -------------------------------------------------------------


def test_capacity_table_matches_table_10():
    model = adapt(resnet.ResNet20(10), (32, 32, 3), num_classes=10, name="resnet20")
    rows = capacity_table(model)
    assert [(r["tier"], r["width"]) for r in rows] == [("strong", 1.0), ("moderate", 0.4375), ("weak", 0.1875)]
    assert [r["params"] for r in rows] == [272_474, 52_811, 9_991]
    assert [r["activations"] for r in rows] == [6_422_848, 2_810_176, 1_204_544]
    # The paper's variant adds a 16→16 projection (c² weights, 2c BatchNorm values, 32·32·c outputs per
    # example) to stage1_block1; with it our counts are exactly Table 10's.
    paper = [(272_762, 6_947_136), (52_874, 3_039_552), (10_006, 1_302_848)]
    for row, c, (p, a) in zip(rows, (16, 7, 3), paper):
        assert row["params"] + c * c + 2 * c == p
        assert row["activations"] + 32 * 32 * 32 * c == a
    np.testing.assert_allclose([r["capacity"] for r in rows], [1.0, 0.43, 0.18], atol=0.005)


# ---- a run by name ------------------------------------------------------------------------------


@pytest.mark.slow  # lighter: the by-name narrow model (test_graphs_width), a tier without members (fjord test)
def test_a_run_by_model_name_with_a_tier_without_members():
    """The registry's MLP on the offline digits, 2 strong clients and 1 weak one (no moderate tier), static BN:
    the narrow model comes from the model's name, and the global model evaluated is the full-width model."""
    config = RunConfig(method="heterofl", options={"tier_mix": "2,0,1", "widths": "0.5,0.25"}, model="mlp",
                       num_clients=3, cohort_size=3, rounds=1, local_steps=2, batch_size=8, out_dir=None,
                       partition="iid", strategy="fused", bn_policy="static")
    sim = Simulation(config)
    assert [(g.name, g.size) for g in sim.round.groups] == [("strong", 2), ("weak", 1)]
    records = list(sim.rounds())
    assert np.isfinite(records[-1]["test_accuracy"]) and records[-1]["train_loss_weak"] > 0
    assert "train_loss_moderate" not in records[-1]
    assert sim.state.variables["params"]["fc1"]["kernel"].shape == (64, 200)
    # the weak client sent its 50×50 (and 64×50, 50×10) part: 4·(64·50+50 + 50·50+50 + 50·10+10) bytes
    assert records[-1]["upload_bytes"] == 4 * (2 * (64 * 200 + 200 + 200 * 200 + 200 + 200 * 10 + 10)
                                               + 64 * 50 + 50 + 50 * 50 + 50 + 50 * 10 + 10)


@pytest.mark.slow  # lighter: test_resnet20_round_with_three_tiers (ResNet20's class with one block per stage)
def test_the_real_resnet20_round_with_three_tiers():
    """The registry's ResNet20 (3 blocks per stage) on 8×8 images, static BN: each tier uploads exactly its
    narrow model — 272,474, 52,811 and 9,991 parameters (Table 10's counts without the 16→16 projection)."""
    model = adapt(build_model("resnet20", 10, (8, 8, 3)), (8, 8, 3), num_classes=10, name="resnet20")
    r = build(model, heterofl(tier_mix=(1, 1, 1)), bn_policy="static")
    _, m = r(start(r), cohorts(1, shape=(8, 8, 3), num_classes=10)[0], jax.random.key(0))
    assert list(traffic_totals(m)["upload_bytes_per_client"]) == [4 * 272_474, 4 * 52_811, 4 * 9_991]
    assert all(np.isfinite(m[f"train_loss_{t}"]) for t in ("strong", "moderate", "weak"))
