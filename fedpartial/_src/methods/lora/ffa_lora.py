"""FFA-LoRA (Sun et al., ICLR 2024, "Improving LoRA in Privacy-preserving Federated Learning"): A stays at its
random initialisation, every client trains and uploads only B (and the output layer).

With A fixed and shared, the clients' updates ``(α/r)·A B_k`` average exactly (the mean of the products is the
product with the mean B), and a client sends half of an adapter whose A and B are of a size (``in = out``).  A
layer mask over the A layers says both: frozen in training (``ClientPlan.train``) and not uploaded
(``Selection.upload``), so the traffic count, the aggregation and DP-FedAvg's clipping (``--dp-clip``) see B alone.
"""

from __future__ import annotations

import jax.numpy as jnp

from fedpartial._src.methods.base import (
    Capabilities,
    ClientPlan,
    InitView,
    Method,
    MethodContext,
    MethodState,
    RoundView,
    Selection,
    make_method,
)
from fedpartial._src.methods.lora.common import adapter_layers, lora_spec, layers_except
from fedpartial._src.methods.registry import MethodSpec


def ffa_lora() -> Method:
    """FFA-LoRA: A frozen at its random initialisation; B trained, uploaded and averaged with ``n_k`` weights.

    Returns:
      The :class:`~fedpartial.Method` (``--method ffa_lora``; the model needs ``--lora RANK``).
    """

    def init(ctx: MethodContext, view: InitView) -> MethodState:
        lora_spec("ffa_lora", ctx)
        return MethodState()

    def plan(ctx: MethodContext, view: RoundView) -> ClientPlan:
        return ClientPlan(train=layers_except(ctx, adapter_layers(ctx, "a"), (ctx.cohort_size,)))

    def select(ctx: MethodContext, view: RoundView) -> Selection:
        k = view.cohort.num_samples.shape[0]
        return Selection(upload=view.plan.train, weights=view.cohort.num_samples,
                         extra_upload_bytes=jnp.zeros((k,), jnp.int32))

    return make_method("ffa_lora", init=init, plan=plan, select=select,
                       capabilities=Capabilities(streamable="per_client", asynchronous=True))


SPEC = MethodSpec("ffa_lora", ffa_lora, "LoRA with A frozen at its random init; only B trained and uploaded "
                  "(--lora RANK).")
