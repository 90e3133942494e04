"""FedDH, FedJS and FedDHE (SPEC §5), and :func:`reweight`: any method's selection with their weights.

**FedDH** (dynamic heterogeneous aggregation, the paper's Algorithm 1).  Each
client's label distribution ``P_k`` is known to the server; ``P_m`` is the
``n_k``-weighted mean of all ``N`` of them (the population's label distribution)
and ``JS_k = JS(P_k || P_m)`` (Formula 5, natural logarithm).  The non-IID degree
is ``D_k = υ_k·JS_k + b_k`` (Formula 4, ``υ_k = 1``, ``b_k = 0`` initially) and the
cohort aggregates with ``q_k = (n_k / D_k) / Σ_j (n_j / D_j)`` (Formula 11; ``n_k``
is the wrapped method's own weight, ``n_k`` for every built-in method).  After the
aggregation, the cohort's ``(υ, b)`` take one gradient step (Formula 10)::

    υ ← υ − λ_Υ·decay_Υ^t · ∇_υ F(w(q(υ, b))),     b ← b − λ_B·decay_B^t · ∇_b F(w(q(υ, b)))

``w(q)`` is the engine's own aggregation (:func:`fedpartial._src.core.aggregation.aggregate`
with the round's upload masks), so the gradient is exact for any masks a wrapped
method uploads; ``F`` is the ``n_k``-weighted mean loss of ``w(q)`` on the first
local batch of every cohort client (its real examples only), and ``jax.grad``
differentiates through the aggregation.  ``t`` is the round index (0 first).

**FedJS** is the paper's ablation: ``q_k ∝ n_k / JS_k``, never learned.

**FedDHE** estimates ``P_k`` on the server instead of receiving it (Formula 8):
on a small class-balanced server set, ``s_i = ||∇L_i(θ_k)||²`` is the squared norm
of the gradient of the mean loss over the server's class-``i`` examples at client
``k``'s trained model, and ``P̂_k(i) ∝ exp(β·s_i)``.

Decisions (where the paper is vague, or where we depart from the authors' code):

* **D_k > 0.**  ``D_k = max(υ_k·JS_k + b_k, min_degree)`` (``min_degree = 1e-3``).
  The paper's linear form holds wherever it is positive; the floor only guards a
  client whose distribution equals the population's (``JS_k = 0`` at ``b_k = 0``)
  or whose ``(υ, b)`` would make ``D_k ≤ 0``.  At the floor ``D_k`` stops depending
  on ``(υ_k, b_k)`` (zero gradient): such a client already weighs the most a
  client can.  A softplus reparametrisation was not used because it changes
  Formula 4 everywhere, not only where it breaks.
* **The gradient.**  Plain gradient steps with the paper's learning rates and
  multiplicative decays (Table 5; defaults are its LeNet/CIFAR-10 column:
  ``λ_Υ = 1e-4``, ``decay_Υ = 0.999``, ``λ_B = 1e-4``, ``decay_B = 0.99``).  The
  authors' public code min-max normalises the gradients and takes their
  ``abs()``; we follow the paper's Formula 10 and do neither.
* **What F is.**  Formula 3's ``F = Σ n_k F_k / Σ n_k`` over the cohort (the paper:
  "only based on the selected devices"), each ``F_k`` on the client's first local
  batch of the round, in evaluation mode (running statistics; batch statistics
  under the 'static' BatchNorm policy).  We differentiate the aggregate itself:
  before a wrapped method's ``server_correct`` (FedNova, FedDyn) and before the
  server optimizer (with FedAvg's SGD(1) the two are the same).
* **No test data, no rollbacks.**  The authors' code hard-codes 10 clients per
  round and drops clients and rolls rounds back by looking at the test loss.
  Here the cohort size is the run's, every sampled client is aggregated, and
  nothing ever reads test data.
* **Label distributions** reach ``init`` as ``InitView.label_counts`` (``[N, C]``;
  :class:`~fedpartial._src.experiment.simulation.Simulation` counts each client's training
  split).  Reporting them once costs no per-round traffic and is not counted.
* **FedDHE, "once at the start".**  The paper estimates ``P_k`` from the updated
  model of device ``k`` once, at the beginning.  A client's trained model exists
  only once it has trained, so ``P̂_k`` is estimated in the first round the client
  takes part (from the model it trained in that round, before that round's
  aggregation, whose weights already use it) and cached; later rounds reuse it.
  ``P_m`` is the ``n_k``-weighted mean of the estimates known so far (the server
  knows ``n_k`` as in FedAvg).  The true label counts are never read.
* **FedDHE's sign.**  SPEC §5 writes ``P_k(i) ∝ exp(β·||∇L_i||²)``; the paper's
  Formula 8 reads ``exp(β / ||∇L_i||²)``.  A client fits the classes it holds
  many of, so their gradient is *small*: both forms put the mass there only with
  the right sign of β.  We keep SPEC's form (bounded exponents: no overflow when a
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

**Composing** (:func:`reweight`).  A :class:`Weighting` is three pure functions
(``init``, ``weights``, ``update``), like an optax transformation: it states
nothing about local training or masks.  ``reweight(method, weighting)`` is
``method`` — its plan, local training, upload masks — aggregated with the
weighting's weights; the two states sit side by side in ``MethodState`` and
neither knows of the other::

    from fedpartial._src.methods.basic.fedavg import fedavg
    from fedpartial._src.methods.layerwise.fedldf import fedldf
    from fedpartial._src.methods.submodel.fedspu import fedspu
    from fedpartial._src.methods.weighting.feddh import feddh_weighting, fedjs_weighting, reweight

    feddh = reweight(fedavg(), feddh_weighting())                # FedDH itself
    ldf_dh = reweight(fedldf(n=4), feddh_weighting())            # FedLDF's top-n layers, FedDH's weights
    spu_js = reweight(fedspu(), fedjs_weighting())               # FedSPU's active neurons, static JS weights

With every ``D_k`` equal the weights are ``n_k`` (up to a common factor) and
``reweight(method, …)`` aggregates exactly as ``method``.  The command line has
``feddh``, ``fedjs`` and ``feddhe`` (over FedAvg); a ``--weighting`` flag for any
method is not offered: registry options belong to one method each, and a
wrapper would need the wrapped method's options too.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedpartial._src.core import aggregation
from fedpartial._src.core.errors import UserError
from fedpartial._src.core.losses import model_loss
from fedpartial._src.methods.base import (
    Carry,
    InitView,
    Method,
    MethodContext,
    MethodState,
    RoundView,
    Selection,
    ServerData,
    scatter_clients,
)
from fedpartial._src.methods.basic.fedavg import fedavg
from fedpartial._src.methods.registry import MethodSpec, Option, at_least, check_values, positive_int
from fedpartial._src.methods.wrappers import Wrapper, wrap

#: smallest non-IID degree a client can have (see the module docstring)
MIN_DEGREE = 1e-3

# ---- the combinator --------------------------------------------------------------------------


class Weighting(NamedTuple):
    """Aggregation weights as a piece that composes with any method (see :func:`reweight`).

    Attributes:
      name: appended to the wrapped method's name.
      init: ``(ctx, InitView) -> MethodState``: the weighting's own state (per-client
        rows ``[N]`` in ``clients``).
      weights: ``(ctx, RoundView) -> [K]`` weights, called in ``select``;
        ``view.selection`` is the wrapped method's selection, ``view.method_state``
        and ``view.client_state`` are the weighting's own.  It may return
        ``Carry(weights, value)``: its ``update`` and ``metrics`` read ``view.carried["select"]``.
      update: ``(ctx, RoundView) -> MethodState``, called after aggregation;
        ``view.selection`` is the final selection (upload masks, these weights).
      metrics: ``(ctx, RoundView) -> dict`` of per-round values, or None.
      server_examples_per_class: the server set the weighting needs (0: none).
    """

    name: str
    init: Callable[[MethodContext, InitView], MethodState]
    weights: Callable[[MethodContext, RoundView], jax.Array]
    update: Callable[[MethodContext, RoundView], MethodState]
    metrics: Callable[[MethodContext, RoundView], dict] | None = None
    server_examples_per_class: int = 0


def reweight(method: Method, weighting: Weighting, name: str | None = None) -> Method:
    """``method`` aggregated with ``weighting``'s weights instead of its own.

    Everything else is ``method``'s: plan, local training, upload masks, its server
    steps (``aggregate`` and ``server_correct``, which see the new weights), personal models, who
    may be sampled.  A :class:`~fedpartial._src.methods.wrappers.Wrapper` adding to ``select``, ``update``
    and ``metrics``: the state is ``MethodState(server=(method's, weighting's), clients=(method's,
    weighting's))``; each piece sees only its own.

    Example::

        from fedpartial._src.methods.layerwise.fedldf import fedldf
        from fedpartial._src.methods.weighting.feddh import feddh_weighting, reweight

        method = reweight(fedldf(n=4), feddh_weighting())   # name 'fedldf+feddh'
    """

    def select(ctx: MethodContext, view: RoundView, own: Selection) -> Selection | Carry:
        weights = weighting.weights(ctx, view._replace(selection=own))
        if isinstance(weights, Carry):  # handed on to the weighting's update and metrics
            return Carry(own._replace(weights=weights.result), weights.value)
        return own._replace(weights=weights)

    def update(ctx: MethodContext, view: RoundView, inner_state: MethodState) -> MethodState:
        return weighting.update(ctx, view)

    def metrics(ctx: MethodContext, view: RoundView, inner: dict | None) -> dict:
        return {**(inner or {}), **weighting.metrics(ctx, view)}

    hooks = {"select": select, "update": update, **({"metrics": metrics} if weighting.metrics else {})}
    return wrap(method, Wrapper(
        lambda inner: name or f"{inner}+{weighting.name}", init=weighting.init, hooks=hooks, label=weighting.name,
        # the weighting reads every client's trained model and, in its update, every client's label distribution
        capabilities=lambda caps: caps._replace(
            server_examples_per_class=max(caps.server_examples_per_class, weighting.server_examples_per_class),
            streamable=None, host_client_state=False)))


# ---- label distributions and the non-IID degree ----------------------------------------------


def kl_divergence(p: jax.Array, q: jax.Array) -> jax.Array:
    """``Σ_y p(y)·log(p(y)/q(y))`` over the last axis (``0·log 0 = 0``; ``q > 0`` where ``p > 0``)."""
    safe_p = jnp.where(p > 0, p, 1.0)
    safe_q = jnp.where(p > 0, q, 1.0)
    return jnp.sum(jnp.where(p > 0, p * jnp.log(safe_p / safe_q), 0.0), axis=-1)


def js_divergence(p: jax.Array, q: jax.Array) -> jax.Array:
    """Jensen–Shannon divergence (Formula 5): ``½KL(p||m) + ½KL(q||m)``, ``m = ½(p + q)``; in ``[0, ln 2]``."""
    m = 0.5 * (p + q)
    return 0.5 * kl_divergence(p, m) + 0.5 * kl_divergence(q, m)


def population_distribution(distributions: jax.Array, num_samples: jax.Array, known: jax.Array) -> jax.Array:
    """``P_m``: the ``n_k``-weighted mean of the known clients' distributions ``[N, C] -> [C]``."""
    w = jnp.where(known, num_samples, 0.0)
    return jnp.tensordot(w, distributions, axes=(0, 0)) / jnp.maximum(jnp.sum(w), 1e-12)


def non_iid_degree(js: jax.Array, upsilon: jax.Array, b: jax.Array, min_degree: float = MIN_DEGREE) -> jax.Array:
    """``D_k = max(υ_k·JS_k + b_k, min_degree)`` (Formula 4, kept strictly positive)."""
    return jnp.maximum(upsilon * js + b, min_degree)


def degree_weights(base: jax.Array, degree: jax.Array, valid: jax.Array) -> jax.Array:
    """``q_k = (base_k / D_k) / Σ_j (base_j / D_j)`` over the valid clients (Formula 11); 0 elsewhere."""
    raw = jnp.where(valid, base / degree, 0.0)
    return raw / jnp.maximum(jnp.sum(raw), 1e-30)


class DegreeState(NamedTuple):
    """Per client ``[N]``: control parameters ``υ``, ``b``; label distribution ``[N, C]``, ``n_k``, and
    whether the distribution is known yet (always, for FedDH; after its first round, for FedDHE)."""

    upsilon: jax.Array
    b: jax.Array
    distribution: jax.Array
    num_samples: jax.Array
    known: jax.Array


def _label_distributions(name: str):
    """``init`` of the distribution state from ``InitView.label_counts`` (FedDH, FedJS)."""

    def init(ctx: MethodContext, view: InitView) -> DegreeState:
        counts = view.label_counts
        if counts is None:
            raise UserError(f"{name} needs every client's label counts ([N, C]: FederatedRound(label_counts=...), "
                            "which Simulation passes), but none were given.")
        expected = (ctx.num_clients, ctx.model.num_classes)
        if tuple(np.shape(counts)) != expected:
            raise UserError(f"{name}: label counts have shape {tuple(np.shape(counts))}, but the run needs "
                            f"{expected} (clients × classes).")
        if isinstance(counts, np.ndarray) and (counts < 0).any():
            raise UserError(f"{name}: label counts must be ≥ 0, got a smallest count of {counts.min()}.")
        counts = jnp.asarray(counts, jnp.float32)
        n = jnp.sum(counts, axis=1)
        return DegreeState(upsilon=jnp.ones_like(n), b=jnp.zeros_like(n),
                           distribution=counts / jnp.maximum(n, 1.0)[:, None], num_samples=n,
                           known=jnp.ones(n.shape, bool))

    return init


def group_by_class(server: ServerData, num_classes: int, name: str = "feddhe") -> ServerData:
    """The server set laid out by class, ``x [C, m, ...]``, ``y [C, m]`` (host work, once).

    Raises UserError unless every class has the same number ``m ≥ 1`` of examples.
    """
    x, y = np.asarray(server.x), np.asarray(server.y)
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


def _estimated_distributions(name: str, beta: float):
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
            return jax.vmap(lambda v: estimate_distribution(ctx, v, server, beta))(trained)

        # Only a round with a new client pays for the estimate (a Python-free branch on array data).
        fresh = jax.lax.cond(jnp.any(new), estimate, lambda _: jnp.zeros((k, c), jnp.float32), view.trained_vars)
        filled = rows._replace(distribution=jnp.where(new[:, None], fresh, rows.distribution),
                               num_samples=jnp.where(new, view.cohort.num_samples, rows.num_samples),
                               known=rows.known | view.cohort.valid)
        return scatter_clients(view.method_state.clients, view.cohort.client_ids, filled, view.cohort.valid)

    return init, fill


# ---- the FedDH weighting ---------------------------------------------------------------------


def global_loss(ctx: MethodContext, view: RoundView, weights: jax.Array) -> jax.Array:
    """``F(w(q))``: the ``n_k``-weighted mean loss of the model aggregated with ``weights`` ``[K]`` under the
    round's upload masks, on every valid cohort client's first local batch (its real examples)."""
    collections = ("params",) if ctx.batch_statistics else ("params", "batch_stats")
    aggregated, _ = aggregation.aggregate(ctx.structure, view.global_vars, view.trained_vars,
                                          view.selection.upload, weights, collections)
    data = view.data

    def client_loss(x, y, example_mask):
        return model_loss(ctx.model, aggregated, x, y, example_mask, train=ctx.batch_statistics)[0]

    losses = jax.vmap(client_loss)(data.x[:, 0], data.y[:, 0], data.example_mask[:, 0])
    n = jnp.where(view.cohort.valid, view.cohort.num_samples, 0.0)
    return jnp.sum(n * losses) / jnp.maximum(jnp.sum(n), 1e-12)


def control_gradients(ctx: MethodContext, view: RoundView, js: jax.Array, base: jax.Array,
                      min_degree: float = MIN_DEGREE) -> tuple[jax.Array, jax.Array]:
    """``(∇_υ F, ∇_b F)`` ``[K]`` at the cohort's current ``(υ, b)`` (``view.client_state``), through the
    aggregation: ``F(w(q(υ, b)))`` with ``q = degree_weights(base, D(υ, b))``."""
    rows: DegreeState = view.client_state

    def loss(upsilon, b):
        return global_loss(ctx, view, degree_weights(base, non_iid_degree(js, upsilon, b, min_degree),
                                                     view.cohort.valid))

    return jax.grad(loss, argnums=(0, 1))(rows.upsilon, rows.b)


def feddh_weighting(lr_upsilon: float = 1e-4, decay_upsilon: float = 0.999, lr_b: float = 1e-4,
                    decay_b: float = 0.99, *, estimate_beta: float | None = None, server_examples: int = 10,
                    min_degree: float = MIN_DEGREE, name: str = "feddh") -> Weighting:
    """FedDH's weights ``q_k ∝ n_k / D_k`` with ``D_k = υ_k·JS_k + b_k`` learned after every aggregation.

    Args:
      lr_upsilon, decay_upsilon, lr_b, decay_b: Formula 10's learning rates and their
        multiplicative per-round decays (both rates 0: nothing is learned — FedJS).
      estimate_beta: None: ``P_k`` from the label counts given to ``init`` (FedDH).  A
        negative number: ``P_k`` estimated on the server with this β (FedDHE).
      server_examples: FedDHE's server set, examples per class.
      min_degree: the floor that keeps ``D_k`` positive.
    """
    # the options describe the arguments: called directly, the factory checks them there (one sentence each)
    check_values(name, (*RATE_OPTIONS, *ESTIMATE_OPTIONS), lr_upsilon=lr_upsilon, decay_upsilon=decay_upsilon,
                 lr_b=lr_b, decay_b=decay_b,
                 **({} if estimate_beta is None else {"beta": estimate_beta, "server_examples": server_examples}))
    if not min_degree > 0:
        raise UserError(f"{name}: min_degree = {min_degree!r} must be > 0 (it keeps D_k positive).")
    learns = lr_upsilon > 0 or lr_b > 0
    if estimate_beta is None:
        init, fill, per_class = _label_distributions(name), None, 0
    else:
        init, fill = _estimated_distributions(name, float(estimate_beta))
        per_class = int(server_examples)

    def init_state(ctx: MethodContext, view: InitView) -> MethodState:
        state = init(ctx, view)
        # FedDHE keeps the server set it estimates on; FedDH needs nothing server-side.
        server = () if fill is None else group_by_class(view.server_data, ctx.model.num_classes, name)
        return MethodState(server=server, clients=state)

    def cohort_js(ctx: MethodContext, view: RoundView) -> tuple[jax.Array, DegreeState]:
        """``JS_k`` ``[K]`` of the cohort against ``P_m``, and the population state it used."""
        population = view.method_state.clients if fill is None else fill(ctx, view, view.method_state.server)
        p_m = population_distribution(population.distribution, population.num_samples, population.known)
        rows = jax.tree.map(lambda a: a[view.cohort.client_ids], population)
        return js_divergence(rows.distribution, p_m[None, :]), population

    def weights(ctx: MethodContext, view: RoundView) -> Carry:
        """The weights, handing the cohort's JS divergences and the population state on (FedDHE's estimate is
        made once a round)."""
        js, population = cohort_js(ctx, view)
        rows: DegreeState = view.client_state
        degree = non_iid_degree(js, rows.upsilon, rows.b, min_degree)
        return Carry(degree_weights(view.selection.weights, degree, view.cohort.valid), (js, population))

    def update(ctx: MethodContext, view: RoundView) -> MethodState:
        js, population = view.carried["select"]
        if not learns:
            return view.method_state._replace(clients=population)
        rows: DegreeState = view.client_state
        degree = non_iid_degree(js, rows.upsilon, rows.b, min_degree)
        # The wrapped method's weights, up to a common factor: q_k·D_k (the engine zeroed padding clients).
        base = jax.lax.stop_gradient(view.selection.weights * degree)
        g_upsilon, g_b = control_gradients(ctx, view, js, base, min_degree)
        t = view.round.astype(jnp.float32)
        stepped = DegreeState(
            upsilon=rows.upsilon - lr_upsilon * decay_upsilon ** t * g_upsilon,
            b=rows.b - lr_b * decay_b ** t * g_b,
            distribution=population.distribution[view.cohort.client_ids],
            num_samples=population.num_samples[view.cohort.client_ids],
            known=population.known[view.cohort.client_ids])
        clients = scatter_clients(population, view.cohort.client_ids, stepped, view.cohort.valid)
        return view.method_state._replace(clients=clients)

    def metrics(ctx: MethodContext, view: RoundView) -> dict:
        js, _ = view.carried["select"]
        rows: DegreeState = view.client_state
        return {"aggregation_weights": view.selection.weights,
                "non_iid_degree": non_iid_degree(js, rows.upsilon, rows.b, min_degree)}

    return Weighting(name=name, init=init_state, weights=weights, update=update, metrics=metrics,
                     server_examples_per_class=per_class)


def fedjs_weighting(min_degree: float = MIN_DEGREE) -> Weighting:
    """FedJS: static ``q_k ∝ n_k / JS_k`` (``υ = 1``, ``b = 0`` never learned)."""
    return feddh_weighting(0.0, 1.0, 0.0, 1.0, min_degree=min_degree, name="fedjs")


def feddhe_weighting(beta: float = -0.03, server_examples: int = 10, lr_upsilon: float = 1e-4,
                     decay_upsilon: float = 0.999, lr_b: float = 1e-4, decay_b: float = 0.99) -> Weighting:
    """FedDHE: FedDH with ``P_k`` estimated on the server from each client's trained model."""
    return feddh_weighting(lr_upsilon, decay_upsilon, lr_b, decay_b, estimate_beta=beta,
                           server_examples=server_examples, name="feddhe")


# ---- the registered methods ------------------------------------------------------------------


def feddh(lr_upsilon: float = 1e-4, decay_upsilon: float = 0.999, lr_b: float = 1e-4,
          decay_b: float = 0.99) -> Method:
    """FedDH: FedAvg aggregated with learned non-IID-degree weights."""
    return reweight(fedavg(), feddh_weighting(lr_upsilon, decay_upsilon, lr_b, decay_b), name="feddh")


def fedjs() -> Method:
    """FedJS: FedAvg aggregated with static ``n_k / JS_k`` weights."""
    return reweight(fedavg(), fedjs_weighting(), name="fedjs")


def feddhe(beta: float = -0.03, server_examples: int = 10, lr_upsilon: float = 1e-4, decay_upsilon: float = 0.999,
           lr_b: float = 1e-4, decay_b: float = 0.99) -> Method:
    """FedDHE: FedDH with label distributions estimated on the server."""
    return reweight(fedavg(), feddhe_weighting(beta, server_examples, lr_upsilon, decay_upsilon, lr_b, decay_b),
                    name="feddhe")


def _decay(v: Any) -> str | None:
    return None if isinstance(v, numbers.Real) and not isinstance(v, bool) and 0 < v <= 1 \
        else "must be a multiplicative decay in (0, 1]"


def _negative(v: Any) -> str | None:
    return None if isinstance(v, numbers.Real) and not isinstance(v, bool) and v < 0 else "must be a number < 0"


RATE_OPTIONS = (
    Option("lr_upsilon", float, 1e-4, "FedDH: learning rate λ_Υ of the control parameters υ", at_least(0.0),
           flag="--dh-lr-upsilon"),
    Option("decay_upsilon", float, 0.999, "FedDH: per-round multiplicative decay of λ_Υ", _decay,
           flag="--dh-decay-upsilon"),
    Option("lr_b", float, 1e-4, "FedDH: learning rate λ_B of the control parameters b", at_least(0.0),
           flag="--dh-lr-b"),
    Option("decay_b", float, 0.99, "FedDH: per-round multiplicative decay of λ_B", _decay, flag="--dh-decay-b"),
)
#: FedDHE's options (the factory's ``beta`` is the weighting's ``estimate_beta``)
ESTIMATE_OPTIONS = (
    Option("beta", float, -0.03, "FedDHE: β of P_k(i) ∝ exp(β·||∇L_i||²)", _negative, flag="--dhe-beta"),
    Option("server_examples", int, 10, "FedDHE: server examples per class", positive_int,
           flag="--dhe-server-examples"),
)
SPECS = (
    MethodSpec("feddh", feddh, "FedAvg weighted by n_k / D_k, D_k = υ_k·JS_k + b_k learned through the aggregation.",
               RATE_OPTIONS),
    MethodSpec("fedjs", fedjs, "FedAvg weighted by n_k / JS_k (static JS divergence of each client's labels)."),
    MethodSpec("feddhe", feddhe, "FedDH with label distributions estimated on the server from client models.",
               (*ESTIMATE_OPTIONS, *RATE_OPTIONS)),
)
