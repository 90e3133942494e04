"""Structured masks (:class:`fedpartial.Mask`): per layer and per neuron, with any leading batch axes.

A method builds masks with these functions and hands them to the engine in a ``ClientPlan`` or a
``Selection``; they are expanded to parameter shape only inside the per-client computation.
"""

from fedpartial._src.core.masks import (
    count_bytes,
    count_bytes_per_layer,
    count_elements,
    expand,
    expand_variables,
    from_layers,
    from_neurons,
    full,
    intersect,
    keep_count,
    protect_output,
    within,
)

__all__ = [
    "count_bytes", "count_bytes_per_layer", "count_elements", "expand", "expand_variables", "from_layers",
    "from_neurons", "full", "intersect", "keep_count", "protect_output", "within",
]
