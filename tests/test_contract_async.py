"""The asynchronous contract over every method that may run with ``--mode async`` (its ``Capabilities.asynchronous``;
a newly marked method is picked up from the catalogue), at the smallest size that shows it: digits, the MLP, N = 8,
C = 4, M = 2, three server steps on log-normal devices (so updates arrive stale), with what a user can add on the
command line stacked on it — client weight decay, Adam at the server, a checkpoint between server steps, and
DP-FedAvg on one method of each family.

Each method's run: finite losses; every server step's record has its fields (``server_step``,
``simulated_clock_s``, ``staleness_mean``/``staleness_max`` that agree with the arrivals, ``clients_arrived``,
``clients_in_flight``, bytes and FLOPs); at least one update arrives stale; a run restored from the checkpoint after
server step 1, written to a run folder on disk and read back from it, ends with the uninterrupted run's state, pool
and records, bit for bit (with the pool on the device, and for FedAvg with the pool in host memory too, as a pool
that does not fit beside the round on an accelerator is kept); and per family, a property of
its masks that can fail:

* dense (FedAvg, FedProx): every element is received at every step (nothing is frozen by accident);
* per-layer top-n (FedLDF, Random, HDFL, ``--n 1``): each layer is uploaded by exactly ``n`` arrived clients;
* everything else (masks, submodels, personal layers, tiers): an element no arrived update carries keeps its value
  bit for bit under Adam, and at this size some element is frozen (so the check is not vacuous; FedSelect's
  personal part grows from nothing, so it freezes nothing in three steps), except under DP, whose noise reaches
  every element.

One method of each family runs by default (FedAvg, HDFL with DP, FedSPU, FedPer, HeteroFL); the others with
``-m slow`` (FedBN on ResNet-20, which has the BatchNorm it keeps personal, takes a minute).

The synchronous contract of the same methods is tests/test_contract.py; the equivalences with the synchronous run
and by hand are tests/engine/test_asynchronous.py and tests/experiment/test_asynchronous.py.
"""

import chex
import jax
import numpy as np
import pytest

from fedpartial._src.core import masks
from fedpartial._src.experiment import asynchronous, checkpoint
from fedpartial._src.experiment.asynchronous import AsyncSimulation
from fedpartial._src.experiment.config import ConfigError, RunConfig
from fedpartial._src.methods.catalog import METHODS, get_method

#: the methods ``--mode async`` takes, from the catalogue
ASYNC_METHODS = [n for n in METHODS if get_method(n).capabilities.asynchronous]
DENSE = {"fedavg", "fedprox"}
TOP_N = {"fedldf", "random", "hdfl"}
#: options at this size: ``--n`` at most the buffer (one uploader per layer, so a wrong count shows); tiers with
#: one strong client of eight, so that a server step of two narrow updates leaves elements to nobody
OPTIONS = {**{name: {"n": 1} for name in TOP_N},
           **{name: {"tier_mix": (1, 1, 6)} for name in ("heterofl", "fedrolex", "embracingfl", "depthfl")}}
#: one method of each family also runs under DP-FedAvg (clipping, noise per server step, ε per server step); its
#: noise reaches every element, uploaded or not, so the freezing check is its siblings'
WITH_DP = {"fedprox", "hdfl", "feddrop", "fedpart", "fedrolex", "lgfedavg"}
#: methods whose masks leave some element to nobody at this size (the freezing check must bite)
FREEZES = {"fiarse", "fedspu", "fjord", "hermes", "fedmp", "prunefl", "heterofl", "embracingfl", "fedadp",
           "fedper", "lgfedavg", "fedrep", "fedbn", "fedbabu", "depthfl"}
#: a model other than the MLP where the method needs one (FedBN: BatchNorm layers to keep personal)
MODELS = {"fedbn": "resnet20"}
#: the default run covers one method of each family (with DP on the top-n one; the methods that choose which
#: elements a client trains or uploads, personal or not, are one family here: their check is the same); the rest
#: of each family runs with ``-m slow`` (a newly marked method is in neither list: it runs by default)
FAMILY_OF = {"fedprox": "fedavg", "fedldf": "hdfl", "random": "hdfl", "feddrop": "fedspu", "fjord": "fedspu",
             "hermes": "fedspu", "fedmp": "fedspu", "prunefl": "fedspu", "fedselect": "fedspu", "fedpart": "fedspu",
             "fiarse": "fedspu", "fedadp": "fedspu", "fedrolex": "heterofl", "embracingfl": "heterofl",
             "depthfl": "heterofl", "lgfedavg": "fedper", "fedrep": "fedper", "fedbn": "fedper", "fedbabu": "fedper",
             "ffa_lora": "fedit", "fedsa_lora": "fedper"}
BASE = dict(dataset="digits", model="mlp", num_clients=8, cohort_size=2, mode="async", concurrency=4, buffer=2,
            rounds=3, local_steps=2, batch_size=8, eval_every=3, out_dir=None, compute_speed="lognormal:1e9:1.0",
            weight_decay=0.01, server_optimizer="adam", server_lr=0.01, record_decisions=True)
RECORD_FIELDS = ("server_step", "simulated_clock_s", "staleness_mean", "staleness_max", "clients_arrived",
                 "clients_in_flight", "upload_bytes", "download_bytes", "client_flops", "train_loss")
WALL_CLOCK = ("round_time_s", "wall_time_s", "host_time_s")
NAMES = [pytest.param(n, marks=pytest.mark.slow) if n in FAMILY_OF else n for n in ASYNC_METHODS]


