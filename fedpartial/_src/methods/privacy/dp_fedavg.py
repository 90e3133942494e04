"""DP-FedAvg (McMahan et al. 2018) around any method: clipped updates, Gaussian noise, a fixed denominator.

``dp_fedavg(method, clip=C, noise_multiplier=z)`` is ``method`` — its plan, local training, upload
masks, state — whose ``params`` are aggregated as user-level differential privacy asks (the engine's
``aggregate`` hook):

* **Update.**  Client ``k``'s update is ``Δ_k = θ_k − θ^t`` on the elements it uploads (its upload
  mask); every built-in method starts a client from the global model on what it uploads, so this is
  *trained − start* there.  A client takes part when it is valid and its selection weight is > 0;
  the weights are otherwise not used: every client's clipped update counts once (a weight read from
  the data would change the sensitivity).
* **Clipping** to L2 norm ``C``: flat (``Δ_k ← Δ_k · min(1, C / ||Δ_k||)`` over its whole upload), or
  ``per_layer``: layer ``l`` of the upload to ``C_l = C / √L`` (``L``: the model's layers, so
  ``Σ_l C_l² = C²``; McMahan et al.'s equal split).  A client within the norm keeps its values bit
  for bit.
* **Noise** of std ``z·C`` is added to ``S_e = Σ_k m_ke Δ_ke``, the sum over the clients that
  uploaded element ``e``, for every element anyone is expected to upload; the server divides by the
  **expected count** ``D_e`` (a fixed denominator) and keeps the global value where ``D_e = 0``::

      θ^{t+1}_e = θ^t_e + (S_e + N(0, z²C²)) / D_e

  ``D_e`` is the mean, over the rounds so far (this one included), of how many clients uploaded
  ``e``: ``K`` for FedAvg and ``n`` for FedLDF in every round, each group's size for EmbracingFL's
  prefix, the expectation for random masks (FedSPU).  Unequal upload masks therefore divide each
  element by its own expected contributors, and the denominator never reads this round's updates.
* **z = 0** adds no noise and gives no privacy: the clipped models are aggregated by the engine's one
  formula (the method's weights over the actual uploaders), so ``C = ∞, z = 0`` is ``method`` bit for
  bit.  ``z > 0`` needs a finite ``C``.
* **Adaptive clipping** (Andrew et al. 2021), with ``target_quantile`` γ: after each round
  ``C ← C · exp(−η (b̃ − γ))``, ``b̃ = (Σ_k [||Δ_k|| ≤ C] + N(0, σ_b²)) / K``.  The count's noise
  ``σ_b = max(K / 20, z·√10 / 2)`` (the paper's ``K/20``, but the count never takes more than a tenth
  of the privacy budget) and the sum's multiplier becomes ``z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2)``, so the
  two together cost what one Gaussian of multiplier ``z`` does.

Refused: a method with a ``server_correct`` (its server step reads every update outside the noised
sum), and BatchNorm running statistics under the 'global' policy (uploaded without clipping or
noise).  Accounting is host-side (:mod:`fedpartial._src.methods.privacy.accountant`); what the
guarantee assumes is in docs/privacy.md.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedpartial._src.core import aggregation, masks
from fedpartial._src.core.errors import UserError
from fedpartial._src.core.structure import leaf_paths
from fedpartial._src.core.types import Carry
from fedpartial._src.methods.base import InitView, Method, MethodContext, MethodState, RoundView
from fedpartial._src.methods.wrappers import Wrapper, wrap


class DpState(NamedTuple):
    """The server's DP state: this round's clipping norm, the noise multiplier (an array, so that runs at
    different ``z`` share one compiled round), the upload counts summed over rounds, the rounds."""

    clip: jax.Array
    noise_multiplier: jax.Array
    uploads: Any  # params-shaped float32: Σ over rounds of how many clients uploaded each element
    rounds: jax.Array


class Clipped(NamedTuple):
    """What a round's ``aggregate`` hands on (:class:`~fedpartial._src.core.types.Carry`): each client's layer
    factors ``[K, L]``, its flat upload norm ``[K]``, and how many clients uploaded each element (params-shaped;
    zeros when there is no noise, whose fixed denominator alone needs the counts)."""

    factors: jax.Array
    norms: jax.Array
    uploads: Any


def count_noise_std(noise_multiplier, clients: int):
    """Adaptive clipping's ``σ_b`` for ``z > 0``: the noise on the count of clients within the norm."""
    return jnp.maximum(clients / 20, noise_multiplier * math.sqrt(10) / 2)


