"""The host driver: per-client held-out splits, personalised evaluation, configuration errors."""

import numpy as np
import pytest

from fedpartial._src.experiment.config import ConfigError, RunConfig
from fedpartial._src.experiment.simulation import Simulation, run

TINY = dict(num_clients=8, cohort_size=3, rounds=2, local_steps=1, local_epochs=None, out_dir=None)


def test_personalised_methods_split_every_client_70_30():
    sim = Simulation(RunConfig(method="fedspu", **TINY))
    x, y, mask = sim.holdout
    assert x.shape[0] == 8
    for train, held in zip(sim.clients, mask.sum(1)):
        n = len(train) + held
        assert len(train) == min(n, max(1, int(np.floor(0.7 * n + 0.5))))
        assert held >= 1  # two examples per client at least: one is held out
    assert Simulation(RunConfig(method="fedavg", **TINY)).holdout is None
    assert Simulation(RunConfig(method="fedavg", train_fraction=0.5, **TINY)).holdout is not None


def test_summary_reports_personal_accuracy_and_state_memory():
    summary = run(RunConfig(method="hermes", **TINY))
    for key in ("final_personal_accuracy", "final_personal_accuracy_std", "final_global_client_accuracy",
                "best_personal_accuracy"):
        assert 0 <= summary[key] <= 1
    model_bytes = summary["num_params"] * 4
    assert summary["personal_state_bytes"] > 8 * model_bytes  # N models + their sub-model masks
    assert summary["client_train_fraction"] == 0.7
    assert "rounds_saved" not in summary and "final_dp_epsilon" not in summary  # no early stopping, no DP


@pytest.mark.parametrize("kw, match", [
    (dict(options={"tiers": (0.0, 1.0)}), "tiers"),
    (dict(train_fraction=1.5), "train fraction"),
    (dict(early_stopping=True, train_fraction=1.0), "held-out"),
    (dict(method="fedselect", options={"start": 0.0}), "select-start"),
    (dict(method="fedavg", options={"mu": 0.1}), "no option 'mu'"),
])
def test_bad_configuration_is_one_sentence(kw, match):
    with pytest.raises(ConfigError, match=match):
        RunConfig(**{**TINY, "method": "fedspu", **kw}).validate()


def test_local_steps_alone_is_enough():
    config = RunConfig(local_steps=3, num_clients=4, cohort_size=2, rounds=1, out_dir=None)
    config.validate()
    assert config.epochs is None and RunConfig().epochs == 2.0
    with pytest.raises(ConfigError, match="only one"):
        RunConfig(local_steps=3, local_epochs=1.0).validate()


def test_custom_method_object_gets_the_driver(tmp_path):
    """Simulation/run take a Method object: sampling, personalised evaluation and logging included."""
    from fedpartial._src.methods.submodel.fedspu import fedspu
    method = fedspu(tiers=(0.5, 1.0))._replace(name="my-fedspu")
    summary = run(RunConfig(**{**TINY, "out_dir": str(tmp_path)}), method=method)
    assert summary["method"] == "my-fedspu" and 0 <= summary["final_personal_accuracy"] <= 1
    assert summary["client_train_fraction"] == 0.7  # personalised: held-out split by default


def test_cohort_draw_of_a_huge_population_is_distinct_uniform_and_o_of_k():
    """Above 2^16 members the draw is Floyd's algorithm: k distinct ids, each member equally likely, and a
    population of 2^30 costs what 2^17 does (a permutation of 2^30 ids would not fit in this test's memory)."""
    import jax

    from fedpartial._src.experiment.population import _PERMUTATION_MAX, _distinct_uniform

    n, k, draws = 4 * _PERMUTATION_MAX, 4096, 256
    counts = np.zeros(n)
    for i in range(draws):
        picked = _distinct_uniform(jax.random.fold_in(jax.random.key(0), i), n, k)
        assert len(np.unique(picked)) == k and picked.min() >= 0 and picked.max() < n
        counts[picked] += 1
    p = k / n
    expected_std = np.sqrt(draws * p * (1 - p))
    assert abs(counts.mean() - draws * p) < 1e-9  # exactly k per draw
    assert 0.9 < counts.std() / expected_std < 1.1  # binomial spread: no member favoured
    # Low and high ids are drawn equally often (Floyd's last steps take the top ids when t collides).
    quarter = n // 4
    assert abs(counts[:quarter].mean() - counts[-quarter:].mean()) < 4 * expected_std / np.sqrt(quarter)
    big = _distinct_uniform(jax.random.key(1), 1 << 30, 1000)
    assert len(np.unique(big)) == 1000 and big.max() < 1 << 30
    # Small populations keep the permutation draw, so earlier runs' cohorts are unchanged.
    small = _distinct_uniform(jax.random.key(2), 100, 10)
    np.testing.assert_array_equal(small, np.asarray(jax.random.choice(jax.random.key(2), 100, (10,), replace=False)))


def _dataset(labels, num_classes=10):
    from fedpartial._src.data.arrays import ArrayDataset

    rng = np.random.default_rng(0)
    y = np.asarray(labels, np.int32)
    return ArrayDataset(name="tiny", x_train=rng.normal(size=(len(y), 4)).astype(np.float32), y_train=y,
                        x_test=rng.normal(size=(4, 4)).astype(np.float32), y_test=np.zeros(4, np.int32),
                        num_classes=num_classes)


@pytest.mark.parametrize("outputs, labels, match", [
    (5, list(range(10)) * 2, "model m gives 5 outputs per example, but tiny has 10 classes; build the model with "
                             "num_classes=10"),
    (20, list(range(10)) * 2, "model m gives 20 outputs per example, but tiny has 10 classes"),
    (10, [0, 3, 12, 1] * 5, "tiny's training labels include 12, but it declares 10 classes \\(labels 0 to 9\\)"),
    (10, [0, -1, 2, 1] * 5, "tiny's training labels include -1"),
])
def test_a_model_that_does_not_fit_the_labels_is_one_sentence(outputs, labels, match):
    """Said as what it is before anything is built (was: 'diverged … lower --lr', a reshape error, or nothing)."""
    from fedpartial._src.models import zoo
    from fedpartial._src.models.adapter import from_linen

    model = from_linen(zoo.MLP(outputs, hidden=(6,)), input_shape=(4,), num_classes=outputs, sequential=True,
                       name="m")
    config = RunConfig(dataset="synthetic", num_clients=4, cohort_size=2, rounds=1, local_steps=1, batch_size=4)
    with pytest.raises(ConfigError, match=match):
        Simulation(config, _dataset(labels), model=model)

