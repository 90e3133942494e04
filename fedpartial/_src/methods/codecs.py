"""Upload codecs: what a client sends of its update, compressed — top-k with error feedback, QSGD, scaled sign.

``upload_codec(method, codec)`` wraps any method by the one composition rule
(:mod:`fedpartial._src.methods.wrappers`): its ``encode`` hook hands the server, for each client, the global
model plus the *decoded* update, which the engine's aggregation (or DP-FedAvg's) reads as
``RoundView.uploaded``; everything else is the method's.  ``--upload-codec topk:0.1 | qsgd:8 | sign`` applies
one to any method from the command line.

Decisions:

* **What is compressed**: client ``k``'s update ``Δ_k = θ_k − θ^t`` on the elements it uploads (its upload
  mask), each parameter tensor on its own (per-tensor codecs, as the papers').  BatchNorm running statistics
  (the 'global' policy) travel uncompressed; downloads are not compressed.
* **top-k** (``topk:F``, F in (0, 1]), with error feedback (Stich et al. 2018): ``a = Δ_k + e_k``; the
  ``⌈F·n⌉`` entries of largest ``|a|`` among the ``n`` uploaded ones are sent (ties to the lower index) and
  ``e_k ← a − sent`` on the uploaded elements (per-client state, ``[N, params]``; elements not uploaded keep
  theirs).  Bits: 32 a value plus the positions — a bitmap of the tensor or 32-bit indices, whichever is
  smaller.
* **QSGD** (``qsgd:B``, B ≥ 2 bits; Alistarh et al. 2017) with ``s = 2^(B−1) − 1`` levels: an uploaded entry
  ``x`` is sent as ``‖Δ‖₂ · sign(x) · ξ / s``, ``ξ`` the stochastic rounding of ``s·|x| / ‖Δ‖₂``, so the
  decoded update is unbiased; no error feedback.  Bits: B an uploaded entry (a sign bit, B − 1 for the level)
  plus 32 for the tensor's norm.
* **sign** (EF-SignSGD, Karimireddy et al. 2019): ``a = Δ_k + e_k``; ``sent = (‖a‖₁ / n) · sign(a)`` on the
  ``n`` uploaded entries; ``e_k ← a − sent``.  Bits: 1 an uploaded entry plus 32 for the scale.
* **Traffic** counts these bits per layer, rounded up to whole bytes per client and layer; it replaces the
  method's own upload count (``Selection.upload_bytes_per_layer``).
* **With DP-FedAvg** (``--dp-clip``) the codec runs first: DP clips what the server receives (the decoded
  update) and noises their sum, so the clip bounds exactly what is summed and the privacy guarantee holds
  whatever a codec does (QSGD's stochastic rounding can lengthen a vector: clipping before encoding would not
  bound what is sent).  Error feedback then keeps what the codec dropped, not what clipping removed.
* The error-feedback residual ``a − sent`` is computed once, in ``encode``, and handed to ``update``
  (:class:`~fedpartial._src.core.types.Carry`).  One codec a method: wrapping a method that already encodes
  is refused.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from fedpartial._src.core import masks
from fedpartial._src.core.errors import UserError
from fedpartial._src.core.structure import leaf_paths
from fedpartial._src.methods.base import (
    Carry,
    InitView,
    Method,
    MethodContext,
    MethodState,
    RoundView,
    Selection,
    cohort_rows,
    scatter_clients,
)
from fedpartial._src.methods.wrappers import Wrapper, wrap

CODECS = "topk:F (F in (0, 1]), qsgd:B (B ≥ 2 bits) or sign"


class Codec(NamedTuple):
    """A per-tensor codec: ``encode(key, x [n], on [n]) -> sent [n]`` (0 off the uploaded entries),
    ``bits(size, uploaded) -> bits sent`` (``uploaded`` an int32 array), and whether it keeps error feedback."""

    name: str
    encode: Callable[[jax.Array, jax.Array, jax.Array], jax.Array]
    bits: Callable[[int, jax.Array], jax.Array]
    feedback: bool


def _kept(fraction: float, n: jax.Array) -> jax.Array:
    """``⌈F·n⌉`` (with slack, so that 0.1 · 10 in float32 keeps 1 and not 2)."""
    return jnp.ceil(fraction * n.astype(jnp.float32) - 1e-4).astype(jnp.int32)


def topk(fraction: float) -> Codec:
    if not 0 < fraction <= 1:
        raise UserError(f"--upload-codec topk:{fraction:g}: the fraction must be in (0, 1].")

    def encode(key, x, on):
        order = jnp.argsort(jnp.where(on, -jnp.abs(x), jnp.inf), stable=True)  # uploaded, largest first
        rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0]))
        return jnp.where(on & (rank < _kept(fraction, jnp.sum(on))), x, 0.0)

    def bits(size, uploaded):
        k = _kept(fraction, uploaded)
        return 32 * k + jnp.where(k > 0, jnp.minimum(size, 32 * k), 0)

    return Codec(f"topk{fraction:g}", encode, bits, feedback=True)


def qsgd(bits_per_entry: int) -> Codec:
    if not (isinstance(bits_per_entry, int) and 2 <= bits_per_entry <= 16):
        raise UserError(f"--upload-codec qsgd:{bits_per_entry}: the bits must be a whole number from 2 to 16.")
    levels = 2 ** (bits_per_entry - 1) - 1

    def encode(key, x, on):
        x = jnp.where(on, x, 0.0)
        norm = jnp.sqrt(jnp.sum(x * x))
        level = levels * jnp.abs(x) / jnp.where(norm > 0, norm, 1.0)
        low = jnp.floor(level)
        xi = low + (jax.random.uniform(key, x.shape) < level - low)
        return jnp.where(on, norm * jnp.sign(x) * xi / levels, 0.0)

    def bits(size, uploaded):
        return jnp.where(uploaded > 0, bits_per_entry * uploaded + 32, 0)

    return Codec(f"qsgd{bits_per_entry}", encode, bits, feedback=False)


def sign() -> Codec:
    def encode(key, x, on):
        scale = jnp.sum(jnp.where(on, jnp.abs(x), 0.0)) / jnp.maximum(jnp.sum(on), 1)
        return jnp.where(on, scale * jnp.sign(x), 0.0)

    def bits(size, uploaded):
        return jnp.where(uploaded > 0, uploaded + 32, 0)

    return Codec("sign", encode, bits, feedback=True)


def parse_codec(text: str) -> Codec:
    """``topk:0.1``, ``qsgd:8`` or ``sign``; anything else is one sentence."""
    name, _, value = str(text).partition(":")
    kinds = {"topk": float, "qsgd": int}
    if name in kinds and value:
        try:
            number = kinds[name](value)
        except ValueError:
            number = None
        if number is not None:  # the codec checks its own range (one sentence)
            return topk(number) if name == "topk" else qsgd(number)
    if name == "sign" and not value:
        return sign()
    raise UserError(f"--upload-codec {text!r} is not a codec; use {CODECS}.")


def upload_codec(method: Method, codec: Codec | str) -> Method:
    """``method`` whose clients send their update through ``codec`` (module docstring).

    Args:
      method: any method without an ``encode`` hook of its own.
      codec: a codec or its ``--upload-codec`` name (e.g. ``topk:0.1``).

    Returns:
      The wrapped :class:`~fedpartial.Method`.
    """
    codec = parse_codec(codec) if isinstance(codec, str) else codec

    def updates(ctx: MethodContext, view: RoundView):
        """``(a = Δ + e [K, ...], uploaded elements [K, ...])``: what the codec compresses, and where."""
        g = view.global_vars["params"]
        on = jax.vmap(lambda m: masks.expand(ctx.structure, m, g))(view.selection.upload)
        a = jax.tree.map(lambda t, a: t - a[None], view.trained_vars["params"], g)
        if codec.feedback:
            a = jax.tree.map(jnp.add, a, view.client_state)
        return a, on

    def init(ctx: MethodContext, view: InitView) -> MethodState:
        if not codec.feedback:
            return MethodState()
        return MethodState(clients=jax.tree.map(lambda p: jnp.zeros((ctx.num_clients, *jnp.shape(p)), jnp.float32),
                                                view.global_vars["params"]))

    def encode(ctx: MethodContext, view: RoundView, inner: None):
        a, on = updates(ctx, view)
        keys = jax.vmap(lambda i: jax.random.fold_in(view.key, i))(view.cohort.client_ids)

        def one(key, a_k, on_k):
            leaves = [codec.encode(jax.random.fold_in(key, i), x.reshape(-1).astype(jnp.float32),
                                   m.reshape(-1)).reshape(x.shape).astype(x.dtype)
                      for i, (x, m) in enumerate(zip(jax.tree.leaves(a_k), jax.tree.leaves(on_k)))]
            return jax.tree.unflatten(jax.tree.structure(a_k), leaves)

        sent = jax.vmap(one)(keys, a, on)
        g, valid = view.global_vars["params"], view.cohort.valid
        uploaded = jax.tree.map(lambda s, p, t, m: jnp.where(m, p[None] + s, t), sent, g, view.trained_vars["params"],
                                on)
        if not codec.feedback:
            return uploaded
        # what the codec left out, handed on to update (Carry): e ← a − sent where the client uploaded
        residual = jax.tree.map(lambda x, s, m, e: jnp.where(m & valid.reshape((-1,) + (1,) * (x.ndim - 1)), x - s, e),
                                a, sent, on, view.client_state)
        return Carry(uploaded, residual)

    def update(ctx: MethodContext, view: RoundView, inner_state: MethodState) -> MethodState:
        return view.method_state._replace(clients=scatter_clients(
            view.method_state.clients, cohort_rows(view), view.carried["encode"], view.cohort.valid))

    def select(ctx: MethodContext, view: RoundView, sel: Selection) -> Selection:
        g = view.global_vars["params"]
        layers = [ctx.structure.role("params", path).layer for path, _ in leaf_paths(g)]
        on = jax.vmap(lambda m: masks.expand(ctx.structure, m, g))(sel.upload)
        per_layer = [jnp.zeros(sel.weights.shape, jnp.int32) for _ in range(ctx.structure.num_layers)]
        for layer, leaf, m in zip(layers, jax.tree.leaves(g), jax.tree.leaves(on)):
            uploaded = jnp.sum(m.reshape(m.shape[0], -1), axis=1, dtype=jnp.int32)
            per_layer[layer] = per_layer[layer] + codec.bits(math.prod(jnp.shape(leaf)), uploaded)
        sent = (jnp.stack(per_layer, axis=-1) + 7) // 8
        if not ctx.batch_statistics and view.global_vars.get("batch_stats"):  # running statistics, uncompressed
            sent = sent + masks.count_bytes_per_layer(ctx.structure, sel.upload, view.global_vars, ("batch_stats",))
        return sel._replace(upload_bytes_per_layer=jnp.where(view.cohort.valid[:, None], sent, 0))

    hooks = {"encode": encode, "select": select, **({"update": update} if codec.feedback else {})}
    return wrap(method, Wrapper(
        lambda inner: f"{inner}+{codec.name}", init=init, hooks=hooks, label=f"upload codec {codec.name}",
        capabilities=lambda caps: caps._replace(streamable=None, asynchronous=False),
        refuses={"encode": "it already encodes its uploads (one codec a method)"}))
