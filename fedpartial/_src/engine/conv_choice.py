"""``--conv-impl auto``: the convolution lowering (and the cohort layout it runs best in), chosen by measurement.

Which lowering of :mod:`fedpartial._src.models.conv` is fastest depends on the chip, the model, the image size
and the cohort (on a 2-core CPU, im2col wins on 8x8 digits and lax's own convolution on 28x28 images), so
:func:`choose` times a round for every candidate and keeps the fastest.  A candidate is a lowering and a *layout*,
the strategy the round runs in (:data:`LAYOUT_STRATEGIES`):

* ``loop`` — ``stepwise:1``: one client's step jitted and called for each client in turn;
* ``vmap`` — ``fused``: the whole round one program, the cohort's training vmapped;
* ``map`` — ``fused:1``: the whole round one program, the clients a ``lax.map`` inside it.

A model without convolutions is timed too on a CPU, in lax's three layouts (:data:`DENSE_CPU_CANDIDATES`): which
wins depends on the cohort.  ``(lax, vmap)`` — grouped convolutions — is tried only off the CPU, where it is what
the fused round runs by default; on XLA:CPU it measured 10-80x slower than the loop.  ``map`` is tried with
``mapped`` (inside a loop XLA:CPU runs autodiff's convolution gradients 15-40x slower, which ``mapped`` avoids)
and ``im2col`` (matrix products only).

**What is timed is a round as the run has it**: FedAvg's round, built by the caller's ``round_for`` (the run's
client optimizer; the model in the candidate's lowering) in the candidate's strategy, for ``local_steps`` steps of
the run's batch size, on data and a server state drawn on the host in their shapes (initialising for real compiles
the initialisers: 2.5 s for VGG-9 on 2 cores).  One local step timed alone misjudged the rounds in both
directions, as a round does more around its steps and the layouts do it differently: on 2026-12-05 the MLP at
K = 50 timed 24 ms a cohort step vmapped and 42 ms mapped, whose rounds took 60 and 49 ms a step; the day before,
one device's vmapped step timed 58 ms against 86 ms for the split over the cores, whose rounds took 98 and 53 ms.
A round is compiled (XLA:CPU already compiles on every core: compiling candidates in parallel gained nothing),
run once, then timed (the fastest run counts), and the first candidate is kept unless another is faster by over
:data:`MARGIN`.

**Timed clients.**  A timed round trains every client of the cohort when their work is at most
:data:`TIMED_ROUND_FLOPS` (XLA's count of one client's step, from its lowered program: nothing compiled), else as
many as fit it (at least :data:`MIN_TIMED_CLIENTS`), and its time is scaled to the cohort: on a CPU a round's time
grows about linearly with its clients once they are a few, and a cohort whose round is cheap is timed whole (the
MLP's vmapped state outgrows the caches as the cohort grows).  The choice is kept in ``conv-impl.json`` in the
cache folder, keyed by backend, device, model, input shape, per-client batch, cohort size, local steps, the
client optimizer's settings, compute dtype and the JAX version, so it is measured once per setting.  The strategy
chooser (:func:`fedpartial._src.engine.strategy.default_strategy`) takes the layout.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedpartial._src.core.types import Batch, CohortInfo
from fedpartial._src.core.xla_costs import flops_of
from fedpartial._src.engine.strategy import Strategy, fused, stepwise
from fedpartial._src.engine.types import Cohort
from fedpartial._src.models.adapter import Model

__all__ = ["ConvChoice", "LAYOUTS", "LAYOUT_STRATEGIES", "MIN_TIMED_CLIENTS", "REVERSE_ONLY", "SPLIT_CANDIDATES",
           "TIMED_ROUND_FLOPS", "candidates", "choose", "prepare", "stand_in_cohort", "step_flops", "time_candidate",
           "time_split", "timed_clients"]

LAYOUTS = ("loop", "vmap", "map")
#: the strategy a round of each layout runs in
LAYOUT_STRATEGIES = {"loop": stepwise(1), "vmap": fused(None), "map": fused(1)}
#: the most work a timed round does, in XLA's count of floating-point operations, by platform (a fraction of a
#: second on a 2-core CPU)
TIMED_ROUND_FLOPS = {"cpu": 1e10, "other": 1e13}
#: the fewest clients a timed round trains (per device of a split), where the cohort has them
MIN_TIMED_CLIENTS = 2
CACHE_FILE = "conv-impl.json"

#: ``round_for(model, strategy, clients, devices)``: the round a layout is timed by (FedAvg's, with the run's
#: client optimizer) for ``clients`` clients, on one device (``devices`` None) or split over ``devices``
RoundFor = Callable[[Model, Strategy, int, "int | None"], Any]


class ConvChoice(NamedTuple):
    """What ``auto`` chose: the lowering, the layout, every candidate's seconds per round, and how."""

    impl: str
    layout: str | None  # None: not measured (nothing to choose), the strategy chooser decides as usual
    seconds: dict  # "impl/layout" -> seconds for one round of the whole cohort
    how: str  # "measured", "cached" or why nothing was measured

    def describe(self) -> str:
        if not self.seconds:
            return f"{self.impl} ({self.how})"
        best = self.seconds[f"{self.impl}/{self.layout}"]
        return f"{self.impl}, {self.layout} ({self.how}: {best:.3g} s a round)"


