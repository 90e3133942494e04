"""How the dropout baselines choose their neurons (:mod:`fedpartial._src.methods.submodel.dropout`).

A chooser is ``choose(ctx, view, counts) -> neurons``: per layer, which of its units
each cohort client keeps, given how many (``counts``).  FedDrop draws them at random,
FjORD takes the leftmost, Hermes and FedMP the largest parameter norms, PruneFL the
largest gradient norms; the index cost says what naming them costs.

Decisions where the papers are vague:

* Norm-based choices score the client's *personal model*: its last trained
  sub-model, whose dropped neurons' parameters hold the global values of that round
  (a client that never trained holds ``w⁰``).  A dropped neuron's BatchNorm running
  statistics still move during training (its output is computed, only the weights
  reading it are zeroed); nothing reads them — they are not uploaded, scores use
  parameters only, and evaluation removes the neuron.  PruneFL's gradient is taken at that model on
  the client's first local batch of the round.
* A neuron's parameters are its kernel column, bias and BatchNorm scale/bias.
* Index cost: who chooses tells the other side — the server's choice (FedDrop)
  costs download, a client's choice costs upload; per masked layer the cheaper of
  int32 indices or a bit-mask.  FjORD sends one int32 width per masked layer.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from fedpartial._src.costs import footprint as costs
from fedpartial._src.core.losses import model_loss
from fedpartial._src.methods import selection
from fedpartial._src.methods.base import MethodContext, RoundView
from fedpartial._src.methods.submodel import common as submodel

#: bytes of FjORD's per-layer width (one int32)
WIDTH_BYTES = 4

Chooser = Callable[[MethodContext, RoundView, tuple], tuple]


def random_units(ctx: MethodContext, view: RoundView, counts: tuple) -> tuple:
    return submodel.random_neurons(view.key, counts, ctx.structure.units, view.cohort.client_ids)


def leftmost_units(ctx: MethodContext, view: RoundView, counts: tuple) -> tuple:
    return submodel.leftmost_neurons(counts, ctx.structure.units)


def by_parameter_norm(ord: int) -> Chooser:
    def choose(ctx: MethodContext, view: RoundView, counts: tuple) -> tuple:
        scores = selection.neuron_norms(ctx.structure, view.client_state.variables["params"], ord=ord)
        return submodel.strongest_neurons(scores, counts)
    return choose


def by_gradient_norm(ctx: MethodContext, view: RoundView, counts: tuple) -> tuple:
    batch = submodel.first_batch(view.data)

    def gradient(variables, x, y, example_mask):
        def loss(params):
            return model_loss(ctx.model, {**variables, "params": params}, x, y, example_mask,
                              train=ctx.batch_statistics)[0]
        return jax.grad(loss)(variables["params"])

    grads = jax.vmap(gradient)(view.client_state.variables, batch.x, batch.y, batch.example_mask)
    return submodel.strongest_neurons(selection.neuron_norms(ctx.structure, grads, ord=2), counts)


def width_bytes(structure, mask) -> jax.Array:
    return jnp.full(mask.layers.shape[:-1], WIDTH_BYTES * (structure.num_layers - 1), jnp.int32)


def dense_layers_only(choose: Chooser) -> Chooser:
    """``choose`` with every convolution keeping all its units: only dense layers are thinned."""
    def dense(ctx: MethodContext, view: RoundView, counts: tuple) -> tuple:
        counts = tuple(jnp.full_like(c, u) if kind == "conv" else c
                       for c, u, kind in zip(counts, ctx.structure.units, ctx.structure.kinds))
        return choose(ctx, view, counts)
    return dense


def dense_index_bytes(structure, mask) -> jax.Array:
    """Index bytes of the hidden dense layers only: conv layers are never thinned, so nothing names them."""
    total = jnp.zeros(mask.layers.shape[:-1], jnp.int32)
    for units, kind, on in zip(structure.units[:-1], structure.kinds[:-1], mask.neurons[:-1]):
        if kind == "dense":
            total = total + costs.layer_index_bytes(units, jnp.sum(on, axis=-1, dtype=jnp.int32))
    return total
