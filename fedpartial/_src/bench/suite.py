"""Throughput suite (``fedpartial bench``): rounds/s and client-steps/s of every method and strategy,
each next to a plain per-client loop of jitted steps measured in the same run.

For every model and cohort size K (population N = K: every client trains every round)
the suite packs one cohort of random data and builds, side by side:

* ``plain_loop`` — the baseline most FL libraries amount to (:class:`PlainLoop`): for
  each client in turn a ``jax.jit``-ted single-client SGD step called S times from
  Python, then the ``n_k``-weighted mean of the client models.  It is FedAvg; every
  method's ratio is taken against it.  Above ``plain_clients`` clients it runs the
  first ``plain_clients`` clients and its time is scaled by ``K / plain_clients``
  (its cost is linear in K; recorded as ``extrapolated_from_clients``).
* one :class:`fedpartial._src.engine.round.FederatedRound` per method and strategy.

Every runner does one warm-up round (compilation, and the correctness check: FedAvg
must match the plain loop, every other method its own first strategy), then the
runners take turns, one timed round each, R times (the median counts), so load on a
shared machine hits them alike.  Per method the phases are jitted separately on the same
inputs and timed: local training (on an accelerator steps in ``lax.scan``, the cohort vmapped; on a
CPU a jitted step per client and step called from Python, as scanned and vmapped conv steps are
slow there), selection (the method's
``select``: FedLDF's divergence and top-n), aggregation (the masked weighted mean and
the server optimizer), evaluation (the global model on ``eval_examples`` test examples).
``round_flops`` is XLA's count for the whole fused round; ``achieved_flops_per_s`` is
that times rounds/s, next to ``device.matmul_flops_per_s``, a large float32 matmul
timed in the same run.  XLA counts no cuDNN conv on a GPU, so each runner (the plain loop too) also gets
``full_model_flops_per_s``: K clients' S full-model steps, analytic (``full_model_training_flops``), × rounds/s.

A preset may leave out cells or strategies too slow for it (``Settings.skip``, recorded
as skipped).  Memory: before a cell is built its size is estimated (:func:`estimate_bytes`) and a
cell above 70% of the available memory is skipped with the reason.  ``peak_memory_bytes``
is, on a GPU, ``memory_stats()['peak_bytes_in_use']`` (the process's high-water mark so
far); on a CPU the process's maximum resident set size so far.  ``memory_growth_bytes``
is how much that mark rose while the runner was built and ran its warm-up round (0 when
an earlier runner had already gone higher).

The JSON (device, versions, settings, every measurement) is written after every cell,
so an interrupted run keeps what it measured; the figure (PNG) next to it shows every
runner's ratio to the plain loop and FedLDF's round time over FedAvg's (the table, the
figure and the derived ratios: :mod:`fedpartial._src.bench.report`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import resource
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from fedpartial._src.core import aggregation
from fedpartial._src.costs import flops
from fedpartial._src.engine.round import FederatedRound
from fedpartial._src.engine.runners.stepwise import Stepwise
from fedpartial._src.engine.strategy import fused, parse_strategy
from fedpartial._src.engine.types import Cohort, LocalInputs, ServerState, cohort_from_packed
from fedpartial._src.experiment import evaluation
from fedpartial._src.core import memory
from fedpartial._src.bench.kit import (
    NUM_CLASSES,
    PlainLoop,
    best_time,
    client_optimizer,
    device_info,
    first_clients,
    int_list,
    log,
    make_data,
    max_abs_diff,
    name_list,
    timed,
    write_json,
)
from fedpartial._src.bench.report import default_out, derive, plot, table
from fedpartial._src.core.types import RoundView
from fedpartial._src.core.errors import UserError
from fedpartial._src.methods.catalog import METHODS, get_method
from fedpartial._src.methods.base import gather_clients
from fedpartial._src.models import registry
from fedpartial._src.models.adapter import from_linen

SEED = 0
FAIL_TOLERANCE = 1e-3  # max |difference| of new global parameters between paths of the same computation
MEMORY_SHARE = 0.7  # a cell estimated above this share of the available memory is skipped

# ---- the device ---------------------------------------------------------------------


def matmul_flops_per_s(platform_name: str | None = None) -> dict:
    """A large float32 matmul's FLOP/s on the default device (fastest of a few runs)."""
    n = 2048 if (platform_name or jax.default_backend()) == "cpu" else 8192
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    matmul = jax.jit(jnp.matmul)
    seconds = best_time(lambda: matmul(a, b), repeats=5)
    return {"matmul_size": n, "matmul_dtype": "float32", "matmul_precision": "default",
            "matmul_flops_per_s": 2.0 * n ** 3 / seconds}


