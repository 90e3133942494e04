"""Reproduction of FedDH's comparison (FedDHAD paper, Table 3: FedDH rows and baselines) on data that runs offline.

Protocol (docs/decisions.md#feddhad, the paper's §6.1): N = 100 devices, K = 10 per round, Dirichlet
β = 0.5 label skew, client SGD with lr 0.1 (no momentum), batch 10, 5 local epochs;
LeNet5 and a small CNN; FedAvg / FedProx / FedNova / MOON / FedDyn / FedJS / FedDH /
FedDHE from the same seeds, partitions and cohorts (the cohort sequence depends only
on the seed).  Where this departs from the paper:

* **No learning-rate decay.**  The paper decays the client lr by 0.99 per round;
  :class:`~fedpartial._src.experiment.config.RunConfig` has no per-round decay (the client
  optimizer restarts every round), so the lr is a constant 0.1.
* **The small CNN** is ``cnn2c1f`` (2 conv 5×5 32/64 + 1 dense; 55k parameters on
  8×8 digits, 95k on 32×32×3 against the paper's 122,570-parameter "CNN").  The
  zoo's ``cnn2c3f`` is LeNet5's architecture (conv 6, conv 16, dense 120-84-out),
  so it would repeat the LeNet5 row.  Both take every dataset's shape here: 8×8×1
  digits (SAME convolutions below 16×16), 28×28×1 ``mnist5k``, 32×32×3 CIFAR/SVHN.
* **Synthetic** (Synthetic(1, 1) of the FedProx paper, 60-feature vectors) runs the
  MLP on its natural 100-client partition (heterogeneous by construction, not
  Dirichlet) with 20 local steps per round: its clients hold 40 to thousands of
  examples, and 5 epochs of the largest would be hundreds of steps.  FedDHE needs a
  class-balanced server set, which a naturally partitioned dataset cannot spare, so
  it is skipped there (noted).
* **FedDHE's partition.**  FedDHE's server set (``server_examples`` per class) is
  taken out of the training data before partitioning, so its clients hold a
  partition of the remaining examples; every other method sees the identical
  partition (each run records a digest of its clients' label counts).
* **(υ, b) rates** are the paper's Table 5, CIFAR-10 column of the model's kind
  (LeNet5: λ_Υ 1e-4, decay 0.999, λ_B 1e-4, decay 0.99; CNN: λ_Υ 1e-3, decay
  0.9999, λ_B 0.1, decay 0.99; the MLP takes LeNet's), for FedDH and FedDHE alike.
  Other methods use their registry defaults (FedProx μ 0.01, MOON μ 1 / τ 0.5 /
  projection 256, FedDyn α 0.01, FedDHE β −0.03 with 10 server examples per class).
* **Target accuracy.**  The paper picks one number per model and dataset by eye.
  Here the target of a (dataset, model) pair is ``--target-fraction`` (default
  0.9) × FedAvg's best test accuracy there (mean over seeds), fixed before the
  other methods are compared; "time" is the simulated time
  (``cumulative_simulated_time_s``, :mod:`fedpartial._src.costs.devices`' default device
  distributions drawn with the seed) at the first evaluation reaching it.
* **MFLOPs** is the mean over rounds of the cohort's FLOPs of local work
  (``client_flops``, XLA's count of the compiled step × real steps) / 10⁶ — per
  round of K clients, not per example as the paper's column (0.65 for LeNet) reads.
* **Final accuracy** is the mean of the last 3 evaluations (the test sets here are
  small: 359 digits, 1,000 mnist5k images); "best" is the maximum over the run.

Usage::

    python -m benchmarks.feddh [--quick] [--datasets digits,mnist5k:lenet5,synthetic]
        [--rounds R] [--local-epochs E] [--seeds 0,1] [--target-fraction 0.9] [--out DIR]

``--datasets`` takes ``dataset`` (all of its models) or ``dataset:model`` entries;
``--methods`` takes method names or variants ``method@option=value[;option=value]``
(e.g. ``fedad@target=literal``), which run the method with those options on top of
this benchmark's and are labelled with them.
Writes ``<out>/feddh-<device>.json`` (every round of every run), a plot of test
accuracy against simulated time and prints, per (dataset, model), the Table-3 rows:
final and best accuracy, the gap to FedAvg, simulated time to the target and its
speed-up over FedAvg, MFLOPs per round — then whether FedDH's claims hold (FedDH >
FedAvg; FedDH ≥ FedJS ≥ FedAvg).  Datasets that are not prepared locally (tfds
cifar10, cifar100, svhn_cropped) are skipped with a note.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import sys
import time
from typing import Callable

import jax
import numpy as np

from benchmarks import device_slug, figure_style
from fedpartial._src.data.sources import DataError
from fedpartial._src.experiment.config import RunConfig
from fedpartial._src.experiment.simulation import Simulation
from fedpartial._src.bench.provenance import stamp

METHODS = ("fedavg", "fedprox", "fednova", "moon", "feddyn", "fedjs", "feddh", "feddhe")
LABELS = {"fedavg": "FedAvg", "fedprox": "FedProx", "fednova": "FedNova", "moon": "MOON", "feddyn": "FedDyn",
          "fedjs": "FedJS", "feddh": "FedDH", "feddhe": "FedDHE"}
DEGREE_METHODS = ("fedjs", "feddh", "feddhe")  # aggregated with n_k / D_k weights

# The paper's Table 5, CIFAR-10 column of each model kind: FedDH's (υ, b) learning rates and decays.
DH_RATES = {
    "lenet": {"lr_upsilon": 1e-4, "decay_upsilon": 0.999, "lr_b": 1e-4, "decay_b": 0.99},
    "cnn": {"lr_upsilon": 1e-3, "decay_upsilon": 0.9999, "lr_b": 0.1, "decay_b": 0.99},
}
MODEL_KIND = {"lenet5": "lenet", "cnn2c1f": "cnn", "mlp": "lenet"}

# dataset -> (models, partition, alpha, client lr, local epochs (None: local steps), local steps, rounds)
# For synthetic, alpha is the generator's Synthetic(α, β = α); its partition is natural.
SETUPS = {
    "digits": (("lenet5", "cnn2c1f"), "dirichlet", 0.5, 0.1, 5.0, None, 40),
    "mnist5k": (("lenet5", "cnn2c1f"), "dirichlet", 0.5, 0.1, 5.0, None, 40),
    "synthetic": (("mlp",), "natural", 1.0, 0.1, None, 20, 40),
    "cifar10": (("lenet5", "cnn2c1f"), "dirichlet", 0.5, 0.1, 5.0, None, 200),
    "cifar100": (("lenet5", "cnn2c1f"), "dirichlet", 0.5, 0.1, 5.0, None, 200),
    "svhn_cropped": (("lenet5", "cnn2c1f"), "dirichlet", 0.5, 0.1, 5.0, None, 200),
}
BATCH = 10


def method_options(method: str, model: str) -> dict:
    if method in ("feddh", "feddhe"):
        return dict(DH_RATES[MODEL_KIND.get(model, "lenet")])
    return {}


def skip_reason(dataset: str, method: str) -> str | None:
    """Why ``method`` cannot run on ``dataset`` under this protocol, or None."""
    if method == "feddhe" and SETUPS[dataset][1] == "natural":
        return "FedDHE needs a class-balanced server set, which a naturally partitioned dataset cannot spare"
    return None


def split_variant(entry: str) -> tuple[str, dict]:
    """``'fedad@target=literal;rate=0.3'`` -> ``('fedad', {'target': 'literal', 'rate': 0.3})``."""
    name, _, rest = entry.partition("@")
    overrides = {}
    for item in filter(None, rest.split(";")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"method variant {entry!r}: {item!r} is not option=value")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    return name, overrides


def variant_label(entry: str, labels: dict) -> str:
    name, _, rest = entry.partition("@")
    return labels.get(name, name) + (f"[{rest}]" if rest else "")


def run_one(dataset: str, model: str, method: str, seed: int, args, options=None) -> dict:
    """One run; ``options(method, model)`` gives the method's options (default: this benchmark's);
    ``method`` may be a variant ``name@option=value`` (see :func:`split_variant`)."""
    entry = method
    method, overrides = split_variant(entry)
    _, partition, alpha, lr, epochs, steps, rounds = SETUPS[dataset]
    if epochs is not None and args.local_epochs is not None:
        epochs = args.local_epochs
    if steps is not None and args.local_steps is not None:
        steps = args.local_steps
    config = RunConfig(
        method=method, dataset=dataset, data_dir=args.data_dir, model=model, partition=partition, alpha=alpha,
        num_clients=args.clients, cohort_size=args.cohort, rounds=args.rounds or rounds, local_epochs=epochs,
        local_steps=steps, batch_size=BATCH, client_lr=lr, momentum=0.0, seed=seed, eval_every=args.eval_every,
        out_dir=None, options={**(options or method_options)(method, model), **overrides},
    )
    start = time.perf_counter()
    sim = Simulation(config)
    records = list(sim.rounds())
    return {"dataset": dataset, "model": model, "method": entry, "seed": seed, "num_params": sim.num_params,
            "options": config.options, "local_epochs": epochs, "local_steps": steps, "rounds": config.rounds,
            "partition_digest": hashlib.sha1(sim.label_counts.astype(np.int64).tobytes()).hexdigest()[:12],
            "max_local_steps": int(sim.num_steps), "diagnostics": degree_diagnostics(sim),
            "records": records, "time_s": time.perf_counter() - start}


def _js(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """JS divergence (natural log) row by row."""
    m = (p + q) / 2

    def kl(a, b):
        return np.sum(np.where(a > 0, a * np.log(np.where(a > 0, a, 1) / np.where(b > 0, b, 1)), 0.0), axis=-1)

    return (kl(p, m) + kl(q, m)) / 2


def degree_diagnostics(sim: Simulation) -> dict:
    """For FedJS/FedDH/FedDHE: how far (υ, b) moved from (1, 0); for FedDHE, how good its estimates are."""
    if sim.config.method not in DEGREE_METHODS:
        return {}
    state = jax.device_get(sim.state.method_state.clients[1])  # reweight(fedavg, weighting): the weighting's
    upsilon, b, known = np.asarray(state.upsilon), np.asarray(state.b), np.asarray(state.known, bool)
    out = {"upsilon_min": float(upsilon.min()), "upsilon_max": float(upsilon.max()),
           "b_min": float(b.min()), "b_max": float(b.max()), "clients_known": int(known.sum())}
    if sim.config.method == "feddhe" and known.any():
        truth = sim.label_counts / sim.label_counts.sum(1, keepdims=True)
        estimate = np.asarray(state.distribution)
        uniform = np.full_like(truth, 1.0 / truth.shape[1])
        out["estimate_js_to_truth"] = float(_js(estimate[known], truth[known]).mean())
        out["uniform_js_to_truth"] = float(_js(uniform[known], truth[known]).mean())
    return out


def accuracy_curve(run: dict) -> tuple[np.ndarray, np.ndarray]:
    evaluated = [r for r in run["records"] if "test_accuracy" in r]
    return (np.array([r["cumulative_simulated_time_s"] for r in evaluated], float),
            np.array([r["test_accuracy"] for r in evaluated], float))


def time_to(run: dict, target: float) -> float:
    seconds, acc = accuracy_curve(run)
    hit = np.flatnonzero(acc >= target - 1e-12)
    return float(seconds[hit[0]]) if hit.size else math.inf


def summarize(runs: list[dict], target_fraction: float, methods=METHODS) -> list[dict]:
    """One row per (dataset, model, method), averaged over seeds; targets from FedAvg's best."""
    rows = []
    for dataset, model in sorted({(r["dataset"], r["model"]) for r in runs}):
        group = {(r["method"], r["seed"]): r for r in runs if (r["dataset"], r["model"]) == (dataset, model)}
        seeds = sorted({s for _, s in group})
        if not all(("fedavg", s) in group for s in seeds):
            continue  # no baseline to set the target
        target = target_fraction * float(np.mean([accuracy_curve(group["fedavg", s])[1].max() for s in seeds]))
        stats = {}
        for m in methods:
            if not all((m, s) in group for s in seeds):
                continue
            mine = [group[m, s] for s in seeds]
            times = [time_to(r, target) for r in mine]
            stats[m] = {
                "final_accuracy": float(np.mean([accuracy_curve(r)[1][-3:].mean() for r in mine])),
                "best_accuracy": float(np.mean([accuracy_curve(r)[1].max() for r in mine])),
                "time_to_target_s": float(np.mean(times)) if all(map(math.isfinite, times)) else None,
                "mflops_per_round": float(np.mean([np.mean([x["client_flops"] for x in r["records"]]) for r in mine])
                                          / 1e6),
                "total_simulated_time_s": float(np.mean([r["records"][-1]["cumulative_simulated_time_s"]
                                                         for r in mine])),
            }
        base = stats["fedavg"]
        for m, s in stats.items():
            rows.append({
                "dataset": dataset, "model": model, "method": m, "seeds": seeds, "target_accuracy": target,
                **s, "gap_to_fedavg": s["final_accuracy"] - base["final_accuracy"],
                "speedup_vs_fedavg": (base["time_to_target_s"] / s["time_to_target_s"]
                                      if s["time_to_target_s"] and base["time_to_target_s"] else None),
            })
    return rows


