"""``fedpartial run --seeds``: replicas as one vmapped simulation equal separate fused runs of each seed.

Each replica is compared with ``simulation.run`` of its seed under ``--strategy fused``: every record
field but the wall-clock times is equal, and the final variables agree to the tolerance below.  The
seeds' populations need different numbers of local steps, so the padding of the shorter ones (padded
steps are no-ops) is exercised too.
"""

import dataclasses
import json
import os
import statistics

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedpartial._src.cli.main import main
from fedpartial._src.core import memory
from fedpartial._src.experiment import replica_axis, replicas, run_directory
from fedpartial._src.experiment.config import ConfigError, RunConfig
from fedpartial._src.experiment.simulation import Simulation, run
from tests.conftest import count_copies, fake_device_memory, wide_dataset

#: float fields and final variables of a replica against its separate run: vmapping the round over
#: replicas lets XLA reorder float operations in its kernels (measured on CPU: equal, or a few ulp apart
#: in the train loss); integer fields (bytes, steps, clients, rounds) are exact
RTOL, ATOL = 1e-5, 1e-6
TIMES = ("round_time_s", "wall_time_s", "host_time_s")


def _separate(config, seed, lr=None, server_lr=None):
    lr = config.client_lr if lr is None else lr
    server_lr = config.server_lr if server_lr is None else server_lr
    sim = Simulation(dataclasses.replace(config, seed=seed, client_lr=lr, server_lr=server_lr, strategy="fused",
                                         out_dir=None))
    steps = sim.num_steps
    return run(sim.config, sim=sim), sim, steps


def _check_equal(config, seeds, tmp_path, replica_axis="auto", lrs=None, server_lrs=None, compare=None):
    """Runs the replicas and compares each (or the ``compare`` indices only: a separate run is a compile)."""
    done = replicas.run_seeds(dataclasses.replace(config, out_dir=str(tmp_path)), seeds, replica_axis=replica_axis,
                              lrs=lrs, server_lrs=server_lrs)
    steps = []
    settings = replicas.replica_settings(seeds, lrs, server_lrs)
    assert len(done["results"]) == len(settings)
    for i, ((seed, lr, server_lr), result, vsim) in enumerate(zip(settings, done["results"], done["simulations"])):
        if compare is not None and i not in compare:
            continue
        alone, sim, n = _separate(config, seed, lr, server_lr)
        steps.append(n)
        _assert_same_run(result, vsim, alone, sim, config.rounds)
    assert len(set(steps)) > 1, "the seeds should need different numbers of local steps (padding is tested)"
    return done


def _assert_same_run(result, vsim, alone, sim, rounds):
    """A replica's ``result`` and simulation ``vsim`` against a separate run's: records equal but the times, the
    final variables to the tolerance above."""
    assert result["status"] == "complete" and len(result["records"]) == rounds
    for mine, theirs in zip(result["records"], alone["records"]):
        assert mine.keys() == theirs.keys()
        for key in mine.keys() - set(TIMES):
            if isinstance(mine[key], float) or isinstance(theirs[key], float):
                assert mine[key] == pytest.approx(theirs[key], rel=RTOL, abs=ATOL), key
            else:
                assert mine[key] == theirs[key], key
    for a, b in zip(jax.tree.leaves(vsim.state.variables), jax.tree.leaves(sim.state.variables)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL)
    assert int(vsim.state.round) == rounds



def small_cnn(num_classes, input_shape):
    """The zoo's digits CNN (``cnn2c1f``: two convolutions and a dense head) with 4 and 8 channels of 3x3, not 32
    and 64 of 5x5: the vmapped replicas' convolutions all the same, its three rounds (the replicas' and two
    separate runs') compiled in a fraction of the time (``--model tests.experiment.test_replicas:small_cnn``)."""
    from fedpartial._src.models.zoo import CNN2C1F

    return CNN2C1F(num_classes, features=(4, 8), kernel_size=3)


def test_fedavg_cnn_on_digits_equals_separate_fused_runs(tmp_path):
    """The replicas vmapped (the accelerator's choice); the other tests run ``auto``, which is ``map`` on CPU."""
    config = RunConfig(dataset="digits", model=f"{__name__}:small_cnn", num_clients=6, cohort_size=2, rounds=2,
                       batch_size=32, local_epochs=0.5, seed=0)
    done = _check_equal(config, [0, 1], tmp_path, replica_axis="vmap")
    assert [sim.round.trace_count for sim in done["simulations"]] == [1, 0]  # one vmapped trace for 2 rounds
    assert done["summary"]["replica_axis"] == "vmap" and done["summary"]["vmapped"] is True


def test_data_on_the_device_equals_separate_device_runs(tmp_path):
    """``data_placement="device"``: every replica's gather is padded to the common number of steps and its
    placed holdout to the longest one (held-out splits: ``train_fraction``), drawing its own run's batches."""
    config = RunConfig(dataset="digits", model="mlp", num_clients=6, cohort_size=2, rounds=2, batch_size=16,
                       local_epochs=0.5, train_fraction=0.7, data_placement="device", seed=0)
    done = _check_equal(config, [0, 1], tmp_path, replica_axis="map")
    sims = done["simulations"]
    assert [s.data_placement for s in sims] == ["device", "device"]
    assert len({s.holdout[0].shape for s in sims}) == 1 and "personal_accuracy" in done["results"][0]["records"][-1]