def available_bytes() -> int | None:
    """Memory a cell may use: the device's free memory on a GPU, available RAM on a CPU (None: unknown)."""
    return memory.available_bytes()[0]


def peak_memory_bytes() -> int:
    """GPU: the device's peak bytes in use so far; CPU: the process's maximum resident set size so far."""
    dev = jax.devices()[0]
    if dev.platform != "cpu":
        return int((dev.memory_stats() or {}).get("peak_bytes_in_use", 0))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def estimate_bytes(num_params: int, k: int, packed_bytes: int, chunk: int | None) -> int:
    """A cell's memory: the cohort data, the trained models, masks and aggregation temporaries of all K
    clients (4 float32 copies), and the local state of the clients trained at once (params, momentum,
    gradient: 3 copies) — activations are not counted."""
    at_once = k if chunk is None else min(chunk, k)
    return packed_bytes + 4 * num_params * (4 * k + 3 * at_once)


# ---- settings -----------------------------------------------------------------------

#: models' example shapes (28x28 grey for the small models, 32x32 colour for the CIFAR ones)
INPUT_SHAPES = {"vgg9": (32, 32, 3), "resnet20": (32, 32, 3), "cnn2c3f": (32, 32, 3)}
DEFAULT_INPUT = (28, 28, 1)


@dataclasses.dataclass(frozen=True)
class Settings:
    models: tuple[str, ...]
    cohorts: tuple[int, ...]
    methods: tuple[str, ...]
    strategies: tuple[str, ...]
    local_steps: int = 10
    batch_size: int = 32
    rounds: int = 2
    plain_clients: int = 100
    input_size: int | None = None  # spatial side of the examples; None: the model's own (INPUT_SHAPES)
    eval_examples: int = 2048
    skip: tuple[str, ...] = ()  # 'MODEL/K' (a whole cell) or 'MODEL/K/STRATEGY'; '*' matches any model or K
    lr: float = 0.05
    momentum: float = 0.9

    def input_shape(self, model: str) -> tuple[int, ...]:
        shape = INPUT_SHAPES.get(model, DEFAULT_INPUT)
        return shape if self.input_size is None else (self.input_size, self.input_size, shape[-1])


