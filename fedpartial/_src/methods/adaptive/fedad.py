"""FedAD (adaptive dropout) and FedDHAD (FedAD aggregated with FedDH's weights), docs/decisions.md#feddhad.

FedAD follows Algorithm 2 of the FedDHAD paper: every round each sampled device
trains a sub-model from which each unit was dropped with its own rate, and the rates
are recomputed only when the importance of the units stops changing.

**Rates** (:mod:`fedpartial._src.methods.adaptive.rates`, with their decisions),
recomputed in ``update`` on the round's cohort: the units' importance ``R`` (HRank /
input-weight sums), the global rate ``d_avg`` (Hessian eigen-gap criterion, or a fixed
``rate``), every device's target ``d*_k`` from ``d_avg`` and its execution time
(``target``: ``'time-matched'`` or ``'literal'``), and per unit
``d_k^i = clip(softmax(−R)_i · N_kind · d*_k, 0, max_rate)``.  Before the first update
every rate is 0 (the paper's critical early period: FedAD starts as FedAvg).

**Schedule.**  Every ``measure_every`` rounds (``h``) the importance is measured and
its variation ``Δ = ‖R^t − R^{t−h}‖`` compared with the previous one; the rounds
without a decrease accumulate, and once they reach ``patience`` (``C``) the rates
are recomputed and the count restarts.  After the first update the rates are also
recomputed at every measurement whose variation decreased (the paper: "the update
is performed again when a reduction in variation is observed").  The metrics of a
round describe the state it ran with (the update comes after them).

**Masks.**  ``resample='round'`` (the paper: ``m_k^{i,t}`` per round): the server
samples each client's sub-model in ``plan`` (unit ``i`` kept with probability
``1 − d_k^i``, kept units scaled by ``1/(1 − d_k^i)``, inverted dropout); dropped
units are neither sent, trained nor uploaded, and the server pays the index bytes.
If a layer would lose every unit, its lowest-rate unit is kept.  ``resample='step'``:
every local step draws a fresh mask from its own key (``Method.step_plan``); the
whole model is sent and uploaded, and the device's FLOPs are counted with each unit's
keep probability (metric ``dropout_keep_probability``).

**Aggregation**: the engine's one formula — per element the weighted mean over the
clients that kept it, else the global value — with weights ``n_k`` (FedAD) or
FedDH's ``q_k`` (FedDHAD, :func:`fedpartial._src.methods.weighting.compose.reweight`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedpartial._src.core import masks
from fedpartial._src.costs import footprint as costs
from fedpartial._src.methods.adaptive import importance
from fedpartial._src.methods.adaptive.rates import (
    cohort_importance,
    device_targets,
    hessian_rate,
    sample_units,
    unit_rates,
    unit_shares,
)
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
from fedpartial._src.methods.registry import MethodSpec, Option, between, check_values, positive_int, whole_number
from fedpartial._src.methods.weighting.compose import reweight
from fedpartial._src.methods.weighting.feddh import RATE_OPTIONS, feddh_weighting

RESAMPLE_MODES = ("round", "step")
TARGET_READINGS = ("time-matched", "literal")


class AdaptiveState(NamedTuple):
    """FedAD's server state (no per-client rows)."""

    importance: tuple[jax.Array, ...]  # R at the last measurement, per layer [units]
    variation: jax.Array  # Δ of the last measurement (inf until two measurements)
    stall: jax.Array  # int32 rounds since Δ last decreased
    measured: jax.Array  # bool: R has been measured at least once
    shares: tuple[jax.Array, ...]  # softmax(−R)·N_kind per unit (classifier 0)
    global_rate: jax.Array  # d_avg
    target: jax.Array  # [N] d*_k
    execution_times: jax.Array  # [N] ET°_k (seconds; ones without a device model)
    reference_time: jax.Array  # ET°_ref
    updates: jax.Array  # int32 number of rate updates so far


def init(ctx: MethodContext, view: InitView) -> MethodState:
    """No rates yet (all 0); the execution times ``ET°_k`` and the reference device's ``ET°_ref``."""
    structure = ctx.structure
    masks.uses_neurons(structure)
    n = ctx.num_clients
    times = (jnp.ones((n,), jnp.float32) if view.execution_times is None
             else jnp.asarray(view.execution_times, jnp.float32))
    sizes = None if view.label_counts is None else jnp.sum(jnp.asarray(view.label_counts), axis=-1)
    reference = jnp.max(times) if sizes is None else times[jnp.argmax(sizes)]
    zeros = tuple(jnp.zeros((u,), jnp.float32) for u in structure.units)
    return MethodState(server=AdaptiveState(
        importance=zeros, variation=jnp.asarray(jnp.inf, jnp.float32), stall=jnp.zeros((), jnp.int32),
        measured=jnp.zeros((), bool), shares=zeros, global_rate=jnp.zeros((), jnp.float32),
        target=jnp.zeros((n,), jnp.float32), execution_times=times, reference_time=reference,
        updates=jnp.zeros((), jnp.int32)))


