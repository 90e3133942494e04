"""The method interface: a NamedTuple of small pure functions run by one generic round.

A round (see :mod:`fedpartial.engine`) calls a method's pieces in this order::

    plan          (cohort)      -> ClientPlan   masks each client trains / keeps / receives
    client_start  (one client)  -> variables    the model a client starts local training from
    regularizer   (one client)  -> scalar       extra term of the local objective
    ... local training (engine) ...
    select        (cohort)      -> Selection    upload masks, aggregation weights, extra bytes
    ... aggregation + server optimizer (engine) ...
    update        (cohort)      -> MethodState  the method's own state (personal models, control variates)

and, outside the round, two optional read-outs of the method state:

    personal        (population)  -> PersonalModels  each client's own model, for personalised evaluation
    active_clients  (population)  -> [N] bool        who may still be sampled (early stopping)

Every piece has a default, so a method states only what differs from FedAvg.
Cohort-level pieces receive a :class:`RoundView` (arrays with a leading ``[K]``
cohort axis) and a static :class:`MethodContext`; per-client pieces receive one
client's slice.  All of them must be pure and jittable: no Python branching on
traced values, shapes fixed by the context.

Example — FedProx is FedAvg plus a proximal term::

    import jax, jax.numpy as jnp
    from fedpartial.methods import base

    def proximal(mu):
        def regularizer(ctx, params, batch, global_vars, client_state):
            sq = jax.tree.map(lambda p, g: jnp.sum((p - g) ** 2), params, global_vars["params"])
            return 0.5 * mu * sum(jax.tree.leaves(sq))
        return regularizer

    fedprox = base.make_method("fedprox", regularizer=proximal(0.01))

Per-client state for the whole population (SCAFFOLD's control variates, FedSPU's
personal models) lives in ``MethodState.clients`` with a leading ``[N]`` axis:
the engine gathers the cohort's rows into ``RoundView.client_state`` and the
method's ``update`` writes them back (:func:`scatter_clients`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from fedpartial import masks as masks_lib
from fedpartial.masks import Mask
from fedpartial.models.adapter import Model
from fedpartial.structure import ModelStructure


class CohortInfo(NamedTuple):
    """Who is in the cohort. All ``[K]``."""

    client_ids: jax.Array  # int32, index into the population
    num_samples: jax.Array  # float32, n_k
    valid: jax.Array  # bool, False for padding clients (they weigh 0)


class Batch(NamedTuple):
    """One local step's data for one client (or ``[K, S, ...]`` for a cohort)."""

    x: jax.Array
    y: jax.Array
    example_mask: jax.Array
    step_mask: jax.Array


class Holdout(NamedTuple):
    """A cohort's held-out (validation) examples, ``[K, H, ...]``; padded examples masked."""

    x: jax.Array
    y: jax.Array
    example_mask: jax.Array


class ClientPlan(NamedTuple):
    """What each client of the cohort trains, keeps and receives. Leading ``[K]``.

    Attributes:
      train: elements a client may change, or None for "everything".
      dropout: neurons that exist in the client's sub-model (its ``neurons``
        field), or None for "no dropout".
      dropout_scale: per-unit forward multipliers ``[K, units_l]`` (e.g. the
        inverted-dropout ``1/(1-d)``), or None to use the dropout mask as 0/1.
      download: elements sent to the client (for traffic accounting), or None
        for the whole model.
      extra_download_bytes: ``[K]`` bytes sent besides parameters (e.g. the
        indices of a client's active neurons), or None for none.
    """

    train: Mask | None = None
    dropout: Mask | None = None
    dropout_scale: tuple[jax.Array, ...] | None = None
    download: Mask | None = None
    extra_download_bytes: jax.Array | None = None


class Selection(NamedTuple):
    """What the server aggregates. Leading ``[K]``.

    Attributes:
      upload: elements each client uploads.
      weights: aggregation weights ``w_k`` (padding clients are zeroed by the engine).
      extra_upload_bytes: bytes uploaded besides parameters (feedback, indices).
    """

    upload: Mask
    weights: jax.Array
    extra_upload_bytes: jax.Array


class MethodState(NamedTuple):
    """A method's state: server-side part and per-client part with leading ``[N]``."""

    server: Any = ()
    clients: Any = ()


class PersonalModels(NamedTuple):
    """Every client's own model: ``variables`` with leading ``[N]`` (or one unstacked
    model shared by all) and, for sub-model methods, the ``[N]`` neuron mask of the
    sub-model each client holds (None: the full model)."""

    variables: dict
    submodel: Mask | None = None
    stacked: bool = True


