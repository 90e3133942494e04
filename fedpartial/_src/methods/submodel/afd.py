"""AFD — Adaptive Federated Dropout (Bouacida, Hou, Zang, Liu; INFOCOM Workshops 2021, arXiv 2011.04050).

AFD is Federated Dropout (each round every sampled client trains a *sub-model*: a
fixed fraction of every hidden layer's units removed, the classifier complete)
whose sub-model is chosen from an **activation score map** instead of uniformly at
random.  No official code exists.  What follows is our reading, put together from the
paper's abstract and summaries, FedDHAD's description of it (a score map; a sub-model
judged by the variation of the loss, which "ignores that the loss naturally falls
during training") and one public re-implementation; the full text's formulas could
not be checked, so the points marked *decided* below are ours.

* **Units and rate.**  An "activation" is a unit of a hidden layer: a dense layer's
  neuron or a convolution's filter (output channel).  Every hidden layer drops the
  fraction ``d`` (``--afd-rate``, default 0.25 as FedDHAD runs it) of its units and
  keeps ``max(1, round((1-d)·u))`` (halves up); the classifier keeps all its outputs.
  The sub-model is removed from the client's forward pass, trained, uploaded and
  averaged exactly as FedDrop's (:func:`fedpartial._src.methods.submodel.dropout.submodel_method`):
  each element is the ``n_k``-weighted mean over the clients that kept it, and an
  element nobody kept keeps its global value.
* **Score map.**  One score per unit, all 0 at the start.  A score is a reward the
  unit earned by belonging to a sub-model after which the training loss fell.
* **Loss.**  The round's training loss ``ℓ_t``: the mean over the cohort's real clients
  of each client's mean local training loss (``RoundView.client_loss``), the value the
  engine reports as ``train_loss``.  Each client also uploads its loss (4 bytes).
* **Update** (``update``, after aggregation), with ``ℓ_{t-1}`` the previous round's loss:
  if ``ℓ_t < ℓ_{t-1}`` the sub-model is *good*: every unit it kept gets the score
  ``(ℓ_{t-1} − ℓ_t) / ℓ_{t-1}`` (the relative loss decrease; the other scores are
  unchanged) and the *same sub-model is sent again* next round.  Otherwise the
  sub-model is *bad*: no score changes and the next round draws a new sub-model.
  The first round has no ``ℓ_{t-1}``: nothing is rewarded and the next sub-model is
  drawn anew.
* **Choice** (``plan``): a kept good sub-model is sent as it is; otherwise every hidden
  layer draws its kept units by *weighted random selection*: units of positive score
  are drawn one after another without replacement with probability proportional to
  their score (Gumbel-top-k: ``log s + Gumbel`` keys, their top ``count``), and when
  fewer than ``count`` units have a positive score the rest are drawn uniformly among
  the zero-score units.  With every score 0 (the start) this is FedDrop's uniform draw.
* **Variants** (``--afd-variant``).  ``single`` (default, the paper's single-model AFD):
  one score map and one sub-model at the server, shared by every sampled client,
  judged by the cohort's loss.  ``multi`` (multi-model AFD): one score map, sub-model
  and previous loss per client (``MethodState.clients``, ``[N]`` rows), each judged by
  that client's own loss against its loss when it last took part; a client's first
  participation has no previous loss.
* **Evaluation.**  AFD trains one global model (not personalised): the full global
  model is what is evaluated.

Decided: the reward *replaces* a unit's score (it is the latest relative improvement,
not a running sum — as the public re-implementation does); "loss" is the clients'
training loss of the round, not a held-out loss; the fraction is dropped in every
hidden layer separately (the re-implementation counts over the whole model), so
sub-model sizes match FedDrop's; the first round's sub-model is not judged; a loss
that is not a number never counts as a decrease.  The classifier's scores are kept
(its units are always in the sub-model) but never read.

Everything is a pure jittable function of arrays and keys; the score map is
``MethodState.server`` (single) or ``MethodState.clients`` (multi).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedpartial._src.core import masks
from fedpartial._src.methods import selection
from fedpartial._src.methods.base import (
    InitView,
    Method,
    MethodContext,
    MethodState,
    RoundView,
    Selection,
    cohort_rows,
    global_is_personal,
    scatter_clients,
)
from fedpartial._src.methods.submodel.dropout import submodel_method
from fedpartial._src.methods.registry import MethodSpec, Option, check_values, rate
from fedpartial._src.methods.submodel.common import active_fraction

DEFAULT_RATE = 0.25
VARIANTS = ("single", "multi")
#: bytes of the training loss each client reports (one float32)
LOSS_BYTES = 4
#: zero-score units are ranked below every unit of positive score: a positive score's key
#: ``log s + Gumbel`` is above -110 for any float32 ``s > 0``; a zero score's ``Gumbel - 1000`` below -980.
_ZERO_SCORE_SHIFT = 1000.0


class ScoreMap(NamedTuple):
    """AFD's state: the activation score map and the sub-model it judges.

    Unbatched for single-model AFD (``MethodState.server``); with a leading ``[N]`` axis,
    one row per client, for multi-model AFD (``MethodState.clients``).

    Attributes:
      scores: per layer ``[units]`` float32, each unit's score (0 until rewarded).
      neurons: per layer ``[units]`` bool, the last sub-model's kept units.
      loss: float32, the training loss after the last sub-model.
      has_loss: bool, whether ``loss`` was ever recorded.
      keep: bool, the last sub-model was good: it is sent again next time.
    """

    scores: tuple[jax.Array, ...]
    neurons: tuple[jax.Array, ...]
    loss: jax.Array
    has_loss: jax.Array
    keep: jax.Array


def empty_map(ctx: MethodContext, batch: tuple[int, ...] = ()) -> ScoreMap:
    """All scores 0, no loss yet, nothing to keep (so the first sub-model is drawn)."""
    return ScoreMap(scores=tuple(jnp.zeros((*batch, u), jnp.float32) for u in ctx.structure.units),
                    neurons=tuple(jnp.ones((*batch, u), bool) for u in ctx.structure.units),
                    loss=jnp.zeros(batch, jnp.float32), has_loss=jnp.zeros(batch, bool),
                    keep=jnp.zeros(batch, bool))


def weighted_draw(key: jax.Array, scores: jax.Array, counts: jax.Array) -> jax.Array:
    """Per row, ``counts[r]`` units drawn by weighted random selection on ``scores[r]``.

    Units of positive score come first, drawn without replacement with probability
    proportional to their score (Gumbel-top-k); zero-score units fill what is left,
    uniformly.  ``key``: one key per row ``[R]``; ``scores``: ``[R, units]`` ≥ 0;
    ``counts``: ``[R]``.  Returns ``[R, units]`` bools.
    """
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, scores.shape[-1:]))(key)
    positive = scores > 0
    priority = jnp.where(positive, jnp.log(jnp.where(positive, scores, 1.0)) + gumbel, gumbel - _ZERO_SCORE_SHIFT)
    return selection.top_count_per_row(priority, counts)


def _rows_of(state: ScoreMap, multi: bool, view: RoundView) -> tuple[ScoreMap, jax.Array]:
    """The cohort's score maps ``[K]`` or the server's one ``[1]``, and one key per row."""
    if multi:
        keys = jax.vmap(lambda i: jax.random.fold_in(view.key, i))(view.cohort.client_ids)
        return view.client_state, keys
    return jax.tree.map(lambda a: a[None], state), view.key[None]


def _choose(multi: bool):
    def choose(ctx: MethodContext, view: RoundView, counts: tuple) -> tuple:
        k = counts[0].shape[0]
        rows, keys = _rows_of(view.method_state.server, multi, view)
        out = []
        for layer, (scores, kept, c) in enumerate(zip(rows.scores, rows.neurons, counts)):
            layer_keys = jax.vmap(lambda kk: jax.random.fold_in(kk, layer))(keys)
            fresh = weighted_draw(layer_keys, scores, c if multi else c[:1])
            chosen = jnp.where(rows.keep[:, None], kept, fresh)
            out.append(chosen if multi else jnp.broadcast_to(chosen, (k, chosen.shape[-1])))
        return tuple(out)
    return choose


def judge(rows: ScoreMap, loss: jax.Array, used: tuple[jax.Array, ...]) -> ScoreMap:
    """Score maps ``[R]`` after their sub-models ``used`` (``[R, units]``) reached ``loss`` (``[R]``).

    A decrease from the recorded loss rewards the used units with the relative decrease
    and keeps the sub-model; otherwise scores stay and the sub-model will be redrawn.
    """
    improved = rows.has_loss & (loss < rows.loss)
    gain = jnp.where(rows.loss > 0, (rows.loss - loss) / jnp.where(rows.loss > 0, rows.loss, 1.0), 0.0)
    scores = tuple(jnp.where(improved[:, None] & u, gain[:, None], s) for s, u in zip(rows.scores, used))
    return ScoreMap(scores=scores, neurons=tuple(used), loss=loss.astype(jnp.float32),
                    has_loss=jnp.ones_like(rows.has_loss), keep=improved)


def afd(dropout_rate: float = DEFAULT_RATE, variant: str = "single") -> Method:
    """Adaptive Federated Dropout: sub-models drawn from an activation score map judged by the loss.

    Args:
      dropout_rate: fraction of every hidden layer's units dropped, in [0, 1).
      variant: ``'single'`` (one score map at the server) or ``'multi'`` (one per client).
    """
    check_values("afd", SPEC.options, dropout_rate=dropout_rate, variant=variant)
    multi = variant == "multi"
    base = submodel_method("afd", _choose(multi), tiers=(1.0 - float(dropout_rate),), chosen_by="server")

    def init(ctx: MethodContext, view: InitView) -> MethodState:
        masks.uses_neurons(ctx.structure)
        if multi:
            return MethodState(clients=empty_map(ctx, (ctx.num_clients,)))
        return MethodState(server=empty_map(ctx))

    def select(ctx: MethodContext, view: RoundView) -> Selection:
        chosen = base.select(ctx, view)
        return chosen._replace(extra_upload_bytes=chosen.extra_upload_bytes + LOSS_BYTES)

    def update(ctx: MethodContext, view: RoundView) -> MethodState:
        used = view.plan.dropout.neurons
        valid = view.cohort.valid
        if multi:
            rows = judge(view.client_state, view.client_loss, used)
            clients = scatter_clients(view.method_state.clients, cohort_rows(view), rows, valid)
            return view.method_state._replace(clients=clients)
        server = view.method_state.server
        n_valid = jnp.sum(valid)
        loss = jnp.sum(jnp.where(valid, view.client_loss, 0.0)) / jnp.maximum(n_valid, 1)
        row = judge(jax.tree.map(lambda a: a[None], server), loss[None], tuple(u[:1] for u in used))
        judged = jax.tree.map(lambda a: a[0], row)
        server = jax.tree.map(lambda new, old: jnp.where(n_valid > 0, new, old), judged, server)
        return view.method_state._replace(server=server)

    def metrics(ctx: MethodContext, view: RoundView) -> dict:
        k = view.cohort.valid.shape[0]
        reused = view.client_state.keep if multi else jnp.broadcast_to(view.method_state.server.keep, (k,))
        return {**active_fraction(ctx, view), "afd_submodel_reused": reused}

    return base._replace(init=init, select=select, update=update, metrics=metrics,
                         personal=global_is_personal).with_capabilities(personalised=False, asynchronous=False)


SPEC = MethodSpec(
    "afd", afd, "Adaptive Federated Dropout: sub-models drawn from an activation score map rewarded when the "
    "training loss falls.",
    options=(Option("dropout_rate", float, DEFAULT_RATE, "AFD: fraction of every hidden layer's units dropped",
                    rate, flag="--afd-rate"),
             Option("variant", str, "single", "AFD: 'single' (one score map at the server) or 'multi' (one per "
                    "client)", flag="--afd-variant", choices=VARIANTS)),
)
