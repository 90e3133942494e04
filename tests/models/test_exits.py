"""Early exits on any staged model: where they sit, what they compute, the losses and evaluation built on them."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedpartial._src.core.errors import UserError
from fedpartial._src.core.losses import exit_cross_entropies, mutual_distillation
from fedpartial._src.costs.footprint import layer_output_shapes
from fedpartial._src.experiment.evaluation import evaluate, record_fields
from fedpartial._src.models.adapter import from_linen
from fedpartial._src.models.exits import MultiExitModel, pool, with_exits
from fedpartial._src.models.registry import build_model

X = np.random.default_rng(0).normal(size=(6, 4)).astype(np.float32)


@pytest.fixture(scope="module")
def exits(staged_mlp):
    return with_exits(staged_mlp, after=(1, 0, 1))  # repeats merge; sorted


def test_exits_follow_their_stage_and_belong_to_it(exits):
    names = [layer.name for layer in exits.structure.layers]
    assert names == ["b1/fc", "exit_b1", "b2/fc", "exit_b2", "b3/fc", "head"]
    assert exits.stage_of_layer == (0, 0, 1, 1, 2, 3) and exits.exit_of_layer == (-1, 0, -1, 1, -1, 2)
    assert exits.exit_stages == (0, 1, 3) and exits.exit_names == ("exit_b1", "exit_b2", "head")
    assert not exits.structure.sequential and exits.stage_names == ("b1", "b2", "b3", "head")
    v = jax.eval_shape(exits.init_variables, jax.random.key(0))
    assert set(exits.stage_variables(v, 0, 2)["params"]) == {"b1", "b2", "exit_b1", "exit_b2"}  # depth 2 holds
    assert exits.exits_within(2) == (0, 1) and exits.exits_within(4) == (0, 1, 2)


def test_the_body_starts_as_the_plain_model_and_every_exit_reads_its_stage(staged_mlp, exits):
    key = jax.random.key(3)
    plain, v = staged_mlp.init_variables(key), exits.init_variables(key)
    for name in staged_mlp.stage_names:
        for a, b in zip(jax.tree.leaves(v["params"][name]), jax.tree.leaves(plain["params"][name]), strict=True):
            np.testing.assert_array_equal(a, b)
    every, _ = exits.exit_logits(v, X)
    h1, _ = staged_mlp.apply_stages(plain, X, stop=1)
    h2, _ = staged_mlp.apply_stages(plain, h1, start=1, stop=2)
    dense = lambda h, p: h @ p["kernel"] + p["bias"][None]  # noqa: E731
    want = [dense(h1, v["params"]["exit_b1"]), dense(h2, v["params"]["exit_b2"]), staged_mlp.apply(plain, X, False)[0]]
    np.testing.assert_allclose(every, np.stack(want), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(exits.apply(v, X, False)[0], np.mean(want, axis=0), rtol=1e-5, atol=1e-6)
    last = with_exits(staged_mlp, after=(0, 1), output="last")
    np.testing.assert_allclose(last.apply(v, X, False)[0], want[-1], rtol=1e-6)
    shallow, _ = exits.exit_logits(exits.stage_variables(v, 0, 2), X, stop=2)  # a depth-2 client's variables
    np.testing.assert_allclose(shallow, every[:2], rtol=1e-6)
    np.testing.assert_allclose(exits.apply_stages(v, X)[0], want[-1], rtol=1e-6)  # the stages are the body's chain


def test_training_mode_updates_the_statistics_of_the_stages_it_runs(exits):
    v = exits.init_variables(jax.random.key(0))
    _, stats = exits.exit_logits(exits.stage_variables(v, 0, 2), X, stop=2, train=True,
                                 example_mask=np.ones(6, bool))
    assert set(stats) == {"b1", "b2"}
    assert not np.allclose(stats["b2"]["bn"]["mean"], v["batch_stats"]["b2"]["bn"]["mean"])


def test_zoo_models_take_exits(staged_mlp):
    """Conv maps and sequences are pooled over their positions; every layer's output shape is known."""
    np.testing.assert_allclose(pool(jnp.arange(24.0).reshape(1, 2, 3, 4)), [[10.0, 11.0, 12.0, 13.0]])
    for name, shape, after in [("resnet20", (8, 8, 3), (3, 6)), ("lenet5", (32, 32, 3), (1, 2)),
                               ("bilstm", (16,), (0, 1))]:
        model = with_exits(from_linen(build_model(name, 10, shape), input_shape=shape, num_classes=10, name=name),
                           after=after)
        v = jax.eval_shape(model.init_variables, jax.random.key(0))
        x = jax.ShapeDtypeStruct((2, *shape), jnp.int32 if name == "bilstm" else jnp.float32)
        assert jax.eval_shape(lambda v, x: model.exit_logits(v, x)[0], v, x).shape == (3, 2, 10), name
        assert layer_output_shapes(model)[-1] == (10,) and len(layer_output_shapes(model)) == model.structure.num_layers


