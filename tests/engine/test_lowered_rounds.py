"""A convolution lowering (models/conv.py) inside whole rounds: with a masking method, momentum and weight decay,
under every strategy that lays the cohort out differently (one client at a time, vmapped, a loop inside the
program, streamed in chunks), two rounds equal lax's one client at a time within float32 rounding."""

import jax
import numpy as np
import pytest

from fedpartial._src.core.types import client_sgd
from fedpartial._src.engine.round import FederatedRound
from fedpartial._src.engine.strategy import parse_strategy
from fedpartial._src.methods.submodel.fedspu import fedspu
from fedpartial._src.methods.submodel.fiarse import fiarse
from fedpartial._src.models import registry
from fedpartial._src.models.adapter import from_linen
from fedpartial._src.models.conv import CONV_IMPLS
from tests.conftest import make_cohort

# Two rounds of a few tiny steps, compared with a tolerance: compiled at -O0 (tests/conftest.py says why that
# changes nothing here; the lowerings are what differ, and each is compiled alike)
pytestmark = pytest.mark.usefixtures("engine_compiled_at_o0")
SHAPE, K, N = (8, 8, 1), 4, 6
OPT = client_sgd(0.05, momentum=0.9, weight_decay=1e-3)
STRATEGIES = ("stepwise:1", "fused", "fused:1", "stream:2")
#: FedSPU freezes neurons; the streamed strategy takes only streamable methods: FIARSE's element masks
METHOD = {"stream:2": fiarse}


def small_cnn(impl):
    module = registry.build_model("cnn2c1f", 10, SHAPE, conv_impl=impl).clone(features=(4, 8))
    return from_linen(module, input_shape=SHAPE, num_classes=10, sequential=True, name="small_cnn")


def two_rounds(impl, strategy, method):
    rnd = FederatedRound(small_cnn(impl), method(), num_clients=N, cohort_size=K, client_optimizer=OPT,
                         strategy=parse_strategy(strategy))
    state = rnd.init(jax.random.key(0))
    for t in range(2):
        cohort = make_cohort(SHAPE, k=K, steps=2, batch=4, seed=t, num_classes=10, real_steps=[2, 1, 2, 2],
                             client_ids=(np.arange(K) + 2 * t) % N)
        state, metrics = rnd(state, cohort, jax.random.fold_in(jax.random.key(1), t))
    return jax.device_get(state), jax.device_get(metrics)


_REFERENCE = {}


def reference(method):
    """lax's two rounds, one client at a time, once per method."""
    if method not in _REFERENCE:
        _REFERENCE[method] = two_rounds("lax", "stepwise:1", method)
    return _REFERENCE[method]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("impl", CONV_IMPLS[1:])
def test_a_lowering_trains_the_same_rounds_as_lax(impl, strategy):
    method = METHOD.get(strategy, fedspu)
    (state, metrics), (want_state, want_metrics) = two_rounds(impl, strategy, method), reference(method)
    for got, want in zip(jax.tree.leaves(state.variables), jax.tree.leaves(want_state.variables)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=f"{impl} {strategy}")
    np.testing.assert_allclose(metrics["train_loss"], want_metrics["train_loss"], rtol=1e-4,
                               err_msg=f"{impl} {strategy}")
