"""How a convolution is lowered: the same ``nn.Conv`` (same parameters, same result) computed one of several ways.

A cohort's local step is one client's step ``vmap``-ped over the clients, each with its own weights; XLA
lowers a vmapped convolution to a *grouped* convolution, which XLA:CPU (and, less so, GPUs) runs far below the
chip's matmul rate.  A *lowering* is a drop-in for ``lax.conv_general_dilated`` that a Flax ``nn.Conv`` takes
as its ``conv_general_dilated`` argument (:func:`lowering`); the parameters, their names and shapes, and the
result (within float32 rounding) do not change:

* ``"lax"`` — ``lax.conv_general_dilated`` itself (grouped when vmapped): the default.
* ``"im2col"`` — the image's patches (one strided slice per kernel tap, concatenated) times the kernel as a
  matrix: a vmapped conv with per-client weights is then a *batched* matrix product, and its gradient too.
* ``"hybrid"`` — ``lax`` for one client; under ``vmap`` (a cohort) im2col's batched matrix product where each
  client has its own weights, and one ordinary convolution over all clients' examples where they share them
  (``jax.custom_batching.custom_vmap``, inside a ``jax.custom_vjp`` so the gradient is batched the same way).
* ``"mapped"`` — ``lax`` for one client, with its two gradients written as ordinary channels-last convolutions
  (inside a loop — ``lax.scan`` over local steps, ``lax.map`` over clients — XLA:CPU runs autodiff's own
  15-40x slower); under ``vmap`` with per-client weights a ``lax.map`` loop over the clients, so the fused
  round one client at a time (``fused:1``) runs each client's convolutions as the plain loop does.

:data:`CONV_IMPLS` names them; ``auto`` (:mod:`fedpartial._src.engine.conv_choice`) times them.  A user's Flax
model takes one argument: ``nn.Conv(32, (5, 5), conv_general_dilated=fedpartial.models.conv_lowering("im2col"))``.
Only channels-last layouts (``NHWC``/``HWIO``, as ``nn.Conv`` uses) without input dilation are rewritten; any
other call falls back to ``lax.conv_general_dilated``.

On a CPU, ``hybrid``'s and ``mapped``'s own convolutions (one client's forward, ``mapped``'s two gradients) of at
most 16 input and output features — a first layer on grey or RGB images, say ``nn.Conv(16)`` — widen the kernel
with zero output features to 32 and slice the result: XLA:CPU hands a convolution to YNNPACK only above 16
features and runs a smaller one on Eigen's kernels, which took 4x the time with a client on each core.  The sums
are the same, in YNNPACK's order, so the result is lax's within float32 rounding, not bit for bit; an
accelerator's lowering is left alone (``lax.platform_dependent``).
"""

from __future__ import annotations

import functools
import itertools
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

from fedpartial._src.core.errors import UserError

__all__ = ["CONV_IMPLS", "check_conv_impl", "im2col_conv", "hybrid_conv", "mapped_conv", "lowering"]

#: the lowerings, in the order ``auto`` tries them (``lax`` first: ties go to the default)
CONV_IMPLS = ("lax", "im2col", "hybrid", "mapped")


def check_conv_impl(impl: str, allowed: tuple[str, ...] = CONV_IMPLS) -> str:
    """``impl`` if it names a lowering, else a :class:`UserError` in one sentence."""
    if impl not in allowed:
        raise UserError(f"convolution lowering {impl!r} is unknown; use one of {', '.join(allowed)}.")
    return impl


def _spec(lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
          feature_group_count, batch_group_count):
    """The static description of a channels-last convolution im2col can compute, or None (use lax)."""
    nd = lhs.ndim - 2
    if nd < 1 or batch_group_count != 1 or any(d != 1 for d in (lhs_dilation or (1,) * nd)):
        return None
    channels_last = lax.conv_dimension_numbers(
        lhs.shape, rhs.shape, ("N" + "HWD"[:nd] + "C", "HWD"[:nd] + "IO", "N" + "HWD"[:nd] + "C"))
    if dimension_numbers is None or lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers) \
            != channels_last:
        return None
    kernel = tuple(rhs.shape[:nd])
    dilation = tuple(rhs_dilation or (1,) * nd)
    strides = tuple(window_strides)
    dilated = tuple((k - 1) * d + 1 for k, d in zip(kernel, dilation))
    if isinstance(padding, str):
        pads = lax.padtype_to_pads(lhs.shape[1:-1], dilated, strides, padding)
    else:
        pads = padding
    pads = tuple((int(lo), int(hi)) for lo, hi in pads)
    return kernel, dilation, strides, pads, int(feature_group_count)