PRESETS = {
    # minutes on a 2-core CPU: the whole-cohort fused strategy and chunks of vmapped conv steps are left out
    # (measured 0.04-0.05x a plain loop for cnn2c1f on CPU, benchmarks/results/strategies-cpu-cpu.json)
    "quick": Settings(models=("mlp", "lenet5", "cnn2c1f"), cohorts=(20, 100), methods=("fedavg", "fedldf"),
                      strategies=("auto", "fused:20", "stepwise:1", "stepwise:20"), local_steps=5, batch_size=16,
                      rounds=3, skip=("cnn2c1f/100", "cnn2c1f/*/fused:20", "lenet5/*/fused:20")),
    # everything, for a GPU
    "full": Settings(models=("mlp", "cnn2c1f", "lenet5", "vgg9", "resnet20"), cohorts=(10, 100, 1000, 10000),
                     methods=("fedavg", "fedldf", "fedspu"),
                     strategies=("auto", "fused", "fused:100", "fused-unrolled:100", "stepwise:1", "stepwise:100"),
                     rounds=3),
    # seconds: the smoke test
    "smoke": Settings(models=("mlp",), cohorts=(4,), methods=("fedavg", "fedldf"), strategies=("auto", "fused:2"),
                      local_steps=2, batch_size=8, rounds=1, input_size=8, eval_examples=64),
}


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The preset with the flags given on top; every bad value is one sentence naming its flag."""
    if args.preset not in PRESETS:
        raise UserError(f"--preset {args.preset!r} is unknown; choose one of {', '.join(PRESETS)}.")
    settings = PRESETS[args.preset]
    changes = {}
    for field, parse in (("models", name_list), ("cohorts", int_list), ("methods", name_list),
                         ("strategies", name_list)):
        text = getattr(args, field, None)
        if text is not None:
            try:
                changes[field] = parse(text)
            except ValueError:
                raise UserError(f"--{field} {text!r} must be comma-separated whole numbers.") from None
            if not changes[field]:
                raise UserError(f"--{field} {text!r} names nothing.")
    for field in ("rounds", "local_steps", "batch_size"):
        value = getattr(args, field, None)
        if value is not None:
            if value < 1:
                raise UserError(f"--{field.replace('_', '-')} {value} must be a positive whole number.")
            changes[field] = value
    for field, allowed, ok in (("lr", "a positive learning rate", lambda v: v > 0),
                               ("momentum", "in [0, 1)", lambda v: 0 <= v < 1)):
        if (value := getattr(args, field, None)) is not None and not ok(value):
            raise UserError(f"--{field} {value} must be {allowed}.")
        changes.update({} if value is None else {field: value})
    settings = dataclasses.replace(settings, **changes)
    for model in settings.models:
        if model not in registry.MODELS:
            raise UserError(f"--models: model {model!r} is unknown; choose from {', '.join(registry.MODELS)}.")
    for method in settings.methods:
        if method not in METHODS:
            raise UserError(f"--methods: method {method!r} is unknown; choose from {', '.join(METHODS)}.")
    for k in settings.cohorts:
        if k < 1:
            raise UserError(f"--cohorts: cohort size {k} must be a positive number of clients.")
    for text in settings.strategies:
        try:
            parse_strategy(text)
        except ValueError as e:
            raise UserError(f"--strategies: {e}") from None
    return settings


# ---- one cell -----------------------------------------------------------------------


def skipped_by(settings: Settings, model: str, k: int, strategy: str | None = None) -> bool:
    """Whether the settings' ``skip`` entries leave out this cell (``strategy`` None) or this strategy of it."""
    for entry in settings.skip:
        parts = entry.split("/", 2)
        if parts[0] in (model, "*") and parts[1] in (str(k), "*") and \
                (len(parts) == 2 or (strategy is not None and parts[2] == strategy)):
            return True
    return False


def local_training(rnd: FederatedRound, global_vars: dict, inputs: tuple[LocalInputs, ...]):
    """Every client's local training as the fused strategy runs it: steps in ``lax.scan``, the cohort
    vmapped.  Returns ``(trained, losses, steps)`` ``[K, ...]``."""
    outs = []
    for fns, part in zip(rnd.clients, inputs):
        def one(start, data, plan, cstate, key, fns=fns):
            prepared = fns.prepare(start, data)
            steps = jnp.arange(jax.tree.leaves(data)[0].shape[0])

            def body(local, xs):
                return fns.step(local, xs[0], plan, global_vars, cstate, key, xs[1], part.server_state), None

            return fns.final(jax.lax.scan(body, fns.init(start, window=plan.window), (prepared, steps))[0], start)
        outs.append(jax.vmap(one)(part.start, part.data, part.plan, part.client_state, part.client_keys))
    return jax.tree.map(lambda *a: jnp.concatenate(a), *outs) if len(outs) > 1 else outs[0]


def local_training_stepwise(rnd: FederatedRound) -> Callable:
    """``train(state, cohort, key, starts)``: every client's local training as the ``stepwise:1`` strategy
    runs it (the engine's own loop: a jitted step per client and step, called from Python; on a CPU, conv
    steps inside ``lax.scan`` run several times slower), finished from the start models ``starts``
    (``rnd.preview(...).start_vars``, computed once outside the timing).  Returns ``(trained, losses,
    steps)`` ``[K, ...]``.  Its jitted pieces are built once, so a timed call compiles nothing."""
    final = jax.jit(rnd.program.final_results)
    stepwise = Stepwise(rnd.program)  # whatever rnd's own strategy

    def train(state, cohort, key, starts):
        _, _, locals_ = stepwise.train(state, cohort, jax.random.key_data(key))
        return final(starts, locals_)

    return train


