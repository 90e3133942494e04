"""Reproduction of EmbracingFL's comparisons (paper Tables 2–7 and §4.5) on data that runs offline.

Three experiments, each EmbracingFL (an output-side suffix per tier) against width reduction
(HeteroFL, static version; FedRolex's rolling windows) and depth reduction (DepthFL, InclusiveFL:
an input-side prefix per tier, with exits) at the paper's capacities, from the same seeds,
partitions and cohorts:

* **scaling** (Table 2): 16 strong clients + 0/16/32/64/112 weak ones, full
  participation — does adding weak clients help, and by how much each method?
* **cases** (Tables 3–6): the ten 128-client mixes of strong/moderate/weak
  clients, scaled to ``--clients`` (case 1 is all strong, i.e. FedAvg for every method but DepthFL,
  whose strong clients train every exit, so it has a case-1 run of its own);
* **bn** (§4.5): global vs static BatchNorm for both methods on a BN model.

Plus **costs** per tier: XLA's FLOPs and peak memory of the compiled local step
and its measured time, each against a strong client's step, for the paper's
three models at their paper shapes (no data needed).

Usage::

    python -m benchmarks.embracingfl [--quick] [--experiments scaling,cases,bn,costs]
        [--datasets mnist5k,synthetic,synthetic_text] [--methods embracingfl,heterofl,...] [--rounds R]
        [--clients N] [--out DIR]

Writes ``<out>/embracingfl-<device>.json`` (every round of every run), a plot and
prints the tables: final and best accuracy, rounds to reach ``--target`` × the
all-strong accuracy, per-tier FLOPs, memory and step time.  Datasets not
prepared locally (tfds: cifar10, imdb_reviews) are skipped with a note.
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
from fedpartial._src.data.sources import DataError
from fedpartial._src.methods.tiered.tiers import CAPACITY_CASES, resolve_mix
from fedpartial._src.experiment.config import RunConfig
from fedpartial._src.experiment.simulation import Simulation
from fedpartial._src.bench.provenance import stamp

METHODS = ("embracingfl", "heterofl", "fedrolex", "depthfl", "inclusivefl")
LABELS = {"embracingfl": "EmbracingFL", "heterofl": "Width red.", "fedrolex": "FedRolex", "depthfl": "DepthFL",
          "inclusivefl": "InclusiveFL"}
#: width reduction needs a zoo model with a width-reduced version (not the BiLSTM)
WIDTH_METHODS = ("heterofl", "fedrolex")
#: methods whose all-strong run is not FedAvg's (EmbracingFL's case-1 run stands for the others)
OWN_ALL_STRONG = ("depthfl",)
WEAK_COUNTS = (0, 16, 32, 64, 112)

# dataset -> (model, batch, client lr, momentum, partition, alpha, bn model)
# The paper: batch 32, 10 local steps, SGD momentum 0.9 (Appendix 6.1).
SETUPS = {
    "mnist5k": ("femnist_cnn", 32, 0.02, 0.9, "dirichlet", 0.5),
    "synthetic": ("mlp", 32, 0.01, 0.9, "natural", 1.0),
    "synthetic_text": ("bilstm", 32, 0.05, 0.9, "dirichlet", 0.5),
    "digits": ("resnet20", 32, 0.05, 0.9, "dirichlet", 0.5),
    "cifar10": ("resnet20", 32, 0.1, 0.9, "dirichlet", 0.5),
    "imdb_reviews": ("bilstm", 32, 0.05, 0.9, "dirichlet", 0.5),
}


def small_bilstm(dataset):
    """A BiLSTM sized for the synthetic text task on a CPU (embedding and LSTM 32 wide, the task's vocabulary)."""
    from fedpartial._src.models.adapter import from_linen
    from fedpartial._src.models.text import BiLSTM

    vocab = int(dataset.x_train.max()) + 1
    shape = tuple(dataset.x_train.shape[1:])
    return from_linen(BiLSTM(num_classes=dataset.num_classes, vocab_size=vocab, embed_dim=32, hidden=32),
                      input_shape=shape, num_classes=dataset.num_classes, name="bilstm")


def population(dataset: str, args, total: int, used: int):
    """The dataset split among ``total`` clients once (same seed), keeping the first ``used`` of them.

    Every run of an experiment then shares the clients it has in common, and adding
    weak clients adds their data (as in the paper, where each client has its own
    local data) instead of re-splitting a fixed pool.
    """
    import dataclasses

    from fedpartial._src.data.partition import partition
    from fedpartial._src.data.sources import load_dataset

    _, _, _, _, scheme, alpha = SETUPS[dataset]
    key = (dataset, total, args.seed)
    if key not in _POPULATIONS:
        options = {"num_clients": total, "alpha": alpha, "beta": alpha} if dataset == "synthetic" else {}
        data = load_dataset(dataset, data_dir=args.data_dir, seed=args.seed, **options)
        parts = data.natural_partition or partition(data.y_train, total, scheme, alpha=alpha, seed=args.seed)
        _POPULATIONS[key] = (data, tuple(parts))
    data, parts = _POPULATIONS[key]
    return dataclasses.replace(data, natural_partition=parts[:used], natural_test_partition=None)


_POPULATIONS: dict = {}


def run_one(dataset: str, method: str, options: dict, args, *, bn_policy: str = "global", total: int) -> dict:
    name, batch, lr, momentum, _, _ = SETUPS[dataset]
    num_clients = sum(options["tier_mix"]) if "tier_mix" in options else args.clients
    data = population(dataset, args, total, num_clients)
    config = RunConfig(
        method=method, dataset=dataset, data_dir=args.data_dir, model=name, partition="natural",
        num_clients=num_clients, cohort_size=num_clients, rounds=args.rounds, local_steps=args.steps,
        batch_size=batch, client_lr=lr, momentum=momentum, seed=args.seed, eval_every=args.eval_every,
        out_dir=None, bn_policy=bn_policy, options=options,
    )
    start = time.perf_counter()
    model = small_bilstm(data) if name == "bilstm" and args.text_model == "small" else None
    adapt = config.build_method().adapt_model
    if model is not None and adapt is not None:  # a model handed to the simulation is used as it is
        model = adapt(model)  # (DepthFL, InclusiveFL: the exits after the tiers' depths)
    sim = Simulation(config, data, model=model)
    records = list(sim.rounds())
    return {"dataset": dataset, "method": method, "options": {k: list(v) if isinstance(v, tuple) else v
                                                               for k, v in options.items()},
            "bn_policy": bn_policy, "num_clients": num_clients, "model": sim.model.name,
            "records": records, "time_s": time.perf_counter() - start}


def accuracy_curve(run: dict) -> tuple[np.ndarray, np.ndarray]:
    evaluated = [r for r in run["records"] if "test_accuracy" in r]
    return np.array([r["round"] for r in evaluated]), np.array([r["test_accuracy"] for r in evaluated])


def summary(run: dict, target: float | None) -> dict:
    rounds, acc = accuracy_curve(run)
    hit = np.flatnonzero(acc >= target) if target is not None else np.array([])
    return {"final_accuracy": float(acc[-1]), "best_accuracy": float(acc.max()),
            "rounds_to_target": int(rounds[hit[0]]) if hit.size else None}


def methods_for(dataset: str, args, all_strong: bool = False) -> tuple[str, ...]:
    """The chosen methods this dataset's model can run (width reduction: not the BiLSTM); with ``all_strong``
    EmbracingFL's run (FedAvg) and those whose all-strong run differs from it."""
    chosen = [m for m in args.methods if not (m in WIDTH_METHODS and SETUPS[dataset][0] == "bilstm")]
    return tuple(m for m in chosen if m == METHODS[0] or m in OWN_ALL_STRONG) if all_strong else tuple(chosen)


def stands_for(method: str) -> str:
    """The method whose all-strong run stands for ``method``'s: its own (DepthFL) or EmbracingFL's (FedAvg)."""
    return method if method in OWN_ALL_STRONG else METHODS[0]


def scaling(dataset: str, args, log) -> list[dict]:
    runs = []
    strong = 16 // args.scale
    for weak in (w // args.scale for w in WEAK_COUNTS):
        for method in methods_for(dataset, args, all_strong=not weak):  # strong clients alone: mostly FedAvg
            total = strong + max(WEAK_COUNTS) // args.scale
            run = run_one(dataset, method, {"tier_mix": (strong, 0, weak)}, args, total=total)
            run["experiment"], run["strong"], run["weak"] = "scaling", strong, weak
            log(run, f"{strong} strong + {weak:>3} weak")
            runs.append(run)
    return runs


def cases(dataset: str, args, log) -> list[dict]:
    runs = []
    for case in args.cases:
        for method in methods_for(dataset, args, all_strong=case == 1):  # case 1 (all strong): mostly FedAvg
            run = run_one(dataset, method, {"capacity_case": case}, args, total=args.clients)
            run["experiment"], run["case"] = "cases", case
            run["mix"] = list(resolve_mix(args.clients, capacity_case=case).counts)
            log(run, f"case {case:>2} {tuple(run['mix'])}")
            runs.append(run)
    return runs


def bn(dataset: str, args, log) -> list[dict]:
    runs = []
    for method in methods_for(dataset, args):
        for policy in ("global", "static"):
            run = run_one(dataset, method, {"capacity_case": args.bn_case}, args, bn_policy=policy,
                          total=args.clients)
            run["experiment"], run["case"] = "bn", args.bn_case
            log(run, f"case {args.bn_case} BN {policy}")
            runs.append(run)
    return runs


def tier_costs(methods=METHODS, repeats: int = 20) -> list[dict]:
    """Per model and tier: XLA FLOPs, peak temp memory and time of one compiled local step (batch 32)."""
    from fedpartial._src.analysis import capacity

    rows = []
    for name in ("femnist_cnn", "resnet20", "bilstm"):
        model = capacity.reference_model(name)
        for method in methods:
            try:
                rows.extend(_method_tier_costs(model, method, repeats))
            except Exception as e:  # noqa: BLE001 — a method that cannot run this model is reported, not fatal
                rows.append({"model": name, "method": method, "error": str(e).splitlines()[0]})
    return rows


def _method_tier_costs(model, method: str, repeats: int) -> list[dict]:
    """One client of each tier (mix 1,1,1): XLA FLOPs and peak memory (``flops.step_costs``) and the
    measured time of its compiled local step, each against the strong client's."""
    import optax

    from fedpartial._src.costs import flops
    from fedpartial._src.engine.round import FederatedRound
    from fedpartial._src.engine.types import Cohort
    from fedpartial._src.core.types import Batch, CohortInfo
    from fedpartial._src.methods.catalog import get_method

    n, steps, batch = 3, 10, 32
    built = get_method(method, tier_mix=(1, 1, 1))
    tokens = model.name == "bilstm"
    model = built.adapt_model(model) if built.adapt_model is not None else model  # DepthFL's exits
    r = FederatedRound(model, built, num_clients=n, cohort_size=n, client_optimizer=optax.sgd(0.01, momentum=0.9))
    state = r.init(jax.random.key(0))
    x = np.ones((n, steps, batch, *model.input_shape), np.int32 if tokens else np.float32)
    cohort = Cohort(Batch(x, np.zeros((n, steps, batch), np.int32), np.ones((n, steps, batch), bool),
                          np.ones((n, steps), bool)),
                    CohortInfo(np.arange(n, dtype=np.int32), np.full(n, steps * batch, np.float32),
                               np.ones(n, bool)))
    costs = flops.step_costs(r, cohort, state)
    rows = []
    for group, fns, cost, li in zip(r.groups, r.clients, costs, r.local_inputs(state, cohort, jax.random.key(1))):
        one = jax.tree.map(lambda a: a[0], li)
        data = fns.prepare(one.start, one.data) if fns.prepare is not None else one.data
        step = jax.jit(fns.step)
        args = (fns.init(one.start), jax.tree.map(lambda a: a[0], data), one.plan, state.variables,
                one.client_state, one.client_keys, 0)
        jax.block_until_ready(step(*args))
        t0 = time.perf_counter()
        for _ in range(repeats):
            out = step(*args)
        jax.block_until_ready(out)
        rows.append({"model": model.name, "method": method, "tier": group.name, "flops": cost.step_flops,
                     "prepare_flops_per_batch": cost.prepare_flops, "peak_bytes": cost.step_peak_bytes,
                     "step_time_s": (time.perf_counter() - t0) / repeats})
    strong = rows[0]
    for row in rows:
        row["flops_vs_strong"] = row["flops"] / strong["flops"]
        row["time_vs_strong"] = row["step_time_s"] / strong["step_time_s"]
        row["memory_vs_strong"] = (row["peak_bytes"] / strong["peak_bytes"]
                                   if row["peak_bytes"] and strong["peak_bytes"] else None)
    return rows


def tables(runs: list[dict], costs: list[dict], target: float) -> tuple[str, list[dict]]:
    lines, rows = [], []
    for dataset in sorted({r["dataset"] for r in runs}):
        mine = [r for r in runs if r["dataset"] == dataset]
        strong = [r for r in mine if (r.get("case") == 1 or r.get("weak") == 0) and r["method"] == METHODS[0]]
        reference = max(summary(r, None)["best_accuracy"] for r in strong) if strong else None
        goal = target * reference if reference is not None else None
        lines.append(f"\n{dataset} ({mine[0]['model']}); target = {target:g} × all-strong best"
                     + (f" = {goal:.4f}" if goal is not None else "") + " (all strong, EmbracingFL is FedAvg)")
        lines.append(f"{'experiment':<10} {'setting':<24} {'method':<12} {'final':>7} {'best':>7} {'rounds→tgt':>10}")
        for r in mine:
            s = summary(r, goal)
            setting = (f"{r['strong']}+{r['weak']} weak" if r["experiment"] == "scaling" else
                       f"case {r['case']} {tuple(r.get('mix', ()))}" if r["experiment"] == "cases" else
                       f"case {r['case']} BN {r['bn_policy']}")
            rows.append({"dataset": dataset, "experiment": r["experiment"], "setting": setting, "method": r["method"],
                         **s, "time_s": r["time_s"]})
            tgt = "–" if s["rounds_to_target"] is None else str(s["rounds_to_target"])
            lines.append(f"{r['experiment']:<10} {setting:<24} {LABELS[r['method']]:<12} {s['final_accuracy']:>7.4f} "
                         f"{s['best_accuracy']:>7.4f} {tgt:>10}")
    if costs:
        lines.append(f"\nper-tier local step (batch 32): {'model':<12} {'method':<12} {'tier':<9} {'MFLOPs':>10} "
                     f"{'×strong':>8} {'memory ×':>9} {'time ×':>7}")
        for c in costs:
            if "error" in c:
                lines.append(f"{'':32}{c['model']:<12} {LABELS[c['method']]:<12} not available: {c['error']}")
                continue
            memory = "–" if c["memory_vs_strong"] is None else f"{c['memory_vs_strong']:.3f}"
            lines.append(f"{'':32}{c['model']:<12} {LABELS[c['method']]:<12} {c['tier']:<9} {c['flops'] / 1e6:>10.1f} "
                         f"{c['flops_vs_strong']:>8.3f} {memory:>9} {c['time_vs_strong']:>7.3f}")
    return "\n".join(lines), rows


def plot(runs: list[dict], path: str) -> None:
    """A panel per (dataset, experiment) the file holds, one legend under them: best accuracy against the
    number of weak clients (scaling), per capacity case (cases, bars), and accuracy against rounds for each
    BatchNorm policy (bn: global solid, static dashed).  A method's all-strong point is the run that stands
    for it (:func:`stands_for`)."""
    from matplotlib.lines import Line2D

    panels = [(d, e) for d in sorted({r["dataset"] for r in runs}) for e in EXPERIMENTS
              if any(r["dataset"] == d and r["experiment"] == e for r in runs)]
    fig, axes = figure_style.figure(max(len(panels), 1))
    policies = {}
    for ax, (dataset, experiment) in zip(axes, panels):
        mine = [r for r in runs if r["dataset"] == dataset and r["experiment"] == experiment]
        shown = [m for m in METHODS if any(r["method"] == m for r in mine)]
        if experiment == "scaling":
            for method in shown:
                pts = sorted((r["weak"], summary(r, None)["best_accuracy"]) for r in mine
                             if (r["method"] == method if r["weak"] else r["method"] == stands_for(method)))
                ax.plot(*zip(*pts), marker="o", label=LABELS[method], color=figure_style.colour(method))
            ax.set(title=f"{dataset}: strong + weak clients", xlabel="weak clients", ylabel="best test accuracy")
        elif experiment == "cases":
            width = 0.8 / len(shown)
            for i, method in enumerate(shown):
                pts = sorted((r["case"], summary(r, None)["best_accuracy"]) for r in mine
                             if (r["method"] == method if r["case"] != 1 else r["method"] == stands_for(method)))
                xs, ys = zip(*pts)
                ax.bar(np.array(xs) + (i - (len(shown) - 1) / 2) * width, ys, width=width, label=LABELS[method],
                       color=figure_style.colour(method))
            ax.set(title=f"{dataset}: capacity cases", xlabel="case", ylabel="best test accuracy")
        else:
            for r in mine:
                rounds, acc = accuracy_curve(r)
                style = policies.setdefault(r["bn_policy"], ("-", "--", ":", "-.")[len(policies) % 4])
                ax.plot(rounds, acc, ls=style, marker=".", label=LABELS[r["method"]],
                        color=figure_style.colour(r["method"]))
            ax.set(title=f"{dataset}: BatchNorm statistics (case {mine[0]['case']})", xlabel="round",
                   ylabel="test accuracy")
        ax.grid(True, alpha=0.3)
    figure_style.shared_legend(fig, axes, extra=[(Line2D([], [], color="#444444", ls=style), f"BN {policy}")
                                                 for policy, style in policies.items()])
    figure_style.save(fig, path)


EXPERIMENTS = {"scaling": scaling, "cases": cases, "bn": bn}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.embracingfl", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smoke test: synthetic, 2 cases, 3 rounds, 16 clients")
    p.add_argument("--experiments", default="scaling,cases,bn,costs")
    p.add_argument("--datasets", default="mnist5k,synthetic,synthetic_text")
    p.add_argument("--methods", default=",".join(METHODS), help="methods compared (EmbracingFL's all-strong run "
                   "is the FedAvg reference and always runs)")
    p.add_argument("--bn-dataset", default="digits", help="dataset of the BN experiment (a BN model: resnet20)")
    p.add_argument("--cases", default=",".join(map(str, CAPACITY_CASES)))
    p.add_argument("--bn-case", type=int, default=10)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--steps", type=int, default=10, help="local steps per round (paper: 10)")
    p.add_argument("--clients", type=int, default=128, help="population of the cases (paper: 128)")
    p.add_argument("--scale", type=int, default=1, help="divide the scaling table's 16 strong + W weak by this")
    p.add_argument("--text-model", choices=("small", "paper"), default="small",
                   help="BiLSTM for synthetic_text: 32 wide (CPU) or the paper's 10,000x256 / 256")
    p.add_argument("--tag", default="", help="appended to the output file names")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=2)
    p.add_argument("--target", type=float, default=0.95, help="target accuracy as a fraction of all-strong's best")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    if args.quick:
        args.datasets, args.rounds, args.clients, args.cases, args.eval_every = "synthetic", 3, 16, "1,10", 1
        args.experiments, args.bn_dataset, args.steps = "cases,bn", "synthetic", 2
    args.cases = [int(c) for c in args.cases.split(",")]
    unknown = sorted(set(args.methods.split(",")) - set(METHODS))
    if unknown:
        p.error(f"method {unknown[0]!r} is not compared here; choose from {', '.join(METHODS)}")
    args.methods = [m for m in METHODS if m == METHODS[0] or m in args.methods.split(",")]
    experiments = args.experiments.split(",")
    os.makedirs(args.out, exist_ok=True)
    runs, notes, t0 = [], [], time.perf_counter()

    def log(run, setting):
        _, acc = accuracy_curve(run)
        print(f"{run['dataset']:<14} {run['experiment']:<8} {setting:<24} {LABELS[run['method']]:<12} "
              f"best {acc.max():.4f}  {run['time_s']:.1f}s", flush=True)

    for name in experiments:
        if name == "costs":
            continue
        if name not in EXPERIMENTS:
            p.error(f"experiment {name!r} is unknown; choose from {', '.join([*EXPERIMENTS, 'costs'])}")
        for dataset in ([args.bn_dataset] if name == "bn" else args.datasets.split(",")):
            if dataset not in SETUPS:
                p.error(f"dataset {dataset!r} has no EmbracingFL setup; choose from {', '.join(SETUPS)}")
            try:
                runs.extend(EXPERIMENTS[name](dataset, args, log))
            except DataError as e:  # a tfds dataset not prepared here
                notes.append(f"{dataset}: skipped ({e})")
                print(notes[-1], file=sys.stderr)
    costs = tier_costs(args.methods) if "costs" in experiments else []
    text, rows = tables(runs, costs, args.target)
    print(text)
    slug = device_slug() + ("-quick" if args.quick else "") + (f"-{args.tag}" if args.tag else "")
    result = {
        "benchmark": "embracingfl",
        "device": {"platform": jax.devices()[0].platform, "device_kind": jax.devices()[0].device_kind,
                   "jax_version": jax.__version__},
        "argv": list(sys.argv[1:] if argv is None else argv), "date": time.strftime("%Y-%m-%d"),
        "protocol": {k: v for k, v in vars(args).items()}, "notes": notes, "summary": rows, "costs": costs,
        "runs": runs, "total_time_s": time.perf_counter() - t0,
    }
    json_path = os.path.join(args.out, f"embracingfl-{slug}.json")
    with open(json_path, "w") as f:
        json.dump(stamp(result), f, default=lambda o: None if isinstance(o, float) and math.isnan(o) else str(o))
    if runs:
        plot(runs, os.path.join(args.out, f"embracingfl-{slug}.png"))
    print(f"\nwrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
