"""Every convolution lowering x execution strategy, against the plain per-client loop: FedAvg rounds per second,
achieved GFLOP/s and their share of the measured matmul rate, and what ``--conv-impl auto`` picks.

Usage::

    python -m benchmarks.conv_lowering [--quick] [--rows ROW[,ROW...]] [--rounds R] [--local-steps S]
        [--batch-size B] [--lowerings lax,im2col,hybrid,mapped] [--strategies stepwise:1,fused:1,fused]
        [--skip ROW:IMPL:STRATEGY] [--dtypes float32,bfloat16] [--matmul-precision highest] [--out PATH]

A row is ``MODEL@SIDExSIDExC:K``: the default rows are the CNN of the default run on 8x8 grey images (the
digits' shape) and on 28x28 (MNIST's) at K = 10 and 50, LeNet-5 and VGG-9 on 32x32x3 at K = 10.  The data
are random (the shapes set the speed, not the values).  For each row the plain loop
(:class:`fedpartial._src.bench.kit.PlainLoop`, lax's convolution) is timed, then every lowering
(:data:`fedpartial._src.models.conv.CONV_IMPLS`) under every strategy, each one warm-up round (compiling; its
time is kept) and R timed rounds; the new global parameters after the warm-up are checked against the plain
loop's.  GFLOP/s count the analytic training FLOPs of the round (:func:`fedpartial._src.costs.flops.training_flops`
x K x S x B), and the share is of a 2048x2048 float32 matmul timed in the same run.  ``auto`` is what
:func:`fedpartial._src.engine.conv_choice.choose` picks for the row (measured here, not cached) and the round
time of that (lowering, strategy) cell.  ``--skip`` leaves out cells known to take minutes (recorded as
skipped, with the reason).  ``--matmul-precision highest`` runs every cell and the plain loop at full float32
(an NVIDIA GPU's default is TF32): a difference from the loop that stays there is a bug, not rounding.
``--quick``: a tiny smoke test (one 8x8 row, K = 2, seconds).
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import subprocess
import sys
import time

import jax
import numpy as np

from fedpartial._src.bench import kit
from fedpartial._src.bench.suite import matmul_flops_per_s
from fedpartial._src.costs import flops
from fedpartial._src.engine import conv_choice
from fedpartial._src.engine.round import FederatedRound
from fedpartial._src.engine.strategy import parse_strategy
from fedpartial._src.engine.types import cohort_from_packed
from fedpartial._src.experiment import parts
from fedpartial._src.methods.basic.fedavg import fedavg
from fedpartial._src.models import registry
from fedpartial._src.models.adapter import from_linen
from fedpartial._src.models.conv import CONV_IMPLS
from fedpartial._src.models.precision import with_compute_dtype

ROWS = ("cnn2c1f@8x8x1:10", "cnn2c1f@8x8x1:50", "cnn2c1f@28x28x1:10", "cnn2c1f@28x28x1:50", "lenet5@32x32x3:10",
        "vgg9@32x32x3:10")
STRATEGIES = ("stepwise:1", "fused:1", "fused")
#: the strategy each of ``auto``'s layouts runs (fedpartial._src.engine.strategy.default_strategy)
LAYOUT_STRATEGY = {"loop": "stepwise:1", "vmap": "fused", "map": "fused:1"}
#: cells that take minutes a round on a 2-core CPU (grouped convolutions on large images)
SLOW = tuple(f"{row}:lax:{s}" for row in ("cnn2c1f@28x28x1:10", "cnn2c1f@28x28x1:50", "vgg9@32x32x3:10",
                                          "lenet5@32x32x3:10") for s in ("fused", "fused:1"))
TOLERANCE = 1e-3


def parse_row(row: str) -> tuple[str, tuple[int, ...], int]:
    model, _, rest = row.partition("@")
    shape, _, k = rest.partition(":")
    return model, tuple(int(v) for v in shape.split("x")), int(k)


def build(model_name: str, shape, impl: str, dtype: str):
    module = registry.build_model(model_name, kit.NUM_CLASSES, shape, conv_impl=impl)
    model = from_linen(module, input_shape=shape, num_classes=kit.NUM_CLASSES,
                       sequential=registry.MODELS[model_name].sequential, name=model_name)
    return module, with_compute_dtype(model, dtype)


def time_engine(model, strategy: str, packed, cfg, reference) -> dict:
    k = packed.step_mask.shape[0]
    rnd = FederatedRound(model, fedavg(), num_clients=k, cohort_size=k,
                         client_optimizer=kit.client_optimizer(cfg["lr"], 0.9), strategy=parse_strategy(strategy))
    cohort = cohort_from_packed(packed, np.arange(k))
    state = rnd.init(jax.random.key(0))
    (state, _), warmup = kit.timed(lambda: rnd(state, cohort, jax.random.key(1)))
    diff = kit.max_abs_diff(state.variables["params"], reference)
    times = []
    for t in range(cfg["rounds"]):
        (state, _), dt = kit.timed(lambda: rnd(state, cohort, jax.random.key(2 + t)))
        times.append(dt)
    return {"warmup_s": warmup, "round_s": min(times), "max_abs_diff_vs_plain": diff}


def time_plain(module, shape, packed, cfg) -> tuple[dict, dict]:
    loop = kit.PlainLoop(module, kit.client_optimizer(cfg["lr"], 0.9), shape)
    variables0 = loop.init_variables(jax.random.key(0))  # BatchNorm statistics too (VGG-9)
    (variables1, _), warmup = kit.timed(lambda: loop.round(variables0, packed))
    variables, times = variables1, []
    for _ in range(cfg["rounds"]):
        (variables, _), dt = kit.timed(lambda: loop.round(variables, packed))
        times.append(dt)
    return {"warmup_s": warmup, "round_s": min(times)}, variables1["params"]


def run_row(row: str, cfg: dict, peak: float, skip: set[str], save=lambda record: None) -> dict:
    """One row's cells; ``save(record)`` after each (a run cut off keeps what it measured)."""
    model_name, shape, k = parse_row(row)
    s, b, dtype = cfg["local_steps"], cfg["batch_size"], cfg["dtype"]
    packed = kit.make_data(k, batch_size=b, local_steps=s, input_shape=shape, seed=0)
    module, plain_model = build(model_name, shape, "lax", "float32")
    work = flops.training_flops(plain_model, batch_size=1) * k * s * b
    record = {"row": row, "model": model_name, "input_shape": list(shape), "cohort_size": k, "dtype": dtype,
              "training_flops_per_round": work, "cells": {}}

    def note(name, cell):
        if "round_s" in cell:
            cell.update(rounds_per_s=1 / cell["round_s"], gflops_per_s=work / cell["round_s"] / 1e9,
                        share_of_matmul=work / cell["round_s"] / peak)
        record["cells"][name] = cell
        save(record)
        shown = (f"{cell['rounds_per_s']:8.3f} rounds/s {cell['gflops_per_s']:7.2f} GFLOP/s "
                 f"({cell['share_of_matmul']:.1%} of matmul), warm-up {cell['warmup_s']:.1f} s"
                 if "round_s" in cell else cell.get("skipped") or cell.get("error"))
        kit.log(f"  {row} {name:<22} {shown}")

    plain, reference = time_plain(module, shape, packed, cfg)
    note("plain_loop", plain)
    for impl in cfg["lowerings"]:
        model = plain_model if (impl, dtype) == ("lax", "float32") else build(model_name, shape, impl, dtype)[1]
        for strategy in cfg["strategies"]:
            name = f"{impl}/{strategy}"
            if f"{row}:{impl}:{strategy}" in skip:
                note(name, {"skipped": "minutes a round here (grouped convolutions); see SLOW"
                            if f"{row}:{impl}:{strategy}" in SLOW else "not measured in this run (--skip)"})
                continue
            try:
                note(name, time_engine(model, strategy, packed, cfg, reference))
            except Exception as e:  # noqa: BLE001 - one failed cell must not end the run
                note(name, {"error": f"{type(e).__name__}: {e}"[:300]})
    base = plain["round_s"]
    for cell in record["cells"].values():
        if "round_s" in cell:
            cell["speedup_vs_plain"] = base / cell["round_s"]
    if not cfg["auto"]:
        return record
    started = time.perf_counter()
    choice = conv_choice.choose(
        lambda impl: build(model_name, shape, impl, dtype)[1],
        lambda model, strategy, clients, devices: parts.timing_round(model, strategy, clients, devices,
                                                                     lr=cfg["lr"], momentum=0.9),
        batch_size=b, cohort_size=k, local_steps=s, dtype=dtype)
    picked = f"{choice.impl}/{LAYOUT_STRATEGY.get(choice.layout, 'stepwise:1')}"
    record["auto"] = {"impl": choice.impl, "layout": choice.layout, "cell": picked,
                      "choose_s": time.perf_counter() - started, "seconds_per_round": choice.seconds,
                      "speedup_vs_plain": record["cells"].get(picked, {}).get("speedup_vs_plain")}
    kit.log(f"  {row} auto picks {picked} in {record['auto']['choose_s']:.1f} s: "
            f"{record['auto']['speedup_vs_plain'] or float('nan'):.2f}x the plain loop")
    return record


