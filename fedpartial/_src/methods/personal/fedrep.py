"""FedRep (Collins et al., ICML 2021, "Exploiting Shared Representations for Personalized Federated Learning",
Algorithm 1): a shared representation (the body), a personal head, trained in turn (docs/decisions.md#fedrep).

In a round a sampled client starts from the global body and its own head, trains the **head**
with the body frozen for the first steps, then the **body** with the head frozen for the rest,
and uploads only the body (averaged with ``n_k`` weights); the head stays personal
(:mod:`fedpartial._src.methods.personal.parts`, :attr:`Method.step_plan` switching the train mask).

Choices where the paper is vague for this engine's local steps: ``--body-fraction`` (default 0.1)
of each client's real local steps train the body, the first ``round((1 − f)·steps)`` the head — the
paper's code trains the head for 9 of 10 local epochs and the body for 1, so both parts train every
round.  So that they do here too, a client with at least 2 real steps gives each part at least one
(2 steps at ``f = 0.1``: 1 head, 1 body, where rounding alone gives the body none); a client with one
step keeps the rounding (the head), and ``f = 0`` (head only) and ``f = 1`` (body only) are exact
(:func:`head_steps`).  The head is the last ``--head-layers`` layers (default 1, the classifier, as in
the paper).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fedpartial._src.core import masks
from fedpartial._src.methods.base import ClientPlan, Method, MethodContext, RoundView
from fedpartial._src.methods.personal.parts import HEAD_LAYERS_OPTION, head_of, personal_layers
from fedpartial._src.methods.registry import MethodSpec, Option


def check_body_fraction(value) -> str | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1
    return None if ok else "must be a fraction of the local steps between 0 and 1"


BODY_FRACTION_OPTION = Option("body_fraction", float, 0.1,
                              "FedRep: the share of each client's local steps that train the body, after the head "
                              "(default 0.1, the paper's 1 of 10 local epochs; rounded, but with 2 or more steps "
                              "each part gets at least one; 0 and 1 are exact)", check=check_body_fraction,
                              flag="--body-fraction")


def head_steps(real_steps: jax.Array, body_fraction: float) -> jax.Array:
    """The number of head steps of each client, the first of its local steps; the rest train the body.

    ``round((1 − body_fraction) · real_steps)`` (half to even), kept between 1 and ``real_steps − 1`` when a
    client has at least 2 steps and ``0 < body_fraction < 1``, so that both parts train every round.

    Args:
      real_steps: each client's number of real (unpadded) local steps, ``[K]``.
      body_fraction: the share of the steps that train the body, in ``[0, 1]``.

    Returns:
      The head steps, ``[K]`` int32.
    """
    steps = jnp.asarray(real_steps, jnp.float32)
    head = jnp.round(steps * (1.0 - body_fraction))
    if 0 < body_fraction < 1:
        head = jnp.where(steps >= 2, jnp.clip(head, 1, steps - 1), head)
    return head.astype(jnp.int32)


def fedrep(head_layers: int = 1, body_fraction: float = 0.1) -> Method:
    """FedRep: head steps (body frozen), then body steps (head frozen); the body is shared, the head personal.

    Args:
      head_layers: the number of output-side layers in the head.
      body_fraction: the share of each client's local steps spent on the body (the rest on the head).

    Returns:
      The :class:`~fedpartial.Method` (``--method fedrep``).
    """
    base = personal_layers("fedrep", lambda num_layers: head_of("fedrep", head_layers, num_layers))

    def plan(ctx: MethodContext, view: RoundView) -> ClientPlan:
        real_steps = jnp.sum(view.data.step_mask, axis=1)  # [K] (padding comes last)
        return base.plan(ctx, view)._replace(extra=head_steps(real_steps, body_fraction))

    def step_plan(ctx: MethodContext, plan: ClientPlan, key: jax.Array, step: jax.Array) -> ClientPlan:
        head = jnp.asarray(head_of("fedrep", head_layers, ctx.structure.num_layers))
        return plan._replace(train=masks.from_layers(ctx.structure, jnp.where(step < plan.extra, head, ~head)))

    return base._replace(plan=plan, step_plan=step_plan)


SPEC = MethodSpec("fedrep", fedrep, "Personal head trained first with the body frozen, then the shared body with "
                                    "the head frozen.", (HEAD_LAYERS_OPTION, BODY_FRACTION_OPTION))
