"""Reproduction of FedSPU's comparison (paper Tables 1–4 and Fig. 5) on data that runs offline.

Protocol (docs/decisions.md#fedspu): N=100 clients, K=10 per round, five equal client tiers with keep
ratios p ∈ {0.2, 0.4, 0.6, 0.8, 1.0}, Dirichlet α ∈ {0.1, 0.5, 1.0}, five local epochs,
each client's data split λ=0.7 train / 0.3 held out; FedSPU and the dropout
baselines FedDrop, FjORD, Hermes, FedMP, PruneFL and FedSelect, each without and with
early stopping (ES, the paper's Table 2 runs the baselines with ES too).  Accuracy is
the mean over clients of the personal model's accuracy on the client's own held-out
split.  ``synthetic`` is Synthetic(α, α) with its natural partition (one client per
generated client), so its α sets the heterogeneity instead of a Dirichlet split.

Usage::

    python -m benchmarks.fedspu [--quick] [--datasets digits,mnist5k,synthetic,emnist,cifar10]
        [--alphas 0.1,0.5,1.0] [--methods fedspu,hermes,...] [--rounds R] [--seeds 0,1]
        [--eval-every E] [--strategy auto] [--data-dir DIR] [--out DIR] [--tag TAG]
    python -m benchmarks.fedspu --merge A.json B.json ... --tag TAG   # tables over several result files

``--methods`` takes method names (each run without and with ES, see ``--es``) or
``name+es`` entries, which make the list literal: ``fedspu,hermes,fedspu+es`` runs
exactly those three.

Writes ``<out>/fedspu-<tag>.json`` (settings, device, every run's summary with a
compact personal-accuracy curve, the tables), ``fedspu-memory-<tag>.png`` (Fig. 5)
and ``fedspu-curves-<tag>.png``, and prints the tables as Markdown:

* Table 1 / 2 — mean final personal accuracy (%) over the α (± std over α) per
  dataset and method, without / with ES, and FedSPU minus the best baseline (the
  paper's +4.45 is the mean over datasets of FedSPU minus the best baseline of that
  dataset, FedSelect included; with ES it is +5.11);
* Table 3 — total local training time (s) and bytes transmitted (upload + download)
  per dataset and method, summed over the α;
* Table 4 — rounds run by FedSPU and FedSPU+ES per dataset and α, and the saving;
* Memory — :func:`fedpartial._src.costs.footprint.fedspu_memory_table` per dataset (FedSPU vs
  full-model training at p = 0.2 … 0.8; paper −54/−44/−31/−18 %).  It needs only the
  model's shapes, so it is given for tfds datasets even when they are not prepared.

``emnist`` and ``cifar10`` are read with tfds from ``--data-dir``; when they are not
prepared there (or tfds is not installed) they are skipped with a note.
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
from fedpartial._src.costs import footprint as costs
from fedpartial._src.data import sources
from fedpartial._src.data.sources import DataError
from fedpartial._src.methods.submodel.common import DEFAULT_TIERS
from fedpartial._src.experiment.config import RunConfig
from fedpartial._src.experiment.parts import build_model
from fedpartial._src.experiment.simulation import Simulation, run
from fedpartial._src.bench.provenance import stamp

#: every method, in the column order of the tables: the paper's order (PruneFL, FjORD,
#: Hermes, FedMP, FedSelect, FedSPU) with FedDrop, which the paper does not tabulate, first.
#: The personalised partial-model methods (personal layers) come after them: not the paper's, run when named
#: (``benchmarks/personalised.py`` runs them beside FedSPU in its own benchmark), compared with FedSPU apart from the
#: dropout baselines.
METHODS = ("feddrop", "prunefl", "fjord", "hermes", "fedmp", "fedselect", "fedspu", "fedper", "lgfedavg", "fedrep",
           "fedbabu", "ditto")
PAPER_METHODS = METHODS[:7]
BASELINES = METHODS[:6]
PERSONALISED = METHODS[7:]
LABELS = {"feddrop": "FedDrop", "prunefl": "PruneFL", "fjord": "FjORD", "hermes": "Hermes", "fedmp": "FedMP",
          "fedselect": "FedSelect", "fedspu": "FedSPU", "fedper": "FedPer", "lgfedavg": "LG-FedAvg",
          "fedrep": "FedRep", "fedbabu": "FedBABU", "ditto": "Ditto"}
ALPHAS = (0.1, 0.5, 1.0)
LOCAL_EPOCHS = 5
PAPER_GAIN = {False: 4.45, True: 5.11}  # mean over datasets of FedSPU − best baseline (Tables 1, 2)
PAPER_MEMORY_REDUCTION = {0.2: 0.54, 0.4: 0.44, 0.6: 0.31, 0.8: 0.18}  # Fig. 5 text, average over datasets

# dataset -> (model, local batch size, client lr, momentum, local steps (None: LOCAL_EPOCHS epochs), partition)
# * digits: the RunConfig defaults (lr 0.05, momentum 0.9, batch 16) with the paper's EMNIST CNN.
# * synthetic: FedLDF's setting (benchmarks/fedldf.py: MLP, batch 10, lr 0.01, no momentum,
#   20 local steps).  Its clients hold 28..4,654 training examples (N=100); five epochs would
#   pad every client to the largest one's 2,330 steps, while 20 steps of 10 are five epochs of
#   the median client (~39 training examples).
# * emnist: the paper's CNN (2 conv + 1 fc after FjORD, zoo ``cnn2c1f``; the simulation's
#   'auto' model for emnist is the LEAF FEMNIST CNN, which has an extra 2048-unit layer),
#   the paper's lr 2e-4 and batch 16.  The paper does not name its optimizer; here it is the
#   engine's SGD with momentum 0.9.
# * cifar10: the paper's CNN (2 conv + 3 fc, zoo ``cnn2c3f``), lr 0.1, batch 128, plain SGD
#   (momentum 0: lr 0.1 is a plain-SGD learning rate).
# * mnist5k: 5,000 real 28x28 MNIST digits offline (4,000 train): the paper's EMNIST CNN on
#   EMNIST-sized images, with the digits setting (lr 0.05, momentum 0.9, batch 16) -- the paper's
#   lr 2e-4 is tuned for EMNIST's 700k examples and barely moves in a few hundred rounds here.
SETUPS = {
    "digits": ("cnn2c1f", 16, 0.05, 0.9, None, "dirichlet"),
    "mnist5k": ("cnn2c1f", 16, 0.05, 0.9, None, "dirichlet"),
    "synthetic": ("mlp", 10, 0.01, 0.0, 20, "natural"),
    "emnist": ("cnn2c1f", 16, 2e-4, 0.9, None, "dirichlet"),
    "cifar10": ("cnn2c3f", 128, 0.1, 0.0, None, "dirichlet"),
}
#: one example's shape and the number of classes, to build a model for the memory table without data
SHAPES = {"digits": ((8, 8, 1), 10), "mnist5k": ((28, 28, 1), 10), "synthetic": ((60,), 10),
          "emnist": ((28, 28, 1), 62), "cifar10": ((32, 32, 3), 10)}


def label(method: str, es: bool) -> str:
    return LABELS[method] + ("+ES" if es else "")


def variants(args) -> list[tuple[str, bool]]:
    """The (method, early stopping) pairs to run, in table order."""
    entries = [m.strip().lower() for m in args.methods.split(",") if m.strip()]
    literal = any(e.endswith("+es") for e in entries)
    pairs = []
    for e in entries:
        name = e.removesuffix("+es")
        if name not in METHODS:
            raise ValueError(f"method {name!r} is not one of FedSPU's methods; choose from {', '.join(METHODS)}")
        if literal:
            pairs.append((name, e.endswith("+es")))
        else:
            pairs += [(name, es) for es in {"both": (False, True), "none": (False,), "only": (True,)}[args.es]]
    return sorted(set(pairs), key=lambda p: (p[1], METHODS.index(p[0])))


def load(dataset: str, alpha: float, seed: int, args, cache: dict) -> sources.ArrayDataset:
    """The dataset of one run, loaded once (Synthetic depends on α and the seed, digits and mnist5k on the seed)."""
    key = (dataset, alpha if dataset == "synthetic" else None,
           seed if dataset in ("digits", "mnist5k", "synthetic") else None)
    if key not in cache:
        options = {}
        if dataset == "synthetic":
            options = dict(alpha=alpha, beta=alpha, num_clients=args.clients)
        cache[key] = sources.load_dataset(dataset, data_dir=args.data_dir, seed=seed, **options)
    return cache[key]


def config_for(dataset: str, alpha: float, method: str, es: bool, seed: int, args) -> RunConfig:
    model, batch, lr, momentum, steps, partition = SETUPS[dataset]
    return RunConfig(
        method=method, dataset=dataset, data_dir=args.data_dir, model=model, partition=partition, alpha=alpha,
        num_clients=args.clients, cohort_size=args.cohort, rounds=args.rounds,
        local_steps=steps, local_epochs=None if steps else args.local_epochs, batch_size=batch, client_lr=lr,
        momentum=momentum, options={} if method == "fedselect" or method in PERSONALISED else {"tiers": DEFAULT_TIERS},
        early_stopping=es, train_fraction=0.7, strategy=args.strategy,
        seed=seed, eval_every=args.eval_every, out_dir=None,
    )


def run_one(dataset: str, alpha: float, method: str, es: bool, seed: int, args, cache: dict) -> dict:
    config = config_for(dataset, alpha, method, es, seed, args)
    sim = Simulation(config, dataset=load(dataset, alpha, seed, args, cache))
    summary = run(config, sim=sim)
    records = summary.pop("records")
    summary.pop("run_dir", None)
    curve = [(r["round"], r["personal_accuracy"]) for r in records if "personal_accuracy" in r]
    # Round 1 compiles the round (and the first run of a process also warms JAX up): the
    # steady total counts it at the median time of the other rounds instead.
    times = [r["round_time_s"] for r in records]
    steady = sum(times[1:]) + float(np.median(times[1:])) if len(times) > 1 else sum(times)
    return {**summary, "dataset": dataset, "alpha": alpha, "seed": seed, "early_stopping": es,
            "label": label(method, es), "first_round_time_s": times[0] if times else 0.0,
            "train_time_steady_s": steady, "accuracy_curve": curve}


# ------------------------------------------------------------------ tables


def _select(runs, **where) -> list[dict]:
    return [r for r in runs if all(r[k] == v for k, v in where.items())]


def _seed_mean(runs, key) -> float:
    return float(np.mean([r[key] for r in runs]))


def accuracy_table(runs: list[dict], es: bool) -> list[dict]:
    """Table 1 (es=False) / 2 (es=True): per dataset, per method the mean final personal
    accuracy (%) over α (each α averaged over seeds first) and its std over α."""
    rows = []
    for dataset in dict.fromkeys(r["dataset"] for r in runs):
        row = {"dataset": dataset, "early_stopping": es, "methods": {}}
        for m in METHODS:
            mine = _select(runs, dataset=dataset, method=m, early_stopping=es)
            if not mine:
                continue
            alphas = sorted({r["alpha"] for r in mine})
            per_alpha = [100 * _seed_mean(_select(mine, alpha=a), "final_personal_accuracy") for a in alphas]
            row["methods"][m] = {"mean": float(np.mean(per_alpha)), "std": float(np.std(per_alpha)),
                                 "per_alpha": dict(zip(map(str, alphas), per_alpha))}
        for key, group in (("baseline", BASELINES), ("personalised", PERSONALISED)):
            base = {m: v["mean"] for m, v in row["methods"].items() if m in group}
            row[f"best_{key}"] = max(base, key=base.get) if base else None
            row[f"fedspu_minus_best_{key}"] = (row["methods"]["fedspu"]["mean"] - base[row[f"best_{key}"]]
                                               if base and "fedspu" in row["methods"] else None)
        if row["methods"]:
            rows.append(row)
    return rows


def cost_table(runs: list[dict]) -> list[dict]:
    """Table 3: per dataset and method (FedSPU+ES too) the local training time and bytes
    sent both ways, summed over α (each α averaged over seeds).  ``train_time_s`` is the
    steady time (round 1, which compiles, counted at the median round time);
    ``train_time_with_compile_s`` the measured one."""
    rows = []
    for dataset in dict.fromkeys(r["dataset"] for r in runs):
        for es in (False, True):
            for m in METHODS:
                mine = _select(runs, dataset=dataset, method=m, early_stopping=es)
                if not mine or (es and m != "fedspu"):
                    continue
                alphas = sorted({r["alpha"] for r in mine})
                time_s = sum(_seed_mean(_select(mine, alpha=a), "train_time_steady_s") for a in alphas)
                raw_s = sum(_seed_mean(_select(mine, alpha=a), "train_time_s") for a in alphas)
                sent = sum(float(np.mean([r["total_upload_bytes"] + r["total_download_bytes"]
                                          for r in _select(mine, alpha=a)])) for a in alphas)
                rows.append({"dataset": dataset, "method": m, "early_stopping": es, "label": label(m, es),
                             "train_time_s": time_s, "train_time_with_compile_s": raw_s, "transmitted_bytes": sent})
    return rows


def rounds_table(runs: list[dict]) -> list[dict]:
    """Table 4: rounds run by FedSPU and FedSPU+ES per dataset and α (mean over seeds)."""
    rows = []
    for dataset in dict.fromkeys(r["dataset"] for r in runs):
        for a in sorted({r["alpha"] for r in _select(runs, dataset=dataset)}):
            plain = _select(runs, dataset=dataset, alpha=a, method="fedspu", early_stopping=False)
            stop = _select(runs, dataset=dataset, alpha=a, method="fedspu", early_stopping=True)
            if not plain or not stop:
                continue
            r0, r1 = _seed_mean(plain, "rounds"), _seed_mean(stop, "rounds")
            rows.append({"dataset": dataset, "alpha": a, "fedspu_rounds": r0, "fedspu_es_rounds": r1,
                         "saved": 1 - r1 / r0,
                         "fedspu_accuracy": 100 * _seed_mean(plain, "final_personal_accuracy"),
                         "fedspu_es_accuracy": 100 * _seed_mean(stop, "final_personal_accuracy"),
                         "stopped_clients": _seed_mean(stop, "stopped_clients")})
    return rows


def memory_rows(dataset: str) -> list[dict]:
    """Fig. 5 for ``dataset``'s model and batch size (shapes only: no data is read)."""
    model_name, batch = SETUPS[dataset][:2]
    shape, classes = SHAPES[dataset]
    stand_in = sources.ArrayDataset(name=dataset, x_train=np.zeros((1, *shape), np.float32),
                                    y_train=np.zeros(1, np.int32), x_test=np.zeros((1, *shape), np.float32),
                                    y_test=np.zeros(1, np.int32), num_classes=classes)
    model = build_model(model_name, stand_in)
    return [{"dataset": dataset, "model": model_name, "batch_size": batch, **row}
            for row in costs.fedspu_memory_table(model, batch)]