def sum_noise_multiplier(noise_multiplier, count_std):
    """The multiplier ``z_Δ > z`` of the noise on the sum, so that sum and count together cost ``z > 0``."""
    return (noise_multiplier ** -2 - (2 * count_std) ** -2) ** -0.5


def _per_client(values: jax.Array, like: jax.Array) -> jax.Array:
    """``[K]`` values shaped to multiply a ``[K, ...]`` leaf."""
    return values.reshape((-1,) + (1,) * (like.ndim - 1)).astype(like.dtype)


def _layers(ctx: MethodContext, params: Any) -> list[int]:
    return [ctx.structure.role("params", path).layer for path, _ in leaf_paths(params)]


def received_params(view: RoundView) -> Any:
    """``[K, ...]`` the params the server receives: an upload codec's decoded values (``RoundView.uploaded``; DP
    clips what it sums, so the guarantee holds whatever a codec does), else the trained ones."""
    return view.trained_vars["params"] if view.uploaded is None else view.uploaded


def clip_factors(ctx: MethodContext, view: RoundView, clip: jax.Array, per_layer: bool):
    """``(Δ [K, ...], factors [K, L], flat upload norms [K])``: each client's update on what it uploads and
    the multiplier of each of its layers."""
    g = view.global_vars["params"]
    delta = jax.tree.map(lambda t, a: t - a[None], received_params(view), g)
    layers, num_layers = _layers(ctx, g), ctx.structure.num_layers

    def squares(d, upload):  # one client: [L] squared norm of each layer's uploaded update
        m = jax.tree.leaves(masks.expand(ctx.structure, upload, g))
        sums = [jnp.sum(jnp.where(mm, x * x, 0.0)).astype(jnp.float32) for x, mm in zip(jax.tree.leaves(d), m)]
        return jnp.stack([sum((s for s, at in zip(sums, layers) if at == i), jnp.float32(0))
                          for i in range(num_layers)])

    sq = jax.vmap(squares)(delta, view.selection.upload)
    flat = jnp.sqrt(jnp.sum(sq, axis=-1))
    norms, limit = (jnp.sqrt(sq), clip / math.sqrt(num_layers)) if per_layer else (flat[:, None], clip)
    factors = jnp.where(norms > limit, limit / jnp.where(norms > 0, norms, 1.0), 1.0)
    return delta, jnp.broadcast_to(factors, sq.shape), flat


def clipped_aggregate(ctx: MethodContext, view: RoundView, clip: jax.Array, per_layer: bool):
    """Without noise: the engine's aggregation over the clipped models (a model within the norm bit for bit).
    Returns ``(new params, received, factors, norms)``."""
    g = view.global_vars["params"]
    delta, factors, flat = clip_factors(ctx, view, clip, per_layer)
    layers = jax.tree.unflatten(jax.tree.structure(g), _layers(ctx, g))
    models = jax.tree.map(lambda t, a, d, at: jnp.where(_per_client(factors[:, at], d) < 1,
                                                        a[None] + _per_client(factors[:, at], d) * d, t),
                          received_params(view), g, delta, layers)
    new, received = aggregation.aggregate(ctx.structure, {"params": g}, {"params": models},
                                          view.selection.upload, view.selection.weights, ("params",))
    return new["params"], received, factors, flat


