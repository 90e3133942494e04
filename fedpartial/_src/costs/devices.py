"""Simulated device time: device profiles, the FLOPs of a client's local work, and round times.

**Time model** (SPEC §5 "Device model").  Client ``k`` of a round spends

    t_k = F_k / c_k  +  D_k / b↓_k  +  U_k / b↑_k

seconds: ``F_k`` FLOPs of local work at compute speed ``c_k`` (FLOP/s), ``D_k``
bytes downloaded at ``b↓_k`` and ``U_k`` bytes uploaded at ``b↑_k`` (bytes/s),
one after the other (download, train, upload; no overlap).  A round lasts as long
as its slowest *valid* client (padding clients never count); server-side work
(aggregation, evaluation) is taken to be free.  :func:`client_times`,
:func:`round_time` and :func:`expected_execution_time` are that arithmetic.

**Device profiles** (:class:`DeviceProfiles`, host numpy ``[N]``) are drawn from
seeded distributions (:func:`sample_profiles`; every client independently, each
quantity from its own stream, so changing one distribution leaves the others'
draws as they were) or read from a CSV (:func:`load_profiles`).  Default
distributions (log-normal: device populations are skewed, with a long tail of
slow phones) are orders of magnitude for phones and edge boards, not a fit to a
trace:

* compute: median 5 GFLOP/s, σ = 0.7 (10th–90th percentile ≈ 2–12 GFLOP/s) — the
  sustained FP32 throughput of phone CPUs / small edge GPUs in on-device benchmarks
  (AI Benchmark, Ignatov et al. 2019, measures phones' inference in the GFLOP/s
  range; training runs slower than peak inference);
* download: median 20 Mbit/s (2.5 MB/s), upload: median 5 Mbit/s (0.625 MB/s),
  σ = 0.8 each — the order of mobile-network medians in public speed-test reports,
  with the several-fold download/upload asymmetry that Konečný et al. (2016,
  "Federated learning: strategies for improving communication efficiency") build on.

Give measured profiles as a CSV for anything that depends on the absolute numbers.

**FLOPs of local work** come from XLA's cost analysis of a client's compiled local
step (:func:`step_costs`, cached per input shape by :class:`CostModel`): per client
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
XLA's count of the physically smaller network (``tests/costs/test_devices.py``, batch 8,
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

import csv
import dataclasses
import math
import numbers
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import numpy as np
from flax.linen.linear import canonicalize_padding

from fedpartial._src.engine import graphs
from fedpartial._src.core import masks
from fedpartial._src.engine.client import make_client_fns
from fedpartial._src.core.errors import UserError
from fedpartial._src.core.masks import Mask
from fedpartial._src.models.adapter import Model
from fedpartial._src.core.structure import leaf_paths

# ---- device profiles -------------------------------------------------------------------

#: CSV columns of a device-profiles file (other columns, e.g. a device name, are ignored)
PROFILE_COLUMNS = ("compute_flops_per_s", "download_bytes_per_s", "upload_bytes_per_s")
DISTRIBUTION_KINDS = ("lognormal", "uniform")

#: default distributions (see the module docstring for where they come from)
DEFAULT_COMPUTE = "lognormal:5e9:0.7"
DEFAULT_DOWNLOAD = "lognormal:2.5e6:0.8"
DEFAULT_UPLOAD = "lognormal:6.25e5:0.8"


class Distribution(NamedTuple):
    """A positive per-client quantity: ``lognormal`` (a = median, b = σ of the log),
    ``uniform`` (between a and b) or ``constant`` (a)."""

    kind: str
    a: float
    b: float = 0.0

    def draw(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` independent draws (float64)."""
        if self.kind == "constant":
            return np.full(n, self.a, np.float64)
        if self.kind == "uniform":
            return rng.uniform(self.a, self.b, n)
        return self.a * np.exp(self.b * rng.standard_normal(n))


