"""InclusiveFL (Liu et al., KDD 2022, "No One Left Behind: Inclusive Federated Learning over Heterogeneous
Devices").

Algorithm, per round:

1. a client of capacity tier ``t`` receives the first ``d_t`` stages of the global model and its tier's
   own classifier after them (a smaller model: the larger one's bottom layers and a head of its own;
   strong: the whole model) and trains them on that classifier's cross-entropy;
2. **layer-wise heterogeneous aggregation**: each element is averaged over the clients holding it;
3. **momentum distillation**: the top stage of a shallower tier ``t`` (its stage ``d_t − 1``) takes, in
   place of ``t``'s own update ``Δ_t``, ``(1 − β)·Δ_t + β·M_t``, where ``M_t`` is the previous round's
   mean update, by the next deeper tier ``u`` of the cohort, of the stages ``[d_t, d_u)`` that ``t``
   lacks — the deeper layers' momentum carried into the shallower top layer.

The tiers, depths, exits and groups are DepthFL's (:mod:`fedpartial._src.methods.tiered.depth`).  The
run's test accuracy is the strong tier's classifier (the large model, InclusiveFL's global model); every
exit's accuracy and their ensemble are recorded beside it.

Choices (we could not check the paper's equation itself; its form here follows a public re-implementation):

* ``M_t`` is tier ``u``'s ``n_k``-weighted mean update; in step 3 ``Δ_t`` is tier ``t``'s, so the
  aggregate of the top stage moves by ``β·W_t/W·(M_t − Δ_t)`` (``W_t``: tier ``t``'s weight, ``W``:
  all holders'); ``β = 0.2``.  No transfer in the first round (no ``M`` yet).
* The paper's layers are identical Transformer blocks; here a parameter of the top stage takes the mean
  update of the deeper stages' parameters **with its name and shape** (a kernel from kernels of that
  shape, a bias from biases) and none if there is no such parameter (e.g. a CNN whose widths all differ).
* Aggregation weights are FedAvg's ``n_k``; the exits are DepthFL's (pooling and one Dense layer).
* All clients strong is FedAvg on the model with exits (only its own classifier trains).
"""

from __future__ import annotations

from fedpartial._src.core.losses import masked_cross_entropy
from fedpartial._src.core.types import InitView, LocalStep, LossAux, MethodContext, MethodState, RoundView
from fedpartial._src.methods.base import make_method
from fedpartial._src.methods.registry import MethodSpec, Option, check_values, probability
from fedpartial._src.methods.tiered.depth import (DEPTHS_OPTION, Tiers, depth_hooks, transfer_apply, transfer_init,
                                                  transfer_next)
from fedpartial._src.methods.tiered.tiers import CAPACITY_CASE_OPTION, TIER_MIX_OPTION


def inclusivefl(tier_mix=None, capacity_case: int | None = None, depths=None, beta: float = 0.2):
    """InclusiveFL with the given tier mix (default: all strong), depths and momentum distillation weight β.

    Args:
      tier_mix: the shares of strong, moderate and weak clients (None: all strong).
      capacity_case: one of EmbracingFL's capacity cases instead of ``tier_mix``, or None.
      depths: per tier, the stages it trains (None: the model's default split).
      beta: the momentum distillation weight β.

    Returns:
      The :class:`~fedpartial.Method` (``--method inclusivefl``).
    """
    check_values("inclusivefl", SPEC.options, beta=beta)

    def tiers(ctx: MethodContext) -> Tiers:
        return Tiers(ctx, tier_mix, capacity_case, depths, "inclusivefl")

    def init(ctx: MethodContext, view: InitView) -> MethodState:
        return MethodState(server=transfer_init(tiers(ctx), view.global_vars["params"]))

    def objective(ctx: MethodContext, params, step: LocalStep):
        logits, stats = step.forward(params, step.batch.x)  # its own exit is the deepest it holds
        loss = masked_cross_entropy(logits[-1], step.batch.y, step.batch.example_mask)
        return loss, LossAux(loss=loss, batch_stats=stats)

    def server_correct(ctx: MethodContext, view: RoundView):
        return transfer_apply(tiers(ctx), view, beta)

    def update(ctx: MethodContext, view: RoundView) -> MethodState:
        return view.method_state._replace(server=transfer_next(tiers(ctx), view))

    hooks = depth_hooks("inclusivefl", tier_mix, capacity_case, depths, own_exit_only=True, output="last")
    return make_method("inclusivefl", init=init, objective=objective, server_correct=server_correct, update=update,
                       **hooks)


SPEC = MethodSpec(
    "inclusivefl", inclusivefl,
    "Depth tiers (InclusiveFL): moderate/weak clients train an input-side prefix and its own head; deeper "
    "stages' updates are distilled into a shallower tier's top stage.",
    options=(TIER_MIX_OPTION, CAPACITY_CASE_OPTION, DEPTHS_OPTION,
             Option("beta", float, 0.2, "InclusiveFL: weight β of the momentum distillation, in [0, 1]",
                    probability,
                    flag="--md-beta")),
)
