"""FedRolex: the rolling window by hand, the windowed graph holds exactly the mask, a plain-Python reference
over three rounds, its first round is HeteroFL's, all strong is FedAvg, and models whose units cannot roll."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedpartial._src.core import masks
from fedpartial._src.core.errors import UserError
from fedpartial._src.engine import graphs
from fedpartial._src.engine.metrics import traffic_totals
from fedpartial._src.engine.strategy import stepwise
from fedpartial._src.experiment.config import RunConfig
from fedpartial._src.experiment.simulation import Simulation
from fedpartial._src.methods.catalog import get_method
from fedpartial._src.methods.tiered.fedrolex import fedrolex
from fedpartial._src.methods.tiered.heterofl import heterofl, width_mask
from fedpartial._src.models import resnet, zoo
from tests.methods.test_heterofl import KEY, SMALL, adapt, build, cohorts, reference_round, start

# Tests whose rounds are compared with a tolerance or only checked for what they record: compiled at -O0
# (tests/conftest.py); not the reference test, whose first round must equal HeteroFL's bit for bit (only at -O1)
AT_O0 = pytest.mark.usefixtures("engine_compiled_at_o0")


def held_units(mask, layer):
    return [int(i) for i in np.flatnonzero(np.asarray(mask.neurons[layer]))]


def test_the_window_rolls_one_unit_a_round_and_wraps():
    """Dense(4) → Dense(3) at width 1/2: 2 of 4 and 2 of 3 units, starting at unit ``round`` of each layer."""
    module = zoo.MLP(3, hidden=(4, 3))
    model = adapt(module, (2,))
    narrow = graphs.narrow_model(model, 0.5, module=module)
    expected = {0: ([0, 1], [0, 1]), 1: ([1, 2], [1, 2]), 2: ([2, 3], [0, 2]), 3: ([0, 3], [0, 1]),
                4: ([0, 1], [1, 2])}
    for t, (first, second) in expected.items():
        mask = jax.jit(lambda w: width_mask(model, narrow, w))(jnp.int32(t))
        assert (held_units(mask, 0), held_units(mask, 1), held_units(mask, 2)) == (first, second, [0, 1, 2])
    # The leading units are window 0, and HeteroFL's mask.
    chex.assert_trees_all_equal(width_mask(model, narrow, 0), width_mask(model, narrow))


@pytest.mark.parametrize("which", ["cnn", "resnet"])
def test_the_windowed_graph_holds_exactly_the_mask(which):
    """At every window (past a wrap too) the narrow graph extracts exactly the elements the mask marks in
    full-model coordinates — a conv map flattened into a Dense, ResNet's residual stream and projection —
    and writing the extract back changes nothing."""
    module = zoo.CNN2C1F(3, features=(4, 6)) if which == "cnn" else resnet.ResNet20(
        num_classes=3, stage_features=(4, 8), blocks_per_stage=1)
    model = adapt(module, (8, 8, 3))
    shapes = jax.eval_shape(model.init_variables, KEY)
    variables = jax.tree.map(lambda a: jnp.asarray(np.random.default_rng(0).normal(size=a.shape), a.dtype), shapes)
    graph = graphs.width(model, 0.5, module=module)
    narrow = graphs.narrow_model(model, 0.5, module=module)
    assert graph.windowed and graphs.rolls_units_consistently(model, 0.5, module=module)
    for window in (0, 3, 7):
        mask = width_mask(model, narrow, window)
        expanded = masks.expand_variables(model.structure, mask, shapes)
        zeros = jax.tree.map(lambda a: np.zeros(a.shape, bool), shapes)
        held = graph.insert(zeros, jax.tree.map(lambda a: np.ones(a.shape, bool), graph.extract(zeros, window)),
                            window)
        chex.assert_trees_all_equal(expanded, held)
        chex.assert_trees_all_equal(graph.insert(variables, graph.extract(variables, window), window), variables)


# The fused FedRolex round of the small MLP (one client per tier) is traced, lowered and run once for the reference
# test and the strategy test (the persistent cache shares only the compilation): the two stay on one xdist worker.
SEVEN_ROUNDS = pytest.mark.xdist_group("fedrolex_seven_rounds")


@pytest.fixture(scope="module")
def seven_rounds():
    """The fused round and the host copy of its state after each of seven rounds of ``cohorts(7)`` (keys 0-6),
    with the last round's metrics and the trace count after the first round."""
    r = build(adapt(SMALL, (4,)), fedrolex(tier_mix=(1, 1, 1), widths=(0.5, 0.25), module=SMALL))
    state, states = start(r), []
    for t, c in enumerate(cohorts(7)):
        state, m = r(state, c, jax.random.key(t))
        states.append(jax.device_get(state))
        if t == 0:
            traces = r.trace_count
    return r, states, m, traces


