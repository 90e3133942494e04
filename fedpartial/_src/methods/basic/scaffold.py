"""SCAFFOLD (Karimireddy et al., ICML 2020, Algorithm 1 with option II), for any whole-model method.

Server control variate ``c`` and one per client ``c_i`` (``[N]`` rows of the method's state).  Every
local step follows the corrected gradient ``g − c_i + c`` (:attr:`Method.transform_grads`, after the
wrapped method's own transform; frozen elements stay frozen).  After ``K_i`` local steps at rate
``η_i`` (``RoundView.client_lr``, the rate the client really trained with)::

    c_i⁺ = c_i − c + (x − y_i) / (K_i · η_i)          c ← c + Σ_{i∈S} (c_i⁺ − c_i) / N

**Partial methods** (:func:`control_variates` wraps any method whose clients train the whole
model's graph): the update is defined on *uploaded* elements only.  ``c_i`` changes where client
``i`` uploaded (elsewhere the server learns nothing of its drift), ``c`` moves by those changes over
``N``, and the model update is the wrapped method's.  ``c`` travels down on the elements the client
receives (all of them when its plan sends the whole model), ``c_i⁺ − c_i`` up on the elements it
uploads: both count as traffic.  ``scaffold()`` is ``control_variates(fedavg())``, the paper's method.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fedpartial._src.core import masks
from fedpartial._src.core.errors import UserError
from fedpartial._src.methods.base import (
    ClientPlan,
    InitView,
    LocalStep,
    Method,
    MethodContext,
    MethodState,
    RoundView,
    Selection,
    cohort_rows,
    scatter_clients,
)
from fedpartial._src.methods.basic.fedavg import fedavg
from fedpartial._src.methods.registry import MethodSpec
from fedpartial._src.methods.wrappers import Wrapper, wrap


def _per_client(x: jax.Array, like: jax.Array) -> jax.Array:
    """``[K]`` values broadcast against ``[K, ...]`` leaves."""
    return x.reshape((-1,) + (1,) * (like.ndim - 1))


def _param_bytes(ctx: MethodContext, mask, variables: dict, k: int) -> jax.Array:
    if mask is None:
        mask = masks.full(ctx.structure, (k,))
    return masks.count_bytes(ctx.structure, mask, variables, ("params",))


def control_variates(method: Method, name: str | None = None) -> Method:
    """``method`` with SCAFFOLD's control variates (option II) on the elements its clients upload.

    Args:
      method: any method whose clients start from the global model on what they upload.
      name: the new method's name (default ``method``'s with ``+scaffold``).

    Returns:
      The wrapped :class:`~fedpartial.Method`.
    """

    def init(ctx: MethodContext, view: InitView) -> MethodState:
        c = jax.tree.map(jnp.zeros_like, view.global_vars["params"])
        return MethodState(server=c, clients=jax.tree.map(lambda a: jnp.zeros((ctx.num_clients, *a.shape), a.dtype), c))

    def plan(ctx: MethodContext, view: RoundView, p: ClientPlan) -> ClientPlan:  # c travels down on what it receives
        k = view.cohort.valid.shape[0]
        extra = 0 if p.extra_download_bytes is None else p.extra_download_bytes
        return p._replace(extra_download_bytes=extra + _param_bytes(ctx, p.download, view.global_vars, k))

    def correct(ctx: MethodContext, grads, step: LocalStep, inner_grads):  # g − c_i + c, after the inner transform
        grads = grads if inner_grads is None else inner_grads
        return jax.tree.map(lambda g, c_i, c: g - c_i + c, grads, step.client_state, step.server_state)

    def select(ctx: MethodContext, view: RoundView, s: Selection) -> Selection:  # c_i⁺ − c_i travels up
        return s._replace(extra_upload_bytes=s.extra_upload_bytes + _param_bytes(ctx, s.upload, view.global_vars,
                                                                                   s.weights.shape[0]))

    def update(ctx: MethodContext, view: RoundView, inner_state: MethodState) -> MethodState:
        if view.client_lr is None:
            raise UserError("scaffold needs the clients' learning rate: build the round with "
                            "client_optimizer=fedpartial.client_sgd(...).")
        c, c_rows = view.method_state.server, view.client_state
        k_lr = jnp.maximum(view.client_steps, 1) * view.client_lr  # K_i · η_i
        uploaded = jax.vmap(lambda m: masks.expand(ctx.structure, m, view.global_vars["params"]))(view.selection.upload)
        valid = view.cohort.valid & (view.selection.weights > 0)

        def new_row(c_i, c, x, y, up):
            fresh = c_i - c[None] + (x[None] - y) / _per_client(k_lr, y)
            return jnp.where(up & _per_client(valid, y), fresh, c_i)

        rows = jax.tree.map(new_row, c_rows, c, view.global_vars["params"], view.trained_vars["params"], uploaded)
        c_new = jax.tree.map(lambda c, new, old: c + jnp.sum(new - old, axis=0) / ctx.num_clients, c, rows, c_rows)
        return MethodState(server=c_new, clients=scatter_clients(view.method_state.clients, cohort_rows(view), rows,
                                                                 view.cohort.valid))

    return wrap(method, Wrapper(
        lambda inner: name or f"{inner}+scaffold", init=init, label="control variates",
        hooks={"plan": plan, "transform_grads": correct, "select": select, "update": update},
        # its own rows are read and written as the cohort's only: the state may leave the device if the inner's may
        capabilities=lambda caps: caps._replace(streamable=None, asynchronous=False),  # c over the cohort
        refuses={"groups": "control variates need every client to train the whole model, and it trains per-group "
                           "graphs"}))



def scaffold() -> Method:
    """SCAFFOLD: FedAvg with control variates correcting every local gradient (option II)."""
    return control_variates(fedavg(), name="scaffold")


SPEC = MethodSpec("scaffold", scaffold, "SCAFFOLD (option II): server and client control variates correct every "
                  "local gradient; both count as traffic.")
