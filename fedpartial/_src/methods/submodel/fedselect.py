"""FedSelect — a growing personal part chosen by how much it changed (docs/decisions.md#fedspu baseline).

The decision (docs/decisions.md#fedspu): per-client selection of the most-changed parameters as
personal, starting at keep 0.25 and growing to 0.5 over training.  Our reading, at neuron granularity so
masks stay structured:

* The personal fraction ``f_t`` ramps linearly from ``start`` (first round) to
  ``end`` (last planned round); it replaces the tiers (the paper sets FedSelect's
  ``p_k`` to 0.25 → 0.5 for everyone).
* In every layer but the classifier, a client's personal neurons are its
  ``max(1, round(f_t·u))`` neurons whose parameters changed most (L2 norm of the
  update) in its last local training.  A client that never trained has no
  personal part yet.
* A personal neuron's parameters (its whole kernel column, bias, BatchNorm) keep
  the client's own values: they are not overwritten by the global model and not
  uploaded.  Everything else is received from the global model and uploaded.
* The client trains its whole full-width model (FedSelect is not a dropout: it
  trains and holds the full model, so its memory is full-model training's).
* The client tells the server which neurons it keeps (index cost on upload).

The personal model evaluated is the client's last trained model.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedpartial._src.costs import footprint as costs
from fedpartial._src.core import masks
from fedpartial._src.methods import selection
from fedpartial._src.methods.submodel import common as submodel
from fedpartial._src.methods.base import (
    Capabilities,
    ClientPlan,
    InitView,
    Method,
    MethodContext,
    MethodState,
    PersonalModels,
    RoundView,
    Selection,
    cohort_rows,
    make_method,
    scatter_clients,
)
from fedpartial._src.methods.registry import MethodSpec, Option, in_unit_interval


class FedSelectState(NamedTuple):
    """Per client ``[N]``: its model, its last update's per-neuron norms, whether it trained."""

    variables: dict
    change: tuple[jax.Array, ...]
    trained: jax.Array


def _complement(mask: masks.Mask) -> masks.Mask:
    """The other neurons of every layer (personal ↔ shared)."""
    return mask._replace(neurons=tuple(~n for n in mask.neurons))


def fedselect(start: float = 0.25, end: float = 0.5) -> Method:
    """FedSelect with the personal fraction growing from ``start`` to ``end`` over the run.

    Args:
      start: the personal fraction of every layer in the first round, in [0, 1].
      end: the personal fraction in the last round, at least ``start``.

    Returns:
      The :class:`~fedpartial.Method` (``--method fedselect``).
    """
    submodel.check_tiers("fedselect", (start, end))

    def init(ctx: MethodContext, view: InitView) -> MethodState:
        n = ctx.num_clients
        return MethodState(clients=FedSelectState(
            variables=submodel.stack_population(ctx, view.global_vars),
            change=tuple(jnp.zeros((n, u), jnp.float32) for u in ctx.structure.units),
            trained=jnp.zeros((n,), bool),
        ))

    def personal_neurons(ctx: MethodContext, view: RoundView) -> masks.Mask:
        k = view.cohort.num_samples.shape[0]
        counts = submodel.broadcast_counts(
            submodel.schedule_counts(ctx.structure, start, end, ctx.rounds, view.round), k)
        state = view.client_state
        chosen = submodel.strongest_neurons(state.change, counts)
        chosen = tuple(c & state.trained[:, None] for c in chosen)
        chosen = (*chosen[:-1], jnp.zeros_like(chosen[-1]))  # the classifier stays shared
        return masks.from_neurons(ctx.structure, chosen)

    def plan(ctx: MethodContext, view: RoundView) -> ClientPlan:
        shared = masks.unwired(ctx.structure, _complement(personal_neurons(ctx, view)))
        return ClientPlan(download=shared)

    def client_start(ctx: MethodContext, global_vars: dict, state, plan: ClientPlan) -> dict:
        return submodel.merge(ctx.structure, plan.download, global_vars, state.variables)

    def select(ctx: MethodContext, view: RoundView) -> Selection:
        # The client names its personal neurons (index_bytes skips the always-shared classifier).
        personal = _complement(view.plan.download)
        return Selection(upload=view.plan.download, weights=view.cohort.num_samples,
                         extra_upload_bytes=costs.index_bytes(ctx.structure, personal))

    def update(ctx: MethodContext, view: RoundView) -> MethodState:
        # How far each neuron moved from where the client started (the engine hands over the start models).
        change = selection.neuron_update_norms(ctx.structure, view.trained_vars["params"],
                                               view.start_vars["params"])
        rows = FedSelectState(variables=view.trained_vars, change=change,
                              trained=jnp.ones_like(view.client_state.trained))
        clients = scatter_clients(view.method_state.clients, cohort_rows(view), rows, view.cohort.valid)
        return view.method_state._replace(clients=clients)

    def personal(ctx: MethodContext, state: MethodState, global_vars: dict) -> PersonalModels:
        return PersonalModels(variables=state.clients.variables)

    return make_method("fedselect", init=init, plan=plan, client_start=client_start, select=select,
                       update=update, personal=personal,
                       capabilities=Capabilities(personalised=True, neuron_masks=True, host_client_state=True,
                                                 asynchronous=True))


SPEC = MethodSpec("fedselect", fedselect, "A growing personal part: each client keeps its most-changed neurons.", (
    Option("start", float, 0.25, "FedSelect: personal fraction in the first round", in_unit_interval,
           flag="--select-start"),
    Option("end", float, 0.5, "FedSelect: personal fraction in the last round", in_unit_interval,
           flag="--select-end"),
))