# The module fixture below is costly: the module stays on one xdist worker (--dist loadgroup), which
# builds it once.
pytestmark = pytest.mark.xdist_group("replicas")
#: tests where a replica's record equals its separate run's exactly though the two are different programs (a
#: learning rate fed in as data, a mapped replica round): equal at -O1, a few ulp apart at -O0
AT_O1 = {"test_learning_rates_as_replicas_equal_separate_runs_at_each_rate",
         "test_server_learning_rates_as_replicas_equal_separate_runs_and_resume_alone",
         "test_replicas_of_a_single_run_that_is_no_vmapped_round_run_its_strategy_in_a_host_loop"}


@pytest.fixture(autouse=True)
def _rounds_at_o0(request):
    """The other tests' few rounds of small models, compared within the tolerance above or with the same program:
    compiled at -O0 (tests/conftest.py; measured for this file, cold: 228 -> 172 CPU seconds)."""
    if request.node.originalname not in AT_O1:
        request.getfixturevalue("engine_compiled_at_o0")


@pytest.fixture(scope="session")  # kept by its xdist group's worker (see test_sharding.py)
def fedldf(tmp_path_factory):
    config = RunConfig(method="fedldf", options={"n": 1}, dataset="synthetic", model="mlp", num_clients=8,
                       cohort_size=3, rounds=2, batch_size=8, local_epochs=1.0)
    return _check_equal(config, [0, 1], tmp_path_factory.mktemp("ldf"))


def test_fedldf_mlp_on_synthetic_equals_separate_fused_runs(fedldf):
    assert fedldf["summary"]["seeds"] == [0, 1]


def test_a_second_signal_during_replicas_writes_every_replicas_status_before_exiting(tmp_path):
    """The forced exit (tests/experiment/test_checkpoint.py) with several replicas: each run folder says so."""
    import io
    import signal
    import threading

    from fedpartial._src.experiment import run_files, signals

    config = RunConfig(method="fedldf", options={"n": 1}, dataset="synthetic", model="mlp", num_clients=8,
                       cohort_size=3, rounds=2, batch_size=8, local_epochs=1.0, out_dir=str(tmp_path))
    statuses, exited = [], threading.Event()

    def exit_now(code):  # stands in for os._exit: the statuses the process would leave
        parent = next(p for p in tmp_path.iterdir() if p.is_dir())
        statuses.extend((code, run_files.read_status(str(d))) for d in sorted(parent.iterdir()) if d.is_dir())
        exited.set()

    def on_round(t, records):
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        assert exited.wait(5)

    flag = signals.StopFlag(io.StringIO(), grace_s=0.1, exit=exit_now)
    with flag, pytest.raises(signals.RunInterrupted):
        replicas.run_seeds(config, [0, 1], on_round=on_round, stop=flag)
    assert len(statuses) == 2
    for code, status in statuses:
        assert code == 130 and status["status"] == "interrupted"
        assert status["message"].startswith("exited at once by a second signal during round 2")
    assert flag.on_force == []  # the writers' callbacks are given back


def test_run_dirs_and_the_summary_is_mean_and_std(fedldf):
    parent = fedldf["out_dir"]
    assert parent.endswith("fedldf-synthetic-seeds0-1")
    summaries = []
    for seed, run_dir in zip((0, 1), fedldf["run_dirs"]):
        assert run_dir.endswith(f"fedldf-synthetic-seeds0-1/fedldf-synthetic-seed{seed}")
        for name in ("config.json", "config.toml", "environment.json", "metrics.jsonl", "metrics.csv",
                     "summary.json", "status.json"):
            assert os.path.exists(f"{run_dir}/{name}"), name
        assert json.load(open(f"{run_dir}/config.json"))["seed"] == seed
        assert json.load(open(f"{run_dir}/status.json"))["status"] == "complete"
        summaries.append(json.load(open(f"{run_dir}/summary.json")))
    written = json.load(open(f"{parent}/seeds_summary.json"))
    for key in ("final_test_accuracy", "best_test_accuracy", "total_upload_bytes", "total_simulated_time_s",
                "rounds", "rounds_per_s"):
        values = [s[key] for s in summaries]
        assert written[f"{key}_mean"] == pytest.approx(statistics.fmean(values), rel=1e-12)
        assert written[f"{key}_std"] == pytest.approx(statistics.pstdev(values), rel=1e-9, abs=1e-15)
    assert written["statuses"] == ["complete"] * 2
    md = open(f"{parent}/seeds_summary.md").read().splitlines()
    assert md[0].startswith("| method | seeds | final accuracy") and md[0].endswith("rounds/s |")
    acc = [s["final_test_accuracy"] for s in summaries]
    assert md[2].startswith("| fedldf | 0,1 | ") and f"{np.mean(acc):.4f} ± {np.std(acc):.4f}" in md[2]


