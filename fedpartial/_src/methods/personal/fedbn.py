"""FedBN (Li et al., ICLR 2021, "FedBN: Federated Learning on Non-IID Features via Local Batch Normalization",
Algorithm 1): FedAvg, except that every BatchNorm stays local.

Each client keeps its own normalisers — BatchNorm scale, bias and running statistics (any
normaliser the model declares: LayerNorm and GroupNorm too) — across rounds and shares everything
else, averaged with ``n_k`` weights; evaluation is each client's own model (the global weights
with its normalisers) on its held-out split (:mod:`fedpartial._src.methods.personal.parts`,
``Mask.norms``).  A model without normalisers is refused: FedBN would be FedAvg.
"""

from __future__ import annotations

import jax.numpy as jnp

from fedpartial._src.core import masks
from fedpartial._src.core.errors import UserError
from fedpartial._src.core.structure import ModelStructure
from fedpartial._src.methods.base import Method
from fedpartial._src.methods.personal.parts import personal_parts
from fedpartial._src.methods.registry import MethodSpec


def without_normalisers(structure: ModelStructure) -> masks.Mask:
    """Every element but the normalisers' (BatchNorm scale, bias and statistics)."""
    if not any(layer.norm_paths for layer in structure.layers):
        raise UserError("fedbn: the model has no BatchNorm (or other normaliser) layers, so FedBN would be FedAvg; "
                        "use fedavg or a model with BatchNorm.")
    return masks.full(structure)._replace(norms=jnp.zeros((structure.num_layers,), bool))


def fedbn() -> Method:
    """FedBN: the normalisers are each client's own, everything else is FedAvg's."""
    return personal_parts("fedbn", without_normalisers)


SPEC = MethodSpec("fedbn", fedbn, "FedAvg with every BatchNorm kept local (personal normalisers).")
