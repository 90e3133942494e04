"""One contract over every registered method (and the documented custom-method example).

Whatever a method does, the engine promises: no retrace in round 2; the same seed
gives identical results; the whole-cohort fused round equals the stepwise one, the fused
round in chunks (``fused:C`` with K not a multiple of C) too (``-m slow``; the engine's
chunking, ``jax.lax.map`` over the same per-client function, is checked per strategy in
tests/engine/test_engine.py); padded steps and examples change nothing; clients outside the cohort keep their
state bit for bit; an element nobody uploaded keeps its global value bit for bit, even under
a stateful server optimizer.
"""

import pathlib
import runpy

import chex
import jax
import numpy as np
import optax
import pytest

from examples import scaffold
from fedpartial._src.core import masks
from fedpartial._src.core.types import Batch, ServerData, client_sgd
from fedpartial._src.engine import strategy as strategies
from fedpartial._src.engine.metrics import traffic_totals
from fedpartial._src.engine.round import FederatedRound
from fedpartial._src.methods.base import Holdout
from fedpartial._src.methods.basic.scaffold import control_variates
from fedpartial._src.methods.catalog import METHODS, get_method
from fedpartial._src.methods.early_stopping import early_stopping
from fedpartial._src.methods.privacy.dp_fedavg import dp_fedavg
from fedpartial._src.models.lora import lora
from fedpartial._src.models.lora_ranks import with_lora_ranks
from tests.conftest import make_cohort

# Two compilations per method (stepwise and fused) of rounds that run a few steps: compiled at -O0
# (tests/conftest.py says why that changes nothing here)
pytestmark = pytest.mark.usefixtures("engine_compiled_at_o0")
ROOT = pathlib.Path(__file__).resolve().parents[1]
N, K = 8, 3
# optax's SGD bit for bit, and the rate readable (SCAFFOLD reads it); momentum with weight decay, so that a frozen
# element's optimizer state is exercised by every method whose masks change
OPT = client_sgd(0.1, momentum=0.9, weight_decay=0.01)
SERVER = optax.sgd(1.0, momentum=0.5)  # stateful (stale momentum would move what nobody uploaded); Adam would
# turn float-noise pseudo-gradients into full steps and make strategy comparisons meaningless
KEY = jax.random.key(0)


def custom_example():
    return runpy.run_path(str(ROOT / "notebooks" / "custom_method.py"), run_name="contract")["random_layers"](0.5)


BUILDERS = {name: (lambda name=name: get_method(name)) for name in METHODS}
BUILDERS["fedldf"] = lambda: get_method("fedldf", n=2)  # n must not exceed K
BUILDERS["random"] = lambda: get_method("random", n=2)
BUILDERS["hdfl"] = lambda: get_method("hdfl", n=2)
BUILDERS["fedspu+es"] = lambda: early_stopping(get_method("fedspu"))
# FedAD / FedDHAD drop nothing until their first rate update: recompute at every round so round 2 drops units
# (FedAD with a fixed rate; FedDHAD through the Hessian criterion; FedAD's per-step masks too).
BUILDERS["fedad"] = lambda: get_method("fedad", rate=0.5, measure_every=1, patience=0)
BUILDERS["fedad-step"] = lambda: get_method("fedad", rate=0.5, measure_every=1, patience=0, resample="step")
BUILDERS["feddhad"] = lambda: get_method("feddhad", rate=0.5, measure_every=1, patience=0)
# The Hessian criterion inside a round is checked in tests/methods/test_fedad.py (against the criterion
# computed client by client); here FedDHAD is the composition of FedAD with FedDH's weights.
# Width tiers (ids 0-4 strong, 5-6 moderate, 7 weak: one of each in these cohorts): FedRolex's windows roll
# over the narrow clients' units (its first round's are HeteroFL's), so the entry covers the narrow graphs too.
BUILDERS["fedrolex"] = lambda: get_method("fedrolex", tier_mix="5,2,1", widths="0.5,0.25")
# Depth tiers (same ids): each tier holds a prefix of a staged model and the exits after it (the methods'
# adapt_model adds them), so these entries run on conftest's staged_mlp with exits instead of the one-stage MLP.
BUILDERS["depthfl"] = lambda: get_method("depthfl", tier_mix="5,2,1")
BUILDERS["inclusivefl"] = lambda: get_method("inclusivefl", tier_mix="5,2,1")
ON_STAGED = {"depthfl", "inclusivefl"}
# The federated LoRA methods train the adapters of a LoRA model (rank 2 on the MLP's hidden layers).
ON_LORA = {"fedit", "ffa_lora", "fedsa_lora", "hetlora", "flexlora", "flora"}
# FlexLoRA with rank tiers 1, 2 (ids 0-3 rank 1, 4-7 rank 2): each client's leading components, the SVD's split.
BUILDERS["flexlora-ranks"] = lambda: get_method("flexlora")
# HetLoRA with the same tiers and self-pruning on (γ 0.5, λ 0.1): each client's rank is its own state, its
# upload the pruned rank's components; plain "hetlora" (every client at rank 2) takes the same path (slow).
BUILDERS["hetlora-ranks"] = lambda: get_method("hetlora", prune_gamma=0.5, prune_lambda=0.1)
ON_LORA_RANKS = {"flexlora-ranks", "hetlora-ranks"}
_LORA_MODELS: dict = {}
BUILDERS["custom_example"] = custom_example
BUILDERS["scaffold_example"] = lambda: scaffold.scaffold()  # examples/scaffold.py: public API, control variates
BUILDERS["fedldf+scaffold"] = lambda: control_variates(get_method("fedldf", n=2))  # control variates on partial uploads
# DP-FedAvg around partial uploads: per-layer clipping, noise over each layer's expected uploaders, adaptive clipping.
BUILDERS["dp-fedldf"] = lambda: dp_fedavg(get_method("fedldf", n=2), clip=1.0, noise_multiplier=1.0, per_layer=True,
                                          target_quantile=0.5)
