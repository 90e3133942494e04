"""Evaluation after per-client fine-tuning, and the driver's choice between it and a method's own models.

A method whose :attr:`Capabilities.finetune_epochs <fedpartial._src.core.types.Capabilities>` is set
(FedBABU) is evaluated as its paper does: every client fine-tunes its copy of the current global model on
its own training data for that many epochs (the whole model, plain cross-entropy, the run's client
optimizer and batch size) and the fine-tuned model is evaluated on the client's held-out split.

The clients go a chunk at a time: their data is packed on the host, each client's batches from its own seed
(``[seed, client id]``, so they do not depend on the chunk), and one jitted call fine-tunes the chunk's
models with the engine's local training vmapped over the clients
(:func:`fedpartial._src.engine.local_training.train_models`) and evaluates each on its held-out examples.
The fine-tuned models are not kept; the global model is unchanged.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from fedpartial._src.core.losses import count_labels, model_loss
from fedpartial._src.core.population import broadcast_clients
from fedpartial._src.core.types import Batch, ClientOptimizer, MethodContext, PersonalModels
from fedpartial._src.data import packing
from fedpartial._src.engine import local_training
from fedpartial._src.experiment.evaluation import (
    CHUNK_BYTES_CPU,
    evaluate_clients,
    labels_per_client,
    summarize_clients,
)
from fedpartial._src.methods.base import make_method
from fedpartial._src.models.adapter import Model

#: what a fine-tuning step does: FedAvg's local step (the whole model, cross-entropy)
FINETUNE = make_method("finetune")
MAX_CHUNK = 64  # clients fine-tuned per call at most


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _finetune_and_evaluate(model: Model, optimizer: ClientOptimizer, batch_statistics: bool, global_vars, data,
                           keys, x, y, mask):
    """The chunk's fine-tuned models (from ``global_vars``) on their held-out ``x, y, mask``: loss sums and
    correct counts ``[C]``."""
    size = keys.shape[0]
    ctx = MethodContext(model=model, num_clients=size, cohort_size=size, batch_statistics=batch_statistics)
    tuned, _, _ = local_training.train_models(ctx, FINETUNE, optimizer, broadcast_clients(global_vars, size), data,
                                              keys, global_vars=global_vars, track_batch_stats=not batch_statistics)

    def one(variables, x_k, y_k, m_k):
        loss, correct = model_loss(model, variables, x_k, y_k, m_k, train=batch_statistics)
        return loss * count_labels(y_k, m_k), correct

    return jax.vmap(one)(tuned, x, y, mask)


def evaluate_finetuned(model: Model, global_vars: dict, optimizer: ClientOptimizer, x_train: np.ndarray,
                       y_train: np.ndarray, clients: list[np.ndarray], holdout: tuple, *, epochs: float,
                       batch_size: int, seed: int, batch_statistics: bool = False,
                       chunk_size: int | None = None) -> dict:
    """Every client's copy of ``global_vars`` fine-tuned for ``epochs`` on its training examples
    ``x_train[clients[i]]`` and evaluated on its held-out split ``holdout`` (``[N, H, ...]``,
    :func:`~fedpartial._src.experiment.evaluation.pad_holdouts`): the result of
    :func:`~fedpartial._src.experiment.evaluation.evaluate_clients`.

    ``seed``: the batches' shuffling (client ``i`` draws from ``[seed, i]``) and the local steps' keys.
    ``chunk_size``: clients per call (default: at most 64, their packed data and models within 64 MiB).
    """
    hx, hy, hmask = holdout
    n = len(clients)
    sizes = np.array([len(c) for c in clients])
    num_steps = max(1, packing.max_steps(np.unique(sizes), batch_size, local_steps=None, local_epochs=epochs))
    itemsize = x_train.dtype.itemsize if np.issubdtype(x_train.dtype, np.integer) else 4  # packed as float32
    per_client = num_steps * batch_size * itemsize * int(np.prod(x_train.shape[1:])) + 3 * sum(
        a.nbytes for a in jax.tree.leaves(global_vars))  # data, and the model with its gradient and momentum
    chunk = min(n, chunk_size or max(1, min(MAX_CHUNK, CHUNK_BYTES_CPU // per_client)))
    key = jax.random.key(seed)
    losses, corrects, done = [], [], 0
    while done < n:
        start = min(done, n - chunk)  # the last chunk overlaps instead of changing shape
        ids = np.arange(start, start + chunk)
        packed = packing.pack_cohort(x_train, y_train, [clients[i] for i in ids], batch_size=batch_size,
                                     num_steps=num_steps, local_epochs=epochs, seed=seed, client_keys=ids)
        data = Batch(packed.x, packed.y, packed.example_mask, packed.step_mask)
        keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.asarray(ids))
        loss, correct = _finetune_and_evaluate(model, optimizer, batch_statistics, global_vars, data, keys,
                                               hx[ids], hy[ids], hmask[ids])
        losses.append(np.asarray(loss)[done - start:])
        corrects.append(np.asarray(correct)[done - start:])
        done = start + chunk
    return summarize_clients(np.concatenate(losses), np.concatenate(corrects), labels_per_client(hy, hmask))


def evaluate_own_models(sim, batch_statistics: bool) -> dict:
    """A simulation's clients' own models on their held-out splits: the method's ``personal`` models, or the
    global model fine-tuned per client when the method asks for it (``Capabilities.finetune_epochs``)."""
    x, y, mask = sim.holdout
    epochs = sim.method.capabilities.finetune_epochs
    if not epochs:
        personal = sim.method.personal(sim.round.ctx, sim.method_state(), sim.state.variables)
        return evaluate_clients(sim.model, personal, x, y, mask, batch_statistics=batch_statistics)
    seed = int(np.random.default_rng([sim.config.seed, 0xF17E, sim.progress["round"]]).integers(2**31))
    optimizer = sim.finetune_optimizer if sim.finetune_optimizer is not None else sim.round.client_optimizer
    return evaluate_finetuned(sim.model, sim.state.variables, optimizer, sim.dataset.x_train,
                              sim.dataset.y_train, sim.clients, sim.holdout, epochs=epochs,
                              batch_size=sim.config.batch_size, seed=seed, batch_statistics=batch_statistics)


def evaluate_personal(sim) -> dict:
    """A simulation's clients' own models (fine-tuned first where the method asks: :func:`evaluate_own_models`) on
    their held-out splits, and the global model on the same splits: the ``personal_accuracy*`` and
    ``global_client_accuracy`` fields of a record."""
    x, y, mask = sim.holdout
    static = sim.config.bn_policy == "static"
    own = evaluate_own_models(sim, static)
    shared = evaluate_clients(sim.model, PersonalModels(variables=sim.state.variables, stacked=False),
                              x, y, mask, batch_statistics=static)
    return {"personal_accuracy": own["mean"], "personal_accuracy_std": own["std"],
            "personal_accuracy_min": own["min"], "personal_accuracy_max": own["max"],
            "global_client_accuracy": shared["mean"]}
