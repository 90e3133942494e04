"""EmbracingFL (Lee et al.): every client trains as many output-side layers as it can hold.

Algorithm (the paper's Alg. 1–2, docs/decisions.md#embracingfl), per round:

1. the server sends the global model to the cohort;
2. a **strong** client runs τ local SGD steps on the whole model (as FedAvg);
3. a **moderate** or **weak** client runs the frozen input-side prefix — stages
   ``[0, cut)`` — *once* over its local data (the "multi-step forward pass"),
   keeps the activations at the cut, and runs its τ local steps on the suffix
   ``[cut, end)`` only, with those activations as inputs;
4. **layer-wise aggregation**: each layer is the ``n_k``-weighted mean over the
   clients that trained it (prefix: strong clients; suffix: everyone) — the
   engine's one formula with each client's upload mask = its trained layers.

Tiers are static client groups (:mod:`fedpartial._src.methods.tiered.tiers`): each compiles
its own local step, and a moderate/weak group's compiled step contains no prefix
at all (:func:`fedpartial._src.engine.graphs.suffix`), so its saving in FLOPs, memory and
time is real.  ``cached=False`` builds the *mask-only* variant instead — the
whole model with the prefix frozen by the train mask (its gradient is computed
and discarded) — which gives the same parameters and exists to prove it.

**Cuts** (first trained stage of moderate, weak): docs/decisions.md#embracingfl for ResNet20 (4, 7:
stem + 3 / + 6 residual blocks frozen), the FEMNIST CNN (2, 3) and the BiLSTM
(1, 1: the embedding frozen; weak clients also see only the first half of every
sequence, as in the paper's Table 1).  Any other staged model: moderate trains
the output-side half of the stages (cut ``S // 2``), weak only the trailing
dense stages (the first stage from which every stage is Dense-only, but at least
one stage past moderate and at most the last stage).  ``cut=`` overrides both
(stage indices or names).

BatchNorm: with the ``global`` policy a layer's running statistics are averaged
over the clients that trained the layer (a frozen prefix's statistics are
neither updated nor uploaded by moderate/weak clients); ``static`` keeps none.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from fedpartial._src.costs import footprint as costs
from fedpartial._src.engine import graphs
from fedpartial._src.core import masks
from fedpartial._src.core.types import Capabilities, ClientGroup, ClientPlan, LocalGraph, MethodContext, RoundView
from fedpartial._src.data.text import first_part
from fedpartial._src.core.errors import UserError
from fedpartial._src.methods.base import make_method
from fedpartial._src.methods.registry import MethodSpec, Option
from fedpartial._src.methods.tiered.tiers import (
    CAPACITY_CASE_OPTION,
    TIER_MIX_OPTION,
    TIER_NAMES,
    TierMix,
    cohort_rows,
    resolve_mix,
    tier_losses,
)
from fedpartial._src.models.adapter import Model

#: docs/decisions.md#embracingfl cuts (moderate, weak) by zoo model name
DEFAULT_CUTS: dict[str, tuple[int, int]] = {"resnet20": (4, 7), "femnist_cnn": (2, 3), "bilstm": (1, 1)}
#: the share of each input sequence a tier sees (strong, moderate, weak); 1.0 everywhere else
SEQUENCE_FRACTIONS: dict[str, tuple[float, float, float]] = {"bilstm": (1.0, 1.0, 0.5)}


def parse_cuts(text) -> tuple:
    """``"4,7"`` or ``"stage2_block1,stage3_block1"`` -> (moderate, weak) as ints or stage names."""
    parts = [p.strip() for p in text.split(",")] if isinstance(text, str) else list(text)
    if len(parts) != 2 or not all(str(p) for p in parts):
        raise UserError(f"--cut {text!r} must name two stages, moderate then weak, e.g. 4,7.")
    return tuple(int(p) if isinstance(p, str) and p.lstrip("-").isdigit() else p for p in parts)


CUT_OPTION = Option("cut", parse_cuts, None,
                    "EmbracingFL: first trained stage of moderate and weak clients, e.g. 4,7 or stage names "
                    "(default: per model, see `fedpartial capacity`)", flag="--cut")


def _stage_index(model: Model, stage) -> int:
    if isinstance(stage, str):
        if stage not in model.stage_names:
            raise UserError(f"--cut stage {stage!r} is not a stage of {model.name}; its stages are "
                            f"{', '.join(model.stage_names)}.")
        return model.stage_names.index(stage)
    if not 0 <= stage < model.num_stages:
        raise UserError(f"--cut stage {stage} is outside 0..{model.num_stages - 1} ({model.name} has stages "
                        f"{', '.join(model.stage_names)}).")
    return int(stage)


def _dense_stages(model: Model) -> list[bool]:
    """Per stage, whether every layer in it outputs a vector (a Dense layer) rather than a map."""
    shapes = costs.layer_output_shapes(model)
    dense = [True] * model.num_stages
    for stage, shape in zip(model.stage_of_layer, shapes):
        dense[stage] = dense[stage] and len(shape) == 1
    return dense


def default_cuts(model: Model) -> tuple[int, int]:
    """(moderate, weak) first trained stages for ``model`` (see the module docstring)."""
    if model.name in DEFAULT_CUTS:
        return DEFAULT_CUTS[model.name]
    n = model.num_stages
    moderate = n // 2
    dense = _dense_stages(model)
    trailing = n - 1
    while trailing > 0 and dense[trailing - 1]:
        trailing -= 1
    return moderate, min(max(trailing, moderate + 1), n - 1)


def resolve_cuts(model: Model, cut=None) -> tuple[int, int, int]:
    """(strong, moderate, weak) first trained stages; strong is always 0."""
    if model.num_stages < 2:
        raise UserError(f"model {model.name} has a single stage, so it cannot be cut into a frozen prefix and a "
                        "trained suffix; use a staged zoo model (see `fedpartial capacity`).")
    if cut is None:
        moderate, weak = default_cuts(model)
    else:
        moderate, weak = (_stage_index(model, c) for c in parse_cuts(cut))
    if not 0 <= moderate <= weak:
        raise UserError(f"--cut {moderate},{weak}: a weak client must train no more stages than a moderate one "
                        "(weak cut ≥ moderate cut).")
    return 0, moderate, weak


def sequence_fractions(model: Model) -> tuple[float, float, float]:
    return SEQUENCE_FRACTIONS.get(model.name, (1.0, 1.0, 1.0))


def tier_graph(model: Model, cut: int, fraction: float, cached: bool) -> LocalGraph | None:
    """A tier's local graph: the suffix on cached prefix activations, or (``cached=False``) the whole model."""
    graph = graphs.suffix(model, cut) if cached and cut > 0 else None
    if fraction < 1.0:
        graph = graphs.map_inputs(graph or graphs.whole(model), lambda x: first_part(x, fraction, truncate=True))
    return graph


