"""Runs the client axis on 4 (fake CPU) devices against 1; prints one JSON object of results.

Started by ``tests/engine/test_sharding.py`` in a subprocess with
``XLA_FLAGS=--xla_force_host_platform_device_count=4`` (the flag must be set before JAX starts,
so it cannot run inside the pytest process).  Every case runs here, in one process, to pay
JAX's start-up once; the test reads the JSON and asserts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import tempfile
import time

import jax
import numpy as np
import optax

from fedpartial._src.engine import conv_choice, sharding
from fedpartial._src.engine.metrics import traffic_totals
from fedpartial._src.engine.round import FederatedRound
from fedpartial._src.engine.runners import base
from fedpartial._src.engine.strategy import fused, stepwise
from fedpartial._src.experiment import core_split, parts, runs
from fedpartial._src.experiment.config import ConfigError, RunConfig
from fedpartial._src.experiment.preflight import preflight
from fedpartial._src.experiment.run_directory import load_config
from fedpartial._src.experiment.simulation import Simulation
from fedpartial._src.methods.basic.fedavg import fedavg
from fedpartial._src.methods.layerwise.fedldf import fedldf
from fedpartial._src.methods.submodel.fedspu import fedspu
from fedpartial._src.models.adapter import from_linen
from tests.conftest import TinyMLP, make_cohort

OPT = optax.sgd(0.1, momentum=0.9)
# Two rounds: the second shows that a round starts from the sharded state the first left (and does not retrace);
# a third proved nothing more (the runs' time is their compilations, one per program and device count)
ROUNDS = 2


def leaves(tree) -> list[np.ndarray]:
    return [np.asarray(a) for a in jax.tree.leaves(jax.device_get(tree))]


def max_diff(a, b) -> float:
    return max(float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64)), initial=0.0))
               for x, y in zip(leaves(a), leaves(b)))


def bit_equal(a, b) -> bool:
    return all(x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y) for x, y in zip(leaves(a), leaves(b)))


def engine_run(model, method, devices, k=6, n=12):
    """ROUNDS rounds of the fused round: ``k`` clients on one device, or padded to a multiple of 4 on 4.

    Returns the final state, per-round integer metrics, per-round train loss, shardings and trace count.
    """
    size = k if devices is None else sharding.padded_size(k, devices)
    r = FederatedRound(model, method, num_clients=n, cohort_size=size, client_optimizer=OPT,
                       strategy=fused(), devices=devices)
    state = r.init(jax.random.key(0))
    ints, losses, cohort = [], [], None
    for t in range(ROUNDS):
        cohort = make_cohort((4,), k=k, steps=3, batch=5, seed=t, real_steps=[3, 2, 1, 3, 3, 2, 3, 1][:k],
                             client_ids=(np.arange(k) * 3 + t) % n)
        if r.mesh is not None:
            cohort = sharding.shard_cohort(sharding.pad_cohort(cohort, size, n), r.mesh)
        state, metrics = r(state, cohort, jax.random.key(100 + t))
        totals = traffic_totals(metrics)
        ints.append([int(metrics["client_steps"]), totals["upload_bytes"], totals["download_bytes"]])
        losses.append(float(metrics["train_loss"]))
    if r.mesh is None:
        return state, ints, losses, None, r.trace_count
    compiled = r.runner.round.lower(state, cohort, jax.random.key_data(jax.random.key(0))).compile()
    shardings = {
        "cohort_devices": cohort.data.x.sharding.num_devices,
        "cohort_shard_rows": [s.data.shape[0] for s in cohort.data.x.addressable_shards],
        "state_devices": jax.tree.leaves(state.variables)[0].sharding.num_devices,
        "state_replicated": all(a.sharding.is_fully_replicated for a in jax.tree.leaves(state)),
        "jit_input_cohort_specs": sorted({str(s.spec) for s in jax.tree.leaves(compiled.input_shardings[0][1])}),
    }
    return state, ints, losses, shardings, r.trace_count


def stepwise_run(model, method, devices, k=6, n=12):
    """ROUNDS rounds of stepwise:1 (``devices``: its clients trained side by side, 4 then 2 at a time)."""
    r = FederatedRound(model, method, num_clients=n, cohort_size=k, client_optimizer=OPT, strategy=stepwise(1),
                       devices=devices)
    state = r.init(jax.random.key(0))
    ints = []
    for t in range(ROUNDS):
        cohort = make_cohort((4,), k=k, steps=3, batch=5, seed=t, real_steps=[3, 2, 1, 3, 3, 2][:k],
                             client_ids=(np.arange(k) * 3 + t) % n)
        state, metrics = r(state, cohort, jax.random.key(100 + t))
        totals = traffic_totals(metrics)
        ints.append([int(metrics["client_steps"]), totals["upload_bytes"], totals["download_bytes"]])
    # the devices the client steps ran on: each jitted step holds one executable per device it ran on
    ran_on = sum(f._cache_size() for f in r.runner.steps.fns.values())
    # executables of the round's begin and end: one each, or a later round compiled them again
    ends = r.runner._begin._cache_size() + r.runner._finish._cache_size()
    return state, ints, ran_on, r.trace_count, ends


def compare_stepwise(model, name, method):
    one, four = stepwise_run(model, method, None), stepwise_run(model, method, 4)
    return {"method": name, "bit_equal": bit_equal(one[0], four[0]), "max_diff": max_diff(one[0], four[0]),
            "ints_1": one[1], "ints_4": four[1], "executables_1": one[2], "executables_4": four[2],
            "mesh_4": None, "trace_count_1": one[3], "trace_count_4": four[3], "ends_1": one[4], "ends_4": four[4]}


def compare_engine(model, name, method):
    one, four = engine_run(model, method, None), engine_run(model, method, 4)
    return {"method": name, "max_diff": max_diff(one[0], four[0]), "bit_equal": bit_equal(one[0], four[0]),
            "ints_1": one[1], "ints_4": four[1], "loss_diff": max(abs(a - b) for a, b in zip(one[2], four[2])),
            "shardings_4": four[3], "trace_count_4": four[4]}


SIM_SETTINGS = dict(dataset="synthetic", model="mlp", num_clients=10, cohort_size=6, rounds=ROUNDS, local_steps=2,
                    batch_size=8, eval_every=ROUNDS, out_dir=None)


def sim_run(devices, **overrides):
    config = RunConfig(**{**SIM_SETTINGS, "strategy": "fused", "devices": devices, **overrides})
    sim = Simulation(config)
    return sim, list(sim.rounds())


def compare_simulation(method, options=None, **overrides):
    """The same run on 1 and 4 devices: K = 6, padded to 8 on 4."""
    (sim1, rec1), (sim4, rec4) = (sim_run(d, method=method, options=options or {}, **overrides) for d in (1, 4))
    ints = ("client_steps", "upload_bytes", "download_bytes", "clients", "client_flops")
    ids4, valid4, _, _ = sim4.sample_cohort(0)
    return {"method": method, "cohort_size_1": sim1.round.ctx.cohort_size, "cohort_size_4": sim4.round.ctx.cohort_size,
            "max_diff": max_diff(sim1.state, sim4.state), "bit_equal": bit_equal(sim1.state, sim4.state),
            "max_abs": max(float(np.max(np.abs(a))) for a in leaves(sim1.state.variables)),
            "groups_4": [[g.name, g.size] for g in sim4.round.groups],
            "ints_1": [[r[f] for f in ints] for r in rec1], "ints_4": [[r[f] for f in ints] for r in rec4],
            "acc_1": rec1[-1]["test_accuracy"], "acc_4": rec4[-1]["test_accuracy"],
            "ids_1": sim1.sample_cohort(0)[0].tolist(), "ids_4": ids4.tolist(), "valid_4": valid4.tolist(),
            "state_devices_4": jax.tree.leaves(sim4.state.variables)[0].sharding.num_devices,
            "step_devices_4": len(sim4.round.step_devices or ()),
            "placement": [sim1.data_placement, sim4.data_placement]}


def split_facts(one_sim, sim) -> dict:
    """What a run restarted for the split shows of it (its plan, lowering and note), and how far from one device."""
    return {"strategy": str(sim.round.strategy), "summary_devices": run_summary_devices(sim),
            "bit_equal": bit_equal(one_sim.state, sim.state), "max_diff": max_diff(one_sim.state, sim.state),
            "note": sim.strategy_note, "conv": sim.conv_choice.describe()}


def compare_auto_split() -> dict:
    """``--strategy auto`` in a process restarted for the ``map`` split over the cores (:mod:`core_split`'s variable
    set, as the command sets it): its plan and lowering follow the split, the fused round one client at a time
    (the ``loop`` split is :func:`compare_split_wrapped_and_resumed`'s); and the split's timing runs on these
    devices."""
    one_sim, _ = sim_run(1, strategy="stepwise:1")
    with split_process(4, "map"):
        sim, _ = sim_run(None, strategy="auto")
    out = {"map": split_facts(one_sim, sim)}
    model = from_linen(TinyMLP(), input_shape=(4,), num_classes=3, sequential=True, name="tiny_mlp")
    seconds = conv_choice.time_split(lambda impl: model, parts.timing_round, (("lax", "loop"), ("lax", "map")),
                                     jax.local_device_count(), batch_size=4, cohort_size=6, local_steps=1)
    out["time_split"] = {k: v > 0 for k, v in seconds.items()}
    return out


#: the wrappers a run adds, all at once: DP clipping and noise, an upload codec with error feedback, early
#: stopping, a deadline that cuts slow clients, FedSPU's per-client state kept on the host
WRAPPED = dict(method="fedspu", client_state="host", dp_clip=1.0, dp_noise_multiplier=0.5, upload_codec="topk:0.5",
               early_stopping=True, deadline_quantile=0.5)


@contextlib.contextmanager
def split_process(devices: int, layout: str):
    """This process as ``fedpartial run`` starts it again for the split over the cores (its variable set)."""
    split = core_split.CoreSplit(devices, "lax", layout, {f"lax/{layout}": 0.01}, {"lax/vmap": 0.02})
    os.environ[core_split.ENV] = json.dumps(dataclasses.asdict(split))
    try:
        yield
    finally:
        del os.environ[core_split.ENV]


def compare_split_wrapped_and_resumed(out_dir: str) -> dict:
    """:data:`WRAPPED` split over the 4 devices as ``auto``'s restart runs it, against one device's ``stepwise:1``;
    and the split run stopped after round 1 (its checkpoint) and resumed to round ``ROUNDS``."""
    one, rec1 = sim_run(1, strategy="stepwise:1", **WRAPPED)
    with split_process(4, "loop"):
        four, rec4 = sim_run(None, strategy="auto", **WRAPPED)
        first = RunConfig(**{**SIM_SETTINGS, **WRAPPED, "strategy": "auto", "devices": None, "rounds": 1,
                             "out_dir": out_dir, "run_name": "split"})
        run_dir = runs.run(first)["run_dir"]
        again = dataclasses.replace(load_config(run_dir), rounds=ROUNDS)
        resumed = Simulation(again)
        summary = runs.run(again, sim=resumed, resume=run_dir)
    ints = ("client_steps", "upload_bytes", "download_bytes", "clients")
    return {**split_facts(one, four),
            "ints_1": [[r[f] for f in ints] for r in rec1], "ints_4": [[r[f] for f in ints] for r in rec4],
            "step_devices_4": len(four.round.step_devices or ()), "client_state_4": four.client_state,
            "resumed_from": summary["resumed_from_round"], "resumed_devices": summary["devices"],
            "resumed_bit_equal": bit_equal(one.state, resumed.state)}


def run_summary_devices(sim) -> int:
    return sim.mesh.size if sim.mesh is not None else len(sim.round.step_devices or ()) or 1


def refusals(model) -> dict:
    out = {}

    def catch(name, fn):
        try:
            fn()
            out[name] = None
        except (ValueError, ConfigError) as e:
            out[name] = str(e)

    catch("engine_stepwise", lambda: FederatedRound(model, fedavg(), num_clients=8, cohort_size=8,
                                                    client_optimizer=OPT, strategy=stepwise(2),
                                                    devices=4))
    catch("engine_cohort", lambda: FederatedRound(model, fedavg(), num_clients=8, cohort_size=6,
                                                  client_optimizer=OPT, strategy=fused(), devices=4))
    catch("engine_too_many", lambda: FederatedRound(model, fedavg(), num_clients=8, cohort_size=8,
                                                    client_optimizer=OPT, strategy=fused(), devices=5))
    base = RunConfig(dataset="synthetic", model="mlp", num_clients=10, cohort_size=6, out_dir=None)
    catch("config_too_many", lambda: preflight(dataclasses.replace(base, devices=5)))
    catch("config_stepwise", lambda: dataclasses.replace(base, devices=4, strategy="stepwise:2").validate())
    catch("config_zero", lambda: dataclasses.replace(base, devices=0).validate())
    return out


def main() -> None:
    # The engine's rounds compiled at XLA's optimization level 0, as tests/conftest.py's engine_compiled_at_o0 does
    # in the test processes (it says why that changes nothing a comparison here proves: both sides of each are
    # compiled alike): this process's time is its compilations (measured 60 -> 42 s, every result within its
    # tolerance and every bit-for-bit one still bit for bit).  Here, not at import: only this process's own run.
    base.CPU_COMPILER_OPTIONS = {**base.CPU_COMPILER_OPTIONS, "xla_backend_optimization_level": 0}
    model = from_linen(TinyMLP(), input_shape=(4,), num_classes=3, sequential=True, name="tiny_mlp")
    results = {"device_count": jax.local_device_count(), "seconds": {}}
    start = time.perf_counter()
    # FedAvg's fused round is FedLDF's without the layer selection: FedLDF (masked uploads) and FedSPU (per-client
    # [N] state scattered from padded rows) cover the sharded round between them
    results["engine"] = [compare_engine(model, name, method) for name, method in (("fedldf", fedldf(3)),
                                                                                 ("fedspu", fedspu()))]
    results["seconds"]["engine"] = time.perf_counter() - start
    start = time.perf_counter()
    # FedSPU's step is FedAvg's plus its per-client state: one method shows the steps side by side
    results["stepwise"] = [compare_stepwise(model, "fedspu", fedspu())]
    results["simulation_stepwise"] = compare_simulation("embracingfl", {"tier_mix": "4,2,4"}, strategy="stepwise:1")
    results["auto_split"] = compare_auto_split()
    with tempfile.TemporaryDirectory() as out_dir:
        results["split_wrapped"] = compare_split_wrapped_and_resumed(out_dir)
    results["seconds"]["stepwise"] = time.perf_counter() - start
    start = time.perf_counter()
    # FedSPU (per-client state) with its data placed on the (first) device once, each round's gathered cohort
    # then split over the four: one pair of runs for both (they were two, each two compilations)
    results["simulation"] = compare_simulation("fedspu", data_placement="device")
    # client groups: tiers of 3, 1 and 2 clients of 10; and the whole population of 6 in tiers of 2, so the
    # 2 padding rows repeat ids.  On 4 devices the last tier holds the padding rows too.
    results["groups"] = [compare_simulation("embracingfl", {"tier_mix": "4,2,4"}),
                         compare_simulation("heterofl", {"tier_mix": "2,2,2"}, num_clients=6)]
    results["seconds"]["simulation"] = time.perf_counter() - start
    results["refusals"] = refusals(model)
    # the multi-host assembly, in one process: this process holds every row
    mesh = sharding.client_mesh(4)
    cohort = sharding.pad_cohort(make_cohort((4,), k=6), 8, 12)
    rows = sharding.process_rows(8, mesh)
    assembled = sharding.global_cohort(jax.tree.map(lambda a: a[rows], cohort), mesh, 8)
    results["global_cohort"] = {"rows": [rows.start, rows.stop], "equal": bit_equal(assembled, cohort),
                                "devices": assembled.data.x.sharding.num_devices}
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