def noised_mean(g: Any, total: Any, expected: Any, std: jax.Array, key: jax.Array) -> Any:
    """``g + (Σ m Δ̃ + std·N(0, 1)) / expected`` per element where ``expected > 0``, else ``g``."""
    keys = jax.random.split(key, len(jax.tree.leaves(g)))
    noise = jax.tree.unflatten(jax.tree.structure(g), [jax.random.normal(k, a.shape, a.dtype) for k, a in
                                                      zip(keys, jax.tree.leaves(g))])
    return jax.tree.map(lambda a, s, n, d: jnp.where(d > 0, a + (s + std.astype(a.dtype) * n)
                                                    / jnp.where(d > 0, d, 1.0).astype(a.dtype), a),
                        g, total, noise, expected)


def _checked_noise(clip: float, noise_multiplier: float, target_quantile: float | None) -> float:
    """The noise multiplier ``z`` as a float, once the arguments are known to make sense."""
    z = float(noise_multiplier)
    if not (math.isfinite(z) and z >= 0):
        raise UserError(f"DP-FedAvg: the noise multiplier {noise_multiplier!r} must be a finite number ≥ 0.")
    if not (clip > 0 and (math.isfinite(clip) or z == 0)):
        raise UserError(f"DP-FedAvg: the clipping norm {clip!r} must be > 0, and finite when there is noise.")
    if target_quantile is not None and not (0 < target_quantile < 1 and math.isfinite(clip)):
        raise UserError(f"DP-FedAvg: the target quantile {target_quantile!r} must be in (0, 1), with a finite clip.")
    return z


