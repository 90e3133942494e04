"""The federated round: ``(server_state, cohort, key) -> (server_state, metrics)``.

One generic round runs every method::

    plan → client_start → local steps → select → aggregate → server optimizer → update

Two execution strategies compute the same thing (to float tolerance):

* :func:`fused` — the whole round is one jitted function: clients vmapped (or
  ``lax.map``-ped in chunks of vmapped clients), local steps in ``lax.scan``.
  Best on accelerators, where it keeps the device busy with one launch.
* :func:`stepwise` — the same client step, jitted over a chunk of clients and
  driven by a host loop over steps; plan and aggregation are jitted separately.
  Best on CPUs, where XLA runs a conv step inside ``lax.scan`` and vmapped
  per-client conv weights markedly slower than a loop of jitted steps.

:func:`default_strategy` picks per platform; every entry point lets a user override.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedpartial import aggregation
from fedpartial import masks as masks_lib
from fedpartial.client import LocalState, make_client_fns
from fedpartial.methods.base import (
    Batch,
    ClientPlan,
    CohortInfo,
    Holdout,
    Method,
    MethodContext,
    RoundView,
    gather_clients,
)
from fedpartial.models.adapter import Model

BN_POLICIES = ("global", "static")


@dataclasses.dataclass(frozen=True)
class Strategy:
    """How a round executes. Build with :func:`fused` or :func:`stepwise`."""

    kind: str
    chunk_size: int | None = None
    unroll: int | bool = 1

    def __post_init__(self):
        if self.kind not in ("fused", "stepwise"):
            raise ValueError(f"strategy {self.kind!r} is unknown; use 'fused' or 'stepwise'.")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError(f"chunk size {self.chunk_size} must be a positive number of clients.")


def fused(chunk_size: int | None = None, unroll: int | bool = 1) -> Strategy:
    """Whole round in one jit; ``chunk_size`` clients vmapped at a time (None: all).

    ``unroll`` is passed to the local-step ``lax.scan``: ``True`` unrolls all steps,
    which on CPU lets XLA give convolutions their fast layout (compiles longer).
    """
    return Strategy("fused", chunk_size, unroll)


def stepwise(chunk_size: int = 1) -> Strategy:
    """Host loop over local steps of a jitted step over ``chunk_size`` clients."""
    return Strategy("stepwise", chunk_size)


def default_strategy(platform: str | None = None) -> Strategy:
    """Stepwise one client at a time on CPU; fused over the whole cohort on GPU/TPU."""
    platform = platform or jax.default_backend()
    return stepwise(1) if platform == "cpu" else fused(None)


def parse_strategy(text: str) -> Strategy:
    """'auto', 'fused', 'fused:N' (N clients vmapped at a time), 'fused-unrolled[:N]',
    'stepwise' or 'stepwise:N'."""
    if text == "auto":
        return default_strategy()
    kind, _, chunk = text.partition(":")
    if kind not in ("fused", "fused-unrolled", "stepwise") or (chunk and not (chunk.isdigit() and int(chunk) > 0)):
        raise ValueError(
            f"strategy {text!r} is not one of 'auto', 'fused', 'fused:N', 'fused-unrolled', "
            "'fused-unrolled:N', 'stepwise', 'stepwise:N' (N a positive number of clients)."
        )
    size = int(chunk) if chunk else None
    if kind == "stepwise":
        return stepwise(size or 1)
    return fused(size, unroll=kind == "fused-unrolled")


class ServerState(NamedTuple):
    """Everything the server carries between rounds."""

    round: jax.Array
    variables: dict  # global {'params', 'batch_stats'}
    opt_state: Any  # server optimizer state
    method_state: Any


class Cohort(NamedTuple):
    """A round's input: the cohort's local data and who the clients are."""

    data: Batch  # [K, S, B, ...]
    info: CohortInfo
    holdout: Holdout | None = None  # [K, H, ...] validation data (early stopping needs it)


def cohort_from_packed(packed, client_ids, valid=None, holdout: Holdout | None = None) -> Cohort:
    """Builds a :class:`Cohort` from :class:`fedpartial.data.packing.CohortBatches`."""
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


class FederatedRound:
    """A method bound to a model, optimizers and a strategy.

    ``init(key)`` builds the server state; calling the object runs one round.
    ``trace_count`` counts how often the jitted pieces were traced (a round with
    the same shapes must not retrace).
    """

    def __init__(
        self,
        model: Model,
        method: Method,
        *,
        num_clients: int,
        cohort_size: int,
        client_optimizer: optax.GradientTransformation,
        server_optimizer: optax.GradientTransformation | None = None,
        bn_policy: str = "global",
        strategy: Strategy | None = None,
        rounds: int | None = None,
    ):
        if bn_policy not in BN_POLICIES:
            raise ValueError(f"BatchNorm policy {bn_policy!r} is unknown; use one of {BN_POLICIES}.")
        if not 1 <= cohort_size <= num_clients:
            raise ValueError(
                f"cohort size {cohort_size} must be between 1 and the population size {num_clients}."
            )
        self.model = model
        self.method = method
        self.ctx = MethodContext(model=model, num_clients=num_clients, cohort_size=cohort_size,
                                 rounds=rounds, batch_statistics=bn_policy == "static")
        self.client_optimizer = client_optimizer
        self.server_optimizer = server_optimizer or optax.sgd(1.0)
        self.bn_policy = bn_policy
        self.strategy = strategy or default_strategy()
        self.client = make_client_fns(self.ctx, method, client_optimizer,
                                      track_batch_stats=bn_policy == "global")
        self.communicated = ("params", "batch_stats") if bn_policy == "global" else ("params",)
        self.trace_count = 0
        self._fused = jax.jit(self._fused_round)
        self._begin = jax.jit(self._begin_round)
        self._finish = jax.jit(self._finish_round)
        self._steps: dict[int | None, Any] = {}

    # ---- state -----------------------------------------------------------------

    def init(self, key: jax.Array) -> ServerState:
        variables = self.model.init_variables(key)
        return ServerState(
            round=jnp.zeros((), jnp.int32),
            variables=variables,
            opt_state=self.server_optimizer.init(variables["params"]),
            method_state=self.method.init(self.ctx, variables),
        )

    # ---- round -----------------------------------------------------------------

    def __call__(self, state: ServerState, cohort: Cohort, key: jax.Array):
        """Runs one round; returns ``(new_state, metrics)`` (metrics are device arrays)."""
        self._check_cohort(cohort)
        if self.strategy.kind == "fused":
            return self._fused(state, cohort, key)
        return self._stepwise_round(state, cohort, key)

    def _check_cohort(self, cohort: Cohort) -> None:
        k = np.shape(cohort.info.client_ids)[0]
        if k != self.ctx.cohort_size:
            raise ValueError(f"cohort has {k} clients but the round was built for {self.ctx.cohort_size}.")
        x_shape = tuple(np.shape(cohort.data.x)[3:])
        if x_shape != self.model.input_shape:
            raise ValueError(
                f"client data has example shape {x_shape} but model {self.model.name} expects "
                f"{self.model.input_shape}."
            )

    def _view(self, state: ServerState, cohort: Cohort, key: jax.Array, plan=None) -> RoundView:
        plan_key, select_key = jax.random.split(key)
        view = RoundView(
            key=plan_key, round=state.round, global_vars=state.variables, method_state=state.method_state,
            client_state=gather_clients(state.method_state.clients, cohort.info.client_ids),
            cohort=cohort.info, data=cohort.data, holdout=cohort.holdout,
        )
        if plan is None:
            plan = self.method.plan(self.ctx, view)
        return view._replace(plan=plan, key=select_key)

    def _begin_round(self, state: ServerState, cohort: Cohort, key: jax.Array):
        """Plans the round and initialises every client's local state ``[K]``."""
        self.trace_count += 1
        view = self._view(state, cohort, key)
        local = jax.vmap(self.client.init, in_axes=(None, 0, 0), axis_size=self.ctx.cohort_size)(
            state.variables, view.client_state, view.plan)
        return view.plan, view.client_state, local

    def _finish_round(self, state: ServerState, cohort: Cohort, key: jax.Array, plan: ClientPlan,
                      local: LocalState):
        """Selection, aggregation, server optimizer and method update."""
        self.trace_count += 1
        view = self._view(state, cohort, key, plan)
        trained, losses, steps = jax.vmap(self.client.final)(local)
        view = view._replace(trained_vars=trained, client_loss=losses)
        selection = self.method.select(self.ctx, view)
        weights = jnp.where(view.cohort.valid, selection.weights, 0.0)
        selection = selection._replace(weights=weights)
        aggregated = aggregation.aggregate(
            self.ctx.structure, state.variables, trained, selection.upload, weights, self.communicated
        )
        params, opt_state = aggregation.server_update(
            self.server_optimizer, state.opt_state, state.variables["params"], aggregated["params"]
        )
        new_vars = {**aggregated, "params": params}
        view = view._replace(selection=selection, new_global_vars=new_vars)
        method_state = self.method.update(self.ctx, view)
        new_state = ServerState(round=state.round + 1, variables=new_vars, opt_state=opt_state,
                                method_state=method_state)
        return new_state, self._metrics(view, selection, losses, steps)

    def _metrics(self, view: RoundView, selection, losses, steps) -> dict:
        structure, g = self.ctx.structure, view.global_vars
        k = view.cohort.valid.shape[0]
        valid = view.cohort.valid
        download_mask = view.plan.download if view.plan.download is not None else masks_lib.full(structure, (k,))
        down = masks_lib.count_bytes(structure, download_mask, g, self.communicated)
        if view.plan.extra_download_bytes is not None:
            down = down + view.plan.extra_download_bytes
        up = masks_lib.count_bytes(structure, selection.upload, g, self.communicated)
        up = up + selection.extra_upload_bytes
        zero = jnp.zeros_like(up)
        n_valid = jnp.maximum(jnp.sum(valid), 1)
        return {
            "train_loss": jnp.sum(jnp.where(valid, losses, 0.0)) / n_valid,
            "client_steps": jnp.sum(jnp.where(valid, steps, 0)),
            "upload_bytes": jnp.sum(jnp.where(valid, up, zero)),
            "download_bytes": jnp.sum(jnp.where(valid, down, zero)),
            "upload_bytes_per_client": jnp.where(valid, up, zero),
            "download_bytes_per_client": jnp.where(valid, down, zero),
            "client_loss": losses,
        }

    # ---- fused strategy ----------------------------------------------------------

    def _fused_round(self, state: ServerState, cohort: Cohort, key: jax.Array):
        plan, client_state, local = self._begin_round(state, cohort, key)

        def train_one(args):
            local_k, data_k, plan_k, cstate_k = args

            def body(carry, batch):
                return self.client.step(carry, batch, plan_k, state.variables, cstate_k), None

            # One client's data has the steps as its leading axis: scan over them.
            return jax.lax.scan(body, local_k, data_k, unroll=self.strategy.unroll)[0]

        args = (local, cohort.data, plan, client_state)
        if self.strategy.chunk_size is None:
            trained = jax.vmap(train_one)(args)
        else:
            trained = jax.lax.map(train_one, args, batch_size=self.strategy.chunk_size)
        return self._finish_round(state, cohort, key, plan, trained)

    # ---- stepwise strategy -------------------------------------------------------

    def _step_fn(self, chunk: int | None):
        """A jitted step over ``chunk`` clients (None: one client, un-vmapped).

        Signature ``(local, data, s, plan, global_vars, client_state) -> local``.
        """
        if chunk not in self._steps:
            step = self.client.step

            def one_step(local, data, s, plan, global_vars, cstate):
                self.trace_count += 1
                batch = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, s, axis=0, keepdims=False), data)
                return step(local, batch, plan, global_vars, cstate)

            if chunk is None:
                fn = one_step
            else:
                fn = jax.vmap(one_step, in_axes=(0, 0, None, 0, None, 0))
            self._steps[chunk] = jax.jit(fn, donate_argnums=(0,))
        return self._steps[chunk]

    def _stepwise_round(self, state: ServerState, cohort: Cohort, key: jax.Array):
        step_mask = np.asarray(cohort.data.step_mask)
        cohort = jax.device_put(cohort)  # once; chunks below are sliced on the device
        plan, client_state, local = self._begin(state, cohort, key)
        k = self.ctx.cohort_size
        chunk = min(self.strategy.chunk_size or 1, k)
        for start in range(0, k, chunk):
            size = min(chunk, k - start)
            # chunk 1 runs the un-vmapped step on one client's slice.
            batched = None if chunk == 1 else size
            # One jitted call takes the chunk out, one writes it back in place:
            # slicing leaf by leaf on the host costs a dispatch per leaf and client.
            local_c, data_c, plan_c, cstate_c = _take(batched, start, (local, cohort.data, plan, client_state))
            step = self._step_fn(batched)
            # Steps after the chunk's last real step are padding: skip them on the host.
            active = np.flatnonzero(step_mask[start:start + size].any(axis=0))
            for s in range(int(active[-1]) + 1 if active.size else 0):
                local_c = step(local_c, data_c, s, plan_c, state.variables, cstate_c)
            local = _put(batched, start, local, local_c)
        return self._finish(state, cohort, key, plan, local)


@functools.partial(jax.jit, static_argnums=(0,))
def _take(size: int | None, start, tree):
    """Rows ``start:start+size`` of every leaf (``size`` None: row ``start`` without its axis)."""
    if size is None:
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, start, 0, keepdims=False), tree)
    return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, start, size, 0), tree)


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def _put(size: int | None, start, tree, rows):
    """Writes ``rows`` back at ``start`` (in place: ``tree`` is donated)."""
    def leaf(a, r):
        r = r[None] if size is None else r
        return jax.lax.dynamic_update_slice_in_dim(a, r.astype(a.dtype), start, 0)
    return jax.tree.map(leaf, tree, rows)
