"""Smoke test of ``fedpartial bench``: the smoke preset end to end, the JSON's fields, skips and flag errors."""

import dataclasses
import json

import jax
import pytest

from fedpartial._src.bench import suite as bench
from fedpartial._src.cli import main as cli
from fedpartial._src.engine.round import FederatedRound
from fedpartial._src.engine.strategy import default_strategy
from fedpartial._src.engine.types import cohort_from_packed

# The module fixture below is costly: the module stays on one xdist worker (--dist loadgroup), which
# builds it once.
pytestmark = pytest.mark.xdist_group("throughput_smoke")


@pytest.fixture(scope="session")  # kept by its xdist group's worker (see test_sharding.py)
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "t.json"
    assert cli.main(["bench", "--preset", "smoke", "--out", str(out)]) == 0
    return json.loads(out.read_text()), out


def test_report_has_device_versions_and_settings(report):
    data, out = report
    assert data["benchmark"] == "throughput" and data["complete"] is True
    device = data["device"]
    assert device["backend"] == jax.default_backend() and device["jax_version"] == jax.__version__
    assert device["matmul_flops_per_s"] > 0 and device["matmul_size"] > 0
    assert data["config"]["preset"] == "smoke" and data["config"]["cohorts"] == [4]
    assert out.with_suffix(".png").stat().st_size > 0


def test_every_runner_is_measured_next_to_the_plain_loop(report):
    data, _ = report
    [record] = data["results"]
    settings = bench.PRESETS["smoke"]
    k, steps = record["cohort_size"], settings.local_steps
    assert (record["model"], k) == ("mlp", 4) and record["peak_memory_bytes"] > 0
    runners = {(e["method"], e["strategy"]): e for e in record["runners"]}
    auto = str(default_strategy(jax.default_backend()))
    assert set(runners) == {("fedavg", "plain_loop"), ("fedavg", "auto"), ("fedavg", "fused:2"),
                            ("fedldf", "auto"), ("fedldf", "fused:2")}
    for (method, strategy), e in runners.items():
        where = f"{method} {strategy}"
        assert "error" not in e, where
        assert e["rounds_per_s"] > 0 and e["warmup_s"] > 0, where
        assert e["client_steps_per_s"] == pytest.approx(k * steps * e["rounds_per_s"]), where
        assert e["ratio_to_plain"] > 0 and e["peak_memory_bytes"] > 0, where
        work = record["phases"]["fedavg"]["full_model_training_flops"]
        assert e["full_model_flops_per_s"] == pytest.approx(work * e["rounds_per_s"]), where
        if strategy == "plain_loop":
            continue
        assert not e["retraced_while_timing"], where
        assert e["achieved_flops_per_s"] > 0, where
        if strategy == "auto":
            assert e["resolved_strategy"] == auto, where
        if not e.get("reference"):  # fedavg: against the plain loop; fedldf: against its first strategy
            assert e["correct"] and e["max_abs_diff_vs_reference"] <= 1e-4, where
    assert runners[("fedavg", "auto")]["max_abs_diff_vs_reference"] <= 1e-4  # the plain loop is FedAvg
    for strategy in ("auto", "fused:2"):
        ratio = runners[("fedldf", strategy)]["round_time_over_fedavg"]
        assert ratio == pytest.approx(runners[("fedldf", strategy)]["round_s"]
                                      / runners[("fedavg", strategy)]["round_s"])
    fedldf, fedavg = record["phases"]["fedldf"], record["phases"]["fedavg"]
    added = sum(fedldf[p] - fedavg[p] for p in ("selection_s", "aggregation_s"))
    assert runners[("fedldf", "auto")]["phase_overhead_over_fedavg"] == pytest.approx(
        1 + added / runners[("fedavg", "auto")]["round_s"])
    assert "phase_overhead_over_fedavg" not in runners[("fedavg", "auto")]


