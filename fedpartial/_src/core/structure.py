"""Layer structure of a model: ordered layers, their output units and how they feed on.

A *layer* (docs/decisions.md#engine) is a parametrised module — a Conv or Dense with its bias; a
normaliser (BatchNorm, LayerNorm, GroupNorm) belongs to the layer it follows, unless it is a *pre-norm*: one
whose output is the input of the next module called and whose input is not the previous layer's output (a
pre-LayerNorm transformer's ``ln1`` before the attention's query), which belongs to the layer it feeds.
Layers are ordered input-side to output-side by the order in which their modules
are first called in a forward pass (params dicts are flattened in sorted-key order
by JAX, so the order cannot be read from the pytree itself).

For neuron-level masks the structure knows, for every leaf, which axis holds the
layer's output units (always the last one) and which axis receives the previous
layer's units (the second to last of a kernel).  Across a conv→flatten→dense
boundary a dense input row ``i`` is fed by conv channel ``i % C`` (NHWC flatten),
which :func:`input_units` expresses as a tiling factor.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax
import numpy as np

Path = tuple[str, ...]

#: The variables collection of parameters that no client trains (a LoRA model's base, :mod:`fedpartial.models`'s
#: ``lora``): the round holds it once and passes it unstacked into every client's forward pass; it is never
#: trained, uploaded or aggregated and has no optimizer state.
FROZEN = "frozen"

def without_frozen(variables: Mapping[str, Any]) -> dict:
    """``variables`` without the frozen base (:data:`FROZEN`): what a client's start model, local state, result
    and personal copy hold, so no per-client copy of the base is ever made."""
    return dict(variables) if FROZEN not in variables else {c: t for c, t in variables.items() if c != FROZEN}


def with_frozen(variables: Mapping[str, Any], global_vars: Mapping[str, Any] | None) -> dict:
    """``variables`` with ``global_vars``' frozen base (held once, unstacked), for a forward pass."""
    if global_vars is None or FROZEN not in global_vars:
        return dict(variables)
    return {**variables, FROZEN: global_vars[FROZEN]}


#: Module class names treated as normalisers: their leaves join the preceding layer.
NORMALIZER_NAMES = ("BatchNorm", "LayerNorm", "GroupNorm", "RMSNorm")


@dataclasses.dataclass(frozen=True)
class Layer:
    """One layer: its module path, output units and input wiring.

    Attributes:
      name: the module path joined by '/', e.g. ``"conv1"`` or ``"block0/conv2"``.
      path: the module path as a tuple.
      units: number of output units (channels / neurons): the last axis of its kernel.
      fan_in: size of the kernel's input axis (None for kernels of rank < 2).
      feeds_from: index of the layer whose units feed this layer's input axis, or
        None (first layer, or wiring unknown for a non-sequential model).
      input_tile: how many input rows each unit of ``feeds_from`` feeds
        (1 for conv→conv and dense→dense, H*W after a conv→flatten→dense).
      norm_paths: module paths of normalisers that belong to this layer.
      kernel_rank: rank of its kernel (4 for a 2-D convolution, 2 for a Dense layer).
    """

    name: str
    path: Path
    units: int
    fan_in: int | None
    feeds_from: int | None
    input_tile: int
    norm_paths: tuple[Path, ...] = ()
    kernel_rank: int = 2

    @property
    def kind(self) -> str:
        """``'conv'`` for a convolution (kernel of rank > 2), else ``'dense'``."""
        return "conv" if self.kernel_rank > 2 else "dense"


