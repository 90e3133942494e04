"""HeteroFL's and FedRolex's width tiers as capacities: the paper's Table 10 (docs/decisions.md#embracingfl).

A client of width ratio ``r`` trains every parameter of its narrow model and the Conv/Dense outputs of one
batch; its capacity is that count over the full model's (:func:`capacity_table`).  The tiers are
:mod:`fedpartial._src.methods.tiered.heterofl`'s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax

from fedpartial._src.costs import footprint as costs
from fedpartial._src.engine import graphs
from fedpartial._src.methods.tiered.heterofl import DEFAULT_WIDTHS, tier_ratios
from fedpartial._src.methods.tiered.tiers import TIER_NAMES
from fedpartial._src.models.adapter import Model


def tier_footprint(model: Model, ratio: float, *, batch_size: int, module=None) -> dict:
    """Values a client of width ``ratio`` trains: every parameter of its narrow model and the Conv/Dense
    outputs of one batch (:func:`fedpartial._src.costs.footprint.layer_output_shapes`), counted as
    :func:`fedpartial._src.methods.tiered.embracingfl.tier_footprint` counts them."""
    narrow = model if ratio == 1 else graphs.narrow_model(model, ratio, module=module)
    variables = jax.eval_shape(narrow.init_variables, jax.random.key(0))
    params = sum(math.prod(a.shape) for a in jax.tree.leaves(variables["params"]))
    acts = sum(math.prod(s) for s in costs.layer_output_shapes(narrow))
    return {"params": int(params), "activations": int(batch_size * acts)}


def capacity_table(model: Model, *, batch_size: int = 32, widths: Sequence[float] = DEFAULT_WIDTHS,
                   module=None) -> list[dict]:
    """One row per tier: width ratio, parameters, activations and capacity (the paper's Table 10; capacity as
    docs/decisions.md#embracingfl defines it)."""
    rows = [dict(tier=TIER_NAMES[t], width=r, **tier_footprint(model, r, batch_size=batch_size, module=module))
            for t, r in enumerate(tier_ratios(widths))]
    full = rows[0]["params"] + rows[0]["activations"]
    for row in rows:
        row["capacity"] = (row["params"] + row["activations"]) / full
    return rows