def measure_phases(rnd: FederatedRound, state: ServerState, cohort: Cohort, key: jax.Array,
                   test: tuple[np.ndarray, np.ndarray], repeats: int) -> dict:
    """Seconds of each phase of one round, jitted separately on the same inputs (fastest of ``repeats``)."""
    inputs = rnd.local_inputs(state, cohort, key)
    preview = rnd.preview(state, cohort, key)
    vmapped = jax.default_backend() != "cpu"
    if vmapped:
        fused_training = jax.jit(lambda g, i: local_training(rnd, g, i))
        train = lambda: fused_training(state.variables, inputs)  # noqa: E731
    else:
        stepwise_training = local_training_stepwise(rnd)
        train = lambda: stepwise_training(state, cohort, key, preview.start_vars)  # noqa: E731
    trained, losses, steps = train()
    view = RoundView(
        key=key, round=state.round, global_vars=state.variables, method_state=state.method_state,
        client_state=gather_clients(state.method_state.clients, cohort.info.client_ids), cohort=cohort.info,
        data=cohort.data, plan=preview.plan, trained_vars=trained, client_loss=losses,
        start_vars=preview.start_vars, client_steps=steps)
    select = jax.jit(lambda v: rnd.method.select(rnd.ctx, v))
    chosen = select(view)

    def aggregate(state, trained, upload, weights):
        new, received = aggregation.aggregate(rnd.ctx.structure, state.variables, trained, upload, weights,
                                              rnd.communicated)
        return aggregation.server_update(rnd.server_optimizer, state.opt_state, state.variables["params"],
                                         new["params"], received)

    aggregate = jax.jit(aggregate)
    x_test, y_test = test
    return {
        "local_training_s": best_time(train, repeats),
        "selection_s": best_time(lambda: select(view), repeats),
        "aggregation_s": best_time(lambda: aggregate(state, trained, chosen.upload, chosen.weights), repeats),
        "evaluation_s": best_time(lambda: evaluation.evaluate(rnd.model, state.variables, x_test, y_test), repeats),
        "evaluation_examples": int(len(y_test)),
        "local_training_mode": "vmapped" if vmapped else "the stepwise:1 strategy's loop of jitted steps",
    }


def _trace_count(runner: "Runner") -> int | None:
    """The runner's round's traces so far (None: the plain loop, or a JAX whose trace cache cannot be read)."""
    if runner.round is None:
        return None
    try:
        return runner.round.trace_count
    except Exception:  # noqa: BLE001 - a private JAX API changed: the check is left out, not the run
        return None


class Runner:
    """One thing timed in a cell: ``step()`` runs one round on its own state."""

    def __init__(self, name: str, method: str, strategy: str, step: Callable[[], Any], num_clients: int):
        self.name, self.method, self.strategy, self.step = name, method, strategy, step
        self.num_clients = num_clients  # clients it really trains a round (the plain loop may run fewer)
        self.times: list[float] = []
        self.entry: dict = {"method": method, "strategy": strategy}
        self.round: FederatedRound | None = None  # the engine's round (None: the plain loop)


def _engine_runner(model, method_name: str, strategy_text: str, cohort, k: int, settings: Settings,
                   key: jax.Array) -> Runner:
    strategy = parse_strategy(strategy_text, model=model)
    rnd = FederatedRound(model, get_method(method_name), num_clients=k, cohort_size=k,
                         client_optimizer=client_optimizer(settings.lr, settings.momentum),
                         strategy=strategy)
    holder = {"state": rnd.init(key), "round": 0}
    round_key = jax.random.key(SEED + 1)

    def step():
        holder["state"], metrics = rnd(holder["state"], cohort, jax.random.fold_in(round_key, holder["round"]))
        holder["round"] += 1
        return holder["state"].variables["params"], metrics["train_loss"]

    runner = Runner(f"{method_name} {strategy_text}", method_name, strategy_text, step, k)
    runner.entry.update(resolved_strategy=str(strategy), chunk_size=strategy.chunk_size)
    runner.round = rnd
    return runner


