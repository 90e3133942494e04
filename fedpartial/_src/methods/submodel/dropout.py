"""The dropout baselines FedSPU is compared with (docs/decisions.md#fedspu), as sub-model methods.

A sub-model method gives every sampled client a set of neurons per layer; the
others are *removed* from its forward pass (their activations are zero, their
parameters receive no update and are not uploaded).  The client's model is
replaced by the received sub-model each round (it starts from the global values);
the server averages each element over the clients whose sub-model contained it,
weighted by ``n_k``.  The classifier's output units are always kept.

What differs is only how the neurons are chosen (``p_k`` is the client's tier,
:mod:`fedpartial._src.methods.submodel.common`; ``round`` is ``max(1, round(p·u))``, halves up):

=========  ===========================================================  ==========
method     keeps, per layer                                             chosen by
=========  ===========================================================  ==========
FedDrop    ``round(p_k·u)`` neurons uniformly at random                 server
FjORD      the leftmost ``⌈p_k·u⌉`` neurons (ordered dropout)            server
Hermes     ``round(p_k·u)`` neurons of largest parameter L2 norm        client
FedMP      ``round(p_k·u)`` neurons of largest parameter L1 norm        client
PruneFL    ``round(p_k·u)`` neurons of largest gradient L2 norm         client
=========  ===========================================================  ==========

Decisions where the papers are vague (how the neurons are chosen, and what naming them
costs: :mod:`fedpartial._src.methods.submodel.choosers`):

* Evaluation: each client's personal model is the sub-model it last trained (its
  dropped neurons removed), on its own held-out split.
* FjORD may instead take EmbracingFL's capacity tiers (``--tier-mix`` /
  ``--capacity-case`` with ``--widths``, :mod:`fedpartial._src.methods.tiered.tiers`): strong
  clients keep every neuron, moderate and weak ones the leftmost ``⌈r·u⌉`` —
  the width-reduction baseline at the paper's capacities, as masks on the full
  model (:mod:`fedpartial._src.methods.tiered.heterofl` runs the same widths as smaller graphs).

:func:`fedselect` is different in kind (a personal part grows inside a full-width
model) and is described there.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax.numpy as jnp
import numpy as np

from fedpartial._src.costs import footprint as costs
from fedpartial._src.core import masks
from fedpartial._src.core.errors import UserError
from fedpartial._src.methods.submodel import common as submodel
from fedpartial._src.methods.submodel.choosers import (
    Chooser,
    by_gradient_norm,
    by_parameter_norm,
    dense_index_bytes,
    dense_layers_only,
    leftmost_units,
    random_units,
    width_bytes,
)
from fedpartial._src.methods.base import (
    Capabilities,
    ClientPlan,
    InitView,
    Method,
    MethodContext,
    MethodState,
    PersonalModels,
    RoundView,
    Selection,
    cohort_rows,
    make_method,
    scatter_clients,
)
from fedpartial._src.methods.tiered.heterofl import DEFAULT_WIDTHS, WIDTHS_OPTION, tier_ratios
from fedpartial._src.methods.registry import MethodSpec, Option, boolean, check_values, is_boolean
from fedpartial._src.methods.tiered.tiers import CAPACITY_CASE_OPTION, TIER_MIX_OPTION, resolve_mix

def submodel_method(name: str, choose: Chooser, *, tiers: Sequence[float], rounding: str = "round",
                    chosen_by: str = "client",
                    index_cost: Callable | None = None,
                    population_tiers: Callable[[MethodContext], np.ndarray] | None = None) -> Method:
    """A dropout method from its neuron choice ``choose(ctx, view, counts) -> neurons``.

    ``chosen_by`` ('server' or 'client') says which side pays the index bytes;
    ``index_cost(structure, mask) -> [K]`` overrides how many (default: indices or bit-mask).
    ``population_tiers(ctx) -> [N]``: each client's index into ``tiers`` (None: equal
    clusters by id, :func:`fedpartial._src.methods.submodel.common.tier_of`).
    """
    tiers = submodel.check_tiers(name, tiers)
    if chosen_by not in ("server", "client"):
        raise ValueError(f"{name}: chosen_by must be 'server' or 'client', got {chosen_by!r}.")
    index_cost = index_cost or costs.index_bytes

    def init(ctx: MethodContext, view: InitView) -> MethodState:
        population = submodel.stack_population(ctx, view.global_vars)
        everything = masks.full(ctx.structure, (ctx.num_clients,)).neurons
        return MethodState(clients=submodel.SubmodelState(variables=population, neurons=everything))

    def plan(ctx: MethodContext, view: RoundView) -> ClientPlan:
        if population_tiers is None:
            counts = submodel.cohort_counts(ctx, tiers, view.cohort.client_ids, rounding)
        else:
            table = jnp.asarray(submodel.keep_table(ctx.structure, tiers, rounding))
            rows = table[jnp.asarray(population_tiers(ctx))[view.cohort.client_ids]]  # [K, L]
            counts = tuple(rows[:, layer] for layer in range(ctx.structure.num_layers))
        kept = submodel.neuron_mask(ctx.structure, choose(ctx, view, counts))
        index = index_cost(ctx.structure, kept)
        return ClientPlan(dropout=kept, download=kept,
                          extra_download_bytes=index if chosen_by == "server" else None)

    def select(ctx: MethodContext, view: RoundView) -> Selection:
        k = view.cohort.num_samples.shape[0]
        extra = (index_cost(ctx.structure, view.plan.dropout) if chosen_by == "client"
                 else jnp.zeros((k,), jnp.int32))
        return Selection(upload=view.plan.dropout, weights=view.cohort.num_samples,
                         extra_upload_bytes=extra.astype(jnp.int32))

    def update(ctx: MethodContext, view: RoundView) -> MethodState:
        rows = submodel.SubmodelState(variables=view.trained_vars, neurons=view.plan.dropout.neurons)
        clients = scatter_clients(view.method_state.clients, cohort_rows(view), rows, view.cohort.valid)
        return view.method_state._replace(clients=clients)

    def personal(ctx: MethodContext, state: MethodState, global_vars: dict) -> PersonalModels:
        return PersonalModels(variables=state.clients.variables,
                              submodel=masks.from_neurons(ctx.structure, state.clients.neurons))

    return make_method(name, init=init, plan=plan, select=select, update=update, personal=personal,
                       metrics=submodel.active_fraction,
                       capabilities=Capabilities(personalised=True, neuron_masks=True, host_client_state=True,
                                                 asynchronous=True))


def feddrop(tiers: Sequence[float] = submodel.DEFAULT_TIERS, dense_only: bool = False) -> Method:
    """FedDrop / random dropout: the server keeps ``p_k`` of each layer's neurons at random.

    ``tiers`` are *keep* ratios: the dropout rate is ``1 - p`` (``--tiers 0.5`` is dropout 0.5 for
    every client).  ``dense_only``: only the hidden dense (fully connected) layers are thinned and
    every convolution keeps all its filters — FedDHAD's FedDrop baseline (``--dense-only --tiers 0.5``);
    the index bytes then name the dense layers' units only.  The classifier always keeps all outputs.

    Args:
      tiers: keep ratios ``p`` in (0, 1], assigned to equal clusters of clients by id (``--tiers``).
      dense_only: thin only the hidden dense layers (convolutions keep every filter).

    Returns:
      The :class:`~fedpartial.Method` (``--method feddrop``).
    """
    check_values("feddrop", (DENSE_ONLY_OPTION,), dense_only=dense_only)
    if dense_only:
        return submodel_method("feddrop", dense_layers_only(random_units), tiers=tiers, chosen_by="server",
                               index_cost=dense_index_bytes)
    return submodel_method("feddrop", random_units, tiers=tiers, chosen_by="server")


def fjord(tiers: Sequence[float] = submodel.DEFAULT_TIERS, tier_mix=None, capacity_case: int | None = None,
          widths: Sequence[float] = DEFAULT_WIDTHS) -> Method:
    """FjORD (ordered dropout): the leftmost ``⌈p_k·units⌉`` neurons of every layer.

    ``p_k`` comes from equal clusters of ``tiers`` or, given ``tier_mix`` or
    ``capacity_case``, from EmbracingFL's capacity tiers with ratios ``(1, *widths)``.

    Args:
      tiers: keep ratios ``p`` in (0, 1], assigned to equal clusters of clients by id (``--tiers``).
      tier_mix: EmbracingFL's capacity tiers' mix (strong, moderate, weak) instead of ``tiers``, or None.
      capacity_case: one of EmbracingFL's capacity cases instead of ``tier_mix``, or None.
      widths: the moderate and weak tiers' keep ratios when ``tier_mix`` or ``capacity_case`` is given.

    Returns:
      The :class:`~fedpartial.Method` (``--method fjord``).
    """
    if tier_mix is None and capacity_case is None:
        return submodel_method("fjord", leftmost_units, tiers=tiers, rounding="ceil", chosen_by="server",
                               index_cost=width_bytes)
    if tuple(tiers) != submodel.DEFAULT_TIERS:
        raise UserError("fjord: give either --tiers (equal clusters) or --tier-mix / --capacity-case with --widths, "
                        "not both.")

    def population_tiers(ctx: MethodContext) -> np.ndarray:
        return np.repeat(np.arange(3), resolve_mix(ctx.num_clients, tier_mix, capacity_case).counts)

    return submodel_method("fjord", leftmost_units, tiers=tier_ratios(widths), rounding="ceil", chosen_by="server",
                           index_cost=width_bytes, population_tiers=population_tiers)


def hermes(tiers: Sequence[float] = submodel.DEFAULT_TIERS) -> Method:
    """Hermes: each client keeps its ``p_k`` neurons of largest parameter L2 norm.

    Args:
      tiers: keep ratios ``p`` in (0, 1], assigned to equal clusters of clients by id (``--tiers``).

    Returns:
      The :class:`~fedpartial.Method` (``--method hermes``).
    """
    return submodel_method("hermes", by_parameter_norm(2), tiers=tiers)


def fedmp(tiers: Sequence[float] = submodel.DEFAULT_TIERS) -> Method:
    """FedMP: each client keeps its ``p_k`` neurons of largest parameter L1 norm.

    Args:
      tiers: keep ratios ``p`` in (0, 1], assigned to equal clusters of clients by id (``--tiers``).

    Returns:
      The :class:`~fedpartial.Method` (``--method fedmp``).
    """
    return submodel_method("fedmp", by_parameter_norm(1), tiers=tiers)


def prunefl(tiers: Sequence[float] = submodel.DEFAULT_TIERS) -> Method:
    """PruneFL: each client keeps its ``p_k`` neurons of largest gradient L2 norm.

    Args:
      tiers: keep ratios ``p`` in (0, 1], assigned to equal clusters of clients by id (``--tiers``).

    Returns:
      The :class:`~fedpartial.Method` (``--method prunefl``).
    """
    return submodel_method("prunefl", by_gradient_norm, tiers=tiers)


DENSE_ONLY_OPTION = Option("dense_only", boolean, False,
                           "FedDrop: thin only the hidden dense layers, every conv layer keeps all its filters "
                           "(FedDHAD's baseline: --dense-only --tiers 0.5, i.e. dropout rate 0.5)", is_boolean)

#: FjORD also takes EmbracingFL's capacity tiers (the width-reduction baseline at the paper's capacities);
#: FedDrop may thin dense layers only
_EXTRA_OPTIONS = {"fjord": (TIER_MIX_OPTION, CAPACITY_CASE_OPTION, WIDTHS_OPTION), "feddrop": (DENSE_ONLY_OPTION,)}

SPECS = tuple(
    MethodSpec(name, factory, summary, (submodel.TIERS_OPTION, *_EXTRA_OPTIONS.get(name, ())))
    for name, factory, summary in (
        ("feddrop", feddrop, "The server keeps p_k of each layer's neurons at random (sub-models); "
                             "--dense-only: dense layers only."),
        ("fjord", fjord, "Ordered dropout: the leftmost ⌈p_k·units⌉ neurons of every layer."),
        ("hermes", hermes, "Each client keeps its p_k neurons of largest parameter L2 norm."),
        ("fedmp", fedmp, "Each client keeps its p_k neurons of largest parameter L1 norm."),
        ("prunefl", prunefl, "Each client keeps its p_k neurons of largest gradient L2 norm."),
    )
)
