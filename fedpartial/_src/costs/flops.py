"""FLOPs of a client's local work: analytic per-layer counts and XLA's count of a compiled step.

:mod:`fedpartial._src.costs.devices` turns these counts into simulated time
(``F_k`` of its time model; :class:`~fedpartial._src.costs.devices.CostModel`
applies them round by round).

**XLA's count** comes from the cost analysis of a client's compiled local
step (:func:`step_costs`): per client
group (:attr:`fedpartial._src.engine.round.FederatedRound.groups`) one step of one client,
and, for a group with a ``prepare`` stage (EmbracingFL's frozen prefix), the
preparation of one batch.  A client's round FLOPs are its real steps × (step +
preparation of one batch): the step runs once per real step, the prefix once over
each real batch of the round — not once per step on top of it (with several local
epochs a packed batch recurs once per epoch, and so does its preparation, as the
engine computes it).  Padded steps cost nothing.  The count includes everything
the step does (forward, backward, the optimizer, masking).  Two gaps of XLA's
counter are closed: a ``scan`` loop's body is counted once whatever its trip count
(the BiLSTM's recurrence), so the missing iterations are added
(:func:`_loop_flops`) to the pre-optimisation count; and when the compiled
executable reports no usable count (older GPU builds of jaxlib reported -1 for
library calls) the pre-optimisation count stands in (``GroupCost.flops_source``
says which).  The price is one extra compilation of each group's step per run
(about a second on a CPU for the small CNNs); ``compiled=False`` counts the
pre-optimisation HLO alone — no compilation, the same on every backend, exactly
linear in the batch — and reports no peak memory.

**Sub-model methods.**  A method whose plan has a ``dropout`` mask (FedDrop, FjORD,
Hermes, FedMP, PruneFL) removes units from the client's model; the engine runs the
full-width step with those units zeroed by masks, so its XLA count is the full
model's plus the masking.  A device holding only the kept units spends what XLA
counts for a physically smaller model.  That is estimated from XLA's count of the
*unmasked* full-width step (compiled with the dropout mask and ``step_plan``
removed: what a device running its sub-model as a plain model executes), split in
three (:func:`submodel_flops`):

* the part that does not grow with the batch (the optimizer update and other
  per-parameter work; found from a second, uncompiled count for one example),
  which scales with the kept parameters;
* the analytic kernel FLOPs (:func:`layer_costs`: forward ``2·MACs`` per example —
  a Dense layer ``2·in·out``, a convolution ``2·c_in·c_out`` per kernel tap that
  lands inside the input, so padding taps count nothing, as XLA counts them —
  times 3 for forward + weight gradient + input gradient, times 2 for the first
  layer a step trains, which needs no input gradient), which scale per layer with
  ``s_l = (kept inputs / inputs) · (kept outputs / outputs)``;
* the rest (bias, activations, pooling, normalisers, loss), which scales with the
  kept output values ``Σ_l e_l o_l / Σ_l e_l`` (``e_l`` a layer's outputs per
  example, ``o_l`` its kept share).

A client keeping every unit costs exactly what a FedAvg client costs.  Against
XLA's count of the physically smaller network (``tests/costs/test_flops.py``, batch 8,
SGD with momentum) the estimate is within 0.25% on pre-optimisation counts and
within 2% on compiled ones (the compiler's count of a narrower network is not a
fixed share of the wider one's); for LeNet-5 at half width, batch 10, +0.24%
compiled (measured once).  The round's plan stands for the whole round; a method
whose ``step_plan`` draws units afresh every local step reports each unit's keep
probability instead (metric ``dropout_keep_probability``, FedAD ``resample='step'``),
and the expected kept shares are used.  FedSPU is *not* a
sub-model method here: its frozen units stay in the forward pass and in
back-propagation, so its XLA count stands; the same holds for every
train-mask-only method.  A method that shrinks its graph (a
:class:`~fedpartial._src.core.types.LocalGraph` that slices widths, as HeteroFL's tiers) is
counted by XLA directly and should not also set a dropout mask.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import numpy as np
from flax.linen.linear import canonicalize_padding

from fedpartial._src.core.masks import Mask
from fedpartial._src.core.structure import leaf_paths
from fedpartial._src.core.xla_costs import flops_of
from fedpartial._src.costs.footprint import adapted_paths, adapter_outputs
from fedpartial._src.engine import graphs
from fedpartial._src.engine.client import make_client_fns
from fedpartial._src.models.adapter import Model

# ---- analytic per-layer FLOPs ----------------------------------------------------------


def _valid_taps(in_size: int, out_size: int, kernel: int, stride: int, dilation: int, pad_lo: int) -> int:
    """Σ over output positions of the kernel taps that land inside the (unpadded) input."""
    o = np.arange(out_size)[:, None]
    i = o * stride - pad_lo + np.arange(kernel)[None, :] * dilation
    return int(np.sum((i >= 0) & (i < in_size)))


def _conv_macs(module: nn.Conv, in_shape: Sequence[int], out_shape: Sequence[int], kernel_shape) -> int | None:
    """Multiply-adds of one example through a shared-weight ``nn.Conv`` (None: a case not modelled)."""
    spatial = len(kernel_shape) - 2
    in_sp, out_sp = tuple(in_shape[-spatial - 1:-1]), tuple(out_shape[-spatial - 1:-1])
    if len(in_sp) != spatial or len(out_sp) != spatial:
        return None

    def per_dim(v):
        return (v,) * spatial if isinstance(v, int) or v is None else tuple(v)

    strides = per_dim(module.strides or 1)
    dilation = per_dim(module.kernel_dilation or 1)
    if any(d != 1 for d in per_dim(module.input_dilation or 1)):
        return None
    ksize = tuple(kernel_shape[:spatial])
    padding = canonicalize_padding(module.padding, spatial)
    taps = 1
    for d in range(spatial):
        window = (ksize[d] - 1) * dilation[d] + 1
        if padding in ("CIRCULAR", "REFLECT", "CAUSAL"):
            # flax pads the input itself, then runs a VALID convolution over real values.
            taps *= out_sp[d] * ksize[d]
            continue
        if padding == "VALID":
            lo = 0
        elif padding == "SAME":
            lo = max((out_sp[d] - 1) * strides[d] + window - in_sp[d], 0) // 2
        elif isinstance(padding, (list, tuple)):
            lo = int(padding[d][0])
        else:
            return None
        taps *= _valid_taps(in_sp[d], out_sp[d], ksize[d], strides[d], dilation[d], lo)
    # kernel_shape[-2] is c_in / groups: every output unit reads that many input channels.
    return taps * int(kernel_shape[-2]) * int(kernel_shape[-1])


class LayerCosts(NamedTuple):
    """Per layer (structure order): for one example, ``forward_flops`` ``2 · multiply-adds``
    of its Conv/Dense and ``outputs`` the number of its output values; and its parameters,
    ``kernel_params`` (leaves with an input axis) and ``unit_params`` (bias, normaliser)."""

    forward_flops: np.ndarray  # [L] float64
    outputs: np.ndarray  # [L] float64
    kernel_params: np.ndarray  # [L] float64
    unit_params: np.ndarray  # [L] float64


def layer_costs(model: Model, input_shape: Sequence[int] | None = None) -> LayerCosts:
    """Analytic per-layer costs of one example (bias, normaliser and activation not in the FLOPs).

    A Dense layer: ``2 · in · out`` per position it is applied at.  A shared-weight
    ``nn.Conv``: ``2 · c_in · c_out`` per kernel tap that lands inside the input, summed
    over output positions (a 'SAME' padding tap multiplies a zero and is not counted,
    as XLA does not count it).  Any other module: ``2 · kernel size · output positions``.
    Found from one abstract forward pass (batch 1), as
    :func:`fedpartial._src.costs.footprint.layer_output_shapes`; needs a linen model.

    Raises:
      ValueError: no call was recorded for some layer (e.g. an NNX model).
    """
    structure = model.structure
    wanted = {layer.path for layer in structure.layers} | adapted_paths(model)
    seen: dict[tuple[str, ...], tuple] = {}

    def record(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        if context.method_name == "__call__":
            path = tuple(context.module.path)
            if path in wanted and path not in seen and args and hasattr(args[0], "shape") and hasattr(out, "shape"):
                seen[path] = (context.module, tuple(args[0].shape), tuple(out.shape))
        return out

    variables = jax.eval_shape(model.init_variables, jax.random.key(0))
    shape = model.input_shape if input_shape is None else tuple(input_shape)
    x = jax.ShapeDtypeStruct((1, *shape), getattr(model, "input_dtype", jnp.float32))
    with nn.intercept_methods(record):
        jax.eval_shape(lambda v, xb: model.apply(v, xb, False), variables, x)
    recorded = {path: out[1:] for path, (_, _, out) in seen.items()}  # one example's, as adapter_outputs takes
    for path, (a_out, b_out) in adapter_outputs(model, recorded).items():  # a LoRA model's A and B layers
        module, in_shape, _ = seen[path]
        seen.setdefault((*path, "lora_a"), (module, in_shape, (1, *a_out)))
        seen.setdefault((*path, "lora_b"), (module, (1, *a_out), (1, *b_out)))
    kernels = {}
    for path, leaf in leaf_paths(variables["params"]):
        if path[:-1] in wanted:
            old = kernels.get(path[:-1])
            if old is None or (len(leaf.shape), math.prod(leaf.shape)) > (len(old), math.prod(old)):
                kernels[path[:-1]] = tuple(leaf.shape)
    flops, outputs = [], []
    for layer in structure.layers:
        if layer.path not in seen:
            raise ValueError(f"no call was recorded for layer {layer.name!r} of model {model.name!r}; analytic "
                             "FLOPs need a linen model (adapted with from_linen).")
        module, in_shape, out_shape = seen[layer.path]
        kernel = kernels[layer.path]
        macs = None
        if isinstance(module, nn.Conv) and len(kernel) >= 3:
            macs = _conv_macs(module, in_shape[1:], out_shape[1:], kernel)
        if macs is None:
            positions = math.prod(out_shape[1:-1]) if len(out_shape) > 2 else 1
            macs = positions * math.prod(kernel)
        flops.append(2.0 * macs)
        outputs.append(float(math.prod(out_shape[1:])))
    kernel_params, unit_params = np.zeros(len(flops)), np.zeros(len(flops))
    for path, leaf in leaf_paths(variables["params"]):
        role = structure.role("params", path)
        (kernel_params if role.has_input_axis else unit_params)[role.layer] += math.prod(leaf.shape)
    return LayerCosts(np.asarray(flops, np.float64), np.asarray(outputs, np.float64), kernel_params, unit_params)


def layer_forward_flops(model: Model, input_shape: Sequence[int] | None = None) -> np.ndarray:
    """``[L]`` forward FLOPs of one example per layer (:func:`layer_costs`)."""
    return layer_costs(model, input_shape).forward_flops


def kept_shares(model: Model, dropout: Mask) -> tuple[np.ndarray, np.ndarray]:
    """Per layer ``[..., L]``: ``(kept inputs / inputs) · (kept outputs / outputs)`` (the share
    of its kernel work) and ``kept outputs / outputs`` (the share of its output values)
    under a dropout mask's neurons.  The classifier's outputs are always kept and the
    first layer's inputs are the data.  The neurons may also be keep *probabilities* of
    masks drawn independently per unit: the result is then the expected share (the
    product of independent layers' expectations is the expectation of the product)."""
    structure = model.structure
    kept = [np.mean(np.asarray(n, np.float64), axis=-1) for n in dropout.neurons]  # bools, or keep probabilities
    kept[-1] = np.ones_like(kept[-1], dtype=np.float64)
    kernel = [np.asarray(kept[l], np.float64) * (kept[layer.feeds_from] if layer.feeds_from is not None else 1.0)
              for l, layer in enumerate(structure.layers)]
    return (np.stack(np.broadcast_arrays(*kernel), axis=-1),
            np.stack(np.broadcast_arrays(*[np.asarray(k, np.float64) for k in kept]), axis=-1))


def _kernel_weights(forward: np.ndarray, layers: Sequence[int], backward: bool) -> np.ndarray:
    """Per layer, the multiple of its forward FLOPs a step spends on its kernel: 3 (forward,
    weight and input gradient), 2 for the first layer trained (no input gradient), 1 in a
    forward-only pass; 0 for a layer not in ``layers``."""
    a = np.zeros_like(forward)
    for i, l in enumerate(layers):
        a[l] = forward[l] * ((2.0 if i == 0 else 3.0) if backward else 1.0)
    return a


def training_flops(model: Model, dropout: Mask | None = None, *, batch_size: int = 1,
                   layers: Sequence[int] | None = None):
    """Analytic FLOPs of one local step on ``batch_size`` examples, kernels only.

    ``Σ_l batch · f_l · s_l · (3, or 2 for the first layer of ``layers``)`` with ``f_l``
    from :func:`layer_costs` and ``s_l`` the kernel share of ``dropout``
    (:func:`kept_shares`; None: the full model).  ``layers``: the layers the step trains
    (default all), ordered.  A lower bound of what XLA counts (bias, activations,
    pooling, loss and update are left out).  Returns a float, or an array with the
    mask's leading shape.
    """
    f = layer_forward_flops(model)
    a = _kernel_weights(f, tuple(range(len(f))) if layers is None else tuple(layers), backward=True)
    s = np.ones_like(f) if dropout is None else kept_shares(model, dropout)[0]
    total = batch_size * np.sum(a * s, axis=-1)
    return float(total) if np.ndim(total) == 0 else total


def submodel_flops(xla_flops: float, layers: LayerCosts, run: Sequence[int], shares: tuple[np.ndarray, np.ndarray],
                   batch_size: int, *, backward: bool = True, fixed_flops: float | None = None):
    """A sub-model's share of a full-width pass that XLA counted as ``xla_flops``.

    The count is split in three: ``fixed_flops``, the part that does not grow with
    the batch (the update and other per-parameter work; None: not measured, taken as
    0), scales with the kept parameters of the layers ``run`` (a kernel's with
    ``s_l``, a bias's or normaliser's with ``o_l``); of the rest, the analytic kernel
    FLOPs (on ``batch_size`` examples; with ``backward`` the training multiples of
    :func:`training_flops`, else forward only) scale per layer with ``s_l``, and what
    remains (bias, activations, pooling, normalisers, loss) with the kept output
    values ``Σ_l e_l o_l / Σ_l e_l``.  ``shares`` is :func:`kept_shares`'s ``(s, o)``.
    With every unit kept the result is ``xla_flops`` itself.  Returns an array with
    the shares' leading shape.
    """
    s, o = shares
    run = list(run)
    fixed = 0.0 if fixed_flops is None else min(max(fixed_flops, 0.0), xla_flops)
    per_batch = xla_flops - fixed
    a = _kernel_weights(layers.forward_flops, tuple(run), backward)
    kernel_full = batch_size * a.sum()
    kernel_kept = batch_size * np.sum(a * s, axis=-1)

    in_run = np.isin(np.arange(len(a)), run)
    ones = np.ones(s.shape[:-1])

    def share(total, kept):
        total = np.where(in_run, total, 0.0).sum()
        return np.sum(np.where(in_run, kept, 0.0), axis=-1) / total if total > 0 else ones

    params_kept = share(layers.kernel_params + layers.unit_params, layers.kernel_params * s + layers.unit_params * o)
    outputs_kept = share(layers.outputs, layers.outputs * o)
    if kernel_full <= 0:
        return fixed * params_kept + per_batch * outputs_kept
    if per_batch < kernel_full:  # a backend that counts less than the kernels: scale the whole count
        return xla_flops * kernel_kept / kernel_full
    return fixed * params_kept + kernel_kept + (per_batch - kernel_full) * outputs_kept


# ---- FLOPs from XLA ----------------------------------------------------------------------


class GroupCost(NamedTuple):
    """One client group's compiled local work, for one client.

    Attributes:
      name: the group's name.
      step_flops: one local step (XLA's count of the compiled step).
      prepare_flops: the group's preparation of one batch (0 without a ``prepare`` stage).
      step_peak_bytes / prepare_peak_bytes: peak memory of the compiled step /
        preparation as XLA reports it (arguments, outputs and temporaries), or None
        where the backend does not report it (0 without preparation).
      step_layers: the layers the step trains (structure order).
      prepare_layers: the layers the preparation runs (forward only).
      flops_source: 'compiled' or 'lowered' (see the module docstring).
      submodel: the group's clients train sub-models (the plan has a dropout mask):
        ``step_flops`` is then the full-width step *without* masking, which
        :meth:`fedpartial._src.costs.devices.CostModel.client_flops` scales to each client's kept units.
      batch_size: examples per step (padded batch), for that scaling.
      step_fixed_flops: the part of ``step_flops`` that does not grow with the batch
        (the update, per-parameter work), found for a sub-model group from a second,
        uncompiled count of its step for one example; None otherwise.
    """

    name: str
    step_flops: float
    prepare_flops: float
    step_peak_bytes: int | None
    prepare_peak_bytes: int | None
    step_layers: tuple[int, ...]
    prepare_layers: tuple[int, ...]
    flops_source: str
    submodel: bool = False
    batch_size: int = 1
    step_fixed_flops: float | None = None


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), tree)


