"""The fedpartial side of ``python -m benchmarks.peers``: the same FedAvg rounds as the Flower side, in one process,
every configuration (and the plain JAX loop) alternating round by round.

``python -m benchmarks.peers_fedpartial ROUNDS '{"ROW": ["CONFIG", ...], ...}'`` prints one JSON line: per row and
configuration the seconds of every round (the first compiles), plus what ``auto`` chose.  A configuration is
``plain`` (a Python loop over clients of a jitted SGD step, only the Flax module shared), ``auto`` (what
``--strategy auto --conv-impl auto`` would run: measured by :func:`auto_choice`, then timed as the configuration it
names, which is run once; a split over the cores is timed by the process that has the devices) or
``LOWERING/STRATEGY`` (e.g. ``lax/stepwise:1``, ``mapped/fused:1``); ``@D`` splits the cohort over ``D`` devices
(the process must have them: ``XLA_FLAGS=--xla_force_host_platform_device_count=D``).
"""

from __future__ import annotations

import json
import sys
import time

import jax
import numpy as np
import optax

import fedpartial as fp
from benchmarks.peers_rows import ROWS, Row
from fedpartial._src.bench import kit
from fedpartial._src.engine import conv_choice
from fedpartial._src.experiment import core_split, parts
from fedpartial._src.models import zoo
from fedpartial.models import from_linen


def flax_module(row: Row, impl: str = "lax"):
    if row.model == "mlp":
        return zoo.MLP(10)
    if row.model == "cnn":
        return zoo.CNN2C3F(10, features=(16, 32), hidden=(64,), kernel_size=5, padding="SAME", conv_impl=impl)
    return zoo.CNN2C1F(10, conv_impl=impl)


def engine_model(row: Row, impl: str = "lax"):
    return from_linen(flax_module(row, impl), input_shape=(row.side, row.side, row.channels), num_classes=10,
                      sequential=True, name=row.model)


def population(row: Row):
    """Every client's examples (``local_steps x batch`` each, drawn from its id) packed ``[N, S, B, ...]``."""
    rng = np.random.default_rng(0)
    shape = (row.clients, row.local_steps, row.batch_size)
    x = rng.normal(size=(*shape, row.side, row.side, row.channels)).astype(np.float32)
    y = rng.integers(0, 10, size=shape).astype(np.int32)
    return x, y


def cohort_packed(x, y, ids):
    k, s, b = len(ids), x.shape[1], x.shape[2]
    return fp.data.CohortBatches(x[ids], y[ids], np.ones((k, s, b), bool), np.ones((k, s), bool),
                                 np.full((k,), s * b, np.float32))


#: the clients' optimizer on both sides
LR, MOMENTUM = 0.05, 0.9
#: the round ``auto`` times a layout by, as ``fedpartial run`` builds it for this optimizer
TIMING = ("fedpartial._src.experiment.parts:timing_round", {"lr": LR, "momentum": MOMENTUM, "weight_decay": 0.0})


def engine_round(row: Row, impl: str, strategy, devices: int = 1):
    return fp.FederatedRound(engine_model(row, impl), fp.methods.fedavg(), num_clients=row.clients,
                             cohort_size=row.cohort, client_optimizer=optax.sgd(LR, momentum=MOMENTUM),
                             strategy=strategy, devices=devices)


def row_model(row_name: str, conv_impl: str = "lax"):
    """The row's model by name (what the split's timing process builds, see :func:`auto_choice`)."""
    return engine_model(ROWS[row_name], conv_impl)


