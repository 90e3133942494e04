"""FedDHE's server-side estimate of the clients' label distributions (docs/decisions.md#feddhad, Formula 8).

On a small class-balanced server set, ``s_i = ||∇L_i(θ_k)||²`` is the squared norm
of the gradient of the mean loss over the server's class-``i`` examples at client
``k``'s trained model, and ``P̂_k(i) ∝ exp(β·s_i)``
(:func:`estimate_distribution`); the weighting itself is FedDH's
(:func:`fedpartial._src.methods.weighting.feddh.feddhe_weighting`).

Decisions:

* **FedDHE, "once at the start".**  The paper estimates ``P_k`` from the updated
  model of device ``k`` once, at the beginning.  A client's trained model exists
  only once it has trained, so ``P̂_k`` is estimated in the first round the client
  takes part (from the model it trained in that round, before that round's
  aggregation, whose weights already use it) and cached; later rounds reuse it.
  ``P_m`` is the ``n_k``-weighted mean of the estimates known so far (the server
  knows ``n_k`` as in FedAvg).  The true label counts are never read.
* **FedDHE's sign.**  docs/decisions.md#feddhad writes ``P_k(i) ∝ exp(β·||∇L_i||²)``; the paper's
  Formula 8 reads ``exp(β / ||∇L_i||²)``.  A client fits the classes it holds
  many of, so their gradient is *small*: both forms put the mass there only with
  the right sign of β.  We keep the decisions page's form (bounded exponents: no overflow when a
  gradient vanishes) and require ``β < 0``.  ``L_i`` is the mean cross-entropy of
  the class-``i`` server examples (evaluation mode) and the norm runs over all
  parameters.  The paper gives no β; the default ``-0.03`` is the best of a sweep
  on the offline digits data (cnn2c1f, Dirichlet 0.5, 10 clients each trained 20
  local steps from the initial model, 10 server examples per class: mean
  ``JS(P̂_k || P_k)`` 0.044 against 0.169 for a uniform guess; the paper's
  ``exp(β/s)`` reached 0.159 at best).  β is scale-dependent (squared norms ranged
  from 0.2 to 100 there): tune it per model.  The per-class gradients of the whole
  cohort are computed at once (memory ``K × C ×`` the model's parameters), only in
  rounds with a new client.  FedDHE learns ``(υ, b)`` exactly as FedDH.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fedpartial._src.core.errors import UserError
from fedpartial._src.core.losses import model_loss
from fedpartial._src.core.structure import with_frozen
from fedpartial._src.methods.base import InitView, MethodContext, RoundView, ServerData, scatter_clients
from fedpartial._src.methods.weighting.degrees import DegreeState


def group_by_class(server: ServerData, num_classes: int, name: str = "feddhe") -> ServerData:
    """The server set laid out by class, ``x [C, m, ...]``, ``y [C, m]`` (host work, once).

    Raises UserError unless every class has the same number ``m ≥ 1`` of examples.
    """
    x, y = np.asarray(server.x), np.asarray(server.y)
    if y.ndim != 1:
        raise UserError(f"{name} estimates label distributions on a server set with one label per example, but "
                        f"its labels have shape {list(y.shape)} (one per position, a language model's); use "
                        "feddh, which counts the clients' labels instead.")
    counts = np.bincount(y, minlength=num_classes) if y.size else np.zeros(num_classes, int)
    if len(counts) != num_classes or counts.min() < 1 or counts.min() != counts.max():
        raise UserError(f"{name}: the server set must hold the same number (≥ 1) of examples of each of the "
                        f"{num_classes} classes, but holds {counts.tolist()}.")
    order = np.argsort(y, kind="stable")
    m = int(counts[0])
    return ServerData(jnp.asarray(x[order].reshape((num_classes, m) + x.shape[1:])),
                      jnp.asarray(y[order].reshape(num_classes, m)))


def class_gradient_norms(ctx: MethodContext, variables: dict, by_class: ServerData) -> jax.Array:
    """``[C]``: ``||∇L_i(θ)||²``, the squared norm (over all parameters) of the gradient of the mean loss
    ``L_i`` over the server's class-``i`` examples (evaluation mode); ``by_class`` from :func:`group_by_class`.

    ``L_i`` depends only on class ``i``'s examples, so each gradient costs one small
    batch; the classes are vmapped (memory: ``C ×`` the model's parameters).
    """

    def squared_norm(x, y):
        def loss(params):
            return model_loss(ctx.model, {**variables, "params": params}, x, y, jnp.ones(y.shape, bool),
                              train=ctx.batch_statistics)[0]

        grads = jax.grad(loss)(variables["params"])
        return sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads))

    return jax.vmap(squared_norm)(by_class.x, by_class.y)


def estimate_distribution(ctx: MethodContext, variables: dict, by_class: ServerData, beta: float) -> jax.Array:
    """FedDHE's ``P̂_k(i) ∝ exp(β·||∇L_i(θ_k)||²)`` ``[C]`` from one client's trained model."""
    return jax.nn.softmax(beta * class_gradient_norms(ctx, variables, by_class))


def estimated_distributions(name: str, beta: float):
    """``init`` (nothing known) and ``fill`` (estimate new cohort clients) of FedDHE's distribution state."""

    def init(ctx: MethodContext, view: InitView) -> DegreeState:
        if view.server_data is None:
            raise UserError(f"{name} needs a class-balanced server set (InitView.server_data; Simulation builds one "
                            "from the method's server_examples_per_class), but none was given.")
        n, c = ctx.num_clients, ctx.model.num_classes
        return DegreeState(upsilon=jnp.ones((n,), jnp.float32), b=jnp.zeros((n,), jnp.float32),
                           distribution=jnp.zeros((n, c), jnp.float32), num_samples=jnp.zeros((n,), jnp.float32),
                           known=jnp.zeros((n,), bool))

    def fill(ctx: MethodContext, view: RoundView, server: ServerData) -> DegreeState:
        """The population state with every valid cohort client's distribution known (estimated if new)."""
        rows: DegreeState = view.client_state
        new = view.cohort.valid & ~rows.known
        k, c = new.shape[0], ctx.model.num_classes

        def estimate(trained):
            # (a LoRA model's frozen base is held once, beside every client's trained parts)
            return jax.vmap(lambda v: estimate_distribution(ctx, with_frozen(v, view.global_vars), server, beta))(
                trained)

        # Only a round with a new client pays for the estimate (a Python-free branch on array data).
        fresh = jax.lax.cond(jnp.any(new), estimate, lambda _: jnp.zeros((k, c), jnp.float32), view.trained_vars)
        filled = rows._replace(distribution=jnp.where(new[:, None], fresh, rows.distribution),
                               num_samples=jnp.where(new, view.cohort.num_samples, rows.num_samples),
                               known=rows.known | view.cohort.valid)
        return scatter_clients(view.method_state.clients, view.cohort.client_ids, filled, view.cohort.valid)

    return init, fill
