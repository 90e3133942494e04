"""The mask helpers the documentation points a method author to: a mask from layer names, and an element level
checked against the parameters it must be shaped like."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedpartial import UserError, masks


def test_from_layer_names_turns_on_the_named_layers(mlp):
    names = [layer.name for layer in mlp.structure.layers]
    m = masks.from_layer_names(mlp.structure, [names[-1]], batch_shape=(3,))
    assert m.layers.shape == (3, len(names))
    np.testing.assert_array_equal(np.asarray(m.layers[0]), [n == names[-1] for n in names])
    with pytest.raises(UserError, match=rf"no layer named 'fc9'; its layers are {', '.join(names)}\."):
        masks.from_layer_names(mlp.structure, ["fc9"])


def test_an_element_level_missing_a_layer_is_named(mlp):
    params = mlp.init_variables(jax.random.key(0))["params"]
    whole = jax.tree.map(lambda p: jnp.ones(p.shape, bool), params)
    last = list(params)[-1]
    short = {k: v for k, v in whole.items() if k != last}
    with pytest.raises(UserError, match=rf"no entry for the parameter {last}/"):
        masks.with_elements(masks.full(mlp.structure), short, like=params)
    unchecked = masks.with_elements(masks.full(mlp.structure), short)  # checked when the engine expands it
    with pytest.raises(UserError, match=rf"no entry for the parameter {last}/"):
        masks.expand(mlp.structure, unchecked, params)
    with pytest.raises(UserError, match=r"has an entry extra/w that the model's params do not have"):
        masks.with_elements(masks.full(mlp.structure), {**whole, "extra": {"w": jnp.ones(2, bool)}}, like=params)
    ok = masks.with_elements(masks.full(mlp.structure), whole, like=params)
    assert int(masks.count_elements(mlp.structure, ok, params)) == sum(p.size for p in jax.tree.leaves(params))
