"""FedAvg rounds per second of every execution strategy, against a plain per-client loop.

Usage::

    python -m benchmarks.strategies [--quick] [--out PATH] [--models mlp,cnn2c1f]
        [--cohorts 20,200] [--rounds R] [--local-steps S] [--batch-size B]
        [--skip NAME[,NAME...]]

For every model and cohort size K (population N = K, so every client trains in
every round) the script measures:

* ``plain_loop`` — the baseline most FL libraries amount to: for each client in
  turn, a ``jax.jit``-ted single-client SGD step called S times from Python, then
  the ``n_k``-weighted mean of the client models with ``jax.tree.map`` on the
  host.  Only the Flax module is shared with the engine.
* ``fused`` — :func:`fedpartial._src.engine.strategy.fused` (all clients vmapped in one jit);
* ``fused_chunk`` — ``fused(min(K, 20))`` (``lax.map`` over vmapped chunks);
* ``fused_unrolled`` — ``fused(min(K, 20), unroll=True)`` (local steps unrolled);
* ``stepwise_1`` — ``stepwise(1)`` (host loop over clients and steps);
* ``stepwise_chunk`` — ``stepwise(min(K, 20))``.

Each one is built, run for one warm-up round (compilation; timed separately and
used as the correctness check: from the same initial parameters and data the
new global parameters must match the plain loop's), then timed over R rounds
with ``jax.block_until_ready``.  The cohort is packed once, outside the timing;
every strategy receives the same host (numpy) arrays, so each round includes
moving its data to the device, as a driver's round does.

``--skip`` takes strategy names (``fused``) or ``MODEL:K:NAME`` entries
(``cnn2c1f:200:fused``) for one configuration only.  A measurement that raises is
recorded as ``{"error": ...}`` and the run goes on.  The exit status is 1 when a
strategy disagrees with the plain loop by more than ``FAIL_TOLERANCE``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any

import jax
import numpy as np
import optax

# benchmarks/compare_revisions.py runs this file in older checkouts too, so each layout is tried in turn.
try:  # this tree: the package under fedpartial/_src
    from fedpartial._src.bench import kit as bench
    from fedpartial._src.bench.kit import PlainLoop, device_info, int_list, log, max_abs_diff, name_list, slug, timed
    from fedpartial._src.methods.basic.fedavg import fedavg
    from fedpartial._src.models import registry
    from fedpartial._src.models.adapter import from_linen
except ModuleNotFoundError:  # before the layout by layer: fedpartial/benchkit.py, fedpartial/engine.py, ...
    from fedpartial import benchkit as bench
    from fedpartial.benchkit import PlainLoop, device_info, int_list, log, max_abs_diff, name_list, slug, timed
    from fedpartial.methods.fedavg import fedavg
    from fedpartial.models import registry
    from fedpartial.models.adapter import from_linen
try:  # the engine split into modules
    from fedpartial._src.engine.round import FederatedRound
    from fedpartial._src.engine.strategy import Strategy, fused, stepwise
    from fedpartial._src.engine.types import cohort_from_packed
except ModuleNotFoundError:
    try:  # the engine in one module under fedpartial/_src
        from fedpartial._src.engine.round import FederatedRound, Strategy, cohort_from_packed, fused, stepwise
    except ModuleNotFoundError:  # the engine before the move: fedpartial/engine.py
        from fedpartial.engine import FederatedRound, Strategy, cohort_from_packed, fused, stepwise

STRATEGY_NAMES = ("plain_loop", "fused", "fused_chunk", "fused_unrolled", "stepwise_1", "stepwise_chunk")
ENGINE_STRATEGIES = STRATEGY_NAMES[1:]
CHUNK = 20  # clients per chunk of the chunked strategies (at most K)
WARN_TOLERANCE = 1e-4
FAIL_TOLERANCE = 1e-3
NUM_CLASSES = bench.NUM_CLASSES
SEED = 0

DEFAULTS = dict(models=("mlp", "cnn2c1f"), cohorts=(20, 200), local_steps=5, batch_size=32, rounds=3,
                input_size=28, lr=0.05, momentum=0.9)
QUICK = dict(models=("mlp",), cohorts=(4,), local_steps=2, batch_size=8, rounds=1,
             input_size=8, lr=0.05, momentum=0.9)


# ---- setup --------------------------------------------------------------------------


def engine_strategy(name: str, k: int) -> Strategy:
    chunk = min(k, CHUNK)
    return {
        "fused": fused(None),
        "fused_chunk": fused(chunk),
        "fused_unrolled": fused(chunk, unroll=True),
        "stepwise_1": stepwise(1),
        "stepwise_chunk": stepwise(chunk),
    }[name]


def client_optimizer(cfg: dict) -> optax.GradientTransformation:
    return bench.client_optimizer(cfg["lr"], cfg["momentum"])


def make_data(k: int, cfg: dict, seed: int):
    """Random data for ``k`` clients (:func:`fedpartial._src.bench.suite.make_data`), ``input_size``² grey images."""
    return bench.make_data(k, batch_size=cfg["batch_size"], local_steps=cfg["local_steps"],
                           input_shape=(cfg["input_size"], cfg["input_size"], 1), seed=seed)


# ---- measuring ----------------------------------------------------------------------


def measure_plain(module, model_input_shape, packed, cfg, key) -> tuple[dict, Any]:
    loop = PlainLoop(module, client_optimizer(cfg), model_input_shape)
    params0 = loop.init(key)
    (params1, loss), warmup = timed(lambda: loop(params0, packed))
    params, times = params1, []
    for _ in range(cfg["rounds"]):
        (params, _), dt = timed(lambda: loop(params, packed))
        times.append(dt)
    return ({"warmup_s": warmup, "round_times_s": times, "first_round_loss": float(loss)},
            (params0, params1, float(loss)))


def measure_engine(name, model, packed, cfg, key, reference) -> dict:
    k = packed.step_mask.shape[0]
    strategy = engine_strategy(name, k)
    rnd = FederatedRound(model, fedavg(), num_clients=k, cohort_size=k,
                         client_optimizer=client_optimizer(cfg), strategy=strategy)
    cohort = cohort_from_packed(packed, np.arange(k))
    state0 = rnd.init(key)
    initial_params = jax.device_get(state0.variables["params"])  # the fused round may donate state0
    round_key = jax.random.key(SEED + 1)
    (state, metrics), warmup = timed(lambda: rnd(state0, cohort, round_key))
    out = {"chunk_size": strategy.chunk_size, "warmup_s": warmup,
           "first_round_loss": float(metrics["train_loss"])}
    if reference is not None:
        params0, params1, loss = reference
        out["initial_params_match"] = max_abs_diff(initial_params, params0) == 0.0
        out["max_abs_diff_vs_plain"] = max_abs_diff(state.variables["params"], params1)
        out["loss_diff_vs_plain"] = abs(out["first_round_loss"] - loss)
    traces = rnd.trace_count
    times = []
    for t in range(cfg["rounds"]):
        (state, metrics), dt = timed(lambda: rnd(state, cohort, jax.random.fold_in(round_key, t)))
        times.append(dt)
    out["round_times_s"] = times
    out["retraced_while_timing"] = rnd.trace_count != traces
    return out


def finish(entry: dict, rounds: int) -> dict:
    times = entry.get("round_times_s")
    if times:
        entry["rounds_per_s"] = rounds / sum(times)
    return entry


def run_config(model_name: str, k: int, cfg: dict, skip: set[str]) -> dict:
    shape = (cfg["input_size"], cfg["input_size"], 1)
    module = registry.build_model(model_name, NUM_CLASSES, shape)
    model = from_linen(module, input_shape=shape, num_classes=NUM_CLASSES,
                       sequential=registry.MODELS[model_name].sequential, name=model_name)
    packed = make_data(k, cfg, SEED)
    key = jax.random.key(SEED)
    record = {"model": model_name, "cohort_size": k, "num_clients": k, "measurements": []}
    reference = None

    def skipped(name):
        return name in skip or f"{model_name}:{k}:{name}" in skip

    for name in STRATEGY_NAMES:
        entry = {"strategy": name}
        if skipped(name):
            entry["skipped"] = True
            record["measurements"].append(entry)
            log(f"  {name:<15} skipped")
            continue
        log(f"  {name:<15} ...")
        try:
            if name == "plain_loop":
                result, reference = measure_plain(module, shape, packed, cfg, key)
                record["num_params"] = sum(int(np.size(p)) for p in jax.tree.leaves(reference[0]))
                result["max_abs_diff_vs_plain"] = 0.0
            else:
                result = measure_engine(name, model, packed, cfg, key, reference)
            entry.update(result)
        except Exception as e:  # noqa: BLE001 - one failed measurement must not end the run
            entry["error"] = f"{type(e).__name__}: {e}"
        finish(entry, cfg["rounds"])
        record["measurements"].append(entry)
        log(f"  {name:<15} {describe(entry)}")

    base = next((m.get("rounds_per_s") for m in record["measurements"] if m["strategy"] == "plain_loop"), None)
    for m in record["measurements"]:
        if base and m.get("rounds_per_s"):
            m["speedup_vs_plain"] = m["rounds_per_s"] / base
        diff = m.get("max_abs_diff_vs_plain")
        if diff is not None:
            m["correct"] = diff <= FAIL_TOLERANCE
    return record


def describe(entry: dict) -> str:
    if entry.get("error"):
        return f"error: {entry['error'][:200]}"
    parts = [f"{entry.get('rounds_per_s', math.nan):.4g} rounds/s", f"warm-up {entry.get('warmup_s', math.nan):.2f}s"]
    if entry.get("max_abs_diff_vs_plain") is not None:
        parts.append(f"max|diff| {entry['max_abs_diff_vs_plain']:.2e}")
    return ", ".join(parts)


# ---- output -------------------------------------------------------------------------


def default_out(device: dict) -> str:
    name = f"strategies-{device['backend']}-{slug(device['device_kind'])}.json"
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", name)


def table(record: dict) -> str:
    title = f"{record['model']}  K={record['cohort_size']}  ({record.get('num_params', '?')} params)"
    head = f"{'strategy':<16}{'chunk':>6}{'rounds/s':>11}{'vs plain':>10}{'warm-up s':>11}{'max|diff|':>11}"
    lines = [title, head, "-" * len(head)]
    for m in record["measurements"]:
        chunk = "" if m.get("chunk_size") is None else str(m["chunk_size"])
        if m.get("skipped"):
            lines.append(f"{m['strategy']:<16}{chunk:>6}  skipped")
            continue
        if m.get("error"):
            lines.append(f"{m['strategy']:<16}{chunk:>6}  error: {m['error'][:80]}")
            continue
        rps = m.get("rounds_per_s", math.nan)
        ratio = m.get("speedup_vs_plain")
        diff = m.get("max_abs_diff_vs_plain")
        lines.append(
            f"{m['strategy']:<16}{chunk:>6}{rps:>11.4g}{'' if ratio is None else f'{ratio:.2f}x':>10}"
            f"{m.get('warmup_s', math.nan):>11.2f}{'' if diff is None else f'{diff:.1e}':>11}"
        )
    return "\n".join(lines)


# ---- entry point --------------------------------------------------------------------


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.strategies", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes (the MLP only, K=4, S=2, R=1, batch 8, 8x8x1 inputs)")
    p.add_argument("--out", help="JSON path (default benchmarks/results/strategies-<backend>-<device>.json)")
    p.add_argument("--models", type=name_list, help="comma-separated registry model names")
    p.add_argument("--cohorts", type=int_list, help="comma-separated cohort sizes K (population N = K)")
    p.add_argument("--rounds", type=int, help="timed rounds R per measurement")
    p.add_argument("--local-steps", type=int, help="local steps S per client")
    p.add_argument("--batch-size", type=int, help="examples per local step B")
    p.add_argument("--skip", type=name_list, default=(),
                   help=f"strategies to skip: names from {', '.join(STRATEGY_NAMES)}, or MODEL:K:NAME")
    args = p.parse_args(argv)
    cfg = dict(QUICK if args.quick else DEFAULTS)
    for field in ("models", "cohorts", "rounds", "local_steps", "batch_size"):
        value = getattr(args, field)
        if value is not None:
            cfg[field] = value
    for entry in args.skip:
        if entry.split(":")[-1] not in STRATEGY_NAMES:
            p.error(f"--skip {entry!r}: strategy must be one of {', '.join(STRATEGY_NAMES)}")
    for model in cfg["models"]:
        if model not in registry.MODELS:
            p.error(f"--models: unknown model {model!r}; choose from {', '.join(sorted(registry.MODELS))}")
    if min(cfg["cohorts"], default=0) < 1 or cfg["rounds"] < 1 or cfg["local_steps"] < 1 or cfg["batch_size"] < 1:
        p.error("cohort sizes, rounds, local steps and batch size must all be >= 1")
    return args, cfg


def main(argv=None) -> int:
    args, cfg = parse_args(argv)
    device = device_info()
    out = args.out or default_out(device)
    config = {
        **{k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()},
        "quick": args.quick,
        "input_shape": [cfg["input_size"], cfg["input_size"], 1],
        "num_classes": NUM_CLASSES,
        "method": "fedavg",
        "client_optimizer": f"sgd(lr={cfg['lr']}, momentum={cfg['momentum']})",
        "server_optimizer": "sgd(1.0)",
        "chunk": f"min(K, {CHUNK})",
        "seed": SEED,
        "skip": list(args.skip),
        "population": "N = K (every client in the cohort)",
        "data": "random normal x, uniform random labels; client sizes uniform in [B, 4B]",
    }
    log(f"device: {device['backend']} / {device['device_kind']}  ({device['cpu_count']} CPUs)")
    results = []
    started = time.perf_counter()

    def write(complete: bool) -> None:
        # Rewritten after every configuration, so an interrupted run keeps what it measured.
        bench.write_json(out, {"benchmark": "strategies", "complete": complete, "device": device, "config": config,
                               "results": results, "total_time_s": time.perf_counter() - started})

    for model_name in cfg["models"]:
        for k in cfg["cohorts"]:
            log(f"{model_name} K={k}")
            results.append(run_config(model_name, k, cfg, set(args.skip)))
            print(table(results[-1]) + "\n", flush=True)
            write(complete=False)
    write(complete=True)
    print(f"wrote {out}")

    status = 0
    for record in results:
        for m in record["measurements"]:
            diff = m.get("max_abs_diff_vs_plain")
            if diff is not None and diff > FAIL_TOLERANCE:
                print(f"CORRECTNESS FAILURE: {record['model']} K={record['cohort_size']} {m['strategy']} "
                      f"differs from the plain loop by {diff:.3g} (> {FAIL_TOLERANCE})", file=sys.stderr)
                status = 1
            elif diff is not None and diff > WARN_TOLERANCE:
                print(f"warning: {record['model']} K={record['cohort_size']} {m['strategy']} differs from "
                      f"the plain loop by {diff:.3g} (> {WARN_TOLERANCE})", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
