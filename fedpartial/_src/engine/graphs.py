"""Local graphs: how a client group sees the model during local training.

A :class:`~fedpartial._src.core.types.LocalGraph` is four pure functions.  :func:`whole` is
the default (the whole model, nothing cut).  :func:`suffix` is EmbracingFL's weak
client: stages ``[0, cut)`` are frozen and run *once per round* over the client's
whole local data (``prepare``), and every local step runs, differentiates and
updates only stages ``[cut, end)`` — its compiled step contains no prefix at all.
:func:`exits_prefix` is the opposite cut, DepthFL's: a client of depth ``d`` holds and
trains stages ``[0, d)`` and the exits after them, nothing deeper.

Any graph whose ``extract`` is a pytree selection or slice (e.g. HeteroFL's
leading channels) fits the same slot: the engine expands masks in full-model
coordinates and cuts them with ``extract``, and writes trained values back with
``insert``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedpartial._src.core.structure import leaf_paths
from fedpartial._src.core.types import Batch, LocalGraph
from fedpartial._src.models import narrow
from fedpartial._src.models.adapter import Model


def whole(model: Model) -> LocalGraph:
    """The whole model: extract and insert are the identity, no preparation."""
    return LocalGraph(extract=lambda tree: tree, insert=lambda full, part: part, apply=model.apply)


def merge_subtree(full: Any, part: Any) -> Any:
    """``full`` with every leaf present in the nested dict ``part`` replaced by ``part``'s."""
    if not isinstance(part, dict):
        return part
    out = dict(full)
    for name, sub in part.items():
        out[name] = merge_subtree(full[name], sub) if isinstance(full.get(name), dict) else sub
    return out


def suffix(model: Model, cut: int) -> LocalGraph:
    """Train stages ``[cut, end)`` only, on prefix activations prepared once per round.

    ``prepare`` runs the frozen prefix batch by batch in train mode, as a full forward
    pass of local training would (a prefix BatchNorm normalises with the batch's own
    statistics over its real examples; its running statistics are not updated, as the
    prefix is frozen), so the result equals training the whole model with the prefix
    frozen by a train mask.  ``cut == 0`` is :func:`whole`.
    """
    if not 0 <= cut < model.num_stages:
        raise ValueError(
            f"cut stage {cut} must be between 0 and {model.num_stages - 1} (model {model.name} has stages "
            f"{', '.join(model.stage_names)}).")
    if cut == 0:
        return whole(model)

    def extract(tree):
        return model.stage_variables(tree, cut)

    def prepare(variables: dict, data: Batch, batch_statistics: bool) -> Batch:
        del batch_statistics  # local training always normalises with batch statistics

        def one(x, mask):
            out, _ = model.apply_stages(variables, x, start=0, stop=cut, train=True, example_mask=mask)
            return out

        h = jax.vmap(one)(data.x, data.example_mask)  # [S, B, ...] one batch at a time
        return data._replace(x=jax.lax.stop_gradient(h))

    def apply(variables, x, train, example_mask=None):
        return model.apply_stages(variables, x, start=cut, train=train, example_mask=example_mask)

    return LocalGraph(extract=extract, insert=merge_subtree, apply=apply, prepare=prepare)


def exits_prefix(model: Model, stop: int) -> LocalGraph:
    """A depth tier's graph: stages ``[0, stop)`` and the exits after them (a
    :class:`~fedpartial._src.models.exits.MultiExitModel`); its forward pass returns every held
    exit's logits, ``[E', B, C]``, shallow to deep.  Nothing past ``stop`` is in the compiled step."""
    if not 1 <= stop <= model.num_stages or not model.exits_within(stop):
        raise ValueError(f"stages [0, {stop}) of {model.name} are not a prefix holding an exit.")

    def apply(variables, x, train, example_mask=None):
        return model.exit_logits(variables, x, stop=stop, train=train, example_mask=example_mask)

    return LocalGraph(extract=lambda tree: model.stage_variables(tree, 0, stop), insert=merge_subtree, apply=apply)


