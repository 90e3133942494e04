"""A method written outside fedpartial, on its public API alone (``examples/scaffold.py``): found by the CLI
through the entry-point group and as ``package.module:factory``, with its options as flags, and run as
learning-rate replicas that each equal their separate run (the rate is read, never multiplied in twice)."""

import dataclasses
import inspect
import json
import pathlib
from importlib import metadata

import jax
import numpy as np
import pytest

import fedpartial as fp
from examples import scaffold
from fedpartial._src.cli.main import main
from fedpartial._src.experiment import replicas
from fedpartial._src.methods import catalog

ROOT = pathlib.Path(__file__).resolve().parents[1]


def installed(monkeypatch, **entries):
    """Methods registered under the entry-point group, as an installed package's metadata would."""
    points = [metadata.EntryPoint(name, value, fp.ENTRY_POINT_GROUP) for name, value in entries.items()]
    monkeypatch.setattr(catalog.metadata, "entry_points", lambda group: points if group == fp.ENTRY_POINT_GROUP
                        else [])


def test_scaffold_uses_only_the_public_api_and_is_short():
    source = inspect.getsource(scaffold)
    assert "_src" not in source and "import fedpartial as fp" in source
    code = [line for line in source.split('"""', 2)[2].splitlines() if line.strip() and not line.strip().startswith("#")]
    assert len(code) < 60, len(code)


def test_an_installed_method_is_listed_and_runs_by_name(monkeypatch, tmp_path, capsys):
    installed(monkeypatch, my_scaffold="examples.scaffold:SPEC")
    assert main(["list", "methods"]) == 0
    assert "my_scaffold" in capsys.readouterr().out
    args = ["run", "--method", "my_scaffold", "--dataset", "synthetic", "--clients", "6", "--cohort", "3", "--rounds",
            "2", "--local-steps", "2", "--quiet", "--out", str(tmp_path)]
    assert main(args) == 0
    run_dir = pathlib.Path(capsys.readouterr().out.strip().splitlines()[-1])
    assert run_dir.name == "my_scaffold-synthetic-seed0"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds"] == 2


def test_a_factory_by_module_path_gets_its_keyword_options_as_flags(monkeypatch, tmp_path, capsys):
    """``--method package.module:factory`` with a plain factory: its keyword defaults become flags, checked and
    passed; a flag the factory does not take is refused in one sentence."""
    module = tmp_path / "my_methods.py"
    module.write_text("import fedpartial as fp\n\n"
                      "def proximal(mu: float = 0.01, tag: str = 'x'):\n"
                      "    '''FedProx written elsewhere.'''\n"
                      "    return fp.methods.fedprox(mu=mu)._replace(name='proximal-' + tag)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    base = ["run", "--method", "my_methods:proximal", "--dataset", "synthetic", "--clients", "4", "--cohort", "2",
            "--rounds", "1", "--local-steps", "1", "--quiet", "--out", str(tmp_path / "runs")]
    assert main(base + ["--mu", "0.5", "--tag", "y"]) == 0
    run_dir = pathlib.Path(capsys.readouterr().out.strip().splitlines()[-1])
    assert json.loads((run_dir / "config.json").read_text())["options"] == {"mu": 0.5, "tag": "y"}
    assert main(base + ["--n", "3"]) == 2  # fedldf's option, not this method's
    assert "--n is an option of" in capsys.readouterr().err
    assert main(base[:2] + ["nowhere.at_all:factory"] + base[3:]) == 2
    assert "cannot be imported" in capsys.readouterr().err


def test_an_installed_name_never_shadows_a_built_in_one(monkeypatch):
    installed(monkeypatch, fedavg="examples.scaffold:SPEC")
    assert catalog.find_method("fedavg") is fp.methods.METHODS["fedavg"]


def test_learning_rate_replicas_of_scaffold_equal_their_separate_runs(tmp_path):
    """The bug this guards against: replicas build the client optimizer at rate 1 and carry the rate in the
    cohort; a method that multiplied a scale by the optimizer's rate itself counted it twice (SCAFFOLD's |c|
    was 4,301 in the replica against 48 alone).  Records, models and control variates must agree."""
    config = fp.RunConfig(method="examples.scaffold:SPEC", dataset="digits", model="mlp", num_clients=6,
                          cohort_size=2, rounds=2, batch_size=16, local_epochs=0.5, momentum=0.0, seed=0,
                          out_dir=str(tmp_path))
    lrs = [0.05, 0.1]
    done = replicas.run_seeds(config, [0], replica_axis="map", lrs=lrs)
    norms = []
    for lr, result, vsim in zip(lrs, done["results"], done["simulations"]):
        alone = fp.Simulation(dataclasses.replace(config, client_lr=lr, strategy="fused", out_dir=None))
        records = list(alone.rounds())
        for mine, theirs in zip(result["records"], records):
            for key in ("upload_bytes", "download_bytes", "client_steps"):
                assert mine[key] == theirs[key], key
            assert mine["train_loss"] == pytest.approx(theirs["train_loss"], rel=1e-5)
        mine, theirs = (jax.device_get((s.state.variables, s.state.method_state)) for s in (vsim, alone))
        for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(theirs)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
        norms.append(float(np.sqrt(sum(np.sum(np.square(a)) for a in jax.tree.leaves(mine[1].server)))))
    assert all(0 < n < 100 for n in norms) and norms[0] != norms[1], norms


@pytest.mark.parametrize("strategy", ["fused", "stepwise", "debug"])
def test_scaffold_control_variates_follow_option_two(mlp, strategy):
    """After one round from c = c_i = 0: c_i⁺ = (x − y_i) / (K·η) for every sampled client, and
    c = Σ_i c_i⁺ / N."""
    from tests.conftest import make_cohort

    n, k, steps, lr = 5, 3, 2, 0.1
    rnd = fp.FederatedRound(mlp, scaffold.scaffold(), num_clients=n, cohort_size=k,
                            client_optimizer=fp.client_sgd(lr), strategy=fp.parse_strategy(strategy))
    state = rnd.init(jax.random.key(0))
    x = jax.device_get(state.variables["params"])
    cohort = make_cohort((4,), k=k, steps=steps, client_ids=[0, 2, 4])
    new, _ = rnd(state, cohort, jax.random.key(1))
    rows, c = jax.device_get((new.method_state.clients, new.method_state.server))
    trained = []
    for i, cid in enumerate([0, 2, 4]):  # each client's model: x − K·η·c_i⁺
        y = jax.tree.map(lambda a, r: a - steps * lr * r[cid], x, rows)
        trained.append(y)
    untouched = jax.tree.map(lambda r: r[[1, 3]], rows)
    assert all(np.all(a == 0) for a in jax.tree.leaves(untouched))
    expected_c = jax.tree.map(lambda r: r.sum(0) / n, rows)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), c, expected_c)
    # the global model is the n_k-weighted mean of the clients' models
    w = np.asarray(cohort.info.num_samples) / np.sum(cohort.info.num_samples)
    mean = jax.tree.map(lambda *a: sum(wi * ai for wi, ai in zip(w, a)), *trained)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
                 jax.device_get(new.variables["params"]), mean)


def test_a_broken_installed_method_fails_only_the_run_that_names_it(monkeypatch, capsys):
    installed(monkeypatch, broken="nowhere.at_all:SPEC")
    assert main(["run", "--help"]) == 0  # every other command still works
    capsys.readouterr()
    assert main(["run", "--method", "broken", "--rounds", "1", "--out", "unused"]) == 2
    assert "cannot be imported" in capsys.readouterr().err
