"""FedBABU: a plain-Python reference over two rounds (the body trained and averaged, the head never moves, bit
for bit), its traffic, bad options; its fine-tuned evaluation is tests/experiment/test_finetune.py's."""

import chex
import jax
import numpy as np
import pytest

from fedpartial._src.core.errors import UserError
from fedpartial._src.engine.metrics import traffic_totals
from fedpartial._src.engine.strategy import stepwise
from fedpartial._src.methods.catalog import get_method
from tests.methods.test_heterofl import LR, MOMENTUM, SMALL, _narrow_grad, adapt, build, start
from tests.methods.test_personal_layers import LAYERS, N, cohorts


def reference(global_params, data, head=("head",)):
    """FedBABU as a textbook writes it, one client at a time: start from the global model, train the body with
    momentum SGD (the head gets no gradient and does not move), average the body with n_k weights."""
    g = jax.tree.map(lambda a: np.array(a, np.float64), global_params)
    for c in data:
        d, trained, weights = c.data, [], []
        for k in range(len(c.info.client_ids)):
            p = jax.tree.map(np.copy, g)
            velocity = jax.tree.map(np.zeros_like, p)
            for s in range(d.step_mask.shape[1]):
                if not d.step_mask[k, s]:
                    continue
                grads = _narrow_grad(jax.tree.map(lambda a: a.astype(np.float32), p), d.x[k, s], d.y[k, s],
                                     d.example_mask[k, s].astype(np.float32), 1.0)
                grads = {name: jax.tree.map(lambda a, on=name not in head: np.asarray(a) * on, grads[name])
                         for name in LAYERS}
                velocity = jax.tree.map(lambda v, dg: MOMENTUM * v + dg, velocity, grads)
                p = jax.tree.map(lambda a, v: a - LR * v, p, velocity)
            trained.append(p)
            weights.append(float(c.info.num_samples[k]))
        w = np.asarray(weights) / sum(weights)
        g = {name: g[name] if name in head else
             jax.tree.map(lambda *leaves: sum(wk * a for wk, a in zip(w, leaves)), *[p[name] for p in trained])
             for name in LAYERS}
    return g


def test_engine_matches_a_plain_python_reference_and_the_head_never_moves():
    model = adapt(SMALL, (4,))
    r = build(model, get_method("fedbabu"), n=N, k=2, strategy=stepwise(1))
    state = start(r)
    initial = jax.device_get(state.variables["params"])
    expected = reference(initial, cohorts())
    for t, c in enumerate(cohorts()):
        state, m = r(state, c, jax.random.key(t))
    params = jax.device_get(state.variables["params"])
    chex.assert_trees_all_close(params, expected, rtol=2e-5, atol=2e-6)
    chex.assert_trees_all_equal(params["head"], initial["head"])  # exactly its random initialisation
    assert not np.allclose(params["fc1"]["kernel"], initial["fc1"]["kernel"])
    # Each client receives and sends the body only: fc1 + fc2 = 30 + 35 values.
    traffic = traffic_totals(m)
    for way in ("upload", "download"):
        np.testing.assert_array_equal(traffic[f"{way}_bytes_per_client"], [4 * 65] * 2)


def test_a_two_layer_head_freezes_both():
    model = adapt(SMALL, (4,))
    r = build(model, get_method("fedbabu", head_layers=2), n=N, k=2)
    state = start(r)
    initial = jax.device_get(state.variables["params"])
    for t, c in enumerate(cohorts()):
        state, _ = r(state, c, jax.random.key(t))
    params = jax.device_get(state.variables["params"])
    chex.assert_trees_all_close(params, reference(initial, cohorts(), head=("fc2", "head")), rtol=2e-5, atol=2e-6)
    chex.assert_trees_all_equal({k: params[k] for k in ("fc2", "head")}, {k: initial[k] for k in ("fc2", "head")})


def test_bad_options_are_one_sentence():
    with pytest.raises(UserError, match="fedbabu: --head-layers 4 must be between 0 and the model's 3 layers"):
        start(build(adapt(SMALL, (4,)), get_method("fedbabu", head_layers=4), n=N, k=2))
    with pytest.raises(UserError, match="--finetune-epochs = -1"):
        get_method("fedbabu", finetune_epochs=-1)
    caps = get_method("fedbabu", finetune_epochs=2).capabilities
    assert caps.personalised and caps.finetune_epochs == 2
