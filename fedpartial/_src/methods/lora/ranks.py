"""Heterogeneous LoRA ranks as masks (``--lora-ranks 2,4,8``): around any method, a client of rank ``r_k`` holds,
trains and uploads the first ``r_k`` rank components of the model's rank-``r`` adapters.

The tiers are the model's (:func:`~fedpartial.models.with_lora_ranks`): the clients are split into equal tiers by
id (``floor(id · T / N)``, as FIARSE's ``--ratios``); tier ``t`` has rank ``ranks[t]``.  The rank components are the units of every adapter's A layer (:class:`~fedpartial.models.LoraSpec`):
a neuron mask keeping A's first ``r_k`` columns keeps, through the wiring, B's first ``r_k`` rows.  It is the
client's sub-model (``ClientPlan.dropout``: the components past ``r_k`` are out of its forward pass and its
training), is not sent to it (its download) and limits its upload, so one compiled round serves every tier, and the server averages each
component over the clients that hold it (the one formula: HetLoRA's zero-padding without the zeros counted).
"""

from __future__ import annotations

import jax.numpy as jnp

from fedpartial._src.core import masks
from fedpartial._src.methods.base import ClientPlan, Method, MethodContext, RoundView, Selection
from fedpartial._src.methods.lora.common import lora_spec
from fedpartial._src.methods.wrappers import Wrapper, wrap
from fedpartial._src.models.lora_ranks import client_ranks


def rank_mask(ctx: MethodContext, client_ids) -> masks.Mask:
    """``[K]`` the mask keeping each client's first ``r_k`` rank components (every other unit on)."""
    return ctx.model.lora.rank_mask(ctx.structure, client_ranks(ctx.model, client_ids, ctx.num_clients))


def _within(mask: masks.Mask | None, ranks: masks.Mask) -> masks.Mask:
    return ranks if mask is None else mask._replace(
        neurons=tuple(jnp.logical_and(a, b) for a, b in zip(mask.neurons, ranks.neurons)))


def rank_tiers(method: Method) -> Method:
    """``method`` with each client holding, training and uploading the first ``r_k`` components of every adapter.

    Args:
      method: any method, run on a :func:`~fedpartial.models.lora` model whose tiers
        :func:`~fedpartial.models.with_lora_ranks` set (without tiers every client holds every component).

    Returns:
      The wrapped :class:`~fedpartial.Method` (``<name>+ranks``).
    """

    def plan(ctx: MethodContext, view: RoundView, inner: ClientPlan) -> ClientPlan:
        lora_spec(method.name, ctx)
        tiers = rank_mask(ctx, view.cohort.client_ids)
        # the components past r_k are out of the client's model: not sent to it either
        return inner._replace(dropout=_within(inner.dropout, tiers), download=_within(inner.download, tiers))

    def select(ctx: MethodContext, view: RoundView, inner: Selection) -> Selection:
        lora_spec(method.name, ctx)
        tiers = rank_mask(ctx, view.cohort.client_ids)
        return inner._replace(upload=_within(inner.upload, tiers))

    return wrap(method, Wrapper(lambda name: f"{name}+ranks", hooks={"plan": plan, "select": select},
                                label="--lora-ranks"))
