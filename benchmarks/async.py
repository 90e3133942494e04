"""Asynchronous against synchronous aggregation on the simulated clock (issue 53; docs/async.md).

Protocol (offline data): N clients (default 100, Dirichlet α 0.5 for digits, the natural partition for
Synthetic), 1 local epoch of batches of 16 (SGD, lr 0.05 — 0.01 for Synthetic — momentum 0.9), the dataset's
default model, devices drawn log-normal and sorted fastest first by id as in ``benchmarks.deadlines`` (so the
tiered methods' strong, moderate and weak thirds are the fast, middling and slow devices).  The reference runs
``rounds`` synchronous rounds of K clients; every other run gets the same **simulated time** — it runs until its
clock passes the reference's last one (at most ``--max-factor`` × the reference's ``rounds × K`` client updates):

* ``sync``: synchronous FedAvg, K a round (the reference: the target is ``--target`` × its best accuracy);
* ``sync+deadline``: the same with a deadline at the population's median full-model round (stragglers dropped);
* ``async M=C=K``: FedAvg with ``--mode async``, buffer = concurrency = K, constant staleness, ``rounds`` server
  steps: the synchronous run bit for bit (a check), whose wall time against ``sync`` is the cost of the
  asynchronous machinery for the same client updates;
* ``fedbuff``: FedAvg, C = ``--concurrency`` (20), M = ``--buffer`` (10), staleness ``poly:0.5``;
* ``fedasync``: FedAvg, C = 20, M = 1, staleness ``poly:0.5`` (U server steps);
* ``fedbuff+heterofl``, ``fedbuff+fedrolex`` (tier mix thirds) and ``fedbuff+fedldf`` (n = M/2 per layer).

Reported per run: time to the target on the simulated clock, accuracy at a fixed simulated time (half the
reference's last clock: the last evaluation at or before it, a run that ended earlier its final one), final
accuracy, client updates and wall time.  Seeds run one after another
(an asynchronous run cannot be a vectorised replica).

Usage::

    python -m benchmarks.async [--quick] [--datasets digits,synthetic] [--seeds 0,1] [--clients 100] [--cohort 10]
        [--rounds 30] [--concurrency 20] [--buffer 10] [--runs sync,fedbuff,...] [--out DIR]

Writes ``<out>/async-<device>.json`` and ``async-<device>.png`` (accuracy against the simulated clock, one panel
per dataset, seed 0) and prints the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import tempfile
import time

import jax
import numpy as np

from benchmarks import device_slug, figure_style
from benchmarks.deadlines import evaluated, sorted_profiles, time_to
from fedpartial._src.experiment.runs import simulation_for
from fedpartial._src.core.errors import DivergedError
from fedpartial._src.experiment.config import RunConfig
from fedpartial._src.experiment.evaluation import record_fields
from fedpartial._src.experiment.simulation import Simulation

RUNS = ("sync", "sync+deadline", "async M=C=K", "fedbuff", "fedasync", "fedbuff+heterofl", "fedbuff+fedrolex",
        "fedbuff+fedldf")
#: the client learning rate by dataset (Synthetic's 0.01 as FedProx's paper; 0.05 diverged there), else 0.05
LR = {"synthetic": 0.01}
KEPT = ("round", "test_accuracy", "simulated_clock_s", "staleness_mean", "staleness_max", "clients_in_flight",
        "cumulative_upload_bytes", "train_loss")


def run_config(args, name: str, dataset: str, seed: int, profiles: str, deadline: float) -> RunConfig:
    """The configuration of run ``name`` (module docstring), each with ``rounds × cohort`` client updates."""
    method = name.split("+")[1] if "+" in name and not name.startswith("sync") else "fedavg"
    third = args.clients // 3
    options = ({"tier_mix": (args.clients - 2 * third, third, third)} if method in ("heterofl", "fedrolex") else
               {"n": max(1, args.buffer // 2)} if method == "fedldf" else {})
    base = dict(method=method, dataset=dataset, model=args.model, num_clients=args.clients, cohort_size=args.cohort,
                rounds=args.rounds, local_epochs=1.0, batch_size=16, client_lr=LR.get(dataset, 0.05), momentum=0.9,
                eval_every=args.eval_every, out_dir=None, seed=seed, options=options, device_profiles=profiles,
                partition="natural" if dataset == "synthetic" else "dirichlet", alpha=0.5)
    cap = int(args.max_factor * args.rounds * args.cohort)  # client updates at most
    if name == "sync":
        return RunConfig(**base)
    if name == "sync+deadline":
        return RunConfig(**base | {"rounds": cap // args.cohort}, round_deadline=deadline)
    if name == "async M=C=K":
        return RunConfig(**base | {"mode": "async", "staleness": "constant"})
    m = 1 if name == "fedasync" else args.buffer
    return RunConfig(**base | {"mode": "async", "concurrency": args.concurrency, "buffer": m,
                               "rounds": cap // m, "eval_every": max(1, args.eval_every * args.cohort // m)})


def run_one(cfg: RunConfig, name: str, dataset: str, seed: int, until_clock: float | None = None) -> dict:
    """Runs ``cfg`` (until its clock passes ``until_clock``, when given; the last record is then evaluated)."""
    start = time.perf_counter()
    sim = simulation_for(cfg)
    records, updates, diverged = [], 0, None
    try:
        for r in sim.rounds():
            updates += r["clients"]
            if until_clock is not None and r["simulated_clock_s"] >= until_clock and "test_accuracy" not in r:
                r.update(record_fields(sim.evaluate()))
            records.append({k: r[k] for k in KEPT if k in r})
            if until_clock is not None and r["simulated_clock_s"] >= until_clock:
                break
    except DivergedError as error:  # kept with the records before it
        diverged = str(error)
    return {"run": name, "dataset": dataset, "seed": seed, "records": records, "time_s": time.perf_counter() - start,
            "client_updates": updates, "diverged": diverged}


def accuracy_at(run: dict, clock: float) -> float | None:
    """The last evaluated accuracy at or before the simulated ``clock``."""
    before = [r["test_accuracy"] for r in evaluated(run) if r["simulated_clock_s"] <= clock]
    return before[-1] if before else None


def summarize(runs: list[dict], args) -> list[dict]:
    rows = []
    for dataset in args.datasets:
        ours = [r for r in runs if r["dataset"] == dataset]
        for name in args.runs:
            group = [r for r in ours if r["run"] == name]
            if not group:
                continue
            rows.append(row(name, dataset, group, ours))
    return rows


def row(name: str, dataset: str, group: list[dict], ours: list[dict]) -> dict:
    """One run's seeds: time to the target (the reference's, per seed) and accuracy at the fixed clock."""
    reached, at_fixed, finals = [], [], []
    for run in group:
        seed_runs = [r for r in ours if r["seed"] == run["seed"]]
        reference = next(r for r in seed_runs if r["run"] == "sync")
        target = run["target"] = TARGET[0] * max(r["test_accuracy"] for r in evaluated(reference))
        fixed = FIXED_SHARE * reference["records"][-1]["simulated_clock_s"]
        reached.append(time_to(run, target))
        at_fixed.append(accuracy_at(run, fixed))
        finals.append(evaluated(run)[-1]["test_accuracy"])
    known = [t for t in reached if t is not None]
    return {"run": name, "dataset": dataset, "seeds": len(group),
            "time_to_target_s": float(np.mean(known)) if len(known) == len(group) else None,
            "reached": f"{len(known)}/{len(group)}",
            "accuracy_at_fixed_clock": (float(np.mean(at_fixed)) if all(a is not None for a in at_fixed) else None),
            "final_accuracy": float(np.mean(finals)), "wall_s": float(np.mean([r["time_s"] for r in group])),
            "client_updates": float(np.mean([r["client_updates"] for r in group])),
            "diverged": sum(1 for r in group if r.get("diverged")),
            "staleness_mean": float(np.mean([np.mean([x.get("staleness_mean", 0.0) for x in r["records"]])
                                             for r in group]))}


TARGET = [0.9]  # the share of the reference's best accuracy (set by main)
#: the fixed simulated time at which accuracy is compared: this share of the reference's last clock
FIXED_SHARE = 0.5


def _cell(x) -> str:
    return "—" if x is None else f"{x:.4f}"


def table(rows: list[dict]) -> str:
    lines = [f"{'dataset':<10} {'run':<18} {'to target':>10} {'reached':>7} {'acc@fixed':>9} {'final':>7} "
             f"{'staleness':>9} {'updates':>7} {'wall':>8}"]
    for r in rows:
        reach = "—" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.1f} s"
        lines.append(f"{r['dataset']:<10} {r['run']:<18} {reach:>10} {r['reached']:>7} "
                     f"{_cell(r['accuracy_at_fixed_clock']):>9} {r['final_accuracy']:>7.4f} "
                     f"{r['staleness_mean']:>9.2f} "
                     f"{r['client_updates']:>7.0f} {r['wall_s']:>6.1f} s")
    return "\n".join(lines)


#: how each run is drawn, so that runs that coincide stay visible: (line style, width, marker, drawing order)
RUN_STYLE = {"sync": ("-", 3.2, None, 1), "async M=C=K": (":", 2.0, "o", 3), "sync+deadline": ("--", 1.8, None, 2)}


def plot(runs: list[dict], datasets: list[str], path: str) -> None:
    """Test accuracy against the simulated clock, a panel per dataset, one legend under them.  The synchronous
    reference is a thick line underneath; ``async M=C=K`` (the same updates, so often the same curve) is dotted
    with markers on top of it; each FedBuff variant takes its method's colour."""
    fig, axes = figure_style.figure(len(datasets), height=3.8)
    for ax, dataset in zip(axes, datasets):
        first = min(r["seed"] for r in runs)
        for run in (r for r in runs if r["dataset"] == dataset and r["seed"] == first):
            ev = evaluated(run)
            style, width, marker, order = RUN_STYLE.get(run["run"], ("-", 1.6, None, 2))
            ax.plot([r["simulated_clock_s"] for r in ev], [r["test_accuracy"] for r in ev],
                    color="#888888" if run["run"] == "sync+deadline" else figure_style.colour(run["run"]),
                    linestyle=style, lw=width, marker=marker, markersize=4, markevery=max(1, len(ev) // 12),
                    zorder=order, label=run["run"])
        ax.set_title(f"{dataset}, seed {first}")
        ax.set_xlabel("simulated clock (s)")
        ax.set_ylabel("test accuracy")
        ax.grid(True, alpha=0.3)
    figure_style.shared_legend(fig, axes)
    figure_style.save(fig, path)


def machinery(args) -> dict:
    """Steady-state wall time per client update of synchronous FedAvg, ``--mode async`` with M = C = K (the same
    updates) and FedBuff (C, M), the first dataset, seed 0, after three warm-up rounds or steps (compiles
    excluded); the synchronous run twice, before and after, to bracket the machine's drift."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        profiles = os.path.join(tmp, "devices.csv")
        sorted_profiles(argparse.Namespace(clients=args.clients, seed=0), profiles)
        base = run_config(args, "sync", args.datasets[0], 0, profiles, 0.0)
        base = dataclasses.replace(base, rounds=3 + args.rounds, eval_every=10**6)
        variants = [("sync", {}), ("async M=C=K", {"mode": "async", "staleness": "constant"}),
                    ("fedbuff", {"mode": "async", "concurrency": args.concurrency, "buffer": args.buffer}),
                    ("sync again", {})]
        for name, extra in variants:
            rounds = base.rounds if name != "fedbuff" else 3 + args.rounds * args.cohort // args.buffer
            it = simulation_for(dataclasses.replace(base, rounds=rounds, **extra)).rounds()
            for _ in range(3):
                next(it)
            start, updates = time.perf_counter(), 0
            for record in it:
                updates += record["clients"]
            out[name] = (time.perf_counter() - start) / updates
            print(f"{name:<12} {1000 * out[name]:.1f} ms per client update", flush=True)
    return out


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.async", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="digits and the MLP, N=12, K=4, C=6, M=2, 2 rounds' updates, sync and fedbuff (a smoke test)")
    p.add_argument("--datasets", default="digits,synthetic")
    p.add_argument("--model", default="auto", help="the model (auto: each dataset's default)")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--cohort", type=int, default=10)
    p.add_argument("--rounds", type=int, default=30, help="synchronous rounds; every run gets rounds × cohort updates")
    p.add_argument("--concurrency", type=int, default=20)
    p.add_argument("--buffer", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=2, help="synchronous rounds (async: the same updates)")
    p.add_argument("--max-factor", type=float, default=4.0,
                   help="a run other than the reference stops after this many times its client updates at most")
    p.add_argument("--runs", default=",".join(RUNS))
    p.add_argument("--target", type=float, default=0.9, help="the target, as a share of sync's best accuracy")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tag", default="", help="added to the result files' names")
    p.add_argument("--machinery", action="store_true",
                   help="only the steady-state time per client update of sync, async M=C=K and FedBuff")
    args = p.parse_args(argv)
    if args.quick:
        args.datasets, args.seeds, args.clients, args.cohort, args.rounds, args.concurrency, args.buffer = (
            "digits", "0", 12, 4, 2, 6, 2)
        args.eval_every, args.runs, args.model, args.max_factor = 1, "sync,fedbuff", "mlp", 2.0
    args.datasets, args.runs = args.datasets.split(","), args.runs.split(",")
    args.seeds = [int(s) for s in args.seeds.split(",")]
    return args


def main(argv=None) -> int:
    args = parse(argv)
    TARGET[0] = args.target
    os.makedirs(args.out, exist_ok=True)
    if args.machinery:
        seconds = machinery(args)
        path = os.path.join(args.out, f"async-machinery-{device_slug()}{'-' + args.tag if args.tag else ''}.json")
        with open(path, "w") as f:
            json.dump({"benchmark": "async_machinery", "date": datetime.datetime.now().isoformat(timespec="seconds"),
                       "command": " ".join(["python -m benchmarks.async",
                                            *(argv if argv is not None else sys.argv[1:])]),
                       "protocol": {k: v for k, v in vars(args).items()}, "seconds_per_client_update": seconds}, f)
        print(f"wrote {path}")
        return 0
    t0, runs = time.perf_counter(), []
    with tempfile.TemporaryDirectory() as tmp:
        for dataset in args.datasets:
            for seed in args.seeds:
                profiles = os.path.join(tmp, f"devices-{seed}.csv")
                sorted_profiles(argparse.Namespace(clients=args.clients, seed=seed), profiles)
                deadline = 0.0
                if "sync+deadline" in args.runs:  # the population's median full-model round
                    probe = Simulation(run_config(args, "sync", dataset, seed, profiles, 0.0))
                    deadline = float(np.quantile(probe.full_model_times(), 0.5))
                until = None
                for name in args.runs:
                    run = run_one(run_config(args, name, dataset, seed, profiles, deadline), name, dataset, seed,
                                  None if name in ("sync", "async M=C=K") else until)
                    if name == "sync":
                        until = run["records"][-1]["simulated_clock_s"]
                    run["deadline_s"] = deadline
                    runs.append(run)
                    print(f"{dataset:<10} seed {seed} {name:<18} best "
                          f"{max(r['test_accuracy'] for r in evaluated(run)):.4f} clock "
                          f"{run['records'][-1]['simulated_clock_s']:.1f} s  {run['time_s']:.1f}s wall", flush=True)
    rows = summarize(runs, args)
    print("\n" + table(rows))
    slug = device_slug() + ("-quick" if args.quick else "") + (f"-{args.tag}" if args.tag else "")
    device = jax.devices()[0]
    result = {"benchmark": "async", "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "command": " ".join(["python -m benchmarks.async", *(argv if argv is not None else sys.argv[1:])]),
              "device": {"platform": device.platform, "device_kind": device.device_kind, "cpu_count": os.cpu_count(),
                         "jax_version": jax.__version__},
              "protocol": {k: v for k, v in vars(args).items()}, "summary": rows, "runs": runs,
              "total_time_s": time.perf_counter() - t0}
    json_path = os.path.join(args.out, f"async-{slug}.json")
    with open(json_path, "w") as f:
        json.dump(result, f)
    plot(runs, args.datasets, os.path.join(args.out, f"async-{slug}.png"))
    print(f"\nwrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
