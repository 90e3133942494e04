"""Mixed precision: a model whose training forward and backward pass run in a lower compute dtype.

:func:`with_compute_dtype` wraps a :class:`~fedpartial._src.models.adapter.Model`: in training, its floating
parameters and its input are cast to the compute dtype (``bfloat16``) before the forward pass, and its output
and BatchNorm statistics come back in float32.  The parameters themselves, the gradients (the cast's
transpose casts them back), the optimizer state and the aggregation stay float32; only the arithmetic of the
forward and backward pass is in bfloat16.  Evaluation (``train=False``) runs in float32, so accuracies are
measured the same way whatever the training precision.  The zoo models keep a bfloat16 input as it is
(:func:`fedpartial._src.models.zoo.as_float`); a user's Flax model computes in the dtype of its parameters
and input, as Flax's layers do by default.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from fedpartial._src.core.errors import UserError
from fedpartial._src.models.adapter import Model

__all__ = ["COMPUTE_DTYPES", "check_compute_dtype", "with_compute_dtype"]

#: the compute dtypes ``--compute-dtype`` accepts
COMPUTE_DTYPES = ("float32", "bfloat16")


def check_compute_dtype(name: str) -> str:
    """``name`` if it is one of :data:`COMPUTE_DTYPES`, else a :class:`UserError` in one sentence."""
    if name not in COMPUTE_DTYPES:
        raise UserError(f"compute dtype {name!r} is unknown; use one of {', '.join(COMPUTE_DTYPES)}.")
    return name


def _cast(tree, dtype):
    return jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def _low(variables, x, dtype):
    variables = {**variables, "params": _cast(variables["params"], dtype)}
    return variables, _cast(x, dtype)


def _back(out, stats):
    return _cast(out, jnp.float32), _cast(stats, jnp.float32)


def with_compute_dtype(model: Model, dtype: str) -> Model:
    """``model`` training in ``dtype`` (``"float32"``: ``model`` itself); see the module docstring."""
    if check_compute_dtype(dtype) == "float32":
        return model
    low = jnp.dtype(dtype)
    apply, run_stages, at_width = model.apply, model.run_stages, model.at_width

    def apply_low(variables, x, train, example_mask=None):
        if not train:
            return apply(variables, x, train, example_mask)
        return _back(*apply(*_low(variables, x, low), train, example_mask))

    def run_low(variables, x, start, stop, train, example_mask=None):
        if not train:
            return run_stages(variables, x, start, stop, train, example_mask)
        return _back(*run_stages(*_low(variables, x, low), start, stop, train, example_mask))

    def at_width_low(ratio: float, scaler: bool) -> Model:
        return with_compute_dtype(at_width(ratio, scaler), dtype)

    return dataclasses.replace(model, apply=apply_low, run_stages=None if run_stages is None else run_low,
                               at_width=None if at_width is None else at_width_low)
