"""Peak memory of many seeds in one run (``fedpartial run --seeds``) against its estimate, per replica axis.

Usage::

    python -m benchmarks.replica_memory [--quick] [--out PATH] [--clients N] [--seeds 0,1,2,3]
        [--axes vmap,map,map:2,map:3]

FedSPU on the Synthetic MLP keeps N personal models per replica on the device (replicas always do), so
the replicas' server state dominates: N = 5,000 is 1.1 GB a replica.  Each replica axis runs in its own
process (so ``ru_maxrss`` is its own peak): :class:`fedpartial._src.experiment.replicas.Replicas` is built and runs
``--rounds`` rounds; recorded are :func:`fedpartial._src.core.memory.for_replicas`'s estimate (what the check
before building compares with the available memory), the stacked state's bytes, and peak RSS after the
build and after each round; on an accelerator also the device's peak memory (``peak_bytes_in_use``), which
is then what the estimate is compared with.  JSON with the device and versions goes to
``benchmarks/results/replica-memory-<backend>-<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from fedpartial._src.bench.provenance import stamp

COMMON = dict(method="fedspu", dataset="synthetic", cohort_size=50, local_steps=2, batch_size=16, max_samples=20,
              out_dir=None)


def _device_peak() -> int | None:
    """The accelerator's peak bytes in use so far (None on CPU, where the device's memory is the RSS)."""
    import jax

    device = jax.devices()[0]
    return None if device.platform == "cpu" else (device.memory_stats() or {}).get("peak_bytes_in_use")


def worker(axis: str, clients: int, seeds: list[int], rounds: int) -> dict:
    """One replica axis in this process: the estimate, the stacked state and peak RSS."""
    from benchmarks.scale import _rss
    from fedpartial._src.core import memory
    from fedpartial._src.experiment import replica_axis, replicas
    from fedpartial._src.experiment.config import RunConfig

    config = RunConfig(**COMMON, num_clients=clients, rounds=rounds, eval_every=rounds + 1)
    start = _rss()
    t0 = time.perf_counter()
    reps = replicas.Replicas(config, seeds, replica_axis=axis)
    build_s = time.perf_counter() - t0
    est = max((sim.memory for sim in reps.sims), key=lambda e: e.total)
    need = memory.for_replicas(est, len(seeds), replica_axis.at_once(reps.replica_axis, len(seeds)))
    out = {"axis": axis, "axis_used": list(reps.replica_axis), "estimate_bytes": need.total,
           "estimate": need._asdict(), "one_replica_estimate": est._asdict(),
           "stacked_state_bytes": memory.tree_bytes(reps.state), "rss_start": start, "build_s": build_s,
           "rss_after_build": _rss(), "rss_after_round": [], "round_s": [],
           "device_peak_after_build": _device_peak(), "device_peak_after_round": []}
    active, last = [True] * len(seeds), [None] * len(seeds)
    for t in range(rounds):
        t0 = time.perf_counter()
        reps.run_round(t, active, last)
        out["round_s"].append(time.perf_counter() - t0)
        out["rss_after_round"].append(_rss())
        out["device_peak_after_round"].append(_device_peak())
    peak = out["device_peak_after_round"][-1] or out["rss_after_round"][-1]
    out["peak_over_estimate"] = peak / need.total
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="60 clients, 2 seeds, 1 round, vmap and map (a smoke run)")
    p.add_argument("--clients", type=int, default=5000)
    p.add_argument("--seeds", default="0,1,2,3")
    p.add_argument("--axes", default="vmap,map,map:2,map:3")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", help="JSON path (default benchmarks/results/replica-memory-<backend>-<date>.json)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.clients, args.seeds, args.axes, args.rounds = 60, "0,1", "vmap,map", 1
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.worker:
        print(json.dumps(worker(args.worker, args.clients, seeds, args.rounds)), flush=True)
        return 0
    import jax

    from benchmarks.strategies import device_info, log

    device = device_info()
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"replica-memory-{jax.default_backend()}-{datetime.date.today()}.json")
    results = []
    for axis in args.axes.split(","):
        proc = subprocess.run([sys.executable, "-m", "benchmarks.replica_memory", "--worker", axis, "--clients",
                               str(args.clients), "--seeds", args.seeds, "--rounds", str(args.rounds)],
                              capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        results.append({"axis": axis, "error": proc.stderr[-2000:]} if proc.returncode else
                       json.loads(proc.stdout.strip().splitlines()[-1]))
        r = results[-1]
        log(f"{axis}: " + (r["error"][-300:] if "error" in r else
                           f"estimate {r['estimate_bytes'] / 2**30:.2f} GiB, peak RSS after build "
                           f"{r['rss_after_build'] / 2**30:.2f}, after the rounds "
                           + ", ".join(f"{b / 2**30:.2f}" for b in r["rss_after_round"]) + " GiB"
                           + ("" if r["device_peak_after_round"][-1] is None else ", device peak " + ", ".join(
                               f"{b / 2**30:.2f}" for b in r["device_peak_after_round"]) + " GiB")))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        settings = {**COMMON, "clients": args.clients, "seeds": seeds, "rounds": args.rounds}
        json.dump(stamp({"benchmark": "replica_memory", "device": device, "settings": settings, "results": results}), f,
                  indent=2)
    log(f"wrote {out}")
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