def map_inputs(graph: LocalGraph, fn: Callable[[jax.Array], jax.Array]) -> LocalGraph:
    """``graph`` fed ``fn(x)`` instead of a client's raw inputs ``x`` (e.g. the first half of every sequence).

    ``fn`` runs once per round on the client's whole local data ``[S, B, ...]``,
    before the graph's own preparation; it must act on the trailing example axes
    only and may change their shape (each client group compiles for its own).
    """

    def prepare(variables: dict, data: Batch, batch_statistics: bool) -> Batch:
        data = data._replace(x=fn(data.x))
        return data if graph.prepare is None else graph.prepare(variables, data, batch_statistics)

    return graph._replace(prepare=prepare)


# ---- width reduction (HeteroFL / FjORD) ---------------------------------------------------------


@functools.lru_cache(maxsize=64)
def narrow_model(model: Model, ratio: float, *, module: nn.Module | None = None, scaler: bool = True) -> Model:
    """The physically smaller ``model`` a :func:`width` graph runs: ``⌈ratio·C⌉`` hidden channels/units
    (:func:`fedpartial._src.models.narrow.narrowed_model`).

    One model per arguments, so the graph and a method's masks built from it share its compilations.
    Its variables are the full model's leading channels/units (see :func:`width`); the classifier keeps
    every class.  ``scaler``: hidden Conv/Dense outputs are multiplied by ``1/ratio`` in training
    (HeteroFL's Scaler).  ``module``: the zoo module ``model`` was built from (default: ``model``'s
    own ``at_width``, else the registry's model named ``model.name``, checked against ``model``'s
    variables).

    Raises:
      UserError: ``model`` cannot be narrowed (neither a zoo model nor built with ``from_linen(...,
        width=...)``), or ``ratio`` is outside (0, 1].
    """
    return narrow.narrowed_model(model, ratio, module=module, scaler=scaler)


class _Slice(NamedTuple):
    """One leaf's narrow part: ``full.reshape(view)[index]`` (``view`` splits a tiled input axis)."""

    full_shape: tuple[int, ...]
    narrow_shape: tuple[int, ...]
    full_view: tuple[int, ...]
    narrow_view: tuple[int, ...]
    index: tuple[slice, ...]

    def roll(self, view, shift):
        """``view`` (full-view shaped) with every narrowed axis rolled by ``shift`` (None: unchanged)."""
        if shift is None:
            return view
        for axis, (n, f) in enumerate(zip(self.narrow_view, self.full_view)):
            if n < f:
                view = jnp.roll(view, shift, axis=axis)
        return view

    def take(self, full, window=None):
        if isinstance(full, jax.ShapeDtypeStruct):  # shapes only (e.g. from jax.eval_shape)
            return jax.ShapeDtypeStruct(self.narrow_shape, full.dtype)
        view = self.roll(full.reshape(self.full_view), None if window is None else -window)
        return view[self.index].reshape(self.narrow_shape)

    def put(self, full, part, window=None):
        if isinstance(full, jax.ShapeDtypeStruct):
            return full
        full = jnp.asarray(full)
        part = jnp.asarray(part, full.dtype).reshape(self.narrow_view)
        view = self.roll(full.reshape(self.full_view), None if window is None else -window)
        return self.roll(view.at[self.index].set(part), window).reshape(self.full_shape)


