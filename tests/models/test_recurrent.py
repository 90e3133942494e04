"""LEAF's stacked LSTMs (shakespeare_lstm, sent140_lstm): their sizes, padding, stages; and a user's own model
named package.module:factory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedpartial._src.core.errors import UserError
from fedpartial._src.models import registry
from fedpartial._src.models.adapter import from_linen
from fedpartial._src.models.recurrent import StackedLSTM


def _count(module, shape):
    variables = jax.eval_shape(module.init, jax.random.key(0), jnp.zeros((1, *shape), jnp.int32))
    return {k: sum(int(np.prod(l.shape)) for l in jax.tree.leaves(v)) for k, v in variables["params"].items()}


def test_shakespeare_lstm_is_leafs_embedding_8_and_two_lstms_of_256():
    counts = _count(registry.build_model("shakespeare_lstm", 81, (80,)), (80,))
    assert counts == {"embedding": 82 * 8, "lstm1": 8 * 1024 + 256 * 1024 + 1024,
                      "lstm2": 256 * 1024 + 256 * 1024 + 1024, "head": 256 * 81 + 81}


def test_sent140_lstm_is_leafs_two_lstms_of_100_and_dense_30():
    counts = _count(registry.build_model("sent140_lstm", 2, (25,)), (25,))
    assert counts == {"embedding": 10_000 * 300, "lstm1": 300 * 400 + 100 * 400 + 400,
                      "lstm2": 100 * 400 + 100 * 400 + 400, "fc1": 100 * 30 + 30, "head": 30 * 2 + 2}


@pytest.fixture(scope="module")
def small():
    module = StackedLSTM(num_classes=5, vocab_size=12, embed_dim=4, hidden=(6, 7), dense=(3,))
    variables = module.init(jax.random.key(1), jnp.zeros((1, 6), jnp.int32))
    return module, variables


def test_trailing_padding_changes_nothing_and_stages_compose(small):
    module, variables = small
    x = jnp.array([[3, 4, 5, 0, 0, 0], [3, 4, 5, 6, 7, 8]])
    short = module.apply(variables, x[:1, :3])
    out = module.apply(variables, x)
    np.testing.assert_allclose(out[0], short[0], rtol=1e-5, atol=1e-6)
    assert not np.allclose(out[0], out[1])
    # the state after the last real token is what the dense layers read: running the stages one by one agrees
    h = x
    for s in range(len(module.stage_names)):
        h = module.apply(variables, h, start=s, stop=s + 1)
    np.testing.assert_allclose(h, out, rtol=1e-5, atol=1e-6)
    assert module.stage_names == ("embedding", "lstm1", "lstm2", "fc1", "head")


def test_a_users_model_by_package_module_factory(tmp_path, monkeypatch):
    (tmp_path / "my_models.py").write_text(
        "import flax.linen as nn\n"
        "class Tiny(nn.Module):\n"
        "    '''A one-layer model.'''\n"
        "    num_classes: int\n"
        "    @nn.compact\n"
        "    def __call__(self, x, train=False):\n"
        "        return nn.Dense(self.num_classes)(x.reshape(x.shape[0], -1))\n"
        "def factory(num_classes, input_shape):\n"
        "    return Tiny(num_classes)\n"
        "factory.sequential = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name, sequential in (("my_models:factory", True), ("my_models:Tiny", False)):
        spec = registry.find_model(name)
        assert spec.sequential is sequential
        module = registry.build_model(name, 3, (4,))
        model = from_linen(module, input_shape=(4,), num_classes=3, name=name)
        assert model.apply(model.init_variables(jax.random.key(0)), jnp.ones((2, 4)), False)[0].shape == (2, 3)
    with pytest.raises(UserError, match=r"^model 'my_models:nothing': module 'my_models' has no 'nothing'\.$"):
        registry.find_model("my_models:nothing")
    with pytest.raises(UserError, match=r"^model 'no_such_module:f': module 'no_such_module' cannot be imported"):
        registry.find_model("no_such_module:f")
