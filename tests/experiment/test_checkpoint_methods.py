"""Every method a user can name checkpoints and resumes bit for bit (issue 50).

``fedpartial run --method NAME`` for every registered method with its defaults, and the wrappers and placements a
user can combine with one (early stopping, DP-FedAvg, SCAFFOLD's control variates under early stopping, FedDH's
weights around FedLDF, per-client state on the host), run through the console script's function: two rounds with
a checkpoint after each, the second being the run's final save (where InclusiveFL's zero-size leaf used to crash
orbax); exit status 0, a summary and the final checkpoint.  Then, on the simulation that ran, the final checkpoint
restores to the state in memory, and round 2 run again from round 1's checkpoint gives that state bit for bit.
Seeds as replicas are checked the same way.  Nothing here knows a method's state: states are compared leaf by leaf
as the checkpoint stores them.

Cost: one compilation per method serves both the command line and the resume (the two checks were once meant as
separate tests; together they compile half as much).  Every run is the smallest every default allows: digits, the
MLP (the digits CNN that ``auto`` picks compiles about 2.5 times slower), 5 clients, a cohort of 4 (FedLDF's, HDFL's
and Random's default n = 4 needs 4), one local step of 8.  Six entries whose checkpointed state is another entry's,
through the same code (``SAME_STATE_AS``), run with ``-m slow`` only.
"""

import json
import os

import chex
import flax.linen as nn
import jax
import numpy as np
import pytest

from fedpartial._src.cli import entry
from fedpartial._src.experiment import checkpoint, checkpoint_arrays, replicas, run_directory, simulation
from fedpartial._src.experiment.config import RunConfig
from fedpartial._src.experiment.simulation import Simulation
from fedpartial._src.methods.catalog import METHODS

#: what makes a newcomer's ``fedpartial run --method NAME`` tiny (the module docstring says why these)
TINY = ["--model", "mlp", "--clients", "5", "--cohort", "4", "--local-steps", "1", "--batch-size", "8"]
DP = ["--dp-clip", "1", "--dp-noise-multiplier", "1"]


def fedldf_with_feddh_weights():
    """FedLDF's uploads with FedDH's weights (``reweight``; ``--method tests.…:fedldf_with_feddh_weights``)."""
    from fedpartial._src.methods.layerwise.fedldf import fedldf
    from fedpartial._src.methods.weighting.compose import reweight
    from fedpartial._src.methods.weighting.feddh import feddh_weighting

    return reweight(fedldf(n=1), feddh_weighting())


#: the methods that train LoRA adapters (their default run adds ``--lora 2``)
LORA_METHODS = ("fedit", "ffa_lora", "fedsa_lora", "hetlora", "flexlora", "flora")
#: name -> the flags after ``fedpartial run``: every registered method with its defaults, then the wrappers and
#: placements a user can combine with one
COMBINATIONS = {
    **{name: ["--method", name, *(["--lora", "2"] if name in LORA_METHODS else [])] for name in METHODS},
    "ffa_lora --dp": ["--method", "ffa_lora", "--lora", "2", *DP],
    "fedavg --es": ["--method", "fedavg", "--es"],
    "fedavg --dp": ["--method", "fedavg", *DP],
    "scaffold --es": ["--method", "scaffold", "--es"],
    "fedldf reweighted by feddh": ["--method", f"{__name__}:fedldf_with_feddh_weights"],
    "fedspu --client-state host": ["--method", "fedspu", "--client-state", "host"],
    "fedavg --upload-codec topk:0.1": ["--method", "fedavg", "--upload-codec", "topk:0.1"],
    "ditto --es --dp --client-state host": ["--method", "ditto", "--es", *DP, "--client-state", "host"],
}
#: combinations refused with every default, and the words of their one sentence
REFUSED = {"fedbn": "has no BatchNorm"}
#: combinations whose checkpointed state is another's, through the same code, run with ``-m slow`` only (each is a
#: method's compilation): FedMP is Hermes with an L1 instead of an L2 norm (one chooser), FedJS is FedDH's
#: weighting with (υ, b) never stepped (the same state), early stopping and DP-FedAvg wrap FedAvg's empty state
#: as they wrap SCAFFOLD's control variates and FFA-LoRA's adapters, FedProx is FedAvg's state with a penalty in the
#: local objective, and LG-FedAvg keeps the complement of FedPer's personal layers (``personal_layers``, one code)
SAME_STATE_AS = {"fedmp": "hermes", "fedjs": "feddh", "fedavg --es": "scaffold --es", "fedavg --dp": "ffa_lora --dp",
                 "fedprox": "fedavg", "lgfedavg": "fedper"}


