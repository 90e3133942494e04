"""SVCCA on cases with known answers."""

import jax
import numpy as np
import pytest

from fedpartial._src.core.errors import UserError
from fedpartial._src.analysis.similarity import canonical_correlations, layer_svcca, svcca


def signals(n=2000, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 4)), rng.normal(size=(n, 4)), rng


def test_a_rotated_copy_is_identical():
    z, _, rng = signals()
    a = np.concatenate([10 * z, 0.01 * rng.normal(size=(len(z), 6))], axis=1)  # 4 strong directions + noise
    q, _ = np.linalg.qr(rng.normal(size=(10, 10)))
    assert float(svcca(a, a @ q * 3.0 + 5.0)) == pytest.approx(1.0, abs=1e-4)


def test_half_of_the_directions_shared_gives_one_half():
    z, w, rng = signals()
    a = 10 * z
    b = 10 * np.concatenate([z[:, :2] @ np.array([[2.0, 1.0], [0.0, 1.0]]), w[:, 2:]], axis=1)
    rho = canonical_correlations(a, b)
    np.testing.assert_allclose(rho[:2], 1.0, atol=1e-4)
    assert float(rho[2]) < 0.1
    assert float(svcca(a, b)) == pytest.approx(0.5, abs=0.05)


def test_unrelated_activations_are_near_zero():
    z, w, _ = signals(n=5000)
    assert float(svcca(z, w)) < 0.05


def test_conv_maps_are_read_per_position_and_bad_input_is_refused():
    z, _, rng = signals(n=512)
    maps = z.reshape(32, 4, 4, 4)
    assert float(svcca(maps, maps[..., ::-1])) == pytest.approx(1.0, abs=1e-4)  # channels permuted
    with pytest.raises(UserError, match="same examples"):
        svcca(z, z[:10])
    with pytest.raises(UserError, match="k = 5 singular directions"):
        svcca(z, z, k=5)


def test_layer_svcca_of_a_model_with_itself():
    from fedpartial._src.models.adapter import from_linen
    from fedpartial._src.models.registry import build_model

    model = from_linen(build_model("mlp", 3, (6,)), input_shape=(6,), num_classes=3, name="mlp")
    v = model.init_variables(jax.random.key(0))
    x = np.random.default_rng(1).normal(size=(64, 6)).astype(np.float32)
    assert float(layer_svcca(model, v, v, x, "fc1")) == pytest.approx(1.0, abs=1e-4)
    other = model.init_variables(jax.random.key(1))
    assert float(layer_svcca(model, v, other, x, "fc1")) < 0.999
    with pytest.raises(UserError, match="not a layer or stage output"):
        layer_svcca(model, v, v, x, "nope")