def tier_train_layers(model: Model, cuts: Sequence[int]) -> np.ndarray:
    """``[tiers, L]`` bool: layer ``l`` is trained by tier ``t`` iff its stage is at or past the tier's cut."""
    stage = np.asarray(model.stage_of_layer)
    return np.stack([stage >= c for c in cuts])


def embracingfl(tier_mix=None, capacity_case: int | None = None, cut=None, *, cached: bool = True,
                name: str = "embracingfl"):
    """EmbracingFL with the given tier mix (default: all strong, i.e. FedAvg) and cuts.

    Args:
      tier_mix: the shares of strong, moderate and weak clients (None: all strong).
      capacity_case: one of EmbracingFL's capacity cases instead of ``tier_mix``, or None.
      cut: per tier, the stage where its trained suffix starts (None: the paper's cuts).
      cached: reuse a client's frozen prefix activations across its local steps.
      name: the method's name.

    Returns:
      The :class:`~fedpartial.Method` (``--method embracingfl``).
    """

    def tiers_of(ctx: MethodContext) -> tuple[TierMix, tuple[int, int, int], tuple[int, ...]]:
        mix = resolve_mix(ctx.num_clients, tier_mix, capacity_case)
        cuts = resolve_cuts(ctx.model, cut) if mix.counts[1] or mix.counts[2] or cut is not None else (0, 0, 0)
        return mix, cuts, cohort_rows(mix, ctx)

    def groups(ctx: MethodContext) -> tuple[ClientGroup, ...]:
        mix, cuts, sizes = tiers_of(ctx)
        fractions = sequence_fractions(ctx.model)
        return tuple(
            ClientGroup(TIER_NAMES[t], sizes[t], members=mix.members(t),
                        graph=tier_graph(ctx.model, cuts[t], fractions[t], cached))
            for t in range(3) if sizes[t] > 0)

    def row_tiers(ctx: MethodContext) -> np.ndarray:
        _, _, sizes = tiers_of(ctx)
        return np.repeat(np.arange(3), sizes)  # the cohort is laid out tier after tier

    def plan(ctx: MethodContext, view: RoundView) -> ClientPlan:
        _, cuts, _ = tiers_of(ctx)
        layers = tier_train_layers(ctx.model, cuts)[row_tiers(ctx)]
        return ClientPlan(train=masks.from_layers(ctx.structure, jnp.asarray(layers)))

    def metrics(ctx: MethodContext, view: RoundView) -> dict:
        return tier_losses(tiers_of(ctx)[2], view.cohort.valid, view.client_loss)

    return make_method(name, groups=groups, plan=plan, metrics=metrics,
                       capabilities=Capabilities(asynchronous=True))


