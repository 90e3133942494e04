"""FLoRA (Wang et al., NeurIPS 2024, "FLoRA: Federated Fine-Tuning Large Language Models with Heterogeneous Low-Rank
Adaptations"): the clients' adapters stacked, so the server's update is exactly the average of theirs, merged into
the base; every round starts from fresh adapters.

Client ``k`` trains adapters of its own rank ``r_k`` (``--lora-ranks``) from fresh ones (B zero).  The server
stacks the uploads, ``[p_1 A_1, …, p_K A_K]`` and ``[B_1; …; B_K]`` (``p_k = n_k / Σ n``, the weight on A as in the
paper), whose product is ``Σ_k p_k ΔW_k`` exactly, with no FedIT aggregation error; it adds the product to the
frozen base (``rewrite_global``: the base is the server's to write) and starts fresh adapters, A drawn anew and
B zero, so the global model computes ``W + Σ_k p_k ΔW_k``.  The output layer and other trained parameters are
averaged as in FedAvg.  The metric ``lora_aggregation_error`` is the distance between the change of the merged
weights and the clients' mean update (zero up to rounding).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fedpartial._src.core.structure import FROZEN
from fedpartial._src.methods.base import InitView, Method, MethodContext, MethodState, RoundView, make_method
from fedpartial._src.methods.lora.common import lora_spec
from fedpartial._src.methods.lora.ranked import cohort_ranks, mean_update, rank_plan, shares
from fedpartial._src.methods.registry import MethodSpec


def fresh_a(key: jax.Array, fan_in: int, rank: int, dtype) -> jax.Array:
    """A new ``A [fan_in, rank]`` drawn as :func:`~fedpartial.models.lora` draws it: uniform in ``±1/√fan_in``."""
    bound = 1.0 / jnp.sqrt(jnp.asarray(fan_in, jnp.float32))
    return jax.random.uniform(key, (fan_in, rank), jnp.float32, -bound, bound).astype(dtype)


def _node(tree: dict, path) -> dict:
    for key in path:
        tree = tree[key]
    return tree


def flora() -> Method:
    """FLoRA: the uploads stacked and merged into the base each round; fresh adapters every round.

    Returns:
      The :class:`~fedpartial.Method` (``--method flora``; the model needs ``--lora RANK``, heterogeneous ranks
      ``--lora-ranks``).
    """

    def init(ctx: MethodContext, view: InitView) -> MethodState:
        lora_spec("flora", ctx)
        return MethodState()

    def rewrite_global(ctx: MethodContext, view: RoundView) -> dict:
        spec = ctx.model.lora
        new = jax.tree.map(lambda x: x, view.new_global_vars)  # fresh containers: written below
        p, ranks = shares(view), cohort_ranks(ctx, view)
        for n, (adapter, a, b) in enumerate(spec.pairs(view.uploaded)):
            base = _node(new[FROZEN], adapter.path)
            base["kernel"] = base["kernel"] + mean_update(a, b, ranks, p, spec.scale).astype(base["kernel"].dtype)
            node = _node(new["params"], adapter.path)
            node["lora_a"]["kernel"] = fresh_a(jax.random.fold_in(view.key, n), adapter.fan_in, spec.rank,
                                               node["lora_a"]["kernel"].dtype)
            node["lora_b"]["kernel"] = jnp.zeros_like(node["lora_b"]["kernel"])
        return new

    def metrics(ctx: MethodContext, view: RoundView) -> dict:
        spec = ctx.model.lora
        p, ranks = shares(view), cohort_ranks(ctx, view)
        total = jnp.zeros((), jnp.float32)
        for adapter, a, b in spec.pairs(view.uploaded):
            keep = (jnp.arange(spec.rank)[None, :] < ranks[:, None]).astype(a.dtype)
            updates = spec.scale * jnp.einsum("kir,kro->kio", a * keep[:, None, :], b)  # each client's ΔW_k
            merged = _node(view.new_global_vars[FROZEN], adapter.path)["kernel"] - \
                _node(view.global_vars[FROZEN], adapter.path)["kernel"]
            total = total + jnp.sum(jnp.square(merged - jnp.tensordot(p, updates, 1)))
        return {"lora_aggregation_error": jnp.sqrt(total)}

    return make_method("flora", init=init, plan=rank_plan, rewrite_global=rewrite_global, metrics=metrics)


SPEC = MethodSpec("flora", flora, "LoRA with heterogeneous ranks (--lora RANK, --lora-ranks): the adapters stacked, "
                  "merged into the base each round, fresh adapters every round.")
