"""Heterogeneous LoRA ranks: rank tiers over the population, each client training the leading components.

A LoRA model of rank ``r_max`` serves every tier: a client of rank ``r_k`` trains, uploads and computes with the
first ``r_k`` components of every adapter (A's leading columns, B's leading rows), a sub-model mask over the A
layers' units (:meth:`~fedpartial.models.LoraSpec.rank_mask`), so one compiled round runs every tier.  Tiers are
equal groups by client id, as the other tiered methods' keep ratios: client ``i`` of ``N`` is in tier
``⌊i·T/N⌋`` of the ``T`` ranks given.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp

from fedpartial._src.core.errors import UserError
from fedpartial._src.models.adapter import Model


def with_lora_ranks(model: Model, ranks: Sequence[int]) -> Model:
    """``model`` (a :func:`~fedpartial.models.lora` model) with rank tiers: clients in equal groups by id train
    the first ``ranks[t]`` rank components of its adapters (``--lora-ranks``).

    Args:
      model: a LoRA model of rank ``r_max``.
      ranks: one rank per tier, each between 1 and ``r_max``.

    Returns:
      The same model, its :class:`~fedpartial.models.LoraSpec` carrying the tiers.

    Raises:
      UserError: a model without adapters, or a rank outside ``1 … r_max``.
    """
    spec = model.lora
    if spec is None:
        raise UserError(f"model {model.name} has no LoRA adapters to rank; wrap it with lora(model, rank=...) first.")
    ranks = tuple(ranks)
    if not ranks or any(isinstance(r, bool) or not isinstance(r, int) or not 1 <= r <= spec.rank for r in ranks):
        raise UserError(f"LoRA ranks {ranks} must be whole numbers between 1 and the adapters' rank {spec.rank}.")
    return dataclasses.replace(model, lora=dataclasses.replace(spec, ranks=ranks))


def client_ranks(model: Model, client_ids: jax.Array, num_clients: int) -> jax.Array:
    """Each client's LoRA rank: its tier's, or the adapters' rank without tiers.

    Args:
      model: a LoRA model (:func:`with_lora_ranks` gives it tiers).
      client_ids: clients' indices into the population (any shape).
      num_clients: the population ``N`` (tiers are equal groups of it by id).

    Returns:
      int32 ranks, ``client_ids``'s shape.

    Examples:
      >>> import fedpartial as fp
      >>> base = fp.models.from_linen(fp.models.build_model("mlp", 3, (4,)), input_shape=(4,), num_classes=3)
      >>> model = fp.models.with_lora_ranks(fp.models.lora(base, 4), (1, 4))
      >>> fp.models.client_ranks(model, [0, 1, 2, 3], 4).tolist()
      [1, 1, 4, 4]
    """
    spec = model.lora
    ids = jnp.asarray(client_ids, jnp.int32)
    if spec.ranks is None:
        return jnp.full(ids.shape, spec.rank, jnp.int32)
    tier = (ids * len(spec.ranks)) // num_clients
    return jnp.asarray(spec.ranks, jnp.int32)[jnp.clip(tier, 0, len(spec.ranks) - 1)]
