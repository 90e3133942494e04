"""Model heads: MOON's projection head, and reading what a forward pass feeds the classifier.

MOON (Li et al. 2021) trains a network of three parts — a base encoder, a
projection head and an output layer — and contrasts the projection ``z`` of the
local model with those of the global and the previous local model.  Its
``ModelFedCon`` is ``encoder → l1 → ReLU → l2 → classifier``: the classifier
reads the projection.  :func:`with_projection_head` builds that network from any
staged :class:`~fedpartial.models.Model` (every zoo model is staged): the
encoder is every stage but the classifier, kept with its own parameters and
initialisation; the stages ``proj`` and ``head`` are new::

    import jax, jax.numpy as jnp
    from fedpartial._src.models.registry import build_model
    from fedpartial._src.models.adapter import from_linen
    from fedpartial._src.models import heads

    plain = from_linen(build_model("lenet5", 10, (32, 32, 3)), input_shape=(32, 32, 3), num_classes=10,
                       sequential=True)
    model = heads.with_projection_head(plain, dim=256)
    model.stage_names                       # ('conv1', 'conv2', 'fc1', 'fc2', 'proj', 'head')
    variables = model.init_variables(jax.random.key(0))
    x = jnp.zeros((4, 32, 32, 3))
    z, (logits, _) = heads.classifier_input(model, lambda: model.apply(variables, x, False))
    z.shape                                 # (4, 256): the projection the classifier reads

:func:`classifier_input` returns, besides the result of a forward pass, the input
the model's classifier (its last layer) received in it: with a projection head
that is ``z``; without one it is the penultimate representation (MOON's "without
projection head" variant).  It reads the value with a Flax method interceptor,
as :func:`fedpartial.models.from_linen` records layer order and outputs, so it
works inside ``jit``, ``vmap`` and ``grad`` and on any linen-backed model
(zoo, :func:`~fedpartial.models.from_linen`, :func:`~fedpartial.models.from_stages`).
"""

from __future__ import annotations

import math
from typing import Callable, TypeVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedpartial._src.core.errors import UserError
from fedpartial._src.models.adapter import Model, linen_recorder, from_linen
from fedpartial._src.models.zoo import stage_range
from fedpartial._src.core.structure import build_structure

T = TypeVar("T")

#: the stage names :func:`with_projection_head` adds
PROJECTION_STAGES = ("proj", "head")


class ProjectionHead(nn.Module):
    """MOON's projection head: flatten → Dense(hidden) ``l1`` → ReLU → Dense(dim) ``l2`` (no activation after)."""

    hidden: int
    dim: int

    @nn.compact
    def __call__(self, x):
        x = x.reshape((x.shape[0], -1))
        return nn.Dense(self.dim, name="l2")(nn.relu(nn.Dense(self.hidden, name="l1")(x)))


class ProjectedClassifier(nn.Module):
    """Stages ``proj`` (a :class:`ProjectionHead`) and ``head`` (the classifier on the projection)."""

    hidden: int
    dim: int
    num_classes: int

    @property
    def stage_names(self) -> tuple[str, ...]:
        return PROJECTION_STAGES

    @nn.compact
    def __call__(self, x, train: bool = False, start: int = 0, stop: int | None = None):
        del train  # no train-dependent layers
        for s in stage_range(len(PROJECTION_STAGES), start, stop):
            if s == 0:
                x = ProjectionHead(self.hidden, self.dim, name="proj")(x)
            else:
                x = nn.Dense(self.num_classes, name="head")(x)
        return x


