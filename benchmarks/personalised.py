"""The personalised methods side by side: each client's own model on its held-out split (issue 55).

FedSPU and the dropout family (FedDrop, FjORD, Hermes, FedMP, PruneFL, FedSelect; five equal tiers of keep
ratios 0.2 … 1.0, as in FedSPU's benchmark), the personal-layers methods (FedPer, LG-FedAvg, FedRep, FedBN,
FedBABU, Ditto) and the plain baseline, FedAvg whose final global model every client fine-tunes on its own
training data for ``FINETUNE_EPOCHS`` epochs (FedBABU's τ_f) before it is evaluated.  Every client splits
its data 70 / 30 (train / held out); personalised accuracy is its own model on its held-out split, given as
mean ± std over the clients of every seed.  The data setups are FedSPU's (:data:`benchmarks.fedspu.SETUPS`):
digits with the CNN of FedSPU's paper (Dirichlet α), Synthetic(α, α) with the MLP (its natural partition).

FedBN keeps the BatchNorm layers local and is refused on a model without them: its rows run on
``resnet20`` (BatchNorm after every conv) on image data, and on Synthetic (vectors; no zoo model with
BatchNorm takes them) it is left out with a note.  Its row therefore compares a different model with the
others; read it against FedAvg + FT only loosely.

Usage::

    python -m benchmarks.personalised [--size cpu|paper|tiny] [--methods fedspu,fedper,...]
        [--datasets digits,synthetic] [--out DIR] [--tag TAG] [--fresh]

Writes ``<out>/personalised-<device>-<size>[-TAG].json`` and ``.png`` after every row (dataset, α, method;
the seeds of a row run together as replicas) and continues such a file when run again with the same
settings (:mod:`benchmarks.families`).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from benchmarks import families, fedspu, figure_style
from fedpartial._src.experiment.config import RunConfig
from fedpartial._src.methods.submodel.common import DEFAULT_TIERS

METHODS = ("fedavg_ft", "fedspu", "feddrop", "fjord", "hermes", "fedmp", "prunefl", "fedselect", "fedper",
           "lgfedavg", "fedrep", "fedbn", "fedbabu", "ditto")
LABELS = {**fedspu.LABELS, "fedavg_ft": "FedAvg + FT", "fedbn": "FedBN (resnet20)"}
TIERED = ("feddrop", "fjord", "hermes", "fedmp", "prunefl", "fedspu")  # take the five keep-ratio tiers
FINETUNE_EPOCHS = 5.0
BN_MODEL = "resnet20"
IMAGES = ("digits", "mnist5k")

#: clients, cohort, rounds, local epochs (digits, mnist5k; Synthetic runs its setup's 20 local steps), seeds
SIZES = {
    "cpu": dict(datasets=("digits", "synthetic"), alphas=(0.1, 0.5), seeds=(0, 1), clients=40, cohort=8,
                rounds=30, local_epochs=1.0, eval_every=5),
    "paper": dict(datasets=("digits", "mnist5k", "synthetic"), alphas=(0.1, 0.5), seeds=(0, 1), clients=100,
                  cohort=10, rounds=200, local_epochs=5.0, eval_every=20),
    "tiny": dict(datasets=("synthetic",), alphas=(0.5,), seeds=(0, 1), clients=8, cohort=4, rounds=2,
                 local_epochs=1.0, eval_every=2),
}


def config_for(dataset: str, alpha: float, method: str, s: dict) -> RunConfig:
    model, batch, lr, momentum, steps, partition = fedspu.SETUPS[dataset]
    return RunConfig(
        method="fedavg" if method == "fedavg_ft" else method, dataset=dataset,
        model=BN_MODEL if method == "fedbn" else model, partition=partition, alpha=alpha,
        num_clients=s["clients"], cohort_size=s["cohort"], rounds=s["rounds"], local_steps=steps,
        local_epochs=None if steps else s["local_epochs"], batch_size=batch, client_lr=lr, momentum=momentum,
        options={"tiers": DEFAULT_TIERS} if method in TIERED else {}, train_fraction=0.7, seed=s["seeds"][0],
        eval_every=s["eval_every"], out_dir=None)


def fine_tuned(sim) -> tuple[float, float]:
    """FedAvg + FT: every client's copy of the final global model fine-tuned on its training data and
    evaluated on its held-out split (mean and std over clients)."""
    from fedpartial._src.experiment.finetune import evaluate_finetuned
    from fedpartial._src.experiment.parts import make_client_optimizer

    out = evaluate_finetuned(sim.model, sim.state.variables, make_client_optimizer(sim.config),
                             sim.dataset.x_train, sim.dataset.y_train, sim.clients, sim.holdout,
                             epochs=FINETUNE_EPOCHS, batch_size=sim.config.batch_size, seed=sim.config.seed)
    return out["mean"], out["std"]


def run_row(dataset: str, alpha: float, method: str, s: dict) -> dict:
    cache: dict = {}
    args = argparse.Namespace(data_dir=None, clients=s["clients"])
    done = families.run_seeds(config_for(dataset, alpha, method, s), s["seeds"],
                                             lambda c: fedspu.load(dataset, alpha, c.seed, args, cache))
    records, sims = done.records, done.sims
    last = [next(r for r in reversed(rs) if "personal_accuracy" in r) for rs in records]
    if method == "fedavg_ft":
        means, stds = zip(*(fine_tuned(sim) for sim in sims))
    else:
        means, stds = [r["personal_accuracy"] for r in last], [r["personal_accuracy_std"] for r in last]
    mean, std = families.pooled(means, stds)
    return {"dataset": dataset, "alpha": alpha, "method": method, "label": LABELS[method],
            "model": sims[0].model.name, "seeds": list(s["seeds"]), "personal_accuracy": mean,
            "personal_accuracy_std": std, "per_seed": [float(m) for m in means],
            "global_client_accuracy": float(np.mean([r["global_client_accuracy"] for r in last])),
            "test_accuracy": float(np.mean([r["test_accuracy"] for r in last])),
            "upload_bytes": float(np.mean([rs[-1]["cumulative_upload_bytes"] for rs in records])),
            "rounds": len(records[0]), "curve": families.mean_curve(records, "personal_accuracy"),
            "wall_s": done.wall_s, "cpu_s": done.cpu_s}


def table(rows: list[dict]) -> str:
    """Methods down, (dataset, α) across: personal accuracy % mean ± std over clients and seeds."""
    cols = list(dict.fromkeys((r["dataset"], r["alpha"]) for r in rows))
    by = {(r["dataset"], r["alpha"], r["method"]): r for r in rows}
    lines = ["| method | " + " | ".join(f"{d}, α={a}" for d, a in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for m in METHODS:
        if any((d, a, m) in by for d, a in cols):
            cells = [f"{100 * by[d, a, m]['personal_accuracy']:.1f} ± {100 * by[d, a, m]['personal_accuracy_std']:.1f}"
                     if (d, a, m) in by else "—" for d, a in cols]
            lines.append(f"| {LABELS[m]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def figure(rows: list[dict], path: str) -> None:
    """One panel per (dataset, α), two a row: every method's personal accuracy, mean ± std over clients and
    seeds, each bar in its method's colour and named on its axis (no legend needed)."""
    panels = list(dict.fromkeys((r["dataset"], r["alpha"]) for r in rows))
    fig, axes = figure_style.figure(len(panels), height=4.6, columns=2)
    for ax, (dataset, alpha) in zip(axes, panels):
        mine = sorted((r for r in rows if r["dataset"] == dataset and r["alpha"] == alpha),
                      key=lambda r: METHODS.index(r["method"]))
        y = np.arange(len(mine))
        ax.barh(y, [100 * r["personal_accuracy"] for r in mine], xerr=[100 * r["personal_accuracy_std"] for r in mine],
                color=[figure_style.colour(r["method"]) for r in mine], capsize=2)
        ax.set_yticks(y, [r["label"] for r in mine])
        ax.invert_yaxis()
        ax.set_xlim(0, 100)
        ax.set_xlabel("personal accuracy (%)")
        ax.set_title(f"{dataset}, α={alpha}")
        ax.grid(True, axis="x", alpha=0.3)
    figure_style.shared_legend(fig, axes)
    figure_style.save(fig, path)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = families.parser("personalised", __doc__, METHODS, "cpu: 2 CPU cores within 75 min; "
                        "paper: N=100, K=10, 3 data sets, 200 rounds; tiny: a smoke test")
    args = p.parse_args(argv)
    s, methods = families.chosen(p, args, SIZES, METHODS, fedspu.SETUPS)
    settings = {**s, "methods": methods, "train_fraction": 0.7, "finetune_epochs": FINETUNE_EPOCHS,
                "tiers": DEFAULT_TIERS, "bn_model": BN_MODEL,
                "setups": {d: dict(zip(("model", "batch_size", "client_lr", "momentum", "local_steps", "partition"),
                                       fedspu.SETUPS[d])) for d in s["datasets"]}}
    progress = families.Progress("personalised", families.result_path(args.out, "personalised", args.size, args.tag),
                                 settings, ("dataset", "alpha", "method"), argv, fresh=args.fresh, figure=figure)
    t0 = time.perf_counter()
    for dataset in s["datasets"]:
        for alpha in s["alphas"]:
            for method in methods:
                if method == "fedbn" and dataset not in IMAGES:
                    progress.note(f"FedBN is left out on {dataset}: no zoo model with BatchNorm takes its vectors, "
                                  "and without BatchNorm FedBN is FedAvg")
                    continue
                if progress.has(dataset=dataset, alpha=alpha, method=method):
                    continue
                row = run_row(dataset, alpha, method, s)
                progress.add(row)
                print(f"{dataset:<9} α={alpha:<4} {row['label']:<17} personal acc {row['personal_accuracy']:.4f} "
                      f"± {row['personal_accuracy_std']:.4f}  {row['wall_s']:.1f}s (CPU {row['cpu_s']:.0f}s)",
                      flush=True)
    print("\n" + table(progress.rows))
    print(f"\nwrote {progress.path} ({time.perf_counter() - t0:.0f}s this run, "
          f"{progress.data['total_time_s']:.0f}s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
