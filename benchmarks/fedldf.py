"""Reproduction of FedLDF's comparison (paper Figs. 3–4 / Table II) on data that runs offline.

Protocol (docs/decisions.md#fedldf): N=50 clients, K=20 per round, n=4 uploads per layer, one local
pass; IID equal-size clients and Dirichlet α=1; FedAvg / FedLDF / Random / HDFL /
FedADP from the same seeds, partitions and cohorts (the cohort sequence depends
only on the seed).

Usage::

    python -m benchmarks.fedldf [--quick] [--datasets digits,mnist5k,synthetic,cifar10]
        [--methods fedavg,fedldf,...] [--rounds R] [--seeds 0,1] [--out DIR] [--data-dir DIR]

Writes ``<out>/fedldf-<device>.json`` (every round of every run), a plot of test
error against cumulative upload traffic (log scale) and prints a table: final
error per method, the gap to FedAvg, and the upload traffic saved at equal error
(the cumulative upload each method needs to first reach the error FedAvg ends at,
relative to FedAvg's).  Datasets that are not prepared locally (tfds) are skipped
with a note.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import jax
import numpy as np

from benchmarks import device_slug, figure_style
from fedpartial._src.bench.provenance import stamp
from fedpartial._src.data.sources import DataError
from fedpartial._src.experiment.config import RunConfig
from fedpartial._src.experiment.simulation import Simulation

METHODS = ("fedavg", "fedldf", "random", "hdfl", "fedadp")
LABELS = {"fedavg": "FedAvg", "fedldf": "FedLDF", "random": "Random", "hdfl": "HDFL", "fedadp": "FedADP"}

# dataset -> (model, local batch size, client lr, momentum, local steps (None: one epoch),
#             settings [(name, partition, alpha)])
# Synthetic clients hold 42..2,734 examples: one epoch would give the largest 274 steps,
# and averaging only n=4 such drifted models diverges, so it runs FedProx's setting
# (lr 0.01, no momentum) with a fixed number of local steps.
# mnist5k (5,000 real 28x28 MNIST digits, 80 training images per client at N=50): LeNet-5, whose
# five layers (2 conv + 3 dense) give the per-layer selection more to choose than the 3-layer
# cnn2c1f of digits; batch 16 (5 steps per local pass), the digits lr and momentum.
SETUPS = {
    "digits": ("cnn2c1f", 8, 0.05, 0.9, None, [("iid", "iid", None), ("dirichlet1", "dirichlet", 1.0)]),
    "mnist5k": ("lenet5", 16, 0.05, 0.9, None, [("iid", "iid", None), ("dirichlet1", "dirichlet", 1.0)]),
    "synthetic": ("mlp", 10, 0.01, 0.0, 20, [("synthetic(1,1)", "natural", 1.0)]),
    "cifar10": ("vgg9", 32, 0.02, 0.9, None, [("iid", "iid", None), ("dirichlet1", "dirichlet", 1.0)]),
}


def run_one(dataset: str, setting: tuple, method: str, seed: int, rounds: int, args) -> dict:
    model, batch, lr, momentum, steps, _ = SETUPS[dataset]
    name, partition, alpha = setting
    config = RunConfig(
        method=method, dataset=dataset, data_dir=args.data_dir, model=model, partition=partition,
        alpha=alpha if alpha is not None else 1.0, num_clients=args.clients, cohort_size=args.cohort,
        rounds=rounds, local_epochs=None if steps else 1.0, local_steps=steps, batch_size=batch, client_lr=lr,
        momentum=momentum,
        seed=seed, eval_every=args.eval_every, out_dir=None,
        options={"n": args.n} if method in ("fedldf", "random", "hdfl") else {},
    )
    sim = Simulation(config)
    records = list(sim.rounds())
    return {"dataset": dataset, "setting": name, "method": method, "seed": seed, "model": sim.model.name,
            "num_params": sim.num_params, "records": records}


def curve(run: dict) -> tuple[np.ndarray, np.ndarray]:
    evaluated = [r for r in run["records"] if "test_accuracy" in r]
    traffic = np.array([r["cumulative_upload_bytes"] for r in evaluated], float)
    error = np.array([1.0 - r["test_accuracy"] for r in evaluated])
    return traffic, error


def traffic_to_reach(run: dict, target_error: float) -> float:
    traffic, error = curve(run)
    hit = np.flatnonzero(error <= target_error + 1e-12)
    return float(traffic[hit[0]]) if hit.size else math.inf


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (dataset, setting, method), averaged over seeds."""
    rows = []
    groups = sorted({(r["dataset"], r["setting"]) for r in runs})
    for dataset, setting in groups:
        group = [r for r in runs if r["dataset"] == dataset and r["setting"] == setting]
        seeds = sorted({r["seed"] for r in group})
        by = {(r["method"], r["seed"]): r for r in group}
        # FedAvg's final error (mean of the last 3 evaluations) is the "equal error" target.
        final = {m: np.mean([np.mean(curve(by[m, s])[1][-3:]) for s in seeds]) for m in METHODS if (m, seeds[0]) in by}
        totals = {m: np.mean([curve(by[m, s])[0][-1] for s in seeds]) for m in final}
        for m in final:
            reach = [traffic_to_reach(by[m, s], np.mean(curve(by["fedavg", s])[1][-3:])) for s in seeds]
            base = [traffic_to_reach(by["fedavg", s], np.mean(curve(by["fedavg", s])[1][-3:])) for s in seeds]
            saved = [1 - a / b if math.isfinite(a) and b > 0 else None for a, b in zip(reach, base)]
            rows.append({
                "dataset": dataset, "setting": setting, "method": m, "seeds": seeds,
                "final_error": float(final[m]), "gap_to_fedavg": float(final[m] - final["fedavg"]),
                "total_upload_mb": float(totals[m] / 1e6),
                "upload_vs_fedavg": float(totals[m] / totals["fedavg"]),
                "traffic_saved_at_fedavg_error": (float(np.mean(saved)) if all(s is not None for s in saved)
                                                  else None),
            })
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'dataset':<10} {'setting':<15} {'method':<7} {'final err':>9} {'gap':>7} "
             f"{'upload MB':>10} {'vs FedAvg':>9} {'saved@err':>9}"]
    for r in rows:
        saved = r["traffic_saved_at_fedavg_error"]
        lines.append(
            f"{r['dataset']:<10} {r['setting']:<15} {LABELS[r['method']]:<7} {r['final_error']:>9.4f} "
            f"{r['gap_to_fedavg']:>+7.4f} {r['total_upload_mb']:>10.1f} {r['upload_vs_fedavg']:>9.3f} "
            f"{'never' if saved is None else f'{saved:.1%}':>9}"
        )
    return "\n".join(lines)