def _leaf_slices(model: Model, narrow: Model) -> dict[tuple[str, tuple[str, ...]], _Slice]:
    """Per ``(collection, leaf path)``, where the narrow leaf sits in the full one: the leading entries of
    every axis, except that a kernel reading a flattened conv map (``input_tile`` > 1) keeps the leading
    channels of each of its ``H·W`` row blocks."""
    full_vars = jax.eval_shape(model.init_variables, jax.random.key(0))
    narrow_vars = jax.eval_shape(narrow.init_variables, jax.random.key(0))
    out = {}
    for collection, tree in full_vars.items():
        narrow_leaves = dict(leaf_paths(narrow_vars.get(collection, {})))
        for path, leaf in leaf_paths(tree):
            full_shape, narrow_shape = tuple(leaf.shape), tuple(narrow_leaves[path].shape)
            role = model.structure.role(collection, path)
            spec = model.structure.layers[role.layer]
            tile = spec.input_tile if role.has_input_axis and spec.feeds_from is not None else 1
            full_view, narrow_view = full_shape, narrow_shape
            if tile > 1:  # [..., H·W·C, out] -> [..., H·W, C, out]
                full_view = (*full_shape[:-2], tile, full_shape[-2] // tile, full_shape[-1])
                narrow_view = (*narrow_shape[:-2], tile, narrow_shape[-2] // tile, narrow_shape[-1])
            if len(full_view) != len(narrow_view) or any(n > f for n, f in zip(narrow_view, full_view)):
                raise ValueError(f"{collection}/{'/'.join(path)}: the narrow leaf {narrow_shape} is not a leading "
                                 f"slice of the full leaf {full_shape}.")
            out[collection, path] = _Slice(full_shape, narrow_shape, full_view, narrow_view,
                                           tuple(slice(0, n) for n in narrow_view))
    return out


def width(model: Model, ratio: float, *, module: nn.Module | None = None, scaler: bool = True) -> LocalGraph:
    """Width reduction: train the leading ``⌈ratio·C⌉`` channels/units of every hidden layer, as a smaller model.

    ``extract`` slices one client's variables (``params``, ``batch_stats``, or any
    tree shaped like them: masks, scales, shapes) to the narrow model's leading channels
    on every axis — input axes too, so a kernel keeps the rows of the kept input
    channels, and a Dense reading a flattened conv map keeps, for every spatial
    position, the rows of the kept channels.  ``insert`` writes a narrow tree back
    into the full one; ``apply`` runs :func:`narrow_model`, so the compiled step
    really is smaller (about ``ratio²`` of the FLOPs of a conv/dense stack).
    ``ratio = 1`` is :func:`whole` (with ``scaler``, the Scaler is then 1).

    The graph is windowed: given a client's ``window`` start ``w`` (``ClientPlan.window``), every
    narrowed axis of ``C`` units holds units ``w, w+1, … (mod C)`` instead of the leading ones
    (FedRolex's rolling sub-model; :func:`rolls_units_consistently` says whether that is a
    sub-network of ``model``).
    """
    if ratio == 1:
        return whole(model)
    narrow = narrow_model(model, ratio, module=module, scaler=scaler)
    slices = _leaf_slices(model, narrow)

    def extract(tree, window=None):
        return {c: jax.tree.unflatten(jax.tree.structure(sub), [slices[c, path].take(a, window)
                                                                for path, a in leaf_paths(sub)])
                for c, sub in tree.items()}

    def insert(full, part, window=None):
        out = dict(full)
        for c, sub in part.items():
            leaves = [slices[c, path].put(f, p, window) for (path, f), p in zip(leaf_paths(full[c]),
                                                                                 jax.tree.leaves(sub), strict=True)]
            out[c] = jax.tree.unflatten(jax.tree.structure(full[c]), leaves)
        return out

    return LocalGraph(extract=extract, insert=insert, apply=narrow.apply, windowed=True)


def roll_units(model: Model, ratio: float, variables: dict, shift, *, module: nn.Module | None = None) -> dict:
    """``variables`` with every unit axis a :func:`width` graph of ``ratio`` narrows rolled by ``shift`` (the
    relabelling that moves window ``shift`` to the leading units, negated)."""
    if ratio == 1:
        return variables
    slices = _leaf_slices(model, narrow_model(model, ratio, module=module))
    return {c: jax.tree.unflatten(jax.tree.structure(sub), [
        slices[c, path].roll(jnp.asarray(a).reshape(slices[c, path].full_view), shift).reshape(a.shape)
        for path, a in leaf_paths(sub)]) for c, sub in variables.items()}


@functools.lru_cache(maxsize=64)
def rolls_units_consistently(model: Model, ratio: float, *, module: nn.Module | None = None) -> bool:
    """Whether rolling the units a :func:`width` graph of ``ratio`` narrows leaves ``model``'s function unchanged,
    i.e. whether every rolled window is a sub-network of ``model`` (checked once per arguments, eagerly, on random
    variables and inputs; an option-A ResNet, whose shortcuts place channels at fixed offsets, is not)."""
    if ratio == 1:
        return True
    key = jax.random.key(0, impl="rbg")
    variables = model.init_variables(key)
    x = jax.random.normal(jax.random.fold_in(key, 1), (2, *model.input_shape), jnp.float32)
    before, _ = model.apply(variables, x, False)
    after, _ = model.apply(roll_units(model, ratio, variables, 1, module=module), x, False)
    return bool(jnp.allclose(before, after, rtol=1e-4, atol=1e-5))