def table(record: dict) -> str:
    lines = [f"{record['row']} ({record['dtype']})",
             f"{'cell':<22}{'rounds/s':>10}{'x loop':>8}{'GFLOP/s':>9}{'% matmul':>10}{'max|diff|':>11}"]
    for name, c in record["cells"].items():
        if "round_s" not in c:
            lines.append(f"{name:<22}  {c.get('skipped') or c.get('error')}")
            continue
        diff = c.get("max_abs_diff_vs_plain")
        lines.append(f"{name:<22}{c['rounds_per_s']:>10.3f}{c['speedup_vs_plain']:>7.2f}x{c['gflops_per_s']:>9.2f}"
                     f"{c['share_of_matmul']:>10.1%}{'' if diff is None else f'{diff:.1e}':>11}")
    a = record.get("auto")
    if a:
        lines.append(f"auto: {a['cell']} (chosen in {a['choose_s']:.1f} s)")
    return "\n".join(lines)


def git_revision() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.conv_lowering", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke test: cnn2c1f@8x8x1:2, S = 1, B = 4, 1 round, the "
                   "plain loop and im2col fused only, no auto")
    p.add_argument("--no-auto", dest="auto", action="store_false", help="do not run --conv-impl auto's chooser")
    p.add_argument("--note", default="", help="the conditions of the run, kept in the file and shown beside its "
                                              "numbers (e.g. that the machine was shared and loaded)")
    p.add_argument("--rows", type=kit.name_list, default=ROWS, help="MODEL@HxWxC:K, comma-separated")
    p.add_argument("--rounds", type=int, default=2, help="timed rounds per cell (the fastest counts)")
    p.add_argument("--local-steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--lowerings", type=kit.name_list, default=CONV_IMPLS)
    p.add_argument("--strategies", type=kit.name_list, default=STRATEGIES)
    p.add_argument("--dtypes", type=kit.name_list, default=("float32",))
    p.add_argument("--skip", type=kit.name_list, default=SLOW, help="ROW:IMPL:STRATEGY cells left out")
    p.add_argument("--matmul-precision", default="default", choices=("default", "high", "highest"),
                   help="JAX's default matmul and convolution precision for every cell and the plain loop "
                        "(default: the backend's own, TF32 on NVIDIA GPUs; highest: full float32)")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/conv-lowering-<device>.json)")
    args = p.parse_args(argv)
    if args.matmul_precision != "default":  # set before anything is traced: it is read at lowering time
        jax.config.update("jax_default_matmul_precision", args.matmul_precision)
    if args.quick:
        args.rows, args.rounds, args.local_steps, args.batch_size = ("cnn2c1f@8x8x1:2",), 1, 1, 4
        args.lowerings, args.strategies, args.auto = ("im2col",), ("fused",), False
    device = kit.device_info()
    device.update(matmul_flops_per_s(device["platform"]))
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"conv-lowering-{kit.slug(device['backend'] + '-' + device['device_kind'])}.json")
    report = {"benchmark": "conv_lowering", "device": device, "argv": list(sys.argv[1:] if argv is None else argv),
              "command": "python -m benchmarks.conv_lowering " + " ".join(sys.argv[1:] if argv is None else argv),
              "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "git_revision": git_revision(), "config": {k: v for k, v in vars(args).items() if k != "out"},
              "data": "random normal images, uniform random labels (the shapes set the speed)", "results": [],
              **({"note": args.note} if args.note else {})}
    kit.log(f"matmul: {device['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s")
    for dtype in args.dtypes:
        for row in args.rows:
            cfg = dict(rounds=args.rounds, local_steps=args.local_steps, batch_size=args.batch_size, lr=args.lr,
                       lowerings=args.lowerings, strategies=args.strategies, dtype=dtype, auto=args.auto)
            done = list(report["results"])

            def save(record, done=done):
                kit.write_json(out, {**report, "results": [*done, record]})

            report["results"].append(run_row(row, cfg, device["matmul_flops_per_s"], set(args.skip), save))
            print(table(report["results"][-1]) + "\n", flush=True)
            kit.write_json(out, report)
    print(f"wrote {out}")
    from benchmarks.redraw import speedups  # the figure the benchmarks page shows, beside the file

    print(f"drew {speedups(pathlib.Path(out))[0]}")
    bad = [(r["row"], n) for r in report["results"] for n, c in r["cells"].items()
           if r["dtype"] == "float32" and c.get("max_abs_diff_vs_plain", 0) > TOLERANCE]
    for row, name in bad:
        print(f"CORRECTNESS FAILURE: {row} {name} differs from the plain loop by more than {TOLERANCE}",
              file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
