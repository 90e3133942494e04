"""FlexLoRA (Bai et al., NeurIPS 2024, "Federated Fine-tuning of Large Language Models under Heterogeneous Tasks
and Client Resources"): the server averages the clients' full updates and gives each its rank's truncated SVD.

Client ``k`` trains adapters of its own rank ``r_k`` (``--lora-ranks``; the leading components of the rank-``r_max``
adapters, :mod:`~fedpartial._src.methods.lora.ranked`).  The server forms every client's
``ΔW_k = (α/r)·A_k B_k``, averages them weighted by data size, ``ΔW = Σ_k p_k ΔW_k``, and factors the average by
its SVD ``U S Vᵀ``: the new global adapters are ``A = U_r √S_r / √(α/r)``, ``B = √S_r V_rᵀ / √(α/r)`` for the
``r_max`` largest singular values.  Components come in decreasing singular value, so a client of rank ``r_k``,
computing with the first ``r_k``, holds the rank-``r_k`` truncated SVD of the average (docs/decisions.md#flexlora).
The output layer and the other trained parameters are averaged as in FedAvg.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fedpartial._src.core import aggregation
from fedpartial._src.methods.base import Capabilities, InitView, Method, MethodContext, MethodState, RoundView, \
    make_method
from fedpartial._src.methods.lora.common import lora_spec
from fedpartial._src.methods.lora.ranked import cohort_ranks, mean_update, rank_plan, shares
from fedpartial._src.methods.registry import MethodSpec


def svd_factors(delta: jax.Array, rank: int, scale: float) -> tuple[jax.Array, jax.Array]:
    """``(A [in, rank], B [rank, out])`` with ``scale·A B`` the rank-``rank`` truncated SVD of ``delta``, split
    evenly: ``A = U √S / √scale``, ``B = √S Vᵀ / √scale``."""
    u, s, vt = jnp.linalg.svd(delta, full_matrices=False)
    root = jnp.sqrt(s[:rank] / scale)
    return u[:, :rank] * root[None, :], root[:, None] * vt[:rank]


def flexlora() -> Method:
    """FlexLoRA: the clients' full updates averaged with ``n_k`` weights, each client given its rank's truncated SVD.

    Returns:
      The :class:`~fedpartial.Method` (``--method flexlora``; the model needs ``--lora RANK``, heterogeneous ranks
      ``--lora-ranks``).
    """

    def init(ctx: MethodContext, view: InitView) -> MethodState:
        lora_spec("flexlora", ctx)
        return MethodState()

    def aggregate(ctx: MethodContext, view: RoundView):
        spec = ctx.model.lora
        out, received = aggregation.aggregate(ctx.structure, view.global_vars, {"params": view.uploaded},
                                              view.selection.upload, view.selection.weights, ("params",))
        params = jax.tree.map(lambda x: x, out["params"])  # fresh containers: the adapters are replaced below
        p, ranks = shares(view), cohort_ranks(ctx, view)
        anyone = jnp.sum(p) > 0
        for adapter, a, b in spec.pairs(view.uploaded):
            new_a, new_b = svd_factors(mean_update(a, b, ranks, p, spec.scale), spec.rank, spec.scale)
            node, got = params, received
            for key in adapter.path:
                node, got = node[key], got[key]
            node["lora_a"]["kernel"], node["lora_b"]["kernel"] = new_a, new_b
            got["lora_a"]["kernel"] = jnp.broadcast_to(anyone, new_a.shape)
            got["lora_b"]["kernel"] = jnp.broadcast_to(anyone, new_b.shape)
        return params, received

    return make_method("flexlora", init=init, plan=rank_plan, aggregate=aggregate)


SPEC = MethodSpec("flexlora", flexlora, "LoRA with heterogeneous ranks (--lora RANK, --lora-ranks): the full updates "
                  "averaged, each client given its rank's truncated SVD.")
