"""Client drift correction side by side: SCAFFOLD, FedAvg, FedProx, FedNova and FedDyn at low α (issue 55).

Every method trains the whole model from the same seeds, partitions and cohorts; the question is how much
accuracy each gets for the rounds it runs and for the bytes it sends.  SCAFFOLD sends its control variates
with the model both ways (twice FedAvg's traffic); FedProx and FedDyn change only the local objective
(their defaults, μ = 0.01 and α = 0.01), FedNova the aggregation.  Clients train with plain SGD (no
momentum), as SCAFFOLD's and FedNova's analyses assume, for one local epoch (so clients of different sizes
take different numbers of steps, which FedNova normalises).  digits: the CNN of FedSPU's paper,
Dirichlet α; Synthetic(α, α) with the MLP (its natural partition).  Accuracy is the global model's on the
test set, the mean over seeds at every evaluation; bytes are upload plus download, cumulative.

Usage::

    python -m benchmarks.drift [--size cpu|paper|tiny] [--methods scaffold,fedavg,...]
        [--datasets digits,synthetic] [--out DIR] [--tag TAG] [--fresh]

Writes ``<out>/drift-<device>-<size>[-TAG].json`` and ``.png`` (accuracy against rounds and against MB)
after every row and continues such a file when run again with the same settings (:mod:`benchmarks.families`).
"""

from __future__ import annotations

import sys
import time

import numpy as np

from benchmarks import families, figure_style
from fedpartial._src.data import sources
from fedpartial._src.experiment.config import RunConfig

METHODS = ("fedavg", "scaffold", "fedprox", "fednova", "feddyn")
LABELS = {"fedavg": "FedAvg", "scaffold": "SCAFFOLD", "fedprox": "FedProx", "fednova": "FedNova", "feddyn": "FedDyn"}
#: dataset -> (model, batch, client lr, momentum, local epochs, partition).  Local epochs, not steps: clients
#: of different sizes then take different numbers of steps, which is what FedNova normalises (with equal
#: steps it is FedAvg).
SETUPS = {
    "digits": ("cnn2c1f", 16, 0.05, 0.0, 1.0, "dirichlet"),
    "mnist5k": ("cnn2c1f", 16, 0.05, 0.0, 1.0, "dirichlet"),
    "synthetic": ("mlp", 10, 0.01, 0.0, 1.0, "natural"),
}
SIZES = {
    "cpu": dict(datasets=("digits", "synthetic"), alphas=(0.1,), seeds=(0, 1), clients=40, cohort=8, rounds=50,
                eval_every=5),
    "paper": dict(datasets=("digits", "mnist5k", "synthetic"), alphas=(0.1, 0.5), seeds=(0, 1), clients=100,
                  cohort=10, rounds=200, eval_every=5),
    "tiny": dict(datasets=("synthetic",), alphas=(0.1,), seeds=(0, 1), clients=8, cohort=4, rounds=2, eval_every=1),
}


def config_for(dataset: str, alpha: float, method: str, s: dict) -> RunConfig:
    model, batch, lr, momentum, epochs, partition = SETUPS[dataset]
    return RunConfig(method=method, dataset=dataset, model=model, partition=partition, alpha=alpha,
                     num_clients=s["clients"], cohort_size=s["cohort"], rounds=s["rounds"], local_epochs=epochs,
                     batch_size=batch, client_lr=lr, momentum=momentum, seed=s["seeds"][0],
                     eval_every=s["eval_every"], out_dir=None)


def run_row(dataset: str, alpha: float, method: str, s: dict) -> dict:
    cache: dict = {}

    def dataset_for(c):
        if c.seed not in cache:
            options = dict(alpha=alpha, beta=alpha, num_clients=s["clients"]) if dataset == "synthetic" else {}
            cache[c.seed] = sources.load_dataset(dataset, seed=c.seed, **options)
        return cache[c.seed]

    done = families.run_seeds(config_for(dataset, alpha, method, s), s["seeds"], dataset_for)
    for rs in done.records:
        for r in rs:
            r["cumulative_mb"] = (r["cumulative_upload_bytes"] + r["cumulative_download_bytes"]) / 1e6
    last = [next(r for r in reversed(rs) if "test_accuracy" in r) for rs in done.records]
    acc = [r["test_accuracy"] for r in last]
    best = [max(r["test_accuracy"] for r in rs if "test_accuracy" in r) for rs in done.records]
    return {"dataset": dataset, "alpha": alpha, "method": method, "label": LABELS[method],
            "model": done.sims[0].model.name, "seeds": list(s["seeds"]), "test_accuracy": float(np.mean(acc)),
            "test_accuracy_std": float(np.std(acc)), "best_accuracy": float(np.mean(best)),
            "mb_per_round": float(np.mean([rs[-1]["cumulative_mb"] / len(rs) for rs in done.records])),
            "total_mb": float(np.mean([rs[-1]["cumulative_mb"] for rs in done.records])),
            "rounds": len(done.records[0]), "curve": families.mean_curve(done.records, "test_accuracy"),
            "bytes_curve": [(mb, acc) for (_, acc), (_, mb) in zip(
                families.mean_curve(done.records, "test_accuracy"),
                families.mean_curve([[r for r in rs if "test_accuracy" in r] for rs in done.records],
                                    "cumulative_mb"))],
            "wall_s": done.wall_s, "cpu_s": done.cpu_s}


