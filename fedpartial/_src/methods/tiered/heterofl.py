"""HeteroFL, static version (Diao et al. 2021): width reduction, EmbracingFL's baseline (docs/decisions.md#embracingfl).

Algorithm, per round:

1. a **strong** client trains the whole model; a **moderate** or **weak** client
   (tier ratio ``r``) receives and trains only the leading ``⌈r·C⌉`` channels /
   units of every hidden layer — a physically smaller model of the same
   architecture (:func:`fedpartial._src.engine.graphs.width`), so its step really costs less;
   the classifier keeps every class;
2. in training, every hidden Conv/Dense output is multiplied by ``1/r`` (HeteroFL's
   "Scaler"); evaluation is never scaled (the global model is the full model);
3. the server averages **each element over the clients holding it**: unweighted
   (``weighting="uniform"``, as HeteroFL's code counts holders) or ``n_k``-weighted
   (``"samples"``) — the engine's one formula with each client's upload mask =
   its width in full-model coordinates (:func:`width_mask`).

Tiers are static client groups, as in EmbracingFL (:mod:`fedpartial._src.methods.tiered.tiers`:
``--tier-mix S,M,W`` or ``--capacity-case 1..10``; stratified sampling per tier).

**Widths.**  The paper's Table 10 (ResNet20/CIFAR-10) keeps 7 of 16 channels at
every layer for moderate clients and 3 of 16 for weak ones: its activation
counts are exactly ``7/16`` and ``3/16`` of the full model's (3,039,552 and
1,302,848 of 6,947,136, the 10 logits aside), and its parameter counts are
reproduced exactly by channels (7, 14, 28) and (3, 6, 12) in its ResNet20
variant: 52,874 and 10,006 (conv weights + BatchNorm scale/bias + head).  So the
default ``widths`` are ``(0.4375, 0.1875)``.  Our ResNet20 lacks that variant's
16→16 projection in ``stage1_block1`` (see :class:`fedpartial._src.models.zoo.ResNet20`),
so it counts 52,811 and 9,991 parameters (63 and 15 fewer: that projection's
``c²`` weights and ``2c`` BatchNorm values), and capacities 0.428 and 0.181
(:func:`fedpartial._src.methods.tiered.width_capacity.capacity_table`; the paper: 0.43 and 0.18).

Choices where the papers are vague:

* The Scaler sits after every hidden Conv/Dense (ResNet20: every conv, the
  shortcut projection too), before BatchNorm and ReLU, never after the classifier.
  ``scaler=False`` turns it off (then a narrow client computes exactly the full
  model with the other channels zeroed; FjORD's ordered dropout).  With no
  normalisation after it (e.g. ``cnn2c1f``) the Scaler multiplies the
  pre-activations and their gradients by ``1/r``: at a high learning rate a weak
  client's first steps can kill the ReLU channels it holds, once for HeteroFL's
  fixed channels and round after round for FedRolex's rolling ones
  (``benchmarks/fedrolex_scaler.py``, docs/reproductions/families.md).
* BatchNorm: HeteroFL's static BN is ``--bn-policy static`` (no running
  statistics; batch statistics in training and in evaluation).  With ``global``
  the running statistics of a channel are averaged over the clients holding it,
  like parameters — they mix widths (and Scaler-scaled activations), which is why
  the EmbracingFL paper's Table 9 finds global BN harmful for width reduction.
* HeteroFL's label-split "masking trick" on the classifier (non-IID) and its
  dynamic width assignment are not part of the static baseline the EmbracingFL
  paper compares with, and are not implemented.
* Width reduction needs a zoo model (:func:`fedpartial._src.models.zoo.narrowed`);
  ResNet20's residual stream is sliced consistently (a block's input channels
  are the previous block's leading channels; option-A shortcuts keep the full
  model's channel offset).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from fedpartial._src.core.errors import UserError
from fedpartial._src.core.masks import Mask
from fedpartial._src.core.types import Capabilities, ClientGroup, ClientPlan, MethodContext, RoundView, Selection
from fedpartial._src.engine import graphs
from fedpartial._src.methods.base import make_method
from fedpartial._src.methods.registry import MethodSpec, Option
from fedpartial._src.methods.tiered.tiers import (
    CAPACITY_CASE_OPTION,
    TIER_MIX_OPTION,
    TIER_NAMES,
    cohort_rows,
    resolve_mix,
    tier_losses,
)
from fedpartial._src.models.adapter import Model

#: moderate and weak width ratios: 7/16 and 3/16 of the channels (the paper's Table 10)
DEFAULT_WIDTHS = (0.4375, 0.1875)
WEIGHTINGS = ("uniform", "samples")


def parse_widths(text) -> tuple[float, float]:
    """``"M,W"`` (or a sequence) -> the moderate and weak width ratios."""
    parts = [p.strip() for p in text.split(",")] if isinstance(text, str) else list(text)
    try:
        widths = tuple(float(p) for p in parts)
    except (TypeError, ValueError):
        raise UserError(f"--widths {text!r} must be two numbers M,W (moderate, weak), e.g. 0.4375,0.1875.") from None
    if len(widths) != 2:
        raise UserError(f"--widths {text!r} must be two numbers M,W (moderate, weak), e.g. 0.4375,0.1875.")
    return widths


def check_widths(widths) -> str | None:
    """An Option check: None when ``widths`` (or ``"M,W"``) are two ratios in (0, 1]."""
    try:
        widths = parse_widths(widths)
    except (UserError, TypeError):
        widths = ()
    ok = len(widths) == 2 and all(0 < w <= 1 for w in widths)
    return None if ok else "must be two width ratios in (0, 1], moderate then weak, e.g. 0.4375,0.1875"


def check_weighting(value) -> str | None:
    return None if value in WEIGHTINGS else f"must be one of {', '.join(WEIGHTINGS)}"


WIDTHS_OPTION = Option("widths", parse_widths, DEFAULT_WIDTHS,
                       "HeteroFL / FjORD tiers: width ratios M,W of moderate and weak clients (default: 7/16, 3/16 "
                       "of the channels, the EmbracingFL paper's Table 10)", check=check_widths, flag="--widths")
WEIGHTING_OPTION = Option("weighting", str, "uniform",
                          "HeteroFL / FedRolex: each holder's aggregation weight, uniform (as HeteroFL) or samples "
                          "(n_k)",
                          check=check_weighting, flag="--heterofl-weights")


def tier_ratios(widths: Sequence[float]) -> tuple[float, float, float]:
    """(strong, moderate, weak) width ratios."""
    problem = check_widths(widths)
    if problem:
        raise UserError(f"widths {widths!r} {problem}.")
    moderate, weak = parse_widths(widths)
    return (1.0, moderate, weak)


def _held(units: int, kept: int, window) -> jax.Array:
    """``[units]`` the units a width of ``kept`` holds: the leading ones, or from ``window`` on (mod ``units``)."""
    index = jnp.arange(units)
    return index < kept if window is None else (index - window) % units < kept


def width_mask(model: Model, narrow: Model | None, window=None) -> Mask:
    """One client's width in full-model coordinates (no leading axis); ``narrow`` None: the full width.

    Neurons: the leading ``units`` of every layer (the classifier keeps all), or, given a ``window``
    start (a traced scalar is fine), the ``units`` from there on, wrapping around (FedRolex).  A
    sequential model wires each kernel's input axis to the previous layer's neurons.  A residual
    model (ResNet20) is wired explicitly (``Mask.inputs``): every kernel after the first keeps the
    rows its narrow kernel has — the channels of the residual stream or of the previous conv it reads.
    """
    structure = model.structure
    units = structure.units if narrow is None else narrow.structure.units
    neurons = tuple(_held(u, n, window) for u, n in zip(structure.units, units))
    layers = jnp.ones((structure.num_layers,), bool)
    if structure.sequential:
        return Mask(layers=layers, neurons=neurons)
    inputs = []
    for i, layer in enumerate(structure.layers):
        if i == 0 or layer.fan_in is None:
            inputs.append(jnp.zeros((0,), bool))  # reads the data (or has no input axis): unwired
        else:
            kept = layer.fan_in if narrow is None else narrow.structure.layers[i].fan_in
            inputs.append(_held(layer.fan_in, kept, window))
    return Mask(layers=layers, neurons=neurons, inputs=tuple(inputs))


def heterofl(tier_mix=None, capacity_case: int | None = None, widths: Sequence[float] = DEFAULT_WIDTHS,
             weighting: str = "uniform", *, scaler: bool = True, module=None, name: str = "heterofl"):
    """HeteroFL (static) with the given tier mix (default: all strong, i.e. FedAvg with ``weighting`` weights).

    Args:
      tier_mix (tuple[int, int, int] | str | None): strong, moderate and weak client counts (or ``"S,M,W"``);
        with ``capacity_case``, the tiers (``resolve_mix``).
      capacity_case: the EmbracingFL paper's client mix 1..10, instead of ``tier_mix``.
      widths: moderate and weak width ratios.
      weighting: ``"uniform"`` (every holder weighs 1, as HeteroFL) or ``"samples"`` (``n_k``).
      scaler: multiply hidden outputs by ``1/r`` in training (HeteroFL's Scaler).
      module (flax.linen.Module | None): the zoo module the run's model was built from, when it is not the
        registry's model of that name (e.g. ``ResNet20(shortcut="zeros")``).
    """
    return width_tiers(name, tier_mix, capacity_case, widths, weighting, scaler=scaler, module=module, rolling=False)


def width_tiers(name: str, tier_mix, capacity_case, widths, weighting, *, scaler: bool, module, rolling: bool):
    """Width reduction per capacity tier: HeteroFL's leading units, or (``rolling``) FedRolex's window that
    starts at unit ``round`` (mod each layer's units); each element averaged over its holders."""
    ratios = tier_ratios(widths)
    if check_weighting(weighting):
        raise UserError(f"{name}: weighting {weighting!r} {check_weighting(weighting)}.")

    def sizes_of(ctx: MethodContext) -> tuple[int, int, int]:
        return cohort_rows(resolve_mix(ctx.num_clients, tier_mix, capacity_case), ctx)

    def narrow(ctx: MethodContext, t: int) -> Model | None:
        return None if ratios[t] == 1 else graphs.narrow_model(ctx.model, ratios[t], module=module, scaler=scaler)

    def groups(ctx: MethodContext) -> tuple[ClientGroup, ...]:
        mix = resolve_mix(ctx.num_clients, tier_mix, capacity_case)
        sizes = cohort_rows(mix, ctx)
        # The width graphs first: a model with no width-reduced version is refused before the rolling check
        # below runs the model eagerly (tens of small compilations, seconds, for a transformer)
        tiers = tuple(
            ClientGroup(TIER_NAMES[t], sizes[t], members=mix.members(t),
                        graph=None if ratios[t] == 1 else graphs.width(ctx.model, ratios[t], module=module,
                                                                        scaler=scaler))
            for t in range(3) if sizes[t] > 0)
        if rolling:
            for t in range(3):
                if sizes[t] > 0 and not graphs.rolls_units_consistently(ctx.model, ratios[t], module=module):
                    raise UserError(
                        f"{name}: rolling the units of model {ctx.model.name} changes what it computes (e.g. "
                        f"option-A shortcuts place channels at fixed offsets), so a rolling window is not a "
                        f"sub-network of it; use a sequential model or ResNet20 with projection shortcuts.")
        return tiers

    def plan(ctx: MethodContext, view: RoundView) -> ClientPlan:
        sizes = sizes_of(ctx)
        window = jnp.asarray(view.round, jnp.int32) if rolling else None
        rows = [jax.tree.map(lambda a, s=s: jnp.broadcast_to(a, (s, *a.shape)),
                             width_mask(ctx.model, narrow(ctx, t), window))
                for t, s in enumerate(sizes) if s > 0]  # the cohort is laid out tier after tier
        mask = jax.tree.map(lambda *a: jnp.concatenate(a), *rows)
        k = ctx.cohort_size
        return ClientPlan(download=mask, window=None if window is None else jnp.broadcast_to(window, (k,)))

    def select(ctx: MethodContext, view: RoundView) -> Selection:
        k = view.cohort.num_samples.shape[0]
        weights = jnp.ones((k,), jnp.float32) if weighting == "uniform" else view.cohort.num_samples
        return Selection(upload=view.plan.download, weights=weights, extra_upload_bytes=jnp.zeros((k,), jnp.int32))

    def metrics(ctx: MethodContext, view: RoundView) -> dict:
        return tier_losses(sizes_of(ctx), view.cohort.valid, view.client_loss)

    return make_method(name, groups=groups, plan=plan, select=select, metrics=metrics,
                       capabilities=Capabilities(asynchronous=True))


SPEC = MethodSpec(
    "heterofl", heterofl,
    "Width reduction (HeteroFL static): moderate/weak clients train the leading ⌈r·C⌉ channels of every layer.",
    options=(TIER_MIX_OPTION, CAPACITY_CASE_OPTION, WIDTHS_OPTION, WEIGHTING_OPTION),
)