def _positive_finite(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def parse_distribution(text: str | Distribution, what: str = "value") -> Distribution:
    """``"lognormal:MEDIAN:SIGMA"``, ``"uniform:LOW:HIGH"`` or a plain positive number.

    Raises:
      UserError: one sentence naming ``what``, the bad text and what is allowed.
    """
    if isinstance(text, Distribution):
        text = f"{text.kind}:{text.a}:{text.b}" if text.kind != "constant" else str(text.a)
    allowed = "a positive number, 'lognormal:MEDIAN:SIGMA' or 'uniform:LOW:HIGH'"
    parts = str(text).strip().split(":")
    try:
        numbers_ = [float(p) for p in (parts if len(parts) == 1 else parts[1:])]
    except ValueError:
        raise UserError(f"{what} {text!r} is not {allowed}.") from None
    if len(parts) == 1:
        if not _positive_finite(numbers_[0]):
            raise UserError(f"{what} {text!r} must be a positive finite number.")
        return Distribution("constant", numbers_[0])
    kind = parts[0].strip().lower()
    if kind not in DISTRIBUTION_KINDS or len(numbers_) != 2:
        raise UserError(f"{what} {text!r} is not {allowed}.")
    a, b = numbers_
    if kind == "lognormal" and not (_positive_finite(a) and math.isfinite(b) and b >= 0):
        raise UserError(f"{what} {text!r} needs a positive finite median and a finite σ ≥ 0.")
    if kind == "uniform" and not (_positive_finite(a) and _positive_finite(b) and a <= b):
        raise UserError(f"{what} {text!r} needs finite bounds with 0 < LOW ≤ HIGH.")
    return Distribution(kind, a, b)


class DeviceProfiles(NamedTuple):
    """Every client's device, host numpy ``[N]`` float64 each."""

    compute_flops_per_s: np.ndarray
    download_bytes_per_s: np.ndarray
    upload_bytes_per_s: np.ndarray

    @property
    def num_clients(self) -> int:
        return len(self.compute_flops_per_s)


def sample_profiles(num_clients: int, seed: int, *, compute: str | Distribution = DEFAULT_COMPUTE,
                    download: str | Distribution = DEFAULT_DOWNLOAD,
                    upload: str | Distribution = DEFAULT_UPLOAD) -> DeviceProfiles:
    """``num_clients`` devices drawn independently; the same seed gives the same devices.

    Each quantity has its own random stream (seeded by ``seed`` and its column), so a
    run that changes only the upload distribution keeps every client's compute speed.
    """
    dists = [parse_distribution(d, name) for d, name in
             zip((compute, download, upload), ("compute speed", "download bandwidth", "upload bandwidth"))]
    columns = [d.draw(num_clients, np.random.default_rng([seed, 0xDE1C, i])) for i, d in enumerate(dists)]
    return DeviceProfiles(*columns)


def save_profiles(path: str | os.PathLike, profiles: DeviceProfiles) -> None:
    """Writes ``profiles`` as a CSV with :data:`PROFILE_COLUMNS` (one row per client, exact floats)."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(PROFILE_COLUMNS)
        for row in zip(*profiles):
            writer.writerow([repr(float(v)) for v in row])


def load_profiles(path: str | os.PathLike, num_clients: int) -> DeviceProfiles:
    """Device profiles from a CSV with the columns :data:`PROFILE_COLUMNS` (any order, extra ones ignored).

    Rows are assigned to clients **cycled by id**: client ``i`` gets data row ``i mod R``
    (R rows), so a file with one row per client gives each its own device and a short
    file describes device kinds that repeat across the population.

    Raises:
      UserError: the file is missing or empty, lacks a column, or a value (named by
        row and column; rows count from 1 after the header) is not a positive finite number.
    """
    name = os.fspath(path)
    try:
        with open(name, newline="") as f:
            reader = csv.DictReader(f)
            header = [h.strip() for h in (reader.fieldnames or [])]
            missing = [c for c in PROFILE_COLUMNS if c not in header]
            if missing:
                raise UserError(f"device profiles file {name} has no column {missing[0]!r}; it needs the columns "
                                f"{', '.join(PROFILE_COLUMNS)}.")
            reader.fieldnames = header
            rows = []
            for i, row in enumerate(reader, start=1):
                values = []
                for column in PROFILE_COLUMNS:
                    text = (row.get(column) or "").strip()
                    try:
                        value = float(text)
                    except ValueError:
                        value = math.nan
                    if not _positive_finite(value):
                        raise UserError(f"device profiles file {name}: row {i} has {column} = {text!r}, which must "
                                        "be a positive finite number.")
                    values.append(value)
                rows.append(values)
    except OSError as e:
        raise UserError(f"device profiles file {name} cannot be read ({e.strerror or e}).") from None
    if not rows:
        raise UserError(f"device profiles file {name} has a header but no rows; give at least one device.")
    table = np.asarray(rows, np.float64)[np.arange(num_clients) % len(rows)]
    return DeviceProfiles(*table.T.copy())


# ---- the time model --------------------------------------------------------------------


def client_times(profiles: DeviceProfiles, client_ids, flops, download_bytes, upload_bytes) -> np.ndarray:
    """Each client's round time ``F/c + D/b↓ + U/b↑`` in seconds, ``[K]`` float64.

    ``client_ids`` ``[K]`` index the population's profiles (None: every client, in id
    order); ``flops``, ``download_bytes`` and ``upload_bytes`` broadcast against it.
    """
    ids = np.arange(profiles.num_clients) if client_ids is None else np.asarray(client_ids)
    return (np.asarray(flops, np.float64) / profiles.compute_flops_per_s[ids]
            + np.asarray(download_bytes, np.float64) / profiles.download_bytes_per_s[ids]
            + np.asarray(upload_bytes, np.float64) / profiles.upload_bytes_per_s[ids])


def round_time(times, valid) -> float:
    """The round's simulated time: its slowest valid client's (0 when none is valid)."""
    times = np.asarray(times, np.float64)
    return float(np.max(np.where(np.asarray(valid, bool), times, 0.0), initial=0.0))


def expected_execution_time(profiles: DeviceProfiles, flops, download_bytes, upload_bytes) -> np.ndarray:
    """``ET_k`` of every client ``[N]``: the time of a round's work of ``flops`` FLOPs and the
    given bytes on each device (e.g. full-model local training, for FedAD's target
    dropout rates ``d*_k = min(ET_max / ET_k, 1)``)."""
    return client_times(profiles, None, flops, download_bytes, upload_bytes)


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
    wanted = {layer.path for layer in structure.layers}
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
        :meth:`CostModel.client_flops` scales to each client's kept units.
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


def _flops_of(analysis) -> float | None:
    """The 'flops' entry of a cost analysis (a dict, or a list of one on older jax), if usable."""
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0] if analysis else None
    value = (analysis or {}).get("flops")
    return float(value) if value is not None and math.isfinite(value) and value >= 0 else None


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
            once = _flops_of(jax.jit(jax_core.jaxpr_as_fun(body)).lower(*args).cost_analysis()) or 0.0
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
    before = _flops_of(lowered.cost_analysis())
    # Some backends (the CUDA build of jaxlib) count nothing before compilation: compile then, even when
    # asked not to, and let the compiled count stand in for the pre-optimisation one.
    executable = lowered.compile() if compiled or before is None else None
    after = None if executable is None or (loops and before is not None) else _flops_of(executable.cost_analysis())
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
    FLOPs and peak memory; :class:`CostModel` caches it per shape.  ``state``: a
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


@dataclasses.dataclass(eq=False)
class CostModel:
    """The FLOPs of a :class:`~fedpartial._src.engine.round.FederatedRound`'s local work, round by round.

    Counts (and compiles, unless ``compiled=False``) each group's step once per
    distinct cohort shape (``compilations`` counts how often).  Use::

        costs = CostModel(fr)
        dropout = costs.round_dropout(state, cohort, key)   # before the round (state is donated)
        state, metrics = fr(state, cohort, key)
        flops = costs.client_flops(cohort, metrics["client_steps_per_client"], dropout)  # [K]
    """

    fr: Any
    compiled: bool = True  # count the compiled steps (False: pre-optimisation HLO, see step_costs)
    compilations: int = 0

    def __post_init__(self):
        self._cache: dict = {}
        self._dropout_fn = None
        self._layers = None

    @staticmethod
    def _signature(cohort) -> tuple:
        leaves, treedef = jax.tree.flatten(cohort)
        return treedef, tuple((np.shape(a), np.dtype(a.dtype).str if not jax.dtypes.issubdtype(
            a.dtype, jax.dtypes.extended) else str(a.dtype)) for a in leaves)

    def group_costs(self, cohort, state=None) -> tuple[GroupCost, ...]:
        """:func:`step_costs` for this cohort's shapes, compiled on the first call per shape."""
        sig = self._signature(cohort)
        if sig not in self._cache:
            self._cache[sig] = step_costs(self.fr, cohort, state, compiled=self.compiled)
            self.compilations += 1
        return self._cache[sig]

    def round_dropout(self, state, cohort, key) -> Mask | None:
        """The round's ``[K]`` dropout mask (host numpy), or None for a full-model method.

        Computes the plan the round itself will compute (same state, cohort and key);
        call it before the round, whose fused strategy consumes ``state``.
        """
        if not any(cost.submodel for cost in self.group_costs(cohort)):
            return None
        if self._dropout_fn is None:
            def dropout(state, cohort, key):
                structure = self.fr.model.structure
                parts = [masks.full(structure, (g.size,)) if li.plan.dropout is None else li.plan.dropout
                         for g, li in zip(self.fr.groups, self.fr.local_inputs(state, cohort, key))]
                parts = [p._replace(inputs=None) for p in parts]  # only the neurons say what a sub-model keeps
                return parts[0] if len(parts) == 1 else jax.tree.map(lambda *a: jnp.concatenate(a), *parts)
            self._dropout_fn = jax.jit(dropout)
        return jax.device_get(self._dropout_fn(state, cohort, key))

    def client_flops(self, cohort, steps, dropout: Mask | None = None) -> np.ndarray:
        """``[K]`` float64 FLOPs each client spent this round: real steps × (step + preparation
        of one batch), scaled to the kept units for a sub-model client."""
        steps = np.asarray(steps, np.float64)
        out = np.zeros_like(steps)
        for cost, group, offset in zip(self.group_costs(cohort), self.fr.groups, self.fr.offsets):
            rows = slice(offset, offset + group.size)
            step, prepare = cost.step_flops, cost.prepare_flops
            if cost.submodel and dropout is not None:
                if self._layers is None:
                    self._layers = layer_costs(self.fr.model)
                mask = jax.tree.map(lambda a, rows=rows: np.asarray(a)[rows], dropout)
                shares = kept_shares(self.fr.model, mask)
                step = submodel_flops(step, self._layers, cost.step_layers, shares, cost.batch_size,
                                      fixed_flops=cost.step_fixed_flops)
                prepare = submodel_flops(prepare, self._layers, cost.prepare_layers, shares, cost.batch_size,
                                         backward=False)
            out[rows] = steps[rows] * (step + prepare)
        return out
