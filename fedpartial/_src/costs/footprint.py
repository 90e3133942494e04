"""Cost accounting: a client's training-memory footprint and the bytes of neuron indices.

**Memory model** (an estimate, after Pfeiffer, Khalili & Henkel 2023; FedSPU Fig. 5).
A client's training memory is *weights + gradients + activations*:

* weights — the parameters it holds in its forward pass (``held``): a FedSPU client
  holds the full model, a dropout client only its sub-model;
* gradients — one value per parameter it trains (``trained``);
* activations — for every layer ``l``, the layer's output (the Conv/Dense output,
  before normaliser, ReLU and pooling) for the units it trains, kept for
  back-propagation: ``batch · prod(spatial dims of l) · trained units of l``.

Optimizer state, the input batch, intermediate ReLU/pool outputs and framework
overhead are not counted, so the numbers compare methods rather than predict a
device's peak memory.  Every value is counted at ``bytes_per_value`` except the
weights and gradients, whose bytes come from the parameters' own dtypes.

Nothing here runs real compute: shapes come from :func:`jax.eval_shape`.
"""

from __future__ import annotations

import math
import numbers
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from fedpartial._src.core import masks
from fedpartial._src.core.masks import Mask
from fedpartial._src.models.adapter import Model
from fedpartial._src.core.structure import FROZEN, ModelStructure

#: ratios of FedSPU's Fig. 5 plus full training (p = 1)
FEDSPU_RATIOS = (0.2, 0.4, 0.6, 0.8, 1.0)


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    return int(value)


def _check_mask(structure: ModelStructure, mask: Mask | None, name: str) -> None:
    if mask is not None and np.shape(mask.layers)[-1:] != (structure.num_layers,):
        raise ValueError(
            f"{name} mask has layer axis of shape {np.shape(mask.layers)}, but the model has "
            f"{structure.num_layers} layers; pass a Mask built for this model's structure."
        )


def values_bytes(tree, bytes_per_value: int) -> int:
    """Bytes of every value of ``tree`` at ``bytes_per_value`` each (shapes only: abstract leaves do)."""
    return int(sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(tree))) * bytes_per_value


def adapted_paths(model: Model) -> set[tuple[str, ...]]:
    """The module paths of a LoRA model's targeted Dense layers (empty for any other model)."""
    spec = getattr(model, "lora", None)
    return set() if spec is None else {a.path for a in spec.adapters}


def adapter_outputs(model: Model, outputs: dict) -> dict:
    """Per targeted layer of a LoRA model whose output shape ``outputs`` recorded (one example, no batch axis),
    the output shapes of its A layer (``x A``: the rank on the last axis) and its B layer (the target's own):
    the adapters are parameters of the target's call, not modules of their own, so no call records them."""
    spec = getattr(model, "lora", None)
    if spec is None:
        return {}
    return {a.path: (tuple(outputs[a.path][:-1]) + (spec.rank,), tuple(outputs[a.path]))
            for a in spec.adapters if a.path in outputs}


