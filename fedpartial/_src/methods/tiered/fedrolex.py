"""FedRolex (Alam et al., NeurIPS 2022, Algorithm 1): rolling sub-model extraction.

Per round ``j``, a client of capacity tier ``r`` trains a width sub-model of every hidden layer of
``C`` units: the ``n = ⌈r·C⌉`` units ``j, j+1, …, j+n−1 (mod C)``.  The window rolls by one unit
every round and wraps around, so over ``C`` rounds every unit is trained by every tier — unlike
HeteroFL, whose narrow clients only ever train the leading units.  The server averages each
element over the clients holding it (HeteroFL's aggregation).

Everything else is HeteroFL's (:mod:`fedpartial._src.methods.tiered.heterofl`): the same tiers
(``--tier-mix`` / ``--capacity-case``, ``--widths``), the same physically smaller narrow graph per
tier (its window is ``ClientPlan.window``, read by the windowed
:func:`fedpartial._src.engine.graphs.width`), the Scaler, ``--heterofl-weights``, and every
element's traffic.  The classifier keeps every class.

Choices where the paper is vague:

* Rounds count from 0, so the first round's windows are HeteroFL's leading units (then the two
  methods part).  One window start for every layer, taken modulo each layer's units (the paper's
  ``j mod K_i``); a narrow input axis follows the layer that feeds it.
* Widths round up (``⌈r·C⌉``), as HeteroFL's code and ours do.
* A window must be a sub-network of the model: rolling a sequential model's units, or those of a
  ResNet with projection shortcuts, is only a relabelling; an option-A ResNet's shortcuts place
  channels at fixed offsets, so it is refused (checked numerically when the run is built).
* All tiers strong is FedAvg (with ``--heterofl-weights samples``, its ``n_k`` weights).
"""

from __future__ import annotations

from collections.abc import Sequence

from fedpartial._src.methods.registry import MethodSpec
from fedpartial._src.methods.tiered.heterofl import DEFAULT_WIDTHS, WEIGHTING_OPTION, WIDTHS_OPTION, width_tiers
from fedpartial._src.methods.tiered.tiers import CAPACITY_CASE_OPTION, TIER_MIX_OPTION


def fedrolex(tier_mix=None, capacity_case: int | None = None, widths: Sequence[float] = DEFAULT_WIDTHS,
             weighting: str = "uniform", *, scaler: bool = True, module=None, name: str = "fedrolex"):
    """FedRolex with the given tier mix (default: all strong, i.e. FedAvg with ``weighting`` weights).

    Arguments as :func:`~fedpartial.methods.heterofl`; the narrow tiers' windows roll.

    Args:
      tier_mix: the shares of strong, moderate and weak clients (None: all strong).
      capacity_case: one of EmbracingFL's capacity cases instead of ``tier_mix``, or None.
      widths: the moderate and weak tiers' width ratios.
      weighting: ``uniform`` or ``samples`` (``n_k``) aggregation weights.
      scaler: multiply hidden outputs by ``1/ratio`` in training (HeteroFL's scaler).
      module: a narrowable model to use instead of the run's, or None.
      name: the method's name.

    Returns:
      The :class:`~fedpartial.Method` (``--method fedrolex``).
    """
    return width_tiers(name, tier_mix, capacity_case, widths, weighting, scaler=scaler, module=module, rolling=True)


SPEC = MethodSpec(
    "fedrolex", fedrolex,
    "Rolling width sub-models (FedRolex): moderate/weak clients train ⌈r·C⌉ units whose window moves one unit a "
    "round.",
    options=(TIER_MIX_OPTION, CAPACITY_CASE_OPTION, WIDTHS_OPTION, WEIGHTING_OPTION),
)