def run_cell(model_name: str, k: int, settings: Settings, test_data: dict,
             progress: Callable[[dict], None] | None = None) -> dict:
    """Every method and strategy of one model and cohort size, next to the plain loop.  ``progress`` is
    called with the record so far after the warm-ups and after the timed rounds (the suite rewrites its
    JSON then, so a run cut off inside a long cell keeps what it measured)."""
    shape = settings.input_shape(model_name)
    module = registry.build_model(model_name, NUM_CLASSES, shape)
    model = from_linen(module, input_shape=shape, num_classes=NUM_CLASSES,
                       sequential=registry.MODELS[model_name].sequential, name=model_name)
    key = jax.random.key(SEED)
    num_params = sum(int(np.size(p)) for p in jax.tree.leaves(model.init_variables(key)["params"]))
    record = {"model": model_name, "cohort_size": k, "num_clients": k, "num_params": num_params,
              "input_shape": list(shape), "runners": [], "phases": {}}
    s, b = settings.local_steps, settings.batch_size
    packed_bytes = k * s * b * (int(np.prod(shape)) * 4 + 4 + 1) + k * s
    def estimate(text: str | None) -> int:  # a strategy's memory (None: the whole cohort at once)
        chunk = None if text is None else parse_strategy(text, model=model).chunk_size
        return estimate_bytes(num_params, k, packed_bytes, chunk)

    available = available_bytes()

    def too_big(text: str | None) -> str | None:  # why a strategy does not fit, or None
        need = estimate(text)
        if available is None or need <= MEMORY_SHARE * available:
            return None
        return (f"estimated {need / 2**30:.1f} GiB exceeds {MEMORY_SHARE:.0%} of the "
                f"{available / 2**30:.1f} GiB available")

    # the cell's estimate: its largest strategy; the cell runs when at least its smallest fits
    record["estimated_bytes"] = max(estimate(t) for t in settings.strategies)
    if skipped_by(settings, model_name, k):
        record["skipped"] = "left out by the preset (too slow for it on this platform)"
        return record
    smallest = min(settings.strategies, key=estimate)
    if too_big(smallest):
        record["skipped"] = too_big(smallest)
        return record
    packed = make_data(k, batch_size=b, local_steps=s, input_shape=shape, seed=SEED)
    cohort = cohort_from_packed(packed, np.arange(k))

    # the plain loop, on at most plain_clients clients (scaled to K below)
    loop = PlainLoop(module, client_optimizer(settings.lr, settings.momentum), shape)
    m = min(k, settings.plain_clients)
    loop_data = packed if m == k else first_clients(packed, m)
    plain_state = {"variables": loop.init_variables(key)}

    def plain_step():
        plain_state["variables"], loss = loop.round(plain_state["variables"], loop_data)
        return plain_state["variables"]["params"], loss

    runners = [Runner("plain_loop", "fedavg", "plain_loop", plain_step, m)]
    if m < k:
        runners[0].entry["extrapolated_from_clients"] = m
    not_run: list[dict] = []
    for method_name in settings.methods:
        resolved = {}
        for text in settings.strategies:
            if skipped_by(settings, model_name, k, text):
                continue
            if too_big(text):  # e.g. the whole cohort at once, where its chunks fit
                not_run.append({"method": method_name, "strategy": text, "skipped": too_big(text)})
                continue
            try:
                runner = _engine_runner(model, method_name, text, cohort, k, settings, key)
            except UserError as e:  # e.g. a neuron-level method on a residual model: not applicable
                not_run.append({"method": method_name, "strategy": text, "skipped": str(e)})
                log(f"  {method_name} {text}: skipped, {e}")
                break
            same = resolved.get(runner.entry["resolved_strategy"])
            if same is not None:  # e.g. 'auto' resolving to a strategy also listed: measured once
                same.entry.setdefault("also", []).append(text)
                continue
            resolved[runner.entry["resolved_strategy"]] = runner
            runners.append(runner)

    # warm-up: compilation, memory, correctness
    reference: dict[str, Any] = {}
    for runner in runners:
        before = peak_memory_bytes()
        try:
            (params, loss), warmup = timed(runner.step)
        except Exception as e:  # noqa: BLE001 - one failed runner must not end the suite
            runner.entry["error"] = f"{type(e).__name__}: {e}"
            log(f"  {runner.name:<28} error: {runner.entry['error'][:200]}")
            continue
        peak = peak_memory_bytes()
        runner.entry.update(warmup_s=warmup, first_round_loss=float(loss), peak_memory_bytes=peak,
                            memory_growth_bytes=max(peak - before, 0))
        if runner.name == "plain_loop":
            if m == k:
                reference["fedavg"] = params
            continue
        if runner.method in reference:
            diff = max_abs_diff(params, reference[runner.method])
            runner.entry["max_abs_diff_vs_reference"] = diff
            runner.entry["correct"] = diff <= FAIL_TOLERANCE
        else:
            reference[runner.method] = params
            runner.entry["reference"] = True
        log(f"  {runner.name:<28} warm-up {warmup:.2f}s")
    if progress is not None:
        progress({**record, "runners": [r.entry for r in runners] + not_run, "partial": "warm-up done"})

    # timed rounds, runners taking turns
    live = [r for r in runners if "error" not in r.entry]
    traces = [_trace_count(r) for r in live]
    for _ in range(settings.rounds):
        for runner in live:
            runner.times.append(timed(runner.step)[1])
    for runner, before in zip(live, traces):
        if runner.round is not None and before is not None:
            runner.entry["retraced_while_timing"] = _trace_count(runner) != before
        seconds = float(np.median(runner.times)) * k / runner.num_clients  # median: robust to a busy moment
        runner.entry.update(round_times_s=runner.times, round_s=seconds, rounds_per_s=1.0 / seconds,
                            client_steps_per_s=k * s / seconds)

    if progress is not None:
        progress({**record, "runners": [r.entry for r in runners] + not_run, "partial": "timed rounds done"})

    # phases and FLOPs, per method (on a fused round's inputs: only where the whole cohort fits)
    for method_name in dict.fromkeys(r.method for r in runners[1:]):
        rnd = FederatedRound(model, get_method(method_name), num_clients=k, cohort_size=k,
                             client_optimizer=client_optimizer(settings.lr, settings.momentum),
                             strategy=fused(None))
        state, phase_key = rnd.init(key), jax.random.key(SEED + 2)
        phases = {}
        try:
            if too_big(None):  # the phases are timed on the whole cohort at once; XLA's count needs no run
                phases["skipped"] = f"phase times: the whole cohort at once, {too_big(None)}"
            else:
                phases = measure_phases(rnd, state, cohort, phase_key, test_data[shape], repeats=1)
            phases["round_flops"] = flops.xla_costs(rnd.pure_round, state, cohort, phase_key,
                                                    compiled=False).flops
        except Exception as e:  # noqa: BLE001
            phases["error"] = f"{type(e).__name__}: {e}"
        # XLA's count on a GPU misses cuDNN convolutions and a loop's repeats: the analytic kernel count of the
        # full model's training is the work a FedAvg round does however it runs
        phases["full_model_training_flops"] = flops.training_flops(model, batch_size=b) * k * s
        record["phases"][method_name] = phases

    record["runners"] = [r.entry for r in runners] + not_run
    derive(record)
    record["peak_memory_bytes"] = peak_memory_bytes()
    return record