def dp_fedavg(method: Method, clip: float, noise_multiplier: float, *, per_layer: bool = False,
              target_quantile: float | None = None, clip_lr: float = 0.2) -> Method:
    """``method`` with its clients' updates clipped to ``clip`` and Gaussian noise of std
    ``noise_multiplier · clip`` on their sum, divided by a fixed denominator (module docstring).

    Args:
      method: any method whose server step is the aggregate (no ``server_correct``, no ``aggregate``).
      clip: the L2 norm ``C`` each client's update is clipped to (> 0).
      noise_multiplier: ``z``: the noise's std is ``z·C`` (0: clipping only, no privacy).
      per_layer: clip each layer to ``C/√L`` instead of the whole upload to ``C``.
      target_quantile: adaptive clipping: ``C`` follows this quantile of the update norms (None: fixed ``C``).
      clip_lr: adaptive clipping's step size.

    Returns:
      The private :class:`~fedpartial.Method` (its metrics hold ``dp_clip``, ``dp_clipped_fraction``, ...).

    Raises:
      UserError: a ``clip``, ``noise_multiplier`` or ``target_quantile`` out of range.

    Examples:
      >>> import fedpartial as fp
      >>> fp.dp_fedavg(fp.methods.fedldf(n=4), clip=1.0, noise_multiplier=1.1, per_layer=True).name
      'dp-fedldf'
    """
    z = _checked_noise(clip, noise_multiplier, target_quantile)

    def init(ctx: MethodContext, view: InitView) -> MethodState:
        if view.global_vars.get("batch_stats") and not ctx.batch_statistics:
            raise UserError("differential privacy needs the 'static' BatchNorm policy (--bn-policy static): the "
                            "'global' policy uploads running statistics without clipping or noise.")
        uploads = jax.tree.map(lambda a: jnp.zeros(jnp.shape(a), jnp.float32), view.global_vars["params"])
        return MethodState(server=DpState(jnp.asarray(clip, jnp.float32), jnp.asarray(z, jnp.float32), uploads,
                                          jnp.zeros((), jnp.int32)))

    def noise_stds(ctx: MethodContext, state: DpState):
        """``(z_Δ, σ_b)`` for ``z > 0``: the sum's multiplier and (adaptive clipping) the count's noise."""
        if target_quantile is None:
            return state.noise_multiplier, 0.0
        sigma_b = count_noise_std(state.noise_multiplier, ctx.clients_per_round)
        return sum_noise_multiplier(state.noise_multiplier, sigma_b), sigma_b

    def clipped_sums(ctx: MethodContext, view: RoundView):
        """``(Σ_k m Δ̃, Σ_k m)`` over the clients taking part, and ``(Δ, factors, norms)``."""
        state, sel, g = view.method_state.server, view.selection, view.global_vars["params"]
        delta, factors, flat = clip_factors(ctx, view, state.clip, per_layer)
        clipped = jax.tree.map(lambda d, at: d * _per_client(factors[:, at], d), delta,
                               jax.tree.unflatten(jax.tree.structure(g), _layers(ctx, g)))
        taking_part = (view.cohort.valid & (sel.weights > 0)).astype(jnp.float32)
        expand = lambda k: masks.expand(ctx.structure, jax.tree.map(lambda a: a[k], sel.upload), g)  # noqa: E731
        return aggregation.weighted_sums(clipped, taking_part, client_masks=expand), (delta, factors, flat)

    def aggregate(ctx: MethodContext, view: RoundView, inner_result: None) -> Carry:
        """The new params and where they moved, carrying the round's :class:`Clipped` to ``update`` and ``metrics``."""
        g, state = view.global_vars["params"], view.method_state.server
        if z == 0:  # no privacy: the engine's formula over the clipped models (within the norm: bit for bit)
            new, received, factors, flat = clipped_aggregate(ctx, view, state.clip, per_layer)
            # the denominator is not used: no counts to keep
            return Carry((new, received), Clipped(factors, flat, jax.tree.map(jnp.zeros_like, state.uploads)))
        (total, count), (_, factors, flat) = clipped_sums(ctx, view)
        expected = jax.tree.map(lambda u, c: (u + c) / (state.rounds + 1).astype(jnp.float32), state.uploads, count)
        new = noised_mean(g, total, expected, noise_stds(ctx, state)[0] * state.clip, view.key)
        return Carry((new, jax.tree.map(lambda d: d > 0, expected)), Clipped(factors, flat, count))

    def update(ctx: MethodContext, view: RoundView, inner_state: MethodState) -> MethodState:
        state, clipped = view.method_state.server, view.carried["aggregate"]
        clip_next = state.clip
        if target_quantile is not None:
            within = jnp.sum((view.cohort.valid & (view.selection.weights > 0) & (clipped.norms <= state.clip)))
            count_std = noise_stds(ctx, state)[1] if z else 0.0
            noisy = (within + count_std * jax.random.normal(jax.random.fold_in(view.key, 0xD9), ())) \
                / ctx.clients_per_round
            clip_next = state.clip * jnp.exp(-clip_lr * (noisy - target_quantile))
        dp = state._replace(clip=clip_next, uploads=jax.tree.map(jnp.add, state.uploads, clipped.uploads),
                            rounds=state.rounds + 1)
        return MethodState(server=dp)

    def metrics(ctx: MethodContext, view: RoundView, inner: dict | None) -> dict:
        state, factors = view.method_state.server, view.carried["aggregate"].factors
        clip_now = state.clip
        taking_part = view.cohort.valid & (view.selection.weights > 0)
        clipped = jnp.sum(taking_part & jnp.any(factors < 1, axis=-1)) / jnp.maximum(jnp.sum(taking_part), 1)
        return {**(inner or {}), "dp_clip": clip_now, "dp_clipped_fraction": clipped,
                "dp_noise_std": noise_stds(ctx, state)[0] * clip_now if z else jnp.zeros((), jnp.float32)}

    return wrap(method, Wrapper(
        lambda inner: f"dp-{inner}", init=init, hooks={"aggregate": aggregate, "update": update, "metrics": metrics},
        capabilities=lambda caps: caps._replace(streamable=None), label="DP-FedAvg",
        refuses={"server_correct": "its server step reads every client's update outside the clipped, noised sum",
                 "rewrite_global": "it rewrites the global model from every client's update, outside the clipped, "
                                   "noised sum",
                 "aggregate": "it aggregates its own way, and DP-FedAvg replaces the aggregation by the clipped, "
                              "noised sum"}))
