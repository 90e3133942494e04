"""Local training semantics: frozen, dropped and padded things change nothing."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedpartial._src.core import masks
from fedpartial._src.core.types import client_sgd
from fedpartial._src.engine.client import make_client_fns
from fedpartial._src.methods.base import Batch, ClientPlan, MethodContext, make_method
from tests.conftest import make_cohort

OPT = optax.chain(optax.add_decayed_weights(0.1), optax.sgd(0.1, momentum=0.9))
# One client's few tiny steps, checked for what stays bit for bit or compared with a tolerance: compiled at XLA's
# -O0, as engine_compiled_at_o0 (tests/conftest.py) compiles the engine's rounds, and for the same reason
JIT_O0 = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})


def train(model, plan, data, variables, optimizer=OPT):
    """Runs one client's local steps un-vmapped (data: Batch with leading steps axis)."""
    fns = make_client_fns(MethodContext(model, 4, 4), make_method("t"), optimizer)
    local = JIT_O0(fns.init)(variables)
    step = JIT_O0(fns.step)
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


# ---- frozen means frozen: value and optimizer state, for every client optimizer the CLI offers ----------------

# fc1's bias feeds a BatchNorm, so its gradient is rounding noise, which Adam's default eps (1e-8) would turn into
# steps of ±lr whose signs differ between float32 and float64; a larger eps keeps the comparison meaningful.
ADAM_EPS = 1e-3
FC1_A = np.array([1, 1, 0, 1, 0, 1], bool)  # fc1 units trained in even steps (the others in odd steps)


def changing_mask(ctx, plan, key, step):
    """Even steps: fc1's units FC1_A and the head; odd steps: fc1's other units and fc2 (a mask that changes
    between local steps, element by element, as FedRep's and FedAD's per-step plans do)."""
    even = step % 2 == 0
    fc1 = jnp.where(even, jnp.asarray(FC1_A), ~jnp.asarray(FC1_A))
    layers = jnp.stack([jnp.array(True), ~even, even])
    return plan._replace(train=masks.Mask(layers, (fc1, jnp.ones(5, bool), jnp.ones(3, bool))))


def reference_masked_training(model, variables, data, optimizer, steps):
    """One client's steps as a plain loop over numpy arrays: each element keeps its own optimizer state, and an
    element not trained in a step is skipped — its value and its state stay as they were (PyTorch's SGD and
    Adam skip a parameter with no gradient)."""
    lr, momentum, wd, adam = optimizer
    f64 = lambda tree: jax.tree.map(lambda a: np.array(a, np.float64), tree)  # noqa: E731
    params, stats = f64(variables["params"]), variables["batch_stats"]
    first, second = jax.tree.map(np.zeros_like, params), jax.tree.map(np.zeros_like, params)
    for s in range(steps):
        ctx = MethodContext(model, 4, 4)
        plan = changing_mask(ctx, ClientPlan(), None, jnp.asarray(s))
        trained = jax.tree.map(np.asarray, masks.expand(model.structure, masks.protect_output(plan.train),
                                                        variables["params"]))
        x, y = data.x[s], data.y[s]

        def loss(p):
            logits, new = model.apply({"params": p, "batch_stats": stats}, x, True)
            return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(len(y)), y]), new

        (_, stats), grads = jax.value_and_grad(loss, has_aux=True)(jax.tree.map(np.float32, params))
        grads = f64(grads)

        def update(p, g, m1, m2, on):
            g = g + wd * p
            if adam:  # optax.adam's count is the client's steps (state shared by every element)
                b1, b2, eps = 0.9, 0.999, ADAM_EPS
                n1, n2 = b1 * m1 + (1 - b1) * g, b2 * m2 + (1 - b2) * g * g
                step = (n1 / (1 - b1 ** (s + 1))) / (np.sqrt(n2 / (1 - b2 ** (s + 1))) + eps)
            else:
                n1, n2 = momentum * m1 + g, m2
                step = n1
            return (np.where(on, p - lr * step, p), np.where(on, n1, m1), np.where(on, n2, m2))

        out = jax.tree.map(update, params, grads, first, second, trained)
        params, first, second = (jax.tree.map(lambda t, i=i: t[i], out, is_leaf=lambda t: isinstance(t, tuple))
                                 for i in range(3))
    return params


@pytest.mark.parametrize("optimizer", [(0.1, 0.0, 0.0, False), (0.1, 0.9, 0.0, False), (0.1, 0.0, 0.05, False),
                                       (0.1, 0.9, 0.05, False), (0.05, 0.0, 0.05, True)],
                         ids=["sgd", "momentum", "weight-decay", "momentum+weight-decay", "adam+weight-decay"])
def test_frozen_elements_keep_their_optimizer_state(mlp, optimizer):
    """A mask that changes every step, under each client optimizer the command line offers (and Adam through the
    API): the engine equals a loop in which a frozen element's value and state do not move."""
    lr, momentum, wd, adam = optimizer
    if adam:
        opt = optax.chain(optax.add_decayed_weights(wd), optax.adam(lr, eps=ADAM_EPS))
    else:
        opt = client_sgd(lr, momentum=momentum, weight_decay=wd)
    v = mlp.init_variables(jax.random.key(5))
    steps = 4
    data = one_client(make_cohort((4,), steps=steps, seed=3))
    fns = make_client_fns(MethodContext(mlp, 4, 4), make_method("t", step_plan=changing_mask), opt)
    local, step = fns.init(v), JIT_O0(fns.step)
    for s in range(steps):
        local = step(local, jax.tree.map(lambda a: a[s], data), ClientPlan(), v, (), jax.random.key(0), s)
    got = fns.final(local, v)[0]["params"]
    want = reference_masked_training(mlp, v, data, optimizer, steps)
    chex.assert_trees_all_close(jax.device_get(got), want, rtol=2e-5, atol=2e-6)
