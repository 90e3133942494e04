"""Depth tiers: what DepthFL and InclusiveFL share — each tier trains an input-side prefix and its exits.

A client of capacity tier ``t`` (strong, moderate, weak: ``--tier-mix`` / ``--capacity-case``, as
EmbracingFL's, :mod:`fedpartial._src.methods.tiered.tiers`) holds the first ``d_t`` stages of the model
and the exits after them (:func:`fedpartial._src.models.exits.with_exits`); strong clients hold the
whole model.  Each tier is a static client group whose compiled step contains no stage past ``d_t``
(:func:`fedpartial._src.engine.graphs.exits_prefix`); it downloads, trains and uploads those stages and
exits only, so the engine's one formula averages every element over the clients that hold it (layer-wise
aggregation, ``n_k``-weighted as FedAvg's; DepthFL's reference code counts holders uniformly).

**Depths** (``--depths M,W``: stages held by moderate and weak clients, as counts or the names of
their last stages).  Default: as many stages as the same tier trains under EmbracingFL (the stages
from its cut to the end, :func:`fedpartial._src.methods.tiered.embracingfl.default_cuts`), at most all
but the classifier — so on the same mix the two methods train as many stages per tier, DepthFL's
from the input side, EmbracingFL's from the output side (ResNet20: 7 and 4, exits after
``stage2_block3`` and ``stage1_block3``; the FEMNIST CNN and LeNet-5-like CNNs 2 and 1 / 3 and 2; the BiLSTM 2 and 2).

**Exits** sit after the moderate and weak depths, besides the model's own classifier (a tier with no
clients keeps its exit, untrained unless a deeper tier trains it); the method's ``adapt_model`` adds
them, so the model a run names must be staged.

**InclusiveFL's momentum distillation** (:func:`transfer_pairs`, :func:`transfer_apply`,
:func:`transfer_next`): which deeper parameters feed each parameter of a shallower tier's top stage, and
the server step that mixes their last update into that tier's own (see
:mod:`fedpartial._src.methods.tiered.inclusivefl`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fedpartial._src.core import masks
from fedpartial._src.core.errors import UserError
from fedpartial._src.core.structure import leaf_paths
from fedpartial._src.core.types import ClientGroup, ClientPlan, MethodContext, RoundView
from fedpartial._src.engine import graphs
from fedpartial._src.methods.registry import Option
from fedpartial._src.methods.tiered.embracingfl import default_cuts
from fedpartial._src.methods.tiered.tiers import TIER_NAMES, cohort_rows, resolve_mix, tier_losses
from fedpartial._src.models.adapter import Model
from fedpartial._src.models.exits import MultiExitModel, with_exits


def parse_depths(text) -> tuple:
    """``"7,4"`` or ``"stage2_block3,stage1_block3"`` -> (moderate, weak) as ints or stage names."""
    parts = [p.strip() for p in text.split(",")] if isinstance(text, str) else list(text)
    if len(parts) != 2 or not all(str(p) for p in parts):
        raise UserError(f"--depths {text!r} must give two depths, moderate then weak, e.g. 7,4.")
    return tuple(int(p) if isinstance(p, str) and p.isdigit() else p for p in parts)


DEPTHS_OPTION = Option("depths", parse_depths, None,
                       "DepthFL / InclusiveFL: stages held by moderate and weak clients, as counts or the names of "
                       "their last stages, e.g. 7,4 (default: as many as EmbracingFL's tier trains)", flag="--depths")


def resolve_depths(model: Model, depths=None) -> tuple[int, int, int]:
    """(strong, moderate, weak) stages held; strong holds every stage."""
    n = model.num_stages
    if n < 2:
        raise UserError(f"model {model.name} is a single stage, so it has no prefix to give a weaker client; "
                        "use a staged model (every zoo model is; from_stages builds one).")
    if depths is None:
        return (n, *(min(max(n - cut, 1), n - 1) for cut in default_cuts(model)))
    out = []
    for d in parse_depths(depths):
        if isinstance(d, str):
            if d not in model.stage_names:
                raise UserError(f"--depths stage {d!r} is not a stage of {model.name}; its stages are "
                                f"{', '.join(model.stage_names)}.")
            d = model.stage_names.index(d) + 1
        if not 1 <= d <= n - 1:
            raise UserError(f"--depths {d} must be between 1 and {n - 1}: a weaker client holds at least one stage "
                            f"and never {model.name}'s classifier stage ({model.stage_names[-1]}).")
        out.append(int(d))
    if out[1] > out[0]:
        raise UserError(f"--depths {out[0]},{out[1]}: a weak client must hold no more stages than a moderate one.")
    return (n, *out)


def exit_model(model: Model, depths=None, output: str = "mean") -> MultiExitModel:
    """``model`` with an exit after the moderate and the weak depth (a method's ``adapt_model``)."""
    return with_exits(model, after=[d - 1 for d in resolve_depths(model, depths)[1:]], output=output)


class Tiers:
    """The run's tiers as a method sees them: the exit model, each tier's depth, its cohort rows."""

    def __init__(self, ctx: MethodContext, tier_mix, capacity_case, depths, name: str):
        if not isinstance(ctx.model, MultiExitModel):
            raise UserError(f"{name} trains a model with exits, but {ctx.model.name} has none; build it with "
                            "fedpartial.models.with_exits (Simulation does it for a model it builds).")
        self.model: MultiExitModel = ctx.model
        self.depths = resolve_depths(self.model.body, depths)
        missing = [d for d in self.depths if d - 1 not in self.model.exit_stages]
        if missing:
            raise UserError(f"{name}: model {self.model.name} has no exit after stage {missing[0] - 1}, where a tier "
                            f"of depth {missing[0]} needs one (its exits follow stages {self.model.exit_stages}).")
        self.mix = resolve_mix(ctx.num_clients, tier_mix, capacity_case)
        self.rows = cohort_rows(self.mix, ctx)  # the cohort is laid out tier after tier
        self.row_tier = np.repeat(np.arange(3), self.rows)
        self.present = [t for t in range(3) if self.rows[t] > 0]

    def exit_of(self, t: int) -> int:
        return self.model.exit_stages.index(self.depths[t] - 1)

    def layers(self, t: int, own_exit_only: bool) -> np.ndarray:
        """``[L]`` the layers tier ``t`` trains: its stages and their exits (``own_exit_only``: its own exit)."""
        stage, exit_of = np.asarray(self.model.stage_of_layer), np.asarray(self.model.exit_of_layer)
        held = stage < self.depths[t]
        return held & ((exit_of == -1) | (exit_of == self.exit_of(t))) if own_exit_only else held

    def deeper(self, t: int) -> int | None:
        """The closest tier of the cohort that holds more stages than tier ``t`` (None: none does)."""
        return min((u for u in self.present if self.depths[u] > self.depths[t]), key=lambda u: self.depths[u],
                   default=None)


def depth_hooks(name: str, tier_mix, capacity_case, depths, *, own_exit_only: bool, output: str = "mean") -> dict:
    """``make_method`` hooks of a depth-tiered method: ``adapt_model``, ``groups``, ``plan``, ``metrics``;
    ``own_exit_only``: a client trains only its deepest exit (InclusiveFL) rather than all it holds."""

    def groups(ctx: MethodContext) -> tuple[ClientGroup, ...]:
        tiers = Tiers(ctx, tier_mix, capacity_case, depths, name)
        return tuple(ClientGroup(TIER_NAMES[t], tiers.rows[t], members=tiers.mix.members(t),
                                 graph=graphs.exits_prefix(tiers.model, tiers.depths[t])) for t in tiers.present)

    def plan(ctx: MethodContext, view: RoundView) -> ClientPlan:
        tiers = Tiers(ctx, tier_mix, capacity_case, depths, name)
        per_tier = np.stack([tiers.layers(t, own_exit_only) for t in range(3)])
        mask = masks.from_layers(ctx.structure, jnp.asarray(per_tier[tiers.row_tier]))
        return ClientPlan(train=mask, download=mask)

    def metrics(ctx: MethodContext, view: RoundView) -> dict:
        return tier_losses(Tiers(ctx, tier_mix, capacity_case, depths, name).rows, view.cohort.valid,
                           view.client_loss)

    return dict(adapt_model=lambda model: exit_model(model, depths, output), groups=groups, plan=plan,
                metrics=metrics)


# ---- InclusiveFL's momentum distillation: deeper stages' updates into a shallower tier's top stage ------


def transfer_pairs(tiers: Tiers) -> list[tuple[int, int, dict]]:
    """``(t, u, sources)`` for every tier ``t`` of the cohort with a deeper one ``u``: ``sources`` maps each
    parameter of ``t``'s top stage (its last body stage) to the parameters of the stages ``u`` holds beyond
    ``t`` of the same kind and shape (a kernel to kernels, a bias to biases, a normaliser's scale to
    normalisers' scales); one without any is left out."""
    model, structure = tiers.model, tiers.model.structure
    shapes = jax.eval_shape(model.init_variables, jax.random.key(0))["params"]
    kind, body = {}, {}
    for p, a in leaf_paths(shapes):
        role = structure.role("params", p)
        if model.exit_of_layer[role.layer] == -1:
            body[p], kind[p] = model.stage_of_layer[role.layer], (p[-1], role.norm, tuple(a.shape))
    pairs = []
    for t in tiers.present:
        u = tiers.deeper(t)
        if u is None:
            continue
        top, beyond = tiers.depths[t] - 1, range(tiers.depths[t], tiers.depths[u])
        sources = {p: [q for q, s in body.items() if s in beyond and kind[q] == kind[p]] for p, s in body.items()
                   if s == top}
        pairs.append((t, u, {p: qs for p, qs in sources.items() if qs}))
    return pairs


def leaf(tree: dict, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def with_leaf(tree: dict, path: tuple[str, ...], value) -> dict:
    """``tree`` (nested dicts) with the leaf at ``path`` replaced by ``value`` (a copy along the path)."""
    if not path:
        return value
    return {**tree, path[0]: with_leaf(tree[path[0]], path[1:], value)}


def tier_update(view: RoundView, rows: np.ndarray, paths) -> tuple[jax.Array, dict]:
    """``(W, {path: Σ_k w_k (θ_k − g)})`` over the cohort rows ``rows`` (``[K]`` bool, static): the weight of a
    tier's clients and their weighted update of the parameters at ``paths`` (``w``: the selection's weights,
    0 for padding and failed clients)."""
    w = jnp.where(jnp.asarray(rows), view.selection.weights, 0.0)
    params, glob = view.trained_vars["params"], view.global_vars["params"]
    sums = {p: jnp.tensordot(w, (leaf(params, p) - leaf(glob, p)[None]).astype(jnp.float32), axes=(0, 0))
            for p in paths}
    return jnp.sum(w), sums


def transfer_init(tiers: Tiers, params: dict) -> tuple:
    """The transfer's server state: per pair of :func:`transfer_pairs`, ``M`` for each parameter of the shallower
    tier's top stage (zeros), and whether it exists yet (``[pairs]`` bool)."""
    momentum = tuple({"/".join(p): jnp.zeros(leaf(params, p).shape, jnp.float32) for p in sources}
                     for _, _, sources in transfer_pairs(tiers))
    return momentum, jnp.zeros((len(momentum),), bool)


def transfer_apply(tiers: Tiers, view: RoundView, beta: float) -> dict:
    """The aggregate's params with each shallower tier ``t``'s update of its top stage replaced by
    ``(1 − β)·Δ_t + β·M_t``: moved by ``β·(W_t·M_t − Σ_{k∈t} w_k Δ_k) / W`` (``W``: the weight of every holder)."""
    (momentum, seen), params = view.method_state.server, view.aggregated["params"]
    row_depth = np.asarray(tiers.depths)[tiers.row_tier]
    for i, (t, _, sources) in enumerate(transfer_pairs(tiers)):
        holders, _ = tier_update(view, row_depth >= tiers.depths[t], ())
        weight, sums = tier_update(view, tiers.row_tier == t, sources)
        for p in sources:
            shift = beta * (weight * momentum[i]["/".join(p)] - sums[p]) / jnp.maximum(holders, 1e-30)
            old = leaf(params, p)
            params = with_leaf(params, p, old + jnp.where(seen[i], shift, 0.0).astype(old.dtype))
    return params


def transfer_next(tiers: Tiers, view: RoundView) -> tuple:
    """The next round's ``M``: per pair ``(t, u)``, tier ``u``'s mean update of the parameters matched to each of
    ``t``'s top-stage parameters, averaged over them (kept from before when ``u`` uploaded nothing)."""
    momentum, seen = view.method_state.server
    new, now = [], []
    for i, (_, u, sources) in enumerate(transfer_pairs(tiers)):
        weight, sums = tier_update(view, tiers.row_tier == u, {q for qs in sources.values() for q in qs})
        new.append({"/".join(p): jnp.where(weight > 0, sum(sums[q] for q in qs) / (len(qs) * weight),
                                            momentum[i]["/".join(p)]) for p, qs in sources.items()})
        now.append(seen[i] | (weight > 0))
    return tuple(new), jnp.stack(now) if now else seen