def claims(rows: list[dict]) -> list[dict]:
    """Per (dataset, model): FedDH − FedAvg and whether FedDH ≥ FedJS ≥ FedAvg (final accuracy)."""
    out = []
    for dataset, model in sorted({(r["dataset"], r["model"]) for r in rows}):
        acc = {r["method"]: r["final_accuracy"] for r in rows if (r["dataset"], r["model"]) == (dataset, model)}
        if not {"fedavg", "fedjs", "feddh"} <= set(acc):
            continue
        out.append({"dataset": dataset, "model": model, "feddh_minus_fedavg": acc["feddh"] - acc["fedavg"],
                    "feddh_minus_fedjs": acc["feddh"] - acc["fedjs"], "fedjs_minus_fedavg": acc["fedjs"] - acc["fedavg"],
                    "feddh_beats_fedavg": acc["feddh"] > acc["fedavg"],
                    "feddh_ge_fedjs_ge_fedavg": acc["feddh"] >= acc["fedjs"] >= acc["fedavg"],
                    "best_method": max(acc, key=acc.get)})
    return out


def table(rows: list[dict], claim_rows: list[dict], labels=None, claim_lines=None) -> str:
    labels = labels or LABELS
    lines = []
    w = max([8] + [len(labels[r["method"]]) for r in rows])
    for dataset, model in sorted({(r["dataset"], r["model"]) for r in rows}):
        mine = [r for r in rows if (r["dataset"], r["model"]) == (dataset, model)]
        lines.append(f"\n{dataset} / {model}  (seeds {','.join(map(str, mine[0]['seeds']))}; "
                     f"target = {mine[0]['target_accuracy']:.4f})")
        lines.append(f"{'method':<{w}} {'final':>7} {'best':>7} {'gap':>8} {'time→tgt s':>11} {'speed-up':>9} "
                     f"{'MFLOPs/rnd':>11}")
        for r in mine:
            t = "never" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.1f}"
            sp = "–" if r["speedup_vs_fedavg"] is None else f"{r['speedup_vs_fedavg']:.2f}x"
            lines.append(f"{labels[r['method']]:<{w}} {r['final_accuracy']:>7.4f} {r['best_accuracy']:>7.4f} "
                         f"{r['gap_to_fedavg']:>+8.4f} {t:>11} {sp:>9} {r['mflops_per_round']:>11.1f}")
    if claim_rows:
        lines.extend((claim_lines or feddh_claim_lines)(claim_rows))
    return "\n".join(lines)