def step_plan(ctx: MethodContext, plan: ClientPlan, key: jax.Array, step: jax.Array) -> ClientPlan:
    """A fresh mask for one local step (``resample='step'``): one client, sampled as a cohort of one."""
    rates = tuple(d[None] for d in plan.extra)
    kept, scales = sample_units(key, rates, jnp.zeros((1,), jnp.int32))
    mask = masks.protect_output(masks.from_neurons(ctx.structure, tuple(k[0] for k in kept)))
    return plan._replace(dropout=mask, dropout_scale=tuple(s[0] for s in scales))


def select(ctx: MethodContext, view: RoundView) -> Selection:
    """Every client uploads what it trained, weighted by ``n_k``."""
    k = view.cohort.num_samples.shape[0]
    return Selection(upload=view.plan.dropout, weights=view.cohort.num_samples,
                     extra_upload_bytes=jnp.zeros((k,), jnp.int32))


def fedad(rate: float | None = None, measure_every: int = 2, patience: int = 4, max_rate: float = 0.5,
          resample: str = "round", importance_batches: int = 2, lanczos_steps: int = 16,
          target: str = "time-matched") -> Method:
    """FedAD: per-unit dropout rates from unit importance, a global rate and each device's time.

    Args:
      rate: fixed global rate ``d_avg`` in [0, 1) (None: the Hessian criterion).
      measure_every: ``h``, rounds between importance measurements.
      patience: ``C``, rounds without a decrease of the variation before the rates are recomputed.
      max_rate: the largest per-unit rate (< 1).
      resample: ``'round'`` (one sub-model per round, the paper) or ``'step'`` (a mask per local step).
      importance_batches: local batches per client on which HRank is measured.
      lanczos_steps: Lanczos iterations of the Hessian criterion.
      target: ``'time-matched'`` or ``'literal'``, the reading of the device targets ``d*_k``.
    """
    check_values("fedad", OPTIONS, rate=rate, measure_every=measure_every, patience=patience, max_rate=max_rate,
                 resample=resample, importance_batches=importance_batches, lanczos_steps=lanczos_steps, target=target)
    per_step = resample == "step"

    def cohort_rates(ctx: MethodContext, view: RoundView) -> tuple[jax.Array, ...]:
        s: AdaptiveState = view.method_state.server
        return unit_rates(s.shares, s.target[view.cohort.client_ids], max_rate)

    def plan(ctx: MethodContext, view: RoundView) -> ClientPlan:
        rates = cohort_rates(ctx, view)
        if per_step:
            k = view.cohort.client_ids.shape[0]
            return ClientPlan(dropout=masks.full(ctx.structure, (k,)), extra=rates)
        kept, scales = sample_units(view.key, rates, view.cohort.client_ids)
        mask = masks.protect_output(masks.from_neurons(ctx.structure, kept))
        return ClientPlan(dropout=mask, dropout_scale=scales, download=mask,
                          extra_download_bytes=costs.index_bytes(ctx.structure, mask), extra=rates)

    def recompute(ctx: MethodContext, view: RoundView, s: AdaptiveState, scores) -> AdaptiveState:
        d_avg = jnp.asarray(rate, jnp.float32) if rate is not None else hessian_rate(ctx, view, lanczos_steps)
        d_avg = jnp.clip(d_avg, 0.0, max_rate)
        targets = device_targets(target, d_avg, s.execution_times, s.reference_time, max_rate)
        return s._replace(shares=unit_shares(importance.importance_kinds(ctx.model), scores), global_rate=d_avg,
                          target=targets, stall=jnp.zeros((), jnp.int32), updates=s.updates + 1)

    def measure(ctx: MethodContext, view: RoundView, s: AdaptiveState) -> AdaptiveState:
        scores = cohort_importance(ctx, view, importance_batches)
        variation = jnp.sqrt(sum(jnp.sum((a - b) ** 2) for a, b in zip(scores, s.importance)))
        variation = jnp.where(s.measured, variation, jnp.inf)
        decreased = variation < s.variation
        stall = jnp.where(s.measured & ~decreased, s.stall + measure_every, 0).astype(jnp.int32)
        again = (s.updates > 0) & decreased  # "performed again when a reduction in variation is observed"
        s = s._replace(importance=scores, variation=variation, stall=stall, measured=jnp.ones((), bool))
        return jax.lax.cond((stall >= patience) | again, lambda s: recompute(ctx, view, s, scores), lambda s: s, s)

    def update(ctx: MethodContext, view: RoundView) -> MethodState:
        s: AdaptiveState = view.method_state.server
        due = (view.round + 1) % measure_every == 0
        s = jax.lax.cond(due, lambda s: measure(ctx, view, s), lambda s: s, s)
        return view.method_state._replace(server=s)

    def metrics(ctx: MethodContext, view: RoundView) -> dict:
        s: AdaptiveState = view.method_state.server
        rates = view.plan.extra  # the rates this round's masks were drawn with
        hidden = sum(ctx.structure.units[:-1])
        mean_rate = sum(jnp.sum(d, axis=-1) for d in rates[:-1]) / max(hidden, 1)
        out = {"global_dropout_rate": s.global_rate, "target_dropout_rate": s.target[view.cohort.client_ids],
               "mean_unit_dropout_rate": mean_rate, "rate_updates": s.updates,
               "importance_variation": jnp.where(jnp.isfinite(s.variation), s.variation, -1.0)}
        if per_step:
            out["dropout_keep_probability"] = tuple(1.0 - d for d in rates)
        return out

    return make_method("fedad", init=init, plan=plan, step_plan=step_plan if per_step else None,
                       select=select, update=update, metrics=metrics,
                       capabilities=Capabilities(needs_execution_times=True, neuron_masks=True,
                                                 second_order=rate is None))


