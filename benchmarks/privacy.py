"""DP-FedAvg vs FedAvg vs DP-FedLDF: test accuracy at a privacy budget ε ∈ {1, 4, 8} (issue 36).

Protocol (mnist5k, offline: 4,000 training images of real MNIST digits): N = 1,000 clients with 4 images
each (IID), K = 100 sampled per round without replacement, T = 50 rounds, 2 local epochs of batches of 2
(plain SGD, lr 0.05), a small CNN (conv 5x5 8 → conv 5x5 16 → dense; 11,274 parameters: DP noise grows with
the parameter count and shrinks with the cohort, so the model is kept small for a population of 1,000).
δ = 1/N.  For each ε the noise multiplier ``z`` is calibrated with dp-accounting for T rounds of K of N
without replacement (replace-one, :mod:`fedpartial._src.methods.privacy.accountant`), and every private run
reports the ε it reached.

* FedAvg and FedLDF (n = 20 of K = 100 clients upload each layer: 20% of FedAvg's traffic) without privacy;
* DP-FedAvg: each client's update clipped to C = 0.3 (flat), noise z·C on the sum, / 100;
* DP-FedLDF: the same budget; per-layer clipping (C/√3 a layer), which keeps the sensitivity at 2C even though
  the top-n selection reads other clients' divergences (docs/privacy.md), noise / 20 per layer.

Usage::

    python -m benchmarks.privacy [--quick] [--rounds T] [--seeds 0,1] [--epsilons 1,4,8] [--out DIR]

Writes ``<out>/privacy-<device>.json`` (every round of every run, the calibrated z) and a plot of final
accuracy against ε, and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import numpy as np

from benchmarks import device_slug, figure_style
from fedpartial._src.experiment.config import RunConfig
from fedpartial._src.experiment.simulation import Simulation
from fedpartial._src.methods.privacy.accountant import noise_multiplier_for
from fedpartial._src.models import zoo
from fedpartial.models import from_linen
from fedpartial._src.bench.provenance import stamp

#: (row name, method, private, per-layer clipping)
VARIANTS = (("FedAvg", "fedavg", False, False), ("FedLDF", "fedldf", False, False),
            ("DP-FedAvg", "fedavg", True, False), ("DP-FedLDF", "fedldf", True, True))


def small_cnn(input_shape):
    return from_linen(zoo.CNN2C1F(num_classes=10, features=(8, 16)), input_shape=input_shape, num_classes=10,
                      sequential=True, name="cnn2c1f-8x16")


def run_one(args, variant, seed: int, z: float | None) -> dict:
    name, method, private, per_layer = variant
    config = RunConfig(
        method=method, dataset=args.dataset, model="cnn2c1f", partition="iid", num_clients=args.clients,
        cohort_size=args.cohort, rounds=args.rounds, local_epochs=args.local_epochs, batch_size=2, client_lr=0.05,
        momentum=0.0,
        eval_every=args.eval_every, out_dir=None, seed=seed,
        options={"n": args.n} if method == "fedldf" else {},
        **(dict(dp_clip=args.clip, dp_noise_multiplier=z, dp_clip_per_layer=per_layer) if private else {}))
    start = time.perf_counter()
    sim = Simulation(config, model=small_cnn((8, 8, 1) if args.dataset == "digits" else (28, 28, 1)))
    records = list(sim.rounds())
    return {"variant": name, "method": method, "seed": seed, "noise_multiplier": z, "records": records,
            "num_params": sim.num_params, "time_s": time.perf_counter() - start}


def final_accuracy(run: dict) -> float:
    """The mean test accuracy of the last three evaluations (one evaluation is noisy)."""
    accs = [r["test_accuracy"] for r in run["records"] if "test_accuracy" in r]
    return float(np.mean(accs[-3:]))


def summarize(runs: list[dict], epsilons: list[float]) -> list[dict]:
    rows = []
    for name, *_ in VARIANTS:
        for eps in ([None] if not name.startswith("DP") else epsilons):
            mine = [r for r in runs if r["variant"] == name and r.get("target_epsilon") == eps]
            if not mine:
                continue
            last = [r["records"][-1] for r in mine]
            rows.append({"variant": name, "target_epsilon": eps, "seeds": [r["seed"] for r in mine],
                         "noise_multiplier": mine[0]["noise_multiplier"],
                         "final_accuracy": float(np.mean([final_accuracy(r) for r in mine])),
                         "final_accuracy_std": float(np.std([final_accuracy(r) for r in mine])),
                         "reached_epsilon": last[0].get("dp_epsilon"),
                         "upload_mb": float(np.mean([x["cumulative_upload_bytes"] for x in last]) / 1e6)})
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'variant':<10} {'ε target':>8} {'z':>7} {'ε reached':>9} {'accuracy':>15} {'upload MB':>9}"]
    for r in rows:
        eps = "∞" if r["target_epsilon"] is None else f"{r['target_epsilon']:g}"
        z = "–" if r["noise_multiplier"] is None else f"{r['noise_multiplier']:.3f}"
        reached = "–" if r["reached_epsilon"] is None else f"{r['reached_epsilon']:.3f}"
        lines.append(f"{r['variant']:<10} {eps:>8} {z:>7} {reached:>9} "
                     f"{r['final_accuracy']:>8.4f} ± {r['final_accuracy_std']:.4f} {r['upload_mb']:>9.1f}")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    """Final test accuracy (mean ± std over seeds) against ε for DP-FedAvg and DP-FedLDF, each over a dashed
    line at its method's accuracy without privacy."""
    fig, (ax,) = figure_style.figure(1, height=4.0)
    for name in ("FedAvg", "FedLDF"):
        color = figure_style.colour(name)
        base = [r for r in rows if r["variant"] == name]
        if base:
            ax.axhline(base[0]["final_accuracy"], color=color, linestyle="--", label=f"{name} (no privacy)")
        dp = [r for r in rows if r["variant"] == f"DP-{name}"]
        if dp:
            ax.errorbar([r["target_epsilon"] for r in dp], [r["final_accuracy"] for r in dp],
                        yerr=[r["final_accuracy_std"] for r in dp], color=color, marker="o", capsize=3,
                        label=f"DP-{name}")
    ax.set_xlabel("ε (δ = 1/N)")
    ax.set_ylabel("test accuracy\n(mean of the last 3 evaluations)")
    ax.grid(True, alpha=0.3)
    figure_style.shared_legend(fig, [ax], columns=2)
    figure_style.save(fig, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.privacy", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="digits, N=20, K=10, n=2, 2 rounds of 0.25 local epochs, ε 8, without non-private FedLDF "
                        "(a smoke test)")
    p.add_argument("--dataset", default="mnist5k")
    p.add_argument("--rounds", type=int, default=50)
    p.add_argument("--seeds", default="0")
    p.add_argument("--epsilons", default="1,4,8")
    p.add_argument("--clients", type=int, default=1000)
    p.add_argument("--cohort", type=int, default=100)
    p.add_argument("--n", type=int, default=20, help="FedLDF: clients uploading each layer")
    p.add_argument("--clip", type=float, default=0.3, help="the clipping norm C")
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--local-epochs", type=float, default=2.0)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    if args.quick:
        args.dataset, args.rounds, args.clients, args.cohort, args.n, args.eval_every, args.epsilons = (
            "digits", 2, 20, 10, 2, 1, "8")
        args.local_epochs = 0.25  # a few steps: the smoke test checks the protocol, not what training reaches
    variants = [v for v in VARIANTS if not (args.quick and v[0] == "FedLDF")]
    epsilons = [float(e) for e in args.epsilons.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    delta = 1 / args.clients
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    noise = {eps: noise_multiplier_for(eps, delta, args.rounds, args.clients, args.cohort, tol=1e-3 if not args.quick
                                       else 1e-2) for eps in epsilons}
    print("noise multipliers: " + ", ".join(f"ε={e:g}: z={z:.3f}" for e, z in noise.items()), flush=True)
    runs = []
    for seed in seeds:
        for variant in variants:
            for eps in (epsilons if variant[2] else [None]):
                run = run_one(args, variant, seed, None if eps is None else noise[eps])
                run["target_epsilon"] = eps
                runs.append(run)
                last = run["records"][-1]
                print(f"seed {seed} {variant[0]:<10} ε {'∞' if eps is None else f'{eps:g}':>3}  acc "
                      f"{final_accuracy(run):.4f}  ε reached {last.get('dp_epsilon', float('nan')):.3f}  "
                      f"{run['time_s']:.1f}s", flush=True)
    rows = summarize(runs, epsilons)
    print()
    print(table(rows))
    slug = device_slug() + ("-quick" if args.quick else "")
    device = jax.devices()[0]
    result = {"benchmark": "privacy", "device": {"platform": device.platform, "device_kind": device.device_kind,
                                                 "jax_version": jax.__version__},
              "protocol": {**vars(args), "delta": delta, "sampling": "K of N without replacement (replace-one)"},
              "noise_multipliers": {str(e): z for e, z in noise.items()}, "summary": rows, "runs": runs,
              "total_time_s": time.perf_counter() - t0}
    json_path = os.path.join(args.out, f"privacy-{slug}.json")
    with open(json_path, "w") as f:
        json.dump(stamp(result), f)
    plot(rows, os.path.join(args.out, f"privacy-{slug}.png"))
    print(f"\nwrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
