"""SCAFFOLD (Karimireddy et al., ICML 2020, Algorithm 1 with option II), on fedpartial's public API alone.

Server control variate ``c`` and one per client ``c_i`` (``[N]`` rows, kept with the method's state).
Every local step follows the corrected gradient ``g − c_i + c`` (the ``transform_grads`` hook, which
sees the client's rows and the server state).  After ``K_i`` local steps at rate ``η_i``::

    c_i⁺ = c_i − c + (x − y_i) / (K_i · η_i)          c ← c + |S|/N · mean_{i∈S}(c_i⁺ − c_i)

The model update is FedAvg's (the server optimizer's rate is the paper's global step size).  ``η_i``
is ``RoundView.client_lr``: the rate each client really trained with, so a replica of ``--lrs``
equals its own separate run.  Both control variates count as traffic: ``c`` goes down with the
model, ``c_i⁺ − c_i`` comes up with it.  Every client uploads its whole model, as in the paper.

Use it with ``fedpartial run --method examples.scaffold:SPEC`` or register ``SPEC`` under the entry
point group ``fedpartial.methods``.  fedpartial's built-in ``scaffold``
(:func:`fedpartial.methods.control_variates`) is the same algorithm, generalised to the elements a
partial method uploads; this file shows what a method written outside fedpartial looks like.
"""

import jax
import jax.numpy as jnp

import fedpartial as fp


def _param_bytes(params) -> int:
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(params))


def scaffold() -> fp.Method:
    def init(ctx, view):
        zeros = jax.tree.map(jnp.zeros_like, view.global_vars["params"])
        rows = jax.tree.map(lambda a: jnp.zeros((ctx.num_clients, *a.shape), a.dtype), zeros)
        return fp.MethodState(server=zeros, clients=rows)

    def plan(ctx, view):  # c travels down with the model
        k = view.cohort.valid.shape[0]
        return fp.ClientPlan(extra_download_bytes=jnp.full((k,), _param_bytes(view.global_vars["params"]), jnp.int32))

    def correct(ctx, grads, step):  # g − c_i + c
        return jax.tree.map(lambda g, c_i, c: g - c_i + c, grads, step.client_state, step.server_state)

    def select(ctx, view):  # c_i⁺ − c_i travels up with the model
        selection = fp.upload_trained(ctx, view)
        return selection._replace(extra_upload_bytes=selection.extra_upload_bytes
                                  + _param_bytes(view.global_vars["params"]))

    def update(ctx, view):
        if view.client_lr is None:
            raise fp.UserError("scaffold needs the clients' learning rate: build the round with "
                               "client_optimizer=fedpartial.client_sgd(...).")
        valid = view.cohort.valid
        k_lr = jnp.maximum(view.client_steps, 1) * view.client_lr  # [K]: K_i · η_i

        def new_row(c_i, c, x, y):  # [K, ...] rows from the [...] server values
            return c_i - c[None] + (x[None] - y) / k_lr.reshape((-1,) + (1,) * (y.ndim - 1))

        rows = jax.tree.map(new_row, view.client_state, view.method_state.server, view.global_vars["params"],
                            view.trained_vars["params"])

        def new_server(c, c_i_new, c_i):
            delta = jnp.where(valid.reshape((-1,) + (1,) * (c_i.ndim - 1)), c_i_new - c_i, 0.0)
            return c + jnp.sum(delta, axis=0) / ctx.num_clients  # |S|/N · mean over S

        server = jax.tree.map(new_server, view.method_state.server, rows, view.client_state)
        clients = fp.scatter_clients(view.method_state.clients, fp.cohort_rows(view), rows, valid)
        return fp.MethodState(server=server, clients=clients)

    return fp.make_method("my_scaffold", init=init, plan=plan, transform_grads=correct, select=select, update=update,
                          capabilities=fp.Capabilities(host_client_state=True))


SPEC = fp.MethodSpec("my_scaffold", scaffold, "SCAFFOLD (option II): control variates correct every local gradient.")