def feddhad(rate: float | None = None, measure_every: int = 2, patience: int = 4, max_rate: float = 0.5,
            resample: str = "round", importance_batches: int = 2, lanczos_steps: int = 16,
            target: str = "time-matched", lr_upsilon: float = 1e-4, decay_upsilon: float = 0.999,
            lr_b: float = 1e-4, decay_b: float = 0.99) -> Method:
    """FedDHAD: FedAD's sub-models aggregated with FedDH's learned non-IID weights.

    Args:
      rate: as FedAD's (:func:`fedpartial.methods.fedad`).
      measure_every: as FedAD's (:func:`fedpartial.methods.fedad`).
      patience: as FedAD's (:func:`fedpartial.methods.fedad`).
      max_rate: as FedAD's (:func:`fedpartial.methods.fedad`).
      resample: as FedAD's (:func:`fedpartial.methods.fedad`).
      importance_batches: as FedAD's (:func:`fedpartial.methods.fedad`).
      lanczos_steps: as FedAD's (:func:`fedpartial.methods.fedad`).
      target: as FedAD's (:func:`fedpartial.methods.fedad`).
      lr_upsilon: the learning rate of the non-IID degrees υ.
      decay_upsilon: the decay of υ's learning rate per round.
      lr_b: the learning rate of the bias b.
      decay_b: the decay of b's learning rate per round.

    Returns:
      The :class:`~fedpartial.Method` (``--method feddhad``).
    """
    return reweight(fedad(rate, measure_every, patience, max_rate, resample, importance_batches, lanczos_steps,
                          target),
                    feddh_weighting(lr_upsilon, decay_upsilon, lr_b, decay_b), name="feddhad")


OPTIONS = (
    Option("rate", float, None, "FedAD: fixed global dropout rate d_avg in [0, 1) (default: the Hessian "
           "eigen-gap criterion)",
           between(0, 1, high_open=True, allowed="must be a number in [0, 1) (or unset for the Hessian criterion)"),
           flag="--ad-rate"),
    Option("measure_every", int, 2, "FedAD: rounds h between importance measurements", positive_int,
           flag="--ad-measure-every"),
    Option("patience", int, 4, "FedAD: rounds C without a decrease of the importance variation before the "
           "rates are recomputed (0: at every measurement)", whole_number(0), flag="--ad-patience"),
    Option("max_rate", float, 0.5, "FedAD: largest per-unit dropout rate, in (0, 1)",
           between(0, 1, low_open=True, high_open=True), flag="--ad-max-rate"),
    Option("resample", str, "round", "FedAD: draw each client's sub-model once per round (the paper) or "
           "a fresh mask every local step", flag="--ad-resample", choices=RESAMPLE_MODES),
    Option("importance_batches", int, 2, "FedAD: local batches per client on which HRank is measured",
           positive_int, flag="--ad-importance-batches"),
    Option("lanczos_steps", int, 16, "FedAD: Lanczos iterations of the Hessian criterion", positive_int,
           flag="--ad-lanczos-steps"),
    Option("target", str, "time-matched", "FedAD: reading of each device's target dropout: time-matched "
           "(slow devices drop until their time matches the reference device's) or literal (Algorithm 2 "
           "as printed: faster devices drop more)", flag="--ad-target", choices=TARGET_READINGS),
)

SPECS = (
    MethodSpec("fedad", fedad, "Adaptive dropout: per-unit rates from HRank / weight importance, a Hessian "
               "global rate and each device's time.", OPTIONS),
    MethodSpec("feddhad", feddhad, "FedAD's sub-models aggregated with FedDH's learned non-IID weights.",
               OPTIONS + RATE_OPTIONS),
)
