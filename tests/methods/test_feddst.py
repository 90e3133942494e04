"""FedDST: ERK counts by hand, the schedule, prune/regrow and sparse aggregation by hand, masked
local training, and exact sparsity through engine rounds (with adjustment rounds)."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedpartial._src.core import masks
from fedpartial._src.core.errors import UserError
from fedpartial._src.engine.client import make_client_fns
from fedpartial._src.engine.round import FederatedRound
from fedpartial._src.engine.strategy import fused
from fedpartial._src.methods.base import ClientPlan, InitView
from fedpartial._src.methods.catalog import get_method
from fedpartial._src.methods.submodel.erk import erk_counts, erk_densities, layout
from fedpartial._src.methods.submodel.feddst import adjusts, cosine_fraction, feddst
from fedpartial._src.methods.submodel.sparse import aggregate_sparse, last_batch_grad, prune_and_regrow
from tests.conftest import make_cohort

MLP_KERNELS = [(4, 6), (6, 5), (5, 3)]  # TinyMLP: fc1, fc2, head (69 weights)


# ---- ERK ------------------------------------------------------------------------------


def test_erk_densities_and_counts_by_hand():
    raw = [10 / 24, 11 / 30, 8 / 15]  # Σ dims / Π dims
    # s = 0.8: 0.2·69 = 13.8 kept; ε = 13.8 / Σ raw·size = 13.8 / 29, no layer over 1.
    np.testing.assert_allclose(erk_densities(MLP_KERNELS, 0.8), [r * 13.8 / 29 for r in raw])
    # exact 4.76, 5.23, 3.81: floors 4, 5, 3 (12); round(13.8) = 14 → +1 to the largest remainders (head, fc1).
    assert erk_counts(MLP_KERNELS, 0.8) == (5, 5, 4)
    # s = 0.2: the head would get 0.533·55.2/29 = 1.015 > 1 → dense (15); ε = (55.2 − 15) / (10 + 11) for the rest.
    np.testing.assert_allclose(erk_densities(MLP_KERNELS, 0.2), [raw[0] * 40.2 / 21, raw[1] * 40.2 / 21, 1.0])
    assert erk_counts(MLP_KERNELS, 0.2) == (19, 21, 15)  # 19.14, 21.06, 15: total round(55.2) = 55
    # s = 0.5: 34.5 kept rounds half up to 35 (exact 11.90, 13.09, 9.52 → 12, 13, 10).
    assert erk_counts(MLP_KERNELS, 0.5) == (12, 13, 10)
    assert erk_counts(MLP_KERNELS, 0.0) == (24, 30, 15)
    # A conv kernel counts its spatial dims: (3+3+1+4)/36 vs the dense (16+3)/48.
    np.testing.assert_allclose(erk_densities([(3, 3, 1, 4), (16, 3)], 0.5), np.array([11 / 36, 19 / 48]) * 42 / 30)
    for s in (0.1, 0.3, 0.8, 0.95):
        assert sum(erk_counts(MLP_KERNELS, s)) == math.floor((1 - s) * 69 + 0.5)


def test_layout_masks_kernels_only(history):
    r, states, _ = history
    lay = layout(r.ctx, states[0].variables["params"], 0.5)
    # Leaves in flatten order: bn1 {bias, scale}, fc1 {bias, kernel}, fc2 {…}, head {…}.
    assert lay.sparse == (False, False, False, True, False, True, False, True)
    assert lay.counts == (6, 6, 6, 12, 5, 13, 3, 10)


# ---- schedule --------------------------------------------------------------------------


def test_cosine_schedule_and_adjustment_rounds():
    got = [float(cosine_fraction(0.05, t, 4)) for t in range(6)]
    want = [0.05, 0.025 * (1 + math.cos(math.pi / 4)), 0.025, 0.025 * (1 + math.cos(3 * math.pi / 4)), 0.0, 0.0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)
    assert float(cosine_fraction(0.05, 100, None)) == pytest.approx(0.05)  # no planned rounds: not annealed
    assert [bool(adjusts(t, 3)) for t in range(8)] == [False, True, False, False, True, False, False, True]
    assert all(bool(adjusts(t, 1)) for t in range(4))


# ---- client: prune and regrow --------------------------------------------------------------


def test_prune_and_regrow_by_hand():
    mask = jnp.array([[True, True, False], [True, False, False]])
    w = jnp.array([[0.5, -0.1, 0.0], [2.0, 0.0, 0.0]])
    g = jnp.array([[9.0, 0.0, 0.3], [0.0, -0.7, 0.2]])
    # k = 1: drop |−0.1| (smallest active), grow index 4 (|−0.7|, largest among the inactive).
    new, kept = prune_and_regrow(mask, w, g, jnp.int32(1))
    np.testing.assert_array_equal(new, [[True, False, False], [True, True, False]])
    np.testing.assert_array_equal(kept, [[True, False, False], [True, False, False]])
    # k = 2: drop 0.1 and 0.5; grow 0.7 and 0.3.  The just-pruned index 0 (|g| = 9) is not regrown.
    new, kept = prune_and_regrow(mask, w, g, jnp.int32(2))
    np.testing.assert_array_equal(new, [[False, False, True], [True, True, False]])
    np.testing.assert_array_equal(kept, [[False, False, False], [True, False, False]])
    # k = 0: nothing moves.
    new, kept = prune_and_regrow(mask, w, g, jnp.int32(0))
    np.testing.assert_array_equal(new, mask)
    np.testing.assert_array_equal(kept, mask)
    # Ties go to the lower index: equal magnitudes everywhere.
    new, _ = prune_and_regrow(mask, jnp.ones((2, 3)), jnp.ones((2, 3)), jnp.int32(1))
    np.testing.assert_array_equal(new, [[False, True, True], [True, False, False]])


def test_regrowth_gradient_is_the_last_real_batch(mlp, history):
    variables = history[1][0].variables
    c = make_cohort((4,), k=1, steps=3, batch=5, seed=2, real_steps=[2], real_examples=[4])
    data = jax.tree.map(lambda a: a[0], c.data)
    got = jax.jit(lambda v, d: last_batch_grad(mlp, v, d))(variables, data)

    def loss(p):  # step 1 is the last real one; example 4 is padding
        logits, _ = mlp.apply({**variables, "params": p}, data.x[1, :4], True)
        return optax.softmax_cross_entropy_with_integer_labels(logits, data.y[1, :4]).mean()

    chex.assert_trees_all_close(got, jax.jit(jax.grad(loss))(variables["params"]), rtol=1e-5, atol=1e-7)


# ---- server: votes, mean, re-pruning ------------------------------------------------------------


def test_sparse_aggregation_by_hand():
    masks = jnp.array([[[1, 1, 0, 0]], [[1, 0, 1, 0]], [[0, 1, 1, 1]], [[0, 0, 1, 0]]], bool)
    values = jnp.array([[[2.0, 4.0, 0, 0]], [[5.0, 0, -1.0, 0]], [[0, 1.0, 3.0, 10.0]], [[0, 0, 99.0, 0]]])
    n = jnp.array([1.0, 2.0, 3.0, 0.0])  # the fourth client is padding: no weight, no vote
    mean = [(1 * 2 + 2 * 5) / 3, (1 * 4 + 3 * 1) / 4, (2 * -1 + 3 * 3) / 5, 10.0]  # 4, 1.75, 1.4, 10
    # Union (min_votes 1): keep the 3 largest |mean|: 10, 4, 1.75.
    keep, value = aggregate_sparse(values, masks, n, 3, 1)
    np.testing.assert_array_equal(keep, [[True, True, False, True]])
    np.testing.assert_allclose(value, [[mean[0], mean[1], 0.0, mean[3]]], rtol=1e-6)
    # min_votes 2: element 3 (one client) is dropped despite its magnitude; 1.4 takes its place.
    keep, value = aggregate_sparse(values, masks, n, 3, 2)
    np.testing.assert_array_equal(keep, [[True, True, True, False]])
    np.testing.assert_allclose(value, [[mean[0], mean[1], mean[2], 0.0]], rtol=1e-6)
    # Re-pruning to 2 keeps the two largest magnitudes among the voted.
    keep, _ = aggregate_sparse(values, masks, n, 2, 2)
    np.testing.assert_array_equal(keep, [[True, True, False, False]])
    # Too few voted (none has 3 votes): the count is still exact, filled by magnitude.
    keep, _ = aggregate_sparse(values, masks, n, 2, 3)
    np.testing.assert_array_equal(keep, [[True, False, False, True]])
    # Regrown weights arrive as zeros: among equal magnitudes the one more clients hold wins.
    zeros = jnp.zeros((3, 1, 2))
    keep, _ = aggregate_sparse(zeros, jnp.array([[[1, 0]], [[0, 1]], [[0, 1]]], bool), n[:3], 1, 1)
    np.testing.assert_array_equal(keep, [[False, True]])


# ---- local training ---------------------------------------------------------------------------


N, K = 5, 3


def build(model, method, rounds=6, strategy=None, client_optimizer=None):
    return FederatedRound(model, method, num_clients=N, cohort_size=K,
                          client_optimizer=client_optimizer or optax.sgd(0.1),
                          strategy=strategy or fused(), rounds=rounds)


def test_pruned_weights_stay_zero_in_local_training(history):
    r, states, _ = history
    state = states[0]  # the dense initial model and the random initial mask
    mask = state.method_state.server.mask
    plan = ClientPlan(train=masks.with_elements(masks.full(r.ctx.structure), mask))  # one client's, as the plan's
    start = r.method.client_start(r.ctx, state.variables, (), plan)
    # Momentum and weight decay: a pruned weight must move on neither.
    opt = optax.chain(optax.add_decayed_weights(0.1), optax.sgd(0.5, momentum=0.9))
    fns = make_client_fns(r.ctx, r.method, opt)
    step = jax.jit(lambda local, batch, s: fns.step(local, batch, plan, state.variables, (), jax.random.key(1), s))
    data = make_cohort((4,), k=1, steps=3, seed=0).data
    local = fns.init(start)
    for s in range(3):
        local = step(local, jax.tree.map(lambda a, s=s: a[0, s], data), jnp.int32(s))
    trained = local.variables["params"]
    for p, p0, p1, m in zip(*(jax.tree.leaves(t) for t in (state.variables["params"], start["params"], trained, mask))):
        m = np.asarray(m)
        np.testing.assert_array_equal(np.asarray(p0), np.where(m, p, 0.0))  # starts from the masked global
        assert not np.any(np.asarray(p1)[~m])  # pruned weights are still exactly zero
        assert np.any(np.asarray(p0)[m] != np.asarray(p1)[m])  # the active ones trained


# ---- engine rounds --------------------------------------------------------------------------


def cohorts():
    """Four rounds of unequal clients; the last has a padding slot."""
    out = []
    for t in range(4):
        ids = np.sort(np.random.default_rng(t).choice(N, K, replace=False))
        c = make_cohort((4,), k=K, steps=3, seed=t, real_steps=[3, 1, 2], real_examples=[5, 2, 4], client_ids=ids)
        if t == 3:
            c = c._replace(info=c.info._replace(valid=np.array([True, True, False])))
        out.append(c)
    return out


# The module fixture below is costly: the module stays on one xdist worker (--dist loadgroup), which
# builds it once.
# Rounds of a few steps, each test its own programs: compiled at -O0 (tests/conftest.py says why that changes
# nothing here)
pytestmark = [pytest.mark.xdist_group("feddst"), pytest.mark.usefixtures("engine_compiled_at_o0")]


@pytest.fixture(scope="session")  # kept by its xdist group's worker (see test_sharding.py)
def history(mlp):
    """Four FedDST rounds (s = 0.5, R_adj = 2, α = 0.5, T_end = 6): adjustments in rounds 1 and 3."""
    r = build(mlp, feddst(sparsity=0.5, adjust_every=2, adjust_fraction=0.5))
    state = r.init(jax.random.key(0))
    states, metrics = [jax.device_get(state)], []
    for t, c in enumerate(cohorts()):
        state, m = r(state, c, jax.random.key(t))
        states.append(jax.device_get(state))
        metrics.append(jax.device_get(m))
    return r, states, metrics


def test_initial_mask_is_random_erk_and_seeded(mlp, history):
    r, states, _ = history
    mask = states[0].method_state.server.mask
    assert [int(np.sum(m)) for m in jax.tree.leaves(mask)] == [6, 6, 6, 12, 5, 13, 3, 10]
    chex.assert_trees_all_equal(r.init(jax.random.key(0)).method_state.server.mask, mask)
    other = r.init(jax.random.key(1)).method_state.server.mask
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(other), jax.tree.leaves(mask)))


def test_global_mask_keeps_exact_sparsity_and_params_are_zero_outside(history):
    _, states, _ = history
    for state in states[1:]:
        mask = state.method_state.server.mask
        assert [int(np.sum(m)) for m in jax.tree.leaves(mask)] == [6, 6, 6, 12, 5, 13, 3, 10]
        for p, m in zip(jax.tree.leaves(state.variables["params"]), jax.tree.leaves(mask)):
            assert not np.any(np.asarray(p)[~np.asarray(m)])


def test_client_masks_move_by_the_annealed_count_on_adjustment_rounds_only(history):
    _, states, metrics = history
    alphas = [0.25 * (1 + math.cos(math.pi * t / 6)) for t in range(4)]
    moved = [sum(math.floor(a * n + 1e-3) for n in (12, 13, 10)) for a in alphas]
    assert moved[1] == 5 + 6 + 4 and moved[3] == 3 + 3 + 2  # α_1 = 0.467, α_3 = 0.25
    for t, m in enumerate(metrics):
        adjusting = t in (1, 3)
        assert bool(m["dst_adjusted"]) == adjusting
        assert float(m["dst_fraction"]) == pytest.approx(alphas[t], rel=1e-6)
        real = np.array([True, True, t != 3])
        np.testing.assert_array_equal(m["dst_moved"], np.where(real, moved[t] if adjusting else 0, 0))
        # Sparse traffic: 35 kernel values + mask bits (3 + 4 + 2 bytes) + 26 dense params + 12 BN statistics.
        sparse = np.where(real, 35 * 4 + 9 + 26 * 4 + 12 * 4, 0)
        np.testing.assert_array_equal(m["sparse_upload_bytes"], sparse)
        # ... and that is what the engine counts both ways (the simulated time reads these).
        np.testing.assert_array_equal(np.asarray(m["upload_bytes_per_layer"]).sum(-1), sparse)
        np.testing.assert_array_equal(np.asarray(m["download_bytes_per_layer"]).sum(-1), sparse)
    masks = [jax.tree.leaves(s.method_state.server.mask) for s in states]
    same = lambda a, b: all(np.array_equal(x, y) for x, y in zip(a, b))  # noqa: E731
    assert same(masks[0], masks[1]) and same(masks[2], masks[3])  # no adjustment: every client keeps the mask
    assert not same(masks[1], masks[2])  # the adjustment moved the global mask


def test_personal_model_is_the_masked_global(history):
    r, states, _ = history
    state = states[0]  # before any round the stored global model is still dense
    personal = r.method.personal(r.ctx, state.method_state, state.variables)
    for p, q, m in zip(jax.tree.leaves(personal.variables["params"]), jax.tree.leaves(state.variables["params"]),
                       jax.tree.leaves(state.method_state.server.mask)):
        np.testing.assert_array_equal(p, np.where(m, q, 0.0))


# ---- options ----------------------------------------------------------------------------------


def test_bad_options_are_one_sentence(history):
    with pytest.raises(UserError, match="--sparsity"):
        get_method("feddst", sparsity=1.0)
    with pytest.raises(UserError, match="--adjust-every"):
        get_method("feddst", adjust_every=0)
    with pytest.raises(UserError, match="--adjust-fraction"):
        get_method("feddst", adjust_fraction=0.0)
    with pytest.raises(UserError, match="--min-votes"):
        get_method("feddst", min_votes=0)
    with pytest.raises(UserError, match="sparsity"):
        feddst(sparsity=-0.1)
    r, states, _ = history
    with pytest.raises(UserError, match="cohort size"):
        feddst(min_votes=K + 1).init(r.ctx, InitView(global_vars=states[0].variables, key=jax.random.key(0)))
