"""LoRA as a model transform: low-rank adapters on a model's Dense layers over a frozen base.

:func:`lora` wraps a model: every targeted Dense layer (kernel ``W [in, out]``, bias ``b``) gets two factors,
``A [in, r]`` (random) and ``B [r, out]`` (zeros), and computes ``y = x W + b + (α/r)·(x A) B``.  In the papers'
column-vector notation (``h = W₀x + (α/r)·B A x``, ``B`` out × r zero-initialised, ``A`` r × in random) these are
the transposes: Flax keeps a kernel as ``[in, out]``, so here ``ΔW = (α/r)·A B`` is ``[in, out]`` too.

Where the variables live:

* ``params``: the adapters, as two layers per targeted Dense, ``<name>/lora_a`` (a kernel ``[in, r]``: its units
  are the ``r`` rank components) and ``<name>/lora_b`` (a kernel ``[r, out]``, its input axis fed by ``lora_a``'s
  units), plus the output layer (the classifier head) unless ``train_head=False``.  These are the model's layers
  (``model.structure``), so every mask, traffic count and method reads them like any other layer: a neuron mask
  over ``lora_a``'s units selects rank components, of A's columns and B's rows at once.
* ``frozen`` (:data:`~fedpartial._src.core.structure.FROZEN`): everything else — the targeted kernels and biases,
  embeddings, normalisers, untargeted layers.  No client trains it; the round holds it once and hands it unstacked
  to every client's forward pass (docs/lora.md).
* ``batch_stats``: as in the wrapped model.

The forward pass never forms ``W + ΔW`` per client (that would be a client-sized copy of the base): the base
layer runs on ``x`` and the adapter adds ``(x A) B``.  :func:`merge_adapters` forms it once, for evaluation or export.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Mapping
from typing import Any, NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from fedpartial._src.core import masks as masks_lib
from fedpartial._src.core.errors import UserError
from fedpartial._src.core.fielddocs import document_fields
from fedpartial._src.core.structure import FROZEN, Layer, LeafRole, ModelStructure, Path, leaf_paths
from fedpartial._src.models.adapter import Model

#: the default targets of a transformer (layers named ``block{i}/attn/query|key|value|out`` and
#: ``block{i}/mlp/fc1|fc2``): every block's attention projections and MLP
TRANSFORMER_TARGETS = ("*attn/query", "*attn/key", "*attn/value", "*attn/out", "*mlp/fc1", "*mlp/fc2")
A_NAME, B_NAME = "lora_a", "lora_b"


@document_fields
class Adapter(NamedTuple):
    """One targeted Dense layer's adapter pair.

    Attributes:
      target: the wrapped layer's name (``"block0/attn/query"``).
      path: its module path.
      a_layer: the index of its A layer (``<target>/lora_a``, units: the rank components) in the structure.
      b_layer: the index of its B layer (``<target>/lora_b``, units: the wrapped layer's outputs).
      fan_in: the wrapped layer's inputs.
      units: the wrapped layer's outputs.
    """

    target: str
    path: Path
    a_layer: int
    b_layer: int
    fan_in: int
    units: int


@dataclasses.dataclass(frozen=True, eq=False)
class LoraSpec:
    """What :func:`lora` did to a model (``model.lora``).

    Attributes:
      rank: every adapter's rank ``r`` (the units of each A layer).
      alpha: the scaling numerator; an adapter adds ``(alpha / rank)·(x A) B``.
      adapters: the adapter pairs, input to output (:class:`Adapter`).
      base: the wrapped model (what :func:`merge_adapters` returns variables for).
      train_head: whether the output layer trains (else it is part of the frozen base).
      ranks: heterogeneous rank tiers (``--lora-ranks``, :func:`~fedpartial.models.with_lora_ranks`): clients in
        equal groups by id train the first ``ranks[t]`` rank components; None: every client the full rank.
    """

    rank: int
    alpha: float
    adapters: tuple[Adapter, ...]
    base: Model
    train_head: bool = True
    ranks: tuple[int, ...] | None = None

    @property
    def scale(self) -> float:
        """``alpha / rank``."""
        return self.alpha / self.rank

    @property
    def a_layers(self) -> tuple[int, ...]:
        """Every adapter's A layer index."""
        return tuple(a.a_layer for a in self.adapters)

    @property
    def b_layers(self) -> tuple[int, ...]:
        """Every adapter's B layer index."""
        return tuple(a.b_layer for a in self.adapters)

    def pairs(self, params: Any) -> list[tuple[Adapter, jax.Array, jax.Array]]:
        """``(adapter, A, B)`` for every adapter of ``params`` (a LoRA model's ``params``; any leading axes)."""
        out = []
        for adapter in self.adapters:
            node = params
            for key in adapter.path:
                node = node[key]
            out.append((adapter, node[A_NAME]["kernel"], node[B_NAME]["kernel"]))
        return out

    def delta(self, params: Any) -> list[jax.Array]:
        """Every adapter's ``ΔW = (α/r)·A B`` (``[..., in, out]``)."""
        return [self.scale * jnp.matmul(a, b) for _, a, b in self.pairs(params)]

    def rank_mask(self, structure: ModelStructure, ranks: Any) -> masks_lib.Mask:
        """A mask (leading axes: ``ranks``'s) keeping the first ``ranks[k]`` rank components of every adapter
        (A's leading columns and, through the wiring, B's leading rows); every other unit and layer on."""
        ranks = jnp.asarray(ranks, jnp.int32)
        a_layers = set(self.a_layers)
        neurons = tuple(
            jnp.arange(u).reshape((1,) * ranks.ndim + (u,)) < ranks[..., None] if i in a_layers
            else jnp.ones((*ranks.shape, u), bool)
            for i, u in enumerate(structure.units))
        return masks_lib.Mask(layers=jnp.ones((*ranks.shape, structure.num_layers), bool), neurons=neurons)


def default_targets(model: Model) -> tuple[str, ...]:
    """The layers :func:`lora` wraps when no targets are given: a transformer's attention projections and MLP
    (layers named ``…attn/query|key|value|out`` and ``…mlp/fc1|fc2``), otherwise every Dense layer but the
    output layer."""
    names = [layer.name for layer in model.structure.layers]
    picked = [n for n in names if any(fnmatch.fnmatchcase(n, t) for t in TRANSFORMER_TARGETS)]
    if picked:
        return tuple(picked)
    return tuple(layer.name for layer in model.structure.layers[:-1] if layer.kind == "dense")


def _resolve_targets(model: Model, targets: Sequence[str] | None) -> tuple[str, ...]:
    if model.lora is not None:
        raise UserError(f"model {model.name} already has LoRA adapters; wrap the model once.")
    names = [layer.name for layer in model.structure.layers]
    if targets is None:
        chosen = default_targets(model)
    else:
        chosen = []
        for pattern in targets:
            hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
            if not hits:
                raise UserError(f"LoRA target {pattern!r} matches no layer of {model.name}; its layers are "
                                f"{', '.join(names)}.")
            chosen += [h for h in hits if h not in chosen]
    chosen = [n for n in names if n in chosen]  # input to output
    if not chosen:
        raise UserError(f"model {model.name} has no Dense layer to put LoRA adapters on; name the layers with "
                        "--lora-targets.")
    return tuple(chosen)


def _check_dense(model: Model, targets: tuple[str, ...]) -> None:
    """Refuses a target that is not a flax.linen Dense called on the model's forward pass."""
    seen: dict[str, str] = {}

    def record(next_fun, args, kwargs, context):
        if context.method_name == "__call__":
            kind = "Dense" if isinstance(context.module, nn.Dense) else type(context.module).__name__
            seen.setdefault("/".join(context.module.path), kind)
        return next_fun(*args, **kwargs)

    variables = jax.eval_shape(model.init_variables, jax.random.key(0))
    with nn.intercept_methods(record):
        jax.eval_shape(lambda v: model.apply(v, jnp.zeros((1, *model.input_shape), jnp.float32), False), variables)
    for name in targets:
        if seen.get(name) != "Dense":
            what = "is not called through flax.linen (an nnx model?)" if not seen else \
                f"is a {seen.get(name, 'module not called')}, not a flax.linen Dense"
            raise UserError(f"LoRA target {name} {what}; LoRA wraps flax.linen Dense layers.")


def lora(model: Model, rank: int, *, alpha: float | None = None, targets: Sequence[str] | None = None,
         train_head: bool = True) -> Model:
    """``model`` with LoRA adapters of rank ``rank`` on its targeted Dense layers, over a frozen base.

    Args:
      model: a zoo model or a :func:`~fedpartial.models.from_linen` model (its targets flax.linen Dense layers).
      rank: the adapters' rank ``r`` (≥ 1, at most the smaller side of every targeted kernel).
      alpha: the scaling numerator (default: ``rank``, so ``α/r = 1``).
      targets: layer names or globs (``"block*/attn/*"``); default: a transformer's attention projections and MLP
        (layers named ``…attn/query|key|value|out`` and ``…mlp/fc1|fc2``), else every Dense layer but the output.
      train_head: the output layer trains with the adapters (default); False: it joins the frozen base.

    Returns:
      The LoRA model (``model.lora`` says where its adapters are; :func:`merge_adapters` folds them into the base).

    Raises:
      UserError: a bad rank, a target that matches nothing or is not a Dense layer.
    """
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 1:
        raise UserError(f"LoRA rank {rank!r} must be a whole number of at least 1.")
    alpha = float(rank if alpha is None else alpha)
    if not alpha > 0:
        raise UserError(f"LoRA alpha {alpha:g} must be positive.")
    targets = _resolve_targets(model, targets)
    _check_dense(model, targets)
    inner = model.structure
    by_name = {layer.name: i for i, layer in enumerate(inner.layers)}
    sides = {n: min(inner.layers[by_name[n]].fan_in or 0, inner.layers[by_name[n]].units) for n in targets}
    too_big = [n for n in targets if rank > sides[n]]
    if too_big:
        raise UserError(f"LoRA rank {rank} is larger than layer {too_big[0]}'s inputs or outputs; use a rank of at "
                        f"most {sides[too_big[0]]}.")
    head = inner.num_layers - 1
    layers, stage_of, adapters = [], [], []
    new_index: dict[int, int] = {}  # inner layer -> the new layer its frozen leaves count under
    for i, spec in enumerate(inner.layers):
        if spec.name in targets:
            a_index = len(layers)
            layers.append(Layer(name=f"{spec.name}/{A_NAME}", path=(*spec.path, A_NAME), units=rank,
                                fan_in=spec.fan_in, feeds_from=None, input_tile=1))
            layers.append(Layer(name=f"{spec.name}/{B_NAME}", path=(*spec.path, B_NAME), units=spec.units,
                                fan_in=rank, feeds_from=a_index, input_tile=1))
            stage_of += [model.stage_of_layer[i]] * 2
            adapters.append(Adapter(spec.name, spec.path, a_index, a_index + 1, spec.fan_in, spec.units))
            new_index[i] = a_index + 1
        elif i == head and train_head:
            new_index[i] = len(layers)
            layers.append(dataclasses.replace(spec, feeds_from=None, input_tile=1))
            stage_of.append(model.stage_of_layer[i])
    trained_layers = {i for i in new_index if inner.layers[i].name not in targets}
    for i in range(inner.num_layers):  # a frozen layer's leaves count under the next layer that trains
        if i not in new_index:
            later = [new_index[j] for j in range(i, inner.num_layers) if j in new_index]
            new_index[i] = later[0] if later else len(layers) - 1

    variables = jax.eval_shape(model.init_variables, jax.random.key(0))
    roles: dict[str, dict[Path, LeafRole]] = {"params": {}, FROZEN: {}}
    for path, leaf in leaf_paths(variables.get("params", {})):
        role = inner.role("params", path)
        if role.layer in trained_layers:
            roles["params"][path] = LeafRole(layer=new_index[role.layer], has_input_axis=False, norm=role.norm,
                                             on_input=role.on_input, units_axis=role.units_axis)  # (a pre-norm)
        else:
            roles[FROZEN][path] = LeafRole(layer=new_index[role.layer], has_input_axis=False, units_axis=False)
    for adapter in adapters:
        roles["params"][(*adapter.path, A_NAME, "kernel")] = LeafRole(layer=adapter.a_layer, has_input_axis=False)
        roles["params"][(*adapter.path, B_NAME, "kernel")] = LeafRole(layer=adapter.b_layer, has_input_axis=True)
    for collection, tree in variables.items():
        if collection == "params":
            continue
        coll = roles.setdefault(collection, {})
        for path, leaf in leaf_paths(tree):
            role = inner.role(collection, path)
            layer = new_index[role.layer]
            coll[path] = LeafRole(layer=layer, has_input_axis=False, norm=role.norm,
                                  units_axis=role.units_axis and np.shape(leaf)[-1:] == (layers[layer].units,))
    structure = ModelStructure(layers=tuple(layers), roles=roles, sequential=False)
    spec = LoraSpec(rank=int(rank), alpha=alpha, adapters=tuple(adapters), base=model, train_head=train_head)
    frozen_paths = frozenset(roles[FROZEN])

    def init(key, x):
        inner_vars = model.init(key, x)
        params, frozen = {}, {}
        for path, leaf in leaf_paths(inner_vars.get("params", {})):
            _put(frozen if path in frozen_paths else params, path, leaf)
        for n, adapter in enumerate(adapters):
            a_key = jax.random.fold_in(jax.random.fold_in(key, 0x10A), n)
            dtype = _get(frozen, (*adapter.path, "kernel")).dtype
            a = nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform")(a_key, (adapter.fan_in, rank), dtype)
            _put(params, (*adapter.path, A_NAME, "kernel"), a)
            _put(params, (*adapter.path, B_NAME, "kernel"), jnp.zeros((rank, adapter.units), dtype))
        return {**inner_vars, "params": params, FROZEN: frozen}

    def split(variables):
        """The wrapped model's variables (base in place) and the adapters by module path."""
        params = dict(variables.get("params", {}))
        found = {}
        for adapter in adapters:
            node = _get(params, adapter.path, None)
            if isinstance(node, Mapping) and A_NAME in node:
                found[adapter.path] = (node[A_NAME]["kernel"], node[B_NAME]["kernel"])
        inner_params: dict = {}
        for path, leaf in leaf_paths(params):
            if not (len(path) >= 3 and path[-2] in (A_NAME, B_NAME) and path[:-2] in found):
                _put(inner_params, path, leaf)
        for path, leaf in leaf_paths(variables.get(FROZEN, {})):
            _put(inner_params, path, leaf)
        rest = {c: t for c, t in variables.items() if c not in ("params", FROZEN)}
        return {**rest, "params": inner_params}, found

    def adapted(found):
        def interceptor(next_fun, args, kwargs, context):
            if context.method_name == "__call__" and tuple(context.module.path) in found:
                a, b = found[tuple(context.module.path)]
                y = next_fun(*args, **kwargs)
                x = jnp.asarray(args[0]).astype(a.dtype)
                # on 2-D operands: the rank-r gradient products of a [B, T, in] dot ran several times slower
                delta = jnp.matmul(jnp.matmul(x.reshape(-1, x.shape[-1]), a), b).reshape(*x.shape[:-1], b.shape[-1])
                return y + (spec.scale * delta).astype(y.dtype)
            return next_fun(*args, **kwargs)
        return nn.intercept_methods(interceptor)

    def apply(variables, x, train, example_mask=None):
        inner_vars, found = split(variables)
        with adapted(found):
            return model.apply(inner_vars, x, train, example_mask)

    def run_stages(variables, x, start, stop, train, example_mask=None):
        inner_vars, found = split(variables)
        with adapted(found):
            return model.apply_stages(inner_vars, x, start=start, stop=stop, train=train, example_mask=example_mask)

    return Model(name=f"{model.name}+lora{rank}", init=init, apply=apply, structure=structure,
                 input_shape=model.input_shape, num_classes=model.num_classes, stage_names=model.stage_names,
                 stage_of_layer=tuple(stage_of), run_stages=run_stages if model.num_stages > 1 else None,
                 lora=spec)


def merge_adapters(model: Model, variables: dict) -> dict:
    """The wrapped model's variables with every adapter folded into its kernel, ``W + (α/r)·A B``: the base
    model (``model.lora.base``) computes with them what ``model`` computes with ``variables``.

    Args:
      model: a :func:`lora` model.
      variables: its variables (no client axis).

    Returns:
      Variables of ``model.lora.base``.
    """
    spec = _spec(model)
    merged = {c: t for c, t in variables.items() if c not in ("params", FROZEN)}
    params: dict = {}
    adapter_paths = {a.path for a in spec.adapters}
    for path, leaf in leaf_paths(variables.get("params", {})):
        if not (len(path) >= 3 and path[-2] in (A_NAME, B_NAME) and path[:-2] in adapter_paths):
            _put(params, path, leaf)
    for path, leaf in leaf_paths(variables.get(FROZEN, {})):
        _put(params, path, leaf)
    for (adapter, _, _), delta in zip(spec.pairs(variables["params"]), spec.delta(variables["params"])):
        kernel = _get(params, (*adapter.path, "kernel"))
        _put(params, (*adapter.path, "kernel"), kernel + delta.astype(kernel.dtype))
    return {**merged, "params": params}


def merge_into_base(model: Model, variables: dict, *, key: jax.Array | None = None) -> dict:
    """``variables`` with every adapter folded into the frozen base (``W ← W + (α/r)·A B``) and fresh adapters:
    B zeros, A unchanged, or drawn afresh from ``key`` (the model computes the same either way, as B is zero).

    Args:
      model: a :func:`lora` model.
      variables: its variables (no client axis).
      key: draws new A factors when given.

    Returns:
      The model's variables.
    """
    spec = _spec(model)
    params = jax.tree.map(lambda a: a, variables["params"])
    frozen = jax.tree.map(lambda a: a, variables[FROZEN])
    fresh = None if key is None else model.init_variables(key)["params"]
    for (adapter, _, b), delta in zip(spec.pairs(variables["params"]), spec.delta(variables["params"])):
        kernel = _get(frozen, (*adapter.path, "kernel"))
        _put(frozen, (*adapter.path, "kernel"), kernel + delta.astype(kernel.dtype))
        _put(params, (*adapter.path, B_NAME, "kernel"), jnp.zeros_like(b))
        if fresh is not None:
            _put(params, (*adapter.path, A_NAME, "kernel"), _get(fresh, (*adapter.path, A_NAME, "kernel")))
    return {**variables, "params": params, FROZEN: frozen}


def _spec(model: Model) -> LoraSpec:
    if model.lora is None:
        raise UserError(f"model {model.name} has no LoRA adapters; wrap it with lora(model, rank=...) (--lora RANK).")
    return model.lora


_MISSING = object()


def _get(tree: Any, path: Path, default: Any = _MISSING) -> Any:
    node = tree
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            if default is _MISSING:
                raise KeyError("/".join(path))
            return default
        node = node[key]
    return node


def _put(tree: dict, path: Path, leaf: Any) -> None:
    """Sets ``tree[path] = leaf``, copying the dicts on the way (never mutating a dict another tree shares)."""
    node = tree
    for key in path[:-1]:
        child = node.get(key)
        child = dict(child) if isinstance(child, Mapping) else {}
        node[key] = child
        node = child
    node[path[-1]] = leaf