#: the federated LoRA methods train adapters over a frozen base
LORA = {"fedit", "ffa_lora", "fedsa_lora"}


def config(name, **changes):
    dp = dict(dp_clip=1.0, dp_noise_multiplier=1.0) if name in WITH_DP else {}
    lora = dict(lora=2) if name in LORA else {}
    return RunConfig(**{**BASE, "model": MODELS.get(name, "mlp"), **dp, **lora, **changes}, method=name,
                     options=OPTIONS.get(name, {}))


def steps(sim):
    """The run's server steps: each record (wall times dropped) with the step's decisions and the parameters
    before and after it."""
    before = jax.device_get(sim.state.variables["params"])
    for record in sim.rounds():
        after = jax.device_get(sim.state.variables["params"])
        yield {k: v for k, v in record.items() if k not in WALL_CLOCK}, sim.last_decisions, before, after
        before = after


def received_per_client(sim, decisions, params):
    """``[M]`` trees of bool: which elements of ``params`` each arrived update carries with a non-zero weight."""
    sel = decisions["selection"]
    expanded = jax.vmap(lambda mask: masks.expand(sim.round.ctx.structure, mask, params))(sel.upload)
    weights = np.asarray(sel.weights) > 0
    return jax.tree.map(lambda e: np.asarray(e) & weights.reshape((-1,) + (1,) * (np.ndim(e) - 1)), expanded)


def _pool_on_host(monkeypatch):
    monkeypatch.setattr(asynchronous, "pool_place", lambda *_: "host")


# Each method's dispatch round and server step, run for three server steps and compared only with themselves (a
# restored run): compiled at -O0 (tests/conftest.py says why that changes nothing here)
@pytest.mark.usefixtures("engine_compiled_at_o0")
@pytest.mark.parametrize("name", NAMES)
def test_async_method_keeps_the_contract(name, tmp_path):
    _check_contract(name, str(tmp_path))


def test_a_pool_kept_in_host_memory_keeps_the_contract_and_runs_as_on_the_device(tmp_path, monkeypatch):
    on_device = [record for record, *_ in steps(AsyncSimulation(config("fedavg")))]
    _pool_on_host(monkeypatch)
    assert _check_contract("fedavg", str(tmp_path), pool_place="host") == on_device


def _check_contract(name, run_dir, pool_place="device"):
    sim = AsyncSimulation(config(name))
    assert sim.pool_place == pool_place
    run = []
    for i, step in enumerate(steps(sim)):
        run.append(step)
        if i == 0:  # the checkpoint after server step 1, written to the run folder
            checkpoint.save(run_dir, sim)
    assert len(run) == 3
    final = jax.device_get((sim.state, sim.pool))
    stale = False
    for t, (record, decisions, before, after) in enumerate(run):
        assert all(f in record for f in RECORD_FIELDS), sorted(set(RECORD_FIELDS) - set(record))
        assert record["server_step"] == t + 1 and np.isfinite(record["train_loss"])
        assert record["clients_arrived"] == 2 and record["clients_in_flight"] == 4
        tau = record["arrived_staleness"]
        assert record["staleness_max"] == max(tau) and record["staleness_mean"] == pytest.approx(np.mean(tau))
        assert record["upload_bytes"] > 0 and record["download_bytes"] > 0 and record["client_flops"] > 0
        stale |= record["staleness_max"] > 0
        if name in WITH_DP:
            assert record["dp_epsilon"] > (run[t - 1][0]["dp_epsilon"] if t else 0.0)
        got = received_per_client(sim, decisions, before)
        anyone = jax.tree.map(lambda g: g.any(0), got)
        if name in DENSE:
            assert all(a.all() for a in jax.tree.leaves(anyone)), "a dense method froze an element"
        elif name in TOP_N:
            uploaders = [int(g.reshape(2, -1).any(1).sum()) for g in jax.tree.leaves(got)]
            assert uploaders == [1] * len(uploaders), uploaders
        frozen = [~np.asarray(a) for a in jax.tree.leaves(anyone)]
        for new, old, keep in zip(jax.tree.leaves(after), jax.tree.leaves(before), frozen):
            if name not in WITH_DP:
                np.testing.assert_array_equal(np.asarray(new)[keep], np.asarray(old)[keep])
        run[t] = run[t] + (sum(int(k.sum()) for k in frozen),)
    assert stale, "no update arrived stale: the run shows nothing asynchronous"
    assert np.isfinite(run[-1][0]["test_accuracy"])
    if name in FREEZES:
        assert sum(step[-1] for step in run) > 0, "nothing was frozen: the check above showed nothing"

    # Resumed from the checkpoint on disk after server step 1: the uninterrupted run, bit for bit.
    checkpoint.restore(run_dir, sim)
    assert sim.progress["round"] == 1
    resumed = list(steps(sim))
    chex.assert_trees_all_equal(jax.device_get((sim.state, sim.pool)), final)
    assert [r for r, *_ in resumed] == [step[0] for step in run[1:]]
    return [step[0] for step in run]


@pytest.mark.parametrize("changes, message", [
    (dict(early_stopping=True), "--es"),
    (dict(upload_codec="topk:0.5"), "--upload-codec"),
    (dict(strategy="stream:2"), "stream"),
])
def test_what_async_cannot_take_is_refused_in_one_sentence(changes, message):
    with pytest.raises(ConfigError) as refused:
        RunConfig(**BASE, method="fedavg", **changes).validate()
    sentence = str(refused.value)
    assert message in sentence and "\n" not in sentence and sentence.endswith("."), sentence