SPEC = MethodSpec(
    "embracingfl", embracingfl,
    "Strong clients train everything, moderate/weak ones an output-side suffix on cached activations.",
    options=(TIER_MIX_OPTION, CAPACITY_CASE_OPTION, CUT_OPTION),
)


# ---- capacity: the paper's Table 1 --------------------------------------------------------------


def tier_footprint(model: Model, cut: int, *, batch_size: int, fraction: float = 1.0) -> dict:
    """Values a client of a tier trains: parameters of stages ``[cut, end)`` and their activations.

    Activations are the Conv/Dense (and LSTM) outputs of the trained layers for one
    batch (:func:`fedpartial._src.costs.footprint.layer_output_shapes`, inputs shortened to
    ``fraction`` of a sequence), as the paper counts them.
    """
    import jax

    variables = jax.eval_shape(model.init_variables, jax.random.key(0))
    params = sum(math.prod(a.shape) for a in jax.tree.leaves(model.stage_variables(variables, cut)["params"]))
    input_shape = model.input_shape
    if fraction < 1.0:
        input_shape = first_part(np.zeros(input_shape), fraction, truncate=True).shape
    shapes = costs.layer_output_shapes(model, input_shape=input_shape)
    acts = sum(math.prod(s) for s, stage in zip(shapes, model.stage_of_layer) if stage >= cut)
    return {"params": int(params), "activations": int(batch_size * acts)}


def capacity_table(model: Model, *, batch_size: int = 32, cut=None) -> list[dict]:
    """One row per tier: cut stage, trained parameters, activations and capacity (docs/decisions.md#embracingfl)."""
    cuts = resolve_cuts(model, cut)
    fractions = sequence_fractions(model)
    rows = [dict(tier=TIER_NAMES[t], cut=cuts[t], cut_stage=model.stage_names[cuts[t]], sequence_fraction=fractions[t],
                 **tier_footprint(model, cuts[t], batch_size=batch_size, fraction=fractions[t])) for t in range(3)]
    full = rows[0]["params"] + rows[0]["activations"]
    for row in rows:
        row["capacity"] = (row["params"] + row["activations"]) / full
    return rows
