"""XLA's own cost analysis, read the one way every layer reads it."""

from __future__ import annotations

import math


def flops_of(analysis) -> float | None:
    """The 'flops' entry of a cost analysis (``Lowered.cost_analysis()`` or ``Compiled.cost_analysis()``: a dict,
    or a list of one on older jax), if usable: None when missing, negative or not finite."""
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0] if analysis else None
    value = (analysis or {}).get("flops")
    return float(value) if value is not None and math.isfinite(value) and value >= 0 else None