def test_sets(settings: Settings) -> dict:
    """Random evaluation examples for every input shape of the run."""
    rng = np.random.default_rng(SEED)
    out = {}
    for model in settings.models:
        shape = settings.input_shape(model)
        if shape not in out:
            out[shape] = (rng.normal(size=(settings.eval_examples, *shape)).astype(np.float32),
                          rng.integers(0, NUM_CLASSES, size=settings.eval_examples).astype(np.int32))
    return out


# ---- entry point --------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="quick", help=f"one of {', '.join(PRESETS)} (quick: a few minutes "
                                                          "on a CPU; full: every model, cohort and method, for a GPU)")
    parser.add_argument("--models", default=None, help="comma-separated registry models (default: the preset's)")
    parser.add_argument("--cohorts", default=None, help="comma-separated cohort sizes K (population N = K)")
    parser.add_argument("--methods", default=None, help="comma-separated methods (default: the preset's)")
    parser.add_argument("--strategies", default=None,
                        help="comma-separated strategies: auto, fused, fused:N, fused-unrolled:N, stepwise:N")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per runner")
    parser.add_argument("--local-steps", type=int, default=None, help="local steps S per client")
    parser.add_argument("--batch-size", type=int, default=None, help="examples per local step B")
    parser.add_argument("--lr", type=float, default=None,
                        help="client learning rate (default 0.05; VGG-9 diverges on the random data above about 0.02)")
    parser.add_argument("--momentum", type=float, default=None, help="client SGD momentum (default 0.9)")
    parser.add_argument("--out", default=None, help="JSON path; the PNG goes next to it "
                                                     "(default benchmarks/results/throughput-<device>-<date>.json)")


