"""Bounded memory at scale: big cohorts and big populations of the Synthetic MLP, with peak RSS.

Each case runs in its own subprocess (so ``ru_maxrss`` is its own peak): the dataset is
generated once per case, then each method runs a :class:`fedpartial._src.experiment.simulation.Simulation`
on it for a few rounds.  Recorded per run: seconds to generate the data and to build the
simulation, seconds per round, the memory estimate of :mod:`fedpartial._src.core.memory` (and
whether the check would refuse the run), and peak RSS before and after.

    python benchmarks/scale.py                       # both default cases
    python benchmarks/scale.py --cases cohort-10k    # one of them

Writes ``benchmarks/results/scale-<backend>-<device>.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import time
from fedpartial._src.bench.provenance import stamp

CASES = {
    # A 10,000-client cohort (every client of the population every round), streamed 1,000 at a time.
    "cohort-10k": dict(num_clients=10_000, cohort_size=10_000, strategy="stream:1000", rounds=2),
    # A 1,000,000-client population (≤ 10 examples each), 1,000-client cohorts.
    "population-1m": dict(num_clients=1_000_000, cohort_size=1_000, strategy="stream:1000", rounds=2,
                          max_samples=10),
    # FedSPU's personal models: 10,000 of them (2.2 GB) on the device, in RAM and on disk, side by side.
    "fedspu-10k": dict(num_clients=10_000, cohort_size=100, strategy="auto", rounds=3, max_samples=10,
                       variants=[dict(method="fedspu", client_state=w) for w in ("device", "host", "disk")]),
    # 100,000 personal models (21.8 GB): more than this machine's RAM, so on disk (auto chooses it).
    "fedspu-100k": dict(num_clients=100_000, cohort_size=100, strategy="auto", rounds=3, max_samples=10,
                        variants=[dict(method="fedspu", client_state="auto")]),
}
COMMON = dict(dataset="synthetic", model="mlp", local_steps=10, batch_size=32, out_dir=None, alpha=1.0)
METHODS = ("fedavg", "fedldf")


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _status_bytes(field: str) -> int | None:
    """A ``/proc/self/status`` size now (``RssAnon``: private memory; ``RssFile``: mapped file pages, which
    the kernel may drop or write back), in bytes; None where unknown."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def worker(case: str, methods: tuple[str, ...], variant: int | None = None) -> dict:
    """Runs one case (or one of its variants) in this process; returns its measurements."""
    from fedpartial._src.engine.strategy import stream_refusal
    from fedpartial._src.core import memory
    from fedpartial._src.experiment import simulation
    from fedpartial._src.experiment.config import RunConfig
    from fedpartial._src.data import sources

    settings = {**COMMON, **CASES[case]}
    variants = settings.pop("variants", None)
    variants = [dict(method=m) for m in methods] if variants is None else [variants[variant or 0]]
    base = RunConfig(**settings, eval_every=settings["rounds"])
    out = {"case": case, "settings": settings, "rss_start": _rss(), "runs": []}
    t0 = time.perf_counter()
    options = dict(alpha=base.alpha, beta=base.alpha, num_clients=base.num_clients)
    if base.max_samples is not None:
        options.update(max_samples=base.max_samples, min_samples=min(50, base.max_samples))
    dataset = sources.load_dataset("synthetic", seed=base.seed, **options)
    out["generate_s"] = time.perf_counter() - t0
    out["train_examples"] = int(len(dataset.y_train))
    out["dataset_bytes"] = int(dataset.x_train.nbytes + dataset.x_test.nbytes)
    out["rss_after_data"] = _rss()
    for variant in variants:
        config = dataclasses.replace(base, **variant)
        t0 = time.perf_counter()
        sim = simulation.Simulation(config, dataset, check_memory=False)
        build = time.perf_counter() - t0
        available, where = memory.available_bytes()
        # What the check before building would say with every client's state on the device.
        est = sim.memory
        # (the estimate already counts a host store on CPU, where the device's memory is the RAM)
        counted = sim.client_state == "device" or (sim.client_state == "host" and where == "RAM")
        off_device = 0 if counted else sim.personal_state_bytes
        on_device = est._replace(server=est.server + off_device)
        refusal = memory.refusal(on_device, available, where, strategy=str(sim.round.strategy),
                                 cohort_size=config.cohort_size,
                                 stream=sim.streamed_option if stream_refusal(sim.method) is None else None,
                                 movable_bytes=sim.personal_state_bytes if sim.method.capabilities.host_client_state else 0,
                                 move="--client-state disk") if available else None
        rss_built = _rss()
        records = list(sim.rounds())
        out["runs"].append({
            **variant, "client_state_used": sim.client_state, "personal_state_bytes": sim.personal_state_bytes,
            "build_s": build, "num_params": sim.num_params, "num_steps": sim.num_steps,
            "round_s": [r["round_time_s"] for r in records], "host_s": [r["host_time_s"] for r in records],
            "wall_s": [r["wall_time_s"] for r in records], "train_loss": [r["train_loss"] for r in records],
            "personal_accuracy": records[-1].get("personal_accuracy"),
            "test_accuracy": records[-1].get("test_accuracy"), "client_steps": records[-1]["client_steps"],
            "estimate_bytes": sim.memory.total, "estimate": sim.memory._asdict(), "available_bytes": available,
            "would_refuse": refusal, "device_estimate_bytes": on_device.total, "rss_after_build": rss_built,
            "peak_rss": _rss(), "rss_anon_end": _status_bytes("RssAnon"), "rss_file_end": _status_bytes("RssFile"),
        })
        del sim
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated: " + ", ".join(CASES))
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--out", help="JSON path (default benchmarks/results/scale-<backend>-<device>.json)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--variant", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    methods = tuple(m for m in args.methods.split(",") if m)
    if args.worker:
        print(json.dumps(worker(args.worker, methods, args.variant)), flush=True)
        return 0
    from benchmarks.strategies import default_out, device_info, log

    device = device_info()
    out = args.out or default_out(device).replace("strategies-", "scale-")
    results = []
    started = time.perf_counter()
    # a case with variants runs each in its own process (its own peak RSS); else every method in one
    jobs = [(c, i) for c in args.cases.split(",") if c for i in range(len(CASES[c].get("variants", [None])))]
    for case, variant in jobs:
        log(f"{case}: {CASES[case]}")
        proc = subprocess.run([sys.executable, "-m", "benchmarks.scale", "--worker", case, "--methods",
                               ",".join(methods), "--variant", str(variant)], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        if proc.returncode:
            results.append({"case": case, "error": proc.stderr[-2000:]})
        else:
            results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        log(json.dumps(results[-1])[:1500])
        report = {"benchmark": "scale", "device": device, "common": COMMON, "results": results,
                  "note": "2 CPU cores shared with other jobs while measured: seconds are noisy",
                  "total_time_s": time.perf_counter() - started}
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(stamp(report), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