def _row(tree: Any, leading: int = 1) -> Any:
    """One client's (``leading=1``) or one step's (2) abstract slice."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[leading:], a.dtype), tree)


def _loop_flops(jaxpr) -> float:
    """FLOPs that XLA's cost analysis leaves out of ``jaxpr``'s ``scan`` loops.

    XLA counts a loop body once, whatever its trip count.  A scan of ``length``
    iterations whose lowered loop holds ``c`` copies of the body (``c`` = its unroll,
    plus the remainder iterations lowered outside the loop) is short of
    ``(length − c)`` bodies; a scan nested in it repeats ``length`` times.  Bodies are
    counted on their pre-optimisation HLO.  A ``while`` loop of unknown trip count
    stays counted once.
    """
    extra = 0.0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            body, length = eqn.params["jaxpr"], int(eqn.params["length"])
            unroll = max(int(eqn.params.get("unroll", 1)), 1)
            copies = length if unroll >= length else unroll + length % unroll
            args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in body.in_avals]
            once = flops_of(jax.jit(jax_core.jaxpr_as_fun(body)).lower(*args).cost_analysis()) or 0.0
            extra += (length - copies) * once + length * _loop_flops(body.jaxpr)
        else:
            for sub in jax_core.jaxprs_in_params(eqn.params):
                extra += _loop_flops(sub)
    return extra


class XlaCost(NamedTuple):
    """XLA's cost analysis of one jitted function (see :func:`xla_costs`)."""

    flops: float  # the compiled executable's count (or the lowered one, see ``source``)
    lowered_flops: float  # the pre-optimisation HLO's count
    peak_bytes: int | None  # peak memory of the compiled executable, None if not reported or not compiled
    source: str  # 'compiled' or 'lowered'


