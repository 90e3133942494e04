"""Checkpoints, resume, run status and clean interruption (issue 13)."""

import dataclasses
import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from fedpartial._src.cli.main import main
from fedpartial._src.core.errors import UserError
from fedpartial._src.experiment import checkpoint, checkpoint_arrays, disk, run_files, signals
from fedpartial._src.experiment.config import RunConfig
from fedpartial._src.experiment.run_directory import load_config
from fedpartial._src.experiment.simulation import Simulation, run

ROUNDS = 5
TINY = dict(dataset="digits", model="mlp", num_clients=6, cohort_size=3, rounds=ROUNDS, local_steps=2,
            batch_size=8)
CLI = ["run", "--dataset", "digits", "--model", "mlp", "--clients", "6", "--cohort", "3", "--rounds", str(ROUNDS),
       "--local-steps", "2", "--batch-size", "8"]
WALL_CLOCK = ("round_time_s", "wall_time_s", "host_time_s")


def _records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _without_wall_clock(records):
    return [{k: v for k, v in r.items() if k not in WALL_CLOCK} for r in records]


def _strict(path):
    """Parses a result file refusing NaN/Infinity (the JSON standard's numbers only)."""
    def refuse(name):
        raise AssertionError(f"{path} holds {name}")
    with open(path) as f:
        text = f.read()
    lines = text.splitlines() if path.endswith(".jsonl") else [text]
    return [json.loads(line, parse_constant=refuse) for line in lines]


