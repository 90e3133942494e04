"""``--init-from``: saved parameters round-trip, a mismatch is one sentence, and a run starts from a
pre-trained run folder."""

import os

import jax
import numpy as np
import pytest

from fedpartial._src.core.errors import UserError
from fedpartial._src.experiment.config import RunConfig
from fedpartial._src.experiment.pretrained import FINAL_PARAMS, initial_model
from fedpartial._src.experiment.simulation import Simulation, run
from fedpartial._src.models import registry
from fedpartial._src.models.adapter import from_linen
from fedpartial._src.models.params_io import load_params, save_params, starting_from

TINY = dict(model="mlp", num_clients=4, cohort_size=2, rounds=1, local_steps=1, local_epochs=None)


def mlp(hidden=(200, 200)):
    module = registry.build_model("mlp", 10, (8, 8, 1))
    return from_linen(module.clone(hidden=hidden), input_shape=(8, 8, 1), num_classes=10, name="mlp")


def test_saved_parameters_round_trip(tmp_path):
    model = mlp()
    variables = model.init_variables(jax.random.key(3))
    path = save_params(variables, str(tmp_path / "weights"))
    assert path.endswith("weights.npz") and not os.path.exists(tmp_path / "weights.partial.npz")
    loaded = load_params(path)
    assert set(np.load(path).files) >= {"params/fc1/kernel", "params/head/bias"}
    jax.tree.map(np.testing.assert_array_equal, loaded["params"], jax.device_get(variables["params"]))
    started = starting_from(model, loaded)
    jax.tree.map(np.testing.assert_array_equal, started.init_variables(jax.random.key(99))["params"],
                 loaded["params"])  # whatever the key


def test_a_mismatch_names_the_parameter_and_both_shapes(tmp_path):
    path = save_params(mlp(hidden=(32, 32)).init_variables(jax.random.key(0)), str(tmp_path / "small.npz"))
    with pytest.raises(UserError) as error:
        initial_model(mlp(), path)
    message = str(error.value)
    assert "parameter params/fc1/bias the shape (32,), but model mlp needs (200,)" in message
    assert message.endswith("them.") and "\n" not in message
    with pytest.raises(UserError, match=f"is a folder without {FINAL_PARAMS}"):
        initial_model(mlp(), str(tmp_path))
    with pytest.raises(UserError, match="does not exist"):
        initial_model(mlp(), str(tmp_path / "nothing.npz"))
    del_head = {"params": {k: v for k, v in load_params(path)["params"].items() if k != "head"}}
    with pytest.raises(UserError, match="have no parameter params/head/bias"):
        starting_from(mlp(hidden=(32, 32)), del_head)


def test_a_run_starts_from_a_pretrained_folder(tmp_path):
    """Central pre-training (one client), then a federated run from its folder: its initial model is the
    pre-trained one, bit for bit."""
    pre = run(RunConfig(**{**TINY, "num_clients": 1, "cohort_size": 1, "out_dir": str(tmp_path)}))
    saved = load_params(os.path.join(pre["run_dir"], FINAL_PARAMS))
    sim = Simulation(RunConfig(**{**TINY, "out_dir": None, "init_from": pre["run_dir"], "seed": 5}))
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(sim.state.variables["params"]), saved["params"])
    fresh = Simulation(RunConfig(**{**TINY, "out_dir": None, "seed": 5}))
    assert not np.array_equal(fresh.state.variables["params"]["head"]["kernel"], saved["params"]["head"]["kernel"])
