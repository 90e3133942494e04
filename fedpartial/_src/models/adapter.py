"""Adapters turning a Flax module (linen or NNX) into a :class:`Model` of pure functions.

The engine never touches a module object: it needs ``init(key, x) -> variables``,
``apply(variables, x, train) -> (logits, batch_stats)`` and the model's layer
structure (see :mod:`fedpartial._src.core.structure`).  Variables are always the plain dict
``{'params': ..., 'batch_stats': ...}`` (``batch_stats`` is ``{}`` without BatchNorm).

Bring your own model::

    import flax.linen as nn
    from fedpartial._src.models.adapter import from_linen

    class Tiny(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            x = nn.relu(nn.Dense(32)(x.reshape((x.shape[0], -1))))
            return nn.Dense(10)(x)

    model = from_linen(Tiny(), input_shape=(8, 8, 1), num_classes=10, sequential=True)

A linen module must accept ``train`` as a keyword and keep running statistics in ``batch_stats``.
An NNX module is adapted with :func:`from_nnx`; ``train()`` / ``eval()`` switch its BatchNorm mode.

Stages.  A model is also a chain of *stages* (:attr:`Model.stage_names`), so that
a client can run a frozen input-side prefix once, keep its output, and train the
output-side suffix alone on it (EmbracingFL, docs/decisions.md#embracingfl); the suffix needs only its
own variables (:meth:`Model.stage_variables`).  The zoo models are staged; a
module without ``stage_names`` is one stage, ``"model"``.  Give your own stages
as a list of modules with :func:`from_stages`::

    import flax.linen as nn
    import jax, jax.numpy as jnp
    from fedpartial._src.models.adapter import from_stages

    class Body(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            return nn.relu(nn.Dense(32)(x.reshape((x.shape[0], -1))))

    model = from_stages([Body(), nn.Dense(10)], input_shape=(8, 8, 1), num_classes=10,
                        names=("body", "head"))
    variables = model.init_variables(jax.random.key(0))
    x = jnp.ones((4, 8, 8, 1))
    features, _ = model.apply_stages(variables, x, stop=1)  # the frozen prefix, once
    head_vars = model.stage_variables(variables, 1)          # {'params': {'head': ...}, ...}
    logits, _ = model.apply_stages(head_vars, features, start=1)
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Mapping, Sequence
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedpartial._src.models.zoo import stage_range
from fedpartial._src.core.structure import NORMALIZER_NAMES, ModelStructure, Path, build_structure
from fedpartial._src.models.call_order import call_order_recorder, pre_norms

Variables = dict[str, Any]


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: a jit static argument
class Model:
    """A model as pure functions plus its layer structure and its stages.

    Attributes:
      name: display name.
      init: ``(key, x) -> variables``.
      apply: ``(variables, x, train, example_mask=None) -> (logits, batch_stats)``; in train mode the returned
        ``batch_stats`` are the updated running statistics.  ``example_mask`` ``[batch]`` marks real examples:
        padded examples are excluded from BatchNorm's batch statistics.
      structure: ordered layers and leaf roles.
      input_shape: shape of one example (no batch axis).
      num_classes: number of output classes.
      stage_names: the forward pass as ordered stages; the last is the classifier.
      stage_of_layer: per layer of ``structure.layers``, the index of its stage (all ``0`` for a single-stage model).
      run_stages: ``(variables, x, start, stop, train, example_mask) -> (out,
        batch_stats)`` for stages ``[start, stop)``; None for a single-stage model
        (``apply`` is then the only stage).  Call :meth:`apply_stages` instead.
      record_outputs: ``(variables, x, train) -> dict`` behind
        :meth:`intermediates`; None records only the logits.
      at_width: ``(ratio, scaler) -> Model``, this model with ``⌈ratio·C⌉``
        channels/units in every hidden layer (width tiers);
        ``scaler``: hidden outputs × ``1/ratio`` in training (HeteroFL's Scaler).
        None: the model cannot rebuild itself narrower (:func:`from_linen`'s ``width`` sets it).
      lora: a :func:`~fedpartial.models.lora` model's adapters (:class:`~fedpartial.models.LoraSpec`), else None.
    """

    name: str
    init: Callable[[jax.Array, jax.Array], Variables]
    apply: Callable[..., tuple[jax.Array, Any]]
    structure: ModelStructure
    input_shape: tuple[int, ...]
    num_classes: int
    stage_names: tuple[str, ...] = ("model",)
    stage_of_layer: tuple[int, ...] = ()
    run_stages: Callable[..., tuple[Any, Any]] | None = None
    record_outputs: Callable[..., dict[str, jax.Array]] | None = None
    at_width: Callable[[float, bool], Model] | None = None
    lora: Any = None

    def __post_init__(self):
        n, layers = len(self.stage_names), self.structure.num_layers
        if n < 1 or len(set(self.stage_names)) != n:
            raise ValueError(f"stage names must be distinct and at least one, got {self.stage_names}.")
        if n > 1 and (self.run_stages is None or not self.stage_of_layer):
            raise ValueError("a model of several stages needs run_stages and stage_of_layer.")
        stage_of = tuple(self.stage_of_layer) or (0,) * layers
        if len(stage_of) != layers or any(not 0 <= s < n for s in stage_of):
            raise ValueError(
                f"stage_of_layer needs one stage index in [0, {n}) per layer ({layers}), got {stage_of}."
            )
        object.__setattr__(self, "stage_of_layer", stage_of)

    @property
    def num_stages(self) -> int:
        """The number of stages (``len(stage_names)``): the blocks a depth-wise method counts."""
        return len(self.stage_names)

    def init_variables(self, key: jax.Array) -> Variables:
        return self.init(key, jnp.zeros((1, *self.input_shape), jnp.float32))

    def apply_stages(
        self,
        variables: Variables,
        x: Any,
        *,
        start: int = 0,
        stop: int | None = None,
        train: bool = False,
        example_mask: jax.Array | None = None,
    ) -> tuple[Any, Any]:
        """Runs stages ``[start, stop)`` on ``x`` (the raw input, or stage ``start - 1``'s output).

        ``variables`` need only hold the running stages' modules (see
        :meth:`stage_variables`).  Returns ``(output, batch_stats)`` as ``apply``
        does: in train mode the updated running statistics of those modules, with
        ``example_mask`` keeping padded examples out of them.  ``start``/``stop``
        pick which submodules exist, so under ``jax.jit`` they are static.
        """
        r = stage_range(self.num_stages, start, stop)
        if not r:
            return x, variables.get("batch_stats", {})
        if self.run_stages is None:
            return self.apply(variables, x, train, example_mask)
        return self.run_stages(variables, x, r.start, r.stop, train, example_mask)

    def stage_variables(
        self, variables: Mapping[str, Any], start: int, stop: int | None = None
    ) -> Variables:
        """``variables`` restricted to the modules of stages ``[start, stop)``.

        Same nested layout, fewer entries, leaves untouched: it works on any tree
        shaped like the variables (a ``[K, ...]`` cohort, boolean masks).  A
        collection with nothing left is ``{}``.
        """
        stages = stage_range(self.num_stages, start, stop)
        keep = {
            path
            for layer, stage in zip(self.structure.layers, self.stage_of_layer, strict=True)
            if stage in stages
            for path in (layer.path, *layer.norm_paths)
        }
        return {collection: _select_modules(tree, keep) for collection, tree in variables.items()}

    def intermediates(
        self, variables: Variables, x: jax.Array, *, train: bool = False
    ) -> dict[str, jax.Array]:
        """Every stage's output and every layer's output, from one forward pass.

        Keys: ``"stage:<name>"`` for the output of each stage (``"stage:head"`` is
        the logits of a zoo model, the stage before it the penultimate
        representation), and each layer's name (``structure.layer_names``) for the
        output of its Conv/Dense module, before any normaliser or activation.
        Train mode uses batch statistics and discards their update.  Jittable
        (``train`` static).
        """
        if self.record_outputs is None:
            logits, _ = self.apply(variables, x, train)
            return {f"stage:{self.stage_names[-1]}": logits}
        return self.record_outputs(variables, x, train)


def _select_modules(tree: Any, keep: set[Path], prefix: Path = ()) -> dict:
    """The leaves of ``tree`` whose module path (their path minus the last key) is in ``keep``."""
    out = {}
    for key, sub in tree.items():
        if isinstance(sub, Mapping):
            picked = _select_modules(sub, keep, prefix + (key,))
            if picked:
                out[key] = picked
        elif prefix in keep:
            out[key] = sub
    return out


def _with_stats(variables: Any) -> Variables:
    variables = dict(variables)
    variables.setdefault("batch_stats", {})
    return {"params": variables["params"], "batch_stats": variables["batch_stats"]}


def from_linen(
    module: nn.Module,
    *,
    input_shape: tuple[int, ...],
    num_classes: int,
    sequential: bool = False,
    name: str | None = None,
    width: Callable[[float, bool], nn.Module] | None = None,
) -> Model:
    """Adapts a linen module ``__call__(x, train=False)``.

    The layer order is recorded by intercepting module calls during one ``init``. Pass ``sequential=True`` only
    for chains without residual/skip connections: neuron-level masks (dropout, FedSPU) are wired across layers
    only then.

    A module with a ``stage_names`` attribute is staged: its ``__call__`` also takes ``start``/``stop`` (the
    model zoo's contract), and which stage owns each layer is found by initialising the stages one at a
    time.  A module whose architecture depends on the input shape may provide ``for_input_shape(input_shape) ->
    module`` to fix it for ``input_shape``.

    ``width(ratio, scaler) -> module`` makes the model narrowable (HeteroFL / FjORD width tiers,
    :attr:`Model.at_width`): the same network with ``⌈ratio·C⌉`` channels/units in every hidden layer, the
    classifier keeping every class, whose variables are this module's leading channels/units on every axis;
    with ``scaler`` its hidden outputs are multiplied by ``1/ratio`` in training.

    Args:
      module: the linen module.
      input_shape: one example's shape (no batch axis).
      num_classes: output classes.
      sequential: the layers form a chain (no residual connections).
      name: the model's display name (default: the module's class name).
      width: ``width(ratio, scaler) -> module``, making the model narrowable, or None.

    Returns:
      The :class:`~fedpartial.models.Model`.
    """
    input_shape = tuple(input_shape)
    fix_shape = getattr(module, "for_input_shape", None)
    if callable(fix_shape):
        module = fix_shape(input_shape)
    declared = getattr(module, "stage_names", None)
    stage_names = tuple(declared) if declared is not None else ("model",)

    def init(key, x):
        return _with_stats(module.init(key, x, train=False))

    def run(variables, x, train, example_mask, **stage_kwargs):
        stats = variables.get("batch_stats", {})
        if not train:
            return module.apply(variables, x, train=False, **stage_kwargs), stats
        with nn.intercept_methods(_mask_batch_norm(example_mask)):
            if stats:
                out, updated = module.apply(
                    variables, x, train=True, mutable=["batch_stats"], **stage_kwargs
                )
                return out, updated["batch_stats"]
            return module.apply(variables, x, train=True, **stage_kwargs), stats

    def apply(variables, x, train, example_mask=None):
        return run(variables, x, train, example_mask)

    def run_stages(variables, x, start, stop, train, example_mask=None):
        if declared is None:  # one stage: the whole module
            return run(variables, x, train, example_mask)
        return run(variables, x, train, example_mask, start=start, stop=stop)

    sample = jnp.zeros((1, *input_shape), jnp.float32)
    order, norms, calls = [], [], []
    with nn.intercept_methods(call_order_recorder(order, norms, calls)):
        variables = jax.eval_shape(lambda: init(jax.random.key(0), sample))
    structure = build_structure(variables, order, norms, sequential=sequential,
                                pre_norm_paths=pre_norms(calls, variables))
    if declared is None:
        stage_of_layer = (0,) * structure.num_layers
    else:
        stage_of_layer = _stage_of_layers(module, sample, structure, stage_names)
    name = name or type(module).__name__

    def at_width(ratio: float, scaler: bool) -> Model:
        return from_linen(width(ratio, scaler), input_shape=input_shape, num_classes=num_classes,
                          sequential=sequential, name=f"{name}@{ratio:g}")

    return Model(
        name=name,
        init=init,
        apply=apply,
        structure=structure,
        input_shape=input_shape,
        num_classes=num_classes,
        stage_names=stage_names,
        stage_of_layer=stage_of_layer,
        run_stages=run_stages if declared is not None else None,
        record_outputs=linen_recorder(structure, stage_names, run_stages),
        at_width=None if width is None else at_width,
    )


def _stage_of_layers(module: nn.Module, sample, structure: ModelStructure, stage_names) -> tuple[int, ...]:
    """Initialises the stages one at a time and notes in which one each layer's module is first called."""
    first_stage: dict[Path, int] = {}
    current = 0

    def record(next_fun, args, kwargs, context):
        if context.method_name == "__call__":
            first_stage.setdefault(tuple(context.module.path), current)
        return next_fun(*args, **kwargs)

    x = sample
    with nn.intercept_methods(record):
        for current in range(len(stage_names)):
            x = jax.eval_shape(
                lambda h, i=current: module.init_with_output(
                    jax.random.key(0), h, train=False, start=i, stop=i + 1
                )[0],
                x,
            )
    missing = [layer.name for layer in structure.layers if layer.path not in first_stage]
    if missing:
        raise ValueError(
            f"layer {missing[0]} is called by no stage of {stage_names} when the stages run one "
            "at a time; __call__ must honour start/stop."
        )
    return tuple(first_stage[layer.path] for layer in structure.layers)


def linen_recorder(structure: ModelStructure, stage_names, run_stages):
    """``intermediates`` for a linen model: the stages run one by one under an output interceptor."""
    layer_of_path = {layer.path: layer.name for layer in structure.layers}

    def record_outputs(variables, x, train=False):
        outputs: dict[str, jax.Array] = {}

        def grab(next_fun, args, kwargs, context):
            y = next_fun(*args, **kwargs)
            if context.method_name == "__call__":
                layer = layer_of_path.get(tuple(context.module.path))
                if layer is not None:
                    outputs.setdefault(layer, y)
            return y

        with nn.intercept_methods(grab):
            for i, stage in enumerate(stage_names):
                x, _ = run_stages(variables, x, i, i + 1, train)
                outputs[f"stage:{stage}"] = x
        return outputs

    return record_outputs


def _mask_batch_norm(example_mask):
    """Interceptor passing the example mask to every BatchNorm (padding leaves statistics alone)."""

    def interceptor(next_fun, args, kwargs, context):
        if (example_mask is not None and context.method_name == "__call__"
                and isinstance(context.module, nn.BatchNorm) and args):
            x = args[0]
            m = example_mask.reshape((x.shape[0],) + (1,) * (x.ndim - 1))
            kwargs = {**kwargs, "mask": jnp.broadcast_to(m, x.shape)}
        return next_fun(*args, **kwargs)

    return interceptor


# ------------------------------------------------------------------ user stages


class _StageChain(nn.Module):
    """Runs a user's stage modules in order; stage ``i``'s variables sit under ``names[i]``."""

    stages: tuple[nn.Module, ...]
    names: tuple[str, ...]

    # Adopted submodules keep the names from_stages gave them (not "stages_0", ...).
    preserve_adopted_names = True

    @property
    def stage_names(self) -> tuple[str, ...]:
        return self.names

    @nn.compact
    def __call__(self, x, train: bool = False, start: int = 0, stop: int | None = None):
        for i in stage_range(len(self.stages), start, stop):
            stage = self.stages[i]
            x = stage(x, train=train) if _takes_train(stage) else stage(x)
        return x


def _takes_train(module: nn.Module) -> bool:
    return "train" in inspect.signature(type(module).__call__).parameters


def from_stages(
    stages: Sequence[nn.Module],
    *,
    input_shape: tuple[int, ...],
    num_classes: int,
    names: Sequence[str] | None = None,
    sequential: bool = False,
    name: str | None = None,
) -> Model:
    """Adapts a list of linen modules run in order, each a stage of the model.

    Stage ``i`` is called as ``stage(x, train=train)`` (``stage(x)`` when its ``__call__`` has no ``train``, e.g.
    ``nn.Dense``) on the previous stage's output; the last must return the logits ``[batch, num_classes]``. Its
    variables live under its stage name (``names``; default ``stage0``, ``stage1``, ...).

    Args:
      stages: the linen modules, input to output.
      input_shape: one example's shape (no batch axis).
      num_classes: output classes.
      names: the stages' names (default ``stage0``, ``stage1``, ...).
      sequential: the layers form a chain (no residual connections), as in :func:`from_linen`.
      name: the model's display name.

    Returns:
      The :class:`~fedpartial.models.Model`, one stage per module.

    Raises:
      ValueError: no stages, ``names`` of the wrong length or not distinct, or a
        last stage that does not produce ``[batch, num_classes]``.
    """
    stages = tuple(stages)
    names = tuple(names) if names is not None else tuple(f"stage{i}" for i in range(len(stages)))
    if not stages or len(names) != len(stages) or len(set(names)) != len(names):
        raise ValueError(
            f"from_stages needs at least one stage and one distinct name per stage, got "
            f"{len(stages)} stages named {names}."
        )
    chain = _StageChain(
        stages=tuple(s.clone(name=n) for s, n in zip(stages, names, strict=True)), names=names
    )
    model = from_linen(chain, input_shape=input_shape, num_classes=num_classes,
                       sequential=sequential, name=name or "stages")
    sample = jnp.zeros((1, *model.input_shape), jnp.float32)
    logits = jax.eval_shape(
        lambda: model.apply(model.init_variables(jax.random.key(0)), sample, False)[0]
    )
    if getattr(logits, "shape", None) != (1, num_classes):
        raise ValueError(
            f"the last stage ({names[-1]}) must return logits [batch, {num_classes}], "
            f"got {getattr(logits, 'shape', logits)} for a batch of 1."
        )
    return model


# ------------------------------------------------------------------------ NNX


def from_nnx(
    module: Any,
    *,
    input_shape: tuple[int, ...],
    num_classes: int,
    sequential: bool = False,
    name: str | None = None,
) -> Model:
    """Adapts an initialised ``flax.nnx`` module ``__call__(x)``.

    Its ``nnx.Param`` leaves become ``variables['params']``, its ``nnx.BatchStat`` leaves ``variables['batch_stats']``;
    ``init`` ignores the key and returns the module's own initial values (an NNX module is initialised when
    constructed).  The layer order is recorded from one forward pass; the model is a single stage.

    Args:
      module: the initialised ``nnx`` module.
      input_shape: one example's shape (no batch axis).
      num_classes: output classes.
      sequential: the layers form a chain (no residual connections).
      name: the model's display name (default: the module's class name).

    Returns:
      The :class:`~fedpartial.models.Model`.
    """
    from flax import nnx

    graphdef, params, stats, rest = nnx.split(module, nnx.Param, nnx.BatchStat, ...)
    initial = {"params": nnx.to_pure_dict(params), "batch_stats": nnx.to_pure_dict(stats)}

    def merged(variables):
        p, s = nnx.clone(params), nnx.clone(stats)
        nnx.replace_by_pure_dict(p, variables["params"])
        if variables.get("batch_stats"):
            nnx.replace_by_pure_dict(s, variables["batch_stats"])
        return nnx.merge(graphdef, p, s, rest)

    def init(key, x):
        del key, x
        return jax.tree.map(jnp.asarray, initial)

    def apply(variables, x, train, example_mask=None):
        del example_mask  # NNX BatchNorm statistics include padded examples (documented).
        m = merged(variables)
        if train:
            m.train()
        else:
            m.eval()
        logits = m(x)
        new_stats = nnx.to_pure_dict(nnx.split(m, nnx.Param, nnx.BatchStat, ...)[2])
        return logits, new_stats

    order, norms = _nnx_call_order(merged(initial), input_shape)
    structure = build_structure(initial, order, norms, sequential=sequential)
    layer_of_path = {layer.path: layer.name for layer in structure.layers}

    def record_outputs(variables, x, train=False):
        m = merged(variables)
        if train:
            m.train()
        else:
            m.eval()
        outputs: dict[str, jax.Array] = {}

        def on_call(cls, path, call):
            y = call()
            if path in layer_of_path:
                outputs.setdefault(layer_of_path[path], y)
            return y

        with _nnx_calls_routed(m, on_call):
            outputs["stage:model"] = m(x)
        return outputs

    return Model(
        name=name or type(module).__name__,
        init=init,
        apply=apply,
        structure=structure,
        input_shape=tuple(input_shape),
        num_classes=num_classes,
        record_outputs=record_outputs,
    )


@contextlib.contextmanager
def _nnx_calls_routed(module: Any, on_call):
    """Routes every call of ``module``'s submodules through ``on_call(cls, path, call)``.

    NNX has no method interceptor, so the submodules' classes get a wrapping
    ``__call__`` while the context is open; ``call()`` runs the original.
    """
    from flax import nnx

    nodes = [(tuple(str(p) for p in path), node) for path, node in nnx.iter_graph(module)
             if isinstance(node, nnx.Module)]
    paths = {id(node): path for path, node in nodes}
    classes = {type(node) for _, node in nodes}
    originals = {cls: (cls.__call__, "__call__" in cls.__dict__) for cls in classes}

    def make(cls, orig):
        def wrapper(self, *args, **kwargs):
            path = paths.get(id(self))
            if path is None:
                return orig(self, *args, **kwargs)
            return on_call(cls, path, lambda: orig(self, *args, **kwargs))
        return wrapper

    try:
        for cls, (orig, _) in originals.items():
            cls.__call__ = make(cls, orig)
        yield
    finally:
        for cls, (orig, own) in originals.items():
            if own:
                cls.__call__ = orig
            else:
                del cls.__call__


def _nnx_call_order(module: Any, input_shape) -> tuple[list, list]:
    """Records the order in which an NNX module's submodules are called."""
    order: list = []
    norms: list = []

    def on_call(cls, path, call):
        if path not in order:
            order.append(path)
            if cls.__name__ in NORMALIZER_NAMES:
                norms.append(path)
        return call()

    module.eval()
    with _nnx_calls_routed(module, on_call):
        jax.eval_shape(lambda: module(jnp.zeros((1, *input_shape), jnp.float32)))
    return order, norms
