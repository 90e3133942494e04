"""Early exits: a classifier after chosen stages of any staged model, every exit's logits from one pass.

Depth-scaled methods (DepthFL, InclusiveFL) give a client of depth ``d`` the first
``d`` stages of the model and a classifier reading stage ``d - 1``'s output.
:func:`with_exits` adds those classifiers to a staged
:class:`~fedpartial._src.models.adapter.Model` (every zoo model is staged;
:func:`~fedpartial._src.models.adapter.from_stages` builds one)::

    import jax, jax.numpy as jnp
    from fedpartial._src.models import exits
    from fedpartial._src.models.adapter import from_linen
    from fedpartial._src.models.registry import build_model

    plain = from_linen(build_model("lenet5", 10, (32, 32, 3)), input_shape=(32, 32, 3), num_classes=10)
    model = exits.with_exits(plain, after=(1, 3))      # after conv2 and fc2, and the model's own head
    variables = model.init_variables(jax.random.key(0))
    x = jnp.zeros((4, 32, 32, 3))
    every, _ = model.exit_logits(variables, x)          # [3, 4, 10]: exit_conv2, exit_fc2, head
    shallow, _ = model.exit_logits(variables, x, stop=2)  # [1, 4, 10]: stages conv1, conv2 and their exit
    logits, _ = model.apply(variables, x, False)        # the mean of the three exits' logits

**An exit** is global average pooling over every axis between the batch and the features
(an image's height and width, a sequence's positions; none for a vector) followed by one
Dense layer to the classes, named ``exit_<stage>``.  The model's own classifier is the last
exit.  Its variables sit beside the model's, and it belongs to the stage it reads, so
:meth:`Model.stage_variables` ``(variables, 0, d)`` is exactly what a client of depth ``d``
holds: the first ``d`` stages and every exit after them.

**The stages** stay the model's own chain (:meth:`Model.apply_stages` runs the body, as the
plain model does); the exits branch off it, so the structure is not sequential.  ``apply``
returns the exits combined: ``output="mean"`` the mean of their logits (DepthFL's ensemble, as
its reference code averages the classifiers' outputs), ``"last"`` the model's own classifier.
It always runs every exit, so every layer is seen by
:func:`fedpartial._src.costs.footprint.layer_output_shapes`.  The body starts from exactly the
weights the plain model would start from with the same key (the exits draw from
``fold_in(key, 1)``).

A single-stage model (a module without stages, an NNX model) has no inside to place an exit
in and is refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedpartial._src.core.errors import UserError
from fedpartial._src.core.structure import build_structure
from fedpartial._src.models.adapter import Model

OUTPUTS = ("mean", "last")


class ExitHeads(nn.Module):
    """One Dense per exit (``names``), each on its (pooled) stage output; returns their logits in order.
    ``kept``: the axes after the batch that the model's own logits keep (1 for a language model's positions),
    which the exits keep too."""

    names: tuple[str, ...]
    num_classes: int
    kept: int = 0

    @nn.compact
    def __call__(self, features: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
        return tuple(nn.Dense(self.num_classes, name=n)(pool(h, self.kept))
                     for n, h in zip(self.names, features, strict=True))


def pool(h: jax.Array, kept: int = 0) -> jax.Array:
    """``[B, ..., C]`` -> ``[B, C]``: the mean over every axis between the batch and the features, but the first
    ``kept`` of them (``[B, T, C]`` stays as it is with ``kept=1``: a sequence model's positions)."""
    h = h.astype(jnp.float32)
    axes = tuple(range(1 + kept, h.ndim - 1))
    return jnp.mean(h, axis=axes) if axes else h


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity, as Model
class MultiExitModel(Model):
    """A :class:`Model` with exits (:func:`with_exits`); it has :class:`Model`'s fields and these.

    Attributes:
      body: the staged model the exits were added to.
      exit_stages: per exit, shallow to deep, the stage whose output it reads; the last is the
        model's own classifier stage.
      exit_names: per exit, its module name (``exit_<stage>``; the last, the classifier's).
      exit_of_layer: per layer, the exit it belongs to, or -1 for a layer of the body before the
        classifier stage (the classifier stage's layers belong to the last exit).
      output: what ``apply`` returns: ``"mean"`` (of the exits' logits) or ``"last"``.
      run_exits: ``(variables, x, stop, train, example_mask) -> (logits [E, B, C], batch_stats)``;
        call :meth:`exit_logits` instead.
    """

    body: Model | None = None
    exit_stages: tuple[int, ...] = ()
    exit_names: tuple[str, ...] = ()
    exit_of_layer: tuple[int, ...] = ()
    output: str = "mean"
    run_exits: Callable[..., tuple[jax.Array, Any]] | None = None

    @property
    def num_exits(self) -> int:
        """The number of early exits (``len(exit_stages)``)."""
        return len(self.exit_stages)

    def exits_within(self, stop: int) -> tuple[int, ...]:
        """The exits a client holding stages ``[0, stop)`` has."""
        return tuple(e for e, s in enumerate(self.exit_stages) if s < stop)

    def exit_logits(self, variables: dict, x: Any, *, stop: int | None = None, train: bool = False,
                    example_mask: jax.Array | None = None) -> tuple[jax.Array, Any]:
        """Logits ``[E', B, C]`` of the exits after stages ``[0, stop)`` (default: every exit), and the
        batch statistics as :meth:`Model.apply_stages` returns them.  ``variables`` need only hold
        those stages (:meth:`Model.stage_variables` ``(variables, 0, stop)``); ``stop`` is static."""
        stop = self.num_stages if stop is None else stop
        if not self.exits_within(stop):
            raise ValueError(f"stages [0, {stop}) of {self.name} hold no exit (exits after stages "
                             f"{self.exit_stages}).")
        return self.run_exits(variables, x, stop, train, example_mask)


def combine(logits: jax.Array, output: str) -> jax.Array:
    """``[E, B, C]`` exit logits -> ``[B, C]``: their mean, or the last exit's."""
    return jnp.mean(logits, axis=0) if output == "mean" else logits[-1]


def with_exits(model: Model, after: Sequence[int], *, output: str = "mean") -> MultiExitModel:
    """``model`` with an exit after each stage in ``after`` (besides its own classifier, the last exit).

    Args:
      model: a staged model whose last stage is its classifier.
      after: stage indices (before the classifier stage) whose outputs an exit reads; repeats are merged.
      output: what ``apply`` returns, the ``"mean"`` of every exit's logits or the ``"last"`` exit's.

    Raises:
      UserError: a single-stage model, a stage outside ``0 … S-2``, an unknown ``output``, or a module
        of the model already named like an exit.
    """
    if model.num_stages < 2:
        raise UserError(f"model {model.name} is a single stage, so no exit can be placed inside it; depth-scaled "
                        "methods need a staged model (every zoo model is; from_stages builds one).")
    if output not in OUTPUTS:
        raise UserError(f"exit output {output!r} is unknown; choose {' or '.join(OUTPUTS)}.")
    last = model.num_stages - 1
    stages = sorted({int(a) for a in after})
    if any(not 0 <= a < last for a in stages):
        raise UserError(f"exits after stages {tuple(after)}: each must be a stage of {model.name} before its "
                        f"classifier, 0 … {last - 1} ({', '.join(model.stage_names[:last])}).")
    names = tuple(f"exit_{model.stage_names[a]}" for a in stages)
    exit_stages = (*stages, last)
    sample = jnp.zeros((1, *model.input_shape), jnp.float32)
    shapes = jax.eval_shape(model.init, jax.random.key(0), sample)
    kept = jax.eval_shape(lambda v: model.apply(v, sample, False)[0], shapes).ndim - 2  # per-position outputs

    def features(body: dict, x, stop: int, train: bool, example_mask):
        """Outputs of the exit stages before ``stop`` (the last: the classifier's logits) and the statistics."""
        outs, stats, start = [], dict(body.get("batch_stats", {})), 0
        for s in exit_stages:
            if s >= stop:
                break
            x, new = model.apply_stages({**body, "batch_stats": stats}, x, start=start, stop=s + 1, train=train,
                                        example_mask=example_mask)
            stats.update(new)
            outs.append(x)
            start = s + 1
        return outs, stats

    def split(variables: dict) -> tuple[dict, dict]:
        body = {c: {k: v for k, v in tree.items() if k not in names} for c, tree in variables.items()}
        return body, {k: v for k, v in variables.get("params", {}).items() if k in names}

    def run_exits(variables, x, stop, train, example_mask=None):
        body, own = split(variables)
        outs, stats = features(body, x, stop, train, example_mask)
        held = names[:len(outs) - (stop > last)]
        heads = ExitHeads(held, model.num_classes, kept).apply({"params": {n: own[n] for n in held}}, outs[:len(held)])
        logits = [*heads, *outs[len(held):]]
        return jnp.stack([lg.astype(jnp.float32) for lg in logits]), stats

    def init(key, x):
        body = model.init(key, x)
        outs, _ = features(body, x, last, False, None)
        return {"params": {**body["params"], **ExitHeads(names, model.num_classes, kept).init(
            jax.random.fold_in(key, 1), outs)["params"]}, "batch_stats": body.get("batch_stats", {})}

    def apply(variables, x, train, example_mask=None):
        logits, stats = run_exits(variables, x, model.num_stages, train, example_mask)
        return combine(logits, output), stats

    def run_stages(variables, x, start, stop, train, example_mask=None):
        return model.apply_stages(split(variables)[0], x, start=start, stop=stop, train=train,
                                  example_mask=example_mask)

    body_vars = jax.eval_shape(lambda: model.init_variables(jax.random.key(0)))
    clash = sorted(set(names) & set(body_vars["params"]))
    if clash:
        raise UserError(f"model {model.name} already has a module named {clash[0]!r}, the name of an exit.")
    variables = jax.eval_shape(lambda: init(jax.random.key(0), sample))
    order, norms, stage_of, exit_of = [], [], [], []
    layers = list(zip(model.structure.layers, model.stage_of_layer, strict=True))
    for i, (layer, stage) in enumerate(layers):
        order += model.structure.calls(i)
        norms += list(layer.norm_paths)
        stage_of.append(stage)
        exit_of.append(len(names) if stage == last else -1)
        ends_stage = i + 1 == len(layers) or layers[i + 1][1] != stage
        if ends_stage and stage in stages:
            order.append((names[stages.index(stage)],))
            stage_of.append(stage)
            exit_of.append(stages.index(stage))
    structure = build_structure(variables, order, norms, sequential=False,
                                pre_norm_paths=model.structure.pre_norm_paths)

    def record_outputs(variables, x, train=False):
        out = dict(model.intermediates(split(variables)[0], x, train=train))
        logits, _ = run_exits(variables, x, model.num_stages, train)
        return {**out, **dict(zip(names, logits[:len(names)]))}

    return MultiExitModel(
        name=f"{model.name}+exits", init=init, apply=apply, structure=structure, input_shape=model.input_shape,
        num_classes=model.num_classes, stage_names=model.stage_names, stage_of_layer=tuple(stage_of),
        run_stages=run_stages, record_outputs=record_outputs, body=model, exit_stages=exit_stages,
        exit_names=(*names, model.structure.layers[-1].name), exit_of_layer=tuple(exit_of), output=output,
        run_exits=run_exits)
