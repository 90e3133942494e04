"""Data on the device: the jitted gather matches pack_cohort's masks, shuffles correctly, and runs in Simulation."""

import copy
import dataclasses

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedpartial._src.core.types import Holdout
from fedpartial._src.data import ondevice
from fedpartial._src.data.packing import max_steps, pack_cohort
from fedpartial._src.experiment import layout
from fedpartial._src.experiment.config import ConfigError, RunConfig
from fedpartial._src.experiment.simulation import Simulation
from fedpartial._src.experiment.simulation import run as simulation_run
from tests.conftest import count_copies, fake_device_memory, wide_dataset

# The runs below are a few tiny rounds, checked for where the data went and for equal results of one program:
# compiled at -O0 (tests/conftest.py says why that changes nothing there; the module's shared Simulation, built
# before any test's fixture, stays at -O1)
pytestmark = pytest.mark.usefixtures("engine_compiled_at_o0")
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Few static settings and fixed shapes, so that the gather compiles a handful of times for the whole file.
BATCH, CLIENTS, MAX_SIZE, COHORT, STEPS_CAP = 4, 6, 20, 5, 12
MODES = ({"local_epochs": 0.5}, {"local_epochs": 1.5}, {"local_steps": 3})
GATHER = jax.jit(ondevice.gather_cohort, static_argnames="spec")


def population(sizes, seed=0, features=(2,)):
    """Clients with ``sizes`` disjoint, shuffled examples, then empty clients and a filler client that are never
    gathered, so that every population has ``CLIENTS + 1`` clients and ``CLIENTS * MAX_SIZE`` examples (fixed
    shapes: one compilation per mode); x holds the example's index (read back)."""
    sizes = list(sizes) + [0] * (CLIENTS - len(sizes)) + [CLIENTS * MAX_SIZE - sum(sizes)]
    total = sum(sizes)
    perm = np.random.default_rng(seed).permutation(total)
    clients = np.split(perm, np.cumsum(sizes)[:-1])
    x = np.broadcast_to(np.arange(total, dtype=np.float32).reshape((total,) + (1,) * len(features)),
                        (total,) + features).copy()
    y = (np.arange(total) % 7 + 1).astype(np.int64)  # never 0, so a padded label is told apart
    return x, y, clients


def gather(sizes, mode, ids, valid, seed=0, data=None):
    """The jitted gather of clients ``ids`` (padded to ``COHORT`` rows with invalid clients)."""
    x, y, clients = data or population(sizes)
    spec = ondevice.gather_spec(batch_size=BATCH, num_steps=STEPS_CAP, **mode)
    assert max_steps(sizes, BATCH, **{"local_steps": None, "local_epochs": None, **mode}) <= STEPS_CAP
    pop = ondevice.place(x, y, clients, spec)
    pad = COHORT - len(ids)
    ids = np.concatenate([np.asarray(ids, np.int32), np.zeros(pad, np.int32)])
    valid = np.concatenate([np.asarray(valid, bool), np.zeros(pad, bool)])
    out, num = GATHER(pop, ids, valid, jax.random.key(seed), spec=spec)
    return jax.device_get(out), np.asarray(num), spec, (x, y, clients), (ids, valid)


def real_ids(batch, k, steps=slice(None)):
    """Client row k's real example ids (its x values), in stream order."""
    return batch.x[k, steps][batch.example_mask[k, steps]][:, 0].astype(int)


def test_tiny_case_by_hand():
    # 5 examples, batches of 4, 1.5 epochs: 2 batches per epoch, ceil(3) = 3 steps of 4, 1 and 4 examples;
    # 1 example, 3 local steps: that example alone in every step; an invalid client: nothing.
    sizes = [5, 1, 7]
    got, num, *_ = gather(sizes, {"local_epochs": 1.5}, [0, 2], [True, False])
    assert got.example_mask[0, :4].sum(axis=1).tolist() == [4, 1, 4, 0]
    assert not got.example_mask[1:].any() and num.tolist() == [5, 0, 0, 0, 0]
    got, num, _, (_, _, clients), _ = gather(sizes, {"local_steps": 3}, [1], [True])
    assert got.example_mask[0, :4].sum(axis=1).tolist() == [1, 1, 1, 0] and num[0] == 1
    assert real_ids(got, 0).tolist() == [clients[1][0]] * 3


