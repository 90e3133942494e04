"""Cost accounting: layer output shapes, memory footprint, index bytes, FedSPU's memory table."""

import numpy as np
import pytest

from fedpartial._src.costs import footprint as costs
from fedpartial._src.core import masks
from fedpartial._src.methods.layerwise.fedldf import index_bytes as fedldf_index_bytes
from fedpartial._src.models import registry, zoo
from fedpartial._src.models.adapter import from_linen, from_nnx


@pytest.fixture(scope="module")
def cnn2c1f():
    module = registry.build_model("cnn2c1f", 62, (28, 28, 1))
    return from_linen(module, input_shape=(28, 28, 1), num_classes=62, sequential=True, name="cnn2c1f")


def _mlp_mask(fc1, fc2, layers=(True, True, True)):
    """TinyMLP mask keeping the first ``fc1`` of 6 and ``fc2`` of 5 units, head all on."""
    return masks.Mask(np.array(layers), (np.arange(6) < fc1, np.arange(5) < fc2, np.ones(3, bool)))


# ------------------------------------------------------------------ layer output shapes


def test_layer_output_shapes_tiny_models(mlp, cnn):
    assert costs.layer_output_shapes(mlp) == ((6,), (5,), (3,))
    # conv1 on the 4x4 input (SAME), conv2 after one 2x2 pool, then the head.
    assert costs.layer_output_shapes(cnn) == ((4, 4, 3), (2, 2, 4), (3,))


def test_layer_output_shapes_zoo_cnn(cnn2c1f):
    assert cnn2c1f.structure.layer_names == ("conv1", "conv2", "head")
    assert costs.layer_output_shapes(cnn2c1f) == ((28, 28, 32), (14, 14, 64), (62,))


def test_layer_output_shapes_needs_linen():
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.fc = nnx.Linear(4, 3, rngs=rngs)

        def __call__(self, x):
            return self.fc(x)

    model = from_nnx(Net(nnx.Rngs(0)), input_shape=(4,), num_classes=3, sequential=True)
    with pytest.raises(ValueError, match="layer 'fc'.*need a linen model"):
        costs.layer_output_shapes(model)


# ------------------------------------------------------------------ memory footprint

# TinyMLP parameters (input 4): fc1 4*6+6 = 30, bn1 scale+bias 6+6 = 12, fc2 6*5+5 = 35,
# head 5*3+3 = 18 → 95 float32 = 380 bytes.  Layer outputs: 6, 5, 3 units, no spatial dims.


def test_memory_full_model_by_hand(mlp):
    out = costs.memory_footprint(mlp, batch_size=8)
    assert out == {
        "weights_bytes": 95 * 4,
        "gradient_bytes": 95 * 4,
        "activation_bytes": 8 * (6 + 5 + 3) * 4,  # 448
        "total_bytes": 380 + 380 + 448,
    }


def test_memory_partial_training_by_hand(mlp):
    # fc1 keeps 2 of 6 units, fc2 1 of 5, head all 3.  Trained parameters (wired):
    # fc1 4*2+2 = 10, bn1 2+2 = 4, fc2 2*1+1 = 3, head 1*3+3 = 6 → 23.
    out = costs.memory_footprint(mlp, batch_size=8, trained=_mlp_mask(2, 1))
    assert out == {
        "weights_bytes": 95 * 4,  # held: the full model (FedSPU)
        "gradient_bytes": 23 * 4,
        "activation_bytes": 8 * (2 + 1 + 3) * 4,  # 192
        "total_bytes": 380 + 92 + 192,
    }


def test_memory_submodel_client_by_hand(mlp):
    # A dropout client holds and trains only its sub-model: weights = gradients.
    out = costs.memory_footprint(mlp, batch_size=2, held=_mlp_mask(2, 1), bytes_per_value=2)
    assert out["weights_bytes"] == out["gradient_bytes"] == 23 * 4
    assert out["activation_bytes"] == 2 * (2 + 1 + 3) * 2
    # An off layer trains nothing and stores no activation.
    off = costs.memory_footprint(mlp, batch_size=2, trained=_mlp_mask(6, 5, (True, False, True)))
    assert off["gradient_bytes"] == (95 - 35) * 4
    assert off["activation_bytes"] == 2 * (6 + 3) * 4


