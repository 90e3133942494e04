"""Local training semantics: frozen, dropped and padded things change nothing."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedpartial._src.core import masks
from fedpartial._src.engine.client import make_client_fns
from fedpartial._src.methods.base import Batch, ClientPlan, MethodContext, make_method
from tests.conftest import make_cohort

OPT = optax.chain(optax.add_decayed_weights(0.1), optax.sgd(0.1, momentum=0.9))


def train(model, plan, data, variables, optimizer=OPT):
    """Runs one client's local steps un-vmapped (data: Batch with leading steps axis)."""
    fns = make_client_fns(MethodContext(model, 4, 4), make_method("t"), optimizer)
    local = jax.jit(fns.init)(variables)
    step = jax.jit(fns.step)
    for s in range(data.step_mask.shape[0]):
        local = step(local, jax.tree.map(lambda a: a[s], data), plan, variables, (), jax.random.key(0), s)
    return fns.final(local, variables)


def one_client(cohort, i=0):
    return jax.tree.map(lambda a: a[i], cohort.data)


def test_frozen_parameters_bit_identical_under_momentum_and_weight_decay(mlp):
    v = mlp.init_variables(jax.random.key(1))
    data = one_client(make_cohort((4,), steps=4))
    n1 = jnp.array([1, 1, 0, 1, 0, 1], bool)
    train_mask = masks.Mask(jnp.array([True, False, True]), (n1, jnp.ones(5, bool), jnp.ones(3, bool)))
    out, loss, steps = train(mlp, ClientPlan(train=train_mask), data, v)
    p0, p1 = v["params"], out["params"]
    assert int(steps) == 4 and np.isfinite(loss)
    # Layer fc2 frozen as a whole: bit-identical.
    chex.assert_trees_all_equal(p1["fc2"], p0["fc2"])
    # fc1 neurons 2 and 4 frozen: their columns, biases and BN parameters are unchanged ...
    for j in (2, 4):
        np.testing.assert_array_equal(p1["fc1"]["kernel"][:, j], p0["fc1"]["kernel"][:, j])
        np.testing.assert_array_equal(p1["fc1"]["bias"][j], p0["fc1"]["bias"][j])
        np.testing.assert_array_equal(p1["bn1"]["scale"][j], p0["bn1"]["scale"][j])
    # ... while the others did train.
    assert not np.array_equal(p1["fc1"]["kernel"][:, 0], p0["fc1"]["kernel"][:, 0])
    assert not np.array_equal(p1["head"]["kernel"], p0["head"]["kernel"])


def test_dropped_neurons_do_not_affect_outputs_and_are_not_updated(cnn):
    v = cnn.init_variables(jax.random.key(2))
    data = one_client(make_cohort((4, 4, 1), steps=3))
    channels = jnp.array([True, False, True, False])
    dropout = masks.from_neurons(cnn.structure, (jnp.ones(3, bool), channels, jnp.ones(3, bool)))
    plan = ClientPlan(dropout=dropout)
    out, loss, _ = train(cnn, plan, data, v)

    # Perturb everything belonging to the dropped channels (their kernels and biases,
    # and the head rows reading them): training must give the same loss and result.
    perturbed = jax.tree.map(lambda a: a, v)
    p = perturbed["params"]
    p["conv2"]["kernel"] = p["conv2"]["kernel"].at[..., 1].set(5.0).at[..., 3].set(-7.0)
    p["conv2"]["bias"] = p["conv2"]["bias"].at[1].set(3.0)
    rows = np.arange(16) % 4
    p["head"]["kernel"] = p["head"]["kernel"].at[(rows == 1) | (rows == 3)].set(9.0)
    out2, loss2, _ = train(cnn, plan, data, perturbed)
    np.testing.assert_allclose(loss, loss2, rtol=1e-6)
    np.testing.assert_allclose(out["params"]["head"]["bias"], out2["params"]["head"]["bias"], rtol=1e-5, atol=1e-6)
    # Dropped parameters are not updated.
    np.testing.assert_array_equal(out2["params"]["conv2"]["kernel"][..., 1], 5.0)
    np.testing.assert_array_equal(out2["params"]["head"]["kernel"][rows == 1], 9.0)


def test_dropout_scale_is_inverted_dropout(mlp):
    v = mlp.init_variables(jax.random.key(3))
    data = one_client(make_cohort((4,), steps=1))
    keep = jnp.array([1, 1, 0, 1, 1, 1], bool)
    dropout = masks.from_neurons(mlp.structure, (keep, jnp.ones(5, bool), jnp.ones(3, bool)))
    scale = (jnp.full(6, 2.0), jnp.ones(5), jnp.ones(3))
    _, loss_scaled, _ = train(mlp, ClientPlan(dropout=dropout, dropout_scale=scale), data, v)
    # The same as doubling fc2's rows by hand and dropping neuron 2 without scaling.
    v2 = jax.tree.map(lambda a: a, v)
    v2["params"]["fc2"]["kernel"] = v["params"]["fc2"]["kernel"] * 2.0
    _, loss_manual, _ = train(mlp, ClientPlan(dropout=dropout), data, v2, optax.sgd(0.0))
    np.testing.assert_allclose(loss_scaled, loss_manual, rtol=1e-6)


def test_padded_steps_and_examples_change_nothing(mlp):
    """A client padded with empty steps and masked examples trains exactly as unpadded (BN included)."""
    v = mlp.init_variables(jax.random.key(4))
    base = one_client(make_cohort((4,), steps=2, batch=3, seed=7))
    rng = np.random.default_rng(0)
    # Pad: 2 more steps of garbage (step_mask False) and 2 more garbage examples per batch.
    x = np.concatenate([base.x, rng.normal(size=(2, 3, 4)).astype(np.float32) * 100], 0)
    x = np.concatenate([x, rng.normal(size=(4, 2, 4)).astype(np.float32) * 100], 1)
    y = np.concatenate([np.concatenate([base.y, rng.integers(0, 3, (2, 3))], 0), rng.integers(0, 3, (4, 2))], 1)
    em = np.zeros((4, 5), bool)
    em[:2, :3] = True
    padded = Batch(x, y.astype(np.int32), em, np.array([True, True, False, False]))
    a, loss_a, steps_a = train(mlp, ClientPlan(), base, v)
    b, loss_b, steps_b = train(mlp, ClientPlan(), padded, v)
    assert int(steps_a) == int(steps_b) == 2
    chex.assert_trees_all_close(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss_a, loss_b, rtol=1e-6)