@SETTINGS
@given(st.lists(st.integers(0, MAX_SIZE), min_size=1, max_size=CLIENTS), st.sampled_from(MODES), st.data())
def test_masks_and_num_samples_equal_pack_cohorts(sizes, mode, data):
    ids = data.draw(st.lists(st.integers(0, len(sizes) - 1), min_size=1, max_size=COHORT))
    valid = data.draw(st.lists(st.booleans(), min_size=len(ids), max_size=len(ids)))
    got, num, spec, (x, y, clients), (ids, valid) = gather(sizes, mode, ids, valid)
    want = pack_cohort(x, y, [clients[i] if v else np.zeros(0, int) for i, v in zip(ids, valid)],
                       batch_size=BATCH, num_steps=spec.num_steps, seed=0, **mode)
    np.testing.assert_array_equal(got.example_mask, want.example_mask)
    np.testing.assert_array_equal(got.step_mask, want.step_mask)
    np.testing.assert_array_equal(num, want.num_samples)
    assert got.x.dtype == want.x.dtype and got.y.dtype == want.y.dtype and got.x.shape == want.x.shape
    # padded slots hold 0 and label 0; real ones the example's own label
    assert np.all(got.x[~got.example_mask] == 0) and np.all(got.y[~got.example_mask] == 0)
    real = got.x[..., 0][got.example_mask].astype(int)
    np.testing.assert_array_equal(got.y[got.example_mask], y[real])


@SETTINGS
@given(st.lists(st.integers(1, MAX_SIZE), min_size=COHORT, max_size=COHORT), st.sampled_from(MODES),
       st.integers(0, 2**31 - 1))
