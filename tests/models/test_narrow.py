"""Width-reduced models (:mod:`fedpartial._src.models.narrow`): any model that says how to rebuild itself
narrower is narrowed (``from_linen(..., width=...)``), and one that cannot be is refused in one sentence."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedpartial._src.core.errors import UserError
from fedpartial._src.engine import graphs
from fedpartial._src.models.adapter import from_linen
from fedpartial._src.models.narrow import narrowed_model
from fedpartial._src.models.zoo import narrow_units

HIDDEN = (8, 6)


class Hidden2(nn.Module):
    """Not a zoo model: Dense(h1) → BN → ReLU → Dense(h2) → ReLU → Dense(3), its hidden outputs × ``scale``
    in training (so that HeteroFL's Scaler can be asked of it)."""

    hidden: tuple[int, int] = HIDDEN
    scale: float = 1.0

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = x.reshape((x.shape[0], -1))
        x = nn.Dense(self.hidden[0], name="fc1")(x) * (self.scale if train else 1.0)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9, name="bn1")(x))
        x = nn.relu(nn.Dense(self.hidden[1], name="fc2")(x) * (self.scale if train else 1.0))
        return nn.Dense(3, name="head")(x)


def at_width(ratio, scaler):
    return Hidden2(hidden=tuple(narrow_units(ratio, h) for h in HIDDEN), scale=1 / ratio if scaler else 1.0)


def adapt(**kw):
    return from_linen(Hidden2(), input_shape=(4,), num_classes=3, sequential=True, name="hidden2", **kw)


def random_variables(model, seed=0):
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(model.init_variables, jax.random.key(0))
    return jax.tree.map(lambda a: jnp.asarray(rng.uniform(0.5, 1.5, a.shape), jnp.float32), shapes)


def test_a_from_linen_model_with_a_width_hook_is_narrowed():
    model = adapt(width=at_width)
    narrow = narrowed_model(model, 0.5)
    assert narrow.structure.units == (4, 3, 3) and narrow.name == "hidden2@0.5"
    assert narrow.structure.layer_names == model.structure.layer_names
    assert narrowed_model(model, 0.5, scaler=False).structure.units == (4, 3, 3)
    # The engine's width graph asks the model: the narrow model run on the extracted leading units equals the
    # full model with every other unit's weights zeroed (BatchNorm in evaluation mode, no Scaler).
    graph = graphs.width(model, 0.5, scaler=False)
    variables = random_variables(model)
    part = graph.extract(variables)
    assert jax.tree.map(jnp.shape, part) == jax.tree.map(jnp.shape, jax.eval_shape(narrow.init_variables,
                                                                                 jax.random.key(0)))
    zeroed = graph.insert(jax.tree.map(jnp.zeros_like, variables), part)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(5, 4)), jnp.float32)
    small, _ = graph.apply(part, x, False)
    full, _ = model.apply(zeroed, x, False)
    np.testing.assert_allclose(small, full, rtol=1e-5, atol=1e-6)
    with pytest.raises(UserError, match="must be a number in"):
        narrowed_model(model, 1.5)


def test_a_model_that_cannot_be_narrowed_is_refused_in_one_sentence():
    model = adapt()  # no width hook, and not a zoo model's name
    for narrow in (lambda: narrowed_model(model, 0.5), lambda: graphs.width(model, 0.5)):
        with pytest.raises(UserError, match=r"model 'hidden2' has no width-reduced version: build it with "
                                            r"from_linen\(\.\.\., width=fn\)") as info:
            narrow()
        message = str(info.value)
        assert message.endswith(".") and ". " not in message and "\n" not in message


class Shallow(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        return nn.Dense(3, name="head")(x.reshape((x.shape[0], -1)))


def test_a_width_hook_that_changes_the_layers_is_refused():
    model = adapt(width=lambda ratio, scaler: Shallow())
    with pytest.raises(UserError, match="does not match the full model"):
        narrowed_model(model, 0.5)
