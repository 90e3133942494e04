"""Checks of a :class:`~fedpartial._src.engine.round.FederatedRound`'s arguments when it is built, and of
each round's cohort."""

from __future__ import annotations

from typing import Any, Protocol

import jax
import numpy as np

from fedpartial._src.core.errors import UserError
from fedpartial._src.core.types import ClientGroup, Method, MethodContext, ModelLike
from fedpartial._src.engine import sharding as sharding_lib
from fedpartial._src.engine.types import Cohort, ServerState, data_spec

from fedpartial._src.engine.strategy import Strategy


class RoundSettings(Protocol):
    """What the checks read of a :class:`~fedpartial._src.engine.round.FederatedRound` (so this module, which the
    round imports, imports nothing of the round's)."""

    ctx: MethodContext
    method: Method
    model: ModelLike
    strategy: Strategy
    mesh: jax.sharding.Mesh | None
    client_state: str
    groups: tuple[ClientGroup, ...]
    offsets: tuple[int, ...]

    def client_state_shapes(self) -> Any: ...

#: where a method's per-client state lives (``FederatedRound(client_state=...)``)
CLIENT_STATES = ("device", "host")


def resolve_groups(rnd: RoundSettings) -> tuple[ClientGroup, ...]:
    """The method's client groups (one group, the whole cohort, when it has none), checked."""
    k = rnd.ctx.cohort_size
    if rnd.method.groups is None:
        return (ClientGroup("cohort", k),)
    groups = tuple(rnd.method.groups(rnd.ctx))
    sizes = [g.size for g in groups]
    if not groups or any(s < 1 for s in sizes) or sum(sizes) != k:
        raise ValueError(
            f"method {rnd.method.name}: client groups of sizes {sizes} must each hold at least one "
            f"client and add up to the cohort size {k}.")
    for i, g in enumerate(groups):
        sampled = g.size - (rnd.ctx.padding if i == len(groups) - 1 else 0)  # the padding rows come last
        if g.members is not None and len(g.members) < sampled:
            raise ValueError(
                f"method {rnd.method.name}: group {g.name!r} samples {sampled} clients per round "
                f"from only {len(g.members)} members.")
    return groups


def resolve_mesh(rnd: RoundSettings, devices) -> jax.sharding.Mesh | None:
    """The client mesh (None: one device, nothing sharded)."""
    if devices is None or (isinstance(devices, (int, np.integer)) and devices == 1):
        return None
    mesh = devices if isinstance(devices, jax.sharding.Mesh) else sharding_lib.client_mesh(devices)
    d, k = mesh.size, rnd.ctx.cohort_size
    if mesh.axis_names != (sharding_lib.CLIENT_AXIS,):
        raise ValueError(f"the device mesh must have the one axis {sharding_lib.CLIENT_AXIS!r}, "
                         f"not {mesh.axis_names}.")
    if d > 1 and rnd.strategy.kind != "fused":
        raise ValueError(f"the {rnd.strategy.kind} strategy runs on one device; only the fused strategy "
                         f"splits the cohort over {d} devices.")
    if k % d:
        raise ValueError(f"the cohort size {k} must be a multiple of the {d} devices the cohort is split over.")
    return mesh if d > 1 else None


def resolve_client_state(rnd: RoundSettings, where: str) -> str:
    """Where the method's per-client state lives (:data:`CLIENT_STATES`), checked against the method and mesh."""
    if where not in CLIENT_STATES:
        raise ValueError(f"client state {where!r} is unknown; use one of {CLIENT_STATES}.")
    if where == "host" and jax.tree.leaves(rnd.client_state_shapes()):
        if not rnd.method.capabilities.host_client_state:
            raise UserError(f"method {rnd.method.name} reads every client's state in its hooks, so its "
                            "per-client state cannot be kept off the device; keep it on the device.")
        if rnd.mesh is not None:
            raise UserError(f"per-client state kept on the host runs on one device, not the {rnd.mesh.size} "
                            "the cohort is split over; use one device.")
        if any(jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key) for a in
               jax.tree.leaves(rnd.client_state_shapes())):
            raise UserError(f"method {rnd.method.name} keeps PRNG keys per client, which the host store "
                            "cannot hold; keep its state on the device.")
    return where


def check_cohort(rnd: RoundSettings, cohort: Cohort, state: ServerState | None = None) -> None:
    """A cohort (and with per-client state on the host, the state) that fits the round, or a ValueError."""
    ids = cohort.info.client_ids
    k = np.shape(ids)[0]
    if k != rnd.ctx.cohort_size:
        raise ValueError(f"cohort has {k} clients but the round was built for {rnd.ctx.cohort_size}.")
    if state is not None and rnd.client_state == "host":
        got = {np.shape(a)[0] for a in jax.tree.leaves(state.method_state.clients)}
        if got - {k}:
            raise ValueError(f"with per-client state on the host the state must hold the cohort's {k} rows "
                             f"(HostClientState.rows(ids)), not {sorted(got)}.")
    x_shape = tuple(data_spec(cohort).data.x.shape[3:])
    if x_shape != rnd.model.input_shape:
        raise ValueError(
            f"client data has example shape {x_shape} but model {rnd.model.name} expects "
            f"{rnd.model.input_shape}."
        )
    if isinstance(ids, np.ndarray):
        valid = np.asarray(cohort.info.valid, bool)
        for g, start in zip(rnd.groups, rnd.offsets):
            if g.members is None:
                continue
            rows = ids[start:start + g.size][valid[start:start + g.size]]
            outside = np.setdiff1d(rows, np.asarray(g.members))
            if outside.size:
                raise ValueError(
                    f"client {int(outside[0])} sits in group {g.name!r}'s rows of the cohort but is not "
                    f"one of its members; lay the cohort out group by group (Simulation does).")