@dataclasses.dataclass(frozen=True)
class LeafRole:
    """How one variable leaf relates to the layer structure."""

    layer: int
    # Whether the leaf's second-to-last axis is the layer's input (kernels).
    has_input_axis: bool
    # Whether the leaf belongs to the layer's normaliser (BatchNorm scale/bias and statistics).
    norm: bool = False
    # Whether its last axis holds the layer's input units, not its outputs (a pre-norm's scale and bias).
    on_input: bool = False
    # Whether the leaf's last axis is the layer's units.  A leaf whose last axis is something else (a low-rank
    # factor written inside the module, ``lora_a [in, r]``) is a whole-layer leaf: on or off with its layer,
    # never wired to single neurons.
    units_axis: bool = True


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: a jit static argument
class ModelStructure:
    """A model's layers in input-to-output order, plus the role of every leaf in every variable collection.

    Every :class:`~fedpartial.Mask` is read against it: a layer bit per entry of ``layers``, a unit bit per
    output unit (``units``).  A method reads it as ``ctx.structure``; ``describe()`` prints the table.

    Attributes:
      layers: the layers (``Layer``: name, kind, units, fan-in, which layer feeds it, its normaliser
        paths), input to output.  A BatchNorm belongs to the layer it follows.
      roles: collection name (``'params'``, ``'batch_stats'``) -> leaf path (inside the collection) ->
        ``LeafRole`` (its layer, whether it is a normaliser's, whether it has an input axis).
      sequential: whether the layers form a chain (no residual connections), which neuron masks need.

    Example::

        module = fedpartial.models.build_model("mlp", 10, (8, 8, 1))
        structure = fedpartial.models.from_linen(module, input_shape=(8, 8, 1), num_classes=10,
                                                 sequential=True).structure
        print(structure.describe())                       # fc1 (200 units), fc2 (200), head (10)
        structure.role("params", ("fc2", "kernel")).layer   # 1
    """

    layers: tuple[Layer, ...]
    roles: Mapping[str, Mapping[Path, LeafRole]]
    sequential: bool

    @property
    def num_layers(self) -> int:
        """How many layers the model has (the length of a mask's ``layers``)."""
        return len(self.layers)

    @property
    def units(self) -> tuple[int, ...]:
        """Each layer's output units (the lengths of a mask's ``neurons``)."""
        return tuple(layer.units for layer in self.layers)

    @property
    def kinds(self) -> tuple[str, ...]:
        """Each layer's :attr:`Layer.kind` (``'conv'`` or ``'dense'``)."""
        return tuple(layer.kind for layer in self.layers)

    @property
    def layer_names(self) -> tuple[str, ...]:
        """Each layer's name, input to output."""
        return tuple(layer.name for layer in self.layers)

    @property
    def pre_norm_paths(self) -> tuple[Path, ...]:
        """The normalisers that feed their layer (pre-norms: their leaves lie on its input units)."""
        pre = {path[:-1] for tree in self.roles.values() for path, role in tree.items() if role.on_input}
        return tuple(p for layer in self.layers for p in layer.norm_paths if p in pre)

    def calls(self, layer: int) -> list[Path]:
        """Module paths of layer ``layer`` in call order (its pre-norms, itself, its other normalisers): what
        :func:`build_structure` reads to rebuild it, e.g. inside a larger model."""
        spec, pre = self.layers[layer], set(self.pre_norm_paths)
        return ([p for p in spec.norm_paths if p in pre] + [spec.path]
                + [p for p in spec.norm_paths if p not in pre])

    def role(self, collection: str, path: Path) -> LeafRole:
        """The role of the leaf at ``path`` (a tuple of keys inside ``collection``): its layer and kind."""
        return self.roles[collection][path]

    def describe(self) -> str:
        """A human-readable table of the layers (for logs and notebooks)."""
        rows = [f"{'#':>3} {'layer':<28} {'units':>6} {'fan_in':>7} {'feeds_from':>10} {'tile':>5}"]
        for i, layer in enumerate(self.layers):
            rows.append(
                f"{i:>3} {layer.name:<28} {layer.units:>6} {str(layer.fan_in):>7} "
                f"{str(layer.feeds_from):>10} {layer.input_tile:>5}"
                + (f"  + {', '.join('/'.join(p) for p in layer.norm_paths)}" if layer.norm_paths else "")
            )
        return "\n".join(rows)


def leaf_paths(tree: Any) -> list[tuple[Path, Any]]:
    """(path-as-tuple-of-str, leaf) pairs of a nested dict pytree."""
    out = []
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        out.append((tuple(_key_str(k) for k in key_path), leaf))
    return out


