"""Max pooling over non-overlapping windows, as a reduction over reshaped windows.

``nn.max_pool(x, w, w, "VALID")`` is XLA's ``reduce_window``, and its gradient a ``select_and_scatter``: on
XLA:CPU the two took about 40 % of a small CNN's SGD step, and scaled poorly when clients train side by side, one
per core (the peer benchmark's CNN, batch 32 of 28×28: 7.6 ms a step alone, 10.4 ms with a client on
the other core; with :func:`max_pool`, 5.7 and 6.6 ms; ``docs/decisions.md``).  Here each window is a trailing axis
of a reshape: the forward pass is a ``max`` over it, and the derivative (a :func:`jax.custom_jvp`) passes the
tangent of each window's first largest element, the element ``select_and_scatter`` chooses.  Values and gradients
are those of ``nn.max_pool`` bit for bit, ties included; being a JVP rule, it also takes forward-mode derivatives
(Hessian-vector products) and ``vmap``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _windows(x: jax.Array, window: tuple[int, int]) -> jax.Array:
    """``x [..., H, W, C]`` as ``[..., H // h, W // w, C, h·w]``, each window's elements in row-major order (the
    rows and columns past the last whole window left out, as 'VALID' pooling does)."""
    h, w = window
    *lead, height, width, channels = x.shape
    rows, cols = height // h, width // w
    x = x[..., :rows * h, :cols * w, :].reshape(*lead, rows, h, cols, w, channels)
    n = len(lead)
    order = (*range(n), n, n + 2, n + 4, n + 1, n + 3)
    return x.transpose(order).reshape(*lead, rows, cols, channels, h * w)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _max_pool(x: jax.Array, window: tuple[int, int]) -> jax.Array:
    return jnp.max(_windows(x, window), axis=-1)


@_max_pool.defjvp
def _max_pool_jvp(window, primals, tangents):
    (x,), (t,) = primals, tangents
    win = _windows(x, window)
    # select_and_scatter's choice: each window's first largest element
    first = jnp.argmax(win, axis=-1, keepdims=True) == jax.lax.broadcasted_iota(jnp.int32, win.shape, win.ndim - 1)
    return (jnp.max(win, axis=-1),
            jnp.sum(jnp.where(first, _windows(t, window), jnp.zeros((), t.dtype)), axis=-1))


def max_pool(x: jax.Array, window: tuple[int, int] = (2, 2)) -> jax.Array:
    """``nn.max_pool(x, window, strides=window, padding="VALID")`` for ``x [batch..., H, W, C]``: the largest
    element of each non-overlapping ``window``, as a reduction over reshaped windows (the module docstring says
    why); equal to it bit for bit, gradients included."""
    return _max_pool(x, tuple(window))
