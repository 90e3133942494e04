"""The client axis split over 4 devices gives the 1-device results (fake CPU devices, in a subprocess).

``XLA_FLAGS=--xla_force_host_platform_device_count=4`` must be set before JAX starts, so every
4-device case runs in one subprocess (``tests/engine/sharding_cases.py``, which prints JSON) and the
tests here read its results.

The fused round's tolerance: not bit-identical.  On 4 devices each device compiles its local training for 2
clients instead of 6 (other batched-dot and fusion choices on XLA:CPU) and the client-axis
sums (aggregation, metrics) become per-device partial sums plus an all-reduce; both change
float32 rounding, not the arithmetic.  Measured after 2 rounds: at most 1.2e-7 (3.6e-7 after 3) on parameters
of size ~1 (a few ulps); asserted: 2e-6.  Integer metrics (steps, bytes, clients, FLOPs) and
the cohort draw are exactly equal.  ``stepwise:1`` over 4 devices (clients trained side by side, one per device)
is bit for bit: each client runs the very step it runs on one device.
"""

import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from fedpartial._src.engine import sharding
from fedpartial._src.experiment.config import ConfigError, RunConfig
from fedpartial._src.methods.base import scatter_clients
from tests.conftest import XLA_TEST_FLAGS

ROOT = pathlib.Path(__file__).resolve().parents[2]
ATOL = 2e-6


