"""Per-client state kept off the device: the round sees only the cohort's rows, and the run is the same.

The reference is the ordinary run (``client_state="device"``): with the ``[N]`` state on the host (numpy)
or on disk (memory-mapped files) every round must give bit-identical global models and per-client rows.
"""

import dataclasses
import os

import chex
import jax
import numpy as np
import pytest

from fedpartial._src.core import memory
from fedpartial._src.core.errors import UserError
from fedpartial._src.engine.strategy import fused
from fedpartial._src.engine.types import with_clients, without_clients
from fedpartial._src.experiment import client_state
from fedpartial._src.experiment.config import ConfigError, RunConfig
from fedpartial._src.experiment.simulation import Simulation, run
from fedpartial._src.methods.catalog import get_method
from tests.test_contract import BUILDERS, KEY, build, cohorts, model_for

# Two ways a method writes per-client state back: personal models (FedSPU, with early stopping's stop
# state on top: two scatters) and FedDyn's per-client gradients written into a state other than the view's.
# Every other method (sub-model masks, MOON's previous models, ...) goes through the same two engine lines
# (gather at RoundView.client_rows, scatter_clients at cohort_rows): slow, run before a release.
FAST = ("fedspu+es", "feddyn")
HOST_METHODS = [n for n in BUILDERS if BUILDERS[n]().capabilities.host_client_state]
NAMES = [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in HOST_METHODS]


def run_host(r, data):
    """The rounds of ``data`` with the per-client state in a host store; the final state with every row."""
    state = r.init(KEY)
    store = client_state.HostClientState(r.client_state_shapes())
    variables = state.variables  # the rows from the initial global variables, as Simulation fills them
    # N = 8: overlapping chunks
    store.fill(lambda start, size: r.init_client_rows(KEY, start, size, variables), chunk=3)
    traces = []
    for t, c in enumerate(data):
        ids = np.asarray(c.info.client_ids)
        state, _ = r(with_clients(state, store.rows(ids)), c, jax.random.fold_in(KEY, t))
        store.write(ids, c.info.valid, state.method_state.clients)
        state = without_clients(state)
        traces.append(r.trace_count)
    return with_clients(jax.device_get(state), store.tree()), traces


def run_device(r, data):
    state = r.init(KEY)
    for t, c in enumerate(data):
        state, _ = r(state, c, jax.random.fold_in(KEY, t))
    return jax.device_get(state)


def test_the_methods_that_keep_per_client_state_say_whether_it_may_leave_the_device():
    assert {"fedspu", "fedspu+es", "feddrop", "fjord", "hermes", "prunefl", "fedselect", "moon",
            "feddyn"} <= set(HOST_METHODS)
    assert not get_method("feddh").capabilities.host_client_state  # its update reads every client's label distribution


@pytest.mark.parametrize("name", NAMES)
def test_host_state_equals_device_state_bit_for_bit(mlp, staged_mlp, name):
    mlp = model_for(name, BUILDERS[name](), mlp, staged_mlp)
    data = cohorts(rounds=3)
    want = run_device(build(mlp, BUILDERS[name](), fused()), data)
    host = build(mlp, BUILDERS[name](), fused(), client_state="host")
    got, traces = run_host(host, data)
    chex.assert_trees_all_equal(got, want)
    assert traces[-1] == traces[0]  # rounds 2 and 3 did not retrace


def test_the_round_refuses_a_state_that_is_not_the_cohorts_rows(mlp):
    device, host = (build(mlp, get_method("fedspu"), fused(), client_state=w) for w in ("device", "host"))
    c = cohorts(rounds=1)[0]
    with pytest.raises(ValueError, match="must hold the cohort's 3 rows"):
        host(with_clients(host.init(KEY), device.init(KEY).method_state.clients), c, KEY)  # all N rows


def test_a_method_that_reads_the_whole_population_keeps_it_on_the_device(mlp):
    build(mlp, get_method("feddh"), fused())  # fine on the device
    with pytest.raises(UserError, match="method feddh reads every client's state in its hooks"):
        build(mlp, get_method("feddh"), fused(), client_state="host")


def test_the_store_writes_only_real_clients_and_reads_in_cohort_order():
    shapes = {"w": jax.ShapeDtypeStruct((5, 2), np.float32)}
    for disk in (False, True):
        store = client_state.HostClientState(shapes, disk=disk)
        store.fill(lambda start, size: {"w": np.arange(start, start + size, dtype=np.float32)[:, None]
                                        * np.ones(2, np.float32)}, chunk=2)
        np.testing.assert_array_equal(store.tree()["w"][:, 0], np.arange(5))
        np.testing.assert_array_equal(store.rows(np.array([4, 1]))["w"][:, 0], [4, 1])
        store.write(np.array([4, 1]), np.array([True, False]), {"w": np.full((2, 2), -1, np.float32)})
        np.testing.assert_array_equal(store.tree()["w"][:, 0], [0, 1, 2, 3, -1])
        if disk:
            folder = store.directory
            assert sorted(os.listdir(folder)) == ["000.npy"]
            store.close()
            assert not os.path.exists(folder)


