"""Width-reduced models (HeteroFL / FjORD width tiers): a model rebuilt with ``⌈r·C⌉`` channels/units in
every hidden layer, the classifier keeping every class, its variables the full model's leading slices.

:func:`narrowed_model` rebuilds a :class:`~fedpartial._src.models.adapter.Model` from, in this order:

* the zoo module passed for it (checked against the model's variables);
* the model's own rebuild hook, :attr:`Model.at_width` (``from_linen(..., width=...)``), so a model
  built from any linen module narrows when it says how;
* the registry's zoo model of the model's name (checked against its variables).

A model none of these covers is refused in one sentence saying what is needed.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedpartial._src.core.errors import UserError
from fedpartial._src.models import registry, zoo
from fedpartial._src.models.adapter import Model, from_linen

__all__ = ["narrowed_model"]


def _zoo_module(model: Model, module: nn.Module | None) -> nn.Module:
    """The zoo module ``model`` was built from: ``module``, or the registry's model of that name, checked."""
    if module is None:
        module = registry.build_model(model.name, model.num_classes, model.input_shape)
    if not isinstance(module, nn.Module):
        raise UserError(f"width reduction needs a flax linen zoo module, got {type(module).__name__}.")
    fix_shape = getattr(module, "for_input_shape", None)
    if callable(fix_shape):
        module = fix_shape(model.input_shape)
    sample = jnp.zeros((1, *model.input_shape), jnp.float32)
    try:
        got = jax.eval_shape(lambda: module.init(jax.random.key(0), sample, train=False))
    except Exception:  # noqa: BLE001 - any failure means the module is not this model
        got = None
    want = jax.eval_shape(model.init_variables, jax.random.key(0))

    def shapes(tree):
        return {c: jax.tree.map(lambda a: a.shape, tree.get(c, {})) for c in ("params", "batch_stats")}

    if got is None or shapes(got) != shapes(want):
        raise UserError(
            f"model {model.name!r} is not the zoo's {type(module).__name__} with these settings (their variables "
            "differ), so its width-reduced version is unknown; pass the zoo module it was built from.")
    return module


def narrowed_model(model: Model, ratio: float, *, module: nn.Module | None = None, scaler: bool = True) -> Model:
    """``model`` with ``⌈ratio·C⌉`` channels/units in every hidden layer (its classifier keeps every class).

    ``scaler``: hidden outputs are multiplied by ``1/ratio`` in training (HeteroFL's
    Scaler).  ``module``: the zoo module ``model`` was built from, when it is not the
    registry's model of ``model.name``.  The result is a new model each call.

    Raises:
      UserError: ``ratio`` outside (0, 1]; a model with no way to narrow it (not a
        zoo model and no :attr:`Model.at_width`); or a narrow model whose layers,
        input shape or classes are not the full model's.
    """
    zoo.check_width_ratio(ratio)
    if module is None and model.at_width is not None:
        out = model.at_width(ratio, scaler)
    elif module is None and model.name not in registry.MODELS:
        raise UserError(
            f"model {model.name!r} has no width-reduced version: build it with from_linen(..., width=fn), fn(ratio, "
            "scaler) returning the module at that width, or use a zoo model by name "
            f"({', '.join(registry.MODELS)}) or pass the zoo module it was built from.")
    else:
        out = from_linen(zoo.narrowed(_zoo_module(model, module), ratio, scaler=scaler),
                         input_shape=model.input_shape, num_classes=model.num_classes,
                         sequential=model.structure.sequential, name=f"{model.name}@{ratio:g}")
    if (out.structure.layer_names, out.input_shape, out.num_classes) != (
            model.structure.layer_names, model.input_shape, model.num_classes):
        raise UserError(
            f"the width-reduced {model.name} (layers {out.structure.layer_names}, input {out.input_shape}, "
            f"{out.num_classes} classes) does not match the full model (layers {model.structure.layer_names}, "
            f"input {model.input_shape}, {model.num_classes} classes); a width rebuild keeps every layer.")
    return out
