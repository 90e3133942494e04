"""FedProx (Li et al. 2020): FedAvg whose local objective adds ``μ/2 ||w - w_global||²``."""

import jax
import jax.numpy as jnp

from fedpartial._src.core.errors import UserError
from fedpartial._src.methods.base import Capabilities, Method, make_method, with_penalty
from fedpartial._src.methods.registry import MethodSpec, Option, at_least, check_values


def proximal_term(mu: float):
    """A penalty ``μ/2 Σ ||w - w_global||²`` over the model's parameters."""
    if mu < 0:
        raise UserError(f"FedProx μ must be ≥ 0, got {mu}.")

    def term(ctx, params, step):
        del ctx
        sq = jax.tree.map(lambda p, g: jnp.sum(jnp.square(p - g)), params, step.global_vars["params"])
        return 0.5 * mu * sum(jax.tree.leaves(sq))

    return term


def fedprox(mu: float = 0.01) -> Method:
    """FedProx with proximal coefficient ``mu``.

    Args:
      mu: the proximal coefficient μ of ``μ/2·‖w − w^t‖²`` (``--mu``; 0: FedAvg).

    Returns:
      The :class:`~fedpartial.Method` (``--method fedprox``).
    """
    check_values("fedprox", SPEC.options, mu=mu)
    return make_method("fedprox", objective=with_penalty(proximal_term(mu)),
                       capabilities=Capabilities(streamable="per_client", asynchronous=True))


SPEC = MethodSpec("fedprox", fedprox, "FedAvg whose local objective adds μ/2·||w − w_global||².",
                  options=(Option("mu", float, 0.01, "FedProx proximal coefficient μ", at_least(0.0)),))
