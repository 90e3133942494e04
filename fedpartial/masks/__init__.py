"""Structured masks (:class:`fedpartial.Mask`): per layer, per neuron and (:func:`with_elements`) per element,
with any leading batch axes.

A method builds masks with these functions and hands them to the engine in a ``ClientPlan`` or a
``Selection``; they are expanded to parameter shape only inside the per-client computation.
:func:`aggregate` is the engine's one formula (each element averaged over the clients that sent it,
``Σ w m θ / Σ w m``; the global value where nobody did), for checking a method by hand.
"""

from fedpartial._src.core.aggregation import aggregate
from fedpartial._src.core.masks import (
    count_bytes,
    count_bytes_per_layer,
    count_elements,
    expand,
    expand_variables,
    from_layer_names,
    from_layers,
    from_neurons,
    full,
    intersect,
    keep_count,
    position_bytes,
    protect_output,
    with_elements,
    within,
)

__all__ = [
    "aggregate", "count_bytes", "count_bytes_per_layer", "count_elements", "expand", "expand_variables",
    "from_layer_names", "from_layers", "from_neurons", "full", "intersect", "keep_count", "position_bytes", "protect_output",
    "with_elements", "within",
]
