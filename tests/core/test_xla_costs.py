"""XLA's cost analysis read one way (engine's timed-client budget and the costs layer's FLOP counts)."""

import math

import jax
import jax.numpy as jnp

from fedpartial._src.core.xla_costs import flops_of


def test_flops_are_read_from_a_dict_or_a_list_of_one_and_unusable_values_are_none():
    assert flops_of({"flops": 12.0}) == 12.0 and flops_of([{"flops": 3}]) == 3.0
    for unusable in (None, {}, [], {"flops": math.nan}, {"flops": math.inf}, {"flops": -1.0}):
        assert flops_of(unusable) is None, unusable


def test_a_lowered_matrix_product_counts_two_flops_per_multiply_add():
    a = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    b = jax.ShapeDtypeStruct((8, 3), jnp.float32)
    assert flops_of(jax.jit(jnp.matmul).lower(a, b).cost_analysis()) == 2 * 4 * 8 * 3