def _same_state(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def compiled():
    """One Simulation of the tiny configuration and its initial state: compiling once keeps the file fast."""
    sim = Simulation(RunConfig(**TINY, out_dir=None))
    return sim, sim.state, dict(sim.progress)


def fresh(compiled, out_dir, name):
    """``compiled``'s simulation back at round 0, writing to ``out_dir/name``."""
    sim, state, progress = compiled
    sim.state, sim.progress = state, dict(progress)
    sim.config = dataclasses.replace(sim.config, out_dir=str(out_dir), run_name=name)
    return sim


@pytest.fixture(scope="module")
def baseline(compiled, tmp_path_factory):
    """An uninterrupted run of the tiny configuration (its final state and metrics)."""
    sim = fresh(compiled, tmp_path_factory.mktemp("base"), "base")
    result = run(sim.config, sim=sim, checkpoint_every=2)
    return sim.state, dict(sim.progress), result


def test_strict_json_writes_non_finite_numbers_as_null():
    value = {"a": math.nan, "b": [math.inf, 1.5, -math.inf], "c": np.float32("nan"), "d": np.int64(3)}
    assert run_files.strict_json(value) == '{"a": null, "b": [null, 1.5, null], "c": null, "d": 3}'


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_typed_prng_keys_round_trip_through_key_data(impl):
    tree = {"key": jax.random.key(7, impl=impl), "keys": jax.random.split(jax.random.key(3, impl=impl), 4),
            "w": np.arange(6, dtype=np.float32).reshape(2, 3), "n": np.int32(5)}
    arrays = checkpoint_arrays.to_arrays(tree)
    assert all(not checkpoint_arrays.is_key(a) for a in arrays.values())
    back = checkpoint_arrays.from_arrays(arrays, tree)
    assert jax.random.key_impl(back["keys"]) == jax.random.key_impl(tree["keys"])
    np.testing.assert_array_equal(jax.random.key_data(back["keys"]), jax.random.key_data(tree["keys"]))
    np.testing.assert_array_equal(jax.random.key_data(back["key"]), jax.random.key_data(tree["key"]))
    np.testing.assert_array_equal(back["w"], tree["w"])


def test_complete_run_writes_status_checkpoints_and_strict_json(compiled, baseline):
    state, progress, result = baseline
    run_dir = result["run_dir"]
    status = _strict(os.path.join(run_dir, "status.json"))[0]
    assert status["status"] == "complete" and status["round"] == ROUNDS and status["checkpoint_round"] == ROUNDS
    # every 2 rounds and the end (round 5), the newest two kept
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["4", "5"]
    assert _strict(os.path.join(run_dir, "summary.json"))[0]["status"] == "complete"
    assert [r["round"] for r in _strict(os.path.join(run_dir, "metrics.jsonl"))] == [1, 2, 3, 4, 5]
    # config.json holds the resolved settings (here: no held-out split, train fraction 1).
    assert load_config(run_dir) == dataclasses.replace(RunConfig(**TINY), out_dir=os.path.dirname(run_dir),
                                                       run_name="base", train_fraction=1.0,
                                                       data_placement=compiled[0].data_placement)
    # The final checkpoint is the final state, progress included.
    other = fresh(compiled, "unused", "unused")
    checkpoint.restore(run_dir, other)
    _same_state(other.state, state)
    assert other.progress == progress and other.progress["round"] == ROUNDS


def test_signal_stops_after_the_round_and_resume_matches_uninterrupted_run(compiled, baseline, tmp_path):
    base_state, _, base = baseline
    sim = fresh(compiled, tmp_path, "stopped")

    def on_round(record):  # a SIGTERM arriving during round 2 (delivered to this, the main thread)
        if record["round"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(signals.RunInterrupted) as stopped:
        run(sim.config, sim=sim, on_round=on_round, checkpoint_every=3)
    assert stopped.value.exit_code == 143
    run_dir = stopped.value.summary["run_dir"]
    status = _strict(os.path.join(run_dir, "status.json"))[0]
    # The run checkpoints where it stopped even though 2 is not a multiple of 3, and says so.
    assert status["status"] == "interrupted" and status["round"] == 2 and status["checkpoint_round"] == 2
    assert "SIGTERM" in status["message"] and "--resume" in status["message"]
    summary = _strict(os.path.join(run_dir, "summary.json"))[0]
    assert summary["status"] == "interrupted" and summary["rounds"] == 2
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers are given back

    # A kill in the middle of the next checkpoint's write leaves a temporary directory: never read.
    torn = os.path.join(run_dir, "checkpoints", "3.orbax-checkpoint-tmp-1700000000")
    os.makedirs(os.path.join(torn, "state"))
    with open(os.path.join(torn, "state", "garbage"), "w") as f:
        f.write("half written")
    # ... and metrics of rounds after the checkpoint (a kill between writing them and the next checkpoint).
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"round": 3, "train_loss": 0.0}) + "\n" + '{"round": 4, "tra')
    assert checkpoint.latest_round(run_dir) == 2

    sim = fresh(compiled, tmp_path, "unused")
    result = run(sim.config, sim=sim, resume=run_dir)
    _same_state(sim.state, base_state)
    assert _without_wall_clock(_strict(os.path.join(run_dir, "metrics.jsonl"))) == \
        _without_wall_clock(_strict(os.path.join(base["run_dir"], "metrics.jsonl")))
    assert result["resumed_from_round"] == 2 and result["rounds"] == ROUNDS
    assert result["total_upload_bytes"] == base["total_upload_bytes"]
    assert result["total_simulated_time_s"] == base["total_simulated_time_s"]
    assert not os.path.exists(torn)  # removed by the checkpoint manager
    assert run_files.read_status(run_dir)["status"] == "complete"


def test_per_process_checkpoints_of_a_multi_process_run_resume_bit_identically(compiled, baseline, tmp_path,
                                                                              monkeypatch):
    """The format each process of a jax.distributed run writes into its own run directory (orbax synchronises
    every process on one shared directory), exercised in this one process; the two-process run itself is
    tests/engine/test_sharding.py's slow test."""
    base_state, _, base = baseline
    monkeypatch.setattr(checkpoint, "several_processes", lambda: True)
    sim = fresh(compiled, tmp_path, "multi")
    run_dir = run(sim.config, sim=sim, checkpoint_every=1)["run_dir"]
    root = os.path.join(run_dir, "checkpoints")
    kept = [str(r) for r in range(ROUNDS - checkpoint.KEEP + 1, ROUNDS + 1)]
    assert sorted(os.listdir(root), key=int) == kept  # the newest two, nothing temporary left
    assert sorted(os.listdir(os.path.join(root, kept[-1]))) == ["host.json", "state.npz"]
    assert checkpoint.latest_round(run_dir) == ROUNDS
    # killed after the round before the last: its checkpoint is the newest; a half-written next one is ignored
    shutil.rmtree(os.path.join(root, kept[-1]))
    os.makedirs(os.path.join(root, f".{ROUNDS}.tmp"))
    assert checkpoint.latest_round(run_dir) == ROUNDS - 1
    sim = fresh(compiled, tmp_path, "unused")
    result = run(sim.config, sim=sim, resume=run_dir)
    assert result["resumed_from_round"] == ROUNDS - 1
    _same_state(sim.state, base_state)
    assert result["total_upload_bytes"] == base["total_upload_bytes"]
    assert not os.path.exists(os.path.join(root, f".{ROUNDS}.tmp"))