def _params() -> list:
    return [pytest.param(name, id=name.replace(" ", "_"), marks=[pytest.mark.slow] if name in SAME_STATE_AS else [])
            for name in COMBINATIONS]


def _stored(sim) -> dict:
    """``sim``'s whole state as the checkpoint stores it (flat numpy arrays, keys as their data)."""
    return checkpoint_arrays.to_arrays(sim.checkpoint_state())


def _status(run_dir: str) -> str:
    with open(os.path.join(run_dir, "summary.json")) as f:
        return json.load(f)["status"]


def _assert_resumes_bit_for_bit(sim, run_dir: str) -> None:
    """``sim`` ran two rounds into ``run_dir`` with a checkpoint after each: the final checkpoint restores to the
    state in memory, and round 2 run again from round 1's checkpoint gives that state bit for bit."""
    assert _status(run_dir) == "complete"
    assert checkpoint.latest_round(run_dir) == 2
    straight, progress = _stored(sim), dict(sim.progress)
    checkpoint.restore(run_dir, sim)
    chex.assert_trees_all_equal(_stored(sim), straight)
    checkpoint.restore(run_dir, sim, step=1)
    assert sim.progress["round"] == 1
    for _ in sim.rounds():
        pass
    chex.assert_trees_all_equal(_stored(sim), straight)
    assert sim.progress == progress


# One compilation of each method's round, run for three rounds of one step: compiled at -O0 (tests/conftest.py says
# why that changes nothing here; the resume compares the program with itself)
@pytest.mark.usefixtures("engine_compiled_at_o0")
@pytest.mark.parametrize("name", _params())
def test_every_method_runs_from_the_command_line_and_resumes_bit_for_bit(name, tmp_path, monkeypatch, capsys):
    """``fedpartial run`` (the console script's function) for two rounds with a checkpoint after each, the second
    being the final save; then the simulation it ran resumes bit for bit (one compilation serves both).  The
    entries of ``SAME_STATE_AS`` run with ``-m slow``: the entry each names proves the same by default."""
    ran = []
    real_run = simulation.run
    monkeypatch.setattr(simulation, "run", lambda config, **kw: ran.append(kw["sim"]) or real_run(config, **kw))
    code = entry.main(["run", *COMBINATIONS[name], "--rounds", "2", "--checkpoint-every", "1", *TINY, "--quiet",
                       "--out", str(tmp_path), "--name", "run"])
    err = capsys.readouterr().err
    if name in REFUSED:  # a default that cannot work is one sentence, and nothing is written
        assert code == 2 and REFUSED[name] in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "run").exists()
        return
    assert code == 0, err[-3000:]
    [sim] = ran
    _assert_resumes_bit_for_bit(sim, str(tmp_path / "run"))


