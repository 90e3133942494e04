"""Row helpers of the client axis and fault cleaning, shared by the round and its runners."""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp


def row_slice(tree: Any, start: int, size: int) -> Any:
    """Rows ``start:start+size`` (static) of every leaf."""
    return jax.tree.map(lambda a: a[start:start + size], tree)


def rows_padded(train: Callable, multiple: int) -> Callable:
    """``train(global_vars, args)`` over rows ``[n, ...]`` for any ``n``: ``args`` are run with copies of
    their first rows added up to a multiple of ``multiple`` (a client group split over devices), and
    only the first ``n`` rows of the results are kept.  Copies, not zeros: every dtype (PRNG keys
    included) and a real client's arithmetic, so nothing in the dropped rows can fail."""

    def padded(global_vars, args):
        n = jax.tree.leaves(args)[0].shape[0]
        extra = -n % multiple
        if not extra:
            return train(global_vars, args)
        rows = jnp.arange(n + extra) % n
        return row_slice(train(global_vars, jax.tree.map(lambda a: a[rows], args)), 0, n)

    return padded


def _inexact(a) -> bool:
    return jnp.issubdtype(jnp.result_type(a), jnp.inexact)


def finite_rows(tree: Any) -> jax.Array:
    """``[K]`` True where every inexact element of client ``k``'s rows is finite (one reduction per leaf)."""
    rows = [jnp.all(jnp.isfinite(a), axis=tuple(range(1, a.ndim))) for a in jax.tree.leaves(tree) if _inexact(a)]
    return functools.reduce(jnp.logical_and, rows)


def all_finite(tree: Any) -> jax.Array:
    """A scalar: every inexact element of the tree is finite."""
    return functools.reduce(jnp.logical_and, [jnp.all(jnp.isfinite(a)) for a in jax.tree.leaves(tree) if _inexact(a)],
                            jnp.asarray(True))


def rows_mask(rows: jax.Array, a: jax.Array) -> jax.Array:
    """``[K]`` booleans shaped to broadcast against ``a`` ``[K, ...]``."""
    return rows.reshape((-1,) + (1,) * (a.ndim - 1))


def clean_faults(trained: dict, losses: jax.Array, starts: dict):
    """``(finite [K], trained, losses)``: a client whose result is not finite gets its start model, loss 0."""
    finite = finite_rows((trained, losses))
    trained = jax.tree.map(lambda t, s: jnp.where(rows_mask(finite, t), t, s.astype(t.dtype)), trained, starts)
    return finite, trained, jnp.where(finite, losses, jnp.zeros_like(losses))


def concat(parts: list) -> Any:
    """Per-part trees ``[n_i, ...]`` joined along the client axis (one part: itself)."""
    return parts[0] if len(parts) == 1 else jax.tree.map(lambda *a: jnp.concatenate(a, axis=0), *parts)