#: entries that need the 'static' BatchNorm policy (DP-FedAvg refuses running statistics uploaded without noise)
STATIC_BN = {"dp-fedldf"}


def cohorts(rounds=2, steps=3, seed=0):
    """Unequal clients (3, 1, 2 real steps; 5, 2, 4 real examples), different cohorts each round."""
    out = []
    for t in range(rounds):
        ids = np.sort(np.random.default_rng([seed, t]).choice(N, K, replace=False))
        c = make_cohort((4,), k=K, steps=steps, seed=seed + t, real_steps=[3, 1, 2], real_examples=[5, 2, 4],
                        client_ids=ids)
        rng = np.random.default_rng(t)
        holdout = Holdout(rng.normal(size=(K, 4, 4)).astype(np.float32), rng.integers(0, 3, (K, 4)).astype(np.int32),
                          np.ones((K, 4), bool))
        out.append(c._replace(holdout=holdout))
    return out


def padded(c):
    """The same cohort with two more padded steps and three more padded examples per batch (garbage)."""
    rng = np.random.default_rng(9)
    d = c.data
    k, s, b = d.step_mask.shape + (d.x.shape[2],)
    x = rng.normal(size=(k, s + 2, b + 3, 4)).astype(np.float32) * 50
    y = rng.integers(0, 3, (k, s + 2, b + 3)).astype(np.int32)
    em = np.zeros((k, s + 2, b + 3), bool)
    sm = np.zeros((k, s + 2), bool)
    x[:, :s, :b], y[:, :s, :b], em[:, :s, :b], sm[:, :s] = d.x, d.y, d.example_mask, d.step_mask
    return c._replace(data=Batch(x, y, em, sm))


# Every client's label counts (FedDH's label distributions) and a class-balanced server set (FedDHE):
# handed to every method, read only by those that need them.
LABEL_COUNTS = np.random.default_rng(3).integers(0, 6, (N, 3)).astype(np.float32) + np.eye(N, 3, dtype=np.float32)
SERVER_DATA = ServerData(np.random.default_rng(4).normal(size=(6, 4)).astype(np.float32),
                         np.array([0, 1, 2, 2, 1, 0], np.int32))


def build(model, method, strategy, record=False, client_state="device", name=None):
    return FederatedRound(model, method, num_clients=N, cohort_size=K, client_optimizer=OPT,
                          server_optimizer=SERVER, strategy=strategy, rounds=4, record_decisions=record,
                          label_counts=LABEL_COUNTS, server_data=SERVER_DATA, client_state=client_state,
                          bn_policy="static" if name in STATIC_BN else "global")