def with_projection_head(model: Model, dim: int = 256, hidden: int | None = None) -> Model:
    """``model`` with its classifier replaced by MOON's projection head and a classifier on the projection.

    Args:
      model: a staged model (its last stage is the classifier; every zoo model is).
      dim: the projection's width (MOON's ``out_dim``, 256 in the paper).
      hidden: the width of ``l1``; None: the width of the encoder's (flattened)
        output, as MOON's ``ModelFedCon`` (``l1`` maps ``num_ftrs`` to ``num_ftrs``).
        The encoder's output is flattened as it is: a classifier stage's own pooling
        (ResNet20's global average) is not kept, and an encoder ending in a large
        feature map makes ``l1`` large (CNN2C1F on 28×28 images: 3136², 9.8M
        parameters; LeNet-5's 84 or 8×8 digits' 256 are small) — pass ``hidden`` then.

    Returns:
      A staged model: the encoder's stages, then ``proj`` and ``head``.  Its
      encoder starts from exactly the weights ``model`` would start from with the
      same key (the new stages draw from ``fold_in(key, 1)``).  It is sequential
      when ``model`` is.

    Raises:
      UserError: a single-stage model (the classifier cannot be told from the encoder),
        bad sizes, or an encoder module already named ``proj`` or ``head``.
    """
    if model.num_stages < 2:
        raise UserError(f"model {model.name} is a single stage, so its classifier cannot be replaced by a "
                        "projection head; give a staged model (a zoo model, or one built with from_stages).")
    for name, value in (("dim", dim), ("hidden", hidden)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise UserError(f"projection head {name} = {value!r} must be a positive integer.")
    cut = model.num_stages - 1  # the encoder is stages [0, cut)
    sample = jnp.zeros((1, *model.input_shape), jnp.float32)

    def encoder_shapes():
        enc = model.stage_variables(model.init_variables(jax.random.key(0)), 0, cut)
        return enc, model.apply_stages(enc, sample, stop=cut)[0]

    encoder_vars, features = jax.eval_shape(encoder_shapes)
    width = math.prod(features.shape[1:])
    tail = from_linen(ProjectedClassifier(hidden or width, dim, model.num_classes),
                      input_shape=tuple(features.shape[1:]), num_classes=model.num_classes, sequential=True,
                      name="projected_classifier")
    tail_vars = jax.eval_shape(lambda: tail.init_variables(jax.random.key(0)))
    clash = sorted(set(encoder_vars["params"]) & set(tail_vars["params"]))
    if clash:
        raise UserError(f"model {model.name}'s encoder already has a module named {clash[0]!r}; "
                        "with_projection_head adds 'proj' and 'head'.")
    tail_names = tuple(tail_vars["params"])

    def split(variables):
        """(encoder variables, tail variables) of a full variables tree."""
        enc = {c: {k: v for k, v in tree.items() if k not in tail_names} for c, tree in variables.items()}
        own = {c: {k: v for k, v in tree.items() if k in tail_names} for c, tree in variables.items()}
        return enc, own

    def join(a, b):
        return {c: {**a.get(c, {}), **b.get(c, {})} for c in ("params", "batch_stats")}

    def init(key, x):
        enc = model.stage_variables(model.init(key, x), 0, cut)
        h, _ = model.apply_stages(enc, x, stop=cut)
        return join(enc, tail.init(jax.random.fold_in(key, 1), h))

    def run_stages(variables, x, start, stop, train, example_mask=None):
        enc, own = split(variables)
        enc_stats, own_stats = enc.get("batch_stats", {}), own.get("batch_stats", {})
        if start < cut:
            x, enc_stats = model.apply_stages(enc, x, start=start, stop=min(stop, cut), train=train,
                                              example_mask=example_mask)
        if stop > cut:
            x, own_stats = tail.apply_stages(own, x, start=max(start - cut, 0), stop=stop - cut, train=train,
                                             example_mask=example_mask)
        return x, {**enc_stats, **own_stats}

    num_stages = cut + len(PROJECTION_STAGES)

    def apply(variables, x, train, example_mask=None):
        return run_stages(variables, x, 0, num_stages, train, example_mask)

    encoder_layers = [(layer, stage) for layer, stage in zip(model.structure.layers, model.stage_of_layer,
                                                               strict=True) if stage < cut]
    order, norms = [], []
    for source, i in [(model.structure, i) for i in range(len(encoder_layers))] + \
            [(tail.structure, i) for i in range(tail.structure.num_layers)]:
        order += source.calls(i)
        norms += list(source.layers[i].norm_paths)
    sequential = model.structure.sequential
    structure = build_structure(join(encoder_vars, tail_vars), order, norms, sequential=sequential,
                                pre_norm_paths=model.structure.pre_norm_paths + tail.structure.pre_norm_paths)
    stage_names = model.stage_names[:cut] + PROJECTION_STAGES
    return Model(
        name=f"{model.name}+proj{dim}",
        init=init,
        apply=apply,
        structure=structure,
        input_shape=model.input_shape,
        num_classes=model.num_classes,
        stage_names=stage_names,
        stage_of_layer=tuple(stage for _, stage in encoder_layers) + tuple(cut + s for s in tail.stage_of_layer),
        run_stages=run_stages,
        record_outputs=linen_recorder(structure, stage_names, run_stages),
    )


def classifier_input(model: Model, run: Callable[[], T]) -> tuple[jax.Array, T]:
    """``(x, run())``: ``x`` is what ``run()``'s forward pass of ``model`` fed the classifier (its last layer).

    ``run`` is any call that runs ``model`` once (``model.apply``, a client's
    ``LocalStep.forward``); the value is read as the classifier is called, so it is
    differentiable with the rest of the pass.  With :func:`with_projection_head`
    it is the projection ``z``.

    Raises:
      UserError: the pass never called the classifier as a Flax linen module
        (e.g. an NNX model).
    """
    path = model.structure.layers[-1].path
    seen: list = []

    def grab(next_fun, args, kwargs, context):
        if context.method_name == "__call__" and tuple(context.module.path) == path and not seen and args:
            seen.append(args[0])
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(grab):
        out = run()
    if not seen:
        raise UserError(f"model {model.name}'s classifier {'/'.join(path)} was not called as a Flax linen module "
                        "in the forward pass, so its input cannot be read; use a linen model (from_linen or "
                        "from_stages).")
    return seen[0], out