def test_memory_conv_activations_by_hand(cnn2c1f):
    out = costs.memory_footprint(cnn2c1f, batch_size=16)
    params = (5 * 5 * 1 * 32 + 32) + (5 * 5 * 32 * 64 + 64) + (7 * 7 * 64 * 62 + 62)
    assert out["weights_bytes"] == out["gradient_bytes"] == params * 4
    assert out["activation_bytes"] == 16 * (28 * 28 * 32 + 14 * 14 * 64 + 62) * 4


def test_memory_leading_axes_match_one_client_calls(mlp):
    counts = [(2, 1), (6, 5), (1, 3)]
    one = [_mlp_mask(a, b) for a, b in counts]
    stacked = masks.Mask(np.stack([m.layers for m in one]),
                         tuple(np.stack(n) for n in zip(*(m.neurons for m in one))))
    for kwargs in ({"trained": stacked}, {"held": stacked}):
        out = costs.memory_footprint(mlp, batch_size=4, **kwargs)
        for key, value in out.items():
            assert isinstance(value, np.ndarray) and value.shape == (3,), key
            expected = [costs.memory_footprint(mlp, batch_size=4, **{k: m for k in kwargs})[key] for m in one]
            np.testing.assert_array_equal(value, expected, err_msg=key)


@pytest.mark.parametrize("batch_size", [0, -3, 2.5, True])
def test_bad_batch_size(mlp, batch_size):
    with pytest.raises(ValueError, match=r"batch_size must be a positive integer, got"):
        costs.memory_footprint(mlp, batch_size=batch_size)


def test_mask_for_another_model_is_rejected(mlp):
    wrong = masks.Mask(np.ones(2, bool), (np.ones(6, bool), np.ones(5, bool)))
    with pytest.raises(ValueError, match="model has 3 layers"):
        costs.memory_footprint(mlp, batch_size=1, trained=wrong)


# ------------------------------------------------------------------ index bytes


def test_index_bytes_by_hand():
    model = from_linen(zoo.MLP(num_classes=3, hidden=(100, 10)), input_shape=(4,), num_classes=3,
                       sequential=True)
    s = model.structure
    assert s.units == (100, 10, 3)
    # Client 0: fc1 2 of 100 on → min(4*2, ⌈100/8⌉ = 13) = 8 (indices cheaper);
    #           fc2 3 of 10 on  → min(4*3, ⌈10/8⌉ = 2) = 2 (bit-mask cheaper)   → 10.
    # Client 1: fc1 4 on → min(16, 13) = 13 (bit-mask); fc2 none → 0            → 13.
    # The head (3 units, partly off here) is never counted.
    neurons = (np.arange(100) < np.array([[2], [4]]),
               np.arange(10) < np.array([[3], [0]]),
               np.array([[True, False, True], [False, False, False]]))
    mask = masks.from_neurons(s, neurons)
    out = costs.index_bytes(s, mask)
    assert out.dtype == np.int32 and out.shape == (2,)
    np.testing.assert_array_equal(out, [10, 13])
    # Same per-layer rule as FedLDF's FedADP upload cost.
    assert out[0] == fedldf_index_bytes(100, 2) + fedldf_index_bytes(10, 3)
    assert out[1] == fedldf_index_bytes(100, 4) + fedldf_index_bytes(10, 0)
    # One client (no leading axis) and 2-byte indices: fc1 min(4, 13) + fc2 min(6, 2).
    single = masks.from_neurons(s, tuple(n[0] for n in neurons))
    assert costs.index_bytes(s, single, index_bytes=2).shape == ()
    assert int(costs.index_bytes(s, single, index_bytes=2)) == 4 + 2