#: the lowerings whose gradient is a custom reverse-mode rule: no forward mode over it (second-order methods)
REVERSE_ONLY = ("hybrid", "mapped")


#: the layouts ``auto`` times for a model without convolutions on a CPU (one lowering: lax's matrix products)
DENSE_CPU_CANDIDATES = (("lax", "loop"), ("lax", "vmap"), ("lax", "map"))


def candidates(platform: str, second_order: bool = False, convolutions: bool = True
               ) -> tuple[tuple[str, str], ...]:
    """The (lowering, layout) pairs ``auto`` times on ``platform``, the default first (ties keep it);
    ``second_order``: for a method that differentiates twice, without :data:`REVERSE_ONLY`;
    ``convolutions``: False for a model of matrix products only, whose layouts are timed on a CPU alone (a GPU
    runs the vmapped cohort, see :func:`~fedpartial._src.engine.strategy.default_strategy`)."""
    if not convolutions:
        return DENSE_CPU_CANDIDATES if platform == "cpu" else ()
    pairs = [("lax", "loop"), ("hybrid", "vmap"), ("mapped", "map"), ("im2col", "map")]
    if platform != "cpu":
        pairs.insert(1, ("lax", "vmap"))
    return tuple(p for p in pairs if not (second_order and p[0] in REVERSE_ONLY))


def _step(model: Model):
    """One client's plain SGD step: what :func:`step_flops` counts."""
    def loss(params, stats, x, y):
        logits, stats = model.apply({"params": params, "batch_stats": stats}, x, True)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), stats

    def step(params, stats, x, y):
        (value, stats), grads = jax.value_and_grad(loss, has_aux=True)(params, stats, x, y)
        return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads), stats, value

    return step


def step_flops(model: Model, batch_size: int) -> float:
    """XLA's count of the floating-point operations of one client's local step of ``batch_size`` examples, from
    the lowered program (nothing compiled); 0 when XLA counts none."""
    shapes = jax.eval_shape(model.init_variables, jax.random.key(0))
    x = jax.ShapeDtypeStruct((batch_size, *model.input_shape), jnp.float32)
    y = jax.ShapeDtypeStruct((batch_size,), jnp.int32)
    return flops_of(jax.jit(_step(model)).lower(shapes["params"], shapes["batch_stats"], x, y).cost_analysis()) or 0.0


