"""The round's inputs and outputs: the server state, the cohort and its data, the round as pure functions.

**Per-client state** (``MethodState.clients``, ``[N, ...]``) lives in the server state;
with ``client_state="host"`` the state holds only the cohort's ``K`` rows
(:func:`without_clients`, :func:`with_clients`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import numpy as np

from fedpartial._src.core.fielddocs import document_fields
from fedpartial._src.core.types import Batch, ClientPlan, CohortInfo, Holdout


@document_fields
class ServerState(NamedTuple):
    """Everything the server carries between rounds.

    Attributes:
      round: int32 scalar, rounds done so far.
      variables: the global model's variables (``{'params', 'batch_stats'}``).
      opt_state: the server optimizer's state.
      method_state: the method's ``MethodState``.
      server_lr_scale: a scalar that multiplies the server optimizer's updates (the replicas of
        ``--server-lrs`` carry each replica's server learning rate here, with the optimizer built at
        rate 1); None: 1, no leaf.
    """

    round: jax.Array
    variables: dict
    opt_state: Any
    method_state: Any
    server_lr_scale: Any = None


def without_clients(state: ServerState) -> ServerState:
    """The state with no per-client rows (``method_state.clients`` is ``()``)."""
    return state._replace(method_state=state.method_state._replace(clients=()))


def with_clients(state: ServerState, clients: Any) -> ServerState:
    """The state holding ``clients`` as its per-client state (e.g. the cohort's rows from the host)."""
    return state._replace(method_state=state.method_state._replace(clients=clients))


@dataclasses.dataclass(frozen=True, eq=False)
class ClientData:
    """A cohort's local data made on demand, some clients at a time (host side; not a pytree).

    ``take(rows)`` returns the :class:`Batch` ``[len(rows), S, B, ...]`` of the cohort
    positions ``rows`` (a client's batches must not depend on which others are taken
    with it); ``spec`` is the whole cohort's :class:`Batch` of ``jax.ShapeDtypeStruct``
    ``[K, S, B, ...]``.  The streamed strategy takes one chunk at a time, so the host
    never holds ``[K, S, B, ...]``; other strategies take every row at once.
    """

    take: Callable[[np.ndarray], Batch]
    spec: Batch

    @classmethod
    def of(cls, data: Batch) -> "ClientData":
        """Rows of an already packed ``[K, ...]`` batch."""
        spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), data)
        return cls(lambda rows: jax.tree.map(lambda a: a[rows], data), spec)


def data_spec(cohort: "Cohort") -> "Cohort":
    """The cohort with :class:`ClientData` replaced by its shapes (for shape-only uses, e.g. FLOP counts)."""
    return cohort._replace(data=cohort.data.spec) if isinstance(cohort.data, ClientData) else cohort


@document_fields
class Cohort(NamedTuple):
    """A round's input: the cohort's local data and who the clients are.

    Attributes:
      data: the cohort's local data ``[K, S, B, ...]`` (a ``Batch``, or the rows of data kept on the device).
      info: who the clients are (``CohortInfo``).
      holdout: ``[K, H, ...]`` validation data (early stopping needs it), or None.
    """

    data: Batch | ClientData
    info: CohortInfo
    holdout: Holdout | None = None


class RoundFunctions(NamedTuple):
    """The round as pure functions: ``init(key) -> state``, ``round(state, cohort, key) -> (state, metrics)``."""

    init: Callable[[jax.Array], ServerState]
    round: Callable[[ServerState, Cohort, jax.Array], tuple[ServerState, dict]]


class RoundPreview(NamedTuple):
    plan: ClientPlan  # [K]
    start_vars: dict  # [K, ...]


class LocalInputs(NamedTuple):
    """What one client group's local training reads in a round; rows are the group's clients."""

    start: dict  # [size, ...] each client's start model (full shape)
    data: Batch  # [size, S, B, ...] raw local data (before the group's preparation)
    plan: ClientPlan  # [size] the group's rows of the plan
    client_state: Any  # [size, ...] the group's rows of the method's per-client state
    client_keys: jax.Array  # [size] typed keys: client k trains with fold_in(train key, id_k)
    server_state: Any = ()  # the method's server state, which every local step sees (``LocalStep.server_state``)


class HookKeys(NamedTuple):
    plan: jax.Array
    train: jax.Array
    select: jax.Array
    update: jax.Array
    metrics: jax.Array


def hook_keys(key: jax.Array) -> HookKeys:
    """One key per hook of a round (plan, local training, select, update, metrics)."""
    return HookKeys(*jax.random.split(key, len(HookKeys._fields)))


def cohort_from_packed(packed, client_ids, valid=None, holdout: Holdout | None = None) -> Cohort:
    """Builds a :class:`Cohort` from :class:`fedpartial._src.data.packing.CohortBatches`."""
    k = len(client_ids)
    return Cohort(
        data=Batch(x=packed.x, y=packed.y, example_mask=packed.example_mask, step_mask=packed.step_mask),
        info=CohortInfo(
            client_ids=np.asarray(client_ids, np.int32),
            num_samples=np.asarray(packed.num_samples, np.float32),
            valid=np.ones((k,), bool) if valid is None else np.asarray(valid, bool),
        ),
        holdout=holdout,
    )