def test_interrupted_replicas_resume_folder_by_folder_and_the_summary_is_written_again(fedldf, tmp_path, capsys):
    """A stop after round 1 of 2, then ``fedpartial run --resume PARENT``: each replica folder continues on its
    own to the uninterrupted replicas' results, and seeds_summary says every replica is complete."""
    import signal

    from fedpartial._src.experiment import signals

    config = RunConfig(method="fedldf", options={"n": 1}, dataset="synthetic", model="mlp", num_clients=8,
                       cohort_size=3, rounds=2, batch_size=8, local_epochs=1.0, out_dir=str(tmp_path))
    flag = signals.StopFlag(open(os.devnull, "w"))
    with flag, pytest.raises(signals.RunInterrupted):
        replicas.run_seeds(config, [0, 1], on_round=lambda t, records: os.kill(os.getpid(), signal.SIGINT),
                           stop=flag)
    parent = str(next(tmp_path.iterdir()))
    assert json.load(open(f"{parent}/seeds_summary.json"))["statuses"] == ["interrupted"] * 2
    assert main(["run", "--resume", parent, "--dataset", "mnist"]) == 2  # the job's own settings only
    assert "--dataset cannot be combined with --resume" in capsys.readouterr().err
    assert main(["run", "--resume", parent]) == 0
    out = capsys.readouterr().out
    assert "1/2 fedldf-synthetic-seed0: complete" in out and "| fedldf | 0,1 |" in out
    written = json.load(open(f"{parent}/seeds_summary.json"))
    assert written["statuses"] == ["complete"] * 2 and written["layout_note"].startswith("2 of 2 replica folders")
    for resumed, whole in zip([f"{parent}/{d}" for d in written["run_dirs"]], fedldf["run_dirs"]):
        got = [json.loads(line) for line in open(f"{resumed}/metrics.jsonl")]
        want = [json.loads(line) for line in open(f"{whole}/metrics.jsonl")]
        assert [r["round"] for r in got] == [1, 2]
        for key in ("test_accuracy", "train_loss"):
            assert got[-1][key] == pytest.approx(want[-1][key], rel=RTOL, abs=ATOL)
    assert main(["run", "--resume", parent]) == 0  # all complete: only the summary is written again
    assert "complete, kept" in capsys.readouterr().out


def test_the_replica_round_is_traced_once(fedldf):
    """Two rounds ran: the first replica's round function was traced once (under ``auto``'s lax.map on
    CPU, vmap elsewhere), no other ran."""
    assert [sim.round.trace_count for sim in fedldf["simulations"]] == [1, 0]
    assert fedldf["summary"]["replica_axis"] == replica_axis.parse_replica_axis("auto", jax.devices()[0].platform)[0]


def test_the_device_model_counts_the_step_once_for_every_replica(fedldf):
    """The replicas' rounds are built alike, so the device model's step FLOPs are compiled and counted once (the
    first replica's) and read by the others, whose simulated times still equal their separate runs (above)."""
    sims = fedldf["simulations"]
    assert [sim.costs.compilations for sim in sims] == [1, 0]  # [1, 1] when each replica counted its own


@pytest.mark.parametrize("axis", ["vmap", "map", "map:2"])
def test_every_replica_axis_gives_each_replica_its_own_result(axis):
    """3 replicas of a small pure function of a state (``map:2``: a batch of 2, then the remainder) equal a
    loop."""
    def fn(w, x, key_data):
        noise = jax.random.normal(jax.random.wrap_key_data(key_data), w.shape)
        return w / 2 + jnp.tanh(x @ w).sum() + noise, jnp.tanh(x @ w), (w ** 2).sum()

    w, x = jnp.arange(3 * 4 * 2.0).reshape(3, 4, 2) / 10, jnp.ones((3, 5, 4))
    keys = jax.vmap(jax.random.key_data)(jax.random.split(jax.random.key(0), 3))
    got = jax.jit(replica_axis.over_replicas(fn, *replica_axis.parse_replica_axis(axis, "cpu")))(w, x, keys)
    for i in range(3):
        for a, b in zip(got, fn(w[i], x[i], keys[i])):
            np.testing.assert_allclose(a[i], b, rtol=1e-6)


@pytest.mark.parametrize("axis, most", [("map", 1.0), ("map:2", 1.5)])
def test_the_mapped_replica_round_updates_the_stacked_state_in_place(axis, most):
    """FedSPU's 200 personal models per replica dominate the stacked state: the mapped round's scratch memory
    is a fraction of it (one replica's rows, or a batch's), not a second stacked copy.  (``jax.lax.map``,
    which stacked its outputs anew: 258 MiB for a 167 MiB state under ``map``, 350 under ``map:2``.)"""
    # rounds=2 with one run: round 1 is not the last, so nothing is evaluated (its programs prove nothing here)
    config = RunConfig(method="fedspu", dataset="synthetic", num_clients=200, cohort_size=5, rounds=2,
                       local_steps=2, batch_size=16, max_samples=20, eval_every=100, out_dir=None)
    reps = replicas.Replicas(config, [0, 1, 2, 3], replica_axis=axis)
    calls, round_fn = [], reps._round
    reps._round = lambda *args: calls.append(args) or round_fn(*args)
    stacked = memory.tree_bytes(reps.state)
    reps.run_round(0, [True] * 4, [None] * 4)
    scratch = round_fn.lower(*calls[0]).compile().memory_analysis().temp_size_in_bytes
    assert scratch < most * stacked, (memory.gib(scratch), memory.gib(stacked))


def test_replica_axis_choices():
    assert replica_axis.parse_replica_axis("auto", "cpu") == ("map", None)
    assert replica_axis.parse_replica_axis("auto", "gpu") == ("vmap", None)
    assert replica_axis.parse_replica_axis("vmap", "cpu") == ("vmap", None)
    assert replica_axis.parse_replica_axis("map:3", "gpu") == ("map", 3)
    for bad in ("pmap", "map:0", "map:x", "vmap:2", ""):
        with pytest.raises(ConfigError, match=f"replica axis {bad!r} is not allowed"):
            replica_axis.parse_replica_axis(bad, "cpu")


