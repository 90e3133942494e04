"""The convolution lowerings (fedpartial._src.models.conv) compute lax's convolution: forward and gradient,
for one client and vmapped over clients with their own or shared weights, for every conv shape the zoo uses."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedpartial._src.core.errors import UserError
from fedpartial._src.models import conv as conv_lowerings
from fedpartial._src.models import registry
from fedpartial._src.models.conv import CONV_IMPLS, lowering

# (kernel, conv keyword arguments): cnn2c1f/femnist (5x5 SAME), lenet5 (5x5 VALID), vgg9 (3x3 SAME, no bias),
# resnet20 (3x3 pad 1 stride 2, 1x1 shortcut stride 2), and dilation / feature groups, which no zoo model uses
# (5x5 SAME is the hybrid test's and the zoo test's)
CASES = {
    "5x5-valid": ((5, 5), {"padding": "VALID"}),
    "3x3-stride2-nobias": ((3, 3), {"strides": (2, 2), "padding": 1, "use_bias": False}),
    "1x1-stride2": ((1, 1), {"strides": (2, 2), "padding": 0}),
    "3x3-dilated-grouped": ((3, 3), {"kernel_dilation": (2, 2), "feature_group_count": 2}),
}
K = 3  # clients


def _loss(impl, kernel, kw):
    conv = nn.Conv(4, kernel, conv_general_dilated=lowering(impl), **kw)
    return lambda v, x: jnp.sum(jnp.sin(conv.apply(v, x)))


def _results(impl, kernel, kw, v, vs, x, xs):
    """Loss and gradients for one client, K clients with their own weights, K clients sharing ``v`` (one jit)."""
    grad = jax.value_and_grad(_loss(impl, kernel, kw), argnums=(0, 1))
    return jax.jit(lambda *a: (grad(a[0], a[2]), jax.vmap(grad)(a[1], a[3]), jax.vmap(grad, in_axes=(None, 0))(
        a[0], a[3])))(v, vs, x, xs)


@pytest.fixture(scope="module")
def inputs():
    x = jax.random.normal(jax.random.key(0), (2, 7, 7, 4))
    xs = jax.random.normal(jax.random.key(1), (K, *x.shape))
    return x, xs


@pytest.mark.parametrize("case", sorted(CASES))
def test_lowerings_equal_lax_forward_and_gradient(case, inputs):
    kernel, kw = CASES[case]
    x, xs = inputs
    v = nn.Conv(4, kernel, **kw).init(jax.random.key(2), x)
    vs = jax.tree.map(lambda a: a[None] + 0.1 * jax.random.normal(jax.random.key(3), (K, *a.shape)), v)  # own
    want = _results("lax", kernel, kw, v, vs, x, xs)
    for impl in CONV_IMPLS[1:]:
        got = _results(impl, kernel, kw, v, vs, x, xs)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5 * float(jnp.max(jnp.abs(w))),
                                       err_msg=f"{impl} {case}")


def test_hybrid_is_lax_for_one_client_and_a_batched_matmul_across_clients(inputs):
    x, xs = inputs
    wide = nn.Conv(24, (5, 5), conv_general_dilated=lowering("hybrid"))  # over 16 features: not widened
    w = wide.init(jax.random.key(2), x)
    np.testing.assert_array_equal(wide.apply(w, x), nn.Conv(24, (5, 5)).apply(w, x))  # lax itself, bit for bit
    conv = nn.Conv(4, (5, 5), conv_general_dilated=lowering("hybrid"))
    v = conv.init(jax.random.key(2), x)
    vs = jax.tree.map(lambda a: jnp.stack([a] * K), v)
    hlo = jax.jit(jax.vmap(conv.apply)).lower(vs, xs).compile().as_text()
    assert "feature_group_count" not in hlo and "convolution(" not in hlo  # no grouped conv: a batched dot


def test_zoo_models_keep_their_parameters_and_outputs():
    x = jax.random.normal(jax.random.key(0), (2, 8, 8, 1))
    lax_model = registry.build_model("cnn2c1f", 10, (8, 8, 1))
    v = lax_model.init(jax.random.key(1), x)
    want = lax_model.apply(v, x)
    for impl in CONV_IMPLS[1:]:
        model = registry.build_model("cnn2c1f", 10, (8, 8, 1), conv_impl=impl)
        assert jax.tree.map(jnp.shape, model.init(jax.random.key(1), x)) == jax.tree.map(jnp.shape, v)
        np.testing.assert_allclose(model.apply(v, x), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(UserError, match="'winograd' is unknown"):
        registry.build_model("cnn2c1f", 10, (8, 8, 1), conv_impl="winograd")


def test_mapped_is_lax_for_one_client_with_plain_gradient_convs_and_a_loop_across_clients(inputs):
    x, xs = inputs
    wide = nn.Conv(24, (5, 5), conv_general_dilated=lowering("mapped"))  # over 16 features: not widened
    w = wide.init(jax.random.key(2), x)
    np.testing.assert_array_equal(wide.apply(w, x), nn.Conv(24, (5, 5)).apply(w, x))  # lax itself, bit for bit
    conv = nn.Conv(4, (5, 5), conv_general_dilated=lowering("mapped"))
    v = conv.init(jax.random.key(2), x)
    loss = lambda v, x: jnp.sum(jnp.sin(conv.apply(v, x)))  # noqa: E731
    plain_loss = lambda v, x: jnp.sum(jnp.sin(nn.Conv(4, (5, 5)).apply(v, x)))  # noqa: E731

    def conv_labels(f):  # of the gradient computed inside a loop
        grad = jax.grad(f, argnums=(0, 1))
        hlo = jax.jit(lambda v, xs: jax.lax.map(lambda x: grad(v, x), xs)).lower(v, xs).compile().as_text()
        return [line.split("dim_labels=")[1].split(",")[0] for line in hlo.splitlines() if "dim_labels=" in line]

    # inside a loop every convolution, the two gradients included, is an ordinary channels-last one (what
    # XLA:CPU runs fast there); autodiff's own gradients keep swapped batch and feature dimensions
    assert conv_labels(loss) == ["b01f_01io->b01f"] * 3
    assert len(set(conv_labels(plain_loss))) > 1
    vs = jax.tree.map(lambda a: jnp.stack([a] * K), v)
    looped = jax.jit(jax.vmap(jax.grad(loss))).lower(vs, xs).compile().as_text()
    assert "feature_group_count" not in looped and "while" in looped  # a loop over clients, not a grouped conv
    # clients of replicas: nested vmaps loop again, and agree with lax's
    vss = jax.tree.map(lambda a: jnp.stack([a, 1.5 * a]), vs)
    xss = jnp.stack([xs, -xs])
    want = jax.vmap(jax.vmap(jax.grad(plain_loss)))(vss, xss)
    got = jax.jit(jax.vmap(jax.vmap(jax.grad(loss))))(vss, xss)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-5)


@pytest.mark.skipif(not conv_lowerings._WIDENS, reason="widened from jax 0.10 (XLA:CPU's YNNPACK fusions)")
@pytest.mark.parametrize("impl", ["hybrid", "mapped"])
def test_a_convolution_of_few_features_runs_widened_on_a_cpu(impl, inputs):
    """XLA:CPU runs a convolution of at most 16 input and output features on Eigen's kernels, 4x slower than
    YNNPACK's: on a CPU, the lowerings' convolutions (forward and both gradients) widen such a kernel to 32 output
    features and slice the result; a wider one, a strided gradient (input dilation: not YNNPACK's) and an
    accelerator are left alone.  The values are the tests above's (lax's within float32 rounding)."""
    x, _ = inputs

    def conv_outputs(features, strides=(1, 1)):
        conv = nn.Conv(features, (3, 3), strides=strides, conv_general_dilated=lowering(impl))
        v = conv.init(jax.random.key(2), x)
        grad = jax.grad(lambda v, x: jnp.sum(jnp.sin(conv.apply(v, x))), argnums=(0, 1))
        hlo = jax.jit(grad).lower(v, x).compile().as_text()
        return sorted(line.split(" convolution(")[0].split("= ")[-1] for line in hlo.splitlines()
                      if " convolution(" in line)

    if impl == "mapped":  # forward, and its own two gradient convolutions: the input's and the kernel's
        assert conv_outputs(4) == ["f32[2,7,7,32]{3,2,1,0}"] * 2 + ["f32[4,3,3,32]{3,2,1,0}"]
        # stride 2: the input gradient spreads the output's (input dilation) and stays as it was
        assert sum(",32]" in out for out in conv_outputs(4, (2, 2))) == 2
    else:  # hybrid's one-client gradient is autodiff's, of the widened forward
        assert "f32[2,7,7,32]{3,2,1,0}" in conv_outputs(4)
    assert not any(",32]" in out for out in conv_outputs(24))
    conv = nn.Conv(4, (3, 3), conv_general_dilated=lowering(impl))
    v = conv.init(jax.random.key(2), x)
    traced = jax.jit(conv.apply).trace(v, x)
    assert "x32xf32>" in traced.lower(lowering_platforms=("cpu",)).as_text()
    for accelerator in ("cuda", "tpu"):  # lowered for an accelerator, without one here: left alone
        assert "x32xf32>" not in traced.lower(lowering_platforms=(accelerator,)).as_text()