def run(r, data):
    """Rounds of ``data`` from a fresh state; host copies of every state, the metrics, and the
    trace count after each round."""
    state = r.init(KEY)
    history, metrics, traces = [jax.device_get(state)], [], []
    for t, c in enumerate(data):
        state, m = r(state, c, jax.random.fold_in(KEY, t))
        history.append(jax.device_get(state))
        metrics.append(jax.device_get(m))
        traces.append(r.trace_count)
    return history, metrics, traces


@pytest.fixture(scope="module")
def data():
    return cohorts()


# Same code path as another entry, so out of the default run: FedMP is Hermes with an L1 instead of an L2
# norm (one chooser, ``dropout.by_parameter_norm``); FedJS is FedDH's weighting with (υ, b) never stepped.
# FedAD's per-step masks (a step_plan) are checked for determinism and against the device model in
# tests/methods/test_fedad.py, and step_plan itself under every strategy in tests/engine/test_hooks.py.
# examples/scaffold.py is the built-in scaffold's algorithm on the public API (tests/test_extension.py checks it
# by hand under every strategy and as learning-rate replicas).  HDFL is Random's draw (``random_n_per_row`` from
# the round's key, uploads ``masks.from_layers``) with one row for every layer; LG-FedAvg is FedPer's
# ``personal_layers`` with the other layers personal; plain FlexLoRA and HetLoRA are their rank-tiered entries with
# every client at rank 2.
SAME_PATH_AS = {"fedmp": "hermes", "fedjs": "feddh", "fedad-step": "fedad", "scaffold_example": "scaffold",
                "hetlora": "hetlora-ranks", "flexlora": "flexlora-ranks", "hdfl": "random", "lgfedavg": "fedper"}
NAMES = [pytest.param(n, marks=pytest.mark.slow) if n in SAME_PATH_AS else n for n in BUILDERS]


def assert_close_to_scale(got, ref, rtol=2e-5, atol=2e-6):
    """Every element within ``rtol`` of its leaf's largest finite magnitude (and 2e-6) of the reference.

    Float errors are relative to the leaf, not to each element: the padded cohorts' wider batches change
    the order of the batch sums, and BatchNorm's one-pass variance (E[x²] - E[x]², flax's default) over
    batches of 2-5 examples amplifies that rounding.  On an AVX-512 CPU a personal-model weight of 0.007
    (in a leaf reaching 0.97) came out 1.06e-5 apart, 2.8e-7 with the two-pass variance; the garbage in
    the padding (scaled by 0, 50 or 5,000) changed nothing, so the padding itself is a no-op."""
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(ref)):
        g, r = np.asarray(g), np.asarray(r)
        finite = np.abs(r[np.isfinite(r)]) if r.dtype.kind == "f" else np.zeros(0)  # (inf: a best loss not yet set)
        scale = float(finite.max()) if finite.size else 0.0
        np.testing.assert_allclose(g, r, rtol=0, atol=atol + rtol * scale, err_msg=jax.tree_util.keystr(path))
    chex.assert_trees_all_equal_structs(got, ref)


#: method state that divides by the clients' rates: SCAFFOLD's c_i = (x − y_i) / (K·η) carries the parameters'
#: tolerance (2e-6 + 2e-5 of a leaf reaching ~1, see above) over K·η = 0.1 for the client with one real step
#: (measured 1.1e-4 on a c_i of 0.0087 on this AVX-512 CPU); tests/test_extension.py checks SCAFFOLD tightly
STATE_ATOL = {name: (2e-6 + 2e-5) / 0.1 for name in ("scaffold", "scaffold_example", "fedldf+scaffold")}


def assert_matches_reference(got, metrics, ref, ref_metrics, name=None):
    assert_close_to_scale(got[-1].variables, ref[-1].variables)
    assert_close_to_scale(got[-1].method_state, ref[-1].method_state, atol=STATE_ATOL.get(name, 2e-6))
    for m, r in zip(metrics, ref_metrics):
        (m_up, r_up), (m_down, r_down) = ((traffic_totals(x)[w] for x in (m, r))
                                          for w in ("upload_bytes", "download_bytes"))
        assert m_up == r_up and m_down == r_down
        np.testing.assert_allclose(m["train_loss"], r["train_loss"], rtol=1e-5)


