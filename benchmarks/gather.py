"""The on-device gather's cost per round, with and without one very large client in the population.

Usage::

    python -m benchmarks.gather [--quick] [--out PATH] [--cohort K] [--large N]

A population of 1,000 clients with 20–400 examples each (60 float32 features) is placed
on the device (:func:`fedpartial._src.data.ondevice.place`); each round gathers a cohort of K
clients, 10 local steps of 32 (:func:`fedpartial._src.data.ondevice.gather_round`, jitted).
The same cohort is timed on the population as it is and with client 0 grown to ``--large``
examples: the gather's work should not depend on the largest client (the earlier sort of
every client's whole stream took 4.7 s a round with a 20,000-example client against
0.15 s without, K = 1,000, on the 2-core CPU).  Median of the timed rounds, and the ratio.
The JSON holds the device, versions and settings (default
``benchmarks/results/gather-<backend>-<date>.json``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

import jax
import numpy as np

from benchmarks.strategies import device_info, log
from fedpartial._src.data import ondevice
from fedpartial._src.bench.provenance import stamp

CLIENTS, FEATURES, STEPS, BATCH = 1000, 60, 10, 32


def population(large: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(20, 400, CLIENTS)
    sizes[0] = max(sizes[0], large)
    total = int(sizes.sum())
    x = rng.normal(size=(total, FEATURES)).astype(np.float32)
    y = rng.integers(0, 10, total)
    return x, y, np.split(np.arange(total), np.cumsum(sizes)[:-1])


def time_gather(large: int, cohort: int, rounds: int) -> dict:
    spec = ondevice.gather_spec(batch_size=BATCH, num_steps=STEPS, local_steps=STEPS)
    x, y, clients = population(large)
    pop = ondevice.place(x, y, clients, spec)
    ids = np.sort(np.random.default_rng(1).choice(CLIENTS, cohort, replace=False)).astype(np.int32)
    ids[0] = 0  # the large client (when there is one) is in the cohort
    ids = np.sort(ids)
    valid = np.ones(cohort, bool)
    jax.block_until_ready(ondevice.gather_round(pop, None, ids, valid, np.uint32(0), spec=spec))  # compile
    times = []
    for r in range(rounds):
        start = time.perf_counter()
        jax.block_until_ready(ondevice.gather_round(pop, None, ids, valid, np.uint32(r + 1), spec=spec))
        times.append(time.perf_counter() - start)
    return {"largest_client": int(max(len(c) for c in clients)), "median_s": statistics.median(times),
            "times_s": times}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gather", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="K = 50, 3 rounds (a smoke test)")
    p.add_argument("--cohort", type=int, default=1000)
    p.add_argument("--large", type=int, default=20_000, help="examples of the one large client")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.cohort, args.rounds = 50, 3
    device = device_info()
    results = {case: time_gather(large, args.cohort, args.rounds)
               for case, large in (("as_is", 0), ("one_large_client", args.large))}
    ratio = results["one_large_client"]["median_s"] / results["as_is"]["median_s"]
    for case, r in results.items():
        log(f"{case:17s} largest client {r['largest_client']:6d}  gather {r['median_s'] * 1e3:8.2f} ms per round")
    log(f"with the large client / without: {ratio:.2f}x")
    report = {"benchmark": "gather", "device": device, "date": datetime.date.today().isoformat(),
              "config": {**vars(args), "clients": CLIENTS, "features": FEATURES, "local_steps": STEPS,
                         "batch_size": BATCH}, "results": results, "large_over_as_is": ratio}
    out = args.out or os.path.join("benchmarks", "results",
                                   f"gather-{device['backend']}-{datetime.date.today().isoformat()}.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(stamp(report), f, indent=2)
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
