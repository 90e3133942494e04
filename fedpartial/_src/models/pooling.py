"""Max pooling over non-overlapping windows, as elementwise work over strided slices.

``nn.max_pool(x, w, w, "VALID")`` is XLA's ``reduce_window``, and its gradient a ``select_and_scatter``: on
XLA:CPU the two took about 40 % of a small CNN's SGD step, and scaled poorly when clients train side by side, one
per core.  Here the forward pass is the elementwise maximum of the window's ``h·w`` strided slices, and the
derivative (a :func:`jax.custom_jvp`) passes the tangent of each window's first largest element, the element
``select_and_scatter`` chooses: differentiated, the forward pass records that element's place in the window (one
small integer an output), and the backward pass, the JVP's transpose, is one elementwise select over the input's
shape.  XLA fuses each with the ReLU around it, without transposes.  The peer benchmark's CNN (batch 32 of
28×28, a client on each of 2 cores): 9.9 ms a step with ``nn.max_pool``, 6.3 ms with this (6.7 ms with an earlier
version that moved each window to a trailing axis; ``docs/decisions.md``).  Values and gradients are those of
``nn.max_pool`` bit for bit, ties included; being a JVP rule, it also takes forward-mode derivatives
(Hessian-vector products) and ``vmap``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax


def _taps(x: jax.Array, window: tuple[int, int]) -> list[jax.Array]:
    """``x [..., H, W, C]``'s ``h·w`` strided slices ``[..., H // h, W // w, C]``, one per place in a window
    (row-major); the rows and columns past the last whole window are left out, as 'VALID' pooling does."""
    h, w = window
    *lead, height, width, channels = x.shape
    rows, cols, n = height // h, width // w, len(lead)
    return [lax.slice(x, (0,) * n + (i, j, 0), (*lead, i + (rows - 1) * h + 1, j + (cols - 1) * w + 1, channels),
                      (1,) * n + (h, w, 1)) for i in range(h) for j in range(w)]


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _max_pool(x: jax.Array, window: tuple[int, int]) -> jax.Array:
    return functools.reduce(jnp.maximum, _taps(x, window))


@_max_pool.defjvp
def _max_pool_jvp(window, primals, tangents):
    (x,), (t,) = primals, tangents
    h, w = window
    largest = _max_pool(x, window)  # itself: a second derivative keeps the first-element rule
    # select_and_scatter's choice, each window's first largest element (or first NaN, as argmax): its place
    small = jnp.int8 if h * w <= 127 else jnp.int32
    first = jnp.zeros(largest.shape, small)
    for place, tap in reversed(list(enumerate(_taps(x, window)))):
        first = jnp.where((tap == largest) | (tap != tap), small(place), first)
    # the tangent at that place: a reshape (no transpose) and a masked sum over the window's two axes, whose
    # transpose is one select over x's shape
    *lead, height, width, channels = t.shape
    rows, cols, n = height // h, width // w, len(lead)
    windows = t[..., :rows * h, :cols * w, :].reshape(*lead, rows, h, cols, w, channels)
    shape = (1,) * (n + 1) + (h, 1, w, 1)
    places = lax.broadcasted_iota(small, shape, n + 1) * w + lax.broadcasted_iota(small, shape, n + 3)
    chosen = jnp.expand_dims(first, (n + 1, n + 3)) == places
    return largest, jnp.sum(jnp.where(chosen, windows, jnp.zeros((), t.dtype)), axis=(n + 1, n + 3))


def max_pool(x: jax.Array, window: tuple[int, int] = (2, 2)) -> jax.Array:
    """``nn.max_pool(x, window, strides=window, padding="VALID")`` for ``x [batch..., H, W, C]``: the largest
    element of each non-overlapping ``window``, as elementwise work over strided slices (the module docstring
    says why); equal to it bit for bit, gradients included."""
    return _max_pool(x, tuple(window))
