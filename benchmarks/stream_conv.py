"""Bounded memory for conv models on CPU: the stepwise strategy against the streamed one with stepwise chunks.

``stepwise:1`` keeps every client's local state of the cohort (``[K, model]``) until the round's end;
``stream-stepwise:1`` trains each client by the same loop of jitted steps and folds it into running sums
at once, so only one client's state exists.  Each strategy runs in its own subprocess (``ru_maxrss`` is its
own peak): one warm-up round, then ``--rounds`` timed rounds of FedAvg on random data, no plain loop beside it.

    python -m benchmarks.stream_conv --model vgg9 --cohort 100          # both strategies, ~10 min on CPU

Writes ``benchmarks/results/stream-conv-<backend>-<device>.json``: per strategy the seconds per round,
the peak RSS and the RSS once model and data existed, and the largest parameter difference between the
strategies' global models after the same rounds (each run's ``max_abs_param_diff_to_first``: against the
first strategy's).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from fedpartial._src.bench.provenance import stamp

STRATEGIES = ("stepwise:1", "stream-stepwise:1")


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker(model_name: str, k: int, strategy_text: str, rounds: int, local_steps: int, batch_size: int,
           params_out: str) -> dict:
    """One strategy in this process: FedAvg rounds on ``k`` clients' random data; the global parameters
    after the last round go to ``params_out`` (npz) for the comparison."""
    import jax
    import numpy as np

    from fedpartial._src.engine.round import FederatedRound
    from fedpartial._src.engine.strategy import parse_strategy
    from fedpartial._src.engine.types import cohort_from_packed
    from fedpartial._src.bench.suite import DEFAULT_INPUT, INPUT_SHAPES, SEED
    from fedpartial._src.bench.kit import NUM_CLASSES, client_optimizer, make_data
    from fedpartial._src.methods.catalog import get_method
    from fedpartial._src.models import registry
    from fedpartial._src.models.adapter import from_linen

    shape = INPUT_SHAPES.get(model_name, DEFAULT_INPUT)
    module = registry.build_model(model_name, NUM_CLASSES, shape)
    model = from_linen(module, input_shape=shape, num_classes=NUM_CLASSES,
                       sequential=registry.MODELS[model_name].sequential, name=model_name)
    packed = make_data(k, batch_size=batch_size, local_steps=local_steps, input_shape=shape, seed=SEED)
    cohort = cohort_from_packed(packed, np.arange(k))
    rnd = FederatedRound(model, get_method("fedavg"), num_clients=k, cohort_size=k,
                         client_optimizer=client_optimizer(0.05, 0.9),
                         strategy=parse_strategy(strategy_text, model=model))
    state = rnd.init(jax.random.key(SEED))
    rss_ready = _rss()
    times = []
    for t in range(rounds + 1):  # round 0 compiles
        t0 = time.perf_counter()
        state, metrics = rnd(state, cohort, jax.random.fold_in(jax.random.key(SEED + 1), t))
        jax.block_until_ready(state)
        times.append(time.perf_counter() - t0)
    leaves = jax.tree.leaves(jax.device_get(state.variables))
    np.savez(params_out, *leaves)
    return {"strategy": strategy_text, "warmup_s": times[0], "round_s": times[1:], "rss_ready": rss_ready,
            "peak_rss": _rss(), "train_loss": float(metrics["train_loss"]), "trace_count": rnd.trace_count}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="vgg9")
    p.add_argument("--cohort", type=int, default=100)
    p.add_argument("--rounds", type=int, default=1, help="timed rounds after the warm-up round")
    p.add_argument("--local-steps", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--out", help="JSON path (default benchmarks/results/stream-conv-<backend>-<device>.json)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--params-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sizes = (args.model, args.cohort)
    settings = dict(rounds=args.rounds, local_steps=args.local_steps, batch_size=args.batch_size)
    if args.worker:
        print(json.dumps(worker(*sizes, args.worker, params_out=args.params_out, **settings)), flush=True)
        return 0
    import numpy as np

    from benchmarks.strategies import default_out, device_info, log

    device = device_info()
    out = args.out or default_out(device).replace("strategies-", "stream-conv-")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs, params = [], []
    for i, strategy in enumerate(s for s in args.strategies.split(",") if s):
        log(f"{args.model} K={args.cohort} {strategy}")
        params_out = f"{out}.{i}.npz"
        cmd = [sys.executable, "-m", "benchmarks.stream_conv", "--worker", strategy, "--params-out", params_out,
               "--model", args.model, "--cohort", str(args.cohort), "--rounds", str(args.rounds),
               "--local-steps", str(args.local_steps), "--batch-size", str(args.batch_size)]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root)
        if proc.returncode:
            runs.append({"strategy": strategy, "error": proc.stderr[-2000:]})
            continue
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        with np.load(params_out) as f:
            params.append([f[name] for name in f.files])
        os.remove(params_out)
        log(f"  warm-up {runs[-1]['warmup_s']:.1f} s, rounds {[round(t, 1) for t in runs[-1]['round_s']]} s, "
            f"peak RSS {runs[-1]['peak_rss'] / 2**30:.2f} GiB")
    report = {"benchmark": "stream_conv", "device": device, "model": args.model, "cohort_size": args.cohort,
              **settings, "runs": runs}
    # each strategy's global model against the first strategy's (the key below: the first two, as before)
    done = [r for r in runs if "error" not in r]
    for run, p in zip(done[1:], params[1:]):
        run["max_abs_param_diff_to_first"] = max(float(np.max(np.abs(a - b))) for a, b in zip(params[0], p))
    if len(params) > 1:
        report["max_abs_param_diff"] = done[1]["max_abs_param_diff_to_first"]
    with open(out, "w") as f:
        json.dump(stamp(report), f, indent=2)
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
