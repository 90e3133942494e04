"""Evaluation after per-client fine-tuning (FedBABU's): each client's own fine-tuned model, checked by hand on a
tiny case, the same in any chunking, and in a run next to the global model."""

import jax
import numpy as np
import pytest

from fedpartial._src.core.types import client_sgd
from fedpartial._src.data import packing
from fedpartial._src.experiment.config import RunConfig
from fedpartial._src.experiment.evaluation import pad_holdouts
from fedpartial._src.experiment.finetune import evaluate_finetuned
from fedpartial._src.experiment.simulation import Simulation
from tests.methods.test_heterofl import LR, MOMENTUM, SMALL, _narrow_grad, adapt

EPOCHS, BATCH, SEED = 2, 2, 7


@pytest.fixture(scope="module")
def case():
    """Three clients of the 4-3 MLP: 5, 3 and no training examples, 4, 2 and 3 held out."""
    rng = np.random.default_rng(0)
    model = adapt(SMALL, (4,))
    variables = jax.tree.map(lambda a: np.asarray(rng.normal(size=a.shape) * 0.5, np.float32),
                             jax.eval_shape(model.init_variables, jax.random.key(0)))
    x, y = rng.normal(size=(8, 4)).astype(np.float32), rng.integers(0, 3, 8).astype(np.int32)
    clients = [np.arange(5), np.arange(5, 8), np.zeros(0, np.int64)]
    held = [(rng.normal(size=(h, 4)).astype(np.float32), rng.integers(0, 3, h).astype(np.int32)) for h in (4, 2, 3)]
    return model, variables, x, y, clients, pad_holdouts(held), held


def by_hand(variables, x, y, clients, held):
    """Each client alone: its copy of the global model trained with momentum SGD on its own batches (packed as
    the run packs them: its own seed [SEED, i]), then its held-out accuracy and loss in float64."""
    accuracy, loss = [], []
    for i, members in enumerate(clients):
        p = jax.tree.map(lambda a: np.array(a, np.float64), variables["params"])
        steps = max(1, packing.max_steps([len(c) for c in clients], BATCH, local_steps=None, local_epochs=EPOCHS))
        d = packing.pack_cohort(x, y, [members], batch_size=BATCH, num_steps=steps, local_epochs=EPOCHS, seed=SEED,
                                client_keys=[i])
        velocity = jax.tree.map(np.zeros_like, p)
        for s in range(steps):
            if d.step_mask[0, s]:
                grads = _narrow_grad(jax.tree.map(lambda a: a.astype(np.float32), p), d.x[0, s], d.y[0, s],
                                     d.example_mask[0, s].astype(np.float32), 1.0)
                velocity = jax.tree.map(lambda v, dg: MOMENTUM * v + np.asarray(dg), velocity, grads)
                p = jax.tree.map(lambda a, v: a - LR * v, p, velocity)
        hx, hy = held[i]
        h = np.maximum(hx @ p["fc1"]["kernel"] + p["fc1"]["bias"], 0)
        h = np.maximum(h @ p["fc2"]["kernel"] + p["fc2"]["bias"], 0)
        logits = h @ p["head"]["kernel"] + p["head"]["bias"]
        logp = logits - logits.max(1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(1, keepdims=True))
        accuracy.append(np.mean(logits.argmax(1) == hy))
        loss.append(-np.mean(logp[np.arange(len(hy)), hy]))
    return np.array(accuracy), np.array(loss)


@pytest.mark.parametrize("chunk", [3, 2])  # 2: the last chunk overlaps the first
def test_each_client_is_evaluated_with_its_own_fine_tuned_model(case, chunk):
    model, variables, x, y, clients, holdout, held = case
    got = evaluate_finetuned(model, variables, client_sgd(LR, MOMENTUM), x, y, clients, holdout, epochs=EPOCHS,
                             batch_size=BATCH, seed=SEED, chunk_size=chunk)
    accuracy, loss = by_hand(variables, x, y, clients, held)
    np.testing.assert_allclose(got["loss"], loss, rtol=1e-4)
    np.testing.assert_array_equal(got["accuracy"], accuracy)
    assert got["mean"] == pytest.approx(accuracy.mean())
    # Client 2 had nothing to train on: its model is the global one, whose loss differs from the tuned ones'.
    untouched, _ = by_hand(variables, x, y, [np.zeros(0, np.int64)] * 3, held)
    assert got["accuracy"][2] == untouched[2]


def test_a_fedbabu_simulation_evaluates_fine_tuned_models():
    """By name from the run configuration: the held-out split, and the fine-tuned models evaluated next to the
    global one (what every evaluated round records; here at the initial model, to compile no round); without
    fine-tuning the two are the same."""
    config = RunConfig(method="fedbabu", model="mlp", num_clients=4, cohort_size=2, rounds=1, local_steps=2,
                       batch_size=8, out_dir=None, partition="iid", options={"finetune_epochs": 1})
    sim = Simulation(config)
    tuned = sim.evaluate_personal()
    assert sim.train_fraction == 0.7 and tuned["personal_accuracy"] > tuned["global_client_accuracy"] + 0.2
    sim.method = sim.method.with_capabilities(finetune_epochs=0)
    untuned = sim.evaluate_personal()
    assert untuned["personal_accuracy"] == untuned["global_client_accuracy"] == tuned["global_client_accuracy"]