def timed_clients(model: Model, clients: int, local_steps: int, batch_size: int) -> int:
    """How many of ``clients`` a timed round trains: all when their local steps are at most
    :data:`TIMED_ROUND_FLOPS`, else as many as are, at least :data:`MIN_TIMED_CLIENTS` (where there are)."""
    budget = TIMED_ROUND_FLOPS["cpu" if jax.default_backend() == "cpu" else "other"]
    per_client = step_flops(model, batch_size) * local_steps
    fit = clients if per_client <= 0 else int(budget // per_client)
    return max(min(clients, MIN_TIMED_CLIENTS), min(clients, fit))


def _drawn(shapes: Any) -> Any:
    """Arrays of ``shapes`` (``jax.ShapeDtypeStruct``) drawn on the host: a round's time does not depend on the
    values (floats small and random, integers 0, keys of seed 0)."""
    rng = np.random.default_rng(0)

    def draw(s):
        if jax.dtypes.issubdtype(s.dtype, jax.dtypes.prng_key):
            return jax.random.split(jax.random.key(0), s.shape) if s.shape else jax.random.key(0)
        if jnp.issubdtype(s.dtype, jnp.floating):
            return (0.05 * rng.standard_normal(s.shape)).astype(s.dtype)
        return np.zeros(s.shape, s.dtype)

    return jax.tree.map(draw, shapes)


def stand_in_cohort(model: Model, clients: int, local_steps: int, batch_size: int) -> Cohort:
    """A cohort of ``clients`` clients with ``local_steps`` full steps of ``batch_size`` random examples each."""
    rng = np.random.default_rng(0)
    shape = (clients, local_steps, batch_size)
    x = rng.standard_normal((*shape, *model.input_shape)).astype(np.float32)
    y = rng.integers(0, model.num_classes, shape).astype(np.int32)
    info = CohortInfo(client_ids=np.arange(clients, dtype=np.int32), valid=np.ones((clients,), bool),
                      num_samples=np.full((clients,), local_steps * batch_size, np.float32))
    return Cohort(data=Batch(x, y, np.ones(shape, bool), np.ones(shape[:2], bool)), info=info)


def timeable(model: Model) -> bool:
    """Whether a round can be timed on stand-in data for ``model``: real-valued inputs and one label per example
    (a token model's inputs index its embedding, and a language model is labelled per position)."""
    variables = jax.eval_shape(model.init_variables, jax.random.key(0))
    x = jax.ShapeDtypeStruct((1, *model.input_shape), jnp.float32)
    try:
        logits = jax.eval_shape(lambda v, x: model.apply(v, x, False)[0], variables, x)
    except (TypeError, ValueError, IndexError):  # e.g. an embedding that takes integer tokens only
        return False
    return logits.ndim == 2 and model.lora is None


def prepare(rnd, local_steps: int, batch_size: int) -> Callable[[], Any]:
    """``run()``: one round of the built round ``rnd`` (its clients, ``local_steps`` steps of ``batch_size``) on
    stand-in data, the server state it returns fed to the next; run once here, compiling it, so that a timed
    call compiles nothing."""
    held = {"state": _drawn(jax.eval_shape(rnd.pure_init, jax.random.key(0)))}
    cohort = stand_in_cohort(rnd.model, rnd.ctx.cohort_size, local_steps, batch_size)
    key = jax.random.key(1)

    def run():
        held["state"], _ = rnd(held["state"], cohort, key)
        return held["state"]

    jax.block_until_ready(run())
    return run


def _best(fn: Callable, repeats: int, beaten_by: float = float("inf")) -> float:
    """The fastest of ``repeats`` timed runs of ``fn`` (compiled and run already); one run only when it took
    over twice ``beaten_by`` (the best candidate so far), which it cannot then beat."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - start)
        if best > 2 * beaten_by:
            break
    return best


#: timed rounds of each candidate ``choose`` measures (after the compiling run)
REPEATS = 2


def time_candidate(round_for: RoundFor, model: Model, layout: str, *, batch_size: int, cohort_size: int,
                   local_steps: int, repeats: int = REPEATS) -> float:
    """Seconds for one round of ``cohort_size`` clients training ``model`` for ``local_steps`` steps of
    ``batch_size`` examples, laid out as ``layout`` on one device (the fastest of ``repeats``)."""
    k = timed_clients(model, cohort_size, local_steps, batch_size)
    run = prepare(round_for(model, LAYOUT_STRATEGIES[layout], k, None), local_steps, batch_size)
    return _best(run, repeats) * cohort_size / k


#: the (lowering, layout) pairs timed with the cohort split over several devices: one client's step at a time on
#: each (``stepwise:1`` over devices) or a loop inside one program per device (``fused:1`` over devices; for
#: convolutions ``mapped``, whose gradients stay fast inside a loop, or ``im2col``); a method that differentiates
#: twice leaves out :data:`REVERSE_ONLY`
SPLIT_CANDIDATES = {"conv": (("lax", "loop"), ("mapped", "map"), ("im2col", "map")),
                    "dense": (("lax", "loop"), ("lax", "map"))}


#: timed rounds of each candidate of a split (and of the one-device choice it is held against), after the
#: compiling run: the same step measured 50 and 77 ms a cohort step in two runs an hour apart on a loaded 2-core
#: machine
SPLIT_REPEATS = 4


def time_split(build: Callable[[str], Model], round_for: RoundFor, pairs, devices: int, *, batch_size: int,
               cohort_size: int, local_steps: int) -> dict:
    """Seconds for one round of ``cohort_size`` clients split over ``devices`` devices (each its
    ``ceil(K / D)`` clients, as the rounds split them), per (lowering, layout) of ``pairs``, each round built by
    ``round_for`` over the devices.  A large share is timed on fewer clients per device and scaled.

    The candidates take turns, a round of each per pass (:data:`SPLIT_REPEATS` passes; the fastest counts): a
    shared machine's speed drifts over seconds, and timed one after another a candidate that happened to run in
    a slow spell lost (measured: ``mapped/map`` 382 ms a cohort step against ``im2col/map``'s 244 ms, whose
    rounds were 1.2x slower)."""
    share = math.ceil(cohort_size / devices)
    models = {impl: build(impl) for impl in dict(pairs)}
    k = timed_clients(models[pairs[0][0]], share, local_steps, batch_size)
    ready = {f"{impl}/{layout}": prepare(round_for(models[impl], LAYOUT_STRATEGIES[layout], k * devices, devices),
                                         local_steps, batch_size)
             for impl, layout in pairs}
    best = dict.fromkeys(ready, float("inf"))
    for _ in range(SPLIT_REPEATS):
        for name, run in ready.items():
            best[name] = min(best[name], _best(run, 1))
    return {name: seconds * share / k for name, seconds in best.items()}


#: the first candidate (the platform's default) is kept unless another is faster by more than this share:
#: a step timed on a few clients only approximates a round, and a near-tie is noise (measured: a 0.6 % lead of
#: ``mapped/map`` over ``lax/loop`` on 28x28 images came out 0.72x the loop in whole rounds)
MARGIN = 0.1


def _pick(seconds: dict) -> tuple[str, str]:
    first, fastest = next(iter(seconds)), min(seconds, key=seconds.get)
    keep = seconds[fastest] > (1 - MARGIN) * seconds[first]
    return tuple((first if keep else fastest).split("/"))


def cache_key(model: Model, batch_size: int, cohort_size: int, local_steps: int, dtype: str,
              second_order: bool = False, optimizer: str = "") -> str:
    """The setting a measurement is kept under (``optimizer``: the client optimizer's settings that change a
    round's work, e.g. its momentum)."""
    device = jax.devices()[0]
    return "|".join(map(str, ("round", jax.default_backend(), device.device_kind, model.name,
                               tuple(model.input_shape), batch_size, cohort_size, f"steps={local_steps}", optimizer,
                               dtype, jax.__version__) + (("second-order",) if second_order else ())))


def read_table(path: str | None) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, TypeError, ValueError):
        return {}


def choose(build: Callable[[str], Model], round_for: RoundFor, *, batch_size: int, cohort_size: int,
           local_steps: int, dtype: str = "float32", optimizer: str = "", cache_dir: str | None = None,
           second_order: bool = False, time_dense: bool = True) -> ConvChoice:
    """The fastest (lowering, layout) for the model ``build(impl)`` builds, each timed by a round ``round_for``
    builds (:data:`RoundFor`) of ``local_steps`` steps of ``batch_size`` per client, measured once per setting.

    ``optimizer``: the settings of the client optimizer ``round_for`` builds with, as the cache key keeps them.
    ``cache_dir``: where ``conv-impl.json`` keeps the choices (None: measure every time, keep nothing).
    ``second_order``: the method differentiates twice (:attr:`~fedpartial.Capabilities.second_order`), so
    :data:`REVERSE_ONLY` lowerings are not candidates.
    ``time_dense``: time the layouts of a model without convolutions too (on a CPU, :data:`DENSE_CPU_CANDIDATES`);
    False leaves its layout to the strategy's rule (a LoRA model: the cohort shares its frozen base).
    """
    model = build("lax")
    convolutions = "conv" in model.structure.kinds
    pairs = candidates(jax.default_backend(), second_order, convolutions)
    if not pairs or not (convolutions or (time_dense and timeable(model))):
        return ConvChoice("lax", None, {}, "no convolutions")
    path = None if cache_dir is None else os.path.join(cache_dir, CACHE_FILE)
    key = cache_key(model, batch_size, cohort_size, local_steps, dtype, second_order, optimizer)
    known = read_table(path).get(key)
    if known:
        return ConvChoice(known["impl"], known["layout"], known["seconds"], "cached")
    models = {impl: model if impl == "lax" else build(impl) for impl in dict(pairs)}
    k = timed_clients(model, cohort_size, local_steps, batch_size)
    seconds = {}
    for impl, layout in pairs:
        run = prepare(round_for(models[impl], LAYOUT_STRATEGIES[layout], k, None), local_steps, batch_size)
        beaten_by = min(seconds.values(), default=float("inf")) * k / cohort_size
        seconds[f"{impl}/{layout}"] = _best(run, REPEATS, beaten_by) * cohort_size / k
    impl, layout = _pick(seconds)
    if cache_dir is not None:
        write_entry(cache_dir, CACHE_FILE, key, {"impl": impl, "layout": layout, "seconds": seconds})
    return ConvChoice(impl, layout, seconds, "measured")


def write_entry(cache_dir: str, name: str, key: str, value) -> None:
    """Keeps ``value`` under ``key`` in the JSON table ``name`` of ``cache_dir`` (replaced whole, so a reader
    never sees half of it); a read-only folder keeps nothing."""
    path = os.path.join(cache_dir, name)
    try:
        os.makedirs(cache_dir, exist_ok=True)
        table = read_table(path)
        table[key] = value
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:  # a read-only cache folder: the choice is still made, just not kept
        pass