def auto_choice(row_name: str) -> dict:
    """What ``fedpartial run --strategy auto --conv-impl auto`` runs for this row (``config``: as
    ``LOWERING/STRATEGY``, with ``@D`` when it splits the cohort over the ``D`` cores), and how it was chosen:
    the one-device choice, then the split over the cores timed in a process of single-threaded devices
    (:mod:`fedpartial._src.experiment.core_split`), taken when faster by the same margin."""
    row = ROWS[row_name]
    started = time.perf_counter()
    choice = conv_choice.choose(
        lambda impl: engine_model(row, impl),
        lambda model, strategy, clients, devices: parts.timing_round(model, strategy, clients, devices, **TIMING[1]),
        batch_size=row.batch_size, cohort_size=row.cohort, local_steps=row.local_steps)
    strategy = fp.parse_strategy("auto", engine_model(row, choice.impl), layout=choice.layout)
    out = {"config": f"{choice.impl}/{strategy}", "conv_impl": choice.impl, "conv_layout": choice.layout,
           "conv_seconds": choice.seconds, "how": choice.how}
    devices = min(core_split.cores(), row.cohort)
    if choice.seconds and jax.device_count() == 1 and devices > 1:
        model = engine_model(row)
        pairs = core_split.candidates("auto", "conv" in model.structure.kinds, False)
        # what fedpartial run weighs: one device's choice timed again now, as often as the split
        known = core_split.measure(("benchmarks.peers_fedpartial:row_model", {"row_name": row_name}), TIMING,
                                   (choice.impl, choice.layout), pairs, devices=devices,
                                   batch_size=row.batch_size, cohort_size=row.cohort, local_steps=row.local_steps)
        split = core_split.decide(known["one_device"], known["split"], devices)
        out["one_device_seconds"] = known["one_device"]
        out["split_seconds"] = known["split"]
        if split is not None:
            layout = fp.parse_strategy("auto", model, layout=split.layout)
            out["config"] = f"{split.impl}/{layout}@{devices}"
    out["choose_s"] = time.perf_counter() - started
    return out


def runner(row: Row, name: str, x, y):
    """``run(ids, t)``: one round of configuration ``name`` on the clients ``ids``, its state kept inside."""
    if name == "plain":
        loop = kit.PlainLoop(flax_module(row), optax.sgd(LR, momentum=MOMENTUM), (row.side, row.side, row.channels))
        held = {"variables": loop.init_variables(jax.random.key(0))}

        def run_plain(ids, t):
            held["variables"], loss = loop.round(held["variables"], cohort_packed(x, y, ids))
            return loss

        return run_plain
    spec, _, devices = name.partition("@")
    impl, _, strategy = spec.partition("/")
    rnd = engine_round(row, impl, fp.parse_strategy(strategy), int(devices or 1))
    held = {"state": rnd.init(jax.random.key(0))}

    def run_engine(ids, t):
        held["state"], _ = rnd(held["state"], _cohort(cohort_packed(x, y, ids), ids), jax.random.key(t))
        return held["state"]

    return run_engine


def time_row(row_name: str, rounds: int, configs: list[str]) -> dict:
    row = ROWS[row_name]
    x, y = population(row)
    chosen = auto_choice(row_name) if "auto" in configs else None
    names = [c for c in configs if c != "auto"]
    here = chosen and "@" not in chosen["config"]  # a split is timed in the split's process
    if here and chosen["config"] not in names:
        names.append(chosen["config"])
    runners = {name: runner(row, name, x, y) for name in names}
    seconds = {name: [] for name in runners}
    sampler = np.random.default_rng(1)
    for t in range(rounds + 1):  # round 0 compiles; every configuration trains the same sampled cohort
        ids = np.sort(sampler.choice(row.clients, row.cohort, replace=False))
        for name, run in runners.items():
            start = time.perf_counter()
            jax.block_until_ready(run(ids, t))
            seconds[name].append(time.perf_counter() - start)
    if here:
        seconds["auto"] = seconds[chosen["config"]]
    return {"round_s": seconds, "auto": chosen}


def main(rounds: int, plan: dict) -> dict:
    rows = {}
    for row, configs in plan.items():
        rows[row] = time_row(row, rounds, configs)
        print("PEERS-ROW " + json.dumps({row: rows[row]}), flush=True)  # kept if the process is cut off
    return {"rows": rows, "devices": jax.device_count(), "jax": jax.__version__}


def _cohort(packed, ids):
    from fedpartial._src.engine.types import cohort_from_packed

    return cohort_from_packed(packed, ids)


if __name__ == "__main__":
    result = main(int(sys.argv[1]), json.loads(sys.argv[2]))
    print("PEERS-RESULT " + json.dumps(result), flush=True)
