"""Structured per-client masks and their transient expansion to parameter shape.

A :class:`Mask` holds one boolean per layer and one boolean per output unit of
each layer, with any number of leading axes (normally the cohort axis ``[K]``).
An element of a kernel is *on* iff its layer is on, its output unit is on and the
input unit feeding it (the previous layer's output unit) is on — so a neuron
mask says at once "this neuron's parameters" and "the weights reading from it".

Masks are never stored expanded: :func:`expand` builds the parameter-shaped
boolean tree for one client inside the per-client computation, and
:func:`count_elements` counts the on-elements exactly without expanding.

The three kinds of docs/decisions.md#engine are all :class:`Mask` values; what differs is how the
engine uses them (see :mod:`fedpartial._src.engine.client` and :mod:`fedpartial._src.core.aggregation`):

* train mask — elements a client may change (frozen otherwise, bit-identical);
* dropout mask — neurons that exist in the client's sub-model (only the neuron
  part is used; a dropped unit's outgoing weights are zeroed in the forward pass);
* upload mask — elements the server aggregates from the client.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedpartial._src.core.errors import UserError
from fedpartial._src.core.fielddocs import document_fields
from fedpartial._src.core.structure import ModelStructure, leaf_paths


@document_fields
class Mask(NamedTuple):
    """Layer and neuron booleans; leading axes (e.g. ``[K]``) are shared by all fields.

    Attributes:
      layers: ``[..., L]`` bool, one per layer.
      neurons: tuple of ``[..., units_l]`` bool, one array per layer.
      inputs: None (the default) wires each layer's input axis to the previous
        layer's ``neurons``; otherwise a tuple, per layer, of ``[..., units_f]``
        bools for the units of the layer ``f`` feeding it (any shape for a layer
        fed by nobody).  ``unwired`` uses it for masks that select a neuron
        together with its whole incoming weight column (FedADP).  A layer the
        structure leaves unwired (``feeds_from`` None, e.g. inside a residual
        network) may be wired here explicitly with a non-empty ``[..., n]``
        vector: each of its ``n`` units feeds ``fan_in / n`` input rows (NHWC
        tiling); an empty ``[..., 0]`` leaves it unwired.  Width reduction uses
        this for ResNet20 (:mod:`~fedpartial.methods.heterofl`).
      norms: None (the default): a layer's normaliser (BatchNorm scale, bias and
        statistics) is on with its layer; otherwise ``[..., L]`` bool, whether each
        layer's normaliser is on as well (FedBN keeps them off: local).
      elements: None (the default): no level below the unit.  Otherwise a tree shaped
        like the parameters (the ``params`` collection) whose leaves say, element by
        element, what is on besides the levels above (an element is on iff on in both):
        a leaf ``[..., *leaf shape]`` is a *sparse* leaf (FedDST's and FIARSE's kept
        weights), a leaf ``[...]`` (the leading axes only) is dense, on or off as a
        whole.  Traffic counts a sparse leaf's values plus its positions
        (:func:`count_bytes`).  Build one with :func:`with_elements`.
    """

    layers: jax.Array
    neurons: tuple[jax.Array, ...]
    inputs: tuple[jax.Array, ...] | None = None
    norms: jax.Array | None = None
    elements: Any = None


def full(structure: ModelStructure, batch_shape: Sequence[int] = (), value: bool = True) -> Mask:
    """A mask with every layer and neuron set to ``value``.

    Args:
      structure: the model's layers (``model.structure``, a :class:`~fedpartial.ModelStructure`).
      batch_shape: leading axes, e.g. ``(K,)`` for a cohort.
      value: every boolean's value.

    Returns:
      The :class:`~fedpartial.Mask`.

    Examples:
      >>> import jax.numpy as jnp
      >>> from fedpartial import masks, models
      >>> model = models.from_linen(models.build_model("mlp", 10, (64,)), input_shape=(64,), num_classes=10)
      >>> masks.full(model.structure, (4,)).layers.shape
      (4, 3)
    """
    batch_shape = tuple(batch_shape)
    return Mask(
        layers=jnp.full((*batch_shape, structure.num_layers), value, bool),
        neurons=tuple(jnp.full((*batch_shape, u), value, bool) for u in structure.units),
    )


def from_layers(structure: ModelStructure, layers: jax.Array) -> Mask:
    """A layer-level mask ``[..., L]``; every neuron of an on-layer is on.

    Args:
      structure: the model's layers (``model.structure``, a :class:`~fedpartial.ModelStructure`).
      layers: ``[..., L]`` bool, one per layer, any leading axes.

    Returns:
      The :class:`~fedpartial.Mask`.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from fedpartial import masks, models
      >>> model = models.from_linen(models.build_model("mlp", 10, (64,)), input_shape=(64,), num_classes=10)
      >>> m = masks.from_layers(model.structure, jnp.array([[True, False, True]]))
      >>> int(masks.count_elements(model.structure, m, model.init_variables(jax.random.key(0))["params"])[0])
      15010
    """
    layers = jnp.asarray(layers, bool)
    batch = layers.shape[:-1]
    return Mask(layers=layers, neurons=tuple(jnp.ones((*batch, u), bool) for u in structure.units))


def from_layer_names(structure: ModelStructure, names: Sequence[str], batch_shape: Sequence[int] = ()) -> Mask:
    """A layer-level mask with the layers ``names`` on and every other layer off.

    Args:
      structure: the model's layers (``model.structure``, a :class:`~fedpartial.ModelStructure`).
      names: layer names as ``structure.layers[i].name`` spells them (``"fc1"``, ``"block0/conv2"``); an
        unknown name is refused in one sentence naming the model's layers.
      batch_shape: leading axes, e.g. ``(K,)`` for every client of a cohort.

    Returns:
      The :class:`~fedpartial.Mask`, ``[*batch_shape, L]``.

    Examples:
      >>> from fedpartial import masks, models
      >>> model = models.from_linen(models.build_model("mlp", 10, (64,)), input_shape=(64,), num_classes=10)
      >>> masks.from_layer_names(model.structure, ["head"]).layers.tolist()
      [False, False, True]
    """
    known = [layer.name for layer in structure.layers]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise UserError(f"the model has no layer named {unknown[0]!r}; its layers are {', '.join(known)}.")
    on = np.isin(known, list(names))
    return from_layers(structure, np.broadcast_to(on, (*batch_shape, len(known))))


def from_neurons(structure: ModelStructure, neurons: Sequence[jax.Array]) -> Mask:
    """A neuron-level mask; every layer is on.

    Args:
      structure: the model's layers (``model.structure``, a :class:`~fedpartial.ModelStructure`).
      neurons: per layer, ``[..., units_l]`` bool, with the same leading axes.

    Returns:
      The :class:`~fedpartial.Mask`.

    Examples:
      >>> import jax.numpy as jnp
      >>> from fedpartial import masks, models
      >>> model = models.from_linen(models.build_model("mlp", 10, (64,)), input_shape=(64,), num_classes=10)
      >>> units = [jnp.arange(u) < u // 2 for u in model.structure.units]
      >>> masks.from_neurons(model.structure, units).neurons[0].sum()
      Array(100, dtype=int32)
    """
    neurons = tuple(jnp.asarray(n, bool) for n in neurons)
    batch = neurons[0].shape[:-1]
    return Mask(layers=jnp.ones((*batch, structure.num_layers), bool), neurons=neurons)


def intersect(a: Mask, b: Mask) -> Mask:
    """Element-wise AND of two masks with the same wiring (an element is on iff on in both).

    Args:
      a: a mask.
      b: a mask with ``a``'s wiring and leading axes.

    Returns:
      Their element-wise AND.
    """
    elements = a.elements if b.elements is None else b.elements if a.elements is None \
        else jax.tree.map(jnp.logical_and, a.elements, b.elements)
    return jax.tree.map(jnp.logical_and, a._replace(elements=None), b._replace(elements=None))._replace(
        elements=elements)


def check_element_tree(elements: Any, params: Any) -> None:
    """Refuses, in one sentence naming the first leaf that differs, an element level not shaped like ``params``
    (a leaf missing from it, or one the parameters do not have)."""
    _check_leaf_paths([path for path, _ in leaf_paths(elements)], [path for path, _ in leaf_paths(params)])


def _check_leaf_paths(have: list, want: list) -> None:
    if want == have:
        return
    missing = [p for p in want if p not in have]
    if missing:
        raise UserError(f"the element mask has no entry for the parameter {'/'.join(missing[0])}; build it shaped "
                        f"like the model's params (e.g. jax.tree.map over them).")
    extra = [p for p in have if p not in want]
    if extra:
        raise UserError(f"the element mask has an entry {'/'.join(extra[0])} that the model's params do not have; "
                        f"build it shaped like the model's params (e.g. jax.tree.map over them).")
    raise UserError("the element mask's leaves are not in the order of the model's params; build it with "
                    "jax.tree.map over the params.")


def with_elements(mask: Mask, elements: Any, like: Any = None) -> Mask:
    """``mask`` with an element level: ``elements`` is shaped like the parameters, each leaf ``[..., *leaf
    shape]`` bool (a sparse leaf: which of its elements are on) or ``[...]`` (a dense leaf, on or off as a
    whole), ``...`` the mask's leading axes (e.g. the cohort's ``[K]``).

    Args:
      mask: the mask to add the level to.
      elements: the element level, shaped as above.
      like: one model's parameters (the ``params`` collection): when given, an ``elements`` tree that misses
        one of their leaves, or has one they do not, is refused in one sentence naming it.  The engine checks
        the same when it expands the mask.

    Returns:
      ``mask`` with ``elements`` set.
    """
    batch = mask.layers.shape[:-1]
    if like is not None:
        check_element_tree(elements, like)
    elements = jax.tree.map(lambda e: jnp.asarray(e, bool), elements)
    for e in jax.tree.leaves(elements):
        if e.shape[:len(batch)] != batch:
            raise UserError(f"an element mask of shape {e.shape} does not start with the mask's leading axes {batch}.")
    return mask._replace(elements=elements)


def within(mask: Mask, submodel: Mask) -> Mask:
    """``mask`` restricted to the neurons that exist in ``submodel`` (its dropout mask).

    Args:
      mask: the mask to restrict.
      submodel: the client's sub-model (its neuron mask).

    Returns:
      ``mask`` with the neurons outside ``submodel`` off.
    """
    return mask._replace(neurons=tuple(jnp.logical_and(a, b) for a, b in zip(mask.neurons, submodel.neurons)))


def unwired(structure: ModelStructure, mask: Mask) -> Mask:
    """The same neurons, but each with its whole input column (inputs not masked)."""
    batch = mask.layers.shape[:-1]
    inputs = tuple(
        jnp.ones((*batch, structure.units[layer.feeds_from] if layer.feeds_from is not None else 0), bool)
        for layer in structure.layers
    )
    return mask._replace(inputs=inputs)


def protect_output(mask: Mask) -> Mask:
    """Forces the classifier's output units on (they are never dropped or frozen per neuron).

    Args:
      mask: any mask.

    Returns:
      ``mask`` with every output unit on.
    """
    neurons = (*mask.neurons[:-1], jnp.ones_like(mask.neurons[-1]))
    return mask._replace(neurons=neurons)


def uses_neurons(structure: ModelStructure) -> None:
    """Raises unless neuron masks can be wired for this model."""
    if any(name.endswith("/lora_a") for name in structure.layer_names):
        raise UserError("neuron-level masks cannot drop a unit of a LoRA model (its frozen base would still compute "
                        "it); use a layer-level method or a LoRA method (fedit, ffa_lora, fedsa_lora).")
    if not structure.sequential:
        raise UserError(
            "neuron-level masks need a sequential model (a chain of layers without residual "
            "connections); use a layer-level method or declare the model sequential."
        )


def _input_units(structure: ModelStructure, layer: int, per_unit: Sequence[jax.Array],
                 inputs: Sequence[jax.Array] | None = None) -> jax.Array | None:
    """Per input row of ``layer``'s kernel, the value of the feeding unit (None if unwired)."""
    spec = structure.layers[layer]
    if spec.feeds_from is None:
        if inputs is None or inputs[layer].shape[-1] == 0:
            return None
        return jnp.tile(inputs[layer], spec.fan_in // inputs[layer].shape[-1])  # explicitly wired
    units = per_unit[spec.feeds_from] if inputs is None else inputs[layer]
    # NHWC flatten: input row i is fed by channel i % C, i.e. the unit vector tiled.
    return jnp.tile(units, spec.input_tile)


def _leaf_values(structure, collection, path, shape, layer_vals, out_vals, in_vals, combine, inputs=None,
                 norms=None):
    role = structure.role(collection, path)
    value = layer_vals[role.layer]
    if role.norm and norms is not None:
        value = combine(value, norms[role.layer])
    if role.on_input:  # a pre-norm: its units are those feeding the layer
        inp = _input_units(structure, role.layer, in_vals, inputs)
        if inp is not None:
            value = combine(value, inp.reshape((1,) * (len(shape) - 1) + inp.shape))
        return jnp.broadcast_to(value, shape)
    if not role.units_axis:  # a whole-layer leaf: its layer's bit alone
        return jnp.broadcast_to(value, shape)
    out = out_vals[role.layer]
    value = combine(value, out.reshape((1,) * (len(shape) - 1) + out.shape))
    if role.has_input_axis:
        inp = _input_units(structure, role.layer, in_vals, inputs)
        if inp is not None:
            value = combine(value, inp.reshape((1,) * (len(shape) - 2) + (inp.shape[0], 1)))
    return jnp.broadcast_to(value, shape)


def expand(structure: ModelStructure, mask: Mask, tree: Any, collection: str = "params") -> Any:
    """Expands one client's mask (no leading axis) to a boolean tree shaped like ``tree``.

    Args:
      structure: the model's layers (``model.structure``, a :class:`~fedpartial.ModelStructure`).
      mask: one client's mask (no leading axis).
      tree: one model's variables of ``collection`` (any leaf values).
      collection: the variables collection ``tree`` belongs to.

    Returns:
      A tree of bool arrays shaped as ``tree``'s leaves.
    """
    flat = leaf_paths(tree)
    leaves = [
        _leaf_values(structure, collection, path, jnp.shape(leaf), mask.layers, mask.neurons,
                     mask.neurons, jnp.logical_and, mask.inputs, mask.norms)
        for path, leaf in flat
    ]
    if mask.elements is not None and collection == "params":
        check_element_tree(mask.elements, tree)
        leaves = [v & jnp.broadcast_to(e.reshape(e.shape + (1,) * (v.ndim - e.ndim)), v.shape)
                  for v, e in zip(leaves, jax.tree.leaves(mask.elements))]
    return jax.tree.unflatten(jax.tree.structure(tree), leaves)


def expand_variables(structure: ModelStructure, mask: Mask, variables: dict) -> dict:
    """:func:`expand` over every collection of a variables dict.

    Args:
      structure: the model's layers (``model.structure``, a :class:`~fedpartial.ModelStructure`).
      mask: one client's mask (no leading axis).
      variables: one model's variables dict.

    Returns:
      A dict of bool trees shaped as ``variables``.
    """
    return {c: expand(structure, mask, t, c) for c, t in variables.items()}


def input_scale(structure: ModelStructure, unit_scale: Sequence[jax.Array], tree: Any) -> Any:
    """Per-element multipliers implementing dropout in the forward pass (one client).

    ``unit_scale[l]`` is ``[units_l]``: 0 for a dropped unit, ``1/(1-d)`` (inverted
    dropout) or 1 for a kept one.  Every weight *reading* a unit is multiplied by
    that unit's scale, so a dropped unit contributes exactly nothing downstream
    and kept units are rescaled.  Leaves without a wired input axis get 1.
    """
    ones_layers = jnp.ones((structure.num_layers,))
    ones_units = tuple(jnp.ones((u,)) for u in structure.units)
    flat = leaf_paths(tree)
    leaves = [
        _leaf_values(structure, "params", path, jnp.shape(leaf), ones_layers, ones_units,
                     unit_scale, jnp.multiply).astype(jnp.result_type(leaf))
        for path, leaf in flat
    ]
    return jax.tree.unflatten(jax.tree.structure(tree), leaves)


def submodel_scale(structure: ModelStructure, submodel: Mask, params: Any,
                   unit_scale: Sequence[jax.Array] | None = None) -> Any:
    """Forward multipliers that run one client's sub-model (dropped units contribute nothing).

    ``submodel`` says which neurons exist; ``unit_scale`` optionally rescales the
    kept ones (``[units_l]`` per layer, e.g. inverted dropout).  The classifier's
    output units always exist and are never rescaled.
    """
    kept = protect_output(submodel).neurons
    if unit_scale is None:
        scales = tuple(n.astype(jnp.float32) for n in kept)
    else:
        scales = tuple(jnp.where(n, s, 0.0) for n, s in zip(kept, unit_scale))
    scales = (*scales[:-1], jnp.ones_like(scales[-1]))
    return input_scale(structure, scales, params)


#: bytes one position of a sparse leaf's element costs when sent as an index (int32)
INDEX_BYTES = 4


def position_bytes(size: int, count: jax.Array) -> jax.Array:
    """Bytes that say where ``count`` on-elements of a leaf of ``size`` elements are: a bitmap (one bit an
    element) or their indices (``INDEX_BYTES`` each), whichever is smaller.

    Args:
      size: the leaf's number of elements.
      count: how many of them are on.

    Returns:
      The bytes, as ``count``'s shape.
    """
    return jnp.minimum(-(-size // 8), INDEX_BYTES * count)


def _element_counts(structure: ModelStructure, mask: Mask, leaves, positions: bool) -> list[jax.Array]:
    """:func:`_layer_counts` of the ``params`` leaves under a mask with an element level, counted on the
    expanded mask one client at a time; with ``positions``, a sparse leaf also costs :func:`position_bytes`."""
    batch = mask.layers.shape[:-1]
    _check_leaf_paths([path for path, _ in leaf_paths(mask.elements)], [path for _, path, _, _ in leaves])
    rows = jax.tree.map(lambda a: a.reshape((-1,) + a.shape[len(batch):]), mask)

    def one(m: Mask) -> jax.Array:
        per_layer = [jnp.zeros((), jnp.int32) for _ in range(structure.num_layers)]
        for (collection, path, shape, weight), e in zip(leaves, jax.tree.leaves(m.elements)):
            on = _leaf_values(structure, collection, path, shape, m.layers, m.neurons, m.neurons, jnp.logical_and,
                              m.inputs, m.norms) & jnp.broadcast_to(e.reshape(e.shape + (1,) * (len(shape) - e.ndim)),
                                                                     shape)
            count = jnp.sum(on, dtype=jnp.int32)
            total = count * weight
            if positions and e.ndim == len(shape):  # a sparse leaf: its values and where they are
                total = total + position_bytes(math.prod(shape), count)
            layer = structure.role(collection, path).layer
            per_layer[layer] = per_layer[layer] + total
        return jnp.stack(per_layer)

    counts = jax.vmap(one)(rows).reshape((*batch, structure.num_layers))
    return [counts[..., layer] for layer in range(structure.num_layers)]


def _layer_counts(structure: ModelStructure, mask: Mask, leaves, xp=jnp, positions: bool = False) -> list[jax.Array]:
    """Per layer, ``[...]`` int32: the on-elements of ``leaves`` (``(collection, path, shape, weight)``, each
    element counting ``weight``) under ``mask``, exactly and without expanding.

    A leaf's count is ``on · n_out · n_in · (its other axes)``, where only ``on`` (its layer, and its
    normaliser's bit), ``n_out`` (its layer's on units) and ``n_in`` (the on units feeding the layer) depend
    on the mask.  So the leaves are grouped by layer and by which of those factors they take, their static
    sizes summed, and each factor is computed once per layer: a handful of operations per layer, not per
    leaf, in every round's traffic metrics.  ``xp=np`` counts a host mask on the host.  Under a mask with an
    element level the ``params`` leaves are counted on the expanded mask instead (:func:`_element_counts`;
    ``positions``: with their positions' bytes)."""
    if mask.elements is not None:
        params = [leaf for leaf in leaves if leaf[0] == "params"]
        rest = [leaf for leaf in leaves if leaf[0] != "params"]
        element = _element_counts(structure, mask, params, positions) if params else None
        others = _layer_counts(structure, mask._replace(elements=None), rest, xp)
        return others if element is None else [a + b for a, b in zip(others, element)]
    groups: dict[tuple[int, bool, bool], int] = {}
    for collection, path, shape, weight in leaves:
        role = structure.role(collection, path)
        spec = structure.layers[role.layer]
        wired = (role.has_input_axis or role.on_input) and not (
            spec.feeds_from is None and (mask.inputs is None or mask.inputs[role.layer].shape[-1] == 0))
        if role.on_input:  # a pre-norm's leaf: input units on its last axis, no output units
            static = math.prod(shape[:-1] if wired else shape) * weight
        elif not role.units_axis:  # a whole-layer leaf: every element, on with its layer
            static = math.prod(shape) * weight
        else:
            static = math.prod(shape[:-2] if wired else shape[:-1]) * weight  # an unwired input axis: all rows
        key = (role.layer, bool(role.norm and mask.norms is not None), wired, role.on_input, role.units_axis)
        groups[key] = groups.get(key, 0) + static
    batch = mask.layers.shape[:-1]
    per_layer = [xp.zeros(batch, xp.int32) for _ in range(structure.num_layers)]
    n_out: dict[int, jax.Array] = {}
    n_in: dict[int, jax.Array] = {}
    for (layer, norm, wired, on_input, units_axis), static in sorted(groups.items()):
        on = mask.layers[..., layer]
        if norm:
            on = on & mask.norms[..., layer]
        if not units_axis:
            per_layer[layer] = per_layer[layer] + on.astype(xp.int32) * static
            continue
        if layer not in n_out:
            n_out[layer] = xp.sum(mask.neurons[layer], axis=-1, dtype=xp.int32)
        count = on.astype(xp.int32) if on_input else on.astype(xp.int32) * n_out[layer]
        if wired:
            if layer not in n_in:
                spec = structure.layers[layer]
                if spec.feeds_from is None:  # explicitly wired
                    feeding = mask.inputs[layer]
                    n_in[layer] = (spec.fan_in // feeding.shape[-1]) * xp.sum(feeding, axis=-1, dtype=xp.int32)
                else:
                    feeding = mask.neurons[spec.feeds_from] if mask.inputs is None else mask.inputs[layer]
                    n_in[layer] = spec.input_tile * xp.sum(feeding, axis=-1, dtype=xp.int32)
            count = count * n_in[layer]
        per_layer[layer] = per_layer[layer] + count * static
    return per_layer


def _leaves(tree: Any, collection: str, itemsize: bool = False):
    return [(collection, path, jnp.shape(leaf), jnp.dtype(leaf.dtype).itemsize if itemsize else 1)
            for path, leaf in leaf_paths(tree)]


def _byte_leaves(variables: dict, collections: Sequence[str]):
    """:func:`_leaves` of the named collections, each element weighing its dtype's bytes."""
    return [leaf for c in collections for leaf in _leaves(variables.get(c, {}), c, itemsize=True)]


def count_elements(structure: ModelStructure, mask: Mask, tree: Any, collection: str = "params") -> jax.Array:
    """Exact number of on-elements of ``tree`` under ``mask``, per leading index, without expanding.

    ``tree`` holds one model (no client axis); the mask may carry leading axes.

    Args:
      structure: the model's layers (``model.structure``, a :class:`~fedpartial.ModelStructure`).
      mask: the mask, any leading axes.
      tree: one model's variables of ``collection``.
      collection: the variables collection ``tree`` belongs to.

    Returns:
      The count, shaped as the mask's leading axes.
    """
    return sum(_layer_counts(structure, mask, _leaves(tree, collection)))


def count_bytes(structure: ModelStructure, mask: Mask, variables: dict, collections: Sequence[str]) -> jax.Array:
    """Bytes of the on-elements of the named collections (exact, from the leaves' dtypes); a sparse leaf of an
    element mask also sends where its elements are (:func:`position_bytes`).

    Args:
      structure: the model's layers (``model.structure``, a :class:`~fedpartial.ModelStructure`).
      mask: the mask, any leading axes.
      variables: one model's variables dict.
      collections: the collections counted (e.g. ``("params",)``).

    Returns:
      The bytes, shaped as the mask's leading axes.
    """
    return sum(_layer_counts(structure, mask, _byte_leaves(variables, collections), positions=True))


def whole_model_bytes_per_layer(structure: ModelStructure, variables: dict, collections: Sequence[str]) -> np.ndarray:
    """``[L]`` int32 on the host: :func:`count_bytes_per_layer` of the full mask (what a client downloading
    the whole model receives), known before anything runs, so a round adds no operations for it."""
    whole = Mask(layers=np.ones(structure.num_layers, bool), neurons=tuple(np.ones(u, bool) for u in structure.units))
    return np.stack(_layer_counts(structure, whole, _byte_leaves(variables, collections), xp=np)).astype(np.int32)


def count_bytes_per_layer(structure: ModelStructure, mask: Mask, variables: dict,
                          collections: Sequence[str]) -> jax.Array:
    """:func:`count_bytes` split by layer, ``[..., L]`` int32.

    One layer's bytes fit int32 for any model that fits a device; a cohort's total
    need not (128 clients × 26 MB overflows it), so totals are summed on the host
    in int64 (:func:`~fedpartial.traffic_totals`).

    Args:
      structure: the model's layers (``model.structure``, a :class:`~fedpartial.ModelStructure`).
      mask: the mask, any leading axes.
      variables: one model's variables dict.
      collections: the collections counted.

    Returns:
      ``[..., L]`` int32 bytes.
    """
    return jnp.stack(_layer_counts(structure, mask, _byte_leaves(variables, collections), positions=True), axis=-1)


def layer_densities(structure: ModelStructure, mask: Mask, params: Any) -> jax.Array:
    """``[..., L]`` float32: each layer's on-elements of ``params`` under ``mask`` over its elements (its kept share;
    the device model's sparse credit, ``--sparse-flops``)."""
    leaves = _leaves(params, "params")
    on = _layer_counts(structure, mask, leaves)
    total = [sum(math.prod(shape) for c, path, shape, _ in leaves if structure.role(c, path).layer == layer)
             for layer in range(structure.num_layers)]
    return jnp.stack([o.astype(jnp.float32) / max(t, 1) for o, t in zip(on, total)], axis=-1)


def keep_count(fraction: float, units: int) -> int:
    """``max(1, round(fraction · units))``, rounding halves up (2.5 → 3, not Python's 2).

    Args:
      fraction: the kept fraction, in (0, 1].
      units: the layer's units.

    Returns:
      The number of units kept.

    Raises:
      ValueError: ``fraction`` outside (0, 1].

    Examples:
      >>> from fedpartial import masks
      >>> masks.keep_count(0.25, 10)
      3
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"a kept fraction must be in (0, 1], got {fraction}.")
    # p·u in float can land a hair below an exact half (0.35·90 = 31.499…96): snap first.
    return max(1, int(math.floor(round(fraction * units, 9) + 0.5)))


def mask_storage_bytes(mask: Mask) -> int:
    """Bytes a stored (structured) mask occupies."""
    return sum(int(leaf.size) * leaf.dtype.itemsize for leaf in jax.tree.leaves(mask))