def test_phases_and_flops_per_method(report):
    data, _ = report
    [record] = data["results"]
    assert set(record["phases"]) == {"fedavg", "fedldf"}
    for method, phases in record["phases"].items():
        assert "error" not in phases, method
        for name in ("local_training_s", "selection_s", "aggregation_s", "evaluation_s"):
            assert phases[name] > 0, (method, name)
        assert phases["round_flops"] > 0 and phases["evaluation_examples"] == bench.PRESETS["smoke"].eval_examples
        settings = bench.PRESETS["smoke"]  # K clients x S steps x B examples x the model's kernel FLOPs
        assert phases["full_model_training_flops"] == pytest.approx(
            record["cohort_size"] * settings.local_steps * settings.batch_size * bench_model_flops(record))
    # FedLDF does FedAvg's work and more: its divergences and top-n are counted too
    assert record["phases"]["fedldf"]["round_flops"] > record["phases"]["fedavg"]["round_flops"]


def bench_model_flops(record) -> float:
    """One example's training step of the record's model, kernels only: 2 (first layer) or 3 forward FLOPs
    per layer, from the layer costs."""
    from fedpartial._src.costs import flops
    from fedpartial._src.models import registry
    from fedpartial._src.models.adapter import from_linen
    shape = tuple(record["input_shape"])
    model = from_linen(registry.build_model(record["model"], bench.NUM_CLASSES, shape), input_shape=shape,
                       num_classes=bench.NUM_CLASSES, name=record["model"])
    forward = flops.layer_forward_flops(model)
    return float(2 * forward[0] + 3 * forward[1:].sum())


def test_a_cell_too_big_for_memory_is_skipped_with_its_estimate(monkeypatch):
    monkeypatch.setattr(bench, "available_bytes", lambda: 1000)
    record = bench.run_cell("mlp", 4, bench.PRESETS["smoke"], {})
    assert record["estimated_bytes"] > 1000 and not record["runners"]
    assert record["skipped"].startswith("estimated ") and "available" in record["skipped"]


def test_a_strategy_too_big_is_skipped_while_its_chunks_run_and_progress_is_reported(monkeypatch):
    """The whole cohort at once does not fit but chunks of 2 do: the cell runs the chunks (and the plain
    loop), records why the whole cohort was left out, skips the phase times (run on the whole cohort)
    yet counts the round's FLOPs; the record so far is handed out after the warm-ups and the timing."""
    settings = dataclasses.replace(bench.PRESETS["smoke"], methods=("fedavg",), strategies=("fused", "fused:2"))
    monkeypatch.setattr(bench, "available_bytes", lambda: 1000)
    sizes = bench.run_cell("mlp", 4, settings, {})  # nothing fits: only the estimates
    whole, n = sizes["estimated_bytes"], sizes["num_params"]
    chunked = whole - 4 * n * 3 * (4 - 2)  # estimate_bytes: 3 copies per client trained at once
    monkeypatch.setattr(bench, "available_bytes", lambda: int((whole + chunked) / 2 / bench.MEMORY_SHARE))
    seen = []
    record = bench.run_cell("mlp", 4, settings, {}, progress=seen.append)
    runners = {e["strategy"]: e for e in record["runners"]}
    assert runners["fused"]["skipped"].startswith("estimated ") and "available" in runners["fused"]["skipped"]
    assert runners["fused:2"]["rounds_per_s"] > 0 and runners["fused:2"]["correct"]
    assert runners["plain_loop"]["rounds_per_s"] > 0
    phases = record["phases"]["fedavg"]
    assert "whole cohort" in phases["skipped"] and phases["round_flops"] > 0 and "local_training_s" not in phases
    assert runners["fused:2"]["achieved_flops_per_s"] > 0
    assert [s["partial"] for s in seen] == ["warm-up done", "timed rounds done"]
    assert "warmup_s" in seen[0]["runners"][1] and "round_s" in seen[1]["runners"][1]