def feddh_claim_lines(claim_rows: list[dict]) -> list[str]:
    lines = []
    if claim_rows:
        lines.append("\nclaims (final accuracy): FedDH > FedAvg; FedDH ≥ FedJS ≥ FedAvg")
        for c in claim_rows:
            lines.append(f"{c['dataset'] + ' / ' + c['model']:<20} FedDH−FedAvg {c['feddh_minus_fedavg']:+.4f}  "
                         f"FedDH−FedJS {c['feddh_minus_fedjs']:+.4f}  FedJS−FedAvg {c['fedjs_minus_fedavg']:+.4f}  "
                         f"FedDH>FedAvg: {'yes' if c['feddh_beats_fedavg'] else 'no'}  "
                         f"FedDH≥FedJS≥FedAvg: {'yes' if c['feddh_ge_fedjs_ge_fedavg'] else 'no'}  "
                         f"best: {variant_label(c['best_method'], LABELS)}")
    return lines


def plot(runs: list[dict], rows: list[dict], path: str, methods=METHODS, labels=None, highlight="feddh") -> None:
    """Test accuracy against simulated time, a panel per (dataset, model) at its first seed, one legend under
    them; a method's variant (``fedad@target=literal``) takes the method's colour, dashed; dotted grey: the
    target accuracy."""
    from matplotlib.lines import Line2D

    labels = labels or LABELS
    methods = tuple(methods) + tuple(dict.fromkeys(r["method"] for r in runs if r["method"] not in methods))
    groups = sorted({(r["dataset"], r["model"]) for r in runs})
    fig, axes = figure_style.figure(len(groups))
    for ax, (dataset, model) in zip(axes, groups):
        seed = min(r["seed"] for r in runs if (r["dataset"], r["model"]) == (dataset, model))
        for m in methods:
            mine = [r for r in runs if (r["dataset"], r["model"], r["method"], r["seed"]) == (dataset, model, m, seed)]
            if mine:
                seconds, acc = accuracy_curve(mine[0])
                ax.plot(seconds, acc, label=labels.get(m) or variant_label(m, labels),
                        color=figure_style.colour(m), ls="--" if "@" in m else "-",
                        lw=2.6 if m == highlight else 1.5, zorder=3 if m == highlight else 2)
        target = next((r["target_accuracy"] for r in rows if (r["dataset"], r["model"]) == (dataset, model)), None)
        if target is not None:
            ax.axhline(target, color="grey", ls=":", lw=1.2)
        ax.set(title=f"{dataset} / {model} (seed {seed})", xlabel="simulated time (s)", ylabel="test accuracy")
        ax.grid(True, alpha=0.3)
    figure_style.shared_legend(fig, axes, extra=[(Line2D([], [], color="grey", ls=":"), "target accuracy")])
    figure_style.save(fig, path)