def test_each_epoch_or_pass_is_a_permutation_of_the_clients_examples(sizes, mode, seed):
    got, _, _, (_, _, clients), _ = gather(sizes, mode, np.arange(COHORT), np.ones(COHORT, bool), seed)
    for k in range(COHORT):
        n, members = len(clients[k]), np.sort(clients[k])
        if "local_epochs" in mode:
            per_epoch = -(-n // BATCH)
            own = int(got.step_mask[k].sum())
            for start in range(0, own, per_epoch):
                ex = real_ids(got, k, slice(start, min(own, start + per_epoch)))
                if len(ex) == n:  # a whole epoch
                    np.testing.assert_array_equal(np.sort(ex), members)
                else:  # a fractional epoch: distinct examples of the client
                    assert len(np.unique(ex)) == len(ex) and np.isin(ex, members).all()
        else:
            stream = real_ids(got, k)
            assert len(stream) == 3 * min(BATCH, n)
            for start in range(0, len(stream) - n + 1, n):
                np.testing.assert_array_equal(np.sort(stream[start:start + n]), members)
            assert np.isin(stream, members).all()


def test_deterministic_shuffled_and_independent_of_the_rest_of_the_cohort():
    sizes = [20, 12, 0, 17, 7]
    data = population(sizes)
    mode = {"local_epochs": 1.5}
    a, *_ = gather(sizes, mode, [0, 1, 3], [True] * 3, seed=5, data=data)
    b, *_ = gather(sizes, mode, [0, 1, 3], [True] * 3, seed=5, data=data)
    c, *_ = gather(sizes, mode, [4, 3, 2, 0], [True] * 4, seed=5, data=data)
    d, *_ = gather(sizes, mode, [0, 1, 3], [True] * 3, seed=6, data=data)
    for field in a._fields:
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    # client 3 is row 2 of a and row 1 of c; client 0 row 0 of a and row 3 of c: the same batches
    for row_a, row_c in ((2, 1), (0, 3)):
        for field in a._fields:
            np.testing.assert_array_equal(getattr(a, field)[row_a], getattr(c, field)[row_c])
    assert not np.array_equal(a.x, d.x)  # another key, another order
    first, second = real_ids(a, 0, slice(0, 5)), real_ids(a, 0, slice(5, 8))  # client 0: an epoch, then half
    assert len(first) == 20 and len(second) == 12
    assert not np.array_equal(first, np.sort(first)) and not np.array_equal(first[:12], second)


def test_integer_features_and_image_shapes_keep_their_layout():
    x, y, clients = population([5, 3], features=(2, 2, 1))
    got, *_ = gather([5, 3], {"local_steps": 3}, [1, 0], [True, True], data=(x.astype(np.int32), y, clients))
    assert got.x.dtype == np.int32 and got.x.shape == (COHORT, STEPS_CAP, BATCH, 2, 2, 1)
    np.testing.assert_array_equal(np.unique(got.x[0, :3, :3]), np.sort(clients[1]))


def test_gather_round_compiles_once_for_many_rounds():
    x, y, clients = population([9, 4, 13, 1])
    spec = ondevice.gather_spec(batch_size=BATCH, num_steps=STEPS_CAP, local_epochs=1.5)
    pop = ondevice.place(x, y, clients, spec)
    holdout = jax.device_put(Holdout(np.ones((5, 3, 2), np.float32), np.ones((5, 3), np.int32),
                                     np.ones((5, 3), bool)))
    before = ondevice.gather_round._cache_size()
    for t in range(5):
        ids = np.random.default_rng(t).choice(5, 2, replace=False).astype(np.int32)
        batch, num, held = ondevice.gather_round(pop, holdout, ids, np.array([True, t % 2 == 0]), np.uint32(t),
                                                 spec=spec)
        assert held.example_mask.shape == (2, 3) and bool(held.example_mask[1].any()) == (t % 2 == 0)
        np.testing.assert_array_equal(num, [len(clients[ids[0]]), len(clients[ids[1]]) if t % 2 == 0 else 0])
    assert ondevice.gather_round._cache_size() == before + 1


# ---------------------------------------------------------------------------- Simulation

TINY = dict(dataset="digits", model="mlp", num_clients=6, cohort_size=3, rounds=3, local_epochs=1.5, batch_size=8,
            train_fraction=0.7, out_dir=None)


@pytest.fixture(scope="module")
def sim():
    """One Simulation of the tiny configuration (device placement) and its initial state and progress."""
    sim = Simulation(RunConfig(**TINY, data_placement="device"))
    return sim, jax.tree.map(lambda a: a.copy(), sim.state), dict(sim.progress)


def test_auto_is_device_on_an_accelerator_when_it_fits_and_host_otherwise(sim, monkeypatch):
    sim = sim[0]
    assert sim.data_placement == "device" and sim.data_bytes > 0
    fits = 4 * sim.data_bytes  # data_bytes is exactly a quarter of it
    monkeypatch.setattr(ondevice, "available_memory", lambda device=None: fits)
    monkeypatch.setattr(jax, "devices", lambda *a: [type("Gpu", (), {"platform": "gpu"})()])
    auto = dataclasses.replace(sim.config, data_placement="auto")
    for available, want in ((fits, "device"), (fits - 4, "host")):
        monkeypatch.setattr(ondevice, "available_memory", lambda device=None, a=available: a)
        assert layout.data_placement(auto, sim.data_bytes) == want
    assert ondevice.resolve_placement("auto", 250, 1000, "gpu") == "device"
    assert ondevice.resolve_placement("auto", 251, 1000, "gpu") == "host"
    assert ondevice.resolve_placement("auto", 1, None, "tpu") == "host"
    assert ondevice.resolve_placement("auto", 1, 10**12, "cpu") == "host"  # measured: no gain on CPU
    assert ondevice.resolve_placement("device", 10**12, 1000, "cpu") == "device"
    assert ondevice.resolve_placement("host", 1, 10**12, "gpu") == "host"


def fake_accelerator(monkeypatch, limit_mib: float) -> None:
    """This CPU as an accelerator of ``limit_mib`` MiB (:func:`tests.conftest.fake_device_memory`) on which
    'auto' places the data."""
    fake_device_memory(monkeypatch, limit_mib)
    monkeypatch.setattr(ondevice, "resolve_placement", lambda requested, *_: "device" if requested == "auto"
                        else requested)


def wide_config(**changes):
    """40 clients of 200 examples with 1,000 features (:func:`tests.conftest.wide_dataset`): the data takes
    30.5 MiB on the device, the round at the whole cohort (stepwise:1) is estimated at 463.8 MiB: 257.8 for the
    server, 5.15 per client in flight."""
    config = RunConfig(num_clients=40, cohort_size=40, local_steps=2, batch_size=8, rounds=2, eval_every=2,
                       out_dir=None, **changes)
    return config, wide_dataset()


def test_auto_placed_data_gives_way_to_a_round_that_fits_only_without_it(monkeypatch):
    config, dataset = wide_config()
    fake_accelerator(monkeypatch, 530)  # 0.9 · 530 = 477 MiB ≥ 463.8, but 0.9 · (530 − 30.5) = 449.5 is not
    copies = count_copies(monkeypatch)
    sim = Simulation(config, dataset=dataset)
    assert (sim.data_placement, sim.data.copied, str(sim.round.strategy)) == ("host", False, "stepwise:1")
    assert copies == []  # checked before it was copied: never copied
    assert sim.strategy_note == ("auto keeps the data on the host: with its 31 MiB on the device, stepwise:1 would "
                                 "need about 464 MiB but 499 MiB of Fake GPU memory would be left")
    host = Simulation(dataclasses.replace(config, data_placement="host"), dataset=dataset)
    assert host.strategy_note is None
    summaries = [simulation_run(config, sim=s) for s in (sim, host)]  # the same run as the data named on the host
    assert summaries[0]["final_test_accuracy"] == summaries[1]["final_test_accuracy"]
    assert summaries[0]["data_placement"] == "host" and summaries[0]["strategy_note"] == sim.strategy_note
    # with room for both the data stays; named, it is never moved (the run is refused instead)
    fake_accelerator(monkeypatch, 560)
    roomy = Simulation(config, dataset=dataset)
    assert roomy.data_placement == "device" and roomy.strategy_note is None and len(copies) == 1
    fake_accelerator(monkeypatch, 530)
    with pytest.raises(ConfigError, match=r"^The run needs about 464 MiB \(stepwise:1 strategy, 40 clients in "
                                          r"flight\) but 499 MiB of Fake GPU memory is available; use --strategy "):
        Simulation(dataclasses.replace(config, data_placement="device"), dataset=dataset)


def test_a_streamed_chunk_is_sized_once_the_placed_data_is_let_go(monkeypatch):
    config, dataset = wide_config()
    # (0.9 · 341 − 257.8) / 5.15 = 9 clients fit without the data on the device; with it, 4 would
    fake_accelerator(monkeypatch, 341)
    sim = Simulation(config, dataset=dataset)
    assert (sim.data_placement, sim.data.copied, str(sim.round.strategy)) == ("host", False, "stream-stepwise:9")
    assert sim.strategy_note == ("auto keeps the data on the host: with its 31 MiB on the device, stepwise:1 would "
                                 "need about 464 MiB but 310 MiB of Fake GPU memory would be left; auto streams the "
                                 "cohort: stepwise:1 would need about 464 MiB but 341 MiB of Fake GPU memory is "
                                 "available")


def test_device_cohort_has_the_host_cohorts_shapes_masks_and_holdout(sim):
    device = sim[0]
    host = copy.copy(device)
    host.data = copy.copy(device.data)
    host.data.keep_on_host()  # the same clients' data, packed on the host
    ids, valid, _, seed = device.sample_cohort(0)
    valid = valid.copy()
    valid[1] = False
    a, b = host.cohort(ids, seed, valid), device.cohort(ids, seed, valid)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert np.shape(x) == np.shape(y) and np.asarray(x).dtype == np.asarray(y).dtype
    for field in ("example_mask", "step_mask"):
        np.testing.assert_array_equal(getattr(a.data, field), getattr(b.data, field))
    np.testing.assert_array_equal(a.info.num_samples, b.info.num_samples)
    for x, y in zip(a.holdout, b.holdout):  # the holdout is gathered by id: the same rows
        np.testing.assert_array_equal(x, y)
    # 1.5 epochs: both read all of each valid client's examples (the second, half epoch may pick others)
    for k in np.flatnonzero(valid):
        seen = lambda c: np.unique(np.asarray(c.data.x[k])[np.asarray(c.data.example_mask[k])], axis=0)  # noqa: E731
        np.testing.assert_array_equal(seen(a), seen(b))
        assert len(seen(b)) == len(np.unique(device.dataset.x_train[device.clients[ids[k]]], axis=0))


def test_device_placement_learns_without_retracing_and_reproduces(sim):
    sim, state, progress = sim
    sim.state, sim.progress = jax.tree.map(lambda a: a.copy(), state), dict(progress)
    records = list(sim.rounds())
    traces = sim.round.trace_count
    assert [r["round"] for r in records] == [1, 2, 3] and all(r["host_time_s"] >= 0 for r in records)
    assert records[-1]["test_accuracy"] > 0.3  # 10 classes: well above chance after three rounds
    assert records[-1]["train_loss"] < records[0]["train_loss"]
    sim.state, sim.progress = jax.tree.map(lambda a: a.copy(), state), dict(progress)
    assert [r["train_loss"] for r in sim.rounds()] == [r["train_loss"] for r in records]
    assert sim.round.trace_count == traces  # three more rounds, nothing traced again


def test_bad_placement_is_one_sentence():
    with pytest.raises(ConfigError, match=r"^--data-placement 'gpu' is unknown; choose one of auto, host, device\.$"):
        RunConfig(data_placement="gpu").validate()


PERMUTE = jax.jit(ondevice._permute)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 16, 17, 255, 1000, 20_000])
def test_each_permutation_is_a_bijection_of_the_clients_examples(n):
    bits = jax.random.bits(jax.random.key(n), (ondevice.FEISTEL_ROUNDS,), np.uint32)
    i = np.arange(n, dtype=np.int32)
    for block in (0, 1, 7):
        np.testing.assert_array_equal(np.sort(PERMUTE(bits, np.int32(n), np.full(n, block, np.int32), i)), i)


