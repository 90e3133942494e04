"""Checks of a :class:`~fedpartial._src.engine.round.FederatedRound`'s arguments when it is built, and of
each round's cohort."""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp
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


def check_second_order(rnd: RoundSettings) -> None:
    """Refuses, in one sentence, a model whose gradient has no forward-mode derivative (a custom reverse-mode
    rule: the ``hybrid`` and ``mapped`` convolution lowerings) for a method that differentiates twice
    (:attr:`~fedpartial.Capabilities.second_order`).  Traced on one example's shapes, nothing computed; any
    other tracing error is left to the round, which reports it where it arises."""
    if not rnd.method.capabilities.second_order:
        return
    model = rnd.model
    variables = jax.eval_shape(model.init_variables, jax.random.key(0))
    x = jax.ShapeDtypeStruct((1, *model.input_shape), jnp.float32)

    def hvp(var, xx):  # as the method's Hessian-vector products run: the gradient linearised
        def loss(params):
            return jnp.sum(model.apply({**var, "params": params}, xx, False)[0])

        return jax.linearize(jax.grad(loss), var["params"])[1](var["params"])

    two = jax.tree.map(lambda a: jax.ShapeDtypeStruct((2, *a.shape), a.dtype), variables)
    try:  # one client, and two vmapped as the round runs them (the lowerings differ under vmap)
        jax.eval_shape(hvp, variables, x)
        jax.eval_shape(jax.vmap(hvp, in_axes=(0, None)), two, x)
    except Exception as e:  # noqa: BLE001 - only the missing forward-mode rule is this check's to report
        if "Linearization failed" not in str(e) and "custom_vjp" not in str(e):
            return
        raise UserError(f"method {rnd.method.name} differentiates its loss twice (forward mode over the gradient), "
                        f"which this model's convolution lowering cannot (its gradient is a custom reverse-mode "
                        f"rule); use --conv-impl lax or im2col.") from None


def client_devices(devices) -> jax.sharding.Mesh | None:
    """The client mesh ``devices`` names (None: one device)."""
    if devices is None or (isinstance(devices, (int, np.integer)) and devices == 1):
        return None
    mesh = devices if isinstance(devices, jax.sharding.Mesh) else sharding_lib.client_mesh(devices)
    if mesh.axis_names != (sharding_lib.CLIENT_AXIS,):
        raise ValueError(f"the device mesh must have the one axis {sharding_lib.CLIENT_AXIS!r}, "
                         f"not {mesh.axis_names}.")
    return mesh if mesh.size > 1 else None


def resolve_step_devices(rnd: RoundSettings, devices) -> tuple[jax.Device, ...] | None:
    """The devices the stepwise strategy trains clients on side by side, one client each at a time (None: one
    device).  Only one-client steps are split: the round's other pieces run on the first device."""
    mesh = client_devices(devices)
    if mesh is None or rnd.strategy.kind != "stepwise":
        return None
    if rnd.strategy.chunk_size != 1:
        raise ValueError(f"the stepwise strategy trains one client per device at a time over {mesh.size} "
                         f"devices, not chunks of {rnd.strategy.chunk_size}; use stepwise:1.")
    if jax.process_count() > 1:
        raise ValueError("the stepwise strategy splits clients over one process's devices; use the fused "
                         "strategy over several processes.")
    return tuple(mesh.devices.flat)


def resolve_mesh(rnd: RoundSettings, devices) -> jax.sharding.Mesh | None:
    """The client mesh of the fused strategy (None: one device, nothing sharded; the stepwise strategy's
    devices are :func:`resolve_step_devices`')."""
    mesh = client_devices(devices)
    if mesh is None or rnd.strategy.kind == "stepwise":
        return None
    d, k = mesh.size, rnd.ctx.cohort_size
    if rnd.strategy.kind != "fused":
        raise ValueError(f"the {rnd.strategy.kind} strategy runs on one device; only the fused strategy "
                         f"splits the cohort over {d} devices, and stepwise:1 its clients' steps.")
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

