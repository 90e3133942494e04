"""MOON (Li, He & Song 2021): model-contrastive federated learning.

Each sampled client trains the global model on ``CE + μ · ℓ_con``, where for every
example the representation ``z`` of the local model is pulled towards the global
model's ``z_glob`` (positive) and pushed away from ``z_prev``, that of the
client's own model from its previous round (negative)::

    ℓ_con = −log( exp(sim(z, z_glob)/τ) / (exp(sim(z, z_glob)/τ) + exp(sim(z, z_prev)/τ)) )
          = softplus( (sim(z, z_prev) − sim(z, z_glob)) / τ )

with ``sim`` the cosine similarity and ``τ`` the temperature; ``ℓ_con`` is averaged
over the step's real examples.  The server aggregates as FedAvg.  Every client's
previous model is per-client state (``[N]``-stacked variables), written after it
trains.

**Projection head.**  ``z`` is the output of a projection head: MOON's network is
encoder → projection (``l1`` → ReLU → ``l2``, 256 wide) → classifier, the classifier
reading the projection.  The method's :attr:`~fedpartial._src.core.types.Method.adapt_model`
builds that network from the run's model
(:func:`fedpartial._src.models.heads.with_projection_head`; the encoder is every stage
but the classifier), and :class:`~fedpartial._src.experiment.simulation.Simulation` applies it to
the models it builds.  ``z`` is read as the classifier's input
(:func:`fedpartial._src.models.heads.classifier_input`) in the same forward pass that
gives the logits; on a model without a projection head (an engine built directly
with a plain model) that input is the penultimate representation — MOON's
"without projection head" variant.

Decisions:

* **First round of a client.**  A client that has never trained has no previous
  model, so there is no negative: as the reference (an empty model pool leaves only
  the positive logit, whose cross-entropy is 0) its ``ℓ_con`` is 0 and it trains on
  CE alone.  Whether a client has a previous model is tracked per client.
* **Previous model.**  The client's model as it last finished local training
  (the reference's model pool of size 1); a client not sampled keeps it unchanged.
* **Global and previous representations** come from those models in evaluation mode
  (as the reference's ``eval()`` copies; with the 'static' BatchNorm policy, batch
  statistics) and carry no gradient.
* **μ = 1** (the reference code's default, and the paper's choice for CIFAR-100 and
  Tiny-ImageNet; the paper tunes μ = 5 for CIFAR-10 — pass ``--moon-mu 5``),
  ``τ = 0.5`` and projection width 256 as in the paper.  Cosine similarity divides
  by ``max(||a||·||b||, 1e-8)``.
* The reported training loss is the cross-entropy alone.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedpartial._src.core.losses import label_weights, masked_cross_entropy
from fedpartial._src.core.structure import with_frozen, without_frozen
from fedpartial._src.methods.base import (
    Capabilities,
    InitView,
    LocalStep,
    LossAux,
    Method,
    MethodContext,
    MethodState,
    RoundView,
    broadcast_clients,
    cohort_rows,
    make_method,
    scatter_clients,
)
from fedpartial._src.methods.registry import MethodSpec, Option, above, at_least, check_values, positive_int
from fedpartial._src.models import heads

COSINE_EPS = 1e-8


class PreviousModel(NamedTuple):
    """One client's (or ``[N]`` clients') previous local model and whether it exists yet."""

    variables: dict
    exists: jax.Array  # bool


def cosine_similarity(a: jax.Array, b: jax.Array) -> jax.Array:
    """Row-wise cosine similarity of ``[B, D]`` arrays (the norm product floored at 1e-8)."""
    dot = jnp.sum(a * b, axis=-1)
    sq = jnp.sum(jnp.square(a), axis=-1) * jnp.sum(jnp.square(b), axis=-1)
    return dot / jnp.sqrt(jnp.maximum(sq, COSINE_EPS**2))


def contrastive_loss(z: jax.Array, z_glob: jax.Array, z_prev: jax.Array, temperature: float,
                     has_negative: jax.Array) -> jax.Array:
    """Per-example ``ℓ_con``; 0 where there is no negative (only the positive logit)."""
    gap = (cosine_similarity(z, z_prev) - cosine_similarity(z, z_glob)) / temperature
    return jnp.where(has_negative, jax.nn.softplus(gap), 0.0)


def moon(mu: float = 1.0, temperature: float = 0.5, projection_dim: int = 256) -> Method:
    """MOON with contrastive weight ``mu``, temperature ``temperature`` and a ``projection_dim``-wide head.

    Args:
      mu: the weight of the contrastive term.
      temperature: the contrastive softmax's temperature τ.
      projection_dim: the width of the projection head added to the model.

    Returns:
      The :class:`~fedpartial.Method` (``--method moon``).
    """
    check_values("moon", SPEC.options, mu=mu, temperature=temperature, projection_dim=projection_dim)

    def init(ctx: MethodContext, view: InitView) -> MethodState:
        return MethodState(clients=PreviousModel(variables=broadcast_clients(without_frozen(view.global_vars),
                                                                             ctx.num_clients),
                                                 exists=jnp.zeros((ctx.num_clients,), bool)))

    def representation(ctx: MethodContext, variables: dict, step: LocalStep) -> jax.Array:
        """``z`` of a fixed model (global or previous) on this step's examples, without gradient."""
        mask = step.batch.example_mask if ctx.batch_statistics else None

        def run():  # (a LoRA model's frozen base is held once, beside the global model)
            return ctx.model.apply(with_frozen(variables, step.global_vars), step.batch.x, ctx.batch_statistics, mask)

        return jax.lax.stop_gradient(heads.classifier_input(ctx.model, run)[0])

    def objective(ctx: MethodContext, params, step: LocalStep):
        z, (logits, stats) = heads.classifier_input(ctx.model, lambda: step.forward(params, step.batch.x))
        ce = masked_cross_entropy(logits, step.batch.y, step.batch.example_mask)
        previous: PreviousModel = step.client_state
        con = contrastive_loss(z, representation(ctx, step.global_vars, step),
                               representation(ctx, previous.variables, step), temperature, previous.exists)
        real = label_weights(step.batch.y, step.batch.example_mask)  # a language model's: one per position
        con = jnp.sum(con * real) / jnp.maximum(jnp.sum(real), 1.0)
        return ce + mu * con, LossAux(loss=ce, batch_stats=stats)

    def update(ctx: MethodContext, view: RoundView) -> MethodState:
        k = view.cohort.client_ids.shape[0]
        rows = PreviousModel(variables=view.trained_vars, exists=jnp.ones((k,), bool))
        clients = scatter_clients(view.method_state.clients, cohort_rows(view), rows, view.cohort.valid)
        return view.method_state._replace(clients=clients)

    def adapt_model(model):
        return heads.with_projection_head(model, dim=projection_dim)

    return make_method("moon", init=init, objective=objective, update=update, adapt_model=adapt_model,
                       capabilities=Capabilities(host_client_state=True))


SPEC = MethodSpec("moon", moon, "FedAvg plus a contrastive term: toward the global model, away from the previous one.",
                  options=(Option("mu", float, 1.0, "MOON: weight μ of the contrastive term", at_least(0.0),
                                  flag="--moon-mu"),
                           Option("temperature", float, 0.5, "MOON: temperature τ of the contrastive term",
                                  above(0, "must be a number > 0"), flag="--moon-tau"),
                           Option("projection_dim", int, 256, "MOON: width of the projection head",
                                  positive_int, flag="--moon-dim")))
