"""A plain-Python, un-vmapped FedAvg that the engine must match (every strategy)."""

import jax
import numpy as np
import optax
import pytest

from fedpartial._src.engine.round import FederatedRound
from fedpartial._src.engine.strategy import fused, stepwise
from fedpartial._src.methods.basic.fedavg import fedavg
from tests.conftest import make_cohort

LR, MOMENTUM, WD = 0.1, 0.9, 1e-3


def reference_fedavg_round(model, global_vars, cohort):
    """FedAvg written the way a textbook (or a Python FL framework) would: one client at a time."""
    to_np = lambda tree: jax.tree.map(lambda a: np.array(a, np.float64), tree)
    results, weights = [], []
    for k in range(cohort.info.client_ids.shape[0]):
        params = to_np(global_vars["params"])
        stats = to_np(global_vars["batch_stats"])
        velocity = jax.tree.map(np.zeros_like, params)
        for s in range(cohort.data.step_mask.shape[1]):
            if not cohort.data.step_mask[k, s]:
                continue  # a padded step: nothing happens
            x, y = cohort.data.x[k, s], cohort.data.y[k, s]
            real = cohort.data.example_mask[k, s]
            x, y = x[real], y[real]  # padded examples simply do not exist here

            def loss(p):
                logits, new_stats = model.apply({"params": p, "batch_stats": stats}, x, True)
                logp = jax.nn.log_softmax(logits)
                return -logp[np.arange(len(y)), y].mean(), new_stats

            p32 = jax.tree.map(lambda a: a.astype(np.float32), params)
            (_, new_stats), grads = jax.value_and_grad(loss, has_aux=True)(p32)
            grads = to_np(grads)
            # SGD with heavy-ball momentum and L2 weight decay added to the gradient.
            velocity = jax.tree.map(lambda v, g, p: MOMENTUM * v + g + WD * p, velocity, grads, params)
            params = jax.tree.map(lambda p, v: p - LR * v, params, velocity)
            stats = to_np(new_stats)
        results.append({"params": params, "batch_stats": stats})
        weights.append(float(cohort.info.num_samples[k]))
    w = np.array(weights) / np.sum(weights)
    return jax.tree.map(lambda *leaves: sum(wi * l for wi, l in zip(w, leaves)), *results)


@pytest.mark.parametrize("strategy", [fused(), stepwise(1), stepwise(3)], ids=str)
def test_engine_matches_plain_python_fedavg(mlp, strategy):
    cohorts = [make_cohort((4,), k=4, steps=3, batch=5, seed=s, real_steps=[3, 2, 1, 3],
                           real_examples=[5, 3, 5, 4]) for s in range(2)]
    opt = optax.chain(optax.add_decayed_weights(WD), optax.sgd(LR, momentum=MOMENTUM))
    r = FederatedRound(mlp, fedavg(), num_clients=4, cohort_size=4, client_optimizer=opt,
                       strategy=strategy)
    state = r.init(jax.random.key(0))
    expected = jax.device_get(state.variables)
    for t, c in enumerate(cohorts):
        expected = reference_fedavg_round(mlp, expected, c)
        state, _ = r(state, c, jax.random.key(t))
    got = jax.device_get(state.variables)
    for e, g in zip(jax.tree.leaves(expected), jax.tree.leaves(got)):
        np.testing.assert_allclose(g, e, rtol=2e-4, atol=2e-5)
