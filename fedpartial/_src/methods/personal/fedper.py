"""FedPer (Arivazhagan et al., 2019, "Federated Learning with Personalization Layers"): a shared body and a
personal head.

Each client keeps the model's last ``--head-layers`` layers (default 1, the classifier; the paper
personalises the top one or two) as its own and trains the whole model every round; only the body
(the base layers) is uploaded and averaged with ``n_k`` weights (:mod:`fedpartial._src.methods.personal.parts`).
``--head-layers 0`` is FedAvg; as many as the model has is local training alone.
"""

from __future__ import annotations

from fedpartial._src.methods.base import Method
from fedpartial._src.methods.personal.parts import HEAD_LAYERS_OPTION, head_of, personal_layers
from fedpartial._src.methods.registry import MethodSpec


def fedper(head_layers: int = 1) -> Method:
    """FedPer: the last ``head_layers`` layers are each client's own, the body is shared.

    Args:
      head_layers: the number of output-side layers in the head.

    Returns:
      The :class:`~fedpartial.Method` (``--method fedper``).
    """
    return personal_layers("fedper", lambda num_layers: head_of("fedper", head_layers, num_layers))


SPEC = MethodSpec("fedper", fedper, "Shared body, personal head (the last --head-layers layers) per client.",
                  (HEAD_LAYERS_OPTION,))