def check_out(out: str | None) -> None:
    """Results are never overwritten: an ``--out`` that exists (or whose figure does) is one sentence."""
    if out is None:
        return
    for path in (out, os.path.splitext(out)[0] + ".png"):
        if os.path.exists(path):
            raise UserError(f"--out {out!r}: {path!r} already exists; give a new path (results are never "
                            f"overwritten).")


def free_path(path: str) -> str:
    """``path``, or ``<stem>-2<ext>``, ``-3`` … when it (or its figure) exists: a second run of the day
    keeps the first's."""
    stem, ext = os.path.splitext(path)
    candidate, n = path, 2
    while os.path.exists(candidate) or os.path.exists(os.path.splitext(candidate)[0] + ".png"):
        candidate, n = f"{stem}-{n}{ext}", n + 1
    return candidate


def run(settings: Settings, out: str | None = None, preset: str = "custom") -> tuple[dict, str]:
    """Runs the suite; returns the report and the JSON path (written after every cell).  ``out`` None: a new
    file named by device and date; an existing ``out`` is refused (nothing is overwritten)."""
    check_out(out)
    device = device_info()
    log(f"device: {device['backend']} / {device['device_kind']}  ({device['cpu_count']} CPUs); "
        "measuring matmul FLOP/s")
    device.update(matmul_flops_per_s(device["platform"]))
    when = datetime.datetime.now(datetime.timezone.utc)
    out = out or free_path(default_out(device, when))
    config = {**dataclasses.asdict(settings), "preset": preset, "num_classes": NUM_CLASSES, "seed": SEED,
              "plain_loop": "FedAvg: per-client Python loop of a jitted SGD step, weighted mean on the host",
              "client_optimizer": f"sgd(lr={settings.lr}, momentum={settings.momentum})",
              "server_optimizer": "sgd(1.0)", "method_options": "registry defaults (fedldf: n = 4)",
              "population": "N = K (every client in the cohort)",
              "data": "random normal x, uniform random labels; client sizes uniform in [B, 4B]",
              "memory_note": "peak_memory_bytes: GPU peak_bytes_in_use so far; CPU process max RSS so far"}
    results: list[dict] = []
    started = time.perf_counter()
    test_data = test_sets(settings)

    def report(complete: bool) -> dict:
        return {"benchmark": "throughput", "complete": complete, "date": when.isoformat(timespec="seconds"),
                "device": device, "config": config, "results": results, "total_time_s": time.perf_counter() - started}

    for model_name in settings.models:
        for k in settings.cohorts:
            log(f"{model_name} K={k}")
            results.append({})

            def progress(partial: dict) -> None:
                results[-1] = partial
                write_json(out, report(False))

            results[-1] = run_cell(model_name, k, settings, test_data, progress)
            print(table(results[-1]) + "\n", flush=True)
            write_json(out, report(False))
    final = report(True)
    write_json(out, final)
    plot(final, os.path.splitext(out)[0] + ".png")
    return final, out


def main(args: argparse.Namespace) -> int:
    """``fedpartial bench``: exit status 1 when a path disagrees with its reference."""
    settings = settings_from_args(args)
    check_out(args.out)
    report, out = run(settings, args.out, args.preset)
    print(f"wrote {out} and {os.path.splitext(out)[0]}.png")
    status = 0
    for record in report["results"]:
        for e in record["runners"]:
            if e.get("correct") is False:
                log(f"CORRECTNESS FAILURE: {record['model']} K={record['cohort_size']} {e['method']} "
                    f"{e['strategy']} differs from its reference by {e['max_abs_diff_vs_reference']:.3g}")
                status = 1
    return status