@dataclasses.dataclass(frozen=True)
class MethodContext:
    """Static facts a method may use (hashable; never traced)."""

    model: Model
    num_clients: int
    cohort_size: int
    rounds: int | None = None  # planned number of rounds, for schedules (None: unknown)
    batch_statistics: bool = False  # 'static' BatchNorm: evaluate with batch statistics

    @property
    def structure(self) -> ModelStructure:
        return self.model.structure


class RoundView(NamedTuple):
    """Everything a cohort-level hook may read; fields not yet known are None."""

    key: jax.Array
    round: jax.Array
    global_vars: dict
    method_state: MethodState
    client_state: Any  # the cohort's rows of method_state.clients
    cohort: CohortInfo
    data: Batch  # the cohort's local data [K, S, B, ...]
    plan: ClientPlan | None = None
    trained_vars: dict | None = None  # [K, ...] after local training
    selection: Selection | None = None
    new_global_vars: dict | None = None
    holdout: Holdout | None = None  # the cohort's validation data, when the run has it
    client_loss: jax.Array | None = None  # [K] mean local training loss


class Method(NamedTuple):
    """A federated method as pure functions (build one with :func:`make_method`)."""

    name: str
    init: Callable[[MethodContext, dict], MethodState]
    plan: Callable[[MethodContext, RoundView], ClientPlan]
    client_start: Callable[[MethodContext, dict, Any, ClientPlan], dict]
    regularizer: Callable[[MethodContext, Any, Batch, dict, Any], jax.Array] | None
    select: Callable[[MethodContext, RoundView], Selection]
    update: Callable[[MethodContext, RoundView], MethodState]
    personal: Callable[[MethodContext, MethodState, dict], PersonalModels]
    active_clients: Callable[[MethodContext, MethodState], jax.Array] | None


# ---- default pieces -------------------------------------------------------------


def no_state(ctx: MethodContext, global_vars: dict) -> MethodState:
    del ctx, global_vars
    return MethodState()


def train_everything(ctx: MethodContext, view: RoundView) -> ClientPlan:
    del ctx, view
    return ClientPlan()


def start_from_global(ctx: MethodContext, global_vars: dict, client_state: Any, plan: ClientPlan) -> dict:
    del ctx, client_state, plan
    return global_vars


def trained_part(ctx: MethodContext, plan: ClientPlan, cohort_size: int) -> Mask:
    """The elements a client changed: its train mask within its sub-model."""
    mask = masks_lib.full(ctx.structure, (cohort_size,)) if plan.train is None else plan.train
    if plan.dropout is not None:
        mask = masks_lib.within(mask, plan.dropout)
    return mask


def upload_trained(ctx: MethodContext, view: RoundView) -> Selection:
    """Each client uploads what it trained, weighted by ``n_k``."""
    k = view.cohort.num_samples.shape[0]
    return Selection(
        upload=trained_part(ctx, view.plan, k),
        weights=view.cohort.num_samples,
        extra_upload_bytes=jnp.zeros((k,), jnp.int32),
    )


def keep_state(ctx: MethodContext, view: RoundView) -> MethodState:
    del ctx
    return view.method_state


def global_is_personal(ctx: MethodContext, state: MethodState, global_vars: dict) -> PersonalModels:
    """A non-personalised method: every client's model is the global model."""
    del ctx, state
    return PersonalModels(variables=global_vars, stacked=False)


def make_method(
    name: str,
    *,
    init=no_state,
    plan=train_everything,
    client_start=start_from_global,
    regularizer=None,
    select=upload_trained,
    update=keep_state,
    personal=global_is_personal,
    active_clients=None,
) -> Method:
    """Builds a :class:`Method`; every piece not given is FedAvg's (``active_clients``
    None: every client may always be sampled)."""
    return Method(name=name, init=init, plan=plan, client_start=client_start,
                  regularizer=regularizer, select=select, update=update, personal=personal,
                  active_clients=active_clients)


def broadcast_clients(tree: Any, num_clients: int) -> Any:
    """``[N, ...]`` copies of one model: every client's initial personal model."""
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (num_clients, *jnp.shape(a))), tree)


def gather_clients(clients: Any, client_ids: jax.Array) -> Any:
    """The cohort's rows ``[K, ...]`` of a population-wide ``[N, ...]`` tree."""
    return jax.tree.map(lambda a: a[client_ids], clients)


def scatter_clients(clients: Any, client_ids: jax.Array, rows: Any, valid: jax.Array) -> Any:
    """Writes the cohort's rows back; padding clients (``valid`` False) write nothing."""

    def leaf(a, r):
        keep = valid.reshape((-1,) + (1,) * (r.ndim - 1))
        return a.at[client_ids].set(jnp.where(keep, r, a[client_ids]))

    return jax.tree.map(leaf, clients, rows)
