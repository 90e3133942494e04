"""A run's settings are pure data (no JAX, no engine) and are validated once per entry path: the command line,
fedpartial.run and Simulation, an asynchronous run, replicas and a comparison; the population's size is checked
on its own once the files are read."""

import dataclasses
import subprocess
import sys
import types

import pytest

import fedpartial as fp
from fedpartial._src.analysis import compare
from fedpartial._src.cli.main import main
from fedpartial._src.experiment import config_checks, plan, population, replicas, setting_checks
from fedpartial._src.experiment.asynchronous import AsyncSimulation
from fedpartial._src.experiment.config import ConfigError, RunConfig
from fedpartial._src.experiment.config_checks import validate_once, validated, with_validation
from fedpartial.methods import METHODS

TINY = dict(dataset="synthetic", max_samples=40, model="mlp", num_clients=6, cohort_size=3, rounds=1, local_steps=1,
            batch_size=8, out_dir=None)
FLAGS = ["--dataset", "synthetic", "--max-samples", "40", "--model", "mlp", "--clients", "6", "--cohort", "3",
         "--rounds", "1", "--local-steps", "1", "--batch-size", "8", "--quiet"]


def test_the_settings_load_without_jax_or_the_engine():
    code = ("import sys, fedpartial._src.experiment.config as c; c.RunConfig(method='fedldf', options={'n': 2}); "
            "loaded = [m for m in sys.modules if m == 'jax' or m.startswith(('jax.', 'fedpartial._src.engine'))]; "
            "print(loaded)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.fixture
def validations(monkeypatch):
    """The number of full validations (config_checks.validate) since the test started."""
    calls = []
    full = config_checks.validate
    monkeypatch.setattr(config_checks, "validate", lambda config, **kw: (calls.append(config), full(config, **kw)))
    return calls


def test_a_validated_configuration_is_not_validated_again_until_a_setting_changes(validations):
    config = RunConfig(**TINY, options={})
    validate_once(config)
    validate_once(config)  # passed as it is
    validate_once(config, custom_method=True)  # the registry's checks cover a custom method's
    assert len(validations) == 1
    validate_once(config, check_model=True)  # more than was checked
    assert len(validations) == 2
    config.options["n"] = 2  # changed in place: judged again
    assert not validated(config)
    config.rounds = 0
    with pytest.raises(ConfigError, match="--rounds 0 is not allowed"):
        validate_once(config)
    assert not validated(dataclasses.replace(RunConfig(**TINY)))  # a fresh copy carries nothing
    validate_once(config := RunConfig(**TINY))  # the record is no field: not compared, shown or saved
    assert config == RunConfig(**TINY) and repr(config) == repr(RunConfig(**TINY))
    assert dataclasses.asdict(config) == dataclasses.asdict(RunConfig(**TINY))


def test_the_command_line_validates_a_run_once(validations, tmp_path):
    assert main(["run", *FLAGS, "--out", str(tmp_path)]) == 0
    assert len(validations) == 1


def test_the_command_line_validates_an_asynchronous_run_once(validations, tmp_path):
    assert main(["run", *FLAGS, "--mode", "async", "--out", str(tmp_path)]) == 0
    assert len(validations) == 1


def test_the_command_line_validates_replicas_once(validations, tmp_path, monkeypatch):
    replica_checks = []
    monkeypatch.setattr(setting_checks, "check_replica", lambda c, f=setting_checks.check_replica: (
        replica_checks.append(c.seed), f(c)))
    assert main(["run", *FLAGS, "--seeds", "0,1", "--out", str(tmp_path)]) == 0
    assert len(validations) == 1
    assert sorted(set(replica_checks)) == [0, 1]  # each replica's own seed, rates and folder


def test_python_entry_paths_validate_once(validations):
    fp.run(RunConfig(**TINY))
    assert len(validations) == 1
    fp.Simulation(RunConfig(**TINY), method=METHODS["fedavg"].factory())
    assert len(validations) == 2 and validations[-1].method == "fedavg"
    AsyncSimulation(RunConfig(**TINY, mode="async"))
    assert len(validations) == 3
    replicas.run_seeds(RunConfig(**TINY), [0, 1])
    assert len(validations) == 4


def test_a_comparison_validates_each_run_once(validations, tmp_path):
    assert main(["compare", "--methods", "fedavg,fedprox", *FLAGS, "--out", str(tmp_path / "cmp")]) == 0
    assert [c.method for c in validations] == ["fedavg", "fedprox"]
    validations.clear()
    compare.compare(RunConfig(**TINY), ["fedavg", "fedprox"], [0], {}, str(tmp_path / "again"))
    assert [c.method for c in validations] == ["fedavg", "fedprox"]


def test_the_population_is_checked_on_its_own_once_the_files_are_read(validations):
    config = RunConfig(dataset="leaf", data_dir="files", cohort_size=5, out_dir=None)
    assert config.num_clients is None
    validate_once(config)
    files = types.SimpleNamespace(natural_partition=[[0]] * 8)
    populated = population.with_population(config, files)
    assert populated.num_clients == 8 and validated(populated) and len(validations) == 1
    with pytest.raises(ConfigError, match=r"--cohort 5 is not allowed: it must be between 1 and --clients \(4\)"):
        population.with_population(config, types.SimpleNamespace(natural_partition=[[0]] * 4))
    # the same sentence as a full validation of the populated configuration
    with pytest.raises(ConfigError, match=r"--cohort 5 is not allowed: it must be between 1 and --clients \(4\)"):
        dataclasses.replace(config, num_clients=4).validate()


def test_derived_settings_carry_the_validation_only_from_a_validated_configuration():
    config = RunConfig(**TINY)
    assert not validated(with_validation(dataclasses.replace(config, seed=3), config))
    config.validate()
    assert validated(with_validation(dataclasses.replace(config, seed=3), config))
    config.seed = 4  # the record no longer matches: nothing is carried
    assert not validated(with_validation(dataclasses.replace(config, seed=3), config))


def test_the_plan_resolves_devices_strategy_and_method():
    config = RunConfig(**TINY, method="fedldf", options={"n": 2})
    resolved = plan.resolve(config)
    assert validated(config) and resolved.num_devices == 1 and resolved.method.name == config.build_method().name
    assert resolved.strategy() == config.run_strategy() and config.num_devices == resolved.num_devices
    own = METHODS["fedavg"].factory()
    assert plan.resolve(dataclasses.replace(config, method=own.name, options={}), own).method is own
