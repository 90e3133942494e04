"""HetLoRA (Cho et al., EMNLP 2024, "Heterogeneous LoRA for Federated Fine-tuning of On-Device Foundation Models"):
heterogeneous ranks, zero-padded aggregation weighted by each client's update norm, local rank self-pruning.

1. **Truncation.** Client ``k`` computes with, trains and uploads the leading ``r_k`` components of the global
   rank-``r_max`` adapters (its sub-model, :mod:`~fedpartial._src.methods.lora.ranked`); ``r_k`` starts at its tier's
   rank (``--lora-ranks``) and is the client's own state from then on.
2. **Self-pruning** (``--prune-gamma γ``; 0: off).  The tail, components ``⌊γ r_k⌋ … r_k − 1``, is penalised in
   the local loss by ``λ·Σ ‖(α/r)·A_tail B_tail‖_F`` (``--prune-lambda``); when training left the tail's norm
   below its norm in the model the client received, the client drops it: it uploads, and keeps from then on,
   ``max(⌊γ r_k⌋, 1)`` components.
3. **Sparsity-weighted aggregation.** For every adapter the server weighs client ``k`` by its update's norm,
   ``q_k = S_k / Σ S``, ``S_k = ‖(α/r)·A_k B_k‖_F`` over its kept components, ``Σ`` over every client that counts,
   and sums the zero-padded factors: ``A = Σ q_k A_k``, ``B = Σ q_k B_k`` (a component a client does not hold
   counts as zero).  A component no client of the round holds keeps its global value.  The output layer is
   averaged as in FedAvg (docs/decisions.md#hetlora).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fedpartial._src.core import aggregation, masks
from fedpartial._src.methods.base import (Capabilities, Carry, ClientPlan, InitView, Method, MethodContext,
                                          MethodState, RoundView, Selection, cohort_rows, cross_entropy,
                                          make_method, scatter_clients, trained_part, with_penalty)
from fedpartial._src.methods.lora.common import lora_spec
from fedpartial._src.methods.lora.ranked import components, norm_weighted_factors, product_norm, pruned_ranks, \
    shares
from fedpartial._src.methods.registry import MethodSpec, Option, at_least, between, check_values
from fedpartial._src.models.lora_ranks import client_ranks


def hetlora(prune_gamma: float = 0.0, prune_lambda: float = 0.0) -> Method:
    """HetLoRA: truncation to each client's rank, optional rank self-pruning, sparsity-weighted aggregation.

    Args:
      prune_gamma: the decay γ of rank self-pruning (``--prune-gamma``; 0: no pruning): a client may drop its
        components from ``⌊γ r_k⌋`` on.
      prune_lambda: the weight λ of the tail's norm in the local loss (``--prune-lambda``).

    Returns:
      The :class:`~fedpartial.Method` (``--method hetlora``; the model needs ``--lora RANK``, heterogeneous ranks
      ``--lora-ranks``).
    """
    check_values("hetlora", SPEC.options, prune_gamma=prune_gamma, prune_lambda=prune_lambda)

    def tail(ctx, params, ranks):
        """Every adapter's ``‖(α/r)·A_tail B_tail‖_F``, the components a client of rank ``ranks`` may prune."""
        spec = ctx.model.lora
        keep = components(spec.rank, pruned_ranks(ranks, prune_gamma), ranks)
        return [product_norm(a, b, keep, spec.scale) for _, a, b in spec.pairs(params)]

    def init(ctx: MethodContext, view: InitView) -> MethodState:
        lora_spec("hetlora", ctx)
        return MethodState(clients=client_ranks(ctx.model, jnp.arange(ctx.num_clients), ctx.num_clients))

    def plan(ctx: MethodContext, view: RoundView) -> ClientPlan:
        return ClientPlan(dropout=ctx.model.lora.rank_mask(ctx.structure, view.client_state))

    def penalty(ctx, params, step):
        return prune_lambda * sum(tail(ctx, params, step.client_state))

    def select(ctx: MethodContext, view: RoundView):
        ranks = view.client_state
        if prune_gamma > 0:  # the tail's norm (all adapters together) fell in training: the client drops it
            before, after = (sum(jnp.square(n) for n in tail(ctx, v["params"], ranks))
                             for v in (view.start_vars, view.trained_vars))
            ranks = jnp.where(after < before, pruned_ranks(ranks, prune_gamma), ranks)
        k = ranks.shape[0]
        upload = masks.within(trained_part(ctx, view.plan, k), ctx.model.lora.rank_mask(ctx.structure, ranks))
        return Carry(Selection(upload=upload, weights=view.cohort.num_samples,
                               extra_upload_bytes=jnp.zeros((k,), jnp.int32)), ranks)

    def aggregate(ctx: MethodContext, view: RoundView):
        spec, ranks = ctx.model.lora, view.carried["select"]
        out, received = aggregation.aggregate(ctx.structure, view.global_vars, {"params": view.uploaded},
                                              view.selection.upload, view.selection.weights, ("params",))
        params = jax.tree.map(lambda x: x, out["params"])  # fresh containers: the adapters are replaced below
        for adapter, a, b in spec.pairs(view.uploaded):
            node, got = params, received
            for key in adapter.path:
                node, got = node[key], got[key]
            for name, new in zip(("lora_a", "lora_b"), norm_weighted_factors(a, b, ranks, shares(view), spec.scale)):
                node[name]["kernel"] = jnp.where(got[name]["kernel"], new, node[name]["kernel"])  # else nobody's
        return params, received

    def update(ctx: MethodContext, view: RoundView) -> MethodState:
        return view.method_state._replace(clients=scatter_clients(
            view.method_state.clients, cohort_rows(view), view.carried["select"], view.cohort.valid))

    def metrics(ctx: MethodContext, view: RoundView) -> dict:
        valid = view.cohort.valid
        mean = jnp.sum(jnp.where(valid, view.carried["select"], 0)) / jnp.maximum(jnp.sum(valid), 1)
        return {"lora_mean_rank": mean.astype(jnp.float32)}  # the cohort's ranks after this round's pruning

    objective = with_penalty(penalty) if prune_gamma > 0 and prune_lambda > 0 else cross_entropy
    return make_method("hetlora", init=init, plan=plan, objective=objective, select=select, aggregate=aggregate,
                       update=update, metrics=metrics, capabilities=Capabilities(host_client_state=True))


SPEC = MethodSpec("hetlora", hetlora, "LoRA with heterogeneous ranks (--lora RANK, --lora-ranks): zero-padded "
                  "aggregation weighted by each update's norm, optional rank self-pruning (--prune-gamma).",
                  options=(Option("prune_gamma", float, 0.0, "HetLoRA: rank self-pruning decay γ, a client may "
                                  "drop its components from ⌊γ r_k⌋ on (default 0: no pruning)",
                                  between(0.0, 1.0, high_open=True)),
                           Option("prune_lambda", float, 0.0, "HetLoRA: weight λ of the prunable components' "
                                  "norm in the local loss (default 0)", at_least(0.0))))
