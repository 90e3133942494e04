"""Population-wide ``[N, ...]`` trees (a method's per-client state) and the cohort's ``[K]`` rows of them.

The round gathers the cohort's rows into ``RoundView.client_state``; a method's ``update`` writes them back
with :func:`scatter_clients` at :func:`cohort_rows`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from fedpartial._src.core.types import RoundView


def broadcast_clients(tree: Any, num_clients: int) -> Any:
    """``[N, ...]`` copies of one model: every client's initial personal model.

    Args:
      tree: one model (or any pytree).
      num_clients: ``N``.

    Returns:
      The tree with a leading ``[N]`` axis.
    """
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (num_clients, *jnp.shape(a))), tree)


def gather_clients(clients: Any, client_ids: jax.Array) -> Any:
    """The cohort's rows ``[K, ...]`` of a population-wide ``[N, ...]`` tree.

    Args:
      clients: a ``[N, ...]`` tree.
      client_ids: ``[K]`` int rows.

    Returns:
      The ``[K, ...]`` rows.
    """
    return jax.tree.map(lambda a: a[client_ids], clients)


def cohort_rows(view: RoundView) -> jax.Array:
    """``[K]`` the cohort's rows of ``view.method_state.clients``: where ``update`` writes its clients'
    state back (the client ids, unless the round holds only the cohort's rows).

    Args:
      view: the hook's :class:`~fedpartial.RoundView`.

    Returns:
      ``[K]`` int32 rows.
    """
    return view.cohort.client_ids if view.client_rows is None else view.client_rows


def scatter_clients(clients: Any, client_ids: jax.Array, rows: Any, valid: jax.Array) -> Any:
    """Writes the cohort's rows back; padding clients (``valid`` False) write nothing.

    A padding row is sent to the out-of-range index ``N`` and dropped, so its id may
    even repeat a real client's (a padded cohort on several devices) without a race.

    Args:
      clients: the ``[N, ...]`` tree.
      client_ids: ``[K]`` rows to write (:func:`cohort_rows`).
      rows: the ``[K, ...]`` new rows.
      valid: ``[K]`` bool, False for padding clients.

    Returns:
      The updated ``[N, ...]`` tree.
    """

    def leaf(a, r):
        return a.at[jnp.where(valid, client_ids, a.shape[0])].set(r, mode="drop")

    return jax.tree.map(leaf, clients, rows)
