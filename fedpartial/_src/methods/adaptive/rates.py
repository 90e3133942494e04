"""FedAD's dropout rates: importance, targets, per-unit rates, masks.

Decisions: docs/decisions.md#feddhad; Algorithm 2 of the FedDHAD paper.

**Rates** (recomputed in ``update``, on the round's cohort ``SD``):

* importance ``R_k`` of every hidden unit on client ``k``'s trained model and its own
  data (:func:`fedpartial._src.methods.adaptive.importance.unit_importance`: HRank for a conv filter, the
  sum of input weights for a dense neuron), aggregated ``R = Σ n_k R_k / Σ n_k``;
* the global rate ``d_avg = Σ n_k d_k / Σ n_k`` with ``d_k = m_k / h_k`` from the
  Hessian criterion (:mod:`fedpartial._src.methods.adaptive.hessian`: Lanczos on Hessian-vector products
  at the trained model, first eigen-gap above ``4·L_k``), or a fixed ``rate``;
* every device's target ``d*_k`` from ``d_avg``, its full-model execution time ``ET°_k``
  (:func:`fedpartial._src.costs.devices.expected_execution_time` of full-model local work on
  device ``k``, given to ``init`` as ``InitView.execution_times``) and ``ET°_ref``, the
  time of the device holding the most training examples (the paper's "device with the
  most significant dataset"); without a device model every device gets ``d_avg``.
  ``target`` picks one of two readings (:func:`device_targets`):

  - ``'time-matched'`` (default): each device drops what makes its expected full-model
    time match the reference device's at ``d_avg``, ``ET°_k (1 − d*_k) = ET°_ref (1 − d_avg)``,
    so ``d*_k = clip(1 − ET°_ref (1 − d_avg) / ET°_k, 0, max_rate)``: slow devices drop
    more, devices faster than the reference drop nothing.
  - ``'literal'``: Algorithm 2 as printed, ``ET_max = ET°_ref · d_avg`` and
    ``d*_k = min(ET_max / ET°_k, 1)``.  The paper treats ``d`` as a keep fraction in
    these two formulas and as a dropout rate in the next one; read as a rate, *faster*
    devices drop more, which is the opposite of what adaptive dropout is for.  Kept as
    the paper's text, for comparison.
* per unit ``d_k^i = softmax(−R)_i · N_kind · d*_k``, the softmax taken over all
  conv filters together and over all hidden dense neurons together (``N_kind`` their
  number), clipped to ``[0, max_rate]`` (``max_rate < 1``; default 0.5, so the
  inverted-dropout scale stays ≤ 2 — the paper says only "clipped below 1", and at
  0.9 the ×10 scale of a rarely kept unit made Synthetic's MLP diverge to NaN within
  three rounds of the first update, measured on the GPU benchmark).  The classifier
  is never dropped.  Before the first update every rate is 0 (the paper's critical early
  period: FedAD starts as FedAvg).

:func:`sample_units` draws a client's sub-model from its per-unit rates (inverted
dropout).  The method that recomputes and uses the rates is
:func:`fedpartial._src.methods.adaptive.fedad.fedad`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fedpartial._src.core.losses import model_loss
from fedpartial._src.methods.adaptive import hessian, importance
from fedpartial._src.methods.base import MethodContext, RoundView


def unit_shares(kinds: tuple[str, ...], scores: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """``softmax(−r)_i · N_kind`` per hidden unit, separately over conv and dense units; 0 for the classifier."""
    out = [jnp.zeros_like(s, jnp.float32) for s in scores]
    for kind in ("conv", "dense"):
        layers = [i for i, k in enumerate(kinds[:-1]) if k == kind]
        if not layers:
            continue
        flat = jnp.concatenate([scores[i].astype(jnp.float32) for i in layers])
        share = jax.nn.softmax(-flat) * flat.shape[0]
        offsets = np.cumsum([0] + [scores[i].shape[0] for i in layers])
        for i, a, b in zip(layers, offsets[:-1], offsets[1:]):
            out[i] = share[a:b]
    return tuple(out)


def unit_rates(shares: tuple[jax.Array, ...], target: jax.Array, max_rate: float) -> tuple[jax.Array, ...]:
    """``[K, units]`` per layer: ``clip(share_i · d*_k, 0, max_rate)`` (the classifier's rates are 0)."""
    return tuple(jnp.clip(s[None, :] * target[:, None], 0.0, max_rate) for s in shares)


def device_targets(reading: str, global_rate: jax.Array, execution_times: jax.Array, reference_time: jax.Array,
                   max_rate: float) -> jax.Array:
    """Each device's target dropout ``d*_k`` from ``d_avg`` and the execution times (see the module doc)."""
    if reading == "literal":
        return jnp.minimum(reference_time * global_rate / execution_times, 1.0)
    return jnp.clip(1.0 - reference_time * (1.0 - global_rate) / execution_times, 0.0, max_rate)


def sample_units(key: jax.Array, rates: tuple[jax.Array, ...], ids: jax.Array) -> tuple[tuple, tuple]:
    """Each client's kept units (unit ``i`` kept w.p. ``1 − d_i``) and their scales ``1/(1 − d_i)``.

    Client ``k`` draws from ``fold_in(key, id_k)`` (its draw does not depend on who else
    is in the cohort), layer ``l`` from ``fold_in(·, l)``.  A layer that would lose every
    unit keeps its lowest-rate one (lowest index among equals).
    """
    keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(ids)
    kept, scales = [], []
    for layer, d in enumerate(rates):
        u = jax.vmap(lambda k, shape=d.shape[1:], layer=layer: jax.random.uniform(
            jax.random.fold_in(k, layer), shape))(keys)
        keep = u >= d
        fallback = jnp.arange(d.shape[-1])[None, :] == jnp.argmin(d, axis=-1)[:, None]
        keep = jnp.where(jnp.any(keep, axis=-1, keepdims=True), keep, fallback)
        kept.append(keep)
        scales.append(jnp.where(keep, 1.0 / (1.0 - d), 0.0))
    return tuple(kept), tuple(scales)


def _real_batches(view: RoundView, batches: int):
    """The first ``batches`` local steps of every client, flattened to ``[K, batches·B, ...]``."""
    data = jax.tree.map(lambda a: a[:, :batches], view.data)
    k = data.x.shape[0]
    x = data.x.reshape((k, -1) + data.x.shape[3:])
    y = data.y.reshape((k, -1))
    mask = (data.example_mask & data.step_mask[..., None]).reshape((k, -1))
    return x, y, mask


def cohort_importance(ctx: MethodContext, view: RoundView, batches: int) -> tuple[jax.Array, ...]:
    """``R = Σ n_k R_k / Σ n_k`` per layer ``[units]`` over the valid cohort, each ``R_k`` on client ``k``'s
    trained model and its first ``batches`` local batches."""
    x, _, mask = _real_batches(view, batches)
    per_client = jax.vmap(lambda v, xx, m: importance.unit_importance(ctx.model, v, xx, m))(
        view.trained_vars, x, mask)
    w = view.cohort.num_samples * view.cohort.valid
    w = w / jnp.maximum(jnp.sum(w), 1e-12)
    return tuple(jnp.tensordot(w, r, axes=1) for r in per_client)



def hessian_rate(ctx: MethodContext, view: RoundView, lanczos_steps: int) -> jax.Array:
    """``d_avg = Σ n_k d_k / Σ n_k`` over the valid cohort, ``d_k`` from the Hessian eigen-gap criterion at
    client ``k``'s trained model on its first local batch."""
    x, y, mask = _real_batches(view, 1)
    keys = jax.vmap(lambda i: jax.random.fold_in(view.key, i))(view.cohort.client_ids)

    def one(trained, start, xx, yy, mm, key):
        def loss(params):
            return model_loss(ctx.model, {**trained, "params": params}, xx, yy, mm,
                              train=ctx.batch_statistics)[0]
        eigs = hessian.hessian_spectrum(loss, trained["params"], lanczos_steps, key)
        lip = hessian.secant_lipschitz(jax.grad(loss), start["params"], trained["params"])
        return hessian.eigengap_rate(eigs, lip)

    d = jax.vmap(one)(view.trained_vars, view.start_vars, x, y, mask, keys)
    w = view.cohort.num_samples * view.cohort.valid
    return jnp.sum(w * d) / jnp.maximum(jnp.sum(w), 1e-12)

