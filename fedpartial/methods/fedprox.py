"""FedProx (Li et al. 2020): FedAvg whose local objective adds ``μ/2 ||w - w_global||²``."""

import jax
import jax.numpy as jnp

from fedpartial.methods.base import Method, make_method


def proximal_term(mu: float):
    """A regularizer ``μ/2 Σ ||w - w_global||²`` over the model's parameters."""
    if mu < 0:
        raise ValueError(f"FedProx μ must be ≥ 0, got {mu}.")

    def regularizer(ctx, params, batch, global_vars, client_state):
        del ctx, batch, client_state
        sq = jax.tree.map(lambda p, g: jnp.sum(jnp.square(p - g)), params, global_vars["params"])
        return 0.5 * mu * sum(jax.tree.leaves(sq))

    return regularizer


def fedprox(mu: float = 0.01) -> Method:
    """FedProx with proximal coefficient ``mu``."""
    return make_method("fedprox", regularizer=proximal_term(mu))
