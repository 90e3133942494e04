"""models/pooling.py's max pooling equals ``nn.max_pool`` bit for bit: values, gradients (ties going to a window's
first largest element, as XLA's select_and_scatter), forward-over-reverse derivatives, under vmap, odd sizes."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedpartial._src.models.pooling import max_pool


def reference(x, window=(2, 2)):
    return nn.max_pool(x, window, strides=window, padding="VALID")


def ties(shape, seed=0):
    """Few distinct values (many ties in a window), and ReLU's zeros."""
    return jnp.asarray(np.random.default_rng(seed).integers(-2, 3, shape).astype(np.float32))


@pytest.mark.parametrize("shape, window", [((3, 8, 6, 4), (2, 2)), ((2, 7, 9, 3), (2, 2)), ((2, 9, 6, 2), (3, 2)),
                                           ((1, 25, 24, 2), (12, 12))])  # 144 places: wider than int8
def test_values_and_gradients_equal_nn_max_pool_bit_for_bit(shape, window):
    for x in (jax.random.normal(jax.random.key(0), shape), ties(shape), jax.nn.relu(ties(shape, 1))):
        y, pull = jax.vjp(lambda v: max_pool(v, window), x)
        y_ref, pull_ref = jax.vjp(lambda v: reference(v, window), x)
        g = jax.random.normal(jax.random.key(1), y.shape)
        np.testing.assert_array_equal(y, y_ref)
        np.testing.assert_array_equal(pull(g)[0], pull_ref(g)[0])


def test_a_tie_sends_the_gradient_to_the_first_largest_element_only():
    x = jnp.array([[1.0, 3.0], [3.0, 0.0]]).reshape(1, 2, 2, 1)
    grad = jax.grad(lambda v: max_pool(v).sum())(x)
    np.testing.assert_array_equal(grad.reshape(2, 2), [[0.0, 1.0], [0.0, 0.0]])


def test_forward_over_reverse_and_vmap_equal_nn_max_pool():
    """A Hessian-vector product (FedAD's criterion differentiates twice) through conv -> ReLU -> pool, per client."""
    xs = jax.random.normal(jax.random.key(2), (3, 2, 6, 6, 2))  # 3 clients
    w = jax.random.normal(jax.random.key(3), (3, 3, 2, 4))
    v = jax.random.normal(jax.random.key(4), w.shape)

    def hvp(pool):
        def loss(w, x):
            z = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
            return jnp.sum(pool(jax.nn.relu(z)) ** 2)
        return jax.vmap(lambda x: jax.jvp(lambda u: jax.grad(loss)(u, x), (w,), (v,))[1])(xs)

    np.testing.assert_array_equal(hvp(max_pool), hvp(reference))
