"""The combinations a user can type, as a covering design: every method with every wrapper it allows, stacked
(``--dp-clip`` around FedDH's reweighting around ``--es`` around SCAFFOLD's control variates), under a client
optimizer with momentum and weight decay, under every strategy (each on a few of the methods), and a checkpoint
between its two rounds.  Each combination keeps the engine's contract — no retrace, a resumed run equals the
uninterrupted one bit for bit, clients outside the cohort keep their state, the fused round equals the stepwise
one — or is refused in one sentence when it is built.  The bare methods keep the whole contract in test_contract.py.

What it costs is XLA compiling each case's round (the two rounds and the resumed one reuse it), so every
method runs the whole-cohort ``fused`` round but the few that show each other strategy with every wrapper (the
chunked ``fused:2``, which compiles the client's training twice, a full chunk of K = 3 and the remainder; the
stepwise leg and its fused twin; the host store and its device twin: each compiles a second program), and the
rounds are compiled at -O0 (``engine_compiled_at_o0``: the resumed round is the uninterrupted one's program, the
stepwise leg is compared within a tolerance) but the host store's: its round equals the device's bit for bit at
-O1, not at -O0 (measured: FedPer's server momentum 1 ulp apart).
"""

import re

import chex
import jax
import numpy as np
import optax
import pytest

from fedpartial._src.core.errors import UserError
from fedpartial._src.core.types import client_sgd
from fedpartial._src.engine import strategy as strategies
from fedpartial._src.engine.round import FederatedRound
from fedpartial._src.experiment.checkpoint_arrays import from_arrays as _from_arrays
from fedpartial._src.experiment.checkpoint_arrays import to_arrays as _to_arrays
from fedpartial._src.methods.basic.scaffold import control_variates
from fedpartial._src.methods.catalog import METHODS, get_method
from fedpartial._src.methods.codecs import upload_codec
from fedpartial._src.methods.early_stopping import early_stopping
from fedpartial._src.methods.privacy.dp_fedavg import dp_fedavg
from fedpartial._src.methods.weighting.compose import reweight
from fedpartial._src.methods.weighting.feddh import feddh_weighting
from tests.experiment.test_client_state import run_host
from tests.test_contract import (
    BUILDERS,
    KEY,
    LABEL_COUNTS,
    SERVER_DATA,
    K,
    N,
    assert_close_to_scale,
    cohorts,
    model_for,
)

OPT = client_sgd(0.1, momentum=0.9, weight_decay=0.01)
SERVER = optax.sgd(1.0, momentum=0.5)
#: innermost first, as the command line stacks them (a method, its control variates, --es, a reweighting,
#: --upload-codec, DP)
WRAPPERS = (
    ("control_variates", control_variates),
    ("early_stopping", early_stopping),
    ("reweight", lambda m: reweight(m, feddh_weighting())),
    ("upload_codec", lambda m: upload_codec(m, "topk:0.5")),
    ("dp_fedavg", lambda m: dp_fedavg(m, clip=1.0, noise_multiplier=0.5, per_layer=True)),
)
#: the strategy of the methods that run another than the whole-cohort ``fused`` round: each strategy meets every
#: wrapper through methods that take them all (every bare method is compared stepwise against fused in
#: test_contract.py, the chunking per strategy in tests/engine/test_engine.py; tests/experiment/test_client_state.py
#: puts methods' state in the host store, whose reads and writes are the same two engine lines for all).  The host
#: store holds the wrappers' per-client rows (control variates, --es) beside the method's own (SCAFFOLD's control
#: variates, FedPer's personal head); FedDH cannot keep its state off the device and is refused in one sentence.
STRATEGY = {"fedldf": "stepwise:1", "moon": "stepwise:1", "fedprox": "fused:2", "fedsa_lora": "fused:2",
            "scaffold": "host", "fedper": "host", "feddh": "host"}
#: methods whose wrappers meet the same code as another's, ``slow``: FedMP is Hermes with an L1 norm (one chooser),
#: FedJS FedDH's weighting with (υ, b) never stepped (test_contract.py's SAME_PATH_AS); Random and HDFL upload the
#: layers (``masks.from_layers``) of the clients the server draws, FedLDF those its divergences choose; LG-FedAvg
#: is FedPer's ``personal_layers`` with the other layers personal
SAME_PATH_AS = {"fedmp": "hermes", "fedjs": "feddh", "random": "fedldf", "hdfl": "fedldf", "lgfedavg": "fedper"}


def stacked(name, leave_out=()):
    """The method with every wrapper it allows around it (but ``leave_out``), and the sentence of each it refuses."""
    method, refused = BUILDERS[name](), {}
    for wrapper, apply in WRAPPERS:
        if wrapper in leave_out:
            continue
        try:
            method = apply(method)
        except UserError as e:
            refused[wrapper] = str(e)
    return method, refused


def build(model, method, strategy):
    host = strategy == "host"
    return FederatedRound(model, method, num_clients=N, cohort_size=K, client_optimizer=OPT,
                          server_optimizer=SERVER, rounds=4, label_counts=LABEL_COUNTS, server_data=SERVER_DATA,
                          strategy=strategies.parse_strategy("fused" if host else strategy),
                          client_state="host" if host else "device", bn_policy="static")


def checkpointed(state):
    """The state as a checkpoint holds it (flat arrays), and a function reading it back onto the device (the
    round donates its input state, so the arrays are copied to the host first)."""
    host = jax.device_get(state)
    arrays = _to_arrays(host)
    return lambda: _from_arrays(arrays, host)


@pytest.fixture(scope="module")
def data():
    return cohorts()


