"""Time to accuracy under a round deadline, with and without client availability (issue 36).

Protocol (offline data): N clients (default 60, Dirichlet α 0.5), K a round (default 10), 1 local epoch of
batches of 16 (SGD, lr 0.05, momentum 0.9), the dataset's default model.  Devices are drawn log-normal
(compute median 5 GFLOP/s, σ 0.7; download 2.5 MB/s and upload 0.625 MB/s medians, σ 0.8: the defaults of
docs/costs.md) and **sorted by client id, fastest first**, so that the tiers the tiered methods assign by id
(strong, moderate, weak: equal thirds) are the fast, middling and slow devices, as those methods assume.

The deadline is the median over the population of a round of full-model work (FedAvg's time on each device,
``Simulation.full_model_times``): half the devices cannot finish FedAvg's round in time.  Straggler policy
``drop``.  Methods:

* FedAvg (every client the full model; the slow half never reports), and FedAvg without a deadline as the
  reference for the accuracy target;
* FedDHAD (per-device dropout targets from the same device times);
* EmbracingFL, HeteroFL and FedRolex with tier mix thirds (moderate and weak clients train less:
  an output-side suffix, or 7/16 and 3/16 of the width).

Each runs with every client always available, and with the diurnal model ``diurnal:0.05:0.6:P``, its period
``P`` = half the run's length at one deadline a round (two "days" a run, most clients away at night).
Time to accuracy is the simulated clock (round times and the waits for availability) at the first evaluation
reaching ``--target`` × the reference's best accuracy.

Usage::

    python -m benchmarks.deadlines [--quick] [--dataset digits] [--clients N] [--cohort K] [--rounds T]
        [--methods fedavg,feddhad,embracingfl,heterofl,fedrolex] [--target 0.9] [--seed 0] [--out DIR]

Writes ``<out>/deadlines-<device>.json`` (every evaluated round of every run) and a plot of accuracy against
the simulated clock, and prints the table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import tempfile
import time

import jax
import numpy as np

from benchmarks import device_slug, figure_style
from fedpartial._src.costs import devices
from fedpartial._src.experiment.config import RunConfig
from fedpartial._src.experiment.simulation import Simulation
from fedpartial._src.bench.provenance import stamp

METHODS = ("fedavg", "feddhad", "embracingfl", "heterofl", "fedrolex")
TIERED = ("embracingfl", "heterofl", "fedrolex")
KEPT = ("round", "test_accuracy", "simulated_time_s", "simulated_clock_s", "clients_sampled", "clients_finished",
        "wasted_flops", "wasted_bytes", "cumulative_upload_bytes")


def sorted_profiles(args, path: str) -> None:
    """The population's devices drawn with the run's seed, sorted fastest first by id, written to ``path``."""
    drawn = devices.sample_profiles(args.clients, args.seed)
    devices.save_profiles(path, devices.DeviceProfiles(*(np.sort(c)[::-1].copy() for c in drawn)))


def config(args, method: str, profiles: str, **timing) -> RunConfig:
    third = args.clients // 3
    options = {"tier_mix": (args.clients - 2 * third, third, third)} if method in TIERED else {}
    return RunConfig(method=method, dataset=args.dataset, model=args.model, partition="dirichlet", alpha=0.5,
                     num_clients=args.clients, cohort_size=args.cohort, rounds=args.rounds,
                     local_epochs=args.local_epochs, batch_size=16, client_lr=0.05, momentum=0.9,
                     eval_every=args.eval_every, out_dir=None, seed=args.seed, options=options,
                     device_profiles=profiles, **timing)


def run_one(cfg: RunConfig, setting: str) -> dict:
    start = time.perf_counter()
    sim = Simulation(cfg)
    records = [{k: r[k] for k in KEPT if k in r} for r in sim.rounds()]
    return {"method": cfg.method, "setting": setting, "records": records, "num_params": sim.num_params,
            "time_s": time.perf_counter() - start}


def evaluated(run: dict) -> list[dict]:
    return [r for r in run["records"] if r.get("test_accuracy") is not None]


def time_to(run: dict, target: float) -> float | None:
    """The simulated clock at the first evaluation reaching ``target`` (None: never)."""
    return next((r["simulated_clock_s"] for r in evaluated(run) if r["test_accuracy"] >= target), None)


def summarize(runs: list[dict], target: float) -> list[dict]:
    rows = []
    for run in runs:
        ev, recs = evaluated(run), run["records"]
        sampled = sum(r["clients_sampled"] for r in recs)
        rows.append({"method": run["method"], "setting": run["setting"],
                     "final_accuracy": float(np.mean([r["test_accuracy"] for r in ev[-3:]])),
                     "best_accuracy": max(r["test_accuracy"] for r in ev), "time_to_target_s": time_to(run, target),
                     "clock_s": recs[-1]["simulated_clock_s"],
                     "reported": sum(r["clients_finished"] for r in recs) / sampled if sampled else math.nan,
                     "wasted_gflops": sum(r["wasted_flops"] for r in recs) / 1e9,
                     "wasted_mb": sum(r["wasted_bytes"] for r in recs) / 1e6,
                     "upload_mb": recs[-1]["cumulative_upload_bytes"] / 1e6})
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'method':<12} {'setting':<24} {'final acc':>9} {'to target':>10} {'clock':>9} {'reported':>8} "
             f"{'wasted GFLOP':>12} {'wasted MB':>9}"]
    for r in rows:
        reach = "—" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.0f} s"
        lines.append(f"{r['method']:<12} {r['setting']:<24} {r['final_accuracy']:>9.4f} {reach:>10} "
                     f"{r['clock_s']:>7.0f} s {r['reported']:>8.0%} {r['wasted_gflops']:>12.2f} "
                     f"{r['wasted_mb']:>9.1f}")
    return "\n".join(lines)


def plot(runs: list[dict], settings: list[str], path: str) -> None:
    """Test accuracy against the simulated clock, a panel per setting, one legend under them; grey dashed:
    FedAvg without a deadline, the reference of every panel."""
    fig, axes = figure_style.figure(len(settings), height=3.8)
    ref = next(evaluated(r) for r in runs if r["setting"] == "no deadline")
    for ax, setting in zip(axes, settings):
        ax.plot([r["simulated_clock_s"] for r in ref], [r["test_accuracy"] for r in ref], color="#888888",
                linestyle="--", lw=2, label="fedavg, no deadline")
        for run in (r for r in runs if r["setting"] == setting):
            ev = evaluated(run)
            ax.plot([r["simulated_clock_s"] for r in ev], [r["test_accuracy"] for r in ev],
                    color=figure_style.colour(run["method"]), marker=".", label=run["method"])
        ax.set_title(setting)
        ax.set_xlabel("simulated clock (s)")
        ax.set_ylabel("test accuracy")
        ax.grid(True, alpha=0.3)
    figure_style.shared_legend(fig, axes, columns=3)
    figure_style.save(fig, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.deadlines", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="N=12, K=4, 2 rounds, the MLP, FedAvg alone (a smoke test)")
    p.add_argument("--dataset", default="digits")
    p.add_argument("--model", default="auto")
    p.add_argument("--clients", type=int, default=60)
    p.add_argument("--cohort", type=int, default=10)
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--local-epochs", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=3)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--target", type=float, default=0.9, help="the target, as a share of the reference's best")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    if args.quick:
        args.clients, args.cohort, args.rounds, args.eval_every, args.methods, args.model = (
            12, 4, 2, 1, "fedavg", "mlp")
    methods = args.methods.split(",")
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        profiles = os.path.join(tmp, "devices.csv")
        sorted_profiles(args, profiles)
        reference = Simulation(config(args, "fedavg", profiles))
        deadline = float(np.quantile(reference.full_model_times(), 0.5))
        period = args.rounds * deadline / 2
        availability = f"diurnal:0.05:0.6:{period:.6g}"
        print(f"deadline {deadline:.2f} s (the population's median full-model round); availability {availability}",
              flush=True)
        start = time.perf_counter()
        base = {"method": "fedavg", "setting": "no deadline", "num_params": reference.num_params,
                "records": [{k: r[k] for k in KEPT if k in r} for r in reference.rounds()]}
        base["time_s"] = time.perf_counter() - start
        runs = [base]
        settings = {"deadline": {}, "deadline + availability": {"availability": availability}}
        for setting, extra in settings.items():
            for method in methods:
                run = run_one(config(args, method, profiles, round_deadline=deadline, **extra), setting)
                runs.append(run)
                print(f"{setting:<24} {method:<12} best {max(r['test_accuracy'] for r in evaluated(run)):.4f} "
                      f"clock {run['records'][-1]['simulated_clock_s']:.0f} s  {run['time_s']:.1f}s", flush=True)
    target = args.target * max(r["test_accuracy"] for r in evaluated(base))
    rows = summarize(runs, target)
    print(f"\ntarget accuracy {target:.4f}\n" + table(rows))
    slug = device_slug() + ("-quick" if args.quick else "")
    device = jax.devices()[0]
    result = {"benchmark": "deadlines", "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "command": " ".join(["python -m benchmarks.deadlines", *(argv if argv is not None else sys.argv[1:])]),
              "device": {"platform": device.platform, "device_kind": device.device_kind, "cpu_count": os.cpu_count(),
                         "jax_version": jax.__version__},
              "protocol": {**vars(args), "deadline_s": deadline, "availability": availability,
                           "target_accuracy": target, "straggler_policy": "drop",
                           "devices": "default log-normal distributions, sorted fastest first by client id"},
              "summary": rows, "runs": runs, "total_time_s": time.perf_counter() - t0}
    json_path = os.path.join(args.out, f"deadlines-{slug}.json")
    with open(json_path, "w") as f:
        json.dump(stamp(result), f)
    plot(runs, ["deadline", "deadline + availability"], os.path.join(args.out, f"deadlines-{slug}.png"))
    print(f"\nwrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