def model_for(name, method, mlp, staged_mlp):
    """The model an entry trains: the one-stage MLP, for a depth-tiered method the staged one with its exits, for
    a LoRA method the MLP with rank-2 adapters on its hidden layers."""
    if name in ON_LORA:
        return _LORA_MODELS.setdefault(id(mlp), lora(mlp, 2))
    if name in ON_LORA_RANKS:
        return _LORA_MODELS.setdefault((id(mlp), "ranks"), with_lora_ranks(lora(mlp, 2), (1, 2)))
    return method.adapt_model(staged_mlp) if name in ON_STAGED else mlp


@pytest.mark.parametrize("name", NAMES)
def test_method_keeps_the_engine_contract(mlp, staged_mlp, data, name):
    mlp = model_for(name, BUILDERS[name](), mlp, staged_mlp)
    # Stepwise, recording decisions: the reference.
    step = build(mlp, BUILDERS[name](), strategies.stepwise(1), record=True, name=name)
    ref, ref_metrics, traces = run(step, data)
    assert traces[0] > 0 and traces[1] == traces[0], "round 2 retraced (stepwise)"

    # The whole cohort fused, on the cohorts padded with garbage steps and examples: the same result, no
    # retrace, and bit-identical when run again with the same seed.  (Fused in chunks of 2 with K = 3 differs
    # from it only in the engine's chunking, which tests/engine/test_engine.py checks per strategy, a remainder
    # chunk included; test_chunked_fused_round_matches_too runs it for every method under -m slow.  The
    # chunked round compiles the client's training twice, a scan over chunks and the remainder: measured 9.0
    # against 5.3 CPU seconds for FedLDF, the largest share of this file's time.)
    fused = build(mlp, BUILDERS[name](), strategies.fused(), name=name)
    padded_data = [padded(c) for c in data]
    got, metrics, traces = run(fused, padded_data)
    assert traces[1] == traces[0], "round 2 retraced (fused)"
    again, _, _ = run(fused, padded_data)
    chex.assert_trees_all_equal(again[-1], got[-1])
    assert_matches_reference(got, metrics, ref, ref_metrics, name)

    for t, (c, m) in enumerate(zip(data, ref_metrics)):
        before, after = ref[t], ref[t + 1]
        # Clients outside the cohort: their per-client state rows are bit-identical.
        outside = np.setdiff1d(np.arange(N), np.asarray(c.info.client_ids))
        rows = lambda tree: jax.tree.map(lambda a: np.asarray(a)[outside], tree)  # noqa: E731
        chex.assert_trees_all_equal(rows(after.method_state.clients), rows(before.method_state.clients))
        # Elements no client uploaded (with non-zero weight): bit-identical global value under server momentum.
        sel = m["decisions"]["selection"]
        g = before.variables["params"]
        expanded = jax.vmap(lambda mask: masks.expand(step.ctx.structure, mask, g))(sel.upload)
        weights = np.asarray(sel.weights)
        received = jax.tree.map(lambda e: np.tensordot(weights, np.asarray(e, np.float64), axes=(0, 0)) > 0,
                                expanded)
        for new, old, got_any in zip(jax.tree.leaves(after.variables["params"]), jax.tree.leaves(g),
                                     jax.tree.leaves(received)):
            keep = ~np.asarray(got_any)
            np.testing.assert_array_equal(np.asarray(new)[keep], np.asarray(old)[keep])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BUILDERS))
def test_chunked_fused_round_matches_too(mlp, staged_mlp, data, name):
    """Fused in chunks of 2 with K = 3 (a scan over one chunk, then the remainder) equals the stepwise round.
    The default run covers it: test_method_keeps_the_engine_contract (the whole-cohort fused round, the same
    per-client function) and tests/engine/test_engine.py::test_strategies_agree (``fused:3`` with K = 4)."""
    mlp = model_for(name, BUILDERS[name](), mlp, staged_mlp)
    ref, ref_metrics, _ = run(build(mlp, BUILDERS[name](), strategies.stepwise(1), name=name), data)
    got, metrics, traces = run(build(mlp, BUILDERS[name](), strategies.fused(2), name=name), data)
    assert traces[1] == traces[0], "round 2 retraced (fused)"
    assert_matches_reference(got, metrics, ref, ref_metrics, name)
