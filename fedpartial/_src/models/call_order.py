"""The order a linen model calls its modules in, and which of its normalisers are pre-norms.

:func:`~fedpartial._src.models.adapter.from_linen` records the calls of one abstract ``init``; the layer
structure (:func:`~fedpartial._src.core.structure.build_structure`) orders the layers by them, and a pre-norm
(a LayerNorm called right before the layer it normalises, as in a pre-LayerNorm transformer) joins the layer it
feeds instead of the one before it.
"""

from __future__ import annotations

from fedpartial._src.core.structure import NORMALIZER_NAMES, leaf_paths

__all__ = ["call_order_recorder", "pre_norms"]


def call_order_recorder(order: list, norms: list, calls: list):
    """An interceptor appending to ``order`` every module path at its first call, to ``norms`` the normalisers,
    and to ``calls`` every first call as ``(path, is_normaliser, input, output)`` (for :func:`pre_norms`)."""

    def record(next_fun, args, kwargs, context):
        if context.method_name != "__call__":
            return next_fun(*args, **kwargs)
        path = tuple(context.module.path)
        first = path not in order
        is_norm = type(context.module).__name__ in NORMALIZER_NAMES
        if first:
            order.append(path)
            if is_norm:
                norms.append(path)
        out = next_fun(*args, **kwargs)
        if first:
            calls.append((path, is_norm, args[0] if args else None, out))
        return out

    return record


def pre_norms(calls: list, variables) -> list:
    """The normalisers that are pre-norms (:func:`~fedpartial._src.core.structure.build_structure`): a module
    called after one takes its output itself, and its input is not the output of a module that owns
    parameters (a BatchNorm right after its Conv stays with the Conv)."""
    owners = {path[:-1] for path, _ in leaf_paths(variables.get("params", {}))}
    found = []
    for i, (path, is_norm, x, out) in enumerate(calls):
        if not is_norm or x is None:
            continue
        post = any(c_out is x for c_path, c_norm, _, c_out in calls if c_path in owners and not c_norm)
        feeds = any(c_x is out for _, c_norm, c_x, _ in calls if not c_norm)
        if feeds and not post:
            found.append(path)
    return found
