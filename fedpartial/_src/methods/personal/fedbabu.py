"""FedBABU (Oh, Kim & Yun, ICLR 2022, "FedBABU: Towards Enhanced Representation for Federated Image
Classification", Algorithm 1): only the body is federated; the head stays at its random initialisation.

In a round a sampled client receives the body, trains it with the head frozen at its initial values
(which every client holds from the start: they never change, so they are not sent again), and uploads the
body, averaged with ``n_k`` weights.  The head is the model's last ``--head-layers`` layers (default 1,
the classifier: the paper's head is the last linear layer).

Evaluation is the paper's personalisation: every client fine-tunes the global model on its own training
data for ``--finetune-epochs`` epochs (default 5, the paper's τ_f) and is evaluated on its held-out split
(:attr:`Capabilities.finetune_epochs`, :mod:`fedpartial._src.experiment.finetune`).  The abstract speaks of
fine-tuning the head; we fine-tune the whole model (body and head), as the paper's evaluation protocol and
its released code do, with the run's client optimizer, learning rate and batch size (the head alone is not
offered).
"""

from __future__ import annotations

import jax.numpy as jnp

from fedpartial._src.core import masks
from fedpartial._src.methods.base import (Capabilities, ClientPlan, InitView, Method, MethodContext, MethodState,
                                          RoundView, make_method)
from fedpartial._src.methods.personal.parts import HEAD_LAYERS_OPTION, head_of
from fedpartial._src.methods.registry import MethodSpec, Option, at_least


def fedbabu(head_layers: int = 1, finetune_epochs: float = 5) -> Method:
    """FedBABU: the body is trained and shared, the head frozen at its initialisation; personalised accuracy
    after ``finetune_epochs`` epochs of per-client fine-tuning.

    Args:
      head_layers: the number of output-side layers in the head.
      finetune_epochs: epochs of per-client fine-tuning before personalised evaluation.

    Returns:
      The :class:`~fedpartial.Method` (``--method fedbabu``).
    """

    def init(ctx: MethodContext, view: InitView) -> MethodState:
        head_of("fedbabu", head_layers, ctx.structure.num_layers)  # a bad split is refused before anything runs
        return MethodState()

    def plan(ctx: MethodContext, view: RoundView) -> ClientPlan:
        body = ~jnp.asarray(head_of("fedbabu", head_layers, ctx.structure.num_layers))
        body = masks.from_layers(ctx.structure, jnp.broadcast_to(body, (ctx.cohort_size, body.shape[0])))
        return ClientPlan(train=body, download=body)  # uploads what it trained: the body

    return make_method("fedbabu", init=init, plan=plan, capabilities=Capabilities(
        personalised=True, finetune_epochs=finetune_epochs, streamable="per_client", asynchronous=True))


FINETUNE_EPOCHS_OPTION = Option("finetune_epochs", float, 5,
                                "FedBABU: epochs each client fine-tunes the global model on its own data before "
                                "its personalised evaluation (default 5, the paper's τ_f)", check=at_least(0.0))

SPEC = MethodSpec("fedbabu", fedbabu, "Body trained and shared, head frozen at its random init; each client "
                                      "fine-tunes the whole model before it is evaluated.",
                  (HEAD_LAYERS_OPTION, FINETUNE_EPOCHS_OPTION))
