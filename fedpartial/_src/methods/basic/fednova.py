"""FedNova (Wang et al. 2020): average updates normalised by each client's effective number of local steps.

FedAvg weighs a client's update by its data share, so a client that takes more
local steps pulls the global model further and the federation converges to a
mixture of the clients' objectives weighted by their step counts.  FedNova
divides each client's cumulative update by ``a_i``, the norm of its local
aggregation vector, and rescales the average by ``τ_eff``::

    d_i   = (θ_g − θ_i) / a_i              the client's normalised update
    τ_eff = Σ_i p_i a_i                     p_i = w_i / Σ_cohort w   (w_i = n_i)
    θ_new = θ_g − τ_eff · Σ_i p_i d_i

``a_i`` follows the reference implementation (JYWa/FedNova, ``distoptim/FedNova.py``):
with heavy-ball momentum ρ, every local step does ``counter = ρ·counter + 1;
a_i += counter`` — in closed form ``a(τ) = Σ_{t=1..τ} (1 − ρ^t)/(1 − ρ)`` — and
without momentum ``a_i = τ_i``.  ``τ_i`` is the client's real number of local
steps this round (``RoundView.client_steps``: padded steps excluded), so clients
with more data or more epochs are normalised by more steps.

With equal steps and no momentum every ``a_i = τ``, ``τ_eff = τ`` and
``θ_new = Σ p_i θ_i``: FedAvg.

Decisions:

* **Momentum.**  ``a_i`` must use the momentum of the clients' optimizer, which the
  method cannot read from an optax transformation.  The factory takes ``momentum``
  and a run passes its own ``--momentum`` (``MethodSpec.run_settings``), so there is
  one setting, not two that could disagree.  Outside a run, give the same value as
  the client optimizer's: ``fednova(momentum=0.9)`` with ``optax.sgd(lr, momentum=0.9)``.
  Nesterov momentum is not modelled.
* **Weight decay** is part of the local gradient, as in the reference: it is inside
  ``θ_g − θ_i`` and does not change ``a_i``.  (The reference's ``(1 − ηµ)`` factor on
  ``a_i`` belongs to a FedProx proximal ``µ``, which this FedNova does not add.)
* **Server.**  ``θ_new`` is the method's :attr:`~fedpartial._src.core.types.Method.server_correct`
  step; the run's server optimizer then takes ``θ_g − θ_new`` as its pseudo-gradient
  (SGD with learning rate 1: ``θ_new``).  The reference's server momentum ``gmf`` is
  not built in.
* **Masks.**  ``Σ p_i d_i`` is the engine's aggregation formula applied to the
  ``d_i`` under the selection's upload masks and weights, so an element only some
  clients upload averages their normalised updates, and a method that changes the
  weights (e.g. FedDH's) changes the ``p_i``.
* **BatchNorm statistics** are aggregated as FedAvg does (they are not updates).
* **Traffic.**  ``d_i`` costs what ``θ_i`` costs; each client also uploads ``a_i``
  (4 bytes).  Each round reports ``tau_eff``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fedpartial._src.core import aggregation
from fedpartial._src.core.errors import UserError
from fedpartial._src.methods.base import Method, MethodContext, RoundView, Selection, make_method, upload_trained
from fedpartial._src.methods.registry import MethodSpec


def normalizer(steps: jax.Array, momentum: float) -> jax.Array:
    """``a_i`` of clients that took ``steps`` local SGD steps with heavy-ball ``momentum`` ρ.

    The reference accumulates ``counter = ρ·counter + 1; a += counter`` per step;
    summed, ``a(τ) = (τ − ρ(1 − ρ^τ)/(1 − ρ)) / (1 − ρ)``, and ``a(τ) = τ`` for ρ = 0.
    """
    tau = jnp.asarray(steps).astype(jnp.float32)
    if momentum == 0:
        return tau
    rho = jnp.float32(momentum)
    return (tau - rho * (1 - rho**tau) / (1 - rho)) / (1 - rho)


def _shares(view: RoundView) -> jax.Array:
    """``p_i``: the selection weights normalised over the cohort (padding clients weigh 0)."""
    w = view.selection.weights
    return w / jnp.maximum(jnp.sum(w), jnp.finfo(w.dtype).tiny)


def fednova(momentum: float = 0.0) -> Method:
    """FedNova for clients training with heavy-ball ``momentum`` (the client optimizer's; 0: plain SGD).

    Args:
      momentum: the client optimizer's heavy-ball momentum (0: plain SGD); a run passes its own ``--momentum``.

    Returns:
      The :class:`~fedpartial.Method` (``--method fednova``).
    """
    if not 0 <= momentum < 1:
        raise UserError(f"FedNova momentum = {momentum!r} must be the client optimizer's momentum, in [0, 1).")

    def select(ctx: MethodContext, view: RoundView) -> Selection:
        selection = upload_trained(ctx, view)
        return selection._replace(extra_upload_bytes=jnp.full_like(selection.extra_upload_bytes, 4))  # a_i

    def tau_eff(view: RoundView) -> jax.Array:
        return jnp.sum(_shares(view) * normalizer(view.client_steps, momentum))

    def server_correct(ctx: MethodContext, view: RoundView):
        g = view.global_vars["params"]
        a = normalizer(view.client_steps, momentum)
        a = jnp.where(a > 0, a, 1.0)  # a client with no steps uploads d_i = 0, not 0/0

        def normalised(theta, glob):
            return (glob[None] - theta) / a.reshape((-1,) + (1,) * glob.ndim).astype(theta.dtype)

        d = jax.tree.map(normalised, view.trained_vars["params"], g)
        zeros = jax.tree.map(jnp.zeros_like, g)
        mean_d, _ = aggregation.aggregate(ctx.structure, {"params": zeros}, {"params": d}, view.selection.upload,
                                          view.selection.weights, ("params",))
        step = tau_eff(view)
        return jax.tree.map(lambda glob, m: glob - step.astype(m.dtype) * m, g, mean_d["params"])

    def metrics(ctx: MethodContext, view: RoundView) -> dict:
        return {"tau_eff": tau_eff(view)}

    return make_method("fednova", select=select, server_correct=server_correct, metrics=metrics)


SPEC = MethodSpec("fednova", fednova,
                  "Normalised averaging: each update divided by its client's effective steps a_i, scaled by τ_eff.",
                  run_settings=("momentum",))