def test_sigkill_at_a_random_moment_then_resume_is_bit_identical(compiled, baseline, tmp_path):
    base_state, base_progress, base = baseline
    rng = random.Random(13)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen([sys.executable, "-m", "fedpartial", *CLI, "--checkpoint-every", "1",
                             "--out", str(tmp_path), "--name", "killed"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    run_dir = str(tmp_path / "killed")
    deadline = time.monotonic() + 120
    while checkpoint.latest_round(run_dir) is None:
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before its first checkpoint"
        time.sleep(0.02)
    time.sleep(rng.uniform(0.0, 0.3))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert run_files.read_status(run_dir)["status"] == "running"  # killed mid-run: nobody wrote otherwise
    assert checkpoint.latest_round(run_dir) >= 1

    assert main(["run", "--resume", run_dir]) == 0
    assert _without_wall_clock(_strict(os.path.join(run_dir, "metrics.jsonl"))) == \
        _without_wall_clock(_strict(os.path.join(base["run_dir"], "metrics.jsonl")))
    resumed = fresh(compiled, "unused", "unused")
    checkpoint.restore(run_dir, resumed)  # the final checkpoint: the resumed run's final state
    assert resumed.progress == base_progress and resumed.progress["round"] == ROUNDS
    _same_state(resumed.state, base_state)
    assert run_files.read_status(run_dir)["status"] == "complete"


def test_cli_sigint_at_any_moment_exits_130_and_says_what_was_kept(tmp_path, capsys):
    before = signal.getsignal(signal.SIGINT)  # pytest's, or SIG_IGN in some xdist workers
    timer = threading.Timer(random.Random(5).uniform(0.5, 3.0), os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        # Far more rounds than fit before the signal (a warm compilation cache runs ~50 rounds/s).
        code = main(CLI + ["--rounds", "5000", "--out", str(tmp_path), "--name", "int"])
    finally:
        timer.cancel()
    assert code == 130
    assert signal.getsignal(signal.SIGINT) is before  # handlers are given back
    err = capsys.readouterr().err
    run_dir = str(tmp_path / "int")
    status = _strict(os.path.join(run_dir, "status.json"))[0]
    assert status["status"] == "interrupted" and status["round"] < 5000
    assert status["checkpoint_round"] == status["round"] == checkpoint.latest_round(run_dir)
    assert f"checkpoint of round {status['round']}" in err and "--resume" in err
    assert _strict(os.path.join(run_dir, "summary.json"))[0]["rounds"] == status["round"]


def test_divergence_is_status_diverged_and_exit_1(tmp_path, capsys):
    # Client learning rate 30 on the tiny MLP: rounds 1 and 2 stay finite, round 3 does not.
    code = main(CLI + ["--lr", "30", "--momentum", "0", "--checkpoint-every", "1", "--out", str(tmp_path),
                       "--name", "nan"])
    assert code == 1
    assert "diverged: round 3" in capsys.readouterr().err
    status = _strict(os.path.join(tmp_path, "nan", "status.json"))[0]
    assert status["status"] == "diverged" and status["round"] == status["checkpoint_round"] == 2
    assert status["message"].endswith("the checkpoint of round 2 is kept.")
    assert checkpoint.latest_round(str(tmp_path / "nan")) == 2
    summary = _strict(os.path.join(tmp_path, "nan", "summary.json"))[0]
    assert summary["status"] == "diverged" and summary["rounds"] == status["round"]


def test_an_error_is_status_failed_and_raised(compiled, tmp_path):
    def boom(record):
        raise RuntimeError("disk on fire")

    sim = fresh(compiled, tmp_path, "f")
    with pytest.raises(RuntimeError, match="disk on fire"):
        run(sim.config, sim=sim, on_round=boom)
    status = run_files.read_status(str(tmp_path / "f"))
    assert status["status"] == "failed" and "RuntimeError: disk on fire" in status["message"]
    assert status["checkpoint_round"] is None


def test_resume_without_a_checkpoint_is_one_sentence(tmp_path, capsys):
    os.makedirs(tmp_path / "empty")
    assert main(["run", "--resume", str(tmp_path / "empty")]) == 2
    assert "cannot be read" in capsys.readouterr().err


def test_resuming_a_completed_run_changes_nothing(tmp_path, capsys):
    """A completed run is said to be complete in one sentence, exit 0, and no file of it is rewritten."""


    run_dir = tmp_path / "done"
    run_dir.mkdir()
    (run_dir / "config.json").write_text("{}")
    (run_dir / "summary.json").write_text('{"status": "complete"}')
    run_files.write_status(str(run_dir), "complete", round=3, message="3 rounds", checkpoint_round=3)
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in run_dir.iterdir()}
    assert main(["run", "--resume", str(run_dir)]) == 0
    assert f"{run_dir} is complete (3 rounds): nothing to resume" in capsys.readouterr().out
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in run_dir.iterdir()} == before


def test_more_rounds_extend_a_completed_run_to_what_a_longer_run_gives_and_fewer_are_refused(
        compiled, baseline, tmp_path, capsys):
    """``--resume RUN --rounds N``: a complete 3-round run extended to 5 equals the uninterrupted 5-round run
    (state and every round's metrics); config.json says 5; fewer rounds than planned change nothing."""
    sim = fresh(compiled, tmp_path, "short")
    sim.config = dataclasses.replace(sim.config, rounds=3)
    run_dir = run(sim.config, sim=sim)["run_dir"]
    before = {p: open(os.path.join(run_dir, p), "rb").read() for p in ("config.json", "summary.json", "status.json")}
    with pytest.raises(UserError, match="--rounds 2 cannot shorten .* which plans 3 rounds"):
        shorter = fresh(compiled, tmp_path, "x")
        shorter.config = dataclasses.replace(shorter.config, rounds=2)
        run(shorter.config, sim=shorter, resume=run_dir)
    assert {p: open(os.path.join(run_dir, p), "rb").read() for p in before} == before
    assert main(["run", "--resume", run_dir, "--rounds", "3"]) == 0  # as planned: complete, nothing written
    assert "is complete (3 rounds)" in capsys.readouterr().out
    assert {p: open(os.path.join(run_dir, p), "rb").read() for p in before} == before

    longer = fresh(compiled, tmp_path, "x")
    longer.config = dataclasses.replace(longer.config, rounds=ROUNDS)
    summary = run(longer.config, sim=longer, resume=run_dir)  # the CLI's --rounds 5: load_config, rounds replaced
    state, progress, result = baseline
    _same_state(longer.state, state)
    assert _without_wall_clock(_records(run_dir)) == _without_wall_clock(result["records"])
    assert load_config(run_dir).rounds == 5 and summary["planned_rounds"] == 5 and summary["resumed_from_round"] == 3
    assert "rounds = 5" in open(os.path.join(run_dir, "config.toml")).read()
    assert run_files.read_status(run_dir)["status"] == "complete"


def test_a_run_folder_in_use_is_refused_and_a_dead_holder_s_lock_is_taken_over(tmp_path, capsys):
    """A second process resuming a folder another live process writes is one sentence and writes nothing; a lock a
    killed run left behind is taken over with a sentence; the lock is given back when the run ends."""


    run_dir = tmp_path / "busy"
    run_dir.mkdir()
    (run_dir / "config.json").write_text("{}")
    (run_dir / "lock-0").write_text(f"{os.getppid()} {socket.gethostname()}\n")  # a live process: pytest's parent
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
    assert main(["run", "--resume", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{run_dir} is in use by process {os.getppid()}" in err
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (run_dir / "lock-0").write_text(f"{dead.pid} {socket.gethostname()}\n")
    note = run_files.lock_run_dir(str(run_dir))
    assert note == f"took over the lock of {run_dir} from process {dead.pid}, which is no longer running"
    assert (run_dir / "lock-0").read_text().split() == [str(os.getpid()), socket.gethostname()]
    run_files.unlock_run_dir(str(run_dir))
    assert not (run_dir / "lock-0").exists()


def _largest_file(folder):
    files = [os.path.join(d, f) for d, _, names in os.walk(folder) for f in names]
    return max(files, key=os.path.getsize)


def _truncate(step_dir):
    path = _largest_file(os.path.join(step_dir, "state"))
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _zero(step_dir):
    path = _largest_file(os.path.join(step_dir, "state"))
    with open(path, "r+b") as f:
        f.write(bytes(os.path.getsize(path)))


def _flip(step_dir):
    """One byte flipped in the middle of the arrays' data: read back without complaint, caught by the checksum."""
    path = _largest_file(os.path.join(step_dir, "state"))
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))


def _no_host_record(step_dir):
    os.remove(os.path.join(step_dir, "host", "metadata"))


DAMAGE = {"truncated": _truncate, "zeroed": _zero, "byte-flipped": _flip, "no host record": _no_host_record}


@pytest.fixture(scope="module")
def stopped_at_4(compiled, tmp_path_factory):
    """A run stopped after round 4 with checkpoints of rounds 2 and 4 (copied by each test before damaging)."""
    sim = fresh(compiled, tmp_path_factory.mktemp("stopped"), "stopped")

    def on_round(record):
        if record["round"] == 4:
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(signals.RunInterrupted) as stopped:
        run(sim.config, sim=sim, on_round=on_round, checkpoint_every=2)
    return stopped.value.summary["run_dir"]


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_newest_checkpoint_is_set_aside_and_the_run_resumes_from_the_one_before(
        compiled, baseline, stopped_at_4, tmp_path, capsys, damage):
    base_state, _, base = baseline
    run_dir = str(tmp_path / "run")
    shutil.copytree(stopped_at_4, run_dir)
    DAMAGE[damage](os.path.join(run_dir, "checkpoints", "4"))
    capsys.readouterr()
    sim = fresh(compiled, tmp_path, "unused")
    result = run(sim.config, sim=sim, resume=run_dir)
    note = capsys.readouterr().err
    assert "the checkpoint of round 4" in note and "resumes from round 2" in note and "damaged-4" in note
    assert len(note.strip().splitlines()) == 1  # one sentence, no orbax traceback
    assert result["resumed_from_round"] == 2
    _same_state(sim.state, base_state)  # rounds 3 and 4 run again: the same result as never stopping
    assert _without_wall_clock(_strict(os.path.join(run_dir, "metrics.jsonl"))) == \
        _without_wall_clock(_strict(os.path.join(base["run_dir"], "metrics.jsonl")))
    assert run_files.read_status(run_dir)["status"] == "complete"
    assert os.path.isdir(os.path.join(run_dir, "checkpoints", "damaged-4"))  # kept for inspection, never read


def test_a_checkpoint_without_orbax_metadata_still_reads_back_and_verifies(compiled, baseline, stopped_at_4,
                                                                          tmp_path, capsys):
    """Orbax restores the arrays from its OCDBT manifest when ``state/_METADATA`` is gone; the checksum says
    they are the ones written, so the run resumes from that checkpoint without a note."""
    base_state, _, _ = baseline
    run_dir = str(tmp_path / "run")
    shutil.copytree(stopped_at_4, run_dir)
    os.remove(os.path.join(run_dir, "checkpoints", "4", "state", "_METADATA"))
    capsys.readouterr()
    sim = fresh(compiled, tmp_path, "unused")
    result = run(sim.config, sim=sim, resume=run_dir)
    assert result["resumed_from_round"] == 4 and "note" not in capsys.readouterr().err
    _same_state(sim.state, base_state)


def test_a_config_json_edited_to_another_method_is_refused_and_nothing_changes(stopped_at_4, tmp_path, capsys):
    run_dir = str(tmp_path / "run")
    shutil.copytree(stopped_at_4, run_dir)
    path = os.path.join(run_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["method"], config["options"] = "fedprox", {}  # the same state shapes: it would restore silently
    with open(path, "w") as f:
        json.dump(config, f)
    status_before = run_files.read_status(run_dir)
    capsys.readouterr()
    assert main(["run", "--resume", run_dir]) == 2
    err = capsys.readouterr().err
    assert "method = 'fedprox'" in err and "written with method = 'fedavg'" in err and "Traceback" not in err
    assert run_files.read_status(run_dir) == status_before
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["2", "4"]


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")  # orbax's leftovers stay quiet
def test_when_no_checkpoint_reads_back_the_run_says_so_and_its_status_is_failed(compiled, stopped_at_4, tmp_path,
                                                                              capsys):
    run_dir = str(tmp_path / "run")
    shutil.copytree(stopped_at_4, run_dir)
    _zero(os.path.join(run_dir, "checkpoints", "4"))
    _truncate(os.path.join(run_dir, "checkpoints", "2"))
    before = sorted(os.listdir(os.path.join(run_dir, "checkpoints")))
    assert main(["run", "--resume", run_dir]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint" in err and "round 4" in err and "round 2" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    status = run_files.read_status(run_dir)
    assert status["status"] == "failed" and "no checkpoint" in status["message"]
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == before  # nothing moved or removed


def test_out_of_space_is_recognised_through_orbax_messages_and_chains():
    assert disk.out_of_space(OSError(28, "No space left on device")) == "no space is left on the device"
    assert disk.out_of_space(ValueError("Failed to write 5 bytes [os_error_code='122']")) == \
        "the disk quota is exceeded"
    try:
        try:
            raise OSError(27, "File too large")
        except OSError as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as outer:
        assert disk.out_of_space(outer) == "the file-size limit is reached"
    assert disk.out_of_space(OSError(13, "Permission denied")) is None
    assert disk.out_of_space(ValueError("bad value")) is None


#: ``python -c`` this, then fedpartial's arguments: files may not grow past argv[1] bytes (EFBIG, as a full disk
#: gives ENOSPC); set in the child itself (preexec_fn would fork the multithreaded test process)
LIMITED = ("import resource, runpy, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
           "limit = int(sys.argv.pop(1)); resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)); "
           "sys.argv[0] = 'fedpartial'; runpy.run_module('fedpartial', run_name='__main__')")


def test_a_checkpoint_that_does_not_fit_is_one_sentence_and_the_last_good_one_is_untouched(
        compiled, baseline, stopped_at_4, tmp_path):
    base_state, _, base = baseline
    run_dir = str(tmp_path / "run")
    shutil.copytree(stopped_at_4, run_dir)
    env = {**os.environ, "JAX_ENABLE_COMPILATION_CACHE": "false"}  # the cache's own writes would hit the limit
    done = subprocess.run([sys.executable, "-c", LIMITED, "100000", "run", "--resume", run_dir], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr and "ERROR" not in done.stderr, done.stderr[-3000:]
    assert "cannot write the checkpoint of round 5" in lines[0] and "the file-size limit is reached" in lines[0]
    assert "KiB" in lines[0] and "the checkpoint of round 4 is kept" in lines[0] and "--resume" in lines[0]
    status = run_files.read_status(run_dir)
    assert status["status"] == "failed" and status["message"] in lines[0]
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["2", "4"]  # no temporary leftovers
    # The last good checkpoint is whole: resuming with room finishes the run as if it never stopped.
    sim = fresh(compiled, tmp_path, "unused")
    result = run(sim.config, sim=sim, resume=run_dir)
    assert result["resumed_from_round"] == 4
    _same_state(sim.state, base_state)


@pytest.fixture
def small_filesystem(tmp_path):
    """A 4 MiB tmpfs mounted for the test (root only; otherwise skipped, saying why)."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root; the file-size-limit test above covers the same path")
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({made.stderr.strip() or made.returncode})")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_a_full_filesystem_is_one_sentence_and_the_last_good_checkpoint_is_untouched(stopped_at_4,
                                                                                     small_filesystem):
    """The same as the file-size limit, on a real filesystem that fills up: the run resumes, round 5's record
    fits, its checkpoint does not."""
    run_dir = str(small_filesystem / "run")
    shutil.copytree(stopped_at_4, run_dir)
    free = os.statvfs(run_dir)
    with open(small_filesystem / "filler", "wb") as f:  # leave 48 KiB: a record fits, a checkpoint does not
        f.write(b"\0" * (free.f_bavail * free.f_frsize - 48 * 1024))
    # (the persistent compilation cache stays on: it lives in the repository's .pytest_cache, not on this
    # filesystem, and holds the programs the run stopped at round 4 compiled)
    done = subprocess.run([sys.executable, "-m", "fedpartial", "run", "--resume", run_dir], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr and "ERROR" not in done.stderr, done.stderr[-3000:]
    assert "cannot write the checkpoint of round 5" in lines[0] and "no space" in lines[0].lower(), lines[0]
    assert "the checkpoint of round 4 is kept" in lines[0]
    status = run_files.read_status(run_dir)
    assert status["status"] == "failed" and status["message"] in lines[0]
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["2", "4"]  # no temporary leftovers


def test_results_that_do_not_fit_are_one_sentence_and_status_failed(compiled, tmp_path, monkeypatch):
    from fedpartial._src.experiment import records

    real = records.MetricsCSV.write

    def full_at_round_3(self, record):
        if record["round"] == 3:
            raise OSError(28, "No space left on device")
        return real(self, record)

    monkeypatch.setattr(records.MetricsCSV, "write", full_at_round_3)
    sim = fresh(compiled, tmp_path, "full")
    with pytest.raises(disk.OutOfSpace) as full:
        run(sim.config, sim=sim, checkpoint_every=2)
    run_dir = os.path.join(tmp_path, "full")
    assert str(full.value).startswith(f"cannot write the results of round 3 in {run_dir}: no space is left")
    assert "the checkpoint of round 2 is kept" in str(full.value)
    status = run_files.read_status(run_dir)
    assert status["status"] == "failed" and status["message"] == str(full.value)
    assert checkpoint.latest_round(run_dir) == 2


def test_a_run_folder_that_cannot_start_on_a_full_disk_is_one_sentence_and_leaves_nothing(compiled, tmp_path,
                                                                                       monkeypatch):
    real = run_files.write_json

    def full(path, value):
        if path.endswith("environment.json"):
            raise OSError(28, "No space left on device")
        return real(path, value)

    monkeypatch.setattr(run_files, "write_json", full)
    sim = fresh(compiled, tmp_path, "start")
    with pytest.raises(disk.OutOfSpace) as no_room:
        run(sim.config, sim=sim)
    assert str(no_room.value).startswith(f"cannot start the run folder {tmp_path / 'start'}: no space is left")
    assert os.listdir(tmp_path) == []  # the half-made folder is gone


def test_a_second_signal_exits_after_a_short_grace_and_says_what_is_kept(compiled, tmp_path):
    import io

    exits, stream, exited = [], io.StringIO(), threading.Event()
    sim = fresh(compiled, tmp_path, "forced")
    run_dir = os.path.join(tmp_path, "forced")

    def exit_now(code):  # stands in for os._exit: notes the code and the status the process would leave
        exits.append((code, run_files.read_status(run_dir)))
        exited.set()

    def on_round(record):  # two Ctrl-C after round 2; the 'round' then outlasts the grace
        if record["round"] == 2:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            assert exited.wait(5)

    flag = signals.StopFlag(stream, grace_s=0.2, exit=exit_now)
    with flag, pytest.raises(signals.RunInterrupted):
        run(sim.config, sim=sim, on_round=on_round, checkpoint_every=1, stop=flag)
    [(code, status)] = exits
    assert code == 130 and status["status"] == "interrupted"
    assert status["message"].startswith("exited at once by a second signal during round 3; the checkpoint of "
                                        "round 2 is kept; continue with: fedpartial run --resume")
    said = stream.getvalue()
    assert "again to exit at once" in said and "exiting in 0.2 s" in said and "exited without finishing" in said


def test_a_second_signal_within_the_grace_of_a_finished_stop_changes_nothing():
    exits = []
    flag = signals.StopFlag(open(os.devnull, "w"), grace_s=0.2, exit=exits.append)
    with flag:
        flag._handle(signal.SIGINT, None)
        flag._handle(signal.SIGINT, None)
    time.sleep(0.4)  # the run stopped (the flag's context ended) within the grace: the timer was cancelled
    assert exits == [] and flag.signum == signal.SIGINT