def xla_costs(fn, *args, compiled: bool = True) -> XlaCost:
    """FLOPs (and peak bytes) of ``jax.jit(fn)`` for the abstract ``args``.

    ``flops`` is the compiled executable's count; the pre-optimisation HLO's count
    (``lowered_flops``) stands in when the executable reports none, when the function
    has ``scan`` loops (whose bodies XLA counts once, :func:`_loop_flops` adds the
    rest; the compiler may unroll a loop, so loops are counted before it does), or
    with ``compiled=False`` (nothing is compiled: no peak memory either).  A backend
    whose pre-optimisation HLO reports no count (jaxlib's CUDA build) is compiled
    anyway and its executable's count serves as both.
    """
    traced = jax.jit(fn).trace(*args)
    lowered = traced.lower()
    loops = _loop_flops(traced.jaxpr.jaxpr)
    before = flops_of(lowered.cost_analysis())
    # Some backends (the CUDA build of jaxlib) count nothing before compilation: compile then, even when
    # asked not to, and let the compiled count stand in for the pre-optimisation one.
    executable = lowered.compile() if compiled or before is None else None
    after = None if executable is None or (loops and before is not None) else flops_of(executable.cost_analysis())
    if after is None and before is None:
        raise ValueError(f"XLA's cost analysis reports no FLOP count on the {jax.default_backend()} backend.")
    peak = None
    if executable is not None:
        try:
            peak = getattr(executable.memory_analysis(), "peak_memory_in_bytes", None)
            peak = int(peak) if peak is not None and peak > 0 else None
        except Exception:  # noqa: BLE001 — memory analysis is optional on some backends
            peak = None
    lowered_total = (before if before is not None else after) + loops
    if after is None:
        return XlaCost(lowered_total, lowered_total, peak, "lowered")
    return XlaCost(after + loops, lowered_total, peak, "compiled")