# ------------------------------------------------------------------ FedSPU table


def test_fedspu_table_tiny_mlp(mlp):
    rows = costs.fedspu_memory_table(mlp, batch_size=8)
    assert [r["p"] for r in rows] == [0.2, 0.4, 0.6, 0.8, 1.0]
    # p = 0.2 keeps max(1, round(1.2)) = 1 of fc1's 6 and round(1.0) = 1 of fc2's 5 units:
    # trained fc1 4*1+1 = 5, bn1 1+1 = 2, fc2 1*1+1 = 2, head 1*3+3 = 6 → 15 parameters.
    first = rows[0]
    assert first["fedspu_weights_bytes"] == first["full_weights_bytes"] == 380
    assert first["fedspu_gradient_bytes"] == 15 * 4
    assert first["fedspu_activation_bytes"] == 8 * (1 + 1 + 3) * 4
    assert first["full_bytes"] == 380 + 380 + 8 * 14 * 4


@pytest.mark.parametrize("name", ["mlp", "cnn2c1f"])
def test_fedspu_table_shape_of_the_curve(name, mlp, cnn2c1f):
    model = {"mlp": mlp, "cnn2c1f": cnn2c1f}[name]
    rows = costs.fedspu_memory_table(model, batch_size=16)
    last = rows[-1]
    assert last["p"] == 1.0 and last["reduction"] == 0.0 and last["fedspu_bytes"] == last["full_bytes"]
    footprints = [r["fedspu_bytes"] for r in rows]
    assert all(a < b for a, b in zip(footprints, footprints[1:]))  # smaller p, less memory
    for r in rows[:-1]:
        assert 0.0 < r["reduction"] < 1.0
        assert r["reduction"] == pytest.approx(1 - r["fedspu_bytes"] / r["full_bytes"])
        assert r["fedspu_bytes"] == (r["fedspu_weights_bytes"] + r["fedspu_gradient_bytes"]
                                     + r["fedspu_activation_bytes"])


def test_fedspu_table_needs_a_sequential_model():
    model = from_linen(zoo.MLP(num_classes=3, hidden=(5,)), input_shape=(4,), num_classes=3, sequential=False)
    with pytest.raises(ValueError, match="sequential"):
        costs.fedspu_memory_table(model, batch_size=1)


def test_a_lora_clients_footprint_holds_the_base_once_and_its_activations():
    """Weights: the frozen base and the adapters (the head once); gradients: the adapters and the head; activations:
    the base's (the backward pass to the adapters goes through it) plus each adapter's ``x A`` (batch · r)."""
    import flax.linen as nn

    from fedpartial._src.costs.flops import layer_costs
    from fedpartial._src.costs.footprint import memory_footprint
    from fedpartial._src.models.adapter import from_linen
    from fedpartial._src.models.lora import lora

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train=False):
            return nn.Dense(3, name="head")(nn.relu(nn.Dense(6, name="fc")(x)))

    base = from_linen(Net(), input_shape=(4,), num_classes=3, name="net")
    adapted = lora(base, 2, targets=["fc"])
    plain, got = memory_footprint(base, batch_size=5), memory_footprint(adapted, batch_size=5)
    adapters = 4 * (4 * 2 + 2 * 6)  # A [4, 2], B [2, 6], float32
    head = 4 * (6 * 3 + 3)
    assert got["weights_bytes"] == plain["weights_bytes"] + adapters
    assert got["gradient_bytes"] == adapters + head
    assert got["activation_bytes"] == plain["activation_bytes"] + 5 * 2 * 4
    # the adapters' layers have FLOPs of their own: x A (4 x 2) and (x A) B (2 x 6), per example
    a, b = adapted.lora.adapters[0].a_layer, adapted.lora.adapters[0].b_layer
    assert list(layer_costs(adapted).forward_flops[[a, b]]) == [2 * 4 * 2, 2 * 2 * 6]
