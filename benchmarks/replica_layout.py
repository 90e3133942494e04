"""Replicas in the layout a single run decides: ``--seeds 0,1`` against the two seeds run separately.

Usage::

    python -m benchmarks.replica_layout [--out PATH] [--rounds R] [--clients N] [--cohort K] [--repeats N]

The 28x28 CNN (``cnn2c1f`` on ``mnist5k``) with ``--conv-impl auto`` and ``--strategy auto``: the replicas
(:func:`fedpartial._src.experiment.replicas.run_seeds`, one simulation of both seeds) against
:func:`fedpartial._src.experiment.simulation.run` of each seed in turn (what a person runs without ``--seeds``).
Both are timed end to end (building, compiling, R rounds with evaluation; nothing written), and by their steady
rounds (``round_time_s`` summed over the seeds, the first round, which compiles, left out); the variants
alternate ``--repeats`` times and the best of each is kept.  The JSON (``benchmarks/results/``) names the
device, the date, the command, the strategy and lowering each side ran, and the ratio separate / replicas
(above 1: the replicas are faster).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time

from benchmarks.strategies import device_info, log
from fedpartial._src.experiment import replicas, simulation
from fedpartial._src.experiment.config import RunConfig

SEEDS = (0, 1)


def steady(records: list[dict]) -> float:
    return sum(r["round_time_s"] for r in records[1:])


def run_replicas(config: RunConfig) -> dict:
    start = time.perf_counter()
    done = replicas.run_seeds(config, list(SEEDS))
    wall = time.perf_counter() - start
    sim = done["simulations"][0]
    return {"wall_s": wall, "steady_s": sum(steady(r["records"]) for r in done["results"]),
            "strategy": str(sim.round.strategy), "conv_impl": sim.conv_choice.impl,
            "final_accuracy": [r["records"][-1].get("test_accuracy") for r in done["results"]]}


def run_separately(config: RunConfig) -> dict:
    start = time.perf_counter()
    results, strategy, impl = [], None, None
    for seed in SEEDS:
        sim = simulation.Simulation(dataclasses.replace(config, seed=seed))
        strategy, impl = str(sim.round.strategy), sim.conv_choice.impl
        results.append(simulation.run(sim.config, sim=sim))
    wall = time.perf_counter() - start
    return {"wall_s": wall, "steady_s": sum(steady(r["records"]) for r in results), "strategy": strategy,
            "conv_impl": impl, "final_accuracy": [r["records"][-1].get("test_accuracy") for r in results]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--cohort", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    config = RunConfig(dataset="mnist5k", model="cnn2c1f", num_clients=args.clients, cohort_size=args.cohort,
                       rounds=args.rounds, local_steps=5, batch_size=16, conv_impl="auto", strategy="auto",
                       out_dir=None)
    best: dict[str, dict] = {}
    for repeat in range(args.repeats):
        for name, fn in (("replicas", run_replicas), ("separate", run_separately)):
            got = fn(config)
            log(f"repeat {repeat}: {name} {got['wall_s']:.1f} s end to end, {got['steady_s']:.2f} s steady "
                f"({got['strategy']}, {got['conv_impl']})")
            if name not in best or got["steady_s"] < best[name]["steady_s"]:
                best[name] = got
    result = {
        "command": "python -m benchmarks.replica_layout " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.date.today().isoformat(), "device": device_info(),
        "config": {"dataset": "mnist5k", "model": "cnn2c1f", "clients": args.clients, "cohort": args.cohort,
                   "rounds": args.rounds, "local_steps": 5, "batch_size": 16, "seeds": list(SEEDS),
                   "conv_impl": "auto", "strategy": "auto"},
        "replicas": best["replicas"], "separate": best["separate"],
        "steady_ratio_separate_over_replicas": best["separate"]["steady_s"] / best["replicas"]["steady_s"],
        "wall_ratio_separate_over_replicas": best["separate"]["wall_s"] / best["replicas"]["wall_s"],
    }
    out = args.out or os.path.join(os.path.dirname(__file__), "results",
                                   f"replica-layout-{result['device'].get('backend', 'cpu')}-{result['date']}.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    log(json.dumps({k: result[k] for k in ("steady_ratio_separate_over_replicas", "wall_ratio_separate_over_replicas")}))
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
