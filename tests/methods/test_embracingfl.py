"""EmbracingFL: tiers, cuts, layer-wise aggregation, cached activations ≡ mask-only, capacity."""

import chex
import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

from fedpartial._src.core.errors import UserError
from fedpartial._src.core.types import Batch, CohortInfo, MethodContext
from fedpartial._src.engine.round import FederatedRound
from fedpartial._src.engine.strategy import fused, stepwise
from fedpartial._src.engine.types import Cohort
from fedpartial._src.methods.basic.fedavg import fedavg
from fedpartial._src.methods.catalog import get_method
from fedpartial._src.methods.tiered.embracingfl import capacity_table, default_cuts, embracingfl, resolve_cuts
from fedpartial._src.methods.tiered.tiers import CAPACITY_CASES, TierMix, cohort_rows, resolve_mix
from fedpartial._src.models.adapter import from_linen, from_stages
from fedpartial._src.models.registry import build_model
from tests.conftest import make_cohort
from tests.engine.test_groups import Block  # Dense → BatchNorm → ReLU

# Rounds of a few steps, each test its own programs: compiled at -O0 (tests/conftest.py says why that changes
# nothing here)
pytestmark = pytest.mark.usefixtures("engine_compiled_at_o0")
N = 8
OPT = optax.sgd(0.1, momentum=0.9)


@pytest.fixture(scope="module")
def staged():
    """Four stages: b1, b2, b3 (Dense+BN) and a Dense head; default cuts moderate 2, weak 3."""
    return from_stages([Block(6), Block(5), Block(4), nn.Dense(3)], input_shape=(4,), num_classes=3,
                       names=("b1", "b2", "b3", "head"), sequential=True, name="staged_mlp")


def run(model, method, cohorts, k, strategy=stepwise(1), **kw):
    r = FederatedRound(model, method, num_clients=N, cohort_size=k, client_optimizer=OPT,
                       strategy=strategy, **kw)
    state = r.init(jax.random.key(0))
    metrics = []
    for t, c in enumerate(cohorts):
        state, m = r(state, c, jax.random.key(10 + t))
        state = jax.device_get(state)
        metrics.append(jax.device_get(m))
    return r, state, metrics


def cohorts(ids_per_round, k, seed=0):
    return [make_cohort((4,), k=k, steps=3, seed=seed + t, real_steps=[3, 2, 3, 1][:k] + [3] * (k - 4),
                        real_examples=[5, 3, 4, 5][:k] + [5] * (k - 4), client_ids=ids)
            for t, ids in enumerate(ids_per_round)]


def prefix_params(model, variables, cut):
    return {name: v for name, v in variables["params"].items()
            if model.stage_names.index(name) < cut}


def test_default_cuts_follow_the_spec_and_the_generic_rule(staged):
    assert default_cuts(staged) == (2, 3)  # output-side half; trailing Dense-only stage (the head)
    for name, shape, classes, cuts in [("resnet20", (8, 8, 3), 10, (4, 7)), ("femnist_cnn", (28, 28, 1), 62, (2, 3)),
                                       ("lenet5", (32, 32, 3), 10, (2, 3)), ("mlp", (8, 8, 1), 10, (1, 2)),
                                       ("vgg9", (32, 32, 3), 10, (4, 8))]:
        model = from_linen(build_model(name, classes, shape), input_shape=shape, num_classes=classes, name=name)
        assert default_cuts(model) == cuts, name
    assert resolve_cuts(staged, "b2,head") == (0, 1, 3)
    with pytest.raises(UserError, match="not a stage of staged_mlp"):
        resolve_cuts(staged, "b2,nope")
    with pytest.raises(UserError, match="weak cut ≥ moderate cut"):
        resolve_cuts(staged, "3,1")


def test_cohort_rows_put_the_padding_rows_in_the_last_populated_tier(staged):
    """A cohort of 6 sampled clients padded to 8 (4 devices): the tiers are sized for the 6."""
    mix = TierMix((4, 2, 4))
    assert cohort_rows(mix, MethodContext(staged, 10, 6)) == (3, 1, 2)
    assert cohort_rows(mix, MethodContext(staged, 10, 8, padding=2)) == (3, 1, 4)
    assert cohort_rows(TierMix((5, 5, 0)), MethodContext(staged, 10, 8, padding=2)) == (3, 5, 0)
    groups = embracingfl(tier_mix=(4, 2, 4)).groups(MethodContext(staged, 10, 8, padding=2))
    assert [(g.name, g.size, len(g.members)) for g in groups] == [("strong", 3, 4), ("moderate", 1, 2),
                                                                   ("weak", 4, 4)]


