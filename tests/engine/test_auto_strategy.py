"""The 'auto' strategy rule: by platform and model (benchmarks/results holds the measurements behind it)."""

import jax
import pytest

from fedpartial._src.engine.strategy import default_strategy, fused, parse_strategy, stepwise


@pytest.mark.parametrize("model", ["mlp", "cnn", None])
def test_cpu_runs_one_client_at_a_time_and_accelerators_fuse_the_cohort(model, request):
    m = None if model is None else request.getfixturevalue(model)
    assert default_strategy("cpu", m) == stepwise(1)
    for platform in ("gpu", "tpu", "cuda", "rocm"):
        assert default_strategy(platform, m) == fused(None)


def test_auto_resolves_for_this_platform_and_model(mlp, cnn):
    for m in (mlp, cnn, None):
        assert parse_strategy("auto", m) == default_strategy(jax.default_backend(), m)
    assert parse_strategy("stepwise:3", cnn) == stepwise(3)  # explicit choices are kept


def test_a_lora_model_fuses_the_cohort_on_every_platform(mlp):
    """Its frozen base is shared: vmapped, each base product is one over every client's examples."""
    from fedpartial._src.models.lora import lora

    adapted = lora(mlp, 2)
    for platform in ("cpu", "gpu", "tpu"):
        assert default_strategy(platform, adapted) == fused(None)
