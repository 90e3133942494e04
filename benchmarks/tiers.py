"""Capacity tiers side by side: EmbracingFL, DepthFL, InclusiveFL, FedRolex, HeteroFL and FIARSE on
EmbracingFL's capacity cases (issue 55).

The rows of the EmbracingFL benchmark (:mod:`benchmarks.embracingfl`, which reproduces that paper's own
tables at full participation) at the issue's protocol: N clients of which K train a round, stratified by
tier, the strong / moderate / weak counts of EmbracingFL's case 5 (half strong, half weak) and case 10
(1/8 strong, 1/8 moderate, 3/4 weak), scaled to N.  Width reduction (HeteroFL, FedRolex) keeps the
moderate and weak tiers' default widths 7/16 and 3/16; FIARSE, whose keep ratios go to equal clusters of
clients by id, gets clusters that line up with the tiers and keeps each tier the share of parameters its
width-reduced model holds (the width squared: 1, 0.19, 0.035), so that every method gives a tier the same
budget.  Every client holds 20 % of its data out.

Per row (data set, case, method; the seeds run together as replicas):

* **global accuracy** — the final global model on the test set (mean ± std over seeds);
* **weak clients' accuracy** — the final global model on the weak clients' held-out splits (mean over
  those clients and the seeds): what the federation gives the clients that could train least of it;
  for DepthFL and InclusiveFL the shallowest exit's test accuracy (the model a weak device can run) is
  given beside it;
* **upload per round** (MB, the mean over rounds) and **simulated time per round** (s, the device
  model's default distributions: docs/costs.md).

Usage::

    python -m benchmarks.tiers [--size cpu|paper|tiny] [--methods embracingfl,depthfl,...]
        [--datasets digits,synthetic] [--cases 5,10] [--out DIR] [--tag TAG] [--fresh]

Writes ``<out>/tiers-<device>-<size>[-TAG].json`` and ``.png`` after every row and continues such a file
when run again with the same settings (:mod:`benchmarks.families`).
"""

from __future__ import annotations

import math
import sys
import time

import numpy as np

from benchmarks import families, figure_style
from fedpartial._src.core.types import PersonalModels
from fedpartial._src.data import sources
from fedpartial._src.experiment.config import RunConfig
from fedpartial._src.experiment.evaluation import evaluate_clients
from fedpartial._src.methods.tiered.heterofl import DEFAULT_WIDTHS
from fedpartial._src.methods.tiered.tiers import resolve_mix

METHODS = ("embracingfl", "depthfl", "inclusivefl", "fedrolex", "heterofl", "fiarse")
LABELS = {"embracingfl": "EmbracingFL", "depthfl": "DepthFL", "inclusivefl": "InclusiveFL", "fedrolex": "FedRolex",
          "heterofl": "HeteroFL", "fiarse": "FIARSE"}
TRAIN_FRACTION = 0.8
#: dataset -> (model, batch, client lr, momentum, local steps, partition)
SETUPS = {
    "digits": ("cnn2c1f", 16, 0.05, 0.9, 5, "dirichlet"),
    "mnist5k": ("cnn2c1f", 16, 0.05, 0.9, 10, "dirichlet"),
    "synthetic": ("mlp", 10, 0.01, 0.9, 10, "natural"),
}
SIZES = {
    "cpu": dict(datasets=("digits", "synthetic"), alphas=(0.5,), cases=(5, 10), seeds=(0, 1), clients=32,
                cohort=8, rounds=50, eval_every=5),
    "paper": dict(datasets=("digits", "mnist5k", "synthetic"), alphas=(0.1, 0.5), cases=(5, 10), seeds=(0, 1),
                  clients=100, cohort=10, rounds=200, eval_every=10),
    "tiny": dict(datasets=("synthetic",), alphas=(0.5,), cases=(10,), seeds=(0, 1), clients=8, cohort=4, rounds=2,
                 eval_every=2),
}