class _BatchNormMLP(nn.Module):
    """Dense(16) → BatchNorm → ReLU → Dense(10): the least model FedBN has something to keep local in."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dense(16, name="fc")(x.reshape((x.shape[0], -1)))
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9, name="bn")(x))
        return nn.Dense(10, name="head")(x)


@pytest.mark.usefixtures("engine_compiled_at_o0")
def test_fedbn_on_a_model_with_batchnorm_resumes_bit_for_bit(tmp_path):
    """FedBN's default run is refused above (no zoo model small enough for digits has BatchNorm but ResNet20, a
    minute to compile); its local BatchNorm statistics are checkpointed here on a tiny model of its own."""
    from fedpartial._src.models.adapter import from_linen

    model = from_linen(_BatchNormMLP(), input_shape=(8, 8, 1), num_classes=10, sequential=True, name="bn_mlp")
    config = RunConfig(method="fedbn", num_clients=5, cohort_size=4, local_steps=1, batch_size=8, rounds=2,
                       out_dir=str(tmp_path), run_name="run")
    sim = Simulation(config, model=model)
    simulation.run(sim.config, sim=sim, checkpoint_every=1)
    _assert_resumes_bit_for_bit(sim, str(tmp_path / "run"))


def test_seeds_as_replicas_checkpoint_each_replica_and_resume_it_alone(tmp_path):
    """``--seeds 0,1``: each replica's folder holds its final state, and its round-1 checkpoint resumed alone in a
    simulation of its config.json (what ``fedpartial run --resume PARENT`` does) gives that replica's round 2, bit
    for bit (on this CPU; a GPU's vmapped replicas may differ from a separate run by a few ulp:
    tests/experiment/test_replicas.py)."""
    config = RunConfig(method="inclusivefl", model="mlp", num_clients=5, cohort_size=4, local_steps=1, batch_size=8,
                       rounds=2, out_dir=str(tmp_path))  # InclusiveFL: its state has a zero-size leaf
    done = replicas.run_seeds(config, [0, 1], checkpoint_every=1)
    for run_dir, vsim in zip(done["run_dirs"], done["simulations"]):
        assert _status(run_dir) == "complete"
        assert checkpoint.latest_round(run_dir) == 2
        final = _stored(vsim)
        alone = Simulation(run_directory.load_config(run_dir))
        checkpoint.restore(run_dir, alone)
        chex.assert_trees_all_equal(_stored(alone), final)
        checkpoint.restore(run_dir, alone, step=1)
        for _ in alone.rounds():
            pass
        chex.assert_trees_all_equal(_stored(alone), final)


# --- the stored layout: leaves orbax or np.savez refuse, and checkpoints written before it ----------------------


class _Holder:
    """What :func:`checkpoint.save` and :func:`checkpoint.restore` use of a Simulation: a state and progress."""

    def __init__(self, state):
        self.state, self.progress = state, {"round": 1}

    def checkpoint_state(self):
        return self.state

    def load_state(self, state):
        self.state = state


def _awkward_state():
    import jax.numpy as jnp
    import ml_dtypes

    rng = np.random.default_rng(0)
    return {"w": rng.normal(size=(3, 4)).astype(np.float32), "seen": np.zeros((0,), bool),
            "empty": np.zeros((2, 0, 3), np.float32), "u4": np.arange(6, dtype=ml_dtypes.uint4).reshape(2, 3),
            "bf16": rng.normal(size=(5,)).astype(jnp.bfloat16), "bf16_scalar": np.asarray(1.5, jnp.bfloat16),
            "i4": np.arange(-3, 3, dtype=ml_dtypes.int4), "n": np.int32(7), "key": jax.random.key(3),
            "no_keys": jax.random.split(jax.random.key(1), 0)}


def _zeroed(state):
    """A template: ``state``'s structure, shapes and dtypes, other values."""
    return jax.tree.map(lambda a: a if checkpoint_arrays.is_key(a) else np.zeros_like(a), state)


@pytest.mark.parametrize("several_processes", [False, True], ids=["orbax", "per-process npz"])
def test_zero_size_and_exotic_dtype_leaves_round_trip_bit_for_bit(several_processes, tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "several_processes", lambda: several_processes)
    state = _awkward_state()
    checkpoint.save(str(tmp_path), _Holder(state))
    back = _Holder(_zeroed(state))
    checkpoint.restore(str(tmp_path), back)
    assert back.progress["round"] == 1
    want, got = checkpoint_arrays.to_arrays(state), checkpoint_arrays.to_arrays(back.state)
    assert want.keys() == got.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        assert got[name].tobytes() == want[name].tobytes(), name
    assert jax.random.key_impl(back.state["key"]) == jax.random.key_impl(state["key"])


@pytest.mark.parametrize("several_processes", [False, True], ids=["orbax", "per-process npz"])
def test_a_checkpoint_written_before_the_stored_layout_still_restores(several_processes, tmp_path, monkeypatch):
    """Written as the format stood before zero-size leaves were left out (every array under its position's name,
    no layout records in the host item): orbax could not hold a zero-size leaf then, ``state.npz`` could."""
    import orbax.checkpoint as ocp

    monkeypatch.setattr(checkpoint, "several_processes", lambda: several_processes)
    state = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "key": jax.random.key(5), "n": np.int32(4)}
    if several_processes:
        state["seen"] = np.zeros((0,), bool)
    arrays = checkpoint_arrays.to_arrays(state)
    host = {"progress": {"round": 3}, "num_leaves": len(arrays), "checksum": checkpoint_arrays.checksum(arrays)}
    if several_processes:
        os.makedirs(tmp_path / "checkpoints")
        checkpoint._save_local(str(tmp_path), 3, arrays, host)
    else:
        with checkpoint._manager(str(tmp_path)) as mgr:
            mgr.save(3, args=ocp.args.Composite(state=ocp.args.StandardSave(arrays), host=ocp.args.JsonSave(host)))
            mgr.wait_until_finished()
    back = _Holder(_zeroed(state))
    checkpoint.restore(str(tmp_path), back)
    assert back.progress["round"] == 3
    chex.assert_trees_all_equal(checkpoint_arrays.to_arrays(back.state), arrays)
