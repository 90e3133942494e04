"""Where a cohort's local step spends its time: one SGD step of K clients, four ways, side by side.

The fused round trains the cohort as ``vmap`` over clients of a single-client step inside ``lax.scan``;
with each client's own weights, XLA lowers a vmapped conv to a *grouped* conv (``feature_group_count`` or
``batch_group_count`` = K).  This probe times one step of the whole cohort:

* ``plain``: the single-client step called K times from Python (the plain loop's step);
* ``vmapped``: that step ``vmap``-ped over the K clients, one jitted call (the fused strategy's step);
* ``mapped``: the same step in ``lax.map`` over the clients, one jitted call (ordinary convs, one client
  after another on the device: no dispatch from Python, no grouped conv);
* ``shared``: one model's step on all K·B examples (the same FLOPs as one ordinary conv: the ceiling).

Each is the best of ``--repeats`` timed calls; FLOP/s use the analytic training FLOPs (kernels only,
:func:`fedpartial._src.costs.flops.training_flops`: XLA's cost analysis counts no cuDNN conv), next to a large
float32 matmul at default precision timed in the same run.  The vmapped step's compiled HLO is searched
for grouped convolutions.

    python -m benchmarks.conv_probe --models cnn2c1f,vgg9 --cohorts 100,1000 --out PATH
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

from fedpartial._src.bench.kit import (NUM_CLASSES, PlainLoop, best_time, client_optimizer, device_info, int_list,
                                       log, name_list, slug, write_json)
from fedpartial._src.bench.suite import INPUT_SHAPES, DEFAULT_INPUT, matmul_flops_per_s
from fedpartial._src.costs import flops
from fedpartial._src.models import registry
from fedpartial._src.models.adapter import from_linen

VARIANTS = ("plain", "vmapped", "mapped", "shared")


def grouped_convolutions(hlo: str) -> dict:
    """Counts of convolutions in an HLO text whose feature or batch group count is above 1."""
    return {name: sum(1 for v in re.findall(rf"{name}=(\d+)", hlo) if int(v) > 1)
            for name in ("feature_group_count", "batch_group_count")}


def probe(model_name: str, k: int, batch_size: int, repeats: int, peak: float, shape=None) -> dict:
    shape = tuple(shape or INPUT_SHAPES.get(model_name, DEFAULT_INPUT))
    module = registry.build_model(model_name, NUM_CLASSES, shape)
    model = from_linen(module, input_shape=shape, num_classes=NUM_CLASSES,
                       sequential=registry.MODELS[model_name].sequential, name=model_name)
    loop = PlainLoop(module, client_optimizer(0.01, 0.9), shape)
    variables = loop.init_variables(jax.random.key(0))
    params, stats = variables["params"], variables.get("batch_stats", {})
    opt_state = loop.optimizer.init(params)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(k, batch_size, *shape)).astype(np.float32))
    y = jnp.asarray(rng.integers(0, NUM_CLASSES, size=(k, batch_size)).astype(np.int32))
    stack = lambda tree: jax.tree.map(lambda a: jnp.broadcast_to(a, (k, *a.shape)), tree)  # noqa: E731
    cohort = (stack(params), stack(stats), stack(opt_state))
    step = loop.sgd_step
    vmapped = jax.jit(jax.vmap(step))
    mapped = jax.jit(lambda p, s, o, xs, ys: jax.lax.map(lambda a: step(*a), (p, s, o, xs, ys)))
    flat_x, flat_y = x.reshape(k * batch_size, *shape), y.reshape(k * batch_size)
    per_client = [(x[i], y[i]) for i in range(k)]  # sliced once: the timed loop dispatches only the steps
    runs = {
        "plain": lambda: [step(params, stats, opt_state, xi, yi)[3] for xi, yi in per_client],
        "vmapped": lambda: vmapped(*cohort, x, y)[3],
        "mapped": lambda: mapped(*cohort, x, y)[3],
        "shared": lambda: step(params, stats, opt_state, flat_x, flat_y)[3],
    }
    work = flops.training_flops(model, batch_size=1) * k * batch_size
    record = {"model": model_name, "cohort_size": k, "batch_size": batch_size, "input_shape": list(shape),
              "training_flops_per_step": work, "variants": {}}
    for name in VARIANTS:
        seconds = best_time(runs[name], repeats)
        record["variants"][name] = {"seconds": seconds, "flops_per_s": work / seconds,
                                    "share_of_matmul": work / seconds / peak}
        log(f"  {model_name} K={k} {name:<8} {seconds * 1e3:9.2f} ms  {work / seconds / 1e12:7.2f} TFLOP/s "
            f"({work / seconds / peak:.1%} of matmul)")
    hlo = vmapped.lower(*cohort, x, y).compile().as_text()
    record["vmapped_grouped_convolutions"] = grouped_convolutions(hlo)
    base = record["variants"]["plain"]["seconds"]
    for name in VARIANTS:
        record["variants"][name]["speedup_over_plain"] = base / record["variants"][name]["seconds"]
    return record


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="cnn2c1f,vgg9")
    p.add_argument("--cohorts", default="100")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--input-size", type=int, default=None, help="spatial side of the examples (default: the model's)")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/conv-probe-<device>-<date>.json)")
    args = p.parse_args(argv)
    device = device_info()
    device.update(matmul_flops_per_s(device["platform"]))
    peak = device["matmul_flops_per_s"]
    name = slug(device["backend"] + "-" + device["device_kind"])
    out = args.out or os.path.join("benchmarks", "results", f"conv-probe-{name}-{datetime.date.today():%Y%m%d}.json")
    results = []
    for model_name in name_list(args.models):
        for k in int_list(args.cohorts):
            shape = None
            if args.input_size:
                side = args.input_size
                shape = (side, side, INPUT_SHAPES.get(model_name, DEFAULT_INPUT)[-1])
            results.append(probe(model_name, k, args.batch_size, args.repeats, peak, shape))
            write_json(out, {"benchmark": "conv_probe", "device": device, "config": vars(args),
                             "argv": list(sys.argv[1:] if argv is None else argv), "results": results})
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
