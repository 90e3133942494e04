"""Personal parts: the piece the personalised partial-model methods share (FedPer, LG-FedAvg, FedRep, FedBN).

Every client keeps its own copy of some parts of the model (whole layers, or every layer's
normaliser) across rounds (``MethodState.clients``, ``[N]``
full models, initially the broadcast ``w⁰``) and shares the others.  In a round, a sampled client:

1. receives the shared layers' global values (they count as download) and starts from them
   with its own personal layers (:func:`fedpartial._src.methods.submodel.common.merge`);
2. trains every layer;
3. uploads the shared layers; the server averages them weighted by ``n_k`` and keeps the global
   value of the personal layers (nobody uploads them);
4. keeps its trained model (the personal layers are what it reuses).

Evaluation is each client's own model on its held-out split: the current global shared parts
with its personal ones.  What is shared is a layer-level mask (a BatchNorm belongs to the layer
it follows; ``Mask.norms`` sets normalisers apart), so any model works, residual or not.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from fedpartial._src.core import masks
from fedpartial._src.core.errors import UserError
from fedpartial._src.core.population import broadcast_clients
from fedpartial._src.core.structure import FROZEN, ModelStructure, without_frozen
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
from fedpartial._src.methods.registry import Option
from fedpartial._src.methods.submodel.common import merge

#: ``num_layers -> [L] bool``, the layers each client keeps as its own
PersonalOf = Callable[[int], np.ndarray]
#: ``structure -> Mask`` (one client's), what every client shares; the rest is its own
SharedOf = Callable[[ModelStructure], masks.Mask]


def check_head_layers(value) -> str | None:
    ok = isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 0
    return None if ok else "must be a whole number of layers, 0 or more (1: the classifier)"


HEAD_LAYERS_OPTION = Option(
    "head_layers", int, 1,
    "FedPer / LG-FedAvg / FedRep: the head is the model's last N layers (default 1, the classifier); FedPer and "
    "FedRep keep it personal, LG-FedAvg shares it and keeps the rest personal", check=check_head_layers,
    flag="--head-layers")


def head_of(name: str, head_layers: int, num_layers: int) -> np.ndarray:
    """``[L]`` bool: the last ``head_layers`` of ``num_layers``; more than the model has is one sentence."""
    if check_head_layers(head_layers) or head_layers > num_layers:
        raise UserError(f"{name}: --head-layers {head_layers!r} must be between 0 and the model's {num_layers} "
                        f"layers.")
    return np.arange(num_layers) >= num_layers - head_layers


def personal_layers(name: str, personal_of: PersonalOf) -> Method:
    """A method whose clients keep the layers ``personal_of(L)`` marks as their own and share the rest.

    Args:
      name: the method's name.
      personal_of: ``num_layers -> [L] bool``, the layers each client keeps (FedPer: the last one).

    Returns:
      The :class:`~fedpartial.Method` (:func:`personal_parts` with that layer split).
    """
    return personal_parts(name, lambda structure: masks.from_layers(
        structure, ~np.asarray(personal_of(structure.num_layers), bool)))


def personal_parts(name: str, shared_of: SharedOf) -> Method:
    """A method whose clients share what ``shared_of(structure)`` marks and keep the rest as their own.

    Each client's full model is its state across rounds (``MethodState.clients``, ``[N]``, initially the
    broadcast global model); a sampled client starts from the global shared parts merged with its own
    (:func:`merge`), trains everything, uploads the shared parts and keeps its trained model.  Evaluation is
    each client's own model on its held-out split.  FedPer, LG-FedAvg and FedBN are this with different splits;
    a method that shares other parts (e.g. FedSA's LoRA ``A`` matrices) is this with its own ``shared_of``.

    Args:
      name: the method's name.
      shared_of: ``structure -> Mask`` (one client's, no leading axis): what every client shares, e.g.
        ``lambda s: masks.from_layer_names(s, ["fc1", "fc2"])``.

    Returns:
      The :class:`~fedpartial.Method`.
    """

    def shared(ctx: MethodContext, batch_shape=()) -> masks.Mask:
        mask = shared_of(ctx.structure)
        return jax.tree.map(lambda a: jnp.broadcast_to(a, (*batch_shape, *jnp.shape(a))), mask)

    def init(ctx: MethodContext, view: InitView) -> MethodState:
        shared(ctx)  # a bad split is refused before anything runs
        return MethodState(clients=broadcast_clients(without_frozen(view.global_vars), ctx.num_clients))

    def plan(ctx: MethodContext, view: RoundView) -> ClientPlan:
        return ClientPlan(download=shared(ctx, (ctx.cohort_size,)))

    def client_start(ctx: MethodContext, global_vars: dict, own: dict, plan: ClientPlan) -> dict:
        return merge(ctx.structure, plan.download, without_frozen(global_vars), own)

    def select(ctx: MethodContext, view: RoundView) -> Selection:
        k = view.cohort.num_samples.shape[0]
        return Selection(upload=view.plan.download, weights=view.cohort.num_samples,
                         extra_upload_bytes=jnp.zeros((k,), jnp.int32))

    def update(ctx: MethodContext, view: RoundView) -> MethodState:
        clients = scatter_clients(view.method_state.clients, cohort_rows(view), view.trained_vars, view.cohort.valid)
        return view.method_state._replace(clients=clients)

    def personal(ctx: MethodContext, state: MethodState, global_vars: dict) -> PersonalModels:
        # Per leaf (whole layers): the global value for every client, or each client's own.
        shared_vars = without_frozen(global_vars)  # a LoRA model's base is held once, not per client
        take = jax.tree.map(np.asarray, masks.expand_variables(ctx.structure, shared(ctx), shared_vars))
        n = ctx.num_clients

        def leaf(t, g, own):
            if not t.all():
                return own
            if isinstance(own, np.ndarray):  # rows kept on the host stay there (evaluated chunk by chunk)
                return np.broadcast_to(np.asarray(g), (n, *np.shape(g)))
            return jnp.broadcast_to(g, (n, *jnp.shape(g)))

        own = jax.tree.map(leaf, take, shared_vars, state.clients)
        return PersonalModels(variables=own if FROZEN not in global_vars else {**own, FROZEN: global_vars[FROZEN]})

    return make_method(name, init=init, plan=plan, client_start=client_start, select=select, update=update,
                       personal=personal, capabilities=Capabilities(personalised=True, host_client_state=True,
                                                                         asynchronous=True))