def _graph_layers(fr, group, variables) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(layers in the group's step graph, layers its preparation runs)."""
    layers = fr.model.structure.layers
    if group.graph is None:
        return tuple(range(len(layers))), ()
    kept = {path[:-1] for path, _ in leaf_paths(group.graph.extract(variables)["params"])}
    step = tuple(i for i, layer in enumerate(layers) if layer.path in kept)
    prepare = () if group.graph.prepare is None else tuple(i for i in range(len(layers)) if i not in step)
    return step, prepare


def step_costs(fr, cohort, state=None, *, compiled: bool = True) -> tuple[GroupCost, ...]:
    """Per client group of ``fr`` (a :class:`~fedpartial._src.engine.round.FederatedRound`), the XLA
    cost of one client's local step and of its preparation of one batch.

    Compiles one un-vmapped step per group for the shapes of ``cohort`` (its data
    ``[K, S, B, ...]``; values are not read) — usable on its own, e.g. for a tier's
    FLOPs and peak memory; :class:`fedpartial._src.costs.devices.CostModel` caches it per shape.  ``state``: a
    server state (or its shapes) of ``fr``; default the shapes of ``fr.pure_init``.
    ``compiled=False`` counts the pre-optimisation HLO instead and compiles nothing
    (no peak memory): the same for every backend, exactly linear in the batch, and
    about thirty times faster.
    """
    key = jax.random.key(0)
    if state is None:
        state = jax.eval_shape(fr.pure_init, key)
    state = _abstract(state)
    inputs = jax.eval_shape(fr.local_inputs, state, _abstract(cohort), key)
    global_vars = state.variables
    out = []
    for group, fns, li in zip(fr.groups, fr.clients, inputs):
        start, data, plan, cstate, ckey = _row(li.start), _row(li.data), _row(li.plan), _row(li.client_state), \
            _row(li.client_keys)
        prepares = group.graph is not None and group.graph.prepare is not None
        prepare_flops, prepare_peak = 0.0, 0
        if prepares:
            one_batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct((1, *a.shape[1:]), a.dtype), data)
            prepare = xla_costs(fns.prepare, start, one_batch, compiled=compiled)
            prepare_flops = prepare.flops if compiled else prepare.lowered_flops
            prepare_peak = prepare.peak_bytes
            data = jax.eval_shape(fns.prepare, start, data)
        local = jax.eval_shape(fns.init, start)
        index = jax.ShapeDtypeStruct((), jnp.int32)
        submodel = plan.dropout is not None
        step = fns.step
        if submodel:
            # A device holding the sub-model runs it unmasked: count the step without the
            # dropout mask (and without a step_plan, which only resamples it).
            step = make_client_fns(fr.ctx, fr.method._replace(step_plan=None), fr.client_optimizer,
                                   track_batch_stats=fr.bn_policy == "global",
                                   graph=group.graph or graphs.whole(fr.model)).step
            plan = plan._replace(dropout=None, dropout_scale=None)
        batch = _row(data)
        cost = xla_costs(step, local, batch, plan, global_vars, cstate, ckey, index, li.server_state,
                         compiled=compiled)
        step_flops, step_peak, source = cost.flops, cost.peak_bytes, cost.source
        if not compiled:
            step_flops, source = cost.lowered_flops, "lowered"
        batch_size, fixed = int(np.shape(cohort.data.x)[2]), None
        if submodel and batch_size > 1 and cost.lowered_flops > 0:
            # C(b) = fixed + b·per_example, exactly so before optimisation: a count for one
            # example (lowered only, no compilation) splits the two; the compiled count is
            # split in the same proportion.
            one = jax.tree.map(lambda a: jax.ShapeDtypeStruct((1, *a.shape[1:]), a.dtype) if a.ndim else a, batch)
            single = xla_costs(step, local, one, plan, global_vars, cstate, ckey, index, li.server_state,
                              compiled=False).lowered_flops
            fixed_lowered = single - (cost.lowered_flops - single) / (batch_size - 1)
            fixed = step_flops * min(max(fixed_lowered, 0.0) / cost.lowered_flops, 1.0)
        step_layers, prepare_layers = _graph_layers(fr, group, global_vars)
        out.append(GroupCost(group.name, step_flops, prepare_flops, step_peak, prepare_peak, step_layers,
                             prepare_layers, source, submodel, batch_size, fixed))
    return tuple(out)
