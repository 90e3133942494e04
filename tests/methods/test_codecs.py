"""Upload codecs: top-k with error feedback, QSGD, scaled sign — around any method, in bits, with DP."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedpartial._src.core.errors import UserError
from fedpartial._src.core.types import client_sgd
from fedpartial._src.engine.metrics import traffic_totals
from fedpartial._src.engine.round import FederatedRound
from fedpartial._src.methods.basic.fedavg import fedavg
from fedpartial._src.methods.codecs import parse_codec, qsgd, sign, topk, upload_codec
from fedpartial._src.methods.layerwise.fedldf import fedldf
from fedpartial._src.methods.privacy.dp_fedavg import dp_fedavg
from tests.conftest import make_cohort

# Rounds of a few steps, each test its own programs: compiled at -O0 (tests/conftest.py says why that changes
# nothing here)
pytestmark = pytest.mark.usefixtures("engine_compiled_at_o0")

N, K = 6, 3


def run(mlp, method, rounds=2, bn_policy="global"):
    r = FederatedRound(mlp, method, num_clients=N, cohort_size=K, client_optimizer=client_sgd(0.1, momentum=0.9),
                       bn_policy=bn_policy)
    state, out = r.init(jax.random.key(0)), []
    for t in range(rounds):
        state, m = r(state, make_cohort((4,), k=K, steps=2, seed=t, client_ids=[t, t + 1, t + 3]),
                     jax.random.key(t))
        out.append(jax.device_get(m))
    return r, jax.device_get(state), out


def test_topk_sends_the_largest_entries_and_error_feedback_sends_everything_eventually():
    x = jnp.asarray([0.5, -3.0, 0.1, 2.0, -0.2, 0.0, 1.0, 0.3, -0.7, 0.05], jnp.float32)
    on = jnp.ones(10, bool).at[6].set(False)  # entry 6 is not uploaded: never sent
    sent = topk(0.2).encode(None, x, on)
    np.testing.assert_array_equal(np.nonzero(np.asarray(sent))[0], [1, 3])  # ⌈0.2 · 9⌉ = 2 largest |x|
    # The same update every round, with error feedback: every uploaded entry's accumulated value is sent within
    # a few rounds, and what was sent plus what is left is exactly what accumulated.
    e, total, seen = jnp.zeros(10), jnp.zeros(10), np.zeros(10, bool)
    for t in range(1, 200):
        a = x + e
        s = topk(0.2).encode(None, a, on)
        e = jnp.where(on, a - s, e)
        total, seen = total + s, seen | (np.asarray(s) != 0)
        np.testing.assert_allclose(total + e, jnp.where(on, t * x, 0.0), rtol=1e-5, atol=1e-5)
    assert seen[np.asarray(on) & (np.asarray(x) != 0)].all() and not seen[6]


def test_qsgd_is_unbiased_and_uses_its_levels():
    x = jnp.asarray(np.random.default_rng(0).normal(size=50), jnp.float32)
    on = jnp.ones(50, bool)
    codec, draws = qsgd(4), 20000
    sent = jax.vmap(lambda k: codec.encode(k, x, on))(jax.random.split(jax.random.key(1), draws))
    norm, s = float(jnp.linalg.norm(x)), 7  # 4 bits: a sign and 2³ − 1 levels
    levels = np.abs(np.asarray(sent)) * s / norm
    np.testing.assert_allclose(levels, np.round(levels), atol=1e-4)  # whole levels, 0 … 7
    assert levels.max() <= s + 1e-4
    # mean over draws within 5 standard errors of x (variance of one draw ≤ (norm/s)² / 4)
    stderr = norm / s / 2 / math.sqrt(draws)
    assert np.all(np.abs(np.asarray(sent).mean(0) - np.asarray(x)) < 5 * stderr)


def test_sign_sends_the_mean_magnitude_with_the_sign():
    x = jnp.asarray([1.0, -3.0, 2.0, 0.5])
    on = jnp.asarray([True, True, True, False])
    np.testing.assert_allclose(sign().encode(None, x, on), [2.0, -2.0, 2.0, 0.0])


@pytest.mark.parametrize("text, name", [("topk:0.1", "topk0.1"), ("qsgd:8", "qsgd8"), ("sign", "sign")])
def test_codecs_by_name(text, name):
    assert parse_codec(text).name == name


@pytest.mark.parametrize("text", ["topk", "topk:0", "topk:1.5", "qsgd:1", "qsgd:x", "sign:2", "zip"])
def test_a_bad_codec_is_one_sentence(text):
    with pytest.raises(UserError, match="--upload-codec") as e:
        parse_codec(text)
    assert "\n" not in str(e.value)


def test_every_entry_kept_is_the_method_up_to_rounding_and_traffic_is_counted_in_bits(mlp):
    """top-k keeping everything sends the whole update: the method's model (θ + (θ_k − θ) rounds once); its
    upload is 32 bits a value plus a bitmap per tensor, in whole bytes per layer."""
    _, plain, _ = run(mlp, fedldf(n=2))
    r, coded, metrics = run(mlp, upload_codec(fedldf(n=2), "topk:1"))
    chex.assert_trees_all_close(coded.variables, plain.variables, rtol=1e-6, atol=1e-6)
    # FedAvg uploads every element: per layer ⌈Σ_tensors (32 bits a value + a bitmap) / 8⌉, plus its BatchNorm
    # statistics uncompressed; every client the same
    r, _, metrics = run(mlp, upload_codec(fedavg(), "topk:1"))
    g = r.init(jax.random.key(0)).variables
    want = 0
    for layer in range(r.ctx.structure.num_layers):
        sizes = [a.size for path, a in jax.tree_util.tree_leaves_with_path(g["params"])
                 if r.ctx.structure.role("params", tuple(k.key for k in path)).layer == layer]
        want += math.ceil(sum(33 * s for s in sizes) / 8)
    want += sum(a.size * 4 for a in jax.tree.leaves(g["batch_stats"]))
    np.testing.assert_array_equal(traffic_totals(metrics[-1])["upload_bytes_per_client"], [want] * K)
    # QSGD 8 bits: 8 a value and 32 a tensor
    _, _, metrics = run(mlp, upload_codec(fedavg(), "qsgd:8"), rounds=1)
    want = sum(math.ceil(sum(8 * a.size + 32 for path, a in jax.tree_util.tree_leaves_with_path(g["params"])
                             if r.ctx.structure.role("params", tuple(k.key for k in path)).layer == layer) / 8)
               for layer in range(r.ctx.structure.num_layers))
    want += sum(a.size * 4 for a in jax.tree.leaves(g["batch_stats"]))
    np.testing.assert_array_equal(traffic_totals(metrics[-1])["upload_bytes_per_client"], [want] * K)


def test_codecs_compose_with_dp_and_a_wrapped_codec_is_refused(mlp):
    method = dp_fedavg(upload_codec(fedavg(), "qsgd:4"), clip=1.0, noise_multiplier=0.5)
    assert method.name == "dp-fedavg+qsgd4"
    _, state, metrics = run(mlp, method, bn_policy="static")
    assert all(np.all(np.isfinite(np.asarray(a))) for a in jax.tree.leaves(state.variables))
    assert "dp_clipped_fraction" in metrics[-1]
    with pytest.raises(UserError, match="upload codec sign cannot wrap fedavg\\+topk0.1: it already encodes"):
        upload_codec(upload_codec(fedavg(), "topk:0.1"), "sign")


def test_the_round_keeps_what_top_k_left_out_for_the_cohort_only(mlp):
    """Error feedback through the engine: after a round, a cohort client's residual is its update on exactly the
    entries top-k did not send (the rest 0); clients outside the cohort keep theirs (0); keeping everything
    leaves no residual at all."""
    r = FederatedRound(mlp, upload_codec(fedavg(), "topk:0.25"), num_clients=N, cohort_size=K,
                       client_optimizer=client_sgd(0.1, momentum=0.9))
    state, _ = r(r.init(jax.random.key(0)), make_cohort((4,), k=K, steps=2, client_ids=[0, 2, 4]), jax.random.key(1))
    residual = jax.device_get(state.method_state.clients[1])
    for path, leaf in jax.tree_util.tree_leaves_with_path(residual):
        rows = np.asarray(leaf).reshape(N, -1)
        assert not rows[[1, 3, 5]].any()  # outside the cohort
        for k in (0, 2, 4):
            size = rows.shape[1]
            left = np.count_nonzero(rows[k])
            assert left <= size - math.ceil(0.25 * size - 1e-4)  # the sent entries leave nothing behind
            if path[-1].key == "kernel":  # what was not sent stays (dead ReLU columns may not have moved at all)
                assert left > (size - math.ceil(0.25 * size - 1e-4)) // 2
    r = FederatedRound(mlp, upload_codec(fedavg(), "topk:1"), num_clients=N, cohort_size=K,
                       client_optimizer=client_sgd(0.1, momentum=0.9))
    state, _ = r(r.init(jax.random.key(0)), make_cohort((4,), k=K, steps=2, client_ids=[0, 2, 4]), jax.random.key(1))
    assert not any(np.asarray(a).any() for a in jax.tree.leaves(jax.device_get(state.method_state.clients[1])))


def test_a_codec_refuses_the_streamed_strategy_in_one_sentence(mlp):
    """A codec keeps per-client state and reads the whole cohort; any method with an encode hook cannot be
    streamed (the streamed round aggregates chunk by chunk, before anything could be encoded)."""
    from fedpartial._src.engine.strategy import streamed
    from fedpartial._src.methods.base import Capabilities, make_method

    def build(method):
        FederatedRound(mlp, method, num_clients=N, cohort_size=K, client_optimizer=client_sgd(0.1),
                       strategy=streamed(1))

    with pytest.raises(UserError, match=r"^method fedavg\+sign needs the whole cohort at once, so it cannot be "
                                        r"streamed; use the fused, stepwise or debug strategy\.$"):
        build(upload_codec(fedavg(), "sign"))
    own = make_method("own", encode=lambda ctx, view: view.trained_vars["params"],
                      capabilities=Capabilities(streamable="per_client"))
    with pytest.raises(UserError, match=r"^method own aggregates in its own way \(not the one formula\) or encodes "
                                        r"its uploads, so it cannot be streamed"):
        build(own)
