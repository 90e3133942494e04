"""Many seeds in one run: the replicas (vmapped or mapped) against the same seeds run one after another.

Usage::

    python -m benchmarks.seeds [--quick] [--out PATH] [--models mlp,cnn2c1f] [--seeds 0,1,2,3]
        [--lrs 0.01,0.1] [--server-lrs 0.3,1.0 --server-opt adam] [--rounds R] [--repeats N]
        [--clients N] [--cohort K]

With ``--lrs`` the replicas are every client learning rate with every seed (``fedpartial run --seeds
... --lrs ...``) and the sequential variants run each (seed, rate) in turn; ``--server-lrs`` likewise
for the server learning rate (with every client rate too).

For every model (``mlp`` on ``synthetic``, ``cnn2c1f`` on ``digits``) the script times, end to end
as a user runs them (building the simulations, compiling, R rounds with evaluation; nothing written):

* ``vmapped`` — :func:`fedpartial._src.experiment.replicas.run_seeds` with ``replica_axis="vmap"``: the seeds as one
  simulation, the fused round vmapped over seeds;
* ``mapped`` — the same with ``replica_axis="map"``: a ``lax.scan`` over the seeds inside the one jit
  (one seed's round after another, compiled once);
* ``sequential_fused`` — :func:`fedpartial._src.experiment.simulation.run` of each seed in turn with
  ``--strategy fused`` (what each replica must equal);
* ``sequential_default`` — the same with ``--strategy auto`` (stepwise on CPU, fused on GPU).

The four alternate (``--repeats`` rounds of all four) so a shared machine's load hits them alike;
the best repeat of each is reported.  Besides the whole wall time, ``steady_s`` is the rounds after
the first (compilation excluded): the sum over seeds of their ``round_time_s`` (for the vmapped run,
each seed's share of the vmapped round plus its host work, so the sum is the run's round time).
Each replica variant's records are checked against ``sequential_fused``: integer fields equal, the final
accuracy within ``1e-4``; its speed-ups over both sequential variants are the sequential time over its own.  JSON goes to ``benchmarks/results/seeds-<backend>-<date>.json`` with the
device and versions (:func:`benchmarks.strategies.device_info`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time

from benchmarks.strategies import device_info, log
from fedpartial._src.experiment import replicas
from fedpartial._src.experiment.config import RunConfig
from fedpartial._src.experiment.setting_checks import SERVER_OPTIMIZERS
from fedpartial._src.experiment.simulation import run
from fedpartial._src.bench.provenance import stamp

VARIANTS = ("vmapped", "mapped", "sequential_fused", "sequential_default")
#: the replica variants and their ``replica_axis``
REPLICA_AXIS = {"vmapped": "vmap", "mapped": "map"}
MODELS = {"mlp": "synthetic", "cnn2c1f": "digits"}
DEFAULTS = dict(models=("mlp", "cnn2c1f"), seeds=(0, 1, 2, 3), rounds=10, clients=20, cohort=10, local_steps=5,
                batch_size=16, repeats=2)
QUICK = dict(models=("mlp",), seeds=(0, 1), rounds=2, clients=4, cohort=2, local_steps=1, batch_size=8, repeats=1)


def base_config(model: str, cfg: dict) -> RunConfig:
    return RunConfig(dataset=MODELS[model], model=model, num_clients=cfg["clients"], cohort_size=cfg["cohort"],
                     rounds=cfg["rounds"], local_steps=cfg["local_steps"], batch_size=cfg["batch_size"],
                     server_optimizer=cfg.get("server_opt", "sgd"), out_dir=None)


def measure(variant: str, config: RunConfig, seeds, lrs=None, server_lrs=None) -> dict:
    """One variant's wall time, steady-state time (rounds after the first) and per-replica records."""
    start = time.perf_counter()
    if variant in REPLICA_AXIS:
        done = replicas.run_seeds(config, seeds, replica_axis=REPLICA_AXIS[variant], lrs=lrs, server_lrs=server_lrs)
        records = [r["records"] for r in done["results"]]
    else:
        strategy = "fused" if variant == "sequential_fused" else "auto"
        records = [run(dataclasses.replace(
            config, seed=r.seed, strategy=strategy, client_lr=config.client_lr if r.lr is None else r.lr,
            server_lr=config.server_lr if r.server_lr is None else r.server_lr))["records"]
            for r in replicas.replica_settings(seeds, lrs, server_lrs)]
    wall = time.perf_counter() - start
    steady = sum(r["round_time_s"] for rs in records for r in rs[1:])
    return {"variant": variant, "wall_s": wall, "steady_s": steady, "records": records}


def agree(a: list, b: list) -> bool:
    """Integer fields equal and final accuracies within 1e-4, seed by seed."""
    for ra, rb in zip(a, b):
        for x, y in zip(ra, rb):
            if any(x[k] != y[k] for k in ("round", "client_steps", "upload_bytes", "download_bytes", "clients")):
                return False
        if abs(ra[-1]["test_accuracy"] - rb[-1]["test_accuracy"]) > 1e-4:
            return False
    return True