def test_preset_skips_match_model_cohort_and_strategy():
    s = bench.Settings(models=("mlp",), cohorts=(4,), methods=("fedavg",), strategies=("auto",),
                       skip=("cnn2c1f/100", "*/*/fused:20"))
    assert bench.skipped_by(s, "cnn2c1f", 100) and not bench.skipped_by(s, "cnn2c1f", 20)
    assert bench.skipped_by(s, "mlp", 20, "fused:20") and not bench.skipped_by(s, "mlp", 20, "stepwise:20")
    assert not bench.skipped_by(s, "mlp", 20)  # a strategy entry leaves the cell itself in


@pytest.mark.parametrize("flags, flag", [
    (["--models", "nope"], "--models"),
    (["--methods", "nope"], "--methods"),
    (["--strategies", "parallel"], "--strategies"),
    (["--cohorts", "4,x"], "--cohorts"),
    (["--rounds", "0"], "--rounds"),
    (["--preset", "huge"], "--preset"),
    (["--lr", "0"], "--lr"),
    (["--momentum", "1"], "--momentum"),
])
def test_bad_flags_are_one_sentence_naming_the_flag(flags, flag, capsys):
    assert cli.main(["bench", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fedpartial: error: ") and flag in err and len(err.splitlines()) == 1


def test_the_learning_rate_and_momentum_flags_reach_the_settings():
    args = cli.build_parser().parse_args(["bench", "--lr", "0.01", "--momentum", "0.5"])
    settings = bench.settings_from_args(args)
    assert (settings.lr, settings.momentum) == (0.01, 0.5)
    assert bench.settings_from_args(cli.build_parser().parse_args(["bench"])).lr == bench.PRESETS["quick"].lr


def test_an_existing_out_is_refused_and_left_alone(tmp_path, capsys):
    earlier = tmp_path / "earlier.json"
    earlier.write_text('{"benchmark": "throughput"}')
    assert cli.main(["bench", "--out", str(earlier)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fedpartial: error: --out ") and "already exists" in err and len(err.splitlines()) == 1
    assert earlier.read_text() == '{"benchmark": "throughput"}'
    # The default name of a second run the same day does not take the first's.
    (tmp_path / "t.json").write_text("{}")
    (tmp_path / "t-2.png").write_bytes(b"")
    assert bench.free_path(str(tmp_path / "t.json")) == str(tmp_path / "t-3.json")
    assert bench.free_path(str(tmp_path / "new.json")) == str(tmp_path / "new.json")


@pytest.mark.parametrize("method", ["fedavg", "fedspu", "embracingfl"])
def test_cpu_training_phase_loop_equals_the_vmapped_scan(method):
    """On a CPU the training phase is timed as the stepwise strategy's loop of jitted steps; it trains what
    the fused strategy's vmapped scan trains (per-client plans, state and keys included)."""
    import numpy as np

    from fedpartial._src.bench.kit import NUM_CLASSES, client_optimizer, make_data
    from fedpartial._src.methods.catalog import get_method
    from fedpartial._src.models import registry
    from fedpartial._src.models.adapter import from_linen

    shape = (8, 8, 1)
    model = from_linen(registry.build_model("cnn2c1f", NUM_CLASSES, shape), input_shape=shape,
                       num_classes=NUM_CLASSES, sequential=registry.MODELS["cnn2c1f"].sequential, name="cnn2c1f")
    k = 3
    rnd = FederatedRound(model, get_method(method), num_clients=k, cohort_size=k,
                         client_optimizer=client_optimizer(0.1, 0.0))
    cohort = cohort_from_packed(make_data(k, batch_size=4, local_steps=3, input_shape=shape, seed=0),
                                np.arange(k))
    state, key = rnd.init(jax.random.key(0)), jax.random.key(1)
    inputs = rnd.local_inputs(state, cohort, key)
    looped = bench.local_training_stepwise(rnd)(state, cohort, key, rnd.preview(state, cohort, key).start_vars)
    scanned = jax.jit(lambda g, i: bench.local_training(rnd, g, i))(state.variables, inputs)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), looped, scanned)
