"""FedSPU — federated learning with stochastic parameter update (docs/decisions.md#fedspu, Algorithm 1).

Every client keeps a full personal model across rounds (``MethodState.clients``,
``[N]``-stacked; initially the broadcast ``w⁰``).  In round ``t``, for each sampled
client ``k`` with keep ratio ``p_k`` (its tier, :mod:`fedpartial._src.methods.submodel.common`):

1. the server draws, in every layer but the classifier, ``max(1, round(p_k·units))``
   *active* neurons uniformly at random; a parameter is active iff both neurons it
   joins are active (the first layer's inputs and the classifier's outputs always
   are; a conv channel feeds every flattened dense row of that channel);
2. it sends ``A_k(w^t)``, the global values of the active parameters, plus the
   active-neuron indices;
3. the client merges them into its personal model and trains it with every
   inactive parameter frozen — still present in the forward pass, bit-identical
   after training;
4. it uploads ``A_k(w_k^{t+1})``; the server averages each element over the clients
   for which it was active, weighted by ``n_k`` (the reference code weights by
   batches; we weight by samples), and keeps the global value elsewhere;
5. the trained model is the client's new personal model.

With every ``p_k = 1`` FedSPU is FedAvg (plus personal copies).

Decisions: BatchNorm scale/bias/statistics belong to their layer's neurons (active
with them); the active-neuron indices cost the cheaper of int32 indices or a
bit-mask per masked layer and count as download (the server chose them, so the
upload needs none); evaluation is each client's personal model on its own
held-out split.  Early stopping is :func:`fedpartial._src.methods.early_stopping.early_stopping`.
"""

from __future__ import annotations

from typing import Sequence

from fedpartial._src.costs import footprint as costs
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
    cohort_rows,
    make_method,
    scatter_clients,
)
from fedpartial._src.methods.registry import MethodSpec


def fedspu(tiers: Sequence[float] = submodel.DEFAULT_TIERS) -> Method:
    """FedSPU with keep ratios ``tiers`` assigned to equal clusters of clients.

    Args:
      tiers: keep ratios ``p`` in (0, 1], assigned to equal clusters of clients by id (``--tiers``).

    Returns:
      The :class:`~fedpartial.Method` (``--method fedspu``).
    """
    tiers = submodel.check_tiers("fedspu", tiers)

    def init(ctx: MethodContext, view: InitView) -> MethodState:
        return MethodState(clients=submodel.stack_population(ctx, view.global_vars))

    def plan(ctx: MethodContext, view: RoundView) -> ClientPlan:
        counts = submodel.cohort_counts(ctx, tiers, view.cohort.client_ids)
        active = submodel.neuron_mask(ctx.structure, submodel.random_neurons(view.key, counts, ctx.structure.units, view.cohort.client_ids))
        return ClientPlan(train=active, download=active,
                          extra_download_bytes=costs.index_bytes(ctx.structure, active))

    def client_start(ctx: MethodContext, global_vars: dict, personal: dict, plan: ClientPlan) -> dict:
        return submodel.merge(ctx.structure, plan.train, global_vars, personal)

    def update(ctx: MethodContext, view: RoundView) -> MethodState:
        clients = scatter_clients(view.method_state.clients, cohort_rows(view), view.trained_vars,
                                  view.cohort.valid)
        return view.method_state._replace(clients=clients)

    def personal(ctx: MethodContext, state: MethodState, global_vars: dict) -> PersonalModels:
        return PersonalModels(variables=state.clients)

    return make_method("fedspu", init=init, plan=plan, client_start=client_start, update=update,
                       personal=personal, metrics=submodel.active_fraction,
                       capabilities=Capabilities(personalised=True, neuron_masks=True, host_client_state=True,
                                                 asynchronous=True))


SPEC = MethodSpec("fedspu", fedspu, "Random active neurons per tier; personal models keep the rest.",
                  (submodel.TIERS_OPTION,))