def test_bad_exits_are_refused_in_one_sentence(staged_mlp, mlp):
    with pytest.raises(UserError, match="single stage"):
        with_exits(mlp, after=(0,))
    with pytest.raises(UserError, match="before its classifier, 0 … 2"):
        with_exits(staged_mlp, after=(3,))
    with pytest.raises(UserError, match="choose mean or last"):
        with_exits(staged_mlp, after=(0,), output="max")


def test_exit_losses_by_hand():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(3, 5, 4)).astype(np.float32)
    y, mask = rng.integers(0, 4, 5), np.array([1, 1, 1, 0, 1], bool)
    t = 2.0
    log_q = jax.nn.log_softmax(logits / t, axis=-1)
    q = np.exp(log_q)
    kl = lambda j, i: np.sum(q[j] * (log_q[j] - log_q[i]), axis=-1)  # noqa: E731  KL(q_j ‖ q_i) per example
    per_example = sum(kl(j, i) for i in range(3) for j in range(3) if j != i) * t**2 / 2
    np.testing.assert_allclose(mutual_distillation(logits, mask, t), per_example[mask].mean(), rtol=1e-5)
    assert float(mutual_distillation(logits[:1], mask, t)) == 0.0
    ce = -np.take_along_axis(np.asarray(jax.nn.log_softmax(logits, -1)), y[None, :, None], -1)[..., 0]
    np.testing.assert_allclose(exit_cross_entropies(logits, y, mask), ce[:, mask].mean(axis=1), rtol=1e-5)


def test_evaluation_reports_every_exit_and_the_ensemble(exits):
    v = exits.init_variables(jax.random.key(1))
    y = np.array([0, 1, 2, 0, 1, 2], np.int32)
    result = evaluate(exits, v, X, y, batch_size=4)  # a padded last batch
    every = np.asarray(exits.exit_logits(v, X)[0])
    accuracy = lambda logits: float(np.mean(np.argmax(logits, -1) == y))  # noqa: E731
    assert result["exit_accuracy"] == pytest.approx([accuracy(e) for e in every])
    assert result["ensemble_accuracy"] == pytest.approx(accuracy(every.mean(0))) == pytest.approx(result["accuracy"])
    fields = record_fields(result)
    assert list(fields) == ["test_accuracy", "test_loss", "test_accuracy_exit1", "test_accuracy_exit2",
                            "test_accuracy_exit3", "test_accuracy_ensemble"]
    assert set(evaluate(exits.body, v, X, y)) == {"accuracy", "loss"}


def test_a_run_records_every_exit_in_its_metrics_and_summary(tmp_path, capsys):
    """The driver builds the run's zoo model with the method's exits and records them; flags come from options."""
    from fedpartial._src.cli.main import build_parser, config_from_args, main

    parser = build_parser()
    args = parser.parse_args(["run", "--method", "depthfl", "--depths", "2,1", "--kd-weight", "0.5",
                              "--kd-temperature", "3", "--tier-mix", "2,2,2"])
    assert config_from_args(args).options == {"depths": (2, 1), "distill": 0.5, "temperature": 3.0,
                                              "tier_mix": (2, 2, 2)}
    args = parser.parse_args(["run", "--method", "inclusivefl", "--md-beta", "0.3", "--capacity-case", "8"])
    assert config_from_args(args).options == {"beta": 0.3, "capacity_case": 8}
    assert main(["run", "--method", "inclusivefl", "--md-beta", "2"]) == 2
    assert "--md-beta" in capsys.readouterr().err
    assert main(["list", "methods"]) == 0
    listed = {line.split()[0] for line in capsys.readouterr().out.splitlines()}
    assert {"depthfl", "inclusivefl"} <= listed
    argv = ["run", "--method", "depthfl", "--dataset", "digits", "--model", "mlp", "--clients", "6", "--cohort", "3",
            "--rounds", "1", "--local-steps", "1", "--batch-size", "8", "--tier-mix", "3,0,3", "--out", str(tmp_path)]
    assert main(argv) == 0
    assert "exits, shallow → deep" in capsys.readouterr().out
    [run_dir] = tmp_path.iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["model"] == "mlp+exits"
    exits_acc = [summary[f"final_test_accuracy_exit{i}"] for i in (1, 2, 3)]
    assert all(0 <= a <= 1 for a in exits_acc) and summary["final_test_accuracy_ensemble"] == summary[
        "final_test_accuracy"]
    record = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert {"test_accuracy_exit3", "train_loss_weak"} <= set(record)


def test_multi_exit_model_is_a_model(exits):
    assert isinstance(exits, MultiExitModel) and exits.num_exits == 3 and exits.body.name == "staged_mlp"