def test_auto_keeps_the_state_where_it_fits():
    gib = 2**30
    resolve = client_state.resolve
    kw = dict(can_leave_device=True, host_free=100 * gib)
    assert resolve("auto", 4 * gib, device_free=10 * gib, platform="gpu", **kw) == "device"
    assert resolve("auto", 6 * gib, device_free=10 * gib, platform="gpu", **kw) == "host"
    assert resolve("auto", 60 * gib, device_free=10 * gib, platform="gpu", **kw) == "disk"
    # on a CPU the RAM is the device: the host store (measured faster), then disk
    assert resolve("auto", 1, device_free=100 * gib, platform="cpu", **kw) == "host"
    assert resolve("auto", 60 * gib, device_free=100 * gib, platform="cpu", **kw) == "disk"
    assert resolve("auto", 60 * gib, device_free=10 * gib, platform="gpu", can_leave_device=False,
                   host_free=100 * gib) == "device"  # the method cannot: the memory check decides
    assert resolve("auto", 0, device_free=10 * gib, platform="cpu", **kw) == "device"  # nothing to keep
    assert resolve("disk", 1, device_free=10 * gib, platform="cpu", **kw) == "disk"


# ---- through Simulation ---------------------------------------------------------------------------

BASE = RunConfig(dataset="synthetic", method="fedspu", num_clients=12, cohort_size=4, rounds=3, local_steps=2,
                 batch_size=8, eval_every=3, out_dir=None, strategy="fused")
TIMES = ("round_time_s", "wall_time_s", "host_time_s")


def records(result):
    return [{k: v for k, v in r.items() if k not in TIMES} for r in result["records"]]


# The module fixture below is costly: the module stays on one xdist worker (--dist loadgroup), which
# builds it once.
pytestmark = pytest.mark.xdist_group("client_state")


@pytest.fixture(scope="session")  # kept by its xdist group's worker (see test_sharding.py)
def device_run():
    return run(dataclasses.replace(BASE, client_state="device"))


@pytest.mark.parametrize("where", ["host", "disk"])
def test_a_run_with_the_state_off_the_device_equals_the_device_run(device_run, where):
    result = run(dataclasses.replace(BASE, client_state=where))
    assert records(result) == records(device_run)  # personal accuracy included: evaluated from the store
    assert result["client_state"] == where and device_run["client_state"] == "device"
    assert result["personal_state_bytes"] == device_run["personal_state_bytes"] > 0


def test_auto_keeps_a_tiny_state_on_the_host_of_a_cpu():
    """``auto`` resolved to a place the runs above cover (run again, it was the host run once more)."""
    sim = Simulation(dataclasses.replace(BASE, client_state="auto"))
    if jax.default_backend() == "cpu":  # tiny state: fits anywhere, and a CPU's host store is the faster
        assert sim.client_state == "host" and sim.client_store is not None
    else:
        assert sim.client_state == "device" and sim.client_store is None


def test_checkpoint_and_resume_with_the_state_on_disk(device_run, tmp_path):
    config = dataclasses.replace(BASE, client_state="disk", out_dir=str(tmp_path), run_name="d", rounds=2)
    run(config, checkpoint_every=1)
    resumed = run(dataclasses.replace(config, rounds=3), resume=str(tmp_path / "d"))
    assert records(resumed)[-1] == records(device_run)[-1]


def test_a_method_without_per_client_state_runs_as_on_the_device():
    sim = Simulation(dataclasses.replace(BASE, method="fedavg", client_state="disk"))
    assert sim.client_state == "device" and sim.client_store is None


def test_a_method_that_cannot_is_refused_in_one_sentence():
    with pytest.raises(ConfigError, match=r"^--client-state host is not allowed for --method feddh: it reads every "
                                          r"client's state in its hooks; use --client-state device or auto\.$"):
        Simulation(dataclasses.replace(BASE, method="feddh", client_state="host"))


def test_the_memory_refusal_names_the_client_state_option(monkeypatch):
    sim = Simulation(BASE)
    state = client_state.tree_bytes(sim.round.client_state_shapes())
    # room for everything but the N personal models
    room = int((sim.memory.total - state / 2) / memory.HEADROOM)
    monkeypatch.setattr(memory, "available_bytes", lambda device=None: (room, "RAM"))
    with pytest.raises(ConfigError, match=r"of it the clients' own state; use --client-state disk\.$"):
        Simulation(dataclasses.replace(BASE, client_state="device"))
