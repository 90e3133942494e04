"""FedSA-LoRA (Guo et al., ICLR 2025, "Selective Aggregation for Low-Rank Adaptation in Federated Learning"):
A is shared and averaged, B stays each client's own.

The paper's finding is that A learns what is general and B what is client-specific, so every client keeps its
own B across rounds (``MethodState.clients``, ``[N]`` copies of the adapters and head only: the frozen base is
held once) and starts each round from the global A and output layer with its own B; it trains A and B and
uploads everything but B.  Evaluation is each client's own model (personalised): the global A and head with its
own B, over the shared base.  This is FedPer's machinery (:mod:`fedpartial._src.methods.personal.parts`) with the
B layers (named ``<layer>/lora_b`` by :func:`fedpartial.models.lora`) as the personal part.
"""

from __future__ import annotations

import numpy as np

from fedpartial._src.core import masks
from fedpartial._src.core.errors import UserError
from fedpartial._src.core.structure import ModelStructure
from fedpartial._src.methods.base import Method
from fedpartial._src.methods.personal.parts import personal_parts
from fedpartial._src.methods.registry import MethodSpec


def b_layers(structure: ModelStructure) -> np.ndarray:
    """``[L]`` bool: the adapters' B layers (``<layer>/lora_b``); a model without adapters is one sentence."""
    found = np.array([name.endswith("/lora_b") for name in structure.layer_names])
    if not found.any():
        raise UserError("method fedsa_lora trains LoRA adapters, but the model has none; add --lora RANK (or wrap "
                        "the model with fedpartial.models.lora).")
    return found


def fedsa_lora() -> Method:
    """FedSA-LoRA: every adapter's A shared (averaged with ``n_k`` weights), its B personal.

    Returns:
      The :class:`~fedpartial.Method` (``--method fedsa_lora``; the model needs ``--lora RANK``).
    """
    return personal_parts("fedsa_lora", lambda structure: masks.from_layers(structure, ~b_layers(structure)))


SPEC = MethodSpec("fedsa_lora", fedsa_lora, "LoRA with A shared and averaged, B personal per client (--lora RANK); "
                  "personalised evaluation.")
