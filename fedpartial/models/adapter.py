"""Adapters turning a Flax module (linen or NNX) into a :class:`Model` of pure functions.

The engine never touches a module object: it needs ``init(key, x) -> variables``,
``apply(variables, x, train) -> (logits, batch_stats)`` and the model's layer
structure (see :mod:`fedpartial.structure`).  Variables are always the plain dict
``{'params': ..., 'batch_stats': ...}`` (``batch_stats`` is ``{}`` without BatchNorm).

Bring your own model::

    import flax.linen as nn
    from fedpartial.models import from_linen

    class Tiny(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            x = nn.relu(nn.Dense(32)(x.reshape((x.shape[0], -1))))
            return nn.Dense(10)(x)

    model = from_linen(Tiny(), input_shape=(8, 8, 1), num_classes=10, sequential=True)

A linen module must accept ``train`` as a keyword and keep running statistics in
``batch_stats``.  An NNX module is adapted with :func:`from_nnx`; ``train()`` /
``eval()`` switch its BatchNorm mode.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedpartial.structure import NORMALIZER_NAMES, ModelStructure, build_structure

Variables = dict[str, Any]


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: a jit static argument
class Model:
    """A model as pure functions plus its layer structure.

    Attributes:
      name: display name.
      init: ``(key, x) -> variables``.
      apply: ``(variables, x, train, example_mask=None) -> (logits, batch_stats)``;
        in train mode the returned ``batch_stats`` are the updated running
        statistics.  ``example_mask`` ``[batch]`` marks real examples: padded
        examples are excluded from BatchNorm's batch statistics.
      structure: ordered layers and leaf roles.
      input_shape: shape of one example (no batch axis).
      num_classes: number of output classes.
    """

    name: str
    init: Callable[[jax.Array, jax.Array], Variables]
    apply: Callable[..., tuple[jax.Array, Any]]
    structure: ModelStructure
    input_shape: tuple[int, ...]
    num_classes: int

    def init_variables(self, key: jax.Array) -> Variables:
        return self.init(key, jnp.zeros((1, *self.input_shape), jnp.float32))


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
) -> Model:
    """Adapts a linen module ``__call__(x, train=False)``.

    The layer order is recorded by intercepting module calls during one ``init``.
    Pass ``sequential=True`` only for chains without residual/skip connections:
    neuron-level masks (dropout, FedSPU) are wired across layers only then.
    """

    def init(key, x):
        return _with_stats(module.init(key, x, train=False))

    def apply(variables, x, train, example_mask=None):
        stats = variables.get("batch_stats", {})
        if not train:
            return module.apply(variables, x, train=False), stats
        with nn.intercept_methods(_mask_batch_norm(example_mask)):
            if stats:
                logits, updated = module.apply(variables, x, train=True, mutable=["batch_stats"])
                return logits, updated["batch_stats"]
            return module.apply(variables, x, train=True), stats

    order: list[tuple[str, ...]] = []
    norms: list[tuple[str, ...]] = []

    def record(next_fun, args, kwargs, context):
        if context.method_name == "__call__":
            path = tuple(context.module.path)
            if path not in order:
                order.append(path)
                if type(context.module).__name__ in NORMALIZER_NAMES:
                    norms.append(path)
        return next_fun(*args, **kwargs)

    sample = jnp.zeros((1, *input_shape), jnp.float32)
    with nn.intercept_methods(record):
        variables = jax.eval_shape(lambda: init(jax.random.key(0), sample))
    structure = build_structure(variables, order, norms, sequential=sequential)
    return Model(
        name=name or type(module).__name__,
        init=init,
        apply=apply,
        structure=structure,
        input_shape=tuple(input_shape),
        num_classes=num_classes,
    )


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


def from_nnx(
    module: Any,
    *,
    input_shape: tuple[int, ...],
    num_classes: int,
    sequential: bool = False,
    name: str | None = None,
) -> Model:
    """Adapts an initialised ``flax.nnx`` module ``__call__(x)``.

    Its parameters (``nnx.Param``) become ``variables['params']`` and its
    ``nnx.BatchStat`` leaves ``variables['batch_stats']``; ``init`` ignores the key
    and returns the module's own initial values (NNX modules are initialised when
    constructed).  The layer order is recorded from one forward pass.
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
    return Model(
        name=name or type(module).__name__,
        init=init,
        apply=apply,
        structure=structure,
        input_shape=tuple(input_shape),
        num_classes=num_classes,
    )


def _nnx_call_order(module: Any, input_shape) -> tuple[list, list]:
    """Records the order in which an NNX module's submodules are called."""
    from flax import nnx

    paths = {id(node): tuple(str(p) for p in path) for path, node in nnx.iter_graph(module)
             if isinstance(node, nnx.Module)}
    classes = {type(node) for path, node in nnx.iter_graph(module) if isinstance(node, nnx.Module)}
    order: list = []
    norms: list = []

    @contextlib.contextmanager
    def patched():
        originals = {cls: cls.__call__ for cls in classes}

        def make(cls, orig):
            def wrapper(self, *args, **kwargs):
                path = paths.get(id(self))
                if path is not None and path not in order:
                    order.append(path)
                    if cls.__name__ in NORMALIZER_NAMES:
                        norms.append(path)
                return orig(self, *args, **kwargs)
            return wrapper

        try:
            for cls, orig in originals.items():
                cls.__call__ = make(cls, orig)
            yield
        finally:
            for cls, orig in originals.items():
                cls.__call__ = orig

    module.eval()
    with patched():
        jax.eval_shape(lambda: module(jnp.zeros((1, *input_shape), jnp.float32)))
    return order, norms