@pytest.mark.parametrize("args, words", [
    (["--seeds", "0,0"], "--seeds '0,0' names a seed twice"),
    (["--seeds", "0,x"], "--seeds '0,x' is not allowed: it must be whole numbers"),
    (["--seeds", "-1"], "--seeds '-1' is not allowed"),
    (["--seeds", "0,1", "--seed", "2"], "--seeds cannot be combined with --seed"),
    (["--seeds", "0,1", "--resume", "somewhere"], "--seeds cannot be combined with --resume"),
    (["--seeds", "0,1", "--strategy", "stepwise"], "--strategy stepwise cannot run with --seeds"),
    (["--seeds", "0,1", "--strategy", "debug"], "--strategy debug cannot run with --seeds"),
])
def test_bad_seeds_exit_2_with_one_sentence(tmp_path, capsys, args, words):
    assert main(["run", "--dataset", "synthetic", "--rounds", "1", "--out", str(tmp_path / "o")] + args) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and err.count("\n") == 0 and err.endswith(".")
    assert not (tmp_path / "o").exists()


def test_strategy_for_replicas():
    assert replica_axis.replica_strategy("auto") == "fused"
    assert replica_axis.replica_strategy("fused:4") == "fused:4"
    with pytest.raises(ConfigError, match="--strategy stepwise:2 cannot run with --seeds"):
        replica_axis.replica_strategy("stepwise:2")


def test_replicas_run_on_one_device():
    assert {c.devices for c in replicas.replica_configs(RunConfig(dataset="synthetic"), [0, 1], None)} == {1}
    with pytest.raises(ConfigError, match="--devices 2 cannot run with --seeds"):
        replicas.replica_configs(RunConfig(dataset="synthetic", devices=2), [0, 1], None)
    with pytest.raises(ConfigError, match="--client-state disk cannot run with --seeds"):
        replicas.replica_configs(RunConfig(dataset="synthetic", client_state="disk"), [0, 1], None)


def test_cli_seeds_writes_the_parent_folder(tmp_path, capsys):
    assert main(["run", "--dataset", "synthetic", "--clients", "6", "--cohort", "2", "--rounds", "1",
                 "--local-steps", "1", "--seeds", "5,7", "--out", str(tmp_path), "--quiet"]) == 0
    parent = capsys.readouterr().out.strip()
    assert parent == str(tmp_path / "fedavg-synthetic-seeds5_7")
    assert sorted(p.name for p in (tmp_path / "fedavg-synthetic-seeds5_7").iterdir()) == [
        "fedavg-synthetic-seed5", "fedavg-synthetic-seed7", "job.json", "seeds_summary.json", "seeds_summary.md"]


def test_a_failed_replica_says_why_under_quiet_too(tmp_path, capsys, monkeypatch):
    from fedpartial._src.core.errors import UserError

    def one_fails(config, seeds, **kwargs):  # the replicas' results as run_seeds gives them, the second failed
        results = [{"status": "complete", "run_dir": str(tmp_path / "r-seed0")},
                   {"status": "failed", "run_dir": str(tmp_path / "r-seed1"),
                    "error": UserError("method fedad cannot run this lowering; use --conv-impl lax.")}]
        return {"out_dir": str(tmp_path / "r"), "results": results, "replica_axis": "map", "data_placement": "host",
                "note": None}

    monkeypatch.setattr(replicas, "run_seeds", one_fails)
    assert main(["run", "--dataset", "synthetic", "--clients", "6", "--cohort", "2", "--rounds", "1",
                 "--local-steps", "1", "--seeds", "0,1", "--out", str(tmp_path), "--quiet"]) == 1
    out, err = capsys.readouterr()
    assert out.strip() == str(tmp_path / "r")
    assert err.strip() == "r-seed1: failed: method fedad cannot run this lowering; use --conv-impl lax."


def test_learning_rates_as_replicas_equal_separate_runs_at_each_rate(tmp_path):
    """``--lrs``: every rate with every seed, one round for all (rate 1 in the optimizer, each replica's
    rate in its cohort); a replica equals its separate run at its rate, and the summary has a row per
    rate over the seeds."""
    config = RunConfig(dataset="digits", model="mlp", num_clients=6, cohort_size=2, rounds=2, batch_size=16,
                       local_epochs=0.5, momentum=0.9, weight_decay=1e-3, seed=0)
    lrs = [0.02, 0.3]
    # separate runs of (seed 1, rate 0.02) and (seed 0, rate 0.3): they differ in the seed and the rate, and a
    # replica order with seeds and rates swapped would give each the other's (0 and 3 would not tell); every
    # replica's own rate and seed are checked through its folder's config below
    done = _check_equal(config, [0, 1], tmp_path, replica_axis="map", lrs=lrs, compare=(1, 2))
    assert [sim.round.trace_count for sim in done["simulations"]] == [1, 0, 0, 0]
    parent = done["out_dir"]
    assert parent.endswith("fedavg-digits-seeds0-1-lrs0.02_0.3")
    names = [os.path.basename(d) for d in done["run_dirs"]]
    assert names == [f"fedavg-digits-seed{s}-lr{lr!r}" for lr in lrs for s in (0, 1)]
    finals = [r["records"][-1]["test_accuracy"] for r in done["results"]]
    assert finals[:2] != finals[2:]  # the rates really differ
    written = json.load(open(f"{parent}/seeds_summary.json"))
    assert written["lrs"] == lrs and written["seeds"] == [0, 1] and len(written["rows"]) == 2
    for i, (lr, row) in enumerate(zip(lrs, written["rows"])):
        assert row["client_lr"] == lr and row["seeds"] == "0,1" and row["method"] == f"fedavg lr {lr!r}"
        for key in ("final_test_accuracy", "total_upload_bytes", "rounds"):
            values = [json.load(open(f"{d}/summary.json"))[key] for d in done["run_dirs"][2 * i:2 * i + 2]]
            assert row[f"{key}_mean"] == pytest.approx(statistics.fmean(values), rel=1e-12)
            assert row[f"{key}_std"] == pytest.approx(statistics.pstdev(values), rel=1e-9, abs=1e-15)
    for d, (seed, lr, _) in zip(done["run_dirs"], replicas.replica_settings([0, 1], lrs)):
        saved = json.load(open(f"{d}/config.json"))
        assert (saved["seed"], saved["client_lr"]) == (seed, lr)
    md = open(f"{parent}/seeds_summary.md").read().splitlines()
    assert md[2].startswith("| fedavg lr 0.02 | 0,1 | ") and md[3].startswith("| fedavg lr 0.3 | 0,1 | ")


