"""A round in which the method's train masks select nothing is said: the engine's ``trained_nothing`` metric,
the run's summary count and one sentence under the closing table."""

import warnings

import jax
import jax.numpy as jnp
import optax

import fedpartial as fp
from fedpartial._src.cli.progress import closing_warnings
from fedpartial._src.core import masks
from fedpartial._src.core.errors import NothingTrainedWarning, warn_nothing_trained
from fedpartial._src.engine.round import FederatedRound
from fedpartial._src.engine.strategy import fused
from tests.conftest import make_cohort


def test_the_round_says_when_no_client_trains_anything(mlp):
    """Round 0 trains no layer (nothing is said wrongly of a round that trains only one layer: round 1)."""
    def plan(ctx, view):
        layers = jnp.arange(ctx.structure.num_layers) == jnp.where(view.round == 0, -1, 0)
        return fp.ClientPlan(train=masks.from_layers(ctx.structure, jnp.broadcast_to(layers, (ctx.cohort_size,
                                                                                            layers.shape[0]))))

    method = fp.make_method("idle_then_one_layer", plan=plan)
    r = FederatedRound(mlp, method, num_clients=4, cohort_size=2, client_optimizer=optax.sgd(0.1), strategy=fused())
    state = r.init(jax.random.key(0))
    said = []
    for t in range(2):
        state, metrics = r(state, make_cohort((4,), k=2, steps=1, batch=3, seed=t), jax.random.key(t))
        said.append(bool(metrics["trained_nothing"]))
    assert said == [True, False]


def test_it_is_said_in_one_sentence():
    lines = closing_warnings({"rounds_training_nothing": 3, "rounds": 5}, None)
    assert len(lines) == 1 and lines[0].startswith("in 3 of 5 rounds the method's train masks selected no "
                                                   "parameter") and lines[0].count(". ") == 0
    assert closing_warnings({"rounds": 5}, None) == []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_nothing_trained(4)
    assert [w.category for w in caught] == [NothingTrainedWarning] and "round 4:" in str(caught[0].message)