def claims(rows: list[dict]) -> list[dict]:
    """Per (data set, α): SCAFFOLD's final accuracy minus FedAvg's, and the accuracy each reaches for the
    bytes FedAvg sends in its whole run (SCAFFOLD's curve read at FedAvg's total)."""
    out = []
    for dataset, alpha in dict.fromkeys((r["dataset"], r["alpha"]) for r in rows):
        by = {r["method"]: r for r in rows if r["dataset"] == dataset and r["alpha"] == alpha}
        if "scaffold" not in by or "fedavg" not in by:
            continue
        budget = by["fedavg"]["total_mb"]
        within = [acc for mb, acc in by["scaffold"]["bytes_curve"] if mb <= budget * (1 + 1e-9)]
        out.append({"dataset": dataset, "alpha": alpha,
                    "scaffold_minus_fedavg": by["scaffold"]["test_accuracy"] - by["fedavg"]["test_accuracy"],
                    "scaffold_at_fedavg_bytes": within[-1] if within else None,
                    "fedavg_final": by["fedavg"]["test_accuracy"]})
    return out


def table(rows: list[dict]) -> str:
    lines = ["| data | method | final acc % | best acc % | MB/round (up + down) | total MB |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['dataset']}, α={r['alpha']} | {r['label']} | {100 * r['test_accuracy']:.1f} ± "
                     f"{100 * r['test_accuracy_std']:.1f} | {100 * r['best_accuracy']:.1f} | {r['mb_per_round']:.3f} | "
                     f"{r['total_mb']:.1f} |")
    return "\n".join(lines)


def figure(rows: list[dict], path: str) -> None:
    """Per (data set, α), a row: test accuracy against rounds (left) and against MB sent (right), mean over
    seeds; one legend under the panels."""
    panels = list(dict.fromkeys((r["dataset"], r["alpha"]) for r in rows))
    fig, axes = figure_style.figure(2 * len(panels), height=3.4, columns=2)
    for col, (dataset, alpha) in enumerate(panels):
        rounds, sent = axes[2 * col], axes[2 * col + 1]
        for r in (r for r in rows if r["dataset"] == dataset and r["alpha"] == alpha):
            for ax, curve in zip((rounds, sent), (r["curve"], r["bytes_curve"])):
                if curve:
                    x, y = zip(*curve)
                    ax.plot(x, 100 * np.asarray(y), marker=".", color=figure_style.colour(r["method"]),
                            label=r["label"])
        rounds.set(xlabel="round", ylabel="test accuracy (%)", title=f"{dataset}, α={alpha}")
        sent.set(xlabel="MB sent (up + down)", ylabel="test accuracy (%)", title=f"{dataset}: against bytes")
        for ax in (rounds, sent):
            ax.grid(True, alpha=0.3)
    figure_style.shared_legend(fig, axes)
    figure_style.save(fig, path)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = families.parser("drift", __doc__, METHODS, "cpu: 2 CPU cores within 20 min; "
                        "paper: N=100, K=10, 3 data sets; tiny: a smoke test")
    args = p.parse_args(argv)
    s, methods = families.chosen(p, args, SIZES, METHODS, SETUPS)
    settings = {**s, "methods": methods,
                "setups": {d: dict(zip(("model", "batch_size", "client_lr", "momentum", "local_epochs", "partition"),
                                       SETUPS[d])) for d in s["datasets"]}}
    progress = families.Progress("drift", families.result_path(args.out, "drift", args.size, args.tag), settings,
                                 ("dataset", "alpha", "method"), argv, fresh=args.fresh, figure=figure)
    t0 = time.perf_counter()
    for dataset in s["datasets"]:
        for alpha in s["alphas"]:
            for method in methods:
                if progress.has(dataset=dataset, alpha=alpha, method=method):
                    continue
                row = run_row(dataset, alpha, method, s)
                progress.add(row)
                progress.data["claims"] = claims(progress.rows)
                progress.write()
                print(f"{dataset:<9} α={alpha:<4} {row['label']:<9} acc {row['test_accuracy']:.4f}  "
                      f"{row['mb_per_round']:.3f} MB/round  {row['wall_s']:.1f}s (CPU {row['cpu_s']:.0f}s)", flush=True)
    print("\n" + table(progress.rows))
    print(f"\nwrote {progress.path} ({time.perf_counter() - t0:.0f}s this run, "
          f"{progress.data['total_time_s']:.0f}s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
