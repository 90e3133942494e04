"""Ditto (Li, Hu, Beirami & Smith, ICML 2021, "Ditto: Fair and Robust Federated Learning Through
Personalization", Algorithm 1): FedAvg for the global model, and beside it a personal model per client
pulled towards the global one.

In a round a sampled client ``k``:

1. trains the global model ``w^t`` it received as FedAvg does and uploads it (the server averages with
   ``n_k`` weights, as fedpartial's FedAvg does where the paper's box averages uniformly: the global model
   is FedAvg's, bit for bit);
2. trains its own personal model ``v_k`` on ``f_k(v) + λ/2·‖v − w^t‖²`` and keeps it
   (``MethodState.clients``, ``[N]`` full models, initially ``w^0``).

Evaluation is each client's personal model on its held-out split.  Choices where the paper is vague for
this engine: the personal model takes as many local steps as the global one, on the same batches, with the
run's client optimizer at the client's own rate (the paper's code runs the same local epochs; its SGD has
no momentum); ``--lam`` defaults to 0.1, a value from the grid the paper tunes λ over per dataset.  The
second training runs in ``update`` with the engine's local training over the cohort
(:func:`fedpartial._src.engine.local_training.train_models`); ``Capabilities.local_passes=2`` has the device
model count it in ``client_flops`` and the simulated time (the same steps and FLOPs as the global model's;
the proximal term's few FLOPs are not counted).
"""

from __future__ import annotations

import jax

from fedpartial._src.core.errors import UserError
from fedpartial._src.core.population import broadcast_clients
from fedpartial._src.core.types import client_sgd
from fedpartial._src.core.structure import with_frozen, without_frozen
from fedpartial._src.engine.local_training import train_models
from fedpartial._src.methods.base import (Capabilities, ClientPlan, InitView, Method, MethodContext, MethodState,
                                          PersonalModels, RoundView, cohort_rows, make_method, scatter_clients,
                                          with_penalty)
from fedpartial._src.methods.basic.fedprox import proximal_term
from fedpartial._src.methods.registry import MethodSpec, Option, at_least, check_values


def ditto(lam: float = 0.1) -> Method:
    """Ditto: FedAvg's global model, and a personal model per client trained with ``λ/2·‖v − w^t‖²``.

    Args:
      lam: the proximal weight λ tying each personal model to the global one.

    Returns:
      The :class:`~fedpartial.Method` (``--method ditto``).
    """
    check_values("ditto", SPEC.options, lam=lam)
    personal_step = make_method("ditto-personal", objective=with_penalty(proximal_term(lam)))

    def init(ctx: MethodContext, view: InitView) -> MethodState:
        return MethodState(clients=broadcast_clients(without_frozen(view.global_vars), ctx.num_clients))

    def update(ctx: MethodContext, view: RoundView) -> MethodState:
        if view.client_lr is None:
            raise UserError("ditto trains each client's personal model at the client's learning rate: build the "
                            "round with fedpartial.client_sgd (a plain optax transformation hides its rate).")
        settings = ctx.client_optimizer
        keys = jax.vmap(lambda i: jax.random.fold_in(view.key, i))(view.cohort.client_ids)
        personal, _, _ = train_models(
            ctx, personal_step, client_sgd(1.0, settings.momentum, settings.weight_decay), view.client_state,
            view.data, keys, global_vars=view.global_vars, plans=ClientPlan(lr_scale=view.client_lr),
            track_batch_stats=not ctx.batch_statistics)
        clients = scatter_clients(view.method_state.clients, cohort_rows(view), personal, view.cohort.valid)
        return view.method_state._replace(clients=clients)

    def personal(ctx: MethodContext, state: MethodState, global_vars: dict) -> PersonalModels:
        return PersonalModels(variables=with_frozen(state.clients, global_vars))  # a LoRA base: one copy

    return make_method("ditto", init=init, update=update, personal=personal,
                       capabilities=Capabilities(personalised=True, host_client_state=True, local_passes=2))


SPEC = MethodSpec("ditto", ditto, "FedAvg, plus a personal model per client trained with λ/2·‖v − w_global‖².",
                  (Option("lam", float, 0.1, "Ditto: the personal models' proximal coefficient λ (default 0.1)",
                          at_least(0.0)),))
