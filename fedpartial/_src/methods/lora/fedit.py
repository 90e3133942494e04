"""FedIT (Zhang et al., ICASSP 2024, "Towards Building the Federated GPT: Federated Instruction Tuning"): FedAvg
on the LoRA adapters.

Every client trains its adapters (and the output layer) over the frozen base, which it never uploads; the
server averages A and B separately, weighted by ``n_k``.  That average of the factors is not the average of the
clients' updates ``ΔW_k = (α/r)·A_k B_k``; the metric ``lora_aggregation_error`` reports the gap each round
(:func:`~fedpartial._src.methods.lora.common.aggregation_error`).  On a LoRA model this is FedAvg exactly.
"""

from __future__ import annotations

from fedpartial._src.methods.base import Capabilities, InitView, Method, MethodContext, MethodState, make_method
from fedpartial._src.methods.lora.common import aggregation_error_metric, lora_spec
from fedpartial._src.methods.lora.ranked import rank_plan
from fedpartial._src.methods.registry import MethodSpec


def fedit() -> Method:
    """FedIT: FedAvg over the LoRA adapters, reporting the aggregation error.

    Returns:
      The :class:`~fedpartial.Method` (``--method fedit``; the model needs ``--lora RANK``).
    """

    def init(ctx: MethodContext, view: InitView) -> MethodState:
        lora_spec("fedit", ctx)
        return MethodState()

    return make_method("fedit", init=init, plan=rank_plan, metrics=aggregation_error_metric,
                       capabilities=Capabilities(streamable="per_client", asynchronous=True))


SPEC = MethodSpec("fedit", fedit, "FedAvg on the LoRA adapters (--lora RANK); reports the aggregation error.")
