"""Per-round time split and end-to-end rounds/s of ``fedpartial run`` with the data on the host or the device.

Usage::

    python -m benchmarks.data_placement [--quick] [--out PATH] [--rounds R] [--cases digits,synthetic,mnist5k]

For every case two :class:`~fedpartial._src.experiment.simulation.Simulation` objects are built from the
same :class:`~fedpartial._src.experiment.config.RunConfig`, one with ``data_placement='host'`` (the
cohort packed with numpy every round, copied to the device by the round) and one with
``'device'`` (the population placed once, the cohort gathered in jit).  Both are warmed up
(compilation), then measured side by side, alternating host and device round by round:

* the split, each phase synchronised explicitly (``jax.block_until_ready``):
  ``sample_s`` (:meth:`Simulation.sample_cohort`), ``prepare_s`` (:meth:`Simulation.cohort`:
  numpy packing on the host, or the jitted gather on the device), ``transfer_s``
  (``jax.device_put`` of the cohort; the host path's copy, nearly nothing on the device)
  and ``compute_s`` (the round itself on on-device inputs);
* ``end_to_end_rounds_per_s``: what a user sees, rounds of :meth:`Simulation.rounds`
  (sampling, packing or gathering, the round, the device model, evaluation every
  ``eval_every`` rounds, the record), nothing synchronised beyond what the driver does.

Medians over R rounds, and the ratio device / host.  The JSON holds the device, versions
and settings; the default path is ``benchmarks/results/data-placement-<backend>-<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import jax

from benchmarks.strategies import device_info, log
from fedpartial._src.experiment.config import RunConfig
from fedpartial._src.experiment.simulation import Simulation
from fedpartial._src.bench.provenance import stamp

#: name -> (description, RunConfig fields); evaluation every round, as ``fedpartial run`` does by default
CASES = {
    "digits": ("digits / cnn2c1f, the quick start (N=20, K=10, 2 local epochs of batch 16)", dict()),
    "synthetic": ("synthetic / mlp, N=100, K=20, 10 local steps of batch 32",
                  dict(dataset="synthetic", num_clients=100, cohort_size=20, local_steps=10, batch_size=32)),
    "mnist5k": ("mnist5k / cnn2c1f (28x28 conv), N=100, K=20, 10 local steps of batch 32",
                dict(dataset="mnist5k", num_clients=100, cohort_size=20, local_steps=10, batch_size=32)),
}
QUICK = {"tiny": ("digits / mlp, N=6, K=3, 2 local steps of batch 8",
                  dict(model="mlp", num_clients=6, cohort_size=3, local_steps=2, batch_size=8))}
PLACEMENTS = ("host", "device")
PHASES = ("sample_s", "prepare_s", "transfer_s", "compute_s")


def build(fields: dict, placement: str, rounds: int) -> Simulation:
    return Simulation(RunConfig(**fields, rounds=rounds, out_dir=None, data_placement=placement))


def split_round(sim: Simulation, t: int) -> dict:
    """One round of ``sim``, each phase timed to completion; ``sim.state`` advances."""
    times = {}
    start = time.perf_counter()
    ids, valid, key, seed = sim.sample_cohort(t)
    times["sample_s"] = time.perf_counter() - start
    start = time.perf_counter()
    cohort = jax.block_until_ready(sim.cohort(ids, seed, valid))
    times["prepare_s"] = time.perf_counter() - start
    start = time.perf_counter()
    cohort = jax.block_until_ready(jax.device_put(cohort))
    times["transfer_s"] = time.perf_counter() - start
    start = time.perf_counter()
    sim.state, metrics = sim.round(sim.state, cohort, key)
    jax.block_until_ready((sim.state, metrics))
    times["compute_s"] = time.perf_counter() - start
    return times


def measure_case(name: str, description: str, fields: dict, rounds: int) -> dict:
    log(f"{name}: building host and device simulations")
    sims = {p: build(fields, p, 2 * rounds + 2) for p in PLACEMENTS}
    entry = {"case": name, "description": description, "config": fields, "rounds": rounds,
             "data_bytes": sims["device"].data_bytes, "num_steps": sims["device"].num_steps}
    for sim in sims.values():  # compile the round, the gather, the cost model and evaluation
        split_round(sim, 0)
    split = {p: [] for p in PLACEMENTS}
    for t in range(1, rounds + 1):  # alternate, so that a load change hits both
        for p in PLACEMENTS:
            split[p].append(split_round(sims[p], t))
    gens = {p: sims[p].rounds() for p in PLACEMENTS}
    for gen in gens.values():
        next(gen)  # warm-up: the first record (evaluation and the device model compile)
    e2e = {p: [] for p in PLACEMENTS}
    for _ in range(rounds):
        for p in PLACEMENTS:
            start = time.perf_counter()
            next(gens[p])
            e2e[p].append(time.perf_counter() - start)
    for p in PLACEMENTS:
        rows = split[p]
        med = {phase: statistics.median(r[phase] for r in rows) for phase in PHASES}
        entry[p] = {**{f"{k}_median": v for k, v in med.items()},
                    "split_total_s_median": statistics.median(sum(r.values()) for r in rows),
                    "end_to_end_round_s_median": statistics.median(e2e[p]),
                    "end_to_end_rounds_per_s": len(e2e[p]) / sum(e2e[p]),
                    "split_rounds": rows, "end_to_end_round_s": e2e[p]}
    entry["device_over_host_end_to_end_rounds_per_s"] = (entry["device"]["end_to_end_rounds_per_s"]
                                                         / entry["host"]["end_to_end_rounds_per_s"])
    log(table_rows(entry))
    return entry


def table_rows(entry: dict) -> str:
    lines = []
    for p in PLACEMENTS:
        e = entry[p]
        ms = "  ".join(f"{k[:-2]} {1e3 * e[k + '_median']:8.2f} ms" for k in PHASES)
        lines.append(f"{entry['case']:10s} {p:6s} {ms}  end-to-end {e['end_to_end_rounds_per_s']:7.2f} rounds/s")
    lines.append(f"{entry['case']:10s} device/host end-to-end rounds/s: "
                 f"{entry['device_over_host_end_to_end_rounds_per_s']:.2f}x")
    return "\n".join(lines)


def default_out(device: dict) -> str:
    day = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    return os.path.join(os.path.dirname(__file__), "results", f"data-placement-{device['backend']}-{day}.json")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one tiny case, one round (a smoke test)")
    p.add_argument("--rounds", type=int, default=None, help="measured rounds per placement (default 10; quick 1)")
    p.add_argument("--cases", default=None, help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/data-placement-...json)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    cases = QUICK if args.quick else CASES
    if args.cases:
        unknown = [c for c in args.cases.split(",") if c not in CASES]
        if unknown:
            log(f"--cases {','.join(unknown)} is unknown; choose among {', '.join(CASES)}.")
            return 2
        cases = {c: CASES[c] for c in args.cases.split(",")}
    rounds = args.rounds or (1 if args.quick else 10)
    device = device_info()
    out = args.out or default_out(device)
    report = {"benchmark": "data_placement", "device": device, "rounds": rounds,
              "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "argv": sys.argv[1:] if argv is None else list(argv), "cases": []}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    for name, (description, fields) in cases.items():
        report["cases"].append(measure_case(name, description, fields, rounds))
        report["complete"] = len(report["cases"]) == len(cases)
        with open(out, "w") as f:  # after every case, so that a cut-off run keeps what it measured
            json.dump(stamp(report), f, indent=2)
    print("\n".join(table_rows(e) for e in report["cases"]))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
