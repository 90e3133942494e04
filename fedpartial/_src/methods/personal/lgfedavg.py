"""LG-FedAvg (Liang et al., 2020, "Think Locally, Act Globally: Federated Learning with Local and Global
Representations"): personal lower layers, a shared head.

Each client keeps every layer below the model's last ``--head-layers`` (default 1, the classifier)
as its own local representation; only the head is uploaded and averaged with ``n_k`` weights
(:mod:`fedpartial._src.methods.personal.parts`).  The paper's optional representation-learning
objectives for the local layers are not part of it.  ``--head-layers`` equal to the model's
layers is FedAvg; 0 is local training alone.
"""

from __future__ import annotations

from fedpartial._src.methods.base import Method
from fedpartial._src.methods.personal.parts import HEAD_LAYERS_OPTION, head_of, personal_layers
from fedpartial._src.methods.registry import MethodSpec


def lgfedavg(head_layers: int = 1) -> Method:
    """LG-FedAvg: every layer below the last ``head_layers`` is each client's own, the head is shared.

    Args:
      head_layers: the number of output-side layers in the head.

    Returns:
      The :class:`~fedpartial.Method` (``--method lgfedavg``).
    """
    return personal_layers("lgfedavg", lambda num_layers: ~head_of("lgfedavg", head_layers, num_layers))


SPEC = MethodSpec("lgfedavg", lgfedavg, "Personal lower layers, shared head (the last --head-layers layers).",
                  (HEAD_LAYERS_OPTION,))