def layer_output_shapes(model: Model, input_shape: Sequence[int] | None = None) -> tuple[tuple[int, ...], ...]:
    """Per layer (structure order), the shape of one example's Conv/Dense output, without a batch axis.

    ``input_shape`` (default the model's) lets a caller ask for other inputs, e.g. a
    sequence model fed half-length sequences.

    Found by intercepting the module calls of one abstract forward pass (eval mode,
    batch of 1), as :func:`fedpartial._src.models.adapter.from_linen` records the layer
    order; a module called twice reports its first call.

    Raises:
      ValueError: no output was recorded for some layer (e.g. an NNX model, whose
        calls linen cannot intercept).
    """
    wanted = {layer.path for layer in model.structure.layers} | adapted_paths(model)
    seen: dict[tuple[str, ...], tuple[int, ...]] = {}

    def record(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        if context.method_name == "__call__":
            path = tuple(context.module.path)
            if path in wanted and path not in seen and hasattr(out, "shape"):
                seen[path] = tuple(int(d) for d in out.shape[1:])
        return out

    variables = jax.eval_shape(model.init_variables, jax.random.key(0))
    shape = model.input_shape if input_shape is None else tuple(input_shape)
    x = jax.ShapeDtypeStruct((1, *shape), jnp.float32)  # models cast their input (token models to int32)
    with nn.intercept_methods(record):
        jax.eval_shape(lambda v, xb: model.apply(v, xb, False), variables, x)
    for path, (a_out, b_out) in adapter_outputs(model, seen).items():
        seen.setdefault((*path, "lora_a"), a_out)
        seen.setdefault((*path, "lora_b"), b_out)
    for layer in model.structure.layers:
        if layer.path not in seen:
            raise ValueError(
                f"no output was recorded for layer {layer.name!r} of model {model.name!r}; "
                "activation shapes need a linen model (adapted with from_linen)."
            )
    return tuple(seen[layer.path] for layer in model.structure.layers)


def _units_per_layer(structure: ModelStructure, mask: Mask | None) -> list[np.ndarray]:
    """Per layer, the number of on output units (0 for an off layer), with the mask's leading axes."""
    if mask is None:
        return [np.asarray(u, np.int64) for u in structure.units]
    layers = np.asarray(mask.layers)
    return [layers[..., l].astype(np.int64) * np.sum(np.asarray(n), axis=-1, dtype=np.int64)
            for l, n in enumerate(mask.neurons)]


def memory_footprint(
    model: Model,
    *,
    batch_size: int,
    trained: Mask | None = None,
    held: Mask | None = None,
    bytes_per_value: int = 4,
) -> dict[str, int | np.ndarray]:
    """Estimated training memory of one client (or one per leading index of the masks).

    * ``weights_bytes`` — parameters under ``held`` (None: the full model);
    * ``gradient_bytes`` — parameters under ``trained`` (None: same as ``held``);
      ``trained`` is taken to lie within ``held``;
    * ``activation_bytes`` — ``Σ_l batch_size · prod(spatial dims of l) · u_l ·
      bytes_per_value``, with ``u_l = trained.layers[..., l] · Σ trained.neurons[l]``
      the trained output units of layer ``l`` (``held``'s if ``trained`` is None, every
      unit if both are);
    * ``total_bytes`` — their sum.

    Only the ``params`` collection counts (running statistics are neither trained
    nor large), and, for a LoRA model (:func:`~fedpartial.models.lora`), the frozen base
    held once in ``weights_bytes`` and the base's activations, which the backward pass to
    the adapters goes through, in ``activation_bytes``.  Masks may carry leading axes (e.g. ``[K]``); values are then int64
    arrays with the broadcast leading shape, and Python ints otherwise.

    Raises:
      ValueError: ``batch_size`` or ``bytes_per_value`` is not a positive integer, or
        a mask does not have one entry per layer of the model.
    """
    batch_size = _positive_int("batch_size", batch_size)
    bytes_per_value = _positive_int("bytes_per_value", bytes_per_value)
    structure = model.structure
    _check_mask(structure, trained, "trained")
    _check_mask(structure, held, "held")
    variables = jax.eval_shape(model.init_variables, jax.random.key(0))

    held_mask = masks.full(structure) if held is None else held
    trained_mask = held_mask if trained is None else trained
    weights = np.asarray(masks.count_bytes(structure, held_mask, variables, ("params",)), np.int64)
    gradients = np.asarray(masks.count_bytes(structure, trained_mask, variables, ("params",)), np.int64)

    shapes = layer_output_shapes(model)
    units = _units_per_layer(structure, trained if trained is not None else held)
    spec = getattr(model, "lora", None)
    # a LoRA model's B layers and head add to the base's outputs, which the base's own activations count
    counted = range(structure.num_layers) if spec is None else [a.a_layer for a in spec.adapters]
    activations = np.asarray(0, np.int64)
    for i, (layer, shape, u) in enumerate(zip(structure.layers, shapes, units)):
        if i not in counted:
            continue
        if shape[-1:] != (layer.units,):
            raise ValueError(
                f"layer {layer.name!r} outputs shape {shape}, whose last axis is not its "
                f"{layer.units} units; activation counts need the units on the last axis."
            )
        activations = activations + batch_size * math.prod(shape[:-1]) * u * bytes_per_value
    if spec is not None:
        # a LoRA client also holds the frozen base (once) and keeps the base's activations for the backward pass
        # that reaches the adapters through it, beside each adapter's x A
        base = memory_footprint(spec.base, batch_size=batch_size, bytes_per_value=bytes_per_value)
        weights = weights + values_bytes(variables.get(FROZEN, {}), bytes_per_value)
        activations = activations + base["activation_bytes"]

    weights, gradients, activations = np.broadcast_arrays(weights, gradients, activations)
    out = {
        "weights_bytes": weights,
        "gradient_bytes": gradients,
        "activation_bytes": activations,
        "total_bytes": weights + gradients + activations,
    }
    if weights.ndim == 0:
        return {k: int(v) for k, v in out.items()}
    return {k: np.array(v, np.int64) for k, v in out.items()}


def layer_index_bytes(units: int, count, index_bytes: int = 4):
    """Bytes naming ``count`` of a layer's ``units`` neurons: the cheaper of ``count``
    indices of ``index_bytes`` each and a ``units``-bit mask (a Python int for an int
    ``count``, else an array)."""
    bits = math.ceil(units / 8)
    if isinstance(count, numbers.Integral):
        return min(index_bytes * int(count), bits)
    return jnp.minimum(index_bytes * count, bits)


def index_bytes(structure: ModelStructure, neurons_mask: Mask, *, index_bytes: int = 4) -> jax.Array:
    """Bytes telling the other side which neurons are on, per leading index of the mask.

    Per layer, the cheaper of the on-units as ``index_bytes``-byte indices and a
    ``units``-bit mask (``min(index_bytes · count, ⌈units / 8⌉)``, FedLDF's rule),
    summed over every layer but the last: the classifier's units are never masked,
    so nothing is sent for it.  Only ``neurons_mask.neurons`` is read.

    Jittable (the mask may be traced).

    Returns:
      int32 array with the mask's leading shape.
    """
    index_bytes = _positive_int("index_bytes", index_bytes)
    _check_mask(structure, neurons_mask, "neurons")
    total = jnp.zeros(jnp.shape(neurons_mask.layers)[:-1], jnp.int32)
    for units, on in zip(structure.units[:-1], neurons_mask.neurons[:-1]):
        total = total + layer_index_bytes(units, jnp.sum(on, axis=-1, dtype=jnp.int32), index_bytes)
    return total


def fedspu_mask(structure: ModelStructure, p: float) -> Mask:
    """A FedSPU client's trained mask at keep ratio ``p``: ``keep_count(p, units)`` active
    neurons in every layer but the classifier (the first ones — only counts matter),
    wired, so a parameter is trained iff both neurons it connects are active."""
    masks.uses_neurons(structure)
    neurons = [np.arange(u) < masks.keep_count(p, u) for u in structure.units[:-1]]
    neurons.append(np.ones(structure.units[-1], bool))
    return masks.from_neurons(structure, neurons)


def fedspu_memory_table(model: Model, batch_size: int, ratios: Sequence[float] = FEDSPU_RATIOS) -> list[dict]:
    """FedSPU's per-client memory at each keep ratio ``p`` against full-model training (Fig. 5).

    A FedSPU client holds the full model and trains the :func:`fedspu_mask` part;
    full training holds and trains everything.  One row per ``p`` with ``p``,
    ``fedspu_bytes``, ``full_bytes``, ``reduction = 1 - fedspu/full`` and the
    components ``{fedspu,full}_{weights,gradient,activation}_bytes``.
    """
    full = memory_footprint(model, batch_size=batch_size)
    rows = []
    for p in ratios:
        spu = memory_footprint(model, batch_size=batch_size, trained=fedspu_mask(model.structure, p))
        row = {
            "p": float(p),
            "fedspu_bytes": spu["total_bytes"],
            "full_bytes": full["total_bytes"],
            "reduction": 1.0 - spu["total_bytes"] / full["total_bytes"],
        }
        for part in ("weights", "gradient", "activation"):
            row[f"fedspu_{part}_bytes"] = spu[f"{part}_bytes"]
            row[f"full_{part}_bytes"] = full[f"{part}_bytes"]
        rows.append(row)
    return rows