def plot(runs: list[dict], path: str) -> None:
    """Test error against cumulative upload (log scale), a panel per (dataset, setting), one legend under them."""
    groups = sorted({(r["dataset"], r["setting"]) for r in runs})
    fig, axes = figure_style.figure(len(groups))
    for ax, (dataset, setting) in zip(axes, groups):
        for m in METHODS:
            mine = [r for r in runs if (r["dataset"], r["setting"], r["method"]) == (dataset, setting, m)]
            if not mine:
                continue
            traffic, error = curve(mine[0])
            ax.plot(traffic / 1e6, error, label=LABELS[m], color=figure_style.colour(m),
                    lw=2.2 if m == "fedldf" else 1.6)
        ax.set_xscale("log")
        ax.set_xlabel("cumulative upload (MB)")
        ax.set_ylabel("test error")
        ax.set_title(f"{dataset}, {setting}")
        ax.grid(True, which="both", alpha=0.3)
    figure_style.shared_legend(fig, axes)
    figure_style.save(fig, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fedldf", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="digits IID only, 2 rounds, N=10, K=5, n=2 (a smoke test)")
    p.add_argument("--datasets", default=None, help="default digits,mnist5k,synthetic,cifar10 (--quick: digits)")
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"comma-separated, fedavg (the reference) among them (default {','.join(METHODS)})")
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--seeds", default="0")
    p.add_argument("--clients", type=int, default=50)
    p.add_argument("--cohort", type=int, default=20)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--eval-every", type=int, default=2)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    if args.quick:
        args.datasets, args.rounds, args.clients, args.cohort, args.n, args.eval_every = (
            args.datasets or "digits", 2, 10, 5, 2, 1)
    args.datasets = args.datasets or "digits,mnist5k,synthetic,cifar10"
    methods = [m for m in METHODS if m in args.methods.split(",")]
    if "fedavg" not in methods or len(methods) != len(set(args.methods.split(","))):
        p.error(f"--methods {args.methods!r}: choose from {', '.join(METHODS)}, fedavg among them")
    seeds = [int(s) for s in args.seeds.split(",")]
    os.makedirs(args.out, exist_ok=True)
    runs, notes, t0 = [], [], time.perf_counter()
    for dataset in args.datasets.split(","):
        if dataset not in SETUPS:
            p.error(f"dataset {dataset!r} has no FedLDF setup; choose from {', '.join(SETUPS)}")
        try:
            settings = SETUPS[dataset][-1][:1] if args.quick else SETUPS[dataset][-1]
            for setting in settings:
                for seed in seeds:
                    for method in methods:
                        start = time.perf_counter()
                        run = run_one(dataset, setting, method, seed, args.rounds, args)
                        run["time_s"] = time.perf_counter() - start
                        runs.append(run)
                        last = run["records"][-1]
                        print(f"{dataset:<10} {setting[0]:<15} seed {seed} {LABELS[method]:<7} "
                              f"acc {last.get('test_accuracy', float('nan')):.4f} upload "
                              f"{last['cumulative_upload_bytes'] / 1e6:8.1f} MB  {run['time_s']:.1f}s", flush=True)
        except DataError as e:  # a tfds dataset not prepared here
            notes.append(f"{dataset}: skipped ({e})")
            print(notes[-1], file=sys.stderr)
    rows = summarize(runs) if runs else []
    print()
    print(table(rows))
    slug = device_slug() + ("-quick" if args.quick else "")
    result = {
        "benchmark": "fedldf", "device": {"platform": jax.devices()[0].platform,
                                          "device_kind": jax.devices()[0].device_kind,
                                          "jax_version": jax.__version__},
        "protocol": {k: v for k, v in vars(args).items()}, "notes": notes, "summary": rows,
        "runs": runs, "total_time_s": time.perf_counter() - t0,
    }
    json_path = os.path.join(args.out, f"fedldf-{slug}.json")
    with open(json_path, "w") as f:
        json.dump(stamp(result), f)
    if runs:
        plot(runs, os.path.join(args.out, f"fedldf-{slug}.png"))
    print(f"\nwrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