def run_model(model: str, cfg: dict) -> dict:
    config = base_config(model, cfg)
    best: dict[str, dict] = {}
    for rep in range(cfg["repeats"]):
        for variant in VARIANTS:
            m = measure(variant, config, cfg["seeds"], cfg.get("lrs"), cfg.get("server_lrs"))
            log(f"{model} repeat {rep + 1}: {variant} {m['wall_s']:.1f} s (steady {m['steady_s']:.2f} s)")
            if variant not in best or m["wall_s"] < best[variant]["wall_s"]:
                best[variant] = m
    out = {"model": model, "dataset": MODELS[model], "measurements": []}
    for variant in REPLICA_AXIS:
        out[f"{variant}_equals_sequential_fused"] = agree(best[variant]["records"], best["sequential_fused"]["records"])
    for variant in VARIANTS:
        m = best[variant]
        entry = {"variant": variant, "wall_s": m["wall_s"], "steady_s": m["steady_s"]}
        if variant in REPLICA_AXIS:  # how many times faster than the seeds one after another
            entry["speedup"] = {
                seq: {"wall": best[seq]["wall_s"] / m["wall_s"],
                      "steady": best[seq]["steady_s"] / m["steady_s"] if m["steady_s"] else None}
                for seq in VARIANTS if seq not in REPLICA_AXIS}
        out["measurements"].append(entry)
    return out


def table(results: list[dict]) -> str:
    fmt = lambda x: f"{x:.2f}×" if x else "–"  # noqa: E731
    lines = ["| model | variant | wall (s) | steady (s) | vs sequential fused (wall / steady) | "
             "vs sequential default (wall / steady) |", "|---|---|---:|---:|---:|---:|"]
    for r in results:
        for m in r["measurements"]:
            ups = [f"{fmt(m['speedup'][seq]['wall'])} / {fmt(m['speedup'][seq]['steady'])}" if "speedup" in m
                   else "–" for seq in ("sequential_fused", "sequential_default")]
            lines.append(f"| {r['model']} | {m['variant']} | {m['wall_s']:.1f} | {m['steady_s']:.2f} | "
                         f"{ups[0]} | {ups[1]} |")
    return "\n".join(lines)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
    p.add_argument("--out", help="JSON path (default benchmarks/results/seeds-<backend>-<date>.json)")
    p.add_argument("--models", help="comma-separated, from " + ", ".join(MODELS))
    p.add_argument("--seeds", help="comma-separated seeds (default 0,1,2,3)")
    p.add_argument("--lrs", help="comma-separated client learning rates, each with every seed (default: none)")
    p.add_argument("--server-lrs", help="comma-separated server learning rates, each with every client rate and "
                                        "seed (default: none)")
    p.add_argument("--server-opt", default="sgd", choices=SERVER_OPTIMIZERS,
                   help="server optimizer (default sgd)")
    p.add_argument("--rounds", type=int)
    p.add_argument("--clients", type=int, help="population N (default 20)")
    p.add_argument("--cohort", type=int, help="clients per round K (default 10)")
    p.add_argument("--repeats", type=int)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = dict(QUICK if args.quick else DEFAULTS)
    if args.models:
        cfg["models"] = tuple(args.models.split(","))
    if args.seeds:
        cfg["seeds"] = tuple(int(s) for s in args.seeds.split(","))
    if args.lrs:
        cfg["lrs"] = tuple(replicas.parse_lrs(args.lrs))
    if args.server_lrs:
        cfg["server_lrs"] = tuple(replicas.parse_lrs(args.server_lrs, "--server-lrs"))
    cfg["server_opt"] = args.server_opt
    for name in ("rounds", "repeats", "clients", "cohort"):
        if getattr(args, name):
            cfg[name] = getattr(args, name)
    device = device_info()
    date = datetime.date.today().isoformat()
    tag = ("-lrs" if args.lrs else "") + ("-server-lrs" if args.server_lrs else "")
    out = args.out or os.path.join(os.path.dirname(__file__), "results", f"seeds-{device['backend']}-{date}{tag}.json")
    log(f"device: {device['backend']} / {device['device_kind']}  ({device['cpu_count']} CPUs)")
    results = [run_model(model, cfg) for model in cfg["models"]]
    report = {"benchmark": "seeds", "device": device, "config": {**cfg, "quick": args.quick}, "results": results,
              "note": "the whole wall time includes building each simulation and compiling; steady excludes "
                      "each run's first round"}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(stamp(report), f, indent=2)
    print(table(results))
    log(f"wrote {out}")
    return 0 if all(r[f"{v}_equals_sequential_fused"] for r in results for v in REPLICA_AXIS) else 1


if __name__ == "__main__":
    sys.exit(main())
