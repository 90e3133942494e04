"""The fedpartial side of ``python -m benchmarks.peers``: the same FedAvg rounds as the Flower side, in one process,
every configuration (and the plain JAX loop) alternating round by round.

``python -m benchmarks.peers_fedpartial ROW ROUNDS CONFIG[,CONFIG...]`` prints one JSON line: per configuration the
seconds of every round (the first compiles), plus what ``auto`` chose.  A configuration is ``plain`` (a Python loop
over clients of a jitted SGD step, only the Flax module shared), ``auto`` (what ``--strategy auto --conv-impl auto``
runs) or ``LOWERING/STRATEGY`` (e.g. ``lax/stepwise:1``, ``mapped/fused:1``); ``@D`` splits the cohort over ``D``
devices (the process must have them: ``XLA_FLAGS=--xla_force_host_platform_device_count=D``).
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


def engine_round(row: Row, impl: str, strategy, devices: int = 1):
    return fp.FederatedRound(engine_model(row, impl), fp.methods.fedavg(), num_clients=row.clients,
                             cohort_size=row.cohort, client_optimizer=optax.sgd(0.05, momentum=0.9),
                             strategy=strategy, devices=devices)


def auto_round(row: Row) -> tuple[fp.FederatedRound, dict]:
    """What ``--strategy auto --conv-impl auto`` runs for this row, and how it was chosen."""
    started = time.perf_counter()
    choice = conv_choice.choose(lambda impl: engine_model(row, impl), batch_size=row.batch_size,
                                cohort_size=row.cohort)
    from fedpartial._src.engine import layout_choice

    decided = layout_choice.decide(lambda impl: engine_model(row, impl), choice, batch_size=row.batch_size,
                                   cohort_size=row.cohort, local_steps=row.local_steps)
    how = {"conv_impl": choice.impl, "conv_layout": choice.layout, "conv_seconds": choice.seconds,
           "strategy": str(decided.strategy), "fallback": decided.how, "choose_s": time.perf_counter() - started}
    return engine_round(row, decided.impl, decided.strategy), how


def main(row_name: str, rounds: int, configs: list[str]) -> dict:
    row = ROWS[row_name]
    x, y = population(row)
    runners, chosen = {}, None
    for name in configs:
        if name == "plain":
            loop = kit.PlainLoop(flax_module(row), optax.sgd(0.05, momentum=0.9), (row.side, row.side, row.channels))
            state = {"variables": loop.init_variables(jax.random.key(0))}

            def run_plain(ids, t, loop=loop, state=state):
                state["variables"], loss = loop.round(state["variables"], cohort_packed(x, y, ids))
                return loss

            runners[name] = run_plain
            continue
        if name == "auto":
            rnd, chosen = auto_round(row)
        else:
            spec, _, devices = name.partition("@")
            impl, _, strategy = spec.partition("/")
            rnd = engine_round(row, impl, fp.parse_strategy(strategy), int(devices or 1))
        holder = {"state": rnd.init(jax.random.key(0))}

        def run_engine(ids, t, rnd=rnd, holder=holder):
            packed = cohort_packed(x, y, ids)
            holder["state"], metrics = rnd(holder["state"], _cohort(packed, ids), jax.random.key(t))
            return holder["state"]

        runners[name] = run_engine
    seconds = {name: [] for name in runners}
    sampler = np.random.default_rng(1)
    for t in range(rounds + 1):  # round 0 compiles; every configuration trains the same sampled cohort
        ids = np.sort(sampler.choice(row.clients, row.cohort, replace=False))
        for name, run in runners.items():
            start = time.perf_counter()
            jax.block_until_ready(run(ids, t))
            seconds[name].append(time.perf_counter() - start)
    return {"round_s": seconds, "auto": chosen, "devices": jax.device_count(), "jax": jax.__version__}


def _cohort(packed, ids):
    from fedpartial._src.engine.types import cohort_from_packed

    return cohort_from_packed(packed, ids)


if __name__ == "__main__":
    result = main(sys.argv[1], int(sys.argv[2]), sys.argv[3].split(","))
    print("PEERS-RESULT " + json.dumps(result), flush=True)