CASES = [(name, STRATEGY.get(name, "fused")) for name in METHODS if name not in SAME_PATH_AS]
#: every method under every strategy, with ``-m slow`` (before a release): the default cases show each method (or
#: one on the same path) with every wrapper, and each strategy with every wrapper; the bare methods under each
#: strategy are test_contract.py's and tests/experiment/test_client_state.py's
SLOW_CASES = [(name, strategy) for name in METHODS for strategy in ("fused", "stepwise:1", "fused:2", "host")
              if (name, strategy) not in CASES]


@pytest.mark.parametrize("name, strategy", [*CASES, *(pytest.param(*c, marks=pytest.mark.slow) for c in SLOW_CASES)],
                         ids=[f"{n}-{s}" for n, s in [*CASES, *SLOW_CASES]])
def test_every_method_with_every_wrapper_it_allows(mlp, staged_mlp, data, name, strategy, request):
    """(The ``slow`` cases, every method under every strategy: the default ones show the same combinations, each
    method or one on the same path (``SAME_PATH_AS``) under ``fused``, each strategy with every wrapper.)"""
    host_store = strategy == "host" and stacked(name, leave_out=("reweight",))[0].capabilities.host_client_state
    if not host_store:  # a few tiny steps, compared with the same program or within a tolerance (see above)
        request.getfixturevalue("engine_compiled_at_o0")
    method, refused = stacked(name)
    for wrapper, sentence in refused.items():  # one sentence naming the method, no traceback
        assert "\n" not in sentence and sentence.endswith(".") and BUILDERS[name]().name in sentence, sentence
    assert len(refused) < len(WRAPPERS), f"{name} takes no wrapper"
    model = model_for(name, method, mlp, staged_mlp)
    if strategy == "host":
        # FedDH's weighting reads every client's label distribution: with it the state stays on the device,
        # refused in one sentence; the other wrappers read their rows as the cohort's only
        with pytest.raises(UserError, match=re.escape(f"method {method.name} reads every client's state")):
            build(model, method, "host")
        method = stacked(name, leave_out=("reweight",))[0]
        if not method.capabilities.host_client_state:
            with pytest.raises(UserError, match=re.escape(f"method {method.name} reads every client's state")):
                build(model, method, "host")
            strategy = "fused"
    r = build(model, method, "fused" if strategy == "host" else strategy)
    first, _ = r(r.init(KEY), data[0], jax.random.fold_in(KEY, 0))
    traces, restore = r.trace_count, checkpointed(first)
    before = jax.device_get(first.method_state.clients)
    second = jax.device_get(r(first, data[1], jax.random.fold_in(KEY, 1))[0])
    assert r.trace_count == traces, "round 2 retraced"
    resumed, _ = r(restore(), data[1], jax.random.fold_in(KEY, 1))
    chex.assert_trees_all_equal(jax.device_get(resumed), second)
    outside = np.setdiff1d(np.arange(N), np.asarray(data[1].info.client_ids))
    rows = lambda tree: jax.tree.map(lambda a: np.asarray(a)[outside], tree)  # noqa: E731
    chex.assert_trees_all_equal(rows(second.method_state.clients), rows(before))
    if strategy == "stepwise:1":  # the fused round equals the stepwise one
        fused = build(model, stacked(name)[0], "fused")
        got = fused(fused(fused.init(KEY), data[0], jax.random.fold_in(KEY, 0))[0], data[1],
                    jax.random.fold_in(KEY, 1))[0]
        assert_close_to_scale(jax.device_get(got.variables), second.variables)
    if strategy == "host":  # the per-client state kept in a host store: the same run, bit for bit
        got, _ = run_host(build(model, stacked(name, leave_out=("reweight",))[0], "host"), data)
        chex.assert_trees_all_equal(got, second)


def _tiny_cnn(impl):
    from fedpartial._src.models.adapter import from_linen
    from fedpartial._src.models.zoo import CNN2C1F

    return from_linen(CNN2C1F(3, features=(2, 2), conv_impl=impl), input_shape=(8, 8, 1), num_classes=3,
                      sequential=True, name="cnn2c1f")


def _differentiates_twice(name):
    try:
        return get_method(name).capabilities.second_order  # the method's defaults
    except (UserError, TypeError, ValueError):  # a method with a required option is built with it in BUILDERS
        return BUILDERS[name]().capabilities.second_order


SECOND_ORDER = [name for name in METHODS if _differentiates_twice(name)]


@pytest.mark.parametrize("impl", ["lax", "im2col", "hybrid", "mapped"])
def test_methods_that_differentiate_twice_run_on_a_lowering_or_are_refused_in_one_sentence(impl):
    from fedpartial._src.engine.conv_choice import REVERSE_ONLY, candidates

    assert {"fedad", "feddhad"} <= set(SECOND_ORDER)
    model = _tiny_cnn(impl)
    for name in SECOND_ORDER:
        method = get_method(name)  # the defaults: Hessian-vector products choose the rate
        assert method.capabilities.second_order
        make = lambda m: FederatedRound(model, m, num_clients=4, cohort_size=2,  # noqa: E731
                                        client_optimizer=optax.sgd(0.1))
        if impl in REVERSE_ONLY:
            with pytest.raises(UserError) as refused:
                make(method)
            sentence = str(refused.value)
            assert sentence.startswith(f"method {method.name} differentiates its loss twice") and "\n" not in sentence
            assert sentence.endswith("use --conv-impl lax or im2col.")
        else:
            make(method)  # forward over reverse traced through this lowering
        make(get_method(name, rate=0.5))  # a fixed rate differentiates once: every lowering runs it
    for platform in ("cpu", "gpu"):  # --conv-impl auto never offers a method that differentiates twice these
        assert not {impl for impl, _ in candidates(platform, second_order=True)} & set(REVERSE_ONLY)
        assert {impl for impl, _ in candidates(platform)} & set(REVERSE_ONLY)