def test_server_learning_rates_as_replicas_equal_separate_runs_and_resume_alone(tmp_path):
    """``--server-lrs`` (FedAdam): the server optimizer at rate 1 and each replica's rate in its server state;
    with ``--lrs`` every server rate runs with every client rate.  Each replica equals its separate run, its
    folder holds a separate run's state (no rate in it) and resumes on its own."""
    config = RunConfig(dataset="digits", model="mlp", num_clients=6, cohort_size=2, rounds=2, batch_size=16,
                       local_epochs=0.5, server_optimizer="adam", seed=0)
    server_lrs, lrs = [0.03, 0.3], [0.05, 0.2]
    # separate runs of the first and last replicas (every rate and seed differs between them) and of one
    # in between; every replica's own rates are checked through its folder's config and the summary below
    done = _check_equal(config, [0, 1], tmp_path, replica_axis="map", lrs=lrs, server_lrs=server_lrs,
                        compare=(0, 5, 7))
    assert [sim.round.trace_count for sim in done["simulations"]] == [1] + [0] * 7
    parent = done["out_dir"]
    assert parent.endswith("fedavg-digits-seeds0-1-lrs0.05_0.2-slrs0.03_0.3")
    settings = replicas.replica_settings([0, 1], lrs, server_lrs)
    names = [os.path.basename(d) for d in done["run_dirs"]]
    assert names == [f"fedavg-digits-seed{s}-lr{lr!r}-slr{slr!r}" for s, lr, slr in settings]
    assert [s.server_lr for s in settings] == [0.03] * 4 + [0.3] * 4
    finals = [r["records"][-1]["test_accuracy"] for r in done["results"]]
    assert finals[:4] != finals[4:]  # the server rates really differ
    for d, (seed, lr, slr) in zip(done["run_dirs"], settings):
        saved = json.load(open(f"{d}/config.json"))
        assert (saved["seed"], saved["client_lr"], saved["server_lr"]) == (seed, lr, slr)
    separate = Simulation(dataclasses.replace(config, seed=1, client_lr=0.2, server_lr=0.3, out_dir=None))
    last = done["simulations"][-1]
    assert last.state.server_lr_scale is None
    assert jax.tree.structure(last.state) == jax.tree.structure(separate.state)
    written = json.load(open(f"{parent}/seeds_summary.json"))
    assert written["lrs"] == lrs and written["server_lrs"] == server_lrs and len(written["rows"]) == 4
    assert [(r["server_lr"], r["client_lr"]) for r in written["rows"]] == [(0.03, 0.05), (0.03, 0.2), (0.3, 0.05),
                                                                          (0.3, 0.2)]
    assert written["rows"][3]["method"] == "fedavg lr 0.2 server lr 0.3" and written["rows"][3]["seeds"] == "0,1"
    # a replica's folder resumes on its own: one more round from its checkpoint equals that run going on
    resumed = run(dataclasses.replace(last.config, rounds=3), resume=done["run_dirs"][-1])
    alone = run(dataclasses.replace(config, seed=1, client_lr=0.2, server_lr=0.3, strategy="fused", rounds=3,
                                    out_dir=None))
    assert resumed["resumed_from_round"] == 2 and resumed["records"][-1]["round"] == 3  # from its checkpoint
    for key in ("test_accuracy", "train_loss"):
        assert resumed["records"][-1][key] == pytest.approx(alone["records"][-1][key], rel=RTOL, abs=ATOL)


def test_cli_server_lrs_with_lrs_writes_a_folder_per_pair(tmp_path, capsys):
    assert main(["run", "--dataset", "synthetic", "--clients", "6", "--cohort", "2", "--rounds", "1",
                 "--local-steps", "1", "--seed", "3", "--lrs", "0.1,0.01", "--server-opt", "adam", "--server-lrs",
                 "0.5,1.0", "--out", str(tmp_path), "--quiet"]) == 0
    parent = tmp_path / "fedavg-synthetic-seeds3-lrs0.1_0.01-slrs0.5_1.0"
    assert capsys.readouterr().out.strip() == str(parent)
    assert sorted(p.name for p in parent.iterdir()) == sorted(
        [f"fedavg-synthetic-seed3-lr{lr}-slr{slr}" for lr in ("0.1", "0.01") for slr in ("0.5", "1.0")]
        + ["job.json", "seeds_summary.json", "seeds_summary.md"])
    saved = json.load(open(parent / "fedavg-synthetic-seed3-lr0.01-slr0.5" / "config.json"))
    assert (saved["server_optimizer"], saved["server_lr"], saved["client_lr"]) == ("adam", 0.5, 0.01)


# --lrs and --server-lrs refusals (one sentence, nothing created) are rows of docs/validation.md, run by
# tests/experiment/test_validation.py.