def fiarse_ratios(num_clients: int, case: int) -> tuple[float, ...]:
    """FIARSE's keep ratios for ``case``: equal clusters by id (``gcd`` of the tier counts clients each) lined up
    with the tiers, each keeping its tier's width-reduced share of the parameters (the width squared)."""
    counts = resolve_mix(num_clients, capacity_case=case).counts
    size = math.gcd(*[c for c in counts if c])
    shares = (1.0, DEFAULT_WIDTHS[0] ** 2, DEFAULT_WIDTHS[1] ** 2)
    return tuple(round(share, 6) for count, share in zip(counts, shares) for _ in range(count // size))


def config_for(dataset: str, alpha: float, case: int, method: str, s: dict) -> RunConfig:
    model, batch, lr, momentum, steps, partition = SETUPS[dataset]
    options = {"ratios": fiarse_ratios(s["clients"], case)} if method == "fiarse" else {"capacity_case": case}
    return RunConfig(method=method, dataset=dataset, model=model, partition=partition, alpha=alpha,
                     num_clients=s["clients"], cohort_size=s["cohort"], rounds=s["rounds"], local_steps=steps,
                     batch_size=batch, client_lr=lr, momentum=momentum, options=options,
                     train_fraction=TRAIN_FRACTION, seed=s["seeds"][0], eval_every=s["eval_every"], out_dir=None)


def weak_accuracy(sim, case: int) -> float:
    """The global model's mean accuracy over the weak clients' held-out splits."""
    weak = list(resolve_mix(sim.config.num_clients, capacity_case=case).members(2))
    x, y, mask = sim.holdout
    out = evaluate_clients(sim.model, PersonalModels(variables=sim.state.variables, stacked=False), x, y, mask)
    return float(np.nanmean(out["accuracy"][weak]))


def run_row(dataset: str, alpha: float, case: int, method: str, s: dict) -> dict:
    cache: dict = {}

    def dataset_for(c):
        if c.seed not in cache:
            options = dict(alpha=alpha, beta=alpha, num_clients=s["clients"]) if dataset == "synthetic" else {}
            cache[c.seed] = sources.load_dataset(dataset, seed=c.seed, **options)
        return cache[c.seed]

    done = families.run_seeds(config_for(dataset, alpha, case, method, s), s["seeds"], dataset_for)
    last = [next(r for r in reversed(rs) if "test_accuracy" in r) for rs in done.records]
    acc = [r["test_accuracy"] for r in last]
    exit1 = [r["test_accuracy_exit1"] for r in last if "test_accuracy_exit1" in r]
    return {"dataset": dataset, "alpha": alpha, "case": case, "method": method, "label": LABELS[method],
            "mix": list(resolve_mix(s["clients"], capacity_case=case).counts), "model": done.sims[0].model.name,
            "seeds": list(s["seeds"]), "test_accuracy": float(np.mean(acc)), "test_accuracy_std": float(np.std(acc)),
            "weak_accuracy": float(np.mean([weak_accuracy(sim, case) for sim in done.sims])),
            "weak_exit_accuracy": float(np.mean(exit1)) if exit1 else None,
            "upload_mb_per_round": float(np.mean([r["upload_bytes"] for rs in done.records for r in rs])) / 1e6,
            "simulated_s_per_round": float(np.mean([r["simulated_time_s"] for rs in done.records for r in rs])),
            "rounds": len(done.records[0]), "curve": families.mean_curve(done.records, "test_accuracy"),
            "wall_s": done.wall_s, "cpu_s": done.cpu_s}


def table(rows: list[dict]) -> str:
    lines = ["| data | case (S,M,W) | method | global acc % | weak clients' acc % | upload MB/round | "
             "simulated s/round |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        weak = f"{100 * r['weak_accuracy']:.1f}" + (f" (exit 1: {100 * r['weak_exit_accuracy']:.1f})"
                                                    if r.get("weak_exit_accuracy") is not None else "")
        lines.append(f"| {r['dataset']}, α={r['alpha']} | {r['case']} {tuple(r['mix'])} | {r['label']} | "
                     f"{100 * r['test_accuracy']:.1f} ± {100 * r['test_accuracy_std']:.1f} | {weak} | "
                     f"{r['upload_mb_per_round']:.3f} | {r['simulated_s_per_round']:.2f} |")
    return "\n".join(lines)


def figure(rows: list[dict], path: str) -> None:
    """Per (data set, α), a row: global accuracy per method and case (bars; the weak clients' accuracy a black
    tick on each), and beside it accuracy against upload per round (a point per method and case, the case its
    marker); one legend under the panels."""
    from matplotlib.lines import Line2D

    panels = list(dict.fromkeys((r["dataset"], r["alpha"]) for r in rows))
    fig, axes = figure_style.figure(2 * len(panels), height=3.8, columns=2)
    cases = sorted({r["case"] for r in rows})
    markers = dict(zip(cases, "o^sDv"))
    for col, (dataset, alpha) in enumerate(panels):
        mine = [r for r in rows if r["dataset"] == dataset and r["alpha"] == alpha]
        shown = [m for m in METHODS if any(r["method"] == m for r in mine)]
        ax, width = axes[2 * col], 0.8 / max(len(shown), 1)
        for i, m in enumerate(shown):
            for j, case in enumerate(cases):
                r = next((r for r in mine if r["method"] == m and r["case"] == case), None)
                if r is None:
                    continue
                x = j + (i - (len(shown) - 1) / 2) * width
                ax.bar(x, 100 * r["test_accuracy"], width, color=figure_style.colour(m), label=LABELS[m])
                ax.plot(x, 100 * r["weak_accuracy"], "k_", markersize=9)
        ax.set_xticks(range(len(cases)), [f"case {c}" for c in cases])
        ax.set(ylabel="accuracy (%)", title=f"{dataset}, α={alpha}")
        ax = axes[2 * col + 1]
        for m in shown:
            for r in (r for r in mine if r["method"] == m):
                ax.scatter(r["upload_mb_per_round"], 100 * r["test_accuracy"], color=figure_style.colour(m), s=50,
                           marker=markers[r["case"]])
        ax.set(xlabel="upload per round (MB)", ylabel="global accuracy (%)", title=f"{dataset}: against upload")
        ax.grid(True, alpha=0.3)
    extra = [(Line2D([], [], color="k", marker="_", ls="", markersize=9), "weak clients' accuracy")]
    extra += [(Line2D([], [], color="#444444", marker=mk, ls=""), f"case {c}") for c, mk in markers.items()]
    figure_style.shared_legend(fig, axes, extra=extra)
    figure_style.save(fig, path)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = families.parser("tiers", __doc__, METHODS, "cpu: 2 CPU cores within 40 min; "
                        "paper: N=100, K=10, 3 data sets; tiny: a smoke test")
    p.add_argument("--cases", default=None, help="EmbracingFL capacity cases (default: the size's, 5 and 10)")
    args = p.parse_args(argv)
    s, methods = families.chosen(p, args, SIZES, METHODS, SETUPS)
    if args.cases:
        s["cases"] = families.ints(args.cases)
    settings = {**s, "methods": methods, "train_fraction": TRAIN_FRACTION, "widths": DEFAULT_WIDTHS,
                "setups": {d: dict(zip(("model", "batch_size", "client_lr", "momentum", "local_steps", "partition"),
                                       SETUPS[d])) for d in s["datasets"]}}
    progress = families.Progress("tiers", families.result_path(args.out, "tiers", args.size, args.tag), settings,
                                 ("dataset", "alpha", "case", "method"), argv, fresh=args.fresh, figure=figure)
    t0 = time.perf_counter()
    for dataset in s["datasets"]:
        for alpha in s["alphas"]:
            for case in s["cases"]:
                for method in methods:
                    if progress.has(dataset=dataset, alpha=alpha, case=case, method=method):
                        continue
                    row = run_row(dataset, alpha, case, method, s)
                    progress.add(row)
                    print(f"{dataset:<9} α={alpha:<4} case {case:<2} {row['label']:<12} acc {row['test_accuracy']:.4f} "
                          f"weak {row['weak_accuracy']:.4f}  {row['wall_s']:.1f}s (CPU {row['cpu_s']:.0f}s)",
                          flush=True)
    print("\n" + table(progress.rows))
    print(f"\nwrote {progress.path} ({time.perf_counter() - t0:.0f}s this run, "
          f"{progress.data['total_time_s']:.0f}s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