def _key_str(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def build_structure(
    variables: Mapping[str, Any],
    call_order: Sequence[Path],
    normalizer_paths: Sequence[Path] = (),
    *,
    sequential: bool,
    pre_norm_paths: Sequence[Path] = (),
) -> ModelStructure:
    """Derives the layer structure from initialised variables and the module call order.

    Args:
      variables: ``{'params': ..., 'batch_stats': ...}`` of one model (no client axis).
      call_order: module paths in the order their modules were first called in a
        forward pass (parents may be included; only modules owning leaves count).
      normalizer_paths: the subset of ``call_order`` that are normalisers.
      pre_norm_paths: the normalisers that join the next layer in ``call_order`` (pre-norms) instead of
        the one before.
      sequential: whether layer ``l`` feeds exactly layer ``l+1`` (no residual or
        skip connections). Neuron masks are only wired across layers when True.

    Raises:
      ValueError: a parameter belongs to no called module, or a sequential model's
        layer input size is incompatible with the previous layer's units.
    """
    params = variables.get("params", {})
    owners: dict[Path, list[Path]] = {}
    for path, _ in leaf_paths(params):
        owners.setdefault(path[:-1], []).append(path)
    norm_set = set(normalizer_paths)
    order_index = {p: i for i, p in reversed(list(enumerate(call_order)))}
    missing = [m for m in owners if m not in order_index]
    if missing:
        raise ValueError(
            f"parameters under {'/'.join(missing[0]) or '<root>'} belong to no module called in "
            "the forward pass; call every parametrised module in __call__ or pass an explicit layer order."
        )
    ordered = sorted(owners, key=lambda m: order_index[m])
    kernels = {m: _kernel_leaf(params, owners[m]) for m in ordered}

    pre_set = set(pre_norm_paths)
    layers: list[dict] = []
    module_layer: dict[Path, int] = {}
    waiting: list[Path] = []  # pre-norms called since the last layer: they join the next one
    for module_path in ordered:
        if module_path in norm_set and module_path in pre_set:
            waiting.append(module_path)
            continue
        if module_path in norm_set:
            if not layers:
                raise ValueError(f"normaliser {'/'.join(module_path)} comes before any layer.")
            layers[-1]["norm_paths"].append(module_path)
            module_layer[module_path] = len(layers) - 1
            continue
        kernel = kernels[module_path]
        units = int(kernel.shape[-1])
        fan_in = int(kernel.shape[-2]) if kernel.ndim >= 2 else None
        layers.append(dict(path=module_path, units=units, fan_in=fan_in, norm_paths=list(waiting),
                           kernel_rank=int(kernel.ndim)))
        module_layer.update({p: len(layers) - 1 for p in [*waiting, module_path]})
        waiting = []
    if waiting:
        raise ValueError(f"normaliser {'/'.join(waiting[0])} feeds no layer after it.")

    built = []
    for i, spec in enumerate(layers):
        feeds_from, tile = None, 1
        if sequential and i > 0 and spec["fan_in"] is not None:
            prev_units = layers[i - 1]["units"]
            if spec["fan_in"] % prev_units:
                raise ValueError(
                    f"layer {'/'.join(spec['path'])} has {spec['fan_in']} inputs, which is not a multiple "
                    f"of the {prev_units} units of the layer before it; declare the model non-sequential."
                )
            feeds_from, tile = i - 1, spec["fan_in"] // prev_units
        built.append(
            Layer(
                name="/".join(spec["path"]),
                path=spec["path"],
                units=spec["units"],
                fan_in=spec["fan_in"],
                feeds_from=feeds_from,
                input_tile=tile,
                norm_paths=tuple(spec["norm_paths"]),
                kernel_rank=spec["kernel_rank"],
            )
        )

    roles: dict[str, dict[Path, LeafRole]] = {}
    for collection, tree in variables.items():
        coll_roles = {}
        for path, leaf in leaf_paths(tree):
            module_path = path[:-1]
            if module_path not in module_layer:
                raise ValueError(
                    f"variable {collection}/{'/'.join(path)} belongs to no layer of the model."
                )
            layer = module_layer[module_path]
            spec = layers[layer]
            shape = np.shape(leaf)
            on_input = module_path in pre_set
            units_axis = on_input or (len(shape) >= 1 and shape[-1] == spec["units"])
            # a second-to-last axis is wired to the feeding layer only where it is the kernel's input axis
            is_kernel_like = (module_path not in norm_set and len(shape) >= 2 and units_axis
                              and shape[-2] == spec["fan_in"])
            coll_roles[path] = LeafRole(layer=layer, has_input_axis=bool(is_kernel_like), norm=module_path in norm_set,
                                        on_input=on_input, units_axis=bool(units_axis))
        roles[collection] = coll_roles
    return ModelStructure(layers=tuple(built), roles=roles, sequential=sequential)


def _kernel_leaf(params: Any, paths: list[Path]):
    """The leaf defining a module's units: its highest-rank leaf (kernel before bias)."""
    leaves = []
    for p in paths:
        node = params
        for k in p:
            node = node[k]
        leaves.append(node)
    return max(leaves, key=lambda a: (np.ndim(a), np.size(a)))
