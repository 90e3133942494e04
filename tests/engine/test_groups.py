"""Static client groups: a weak group trains only the output-side stages on prefix activations
prepared once per round, and equals the mask-only reading (prefix frozen by the train mask)."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedpartial._src.core import masks
from fedpartial._src.core.types import ClientGroup, ClientPlan
from fedpartial._src.engine import graphs
from fedpartial._src.engine.metrics import traffic_totals
from fedpartial._src.engine.round import FederatedRound
from fedpartial._src.engine.strategy import fused, stepwise
from fedpartial._src.experiment.config import RunConfig
from fedpartial._src.experiment.simulation import Simulation
from fedpartial._src.methods.base import make_method
from fedpartial._src.models.adapter import from_stages
from tests.conftest import make_cohort

# Rounds of a few tiny steps, compared with a tolerance: compiled at -O0 (tests/conftest.py says why that changes
# nothing here)
pytestmark = pytest.mark.usefixtures("engine_compiled_at_o0")
N, K, CUT = 8, 3, 2
OPT = optax.sgd(0.1, momentum=0.9)


class Block(nn.Module):
    """Dense → BatchNorm → ReLU: a stage with running statistics."""

    units: int

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dense(self.units)(x.reshape((x.shape[0], -1)))
        return nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))


@pytest.fixture(scope="module")
def staged():
    return from_stages([Block(6), Block(5), nn.Dense(3)], input_shape=(4,), num_classes=3,
                       names=("b1", "b2", "head"), sequential=True, name="staged_mlp")


def tiers(cached: bool):
    """Two strong clients (ids 0-3) train everything; one weak client (ids 4-7) only stages ≥ CUT.

    ``cached``: the weak group runs the truncated graph (prefix prepared once); otherwise the
    whole model with the prefix frozen by its train mask (the mask-only variant).
    """

    def groups(ctx):
        weak_graph = graphs.suffix(ctx.model, CUT) if cached else None
        return (ClientGroup("strong", 2, members=tuple(range(4))),
                ClientGroup("weak", 1, members=tuple(range(4, 8)), graph=weak_graph))

    def plan(ctx, view):
        suffix = jnp.asarray(ctx.model.stage_of_layer) >= CUT
        layers = jnp.stack([jnp.ones_like(suffix), jnp.ones_like(suffix), suffix])  # rows follow the groups
        return ClientPlan(train=masks.from_layers(ctx.structure, layers))

    return make_method("tiers-cached" if cached else "tiers-masked", groups=groups, plan=plan)


def cohorts():
    return [make_cohort((4,), k=K, steps=3, seed=t, real_steps=[3, 2, 3], real_examples=[5, 3, 4],
                        client_ids=ids) for t, ids in enumerate(([0, 2, 5], [1, 3, 7]))]


_RUNS = {}


def run(model, method, strategy):
    """The round, its state and metrics after the two cohorts; once per method and strategy in this module (the
    mask-only reference of every strategy's comparison, the cached fused run of two tests)."""
    key = (id(model), method.name, str(strategy))
    if key not in _RUNS:
        r = FederatedRound(model, method, num_clients=N, cohort_size=K, client_optimizer=OPT, strategy=strategy)
        state = r.init(jax.random.key(0))
        for t, c in enumerate(cohorts()):
            state, m = r(state, c, jax.random.key(t))
        _RUNS[key] = r, jax.device_get(state), jax.device_get(m)
    return _RUNS[key]


@pytest.mark.parametrize("strategy", [fused(), stepwise(1), stepwise(2)], ids=str)
def test_truncated_graph_equals_the_mask_only_variant(staged, strategy):
    _, cached, mc = run(staged, tiers(True), strategy)
    _, masked, mm = run(staged, tiers(False), stepwise(1))
    chex.assert_trees_all_close(cached.variables, masked.variables, rtol=2e-5, atol=1e-5)  # TF32 on GPUs
    np.testing.assert_allclose(mc["client_loss"], mm["client_loss"], rtol=1e-5)
    assert traffic_totals(mc)["upload_bytes"] == traffic_totals(mm)["upload_bytes"]


def test_weak_clients_hold_and_train_only_the_suffix(staged):
    r, state, _ = run(staged, tiers(True), fused())
    weak = r.clients[1]
    local = weak.init(state.variables)
    assert set(local.variables["params"]) == {"head"}  # neither the prefix's weights nor their optimizer state
    # The prepared inputs are the prefix activations: [S, B, units of stage CUT-1].
    data = jax.tree.map(lambda a: a[0], make_cohort((4,), k=1, steps=3).data)
    prepared = weak.prepare(state.variables, data)
    assert prepared.x.shape == (3, 5, 5)
    # The weak client's step, compiled, is cheaper than the strong one's.
    batch = jax.tree.map(lambda a: a[0], prepared)
    strong = r.clients[0]

    def flops(fns, start, b):
        lowered = jax.jit(fns.step).lower(fns.init(start), b, ClientPlan(), state.variables, (), jax.random.key(0), 0)
        return lowered.compile().cost_analysis()["flops"]

    strong_batch = jax.tree.map(lambda a: a[0], data)
    assert flops(weak, state.variables, batch) < 0.5 * flops(strong, state.variables, strong_batch)


def test_groups_must_fill_the_cohort(staged):
    bad = make_method("bad", groups=lambda ctx: (ClientGroup("a", 1), ClientGroup("b", 1)))
    with pytest.raises(ValueError, match="add up to the cohort size 3"):
        FederatedRound(staged, bad, num_clients=N, cohort_size=K, client_optimizer=OPT)
    r = FederatedRound(staged, tiers(True), num_clients=N, cohort_size=K, client_optimizer=OPT)
    wrong = make_cohort((4,), k=K, client_ids=[0, 5, 6])  # client 5 sits in a strong slot
    with pytest.raises(ValueError, match="client 5 sits in group 'strong'"):
        r(r.init(jax.random.key(0)), wrong, jax.random.key(1))


def test_simulation_samples_each_group_from_its_members(staged):
    import fedpartial._src.data.sources as sources
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 4)).astype(np.float32)
    y = rng.integers(0, 3, 200).astype(np.int32)
    dataset = sources.ArrayDataset(name="toy", x_train=x, y_train=y, x_test=x[:50], y_test=y[:50], num_classes=3)
    sim = Simulation(RunConfig(num_clients=N, cohort_size=K, rounds=3, local_steps=2, batch_size=8, out_dir=None,
                               partition="iid"), dataset, method=tiers(True), model=staged)
    for t in range(5):
        ids, valid, _, _ = sim.sample_cohort(t)
        assert valid.all() and set(ids[:2]) <= set(range(4)) and ids[2] in range(4, 8)
    records = list(sim.rounds())
    assert len(records) == 3 and np.isfinite(records[-1]["train_loss"])
