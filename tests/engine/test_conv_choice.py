"""--conv-impl auto (engine/conv_choice.py), --compute-dtype bfloat16 (models/precision.py) and the compilation
cache folder (experiment/compile_cache.py): measured once and kept, what a run records, and what they compute."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedpartial._src.engine import conv_choice
from fedpartial._src.engine.strategy import default_strategy, fused, parse_strategy, stepwise
from fedpartial._src.experiment.config import ConfigError, RunConfig
from fedpartial._src.experiment.parts import timing_round
from fedpartial._src.experiment.simulation import run
from fedpartial._src.models import registry
from fedpartial._src.models.adapter import from_linen
from fedpartial._src.models.precision import with_compute_dtype

# The candidates timed and the runs recorded are a few tiny steps, checked for what is kept and recorded, not for
# speed: compiled at -O0 (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("engine_compiled_at_o0")
SHAPE = (8, 8, 1)


def small_cnn(impl: str = "lax"):
    module = registry.build_model("cnn2c1f", 10, SHAPE, conv_impl=impl).clone(features=(4, 8))
    return from_linen(module, input_shape=SHAPE, num_classes=10, sequential=True, name="small_cnn")


def test_auto_times_every_candidate_once_keeps_the_fastest_and_reads_it_back(tmp_path, mlp):
    built = []

    def build(impl):
        built.append(impl)
        return small_cnn(impl)

    first = conv_choice.choose(build, timing_round, batch_size=4, cohort_size=3, local_steps=1, cache_dir=str(tmp_path))
    pairs = conv_choice.candidates("cpu")
    assert first.how == "measured" and set(first.seconds) == {f"{i}/{lay}" for i, lay in pairs}
    chosen, fastest = first.seconds[f"{first.impl}/{first.layout}"], min(first.seconds.values())
    default = "/".join(pairs[0])  # kept unless another is faster by more than the margin
    assert chosen == fastest or (chosen == first.seconds[default] and fastest > (1 - conv_choice.MARGIN) * chosen)
    assert all(s > 0 for s in first.seconds.values())
    kept = json.loads((tmp_path / conv_choice.CACHE_FILE).read_text())
    assert [v["impl"] for v in kept.values()] == [first.impl]
    built.clear()
    again = conv_choice.choose(build, timing_round, batch_size=4, cohort_size=3, local_steps=1, cache_dir=str(tmp_path))
    assert again == first._replace(how="cached") and built == ["lax"]  # nothing timed the second time
    other = conv_choice.choose(lambda impl: mlp, timing_round, batch_size=4, cohort_size=3, local_steps=1,
                               cache_dir=str(tmp_path), time_dense=False)
    assert other == conv_choice.ConvChoice("lax", None, {}, "no convolutions")


def test_a_dense_model_has_its_layouts_timed_on_a_cpu(mlp):
    dense = conv_choice.choose(lambda impl: mlp, timing_round, batch_size=4, cohort_size=3, local_steps=1)
    assert dense.how == "measured" and dense.impl == "lax"
    assert set(dense.seconds) == {f"{i}/{lay}" for i, lay in conv_choice.DENSE_CPU_CANDIDATES}
    assert dense.layout in ("loop", "vmap", "map")
    assert conv_choice.candidates("gpu", convolutions=False) == ()  # a GPU runs the vmapped cohort unmeasured


def test_each_layout_is_timed_by_a_round_of_its_strategy_on_the_clients_its_work_allows(mlp, monkeypatch):
    """What is timed is a round as the run has it: ``round_for`` builds one per candidate, in the layout's strategy,
    for every client when their steps are within the budget, else for as many as fit it (at least two), and the
    time is scaled to the cohort."""
    built = []

    def round_for(model, strategy, clients, devices):
        built.append((strategy, clients, devices))
        return timing_round(model, strategy, clients, devices)

    flops = conv_choice.step_flops(mlp, 4)
    assert flops > 0 and conv_choice.step_flops(mlp, 8) == pytest.approx(2 * flops, rel=0.2)
    dense = conv_choice.choose(lambda impl: mlp, round_for, batch_size=4, cohort_size=3, local_steps=2)
    assert built == [(conv_choice.LAYOUT_STRATEGIES[lay], 3, None) for _, lay in conv_choice.DENSE_CPU_CANDIDATES]
    assert [s for s, _, _ in built] == [stepwise(1), fused(None), fused(1)]
    assert all(s > 0 for s in dense.seconds.values())
    # a budget of 2.5 clients' steps: two are timed (and the round's time scaled by 5 / 2); never fewer than two
    monkeypatch.setitem(conv_choice.TIMED_ROUND_FLOPS, "cpu", 2.5 * 2 * flops)
    assert conv_choice.timed_clients(mlp, 5, 2, 4) == 2
    monkeypatch.setitem(conv_choice.TIMED_ROUND_FLOPS, "cpu", 4.5 * 2 * flops)
    assert conv_choice.timed_clients(mlp, 5, 2, 4) == 4
    monkeypatch.setitem(conv_choice.TIMED_ROUND_FLOPS, "cpu", 0.0)
    assert conv_choice.timed_clients(mlp, 5, 2, 4) == conv_choice.MIN_TIMED_CLIENTS
    assert conv_choice.timed_clients(mlp, 1, 2, 4) == 1
    built.clear()
    calls = []
    monkeypatch.setattr(conv_choice, "_best", lambda run, repeats, beaten_by=0: calls.append(run) or 1.0)
    scaled = conv_choice.choose(lambda impl: mlp, round_for, batch_size=4, cohort_size=5, local_steps=2)
    assert {clients for _, clients, _ in built} == {2} and set(scaled.seconds.values()) == {2.5}


def test_a_timed_round_runs_on_stand_in_data_and_feeds_its_state_back(mlp):
    rnd = timing_round(mlp, fused(1), 2)
    run = conv_choice.prepare(rnd, local_steps=3, batch_size=4)  # compiled and run once here
    rounds = [int(run().round) for _ in range(2)]  # read before the next call: the fused round donates its state
    assert rounds == [2, 3]
    assert rnd.trace_count == 1  # the timed calls compile nothing
    cohort = conv_choice.stand_in_cohort(mlp, 2, 3, 4)
    assert cohort.data.x.shape == (2, 3, 4, *mlp.input_shape) and cohort.data.step_mask.all()


def test_the_default_candidate_is_kept_unless_another_is_clearly_faster():
    assert conv_choice._pick({"lax/loop": 1.0, "mapped/map": 0.95, "hybrid/vmap": 2.0}) == ("lax", "loop")
    assert conv_choice._pick({"lax/loop": 1.0, "mapped/map": 0.85, "hybrid/vmap": 0.8}) == ("hybrid", "vmap")


def test_the_measured_layout_decides_the_auto_strategy(cnn):
    for platform in ("cpu", "gpu"):
        assert default_strategy(platform, cnn, "vmap") == fused(None)
        assert default_strategy(platform, cnn, "loop") == stepwise(1)
        assert default_strategy(platform, cnn, "map") == fused(1)  # the round one program, clients a loop in it
    assert parse_strategy("auto", cnn, "vmap") == fused(None)
    assert parse_strategy("stepwise:3", cnn, "vmap") == stepwise(3)  # an explicit strategy is kept
    assert default_strategy("cpu", cnn, None) == stepwise(1)  # not measured: the platform's rule


def test_bfloat16_trains_in_bfloat16_and_evaluates_in_float32():
    model = small_cnn()
    low = with_compute_dtype(model, "bfloat16")
    variables = model.init_variables(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (4, *SHAPE))
    np.testing.assert_array_equal(low.apply(variables, x, False)[0], model.apply(variables, x, False)[0])
    want, got = model.apply(variables, x, True)[0], low.apply(variables, x, True)[0]
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=0.05, atol=0.05 * float(jnp.max(jnp.abs(want))))

    def loss(p, m):
        return jnp.sum(m.apply({**variables, "params": p}, x, True)[0] ** 2)

    grads = jax.grad(loss)(variables["params"], low)
    assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}  # parameters' dtype
    hlo = jax.jit(jax.grad(loss), static_argnums=1).lower(variables["params"], low).as_text()
    assert "convolution" in hlo and "bf16" in hlo.split("convolution")[1].split("\n")[0]
    assert with_compute_dtype(model, "float32") is model


def test_a_run_records_its_lowering_dtype_and_compile_time(tmp_path):
    config = RunConfig(model="cnn2c1f", num_clients=4, cohort_size=2, rounds=2, local_steps=1, local_epochs=None,
                       conv_impl="im2col", compute_dtype="bfloat16", out_dir=str(tmp_path), run_name="r")
    summary = run(config)
    plain = run(dataclasses.replace(config, conv_impl="lax", compute_dtype="float32", out_dir=None))
    # the simulated devices' work is the model's, however the simulator lowers or rounds it
    assert summary["total_client_flops"] == plain["total_client_flops"] > 0
    assert summary["total_simulated_time_s"] == plain["total_simulated_time_s"]
    env = json.loads((tmp_path / "r" / "environment.json").read_text())
    assert env["conv_impl"]["impl"] == "im2col" and env["conv_impl"]["how"] == "--conv-impl"
    assert env["compute_dtype"] == "bfloat16" and env["compile_cache_dir"] == jax.config.jax_compilation_cache_dir
    assert summary["conv_impl"] == "im2col (--conv-impl)" and summary["compute_dtype"] == "bfloat16"
    assert 0 <= summary["compile_time_s"] <= summary["first_round_time_s"]
    for bad, flag in (({"conv_impl": "fft"}, "--conv-impl 'fft'"), ({"compute_dtype": "float16"}, "--compute-dtype")):
        with pytest.raises(ConfigError, match=flag):
            RunConfig(**bad).validate()


def test_the_compile_cache_defaults_to_the_user_cache_folder_and_can_be_turned_off(tmp_path):
    code = ("from fedpartial._src.experiment import compile_cache as c; import jax; "
            "print(c.enable({on}), jax.config.jax_compilation_cache_dir)")
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["XDG_CACHE_HOME"] = str(tmp_path)

    def folder(on):
        out = subprocess.run([sys.executable, "-c", code.format(on=on)], env=env, capture_output=True, text=True,
                             check=True)
        return out.stdout.split()

    want = str(tmp_path / "fedpartial" / "jax")
    assert folder(True) == [want, want] and os.path.isdir(want)
    assert folder(False) == ["None", "None"]
    env["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path / "own")  # a folder the user chose is kept
    assert folder(True) == [str(tmp_path / "own")] * 2