def _md(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def format_accuracy(rows: list[dict], es: bool) -> str:
    shown = [m for m in METHODS if any(m in r["methods"] for r in rows)]
    header = ["Dataset"] + [label(m, es) for m in shown] + ["FedSPU − best baseline"]
    body = []
    for r in rows:
        cells = [f"{r['methods'][m]['mean']:.2f} ± {r['methods'][m]['std']:.2f}" if m in r["methods"] else "—"
                 for m in shown]
        gap = r["fedspu_minus_best_baseline"]
        gap = "—" if gap is None else f"{gap:+.2f} (vs {LABELS[r['best_baseline']]})"
        body.append([r["dataset"], *cells, gap])
    return _md(header, body)


def format_costs(rows: list[dict]) -> str:
    big = max((r["transmitted_bytes"] for r in rows), default=0) >= 1e9
    unit, scale = ("GB", 1e9) if big else ("MB", 1e6)
    labels = list(dict.fromkeys(r["label"] for r in rows))
    body = []
    for dataset in dict.fromkeys(r["dataset"] for r in rows):
        by = {r["label"]: r for r in rows if r["dataset"] == dataset}
        body.append([f"{dataset} time (s)"] + [f"{by[l]['train_time_s']:.1f}" if l in by else "—" for l in labels])
        body.append([f"{dataset} sent ({unit})"]
                    + [f"{by[l]['transmitted_bytes'] / scale:.3f}" if l in by else "—" for l in labels])
    return _md(["Dataset"] + labels, body)


def format_rounds(rows: list[dict]) -> str:
    body = [[f"{r['dataset']} (α={r['alpha']})", f"{r['fedspu_rounds']:.0f}", f"{r['fedspu_es_rounds']:.0f}",
             f"{r['saved']:.0%}", f"{r['fedspu_accuracy']:.2f}", f"{r['fedspu_es_accuracy']:.2f}",
             f"{r['stopped_clients']:.0f}"] for r in rows]
    return _md(["Dataset", "FedSPU rounds", "FedSPU+ES rounds", "saved", "FedSPU acc %", "FedSPU+ES acc %",
                "stopped clients"], body)


def format_memory(rows: list[dict]) -> str:
    body = [[r["dataset"], r["model"], str(r["batch_size"]), f"{r['p']:.1f}", f"{r['fedspu_bytes'] / 1e6:.3f}",
             f"{r['full_bytes'] / 1e6:.3f}", f"{-r['reduction']:+.0%}",
             f"{-PAPER_MEMORY_REDUCTION[r['p']]:+.0%}" if r["p"] in PAPER_MEMORY_REDUCTION else "—"]
            for r in rows if r["p"] < 1]
    return _md(["Dataset", "model", "batch", "p", "FedSPU MB", "full MB", "change", "paper (avg)"], body)


def verdicts(rows: list[dict]) -> list[str]:
    lines = []
    for r in rows:
        gap = r["fedspu_minus_best_baseline"]
        if gap is None:
            continue
        verb = "beats" if gap >= 0 else "trails"
        es = " with ES" if r["early_stopping"] else ""
        lines.append(f"{r['dataset']}{es}: FedSPU {verb} the best dropout baseline ({LABELS[r['best_baseline']]}) "
                     f"by {abs(gap):.2f} points (paper: +{PAPER_GAIN[r['early_stopping']]:.2f} on average)")
    for r in rows:
        gap = r.get("fedspu_minus_best_personalised")
        if gap is not None:
            es = " with ES" if r["early_stopping"] else ""
            lines.append(f"{r['dataset']}{es}: FedSPU {'beats' if gap >= 0 else 'trails'} the best personal-layers "
                         f"method ({LABELS[r['best_personalised']]}) by {abs(gap):.2f} points (not in the paper)")
    return lines


# ------------------------------------------------------------------ plots


def plot_memory(rows: list[dict], path: str) -> None:
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    fig, axes = figure_style.figure(len(datasets))
    for ax, dataset in zip(axes, datasets):
        mine = [r for r in rows if r["dataset"] == dataset and r["p"] < 1]
        x = np.arange(len(mine))
        ax.bar(x - 0.2, [r["fedspu_bytes"] / 1e6 for r in mine], 0.4, label="FedSPU",
               color=figure_style.colour("fedspu"))
        ax.bar(x + 0.2, [r["full_bytes"] / 1e6 for r in mine], 0.4, label="full model (the other methods)",
               color="#999999")
        for i, r in enumerate(mine):
            ax.annotate(f"{-r['reduction']:+.0%}", (i - 0.2, r["fedspu_bytes"] / 1e6), ha="center", va="bottom")
        ax.set_xticks(x, [f"{r['p']:.1f}" for r in mine])
        ax.set_xlabel("keep ratio p")
        ax.set_ylabel("training memory (MB)")
        ax.set_title(f"{dataset} ({mine[0]['model']}, batch {mine[0]['batch_size']})")
    figure_style.shared_legend(fig, axes)
    figure_style.save(fig, path)


def plot_curves(runs: list[dict], path: str) -> None:
    """Accuracy against rounds, one panel per (dataset, α), three a row; a method has one colour, its run with
    early stopping is dashed; one legend under the panels."""
    from matplotlib.lines import Line2D

    panels = list(dict.fromkeys((r["dataset"], r["alpha"]) for r in runs))
    fig, axes = figure_style.figure(len(panels))
    for ax, (dataset, alpha) in zip(axes, panels):
        for r in _select(runs, dataset=dataset, alpha=alpha, seed=min(x["seed"] for x in runs)):
            if r["accuracy_curve"]:
                t, acc = zip(*r["accuracy_curve"])
                ax.plot(t, 100 * np.asarray(acc), "--" if r["early_stopping"] else "-", lw=1.6,
                        color=figure_style.colour(r["method"]),
                        label=r["label"].removesuffix("+ES"))
        ax.set_xlabel("round")
        ax.set_ylabel("personal accuracy (%)")
        ax.set_title(f"{dataset}, α={alpha}")
        ax.grid(True, alpha=0.3)
    styles = [(Line2D([], [], color="#444444", ls="-"), "without early stopping"),
              (Line2D([], [], color="#444444", ls="--"), "with early stopping (+ES)")]
    figure_style.shared_legend(fig, axes, extra=styles if any(r["early_stopping"] for r in runs) else ())
    figure_style.save(fig, path)


def run_all(datasets, alphas, seeds, pairs, args) -> tuple[list[dict], list[str]]:
    """Every (dataset, α, seed, method, ES) run, printing one line each; unprepared tfds datasets are noted."""
    runs, notes = [], []
    for dataset in datasets:
        cache = {}
        try:
            for alpha in alphas:
                for seed in seeds:
                    for method, es in pairs:
                        start = time.perf_counter()
                        r = run_one(dataset, alpha, method, es, seed, args, cache)
                        r["time_s"] = time.perf_counter() - start
                        runs.append(r)
                        print(f"{dataset:<9} α={alpha:<4} seed {seed} {r['label']:<12} personal acc "
                              f"{r.get('final_personal_accuracy', math.nan):.4f}  rounds {r['rounds']:>4}/"
                              f"{args.rounds}  {r['time_s']:.1f}s", flush=True)
        except DataError as e:  # a tfds dataset not prepared here, or tfds missing
            notes.append(f"{dataset}: skipped ({e})")
            print(notes[-1], file=sys.stderr)
    return runs, notes


def merge(paths: list[str]) -> tuple[list[dict], list[str], list[str], dict, dict | list]:
    """Runs, notes, datasets, settings and device of several result files (e.g. one per GPU call);
    a run repeated (same dataset, α, seed, method, ES) is taken from the last file."""
    results = []
    for path in paths:
        with open(path) as f:
            results.append(json.load(f))
    by_key = {}
    for res in results:
        for r in res["runs"]:
            by_key[r["dataset"], r["alpha"], r["seed"], r["method"], r["early_stopping"]] = r
    runs = list(by_key.values())
    datasets = list(dict.fromkeys(d for res in results for d in res["settings"]["datasets"]))
    ran = {r["dataset"] for r in runs}
    notes = list(dict.fromkeys(n for res in results for n in res["notes"] if n.split(":")[0] not in ran))
    devices = list({json.dumps(res["device"], sort_keys=True): res["device"] for res in results}.values())
    planned = sorted({r["planned_rounds"] for r in runs})
    if len(planned) > 1:
        notes.append(f"merged runs were planned for different numbers of rounds ({planned}); tables mix them")
    settings = {"merged_from": list(paths), "datasets": datasets, "settings": [res["settings"] for res in results]}
    return runs, notes, datasets, settings, devices[0] if len(devices) == 1 else devices


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fedspu", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="smoke test: digits, α=0.5, N=10, K=4, 2 rounds, 1 local epoch, FedSPU, Hermes, FedSPU+ES, "
                        "evaluated at the end")
    p.add_argument("--datasets", default=None,
                   help="default digits,mnist5k,synthetic,emnist,cifar10 (--quick: digits); emnist and cifar10 run "
                        "only when prepared in --data-dir (else skipped with a note)")
    p.add_argument("--alphas", default=",".join(map(str, ALPHAS)))
    p.add_argument("--methods", default=None,
                   help=f"names ({', '.join(METHODS)}; default the paper's, --quick: fedspu,hermes,fedspu+es), or "
                        f"name+es entries for a literal list")
    p.add_argument("--es", choices=("both", "none", "only"), default="both",
                   help="for plain names in --methods: run without and with early stopping, or one of them")
    p.add_argument("--rounds", type=int, default=200, help="the paper runs 500")
    p.add_argument("--seeds", default="0", help="comma-separated seeds (default: one seed, 0)")
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--cohort", type=int, default=10)
    p.add_argument("--local-epochs", type=float, default=LOCAL_EPOCHS)
    p.add_argument("--eval-every", type=int, default=None, help="default: rounds // 10")
    p.add_argument("--strategy", default="auto")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tag", default=None, help="file name suffix (default: the device, e.g. gpu-nvidia-h100…)")
    p.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                   help="run nothing: rebuild the tables from these result files (e.g. one per dataset or α)")
    args = p.parse_args(argv)
    if args.quick:
        args.datasets, args.alphas = args.datasets or "digits", "0.5"
        args.methods = args.methods or "fedspu,hermes,fedspu+es"
        args.rounds, args.clients, args.cohort, args.local_epochs = 2, 10, 4, 1.0
        args.eval_every = args.rounds  # evaluate once, at the end: each evaluation compiles on first use
    if args.eval_every is None:
        args.eval_every = max(1, args.rounds // 10)
    args.datasets = args.datasets or "digits,mnist5k,synthetic,emnist,cifar10"
    args.methods = args.methods or ",".join(PAPER_METHODS)
    alphas = [float(a) for a in args.alphas.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    for dataset in datasets:
        if dataset not in SETUPS:
            p.error(f"dataset {dataset!r} has no FedSPU setup; choose from {', '.join(SETUPS)}")
    try:
        pairs = variants(args)
    except ValueError as e:
        p.error(str(e))
    tag = (args.tag or device_slug()) + ("-quick" if args.quick else "")
    os.makedirs(args.out, exist_ok=True)

    t0 = time.perf_counter()
    device = jax.devices()[0]
    device_info = {"platform": device.platform, "device_kind": device.device_kind, "backend": jax.default_backend(),
                   "jax_version": jax.__version__}
    settings = {**vars(args), "alphas": alphas, "seeds": seeds, "datasets": datasets,
                "runs": [label(m, es) for m, es in pairs], "tiers": list(DEFAULT_TIERS), "train_fraction": 0.7,
                "setups": {d: dict(zip(("model", "batch_size", "client_lr", "momentum", "local_steps", "partition"),
                                       SETUPS[d])) for d in datasets}}
    if args.merge:
        runs, notes, datasets, settings, device_info = merge(args.merge)
    else:
        runs, notes = run_all(datasets, alphas, seeds, pairs, args)
    memory = [row for dataset in datasets for row in memory_rows(dataset)]
    tables = {"table1_accuracy": accuracy_table(runs, es=False), "table2_accuracy_es": accuracy_table(runs, es=True),
              "table3_costs": cost_table(runs), "table4_rounds": rounds_table(runs), "memory": memory}
    lines = verdicts(tables["table1_accuracy"]) + verdicts(tables["table2_accuracy_es"])

    print("\n### Table 1 — mean final personal accuracy (%) over α, without ES\n")
    print(format_accuracy(tables["table1_accuracy"], es=False))
    print("\n### Table 2 — mean final personal accuracy (%) over α, with ES\n")
    print(format_accuracy(tables["table2_accuracy_es"], es=True))
    print("\n### Table 3 — total local training time (round 1 at the median round time: no compile) and bytes "
          "transmitted (up + down), summed over α\n")
    print(format_costs(tables["table3_costs"]))
    print("\n### Table 4 — rounds run, FedSPU vs FedSPU+ES\n")
    print(format_rounds(tables["table4_rounds"]))
    print("\n### Memory (Fig. 5) — FedSPU vs full-model training per client (weights + gradients + activations)\n")
    print(format_memory(memory))
    print()
    for line in lines + notes:
        print(line)

    result = {
        "benchmark": "fedspu", "device": device_info, "settings": settings,
        "notes": notes, "verdicts": lines, "tables": tables, "runs": runs,
        "total_time_s": time.perf_counter() - t0,
    }
    json_path = os.path.join(args.out, f"fedspu-{tag}.json")
    with open(json_path, "w") as f:
        json.dump(stamp(result), f, default=lambda o: o.item() if hasattr(o, "item") else str(o))
    plot_memory(memory, os.path.join(args.out, f"fedspu-memory-{tag}.png"))
    if runs:
        plot_curves(runs, os.path.join(args.out, f"fedspu-curves-{tag}.png"))
    print(f"\nwrote {json_path} ({result['total_time_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