def _patches(x, kernel, dilation, strides, pads):
    """``[N, *out, taps, C]``: for every output pixel, the input pixels under each kernel tap (row-major taps)."""
    x = jnp.pad(x, ((0, 0), *pads, (0, 0)))
    spatial = x.shape[1:-1]
    out = tuple((s - ((k - 1) * d + 1)) // st + 1 for s, k, d, st in zip(spatial, kernel, dilation, strides))
    taps = []
    for tap in itertools.product(*(range(k) for k in kernel)):
        start = (0, *(t * d for t, d in zip(tap, dilation)), 0)
        limit = (x.shape[0], *(b + (o - 1) * st + 1 for b, o, st in zip(start[1:-1], out, strides)), x.shape[-1])
        taps.append(lax.slice(x, start, limit, (1, *strides, 1)))
    return jnp.stack(taps, axis=-2)


def _im2col(x, w, spec, precision=None, preferred_element_type=None):
    kernel, dilation, strides, pads, groups = spec
    p = _patches(x, kernel, dilation, strides, pads)  # [N, *out, T, C]
    t, c_in, c_out = p.shape[-2], w.shape[-2], w.shape[-1]
    if groups == 1:
        p = p.reshape((*p.shape[:-2], t * c_in))
        return jnp.matmul(p, w.reshape((t * c_in, c_out)), precision=precision,
                          preferred_element_type=preferred_element_type)
    p = p.reshape((*p.shape[:-1], groups, c_in))  # input channels group-major, as lax groups them
    wg = w.reshape((t, c_in, groups, c_out // groups))
    y = jnp.einsum("...tgc,tcgo->...go", p, wg, precision=precision, preferred_element_type=preferred_element_type)
    return y.reshape((*y.shape[:-2], c_out))


def _lax(x, w, spec, precision=None, preferred_element_type=None):
    kernel, dilation, strides, pads, groups = spec
    if groups == 1 and preferred_element_type is None:
        return _channels_last_conv(x, w, strides, pads, None, dilation, precision)
    nd = len(kernel)
    dn = lax.conv_dimension_numbers(x.shape, w.shape, ("N" + "HWD"[:nd] + "C", "HWD"[:nd] + "IO",
                                                       "N" + "HWD"[:nd] + "C"))
    return lax.conv_general_dilated(x, w, strides, pads, rhs_dilation=dilation, dimension_numbers=dn,
                                    feature_group_count=groups, precision=precision,
                                    preferred_element_type=preferred_element_type)


#: XLA:CPU hands a float32 2-D convolution to YNNPACK only when it has more than 16 input or output features;
#: a smaller one runs on Eigen's kernels, which took 4x the time side by side (a client on each core:
#: ``docs/decisions.md``).  On a CPU such a convolution's kernel gets zero output features up to
#: ``_PADDED_FEATURES`` (the width YNNPACK ran fastest) and the result is sliced back: the same sums, in
#: YNNPACK's order (within float32 rounding of Eigen's).
_SMALL_FEATURES, _PADDED_FEATURES = 16, 32
#: measured with jax 0.10, whose XLA:CPU has YNNPACK fusions; on an older one every convolution ran on Eigen,
#: where widening would only add work, so it is left alone there
_WIDENS = tuple(map(int, re.match(r"(\d+)\.(\d+)", jax.__version__).groups())) >= (0, 10)


def _runs_small_on_eigen(lhs_shape, kernel_shape, strides, pads, lhs_dilation, dtype) -> bool:
    """Whether XLA:CPU runs this channels-last convolution on Eigen's kernels only for its few features (and on
    YNNPACK's with more output features): 2-D, float32, no input dilation, the output and the (dilated) kernel no
    larger than the input, at most ``_SMALL_FEATURES`` input and output features."""
    if not _WIDENS or len(lhs_shape) != 4 or dtype != jnp.float32 or any(d != 1 for d in (lhs_dilation or (1, 1))):
        return False
    if max(lhs_shape[-1], kernel_shape[-1]) > _SMALL_FEATURES:
        return False
    return all(k <= n and (n + lo + hi - k) // s + 1 <= n
               for n, k, s, (lo, hi) in zip(lhs_shape[1:3], kernel_shape[:2], strides, pads))


def _channels_last_conv(lhs, rhs, strides, pads, lhs_dilation, rhs_dilation, precision):
    """``lax.conv_general_dilated`` of an ``N...C`` input and a ``...IO`` kernel (no feature groups); on a CPU, a
    convolution XLA would run on Eigen's kernels for its few features gets its kernel widened to YNNPACK's."""
    nd = lhs.ndim - 2
    dn = lax.conv_dimension_numbers(lhs.shape, rhs.shape, ("N" + "HWD"[:nd] + "C", "HWD"[:nd] + "IO",
                                                           "N" + "HWD"[:nd] + "C"))
    conv = functools.partial(lax.conv_general_dilated, window_strides=strides, padding=pads,
                             lhs_dilation=lhs_dilation, rhs_dilation=rhs_dilation, dimension_numbers=dn,
                             precision=precision)
    spans = tuple((k - 1) * d + 1 for k, d in zip(rhs.shape[:nd], rhs_dilation or (1,) * nd))
    dtype = jnp.result_type(lhs, rhs)
    if not _runs_small_on_eigen(lhs.shape, (*spans, *rhs.shape[nd:]), strides, pads, lhs_dilation, dtype):
        return conv(lhs, rhs)
    features = rhs.shape[-1]

    def widened(a, b):
        return conv(a, jnp.pad(b, [(0, 0)] * (b.ndim - 1) + [(0, _PADDED_FEATURES - features)]))[..., :features]

    return lax.platform_dependent(lhs, rhs, cpu=widened, default=conv)


def _conv_args(lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None, dimension_numbers=None,
               feature_group_count=1, batch_group_count=1, precision=None, preferred_element_type=None):
    spec = _spec(lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
                 feature_group_count, batch_group_count)
    fallback = functools.partial(lax.conv_general_dilated, lhs, rhs, window_strides, padding, lhs_dilation,
                                 rhs_dilation, dimension_numbers, feature_group_count, batch_group_count, precision,
                                 preferred_element_type)
    return spec, fallback


def im2col_conv(lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None, dimension_numbers=None,
                feature_group_count=1, batch_group_count=1, precision=None, preferred_element_type=None):
    """``lax.conv_general_dilated``'s result as patches times a matrix (same signature)."""
    spec, fallback = _conv_args(lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
                                feature_group_count, batch_group_count, precision, preferred_element_type)
    if spec is None:
        return fallback()
    return _im2col(lhs, rhs, spec, precision, preferred_element_type)


# ---- hybrid and mapped: lax for one client, their own way across a cohort ----------------------------------


def _broadcast(a, batched: bool, size: int):
    return a if batched else jnp.broadcast_to(a, (size, *a.shape))


def _conv_grads(x, w, g, spec, precision=None):
    """The gradients of ``_lax(x, w)`` given the output's gradient ``g``, as two channels-last convolutions.

    What autodiff emits computes the same, but with batch and feature dimensions swapped in its dimension
    numbers; XLA:CPU relayouts those at the top of a program but inside a loop (``lax.scan`` over local steps,
    ``lax.map`` over clients) runs them 15-40x slower.  Here the transposes are explicit, so both are ordinary
    ``NHWC x HWIO`` convolutions wherever they run.  Feature groups fall back to autodiff's.
    """
    kernel, dilation, strides, pads, groups = spec
    if groups != 1:
        return jax.vjp(lambda a, b: _lax(a, b, spec, precision), x, w)[1](g)
    nd = len(kernel)
    span = [(k - 1) * d + 1 for k, d in zip(kernel, dilation)]
    sizes, outs = x.shape[1:-1], g.shape[1:-1]
    # input: the output gradient spread by the strides, convolved with the flipped kernel (in and out swapped)
    flipped = jnp.swapaxes(jnp.flip(w, tuple(range(nd))), -1, -2)
    pads_x = [(sp - 1 - lo, n - ((o - 1) * st + 1) + lo) for sp, (lo, _), n, o, st in
              zip(span, pads, sizes, outs, strides)]
    gx = _channels_last_conv(g, flipped, (1,) * nd, pads_x, strides, dilation, precision)
    # kernel: input channels as the batch, examples as the features, the output gradient as the kernel
    lhs, rhs = jnp.moveaxis(x, (0, -1), (-1, 0)), jnp.moveaxis(g, 0, -2)
    pads_w = [(lo, sp + (o - 1) * st - n - lo) for sp, (lo, _), n, o, st in zip(span, pads, sizes, outs, strides)]
    gw = _channels_last_conv(lhs, rhs, dilation, pads_w, None, strides, precision)
    return gx.astype(x.dtype), jnp.moveaxis(gw, 0, -2).astype(w.dtype)


#: how ``hybrid`` and ``mapped`` differ: one client's gradients, and the forward and backward across clients
#: with per-client weights (``vmap`` of im2col: a batched GEMM; ``lax.map`` of the one-client function: a loop)
_ACROSS = {"hybrid": "im2col", "mapped": "loop"}


@functools.lru_cache(maxsize=None)
def _custom_conv(kind: str, spec, precision) -> Callable:
    """The convolution of one static ``spec``: lax's for one client, with batching rules for forward and
    backward (``jax.custom_batching.custom_vmap`` inside a ``jax.custom_vjp``, whose reverse mode it lacks)."""
    looped = _ACROSS[kind] == "loop"

    @jax.custom_batching.custom_vmap
    def forward(x, w):
        return _lax(x, w, spec, precision)

    @forward.def_vmap
    def _(axis_size, in_batched, x, w):
        xb, wb = in_batched
        x = _broadcast(x, xb, axis_size)
        if not wb:  # shared weights: the clients' examples are one batch of an ordinary conv
            y = forward(x.reshape((-1, *x.shape[2:])), w)
            return y.reshape((axis_size, x.shape[1], *y.shape[1:])), True
        if looped:  # the body calls `forward`: nested vmaps (replicas of cohorts) loop again
            return lax.map(lambda a: forward(*a), (x, w)), True
        return jax.vmap(lambda a, b: _im2col(a, b, spec, precision))(x, w), True

    @jax.custom_batching.custom_vmap
    def backward(x, w, g):
        if looped:
            return _conv_grads(x, w, g, spec, precision)
        return jax.vjp(lambda a, b: _lax(a, b, spec, precision), x, w)[1](g)

    @backward.def_vmap
    def _(axis_size, in_batched, x, w, g):
        x, w, g = (_broadcast(a, b, axis_size) for a, b in zip((x, w, g), in_batched))
        if looped:
            return lax.map(lambda a: backward(*a), (x, w, g)), (True, True)
        one = lambda a, b, c: jax.vjp(lambda u, v: _im2col(u, v, spec, precision), a, b)[1](c)  # noqa: E731
        return jax.vmap(one)(x, w, g), (True, True)

    @jax.custom_vjp
    def conv(x, w):
        return forward(x, w)

    conv.defvjp(lambda x, w: (forward(x, w), (x, w)), lambda res, g: backward(*res, g))
    return conv


def _custom_lowering(kind: str, doc: str) -> Callable:
    def conv(lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None, dimension_numbers=None,
             feature_group_count=1, batch_group_count=1, precision=None, preferred_element_type=None):
        spec, fallback = _conv_args(lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation,
                                    dimension_numbers, feature_group_count, batch_group_count, precision,
                                    preferred_element_type)
        if spec is None or preferred_element_type is not None:
            return fallback()
        return _custom_conv(kind, spec, precision)(lhs, rhs)

    conv.__name__ = conv.__qualname__ = f"{kind}_conv"
    conv.__doc__ = doc
    return conv


hybrid_conv = _custom_lowering("hybrid", "``lax.conv_general_dilated`` for one client; under ``vmap``, im2col's "
                                         "batched GEMM (same signature).")
mapped_conv = _custom_lowering("mapped", "``lax.conv_general_dilated`` for one client, its gradients as ordinary "
                                         "convolutions; under ``vmap``, a loop over the clients (same signature).")


_LOWERINGS: dict[str, Any] = {"lax": None, "im2col": im2col_conv, "hybrid": hybrid_conv, "mapped": mapped_conv}


def lowering(impl: str = "lax") -> Callable | None:
    """What ``nn.Conv(..., conv_general_dilated=lowering(impl))`` takes for lowering ``impl``.

    Args:
      impl: ``lax`` (XLA's convolution; grouped when vmapped over clients), ``im2col`` (patches and a matrix
        product; a batched GEMM under vmap), ``hybrid`` (lax for one client, im2col across clients) or
        ``mapped`` (lax for one client with its gradients as ordinary convolutions, a loop across clients).

    Returns:
      The convolution function, or None for ``"lax"``: Flax's own default, so the module is exactly the plain
      ``nn.Conv``.

    Raises:
      UserError: ``impl`` is not one of :data:`CONV_IMPLS`.
    """
    return _LOWERINGS[check_conv_impl(impl)]