def _env(devices: int) -> dict:
    flags = f"--xla_force_host_platform_device_count={devices} {XLA_TEST_FLAGS}"
    return {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def _start(module: str, *args, devices: int) -> subprocess.Popen:
    """Output to files, not pipes: a process blocked on a full pipe would stall its peers' collectives."""
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    process = subprocess.Popen([sys.executable, "-m", module, *map(str, args)], cwd=ROOT, env=_env(devices),
                               stdout=out, stderr=err, text=True)
    process.files = (out, err)
    return process


def _result(process: subprocess.Popen) -> dict:
    """The JSON on the last line of stdout (gloo writes its own lines there too)."""
    try:
        process.wait(timeout=900)
    except subprocess.TimeoutExpired:  # not left running (and compiling) for the rest of the session
        process.kill()
        raise
    out, err = process.files
    for f in (out, err):
        f.seek(0)
    assert process.returncode == 0, err.read()[-3000:]
    return json.loads(out.read().strip().splitlines()[-1])


# The fixture below is costly: the module stays on one xdist worker (--dist loadgroup), which builds it
# once.  Session scope: that worker may run other modules' tests in between, which would tear down (and
# rebuild, measured 58 s) a module-scoped fixture.
pytestmark = pytest.mark.xdist_group("sharding")


@pytest.fixture(scope="session")
def four_devices():
    return _result(_start("tests.engine.sharding_cases", devices=4))


def test_the_subprocess_has_four_devices(four_devices):
    assert four_devices["device_count"] == 4


# FedAvg's fused round is FedLDF's without its layer selection (sharding_cases.py runs these two only)
@pytest.mark.parametrize("method", ["fedldf", "fedspu"])
def test_padded_cohort_on_four_devices_equals_one_device(four_devices, method):
    """K = 6 on one device against K = 6 padded to 8 on 4 devices, 2 rounds of the fused round."""
    case = next(c for c in four_devices["engine"] if c["method"] == method)
    assert case["max_diff"] <= ATOL
    assert case["ints_4"] == case["ints_1"]  # client steps, upload and download bytes, every round
    assert case["loss_diff"] <= ATOL
    assert case["trace_count_4"] == 1  # round 2 did not retrace


@pytest.mark.parametrize("method", ["fedldf", "fedspu"])
def test_the_sharding_is_really_applied(four_devices, method):
    s = next(c for c in four_devices["engine"] if c["method"] == method)["shardings_4"]
    assert s["cohort_devices"] == 4 and s["cohort_shard_rows"] == [2, 2, 2, 2]
    assert s["jit_input_cohort_specs"] == ["P('clients',)"]  # what the compiled round takes
    assert s["state_devices"] == 4 and s["state_replicated"]


def test_simulation_pads_the_cohort_and_counts_real_clients(four_devices):
    """FedSPU (per-client [N] state) through Simulation: K = 6 draws the same clients, padded with two
    clients outside the cohort that weigh nothing; records count 6 clients; the runs agree.  Its data is on the
    device (``--data-placement device``): the cohort gathered there, then split over the 4 devices."""
    case = four_devices["simulation"]
    assert case["placement"] == ["device", "device"]
    assert (case["cohort_size_1"], case["cohort_size_4"]) == (6, 8)
    assert case["ids_4"][:6] == case["ids_1"]
    assert not set(case["ids_4"][6:]) & set(case["ids_1"])
    assert case["valid_4"] == [True] * 6 + [False] * 2
    assert case["ints_4"] == case["ints_1"]
    assert all(row[3] == 6 for row in case["ints_4"])  # "clients"
    assert case["max_diff"] <= ATOL
    assert case["acc_4"] == case["acc_1"]
    assert case["state_devices_4"] == 4


@pytest.mark.parametrize("index, method, groups", [
    (0, "embracingfl", [["strong", 3], ["moderate", 1], ["weak", 4]]),  # K = 6 of a 4,2,4 mix of 10
    (1, "heterofl", [["strong", 2], ["moderate", 2], ["weak", 4]]),  # all 6 of a 2,2,2 mix, every round
])
def test_client_groups_split_over_four_devices_equal_one_device(four_devices, index, method, groups):
    """On 4 devices the tiers keep the clients drawn on one device, the 2 padding rows join the last tier,
    and each tier not a multiple of 4 trains padded up to one inside the round.  HeteroFL's weights grow to
    ~5 here (its scaler), so the tolerance scales with the largest weight."""
    case = four_devices["groups"][index]
    assert case["method"] == method
    assert case["groups_4"] == groups
    assert case["ids_4"][:6] == case["ids_1"] and case["valid_4"] == [True] * 6 + [False] * 2
    assert case["ints_4"] == case["ints_1"]
    assert case["max_diff"] <= ATOL * max(1.0, case["max_abs"])
    assert case["acc_4"] == case["acc_1"]


def test_stepwise_clients_side_by_side_on_four_devices_equal_one_device_bit_for_bit(four_devices):
    """stepwise:1 over 4 devices: 6 clients of unequal steps, 4 then 2 at a time, each running the same
    un-vmapped jitted step as on one device, so the state is the same bit for bit; the step ran on all 4.  FedSPU:
    FedAvg's step with per-client state (its client groups: the simulation test below)."""
    [case] = four_devices["stepwise"]
    assert case["method"] == "fedspu"
    assert case["bit_equal"], case["max_diff"]
    assert case["ints_4"] == case["ints_1"]
    assert case["executables_1"] == 1 and case["executables_4"] == 4
    assert case["trace_count_4"] == case["trace_count_1"]
    assert case["ends_1"] == case["ends_4"] == 2  # begin and finish compiled once: round 2 compiled nothing new


def test_a_stepwise_run_of_client_groups_on_four_devices_equals_one_device(four_devices):
    """``--strategy stepwise:1 --devices 4``: EmbracingFL's three tiers trained side by side, the cohort not
    padded (only the client steps are split), every number the same as on one device."""
    case = four_devices["simulation_stepwise"]
    assert case["bit_equal"] and case["step_devices_4"] == 4 and case["state_devices_4"] == 1
    assert case["cohort_size_4"] == case["cohort_size_1"] == 6
    assert case["ints_4"] == case["ints_1"] and case["acc_4"] == case["acc_1"]


def test_auto_in_a_process_restarted_for_the_split_over_the_cores_runs_it(four_devices):
    """The variable ``fedpartial run`` sets when it starts again on the cores: ``auto`` (no ``--devices``) then
    trains over the 4 devices in the split's layout and lowering, and says why; ``loop`` is one device's
    ``stepwise:1`` bit for bit, ``map`` the fused round one client at a time (the cohort padded to 8)."""
    case = {"loop": four_devices["split_wrapped"], **four_devices["auto_split"]}  # loop: the wrapped run's
    assert case["loop"]["strategy"] == "stepwise:1" and case["loop"]["summary_devices"] == 4
    assert case["loop"]["bit_equal"], case["loop"]["max_diff"]
    assert case["map"]["strategy"] == "fused:1" and case["map"]["summary_devices"] == 4
    assert case["map"]["max_diff"] <= ATOL
    for layout in ("loop", "map"):
        assert case[layout]["note"].startswith("the cohort split over the 4 CPU cores")
        assert case[layout]["conv"] == f"lax, {layout} (split over 4 cores: 0.01 s a round)"
    assert case["time_split"] == {"lax/loop": True, "lax/map": True}


def test_the_wrappers_split_over_the_cores_and_resumed_equal_one_device_bit_for_bit(four_devices):
    """DP clipping and noise, a top-k codec with error feedback, early stopping, a deadline and FedSPU's state on
    the host, all in one run split over 4 devices as auto's restart runs it: every number one device's; stopped
    after round 1 and resumed, still the same state."""
    case = four_devices["split_wrapped"]
    assert case["step_devices_4"] == 4 and case["client_state_4"] == "host"
    assert case["bit_equal"], case["max_diff"]
    assert case["ints_4"] == case["ints_1"]
    assert case["resumed_from"] == 1 and case["resumed_devices"] == 4 and case["resumed_bit_equal"]


def test_refusals_are_one_sentence_naming_the_values(four_devices):
    r = four_devices["refusals"]
    assert r["engine_stepwise"] == ("the stepwise strategy trains one client per device at a time over 4 "
                                    "devices, not chunks of 2; use stepwise:1.")
    assert r["engine_cohort"] == "the cohort size 6 must be a multiple of the 4 devices the cohort is split over."
    assert r["engine_too_many"] == "5 devices asked for, but this process has 4 (cpu); use 1 to 4."
    assert r["config_too_many"] == ("--devices 5 is not allowed: it must be between 1 and 4, the number of local "
                                    "cpu devices.")
    assert r["config_stepwise"] == ("--devices 4 needs the fused strategy (--strategy fused or fused:N) or "
                                    "stepwise:1; --strategy stepwise:2 runs on one device.")
    assert r["config_zero"] == "--devices 0 is not allowed: it must be a whole number ≥ 1."


def test_global_cohort_assembles_this_process_rows(four_devices):
    """sharding.process_rows / global_cohort (the multi-host path) in one process: all 8 rows, same arrays."""
    assert four_devices["global_cohort"] == {"rows": [0, 8], "equal": True, "devices": 4}


# ---- one process, no subprocess ------------------------------------------------------------------


def test_padded_size():
    assert [sharding.padded_size(k, 4) for k in (1, 4, 6, 8, 9)] == [4, 4, 8, 8, 12]
    assert sharding.padded_size(7, 1) == 7


def test_padding_ids_come_from_outside_the_cohort():
    assert sharding.padding_ids(np.array([0, 2, 3]), 5, 4).tolist() == [1, 4, 1, 4]
    assert sharding.padding_ids(np.array([0, 1, 2]), 3, 1).tolist() == [0]  # the whole population: any id


def test_pad_cohort_adds_clients_that_train_on_nothing():
    from tests.conftest import make_cohort

    cohort = make_cohort((4,), k=3, client_ids=[0, 2, 3])
    padded = sharding.pad_cohort(cohort, 4, 5)
    assert padded.info.client_ids.tolist() == [0, 2, 3, 1]
    assert padded.info.valid.tolist() == [True, True, True, False]
    assert padded.info.num_samples[3] == 0 and not padded.data.step_mask[3].any()
    assert not padded.data.example_mask[3].any()
    np.testing.assert_array_equal(padded.data.x[:3], cohort.data.x)


def test_scatter_drops_padding_rows_even_when_their_id_repeats_a_real_one():
    import jax.numpy as jnp

    clients = jnp.zeros((4, 2), jnp.float32)
    rows = jnp.array([[1, 1], [2, 2], [9, 9]], jnp.float32)
    out = scatter_clients(clients, jnp.array([1, 2, 1]), rows, jnp.array([True, True, False]))
    np.testing.assert_array_equal(out, [[0, 0], [1, 1], [2, 2], [0, 0]])


def test_devices_beyond_this_machine_are_refused_naming_both_numbers():
    import jax

    from fedpartial._src.experiment.preflight import preflight

    n = jax.local_device_count()
    with pytest.raises(ConfigError, match=rf"^--devices {n + 1} is not allowed: it must be between 1 and {n}, "):
        preflight(RunConfig(devices=n + 1, out_dir=None))  # a question for this machine, not of the settings


def test_one_device_by_default_on_cpu():
    import jax

    if jax.default_backend() == "cpu":
        assert RunConfig(strategy="fused").num_devices == 1
    assert RunConfig(devices=1).run_strategy() == RunConfig().run_strategy()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # ~60 s of two JAX start-ups, compiles and gloo collectives on 2 cores; run with -m slow
def test_two_processes_finish_with_the_parameters_of_one_and_resume_from_their_checkpoints(tmp_path):
    """jax.distributed on this machine: 2 processes × 2 CPU devices (gloo collectives) split a cohort of 6,
    padded to 8, over 4 devices; both end with the one-process, one-device run's parameters (FedSPU).  Each
    writes a checkpoint a round into its own run directory; resumed from round 1 each ends bit for bit where
    the uninterrupted run did.  (The same checkpoint format in one process: tests/experiment/test_checkpoint.py.)"""
    port = _free_port()
    workers = [_start("tests.engine.multihost_case", port, i, 2, tmp_path, devices=2) for i in range(2)]
    reference = _result(_start("tests.engine.multihost_case", devices=1))
    results = [_result(w) for w in workers]
    assert [(r["process"], r["processes"], r["devices"], r["cohort_size"]) for r in results] == [(0, 2, 4, 8),
                                                                                                 (1, 2, 4, 8)]
    assert reference["cohort_size"] == 6
    assert results[0]["params"] == results[1]["params"]  # every process holds the same replicated model
    for r in results:
        assert r["checkpoints"] == ["1", "2"] and r["resumed_from"] == 1
        assert r["resumed_params"] == r["params"]
        assert r["clients"] == reference["clients"] == [6, 6]
        assert r["upload_bytes"] == reference["upload_bytes"]
        for mine, theirs in zip(r["params"], reference["params"]):
            np.testing.assert_allclose(mine, theirs, rtol=0, atol=ATOL)


def test_the_flag_reaches_the_config():
    from fedpartial._src.cli.main import build_parser, config_from_args

    args = build_parser().parse_args(["run", "--devices", "2", "--strategy", "fused:4"])
    assert config_from_args(args).devices == 2
    assert config_from_args(build_parser().parse_args(["run"])).devices is None
