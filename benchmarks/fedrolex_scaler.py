"""Why FedRolex trails HeteroFL on digits in the capacity-tier benchmark: dead ReLU channels (issue 55).

HeteroFL's Scaler on a CNN without normalisation kills the ReLU channels a weak client holds, and FedRolex's
window moves on to fresh channels every round.

The tiers benchmark's digits setting (:mod:`benchmarks.tiers`: ``cnn2c1f``, N = 32, K = 8, 5 local steps of
batch 16, momentum 0.9, Dirichlet α = 0.5, 20 % held out) for HeteroFL and FedRolex, three ways: as the
benchmark runs them (the Scaler multiplies a weak client's hidden conv outputs by 16/3 in training; client
learning rate 0.05), without the Scaler, and with it at learning rate 0.01.  Per row (method, variant, case,
seed): the global model's test accuracy against rounds, the weak tier's mean training loss every round, and
after the last round the **dead** channels of each conv layer of the global model — those whose ReLU output
is zero on every one of the first 2,000 training images, so that no client's gradient reaches them again.

Usage::

    python -m benchmarks.fedrolex_scaler [--cases 5,10] [--seeds 0,1] [--rounds 50] [--variants ...]
        [--methods heterofl,fedrolex] [--out DIR] [--tag TAG] [--fresh]

Writes ``<out>/fedrolex-scaler-<device>-digits[-TAG].json`` (device, date, command, git revision, rows) after every row
and continues such a file when run again with the same settings (:mod:`benchmarks.families`).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import numpy as np

from benchmarks import families, tiers
from fedpartial._src.experiment.simulation import Simulation
from fedpartial._src.methods.tiered.fedrolex import fedrolex
from fedpartial._src.methods.tiered.heterofl import heterofl
from fedpartial._src.models import zoo

METHODS = {"heterofl": heterofl, "fedrolex": fedrolex}
#: variant -> (the Scaler on, the client learning rate; None: the benchmark's)
VARIANTS = {"benchmark": (True, None), "no-scaler": (False, None), "lr-0.01": (True, 0.01)}
IMAGES = 2000


def dead_channels(params: dict, x: np.ndarray) -> dict[str, list[int]]:
    """Per conv layer of a ``cnn2c1f`` (its ``params``), the channels whose ReLU (then max-pool) output is zero on
    every image of ``x``."""
    module = zoo.CNN2C1F(int(params["head"]["bias"].shape[0]),
                         features=tuple(int(params[f"conv{i}"]["bias"].shape[0]) for i in (1, 2)))
    x = np.asarray(x, np.float32)
    out = {}
    for stop, layer in ((1, "conv1"), (2, "conv2")):
        act = np.asarray(module.apply({"params": params}, x, False, stop=stop))
        out[layer] = [int(c) for c in np.flatnonzero(act.max(axis=(0, 1, 2)) <= 0)]
    return out


def run_row(method: str, variant: str, case: int, seed: int, rounds: int) -> dict:
    s = dict(tiers.SIZES["cpu"], seeds=(seed,), rounds=rounds)
    scaler, lr = VARIANTS[variant]
    config = tiers.config_for("digits", 0.5, case, method, s)
    config = dataclasses.replace(config, eval_every=5, **({} if lr is None else {"client_lr": lr}))
    start = time.perf_counter()
    sim = Simulation(config, method=METHODS[method](capacity_case=case, scaler=scaler))
    records = list(sim.rounds())
    params = sim.state.variables["params"]
    dead = dead_channels(params, sim.dataset.x_train[:IMAGES])
    return {"method": method, "variant": variant, "case": case, "seed": seed, "scaler": scaler,
            "client_lr": config.client_lr, "rounds": rounds,
            "test_accuracy": float(next(r for r in reversed(records) if "test_accuracy" in r)["test_accuracy"]),
            "curve": [(r["round"], float(r["test_accuracy"])) for r in records if "test_accuracy" in r],
            "weak_train_loss": [float(r.get("train_loss_weak", float("nan"))) for r in records],
            "dead": dead, "units": {layer: int(params[layer]["bias"].shape[0]) for layer in dead},
            "wall_s": time.perf_counter() - start}


def table(rows: list[dict]) -> str:
    lines = ["| case | method | variant | seed | final acc % | best acc % | weak loss, last 10 rounds | dead conv1 | "
             "dead conv2 |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        weak = np.nanmean(r["weak_train_loss"][-10:])
        dead = " | ".join(f"{len(r['dead'][layer])}/{r['units'][layer]}" for layer in ("conv1", "conv2"))
        lines.append(f"| {r['case']} | {r['method']} | {r['variant']} | {r['seed']} | {100 * r['test_accuracy']:.1f} | "
                     f"{100 * max(a for _, a in r['curve']):.1f} | {weak:.2f} | {dead} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m benchmarks.fedrolex_scaler", description=__doc__.splitlines()[0])
    p.add_argument("--methods", default=",".join(METHODS), help=f"a subset of {', '.join(METHODS)}")
    p.add_argument("--cases", default="5,10", help="EmbracingFL capacity cases (default 5,10)")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--rounds", type=int, default=50, help="the tiers benchmark's 50 by default")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"a subset of {', '.join(VARIANTS)}")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tag", default=None, help="appended to the file name")
    p.add_argument("--fresh", action="store_true", help="start the result file over instead of continuing it")
    args = p.parse_args(argv)
    cases, seeds = families.ints(args.cases), families.ints(args.seeds)
    variants, methods = families.names(args.variants), families.names(args.methods)
    if bad := [v for v in variants if v not in VARIANTS] + [m for m in methods if m not in METHODS]:
        p.error(f"{bad[0]!r} is not a variant ({', '.join(VARIANTS)}) or method ({', '.join(METHODS)}) here")
    settings = {"cases": cases, "seeds": seeds, "rounds": args.rounds, "variants": variants, "methods": methods,
                "images": IMAGES}
    path = families.result_path(args.out, "fedrolex-scaler", "digits", args.tag)
    progress = families.Progress("fedrolex_scaler", path, settings, ("case", "method", "variant", "seed"), argv,
                                 fresh=args.fresh)
    for case in cases:
        for variant in variants:
            for method in methods:
                for seed in seeds:
                    if progress.has(case=case, method=method, variant=variant, seed=seed):
                        continue
                    row = run_row(method, variant, case, seed, args.rounds)
                    progress.add(row)
                    print(f"case {case} {method:<9} {variant:<10} seed {seed}: acc {row['test_accuracy']:.3f}, dead "
                          f"conv1 {len(row['dead']['conv1'])}, conv2 {len(row['dead']['conv2'])} "
                          f"({row['wall_s']:.0f}s)", flush=True)
    print("\n" + table(progress.rows))
    print(f"\nwrote {progress.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