def test_permutations_differ_with_the_key_and_the_block_and_look_uniform():
    """n = 5 over 4,000 keys: the first example is each of the 5 about equally often, and every ordered pair
    of the first two occurs; another block (the next epoch) of the same key is another order."""
    n, keys = 5, 4000
    i = np.arange(n, dtype=np.int32)
    bits = jax.random.bits(jax.random.key(0), (keys, ondevice.FEISTEL_ROUNDS), np.uint32)
    perms = np.asarray(jax.vmap(lambda b: PERMUTE(b, np.int32(n), np.zeros(n, np.int32), i))(bits))
    counts = np.bincount(perms[:, 0], minlength=n)
    assert np.all(np.abs(counts - keys / n) < 0.1 * keys / n), counts  # binomial sd ≈ 25: 3 sd is 0.09 · 800
    assert len({(a, b) for a, b in perms[:, :2]}) == n * (n - 1)
    assert len({tuple(p) for p in perms}) > 100  # of the 120 orders
    nxt = np.asarray(jax.vmap(lambda b: PERMUTE(b, np.int32(n), np.ones(n, np.int32), i))(bits))
    assert np.mean(np.all(nxt == perms, axis=1)) < 0.05


def test_a_very_large_client_is_gathered_from_its_own_examples_in_distinct_draws():
    """The settings hold no client size (the stream is computed position by position, never sorted), so a
    20,000-example client costs its cohort nothing; its 3 steps of 4 draw 12 distinct examples of its own."""
    spec = ondevice.gather_spec(batch_size=BATCH, num_steps=STEPS_CAP, local_steps=3)
    assert spec == ondevice.GatherSpec(BATCH, STEPS_CAP, 3, None)
    x = np.arange(20_005, dtype=np.float32)[:, None]
    clients = [np.arange(5), np.arange(5, 20_005)]
    got, num = GATHER(ondevice.place(x, np.ones(20_005, np.int64), clients, spec), np.array([1, 0], np.int32),
                      np.ones(2, bool), jax.random.key(0), spec=spec)
    big = real_ids(got, 0)
    assert num.tolist() == [20_000, 5] and len(np.unique(big)) == 12 and np.isin(big, clients[1]).all()