def test_tier_mix_and_capacity_cases():
    assert resolve_mix(128, capacity_case=10).counts == (16, 16, 96)
    assert resolve_mix(32, capacity_case=10).counts == (4, 4, 24)  # scaled to the population
    assert all(sum(c) == 128 for c in CAPACITY_CASES.values())
    mix = resolve_mix(8, "2,3,3")
    assert mix.members(1) == (2, 3, 4) and mix.cohort_sizes(8) == (2, 3, 3)
    assert mix.cohort_sizes(4) == (1, 2, 1)  # proportional, largest remainder
    assert TierMix((6, 1, 1)).cohort_sizes(2) == (2, 0, 0)  # too few slots for every tier
    assert TierMix((6, 1, 1)).cohort_sizes(3) == (1, 1, 1)
    with pytest.raises(UserError, match="adds up to 7 clients, but the population has 8"):
        resolve_mix(8, "2,3,2")
    with pytest.raises(UserError, match="not both"):
        resolve_mix(8, "2,3,3", capacity_case=2)
    with pytest.raises(UserError, match="--capacity-case = 11 must be a case from 1 to 10"):
        get_method("embracingfl", capacity_case=11)


def test_all_strong_equals_fedavg(staged):
    cs = cohorts([[0, 3, 5, 6], [1, 2, 4, 7]], k=4)
    _, a, ma = run(staged, embracingfl(), cs, 4)
    _, b, mb = run(staged, fedavg(), cs, 4)
    # Equal up to float rounding, not bit for bit: on a CPU the aggregation's loop over clients is compiled
    # inside each method's own round program, and XLA may fuse (round) it differently in the two (measured:
    # 3.7e-9 on a BatchNorm mean).
    chex.assert_trees_all_close(a.variables, b.variables, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(ma[-1]["client_loss"], mb[-1]["client_loss"], rtol=1e-6)


def test_weak_clients_leave_the_prefix_bit_identical(staged):
    r, state, m = run(staged, embracingfl(tier_mix=(0, 0, N)), cohorts([[0, 3, 5], [1, 2, 4]], k=3), 3)
    init = jax.device_get(r.init(jax.random.key(0)))
    chex.assert_trees_all_equal(prefix_params(staged, state.variables, 3), prefix_params(staged, init.variables, 3))
    stats = state.variables["batch_stats"]
    chex.assert_trees_all_equal(stats, init.variables["batch_stats"])  # every BN sits in the frozen prefix
    assert not np.allclose(state.variables["params"]["head"]["kernel"], init.variables["params"]["head"]["kernel"])
    assert {"train_loss_weak"} <= set(m[-1]) and "train_loss_strong" not in m[-1]
    # the weak group holds the head alone: its local state has no prefix weights or optimizer state
    assert set(r.clients[0].init(state.variables).variables["params"]) == {"head"}


_MASK_ONLY = {}


@pytest.mark.parametrize("strategy,bn_policy", [(fused(), "global"), (stepwise(2), "global"),
                                                (fused(), "static")], ids=str)
def test_cached_activations_equal_mask_only_training(staged, strategy, bn_policy):
    mix = (2, 3, 3)  # cohort of 4: 1 strong, 2 moderate, 1 weak
    cs = cohorts([[0, 2, 4, 5], [1, 3, 4, 7]], k=4)
    _, cached, mc = run(staged, embracingfl(tier_mix=mix), cs, 4, strategy, bn_policy=bn_policy)
    if bn_policy not in _MASK_ONLY:  # the mask-only reference, stepwise: once per policy in this module
        _MASK_ONLY[bn_policy] = run(staged, embracingfl(tier_mix=mix, cached=False), cs, 4, bn_policy=bn_policy)
    _, masked, mm = _MASK_ONLY[bn_policy]
    chex.assert_trees_all_close(cached.variables, masked.variables, rtol=2e-5, atol=1e-5)
    np.testing.assert_allclose(mc[-1]["client_loss"], mm[-1]["client_loss"], rtol=1e-5)
    for t in ("strong", "moderate", "weak"):
        np.testing.assert_allclose(mc[-1][f"train_loss_{t}"], mm[-1][f"train_loss_{t}"], rtol=1e-5)


def _alone(cohort, rows):
    """The cohort restricted to ``rows`` (same data, ids and sizes)."""
    def pick(a):
        return np.asarray(a)[list(rows)]

    return Cohort(Batch(*map(pick, cohort.data)), jax.tree.map(pick, cohort.info))


def test_layer_wise_aggregation_by_hand(staged):
    """One strong + one weak client: prefix = the strong model, suffix = the n_k-weighted mean of both."""
    c = make_cohort((4,), k=2, steps=3, seed=3, real_examples=[5, 2], client_ids=[1, 6])
    mix = (4, 0, 4)
    _, both, _ = run(staged, embracingfl(tier_mix=mix), [c], 2)
    # Each client alone, in a one-client cohort of its own tier (same id → same keys and data).
    _, strong, _ = run(staged, embracingfl(tier_mix=(8, 0, 0)), [_alone(c, [0])], 1)
    _, weak, _ = run(staged, embracingfl(tier_mix=(0, 0, 8)), [_alone(c, [1])], 1)
    n_s, n_w = 15.0, 6.0  # 3 steps x 5 and 3 steps x 2 real examples
    p, ps, pw = both.variables["params"], strong.variables["params"], weak.variables["params"]
    for stage in ("b1", "b2", "b3"):
        chex.assert_trees_all_close(p[stage], ps[stage], rtol=1e-6, atol=1e-7)
    expected = jax.tree.map(lambda s, w: (n_s * s + n_w * w) / (n_s + n_w), ps["head"], pw["head"])
    chex.assert_trees_all_close(p["head"], expected, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(both.variables["batch_stats"], strong.variables["batch_stats"], rtol=1e-6)


def test_a_tier_with_no_client_in_the_cohort(staged):
    method = embracingfl(tier_mix=(6, 1, 1))
    r, state, m = run(staged, method, cohorts([[0, 4], [2, 5]], k=2), 2)
    assert [g.name for g in r.groups] == ["strong"]
    assert np.isfinite(m[-1]["train_loss"])
    r, state, m = run(staged, embracingfl(tier_mix=(0, 4, 4)), cohorts([[0, 4], [2, 7]], k=2), 2)
    assert [g.name for g in r.groups] == ["moderate", "weak"]  # no strong client: the prefix never moves
    init = jax.device_get(r.init(jax.random.key(0)))
    chex.assert_trees_all_equal(prefix_params(staged, state.variables, 2), prefix_params(staged, init.variables, 2))


def test_uploads_are_the_trained_layers(staged):
    _, _, m = run(staged, embracingfl(tier_mix=(2, 3, 3)), cohorts([[0, 2, 4, 5]], k=4), 4, record_decisions=True)
    layers = np.asarray(m[0]["decisions"]["selection"].upload.layers)
    np.testing.assert_array_equal(layers, [[1, 1, 1, 1], [0, 0, 1, 1], [0, 0, 1, 1], [0, 0, 0, 1]])
    up = m[0]["upload_bytes_per_layer"]
    assert (up[0] > 0).all() and (up[3, :3] == 0).all() and up[3, 3] == up[0, 3]


def test_capacity_table_matches_the_paper_for_resnet20():
    model = from_linen(build_model("resnet20", 10, (32, 32, 3)), input_shape=(32, 32, 3), num_classes=10,
                       name="resnet20")
    rows = {r["tier"]: r for r in capacity_table(model, batch_size=32)}
    # Table 1: moderate and weak are exact; our strong model lacks the paper's extra 16→16 projection
    # (256 + 32 parameters, one 32×32×16 activation map per example).
    assert (rows["moderate"]["params"], rows["moderate"]["activations"]) == (257_994, 2_752_832)
    assert (rows["weak"]["params"], rows["weak"]["activations"]) == (206_346, 917_824)
    assert rows["strong"]["params"] == 272_762 - 288
    assert rows["strong"]["activations"] == 6_947_136 - 32 * 32 * 32 * 16
    assert rows["moderate"]["cut_stage"] == "stage2_block1" and rows["weak"]["cut_stage"] == "stage3_block1"
    assert rows["moderate"]["capacity"] == pytest.approx(0.45, abs=0.005)
    assert rows["weak"]["capacity"] == pytest.approx(0.168, abs=0.005)


def test_weak_bilstm_clients_train_on_the_first_half_of_each_sequence():
    """Weak BiLSTM clients freeze the embedding and see half of every sequence; cached = mask-only."""
    from fedpartial._src.models.text import BiLSTM

    model = from_linen(BiLSTM(num_classes=2, vocab_size=50, embed_dim=8, hidden=6), input_shape=(12,),
                       num_classes=2, name="bilstm")
    assert default_cuts(model) == (1, 1)
    rng = np.random.default_rng(0)
    x = rng.integers(2, 50, (3, 2, 4, 12)).astype(np.int32)
    data = Batch(x, rng.integers(0, 2, (3, 2, 4)).astype(np.int32), np.ones((3, 2, 4), bool), np.ones((3, 2), bool))
    c = Cohort(data, CohortInfo(np.array([0, 3, 6], np.int32), np.full(3, 8.0, np.float32), np.ones(3, bool)))
    r, cached, _ = run(model, embracingfl(tier_mix=(3, 3, 2)), [c], 3)
    weak = r.clients[2]
    prepared = weak.prepare(cached.variables, jax.tree.map(lambda a: a[2], data))
    assert prepared.x.shape == (2, 4, 6, 8)  # embeddings of the first 6 of 12 tokens
    _, masked, _ = run(model, embracingfl(tier_mix=(3, 3, 2), cached=False), [c], 3)
    chex.assert_trees_all_close(cached.variables, masked.variables, rtol=2e-5, atol=1e-6)
    # A weak client alone: its update equals training on the half sequences with the embedding frozen.
    half = Cohort(data._replace(x=np.where(np.arange(12) < 6, x, 0)), c.info)
    _, on_half, _ = run(model, embracingfl(tier_mix=(0, 0, 8)), [_alone(half, [2])], 1)
    _, alone, _ = run(model, embracingfl(tier_mix=(0, 0, 8)), [_alone(c, [2])], 1)
    chex.assert_trees_all_close(alone.variables, on_half.variables, rtol=2e-5, atol=1e-6)
    rows = {row["tier"]: row for row in capacity_table(model, batch_size=1)}
    assert rows["weak"]["activations"] < rows["moderate"]["activations"]


def test_capacity_command(capsys):
    from fedpartial._src.cli import main as cli

    assert cli.main(["capacity", "--model", "femnist_cnn", "--batch-size", "1"]) == 0
    out = capsys.readouterr().out
    assert "6,551,614" in out and "0.986" in out and "0.99" in out  # moderate: ours and the paper's capacity
    assert cli.main(["capacity", "--model", "lenet5", "--cut", "1,9"]) == 2
    assert "--cut stage 9 is outside 0..4" in capsys.readouterr().err


def test_simulation_samples_a_fixed_number_per_tier():
    from fedpartial._src.data.sources import ArrayDataset
    from fedpartial._src.experiment.config import RunConfig
    from fedpartial._src.experiment.simulation import Simulation

    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 4)).astype(np.float32)
    y = rng.integers(0, 3, 300).astype(np.int32)
    data = ArrayDataset(name="toy", x_train=x, y_train=y, x_test=x[:60], y_test=y[:60], num_classes=3)
    model = from_stages([Block(6), Block(5), Block(4), nn.Dense(3)], input_shape=(4,), num_classes=3,
                        names=("b1", "b2", "b3", "head"), sequential=True, name="staged_mlp")
    config = RunConfig(method="embracingfl", options={"capacity_case": 9}, num_clients=16, cohort_size=8, rounds=2,
                       local_steps=2, batch_size=8, out_dir=None, partition="iid", bn_policy="static")
    sim = Simulation(config, data, model=model)
    assert [(g.name, g.size) for g in sim.round.groups] == [("strong", 1), ("moderate", 2), ("weak", 5)]
    for t in range(4):
        ids, valid, _, _ = sim.sample_cohort(t)  # case 9 on 16 clients: 2 strong, 4 moderate, 10 weak
        assert valid.all() and set(ids[:1]) <= {0, 1} and set(ids[1:3]) <= set(range(2, 6))
        assert set(ids[3:]) <= set(range(6, 16)) and len(set(ids)) == 8
    records = list(sim.rounds())
    assert np.isfinite(records[-1]["test_accuracy"]) and "train_loss_weak" in records[-1]