@SEVEN_ROUNDS
def test_engine_matches_a_plain_python_reference_past_the_wrap(seven_rounds):
    """Strong, moderate (1/2) and weak (1/4) clients of a Dense(6) → Dense(5) MLP: at round t each narrow
    client trains units t, t+1, … of each hidden layer (mod 6 and mod 5); every element averaged over its
    holders.  Seven rounds: the windows wrap around both layers (rounds 5 and 6 start past the last unit).
    Its first round is HeteroFL's, bit for bit; the next ones are not."""
    model = adapt(SMALL, (4,))
    r, states, m, traces = seven_rounds
    hetero = build(model, heterofl(tier_mix=(1, 1, 1), widths=(0.5, 0.25), module=SMALL))
    other = start(hetero)
    expected = jax.device_get(start(r).variables["params"])
    for t, (c, state) in enumerate(zip(cohorts(7), states)):
        expected = reference_round(expected, c, window=t)
        other, _ = hetero(other, c, jax.random.key(t))
        if t == 0:
            chex.assert_trees_all_equal(state.variables, jax.device_get(other.variables))
        chex.assert_trees_all_close(state.variables["params"], expected, rtol=2e-5, atol=2e-6)
    assert r.trace_count == traces, "a later round retraced"
    assert not np.allclose(state.variables["params"]["fc1"]["kernel"], other.variables["params"]["fc1"]["kernel"])
    # Each client sends and receives its window: 4→6→5→3 at full width, 4→3→3→3 and 4→2→2→3 (float32).
    traffic = traffic_totals(m)
    for way in ("upload", "download"):
        np.testing.assert_array_equal(traffic[f"{way}_bytes_per_client"], [4 * 83, 4 * 39, 4 * 25])


def two_rounds(method, strategy=None):
    """The global variables after two rounds of ``method`` on the small MLP."""
    r = build(adapt(SMALL, (4,)), method, strategy=strategy)
    state = start(r)
    for t, c in enumerate(cohorts(2)):
        state, _ = r(state, c, jax.random.key(t))
    return jax.device_get(state.variables)


@SEVEN_ROUNDS
def test_stepwise_strategy_agrees(seven_rounds):
    """Two rounds stepwise equal the fused round's first two (:func:`seven_rounds`, the same cohorts and keys)."""
    fused_two = seven_rounds[1][1].variables
    chex.assert_trees_all_close(two_rounds(fedrolex(tier_mix=(1, 1, 1), widths=(0.5, 0.25), module=SMALL),
                                           stepwise(1)), fused_two, rtol=1e-6, atol=1e-7)


@AT_O0
def test_all_strong_fedrolex_is_fedavg():
    """Every client strong with n_k weights: the whole model, averaged over everyone — FedAvg."""
    chex.assert_trees_all_close(two_rounds(fedrolex(weighting="samples")), two_rounds(get_method("fedavg")),
                                rtol=1e-6, atol=1e-7)


def test_an_option_a_resnet_is_refused_and_projection_shortcuts_roll():
    """Option-A shortcuts place a stage's channels at a fixed offset of the next stage's: rolling every unit
    axis changes the function, so windows would not be sub-networks — refused in one sentence."""
    zeros = resnet.ResNet20(num_classes=3, stage_features=(4, 8), blocks_per_stage=1, shortcut="zeros")
    model = adapt(zeros, (8, 8, 3))
    assert not graphs.rolls_units_consistently(model, 0.5, module=zeros)
    with pytest.raises(UserError, match="fedrolex: rolling the units of model m changes what it computes"):
        build(model, fedrolex(tier_mix=(1, 1, 1), widths=(0.5, 0.25), module=zeros))


def test_a_model_with_no_width_reduced_version_is_refused_before_any_unit_is_rolled(monkeypatch):
    """The width graphs are built first: their one sentence comes before the rolling check runs the model
    eagerly (measured 6.5 s of small compilations for a one-block transformer, 0.3 s after)."""
    import flax.linen as nn

    from fedpartial._src.models.adapter import from_linen

    class Plain(nn.Module):  # a user's module, with no width-reduced version
        @nn.compact
        def __call__(self, x, train=False):
            return nn.Dense(3, name="head")(nn.relu(nn.Dense(4, name="fc")(x)))

    monkeypatch.setattr(graphs, "rolls_units_consistently", lambda *a, **k: pytest.fail("rolled before refusing"))
    model = from_linen(Plain(), input_shape=(2,), num_classes=3, sequential=True, name="plain")
    with pytest.raises(UserError, match="model 'plain' has no width-reduced version"):
        build(model, fedrolex(tier_mix=(1, 1, 1), widths=(0.5, 0.25)))


@AT_O0
def test_a_run_by_model_name():
    """From the run configuration, as the CLI builds it: the registry's MLP on the offline digits, one client per
    tier; the window moves, what each client sends does not."""
    config = RunConfig(method="fedrolex", options={"tier_mix": "1,1,1", "widths": "0.5,0.25"}, model="mlp",
                       num_clients=3, cohort_size=3, rounds=2, local_steps=2, batch_size=8, out_dir=None,
                       partition="iid", strategy="fused", bn_policy="static")
    sim = Simulation(config)
    assert [(g.name, g.size) for g in sim.round.groups] == [("strong", 1), ("moderate", 1), ("weak", 1)]
    records = list(sim.rounds())
    assert all(np.isfinite(r["test_accuracy"]) and r["train_loss_weak"] > 0 for r in records[-1:])
    assert records[0]["upload_bytes"] == records[1]["upload_bytes"] == 4 * sum(
        64 * h + h + h * h + h + h * 10 + 10 for h in (200, 100, 50))
