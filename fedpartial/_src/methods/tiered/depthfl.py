"""DepthFL (Kim et al., ICLR 2023, "DepthFL: Depthwise Federated Learning for Heterogeneous Clients").

Algorithm, per round:

1. a client of capacity tier ``t`` receives the first ``d_t`` stages of the global model and the
   classifiers (exits) after them — a local model pruned of its deepest layers (strong: all of it);
2. it trains the sum of its exits' cross-entropies plus **mutual self-distillation**: every exit ``i``
   also learns from each other exit ``j`` it holds, ``λ/(m−1) Σ_{j≠i} T²·KL(p_j ‖ p_i)`` with the
   teacher ``p_j`` held fixed (:func:`fedpartial._src.core.losses.mutual_distillation`);
3. **layer-wise aggregation**: each element is averaged over the clients holding it.

The tiers, depths, exits and groups are shared with InclusiveFL
(:mod:`fedpartial._src.methods.tiered.depth`); the run's test accuracy is the exits' **ensemble**,
the mean of their logits (the reference code's), and every exit's accuracy is recorded beside it.

Choices where the paper is vague:

* An exit is global average pooling and one Dense layer (:mod:`fedpartial._src.models.exits`), not the
  paper's ResNet bottleneck classifiers, so that any staged model takes exits.
* ``distill`` (``λ``, default 1) is constant; the reference code ramps it up over the first 300 rounds.
  ``temperature`` ``T`` defaults to 1, as the reference code.
* Aggregation weights are FedAvg's ``n_k`` (the reference code counts holders uniformly), and local
  training is plain FedAvg (the paper's best runs add FedDyn's regulariser; ``feddyn`` is separate).
* The reported training loss is the mean of the exits' cross-entropies.
* All clients strong and ``distill = 0`` is FedAvg on the model with exits, trained on the sum of
  their cross-entropies.
"""

from __future__ import annotations

import jax.numpy as jnp

from fedpartial._src.core.losses import exit_cross_entropies, mutual_distillation
from fedpartial._src.core.types import Capabilities, LocalStep, LossAux, MethodContext
from fedpartial._src.methods.base import make_method
from fedpartial._src.methods.registry import MethodSpec, Option, above, at_least, check_values
from fedpartial._src.methods.tiered.depth import DEPTHS_OPTION, depth_hooks
from fedpartial._src.methods.tiered.tiers import CAPACITY_CASE_OPTION, TIER_MIX_OPTION


def depthfl(tier_mix=None, capacity_case: int | None = None, depths=None, distill: float = 1.0,
            temperature: float = 1.0):
    """DepthFL with the given tier mix (default: all strong), depths and distillation weight and temperature.

    Args:
      tier_mix: the shares of strong, moderate and weak clients (None: all strong).
      capacity_case: one of EmbracingFL's capacity cases instead of ``tier_mix``, or None.
      depths: per tier, the stages it trains (None: the model's default split).
      distill: the self-distillation weight between exits.
      temperature: the distillation temperature.

    Returns:
      The :class:`~fedpartial.Method` (``--method depthfl``).
    """
    check_values("depthfl", SPEC.options, distill=distill, temperature=temperature)

    def objective(ctx: MethodContext, params, step: LocalStep):
        logits, stats = step.forward(params, step.batch.x)  # [exits held, B, C]
        ce = exit_cross_entropies(logits, step.batch.y, step.batch.example_mask)
        value = jnp.sum(ce)
        if distill:
            value = value + distill * mutual_distillation(logits, step.batch.example_mask, temperature)
        return value, LossAux(loss=jnp.mean(ce), batch_stats=stats)

    hooks = depth_hooks("depthfl", tier_mix, capacity_case, depths, own_exit_only=False, output="mean")
    return make_method("depthfl", objective=objective, capabilities=Capabilities(asynchronous=True), **hooks)


SPEC = MethodSpec(
    "depthfl", depthfl,
    "Depth tiers (DepthFL): moderate/weak clients train an input-side prefix and its exits, with mutual "
    "self-distillation among the exits.",
    options=(TIER_MIX_OPTION, CAPACITY_CASE_OPTION, DEPTHS_OPTION,
             Option("distill", float, 1.0, "DepthFL: weight λ of the mutual self-distillation (0: none)",
                    at_least(0.0), flag="--kd-weight"),
             Option("temperature", float, 1.0, "DepthFL: temperature T of the self-distillation",
                    above(0, "must be a number > 0"),
                    flag="--kd-temperature")),
)