def test_cli_lrs_without_seeds_uses_the_seed(tmp_path, capsys):
    assert main(["run", "--dataset", "synthetic", "--clients", "6", "--cohort", "2", "--rounds", "1",
                 "--local-steps", "1", "--seed", "3", "--lrs", "0.1,0.01", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    layout = out.index("2 replicas in one jitted round (replica axis: map), data on the host")  # CPU's auto
    assert out[layout - 4].startswith("| method | seeds |") and out[layout + 1].startswith("results:")  # 2 rows
    assert sorted(p.name for p in (tmp_path / "fedavg-synthetic-seeds3-lrs0.1_0.01").iterdir()) == [
        "fedavg-synthetic-seed3-lr0.01", "fedavg-synthetic-seed3-lr0.1", "job.json", "seeds_summary.json",
        "seeds_summary.md"]


MIB = 2**20


def test_the_replica_round_holds_every_state_and_cohort_and_the_clients_of_those_in_flight():
    # one replica: 10 MiB of server arrays, 4 of them its state between rounds
    est = memory.MemoryEstimate(server=memory.RUNTIME_BYTES + 10 * MIB, clients=100 * MIB, data=5 * MIB,
                                in_flight=10, per_client=int(10.5 * MIB), state=4 * MIB)
    # 3 × (10 + its own state 4) + the 2 in flight's rows taken out of the stacked state (2 × 4)
    assert memory.for_replicas(est, 3, 2) == est._replace(server=memory.RUNTIME_BYTES + 50 * MIB,
                                                          clients=200 * MIB, data=15 * MIB, in_flight=20)
    # vmap: all at once, no rows taken out
    assert memory.for_replicas(est, 3, 3) == est._replace(server=memory.RUNTIME_BYTES + 42 * MIB,
                                                          clients=300 * MIB, data=15 * MIB, in_flight=30)
    assert memory.for_replicas(est, 1, 1) == est._replace(server=memory.RUNTIME_BYTES + 14 * MIB)


@pytest.mark.parametrize("client_state", ["device", "host"])
def test_the_estimate_counts_the_server_state_held_between_rounds(client_state):
    config = RunConfig(method="fedspu", dataset="synthetic", num_clients=30, cohort_size=5, rounds=1,
                       local_steps=2, batch_size=16, max_samples=20, out_dir=None, client_state=client_state)
    sim = Simulation(config)
    model = memory.tree_bytes(sim.state.variables)
    assert sim.memory.state == memory.tree_bytes(sim.state)  # the 30 personal models on the device, or none
    assert sim.memory.state > 30 * model if client_state == "device" else sim.memory.state < 2 * model


def test_auto_trains_the_most_replicas_at_a_time_that_fit_and_a_named_axis_is_refused():
    # one replica: server 256 (runtime) + 10, clients 100, data 5 MiB; three replicas: 256 + 30 + 15 MiB and
    # 100 MiB per replica in flight: 601 MiB at once (vmap), 501 two at a time, 401 one at a time
    est = memory.MemoryEstimate(server=memory.RUNTIME_BYTES + 10 * MIB, clients=100 * MIB, data=5 * MIB,
                                in_flight=10, per_client=int(10.5 * MIB))
    vmap, where = ("vmap", None), "Fake GPU memory"
    fit = lambda available_mib, **kw: replica_axis.fit_replica_axis(est, 3, kw.pop("axis", vmap),  # noqa: E731
                                                                available_mib * MIB, where, **kw)
    assert fit(700, auto=True) == (vmap, None)  # 0.9 × 700 = 630 ≥ 601
    assert replica_axis.fit_replica_axis(est, 3, vmap, None, where, auto=True) == (vmap, None)  # nothing known
    head = "3 replicas all at once (vmap) would need about 601 MiB but {} MiB of Fake GPU memory is available"
    assert fit(600, auto=True) == (("map", 2), "auto runs 2 of the replicas at a time: " + head.format(600))
    assert fit(500, auto=True) == (("map", None), "auto runs 1 of the replicas at a time: " + head.format(500))
    with pytest.raises(ConfigError) as named:
        fit(600, auto=False)
    assert str(named.value) == head.format(600) + "; use replica_axis='map:2' (2 at a time)."
    with pytest.raises(ConfigError) as two:  # 0.9 × 420 = 378: one replica (371) fits, two (386) do not
        fit(420, auto=True)
    assert str(two.value) == head.format(420) + (
        ", and too much even one at a time (every replica's state and cohort stay on the device); run at most 1 "
        "of them together and the rest in another run (fedpartial compare reads them all).")
    with pytest.raises(ConfigError, match=r"even one at a time; use a smaller --cohort or fewer --clients\.$"):
        fit(400, auto=True)
    with pytest.raises(ConfigError, match=r"^3 replicas 2 at a time would need about 501 MiB"):
        fit(500, axis=("map", 2), auto=False)


def _pose_as_gpu(monkeypatch, limit_mib):
    """This CPU as an accelerator of ``limit_mib`` MiB (:func:`tests.conftest.fake_device_memory`) without the
    runtime's fixed share in the estimate, so that data and clients decide."""
    monkeypatch.setattr(memory, "RUNTIME_BYTES", 0)
    monkeypatch.setattr(replica_axis, "platform", lambda: "gpu")
    fake_device_memory(monkeypatch, limit_mib)


WIDE = RunConfig(num_clients=40, cohort_size=4, local_steps=2, batch_size=8, rounds=2, eval_every=2)


def test_auto_places_every_replicas_data_or_none_of_it(monkeypatch, tmp_path):
    """Each replica's data takes 30.5 MiB (:func:`tests.conftest.wide_dataset`).  At 140 MiB one replica's data
    is within a quarter of the free memory and both replicas' (61 MiB) are not: decided one replica after
    another, the first went to the device and the second stayed on the host (other batches than its own run's).
    Now both stay on the host, and each replica equals its separate run with the data named on the host."""
    dataset = wide_dataset()
    _pose_as_gpu(monkeypatch, 140)
    done = replicas.run_seeds(dataclasses.replace(WIDE, out_dir=str(tmp_path)), [0, 1], dataset_for=lambda c: dataset)
    assert [s.data_placement for s in done["simulations"]] == ["host", "host"]
    assert (done["data_placement"], done["replica_axis"], done["note"]) == ("host", "vmap", None)
    assert done["summary"]["data_placement"] == "host" and "layout_note" not in done["summary"]
    for i in (0, 1):
        sim = Simulation(dataclasses.replace(WIDE, seed=i, strategy="fused", data_placement="host"), dataset)
        _assert_same_run(done["results"][i], done["simulations"][i], run(sim.config, sim=sim), sim, WIDE.rounds)
    _pose_as_gpu(monkeypatch, 300)  # 61 MiB ≤ 75: both on the device
    with pytest.raises(ConfigError, match=r"^data_placement 'gpu' is not allowed: choose host or device \(or None for "
                                          r"--data-placement auto\)\.$"):
        Simulation(WIDE, dataset, data_placement="gpu")
    # refused before any data is loaded
    monkeypatch.setattr("fedpartial._src.data.sources.load_dataset", lambda *a, **k: pytest.fail("data was loaded"))
    with pytest.raises(ConfigError, match=r"^data_placement 'gpu' is not allowed"):
        Simulation(WIDE, data_placement="gpu")
    copies = count_copies(monkeypatch)
    both = replicas.Replicas(WIDE, [0, 1], dataset_for=lambda c: dataset)
    assert [s.data_placement for s in both.sims] == ["device", "device"] and both.note is None and len(copies) == 2


def test_auto_placed_data_gives_way_to_the_replicas_then_their_parallelism(monkeypatch):
    """Cohorts of 40: one replica needs 1.9 MiB of server arrays (0.9 of them its state, which it also keeps as
    its own), 201.1 MiB of clients in flight and 4.9 of packed data (5.15 MiB a client, as for one run), so two
    replicas 417 MiB at once and 217 MiB one at a time."""
    dataset = wide_dataset()
    config = dataclasses.replace(WIDE, cohort_size=40)
    _pose_as_gpu(monkeypatch, 500)  # 61 MiB of data ≤ a quarter: device; but 0.9 · 437 < 417 ≤ 0.9 · 498
    copies = count_copies(monkeypatch)
    fitted = replicas.Replicas(config, [0, 1], dataset_for=lambda c: dataset)
    assert [s.data_placement for s in fitted.sims] == ["host", "host"] and fitted.replica_axis == ("vmap", None)
    assert copies == []  # checked before any replica's data was copied
    assert fitted.note == ("auto keeps the data on the host: with the 2 replicas' 61 MiB on the device, they would "
                           "need about 417 MiB but 437 MiB of Fake GPU memory would be left")
    _pose_as_gpu(monkeypatch, 300)  # not on the device, and still 0.9 · 298 < 417: one replica at a time (217)
    mapped = replicas.Replicas(config, [0, 1], dataset_for=lambda c: dataset)
    assert [s.data_placement for s in mapped.sims] == ["host", "host"] and mapped.replica_axis == ("map", None)
    assert mapped.note == ("auto keeps the data on the host: with the 2 replicas' 61 MiB on the device, they would "
                           "need about 417 MiB but 237 MiB of Fake GPU memory would be left; auto runs 1 of the "
                           "replicas at a time: 2 replicas all at once (vmap) would need about 417 MiB but 298 MiB of "
                           "Fake GPU memory is available")
    del mapped
    _pose_as_gpu(monkeypatch, 300)  # named, the axis is not changed: the sentence says what fits
    with pytest.raises(ConfigError, match=r"^2 replicas all at once \(vmap\) would need about 417 MiB but 298 MiB of "
                                          r"Fake GPU memory is available; use replica_axis='map' \(one at a time\)\.$"):
        replicas.Replicas(config, [0, 1], dataset_for=lambda c: dataset, replica_axis="vmap")


def test_fine_tuning_replicas_train_at_their_own_rate_as_separate_runs(tmp_path):
    """FedBABU's evaluation fine-tunes every client: a replica (whose round runs at rate 1, its rate in its
    cohort) fine-tunes at its own rate, so its personalised accuracy equals its separate run's."""
    config = RunConfig(method="fedbabu", dataset="digits", model="mlp", num_clients=6, cohort_size=2, rounds=1,
                       batch_size=16, local_epochs=0.5, client_lr=0.05, seed=0, options={"finetune_epochs": 1.0})
    done = replicas.run_seeds(config, [0, 1], replica_axis="map")
    alone, _, _ = _separate(config, 1)  # one seed is enough (a separate run is a compile)
    mine, theirs = done["results"][1]["records"][-1], alone["records"][-1]
    assert mine["personal_accuracy"] == pytest.approx(theirs["personal_accuracy"], rel=RTOL, abs=ATOL)


@pytest.mark.parametrize("layout, strategy", [("vmap", "fused"), ("map", "fused:1"), ("loop", "fused:1"), (None, None)])
def test_replicas_follow_the_layout_a_single_run_measures(layout, strategy, monkeypatch):
    """``--strategy auto`` with ``--conv-impl auto``: the lowering and layout measured for a single run, in the fused
    family (a host loop is one client at a time inside the round); nothing measured, or a strategy named: None."""
    from fedpartial._src.engine.conv_choice import ConvChoice

    monkeypatch.setattr(replica_axis, "choose_conv", lambda config, dataset: ConvChoice("mapped", layout, {}, "test"))
    config = RunConfig(dataset="digits", model="cnn2c1f", conv_impl="auto")
    assert replica_axis.decided_layout(config, None) == (None if strategy is None else (strategy, "mapped"))
    assert replica_axis.decided_layout(dataclasses.replace(config, strategy="fused:2"), None) is None


@pytest.mark.parametrize("layout, strategy", [("loop", "stepwise:1"), ("map", "fused:1")])
def test_replicas_of_a_single_run_that_is_no_vmapped_round_run_its_strategy_in_a_host_loop(layout, strategy,
                                                                                         monkeypatch, tmp_path):
    """A measured ``loop`` (a single run's ``stepwise:1``) or ``map`` (``fused:1``): the replicas run that strategy
    one after another from the host, every replica in the first one's compiled round (nothing traced for the
    others), each at its own client and server rate, and each equals its separate run of that strategy bit for
    bit; its folder's checkpoint holds its final state."""
    from fedpartial._src.engine.conv_choice import ConvChoice
    from fedpartial._src.experiment import checkpoint

    monkeypatch.setattr(replica_axis, "choose_conv", lambda config, dataset: ConvChoice("lax", layout, {}, "test"))
    # The MLP: the layout is stubbed above, and nothing in the host loop depends on the model (the digits CNN, whose
    # layout this is in practice, compiled the three rounds here, the replicas' and two separate runs', 2-3x
    # slower: measured 63 against 41 CPU seconds for 'loop', 50 against 16 for 'map')
    config = RunConfig(dataset="digits", model="mlp", num_clients=6, cohort_size=2, rounds=2, batch_size=16,
                       local_epochs=0.5, momentum=0.9, server_optimizer="adam", conv_impl="auto", seed=0,
                       out_dir=str(tmp_path))
    lrs, server_lrs = [0.02, 0.3], [0.1, 0.5]
    done = replicas.run_seeds(config, [0, 1], lrs=lrs, server_lrs=server_lrs, checkpoint_every=1)
    assert done["replica_axis"] == "loop" and done["summary"]["replica_axis"] == "loop"
    assert done["summary"]["vmapped"] is False
    sims = done["simulations"]
    assert [s.round.trace_count for s in sims[1:]] == [0] * 7 and sims[0].round.trace_count > 0
    assert {str(s.round.strategy) for s in sims} == {strategy}
    settings = replicas.replica_settings([0, 1], lrs, server_lrs)
    steps = set()
    for i in (0, 7) if layout == "loop" else (3,):  # the first and last differ in every rate and the seed
        (_, lr, server_lr), result, vsim = settings[i], done["results"][i], sims[i]
        saved = run_directory.load_config(done["run_dirs"][i])
        assert (saved.strategy, saved.conv_impl, saved.client_lr, saved.server_lr) == (strategy, "lax", lr, server_lr)
        sim = Simulation(dataclasses.replace(saved, out_dir=None))
        alone = run(sim.config, sim=sim)
        steps.add(sim.num_steps)
        assert result["status"] == "complete"
        for mine, theirs in zip(result["records"], alone["records"], strict=True):
            assert {k: v for k, v in mine.items() if k not in TIMES} == {k: v for k, v in theirs.items()
                                                                          if k not in TIMES}
        for a, b in zip(jax.tree.leaves(vsim.state), jax.tree.leaves(sim.state), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert checkpoint.latest_round(done["run_dirs"][i]) == 2
        checkpoint.restore(done["run_dirs"][i], sim, step=1)  # round 1's state, then the replica's last round alone
        assert sim.progress["round"] == 1 and len(list(sim.rounds())) == 1
        for a, b in zip(jax.tree.leaves(vsim.state), jax.tree.leaves(sim.state), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert layout == "map" or len(steps) > 1, "the seeds should need different numbers of local steps"


@pytest.mark.parametrize("layout, strategy, looped", [("vmap", "fused", False), ("map", "fused:1", True),
                                                      ("loop", "stepwise:1", True), (None, None, False)])
def test_with_the_replica_axis_left_to_auto_replicas_take_the_single_runs_strategy(layout, strategy, looped,
                                                                                  monkeypatch):
    """The replica axis left to ``auto``: the single run's own strategy for the measured layout, stacked only where
    it is the vmapped fused round (``vmap``) or nothing was measured; otherwise a host loop with no stacked state."""
    from fedpartial._src.engine.conv_choice import ConvChoice

    monkeypatch.setattr(replica_axis, "choose_conv", lambda config, dataset: ConvChoice("lax", layout, {}, "test"))
    config = RunConfig(dataset="synthetic", model="mlp", num_clients=6, cohort_size=2, rounds=1, local_steps=1,
                       batch_size=8, conv_impl="auto", out_dir=None)
    decided = replica_axis.decided_layout(config, None, stacked=False)
    assert decided == (None if strategy is None else (strategy, "lax"))
    assert replica_axis.runs_looped(decided) is looped
    reps = replicas.Replicas(config, [0, 1])
    assert {str(sim.round.strategy) for sim in reps.sims} == {strategy or "fused"}
    if looped:
        assert reps.replica_axis == replica_axis.LOOP and reps.loop is not None and reps.state is None
    else:
        assert reps.replica_axis == ("map", None) and reps.loop is None and reps.state is not None
    named = replicas.Replicas(config, [0, 1], replica_axis="map")  # a named axis: stacked, in the fused family
    assert named.loop is None and named.replica_axis == ("map", None)
    assert {str(sim.round.strategy) for sim in named.sims} == {replica_axis.LAYOUT_STRATEGIES.get(layout, "fused")}