def parse_targets(text: str, error) -> list[tuple[str, str]]:
    """``digits,mnist5k:lenet5`` -> [(dataset, model)], every model of a bare dataset."""
    pairs = []
    for entry in text.split(","):
        dataset, _, model = entry.partition(":")
        if dataset not in SETUPS:
            error(f"dataset {dataset!r} has no FedDH setup; choose from {', '.join(SETUPS)}")
        models = SETUPS[dataset][0]
        if model and model not in models:
            error(f"model {model!r} is not in the {dataset} setup; choose from {', '.join(models)}")
        pairs.extend((dataset, m) for m in ([model] if model else models))
    return pairs


@dataclasses.dataclass(frozen=True)
class Comparison:
    """One Table-3-shaped benchmark: its methods, their options and labels, and its claims."""

    name: str
    doc: str
    methods: tuple[str, ...]
    labels: dict
    options: Callable[[str, str], dict]
    skip_reason: Callable[[str, str], str | None]
    claims: Callable[[list[dict]], list[dict]]
    claim_lines: Callable[[list[dict]], list[str]]
    quick_methods: str
    highlight: str


def compare(argv, bench: Comparison) -> int:
    """The command line of a :class:`Comparison` (``python -m benchmarks.<name>``)."""
    methods_all = bench.methods
    p = argparse.ArgumentParser(prog=f"python -m benchmarks.{bench.name}", description=bench.doc.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help=f"a smoke test: digits LeNet5, {bench.quick_methods}, 2 rounds, N=10, K=3, 1 local epoch")
    p.add_argument("--datasets", default=None,
                   help="dataset or dataset:model entries (default digits,mnist5k,synthetic,cifar10,cifar100,"
                        "svhn_cropped)")
    p.add_argument("--methods", default=None, help=f"default: {','.join(methods_all)}")
    p.add_argument("--rounds", type=int, default=None, help="rounds of every run (default: the dataset's)")
    p.add_argument("--local-epochs", type=float, default=None,
                   help="local epochs of the epoch-based setups (paper and default: 5)")
    p.add_argument("--local-steps", type=int, default=None, help="local steps of synthetic (default 20)")
    p.add_argument("--seeds", default="0")
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--cohort", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=1)
    p.add_argument("--target-fraction", type=float, default=0.9, help="target accuracy = this × FedAvg's best")
    p.add_argument("--tag", default="", help="appended to the output file names")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    if args.quick:
        args.datasets = args.datasets or "digits:lenet5"
        args.methods = args.methods or bench.quick_methods
        args.rounds, args.clients, args.cohort, args.local_epochs = 2, 10, 3, 1.0
    args.datasets = args.datasets or "digits,mnist5k,synthetic,cifar10,cifar100,svhn_cropped"
    args.methods = args.methods or ",".join(methods_all)
    if not 0 < args.target_fraction <= 1:
        p.error(f"target fraction {args.target_fraction} must be in (0, 1]")
    methods = args.methods.split(",")
    try:
        unknown = [m for m in methods if split_variant(m)[0] not in methods_all]
    except ValueError as e:
        p.error(str(e))
    if unknown or "fedavg" not in methods:
        p.error(f"methods must include fedavg (the target's reference) and come from {', '.join(methods_all)} "
                f"(or be their variants name@option=value); got {args.methods!r}")
    # variants (name@option=value) run after the names they vary, labelled with their options
    methods_all = tuple(methods_all) + tuple(m for m in methods if m not in methods_all)
    labels = {**bench.labels, **{m: variant_label(m, bench.labels) for m in methods}}
    seeds = [int(s) for s in args.seeds.split(",")]
    pairs = parse_targets(args.datasets, p.error)
    os.makedirs(args.out, exist_ok=True)
    runs, notes, t0 = [], [], time.perf_counter()
    unavailable = set()
    for dataset, model in pairs:
        if dataset in unavailable:
            continue
        try:
            for seed in seeds:
                for method in methods:
                    reason = bench.skip_reason(dataset, split_variant(method)[0])
                    if reason:
                        note = f"{dataset}/{model}: {labels[method]} skipped ({reason})"
                        if note not in notes:
                            notes.append(note)
                            print(note, file=sys.stderr)
                        continue
                    run = run_one(dataset, model, method, seed, args, bench.options)
                    runs.append(run)
                    _, acc = accuracy_curve(run)
                    last = run["records"][-1]
                    print(f"{dataset:<9} {model:<8} seed {seed} {labels[method]:<8} acc {acc[-1]:.4f} best "
                          f"{acc.max():.4f} sim {last['cumulative_simulated_time_s']:8.1f}s  "
                          f"{run['time_s']:.1f}s", flush=True)
        except DataError as e:  # a tfds dataset not prepared here
            unavailable.add(dataset)
            notes.append(f"{dataset}: skipped ({e})")
            print(notes[-1], file=sys.stderr)
    rows = summarize(runs, args.target_fraction, methods_all) if runs else []
    claim_rows = bench.claims(rows)
    print(table(rows, claim_rows, labels, bench.claim_lines))
    for note in notes:
        print(f"note: {note}")
    slug = device_slug() + ("-quick" if args.quick else "") + (f"-{args.tag}" if args.tag else "")
    result = {
        "benchmark": bench.name,
        "device": {"platform": jax.devices()[0].platform, "device_kind": jax.devices()[0].device_kind,
                   "jax_version": jax.__version__},
        "protocol": {**vars(args), "batch_size": BATCH, "momentum": 0.0, "lr_decay": None,
                     "setups": {d: SETUPS[d] for d in {d for d, _ in pairs}},
                     "options": {m: {model: {**bench.options(split_variant(m)[0], model), **split_variant(m)[1]}
                                     for _, model in pairs} for m in methods}},
        "notes": notes, "summary": rows, "claims": claim_rows, "runs": runs,
        "total_time_s": time.perf_counter() - t0,
    }
    json_path = os.path.join(args.out, f"{bench.name}-{slug}.json")
    with open(json_path, "w") as f:
        json.dump(stamp(result), f, default=lambda o: o.item() if isinstance(o, np.generic) else str(o))
    if runs:
        plot(runs, rows, os.path.join(args.out, f"{bench.name}-{slug}.png"), methods_all, labels,
             bench.highlight)
    print(f"\nwrote {json_path}  ({time.perf_counter() - t0:.0f}s)")
    return 0


FEDDH = Comparison(name="feddh", doc=__doc__, methods=METHODS, labels=LABELS, options=method_options,
                   skip_reason=skip_reason, claims=claims, claim_lines=feddh_claim_lines,
                   quick_methods="fedavg,feddh", highlight="feddh")


def main(argv=None) -> int:
    return compare(argv, FEDDH)


if __name__ == "__main__":
    sys.exit(main())
