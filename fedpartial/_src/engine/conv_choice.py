"""``--conv-impl auto``: the convolution lowering (and the cohort layout it runs best in), chosen by measurement.

Which lowering of :mod:`fedpartial._src.models.conv` is fastest depends on the chip, the model, the image size
and the cohort (on a 2-core CPU, im2col wins on 8x8 digits and lax's own convolution on 28x28 images), so
:func:`choose` times one local SGD step of the whole cohort for every candidate and keeps the fastest.  A
candidate is a lowering and a *layout*:

* ``loop`` — one client's step jitted and called for each client in turn (what ``stepwise:1`` runs);
* ``vmap`` — the step vmapped over the cohort in one jitted call (what the fused round runs);
* ``map`` — a ``lax.map`` of one client's step over the cohort in one jitted call (what ``fused:1`` runs: the
  whole round one program, the clients a loop inside it).

A model without convolutions is timed too on a CPU, in lax's three layouts (:data:`DENSE_CPU_CANDIDATES`): the MLP's
fused round ran 1.63x the plain loop at K = 10 where one client at a time ran 1.13x
(``benchmarks/results/conv-lowering-cpu-cpu-20261203.json``), and which wins depends on the cohort.

``(lax, vmap)`` — grouped convolutions — is tried only off the CPU, where it is what the fused round runs by default; on
XLA:CPU it measured 10-80x slower than the loop.  ``map`` is tried with ``mapped`` (inside a loop XLA:CPU
runs autodiff's convolution gradients 15-40x slower, which ``mapped`` avoids) and ``im2col`` (matrix products
only).  Each candidate is compiled (XLA:CPU already compiles on every core: compiling them in parallel
gained nothing), then run twice, the first run timed too (the best counts), and the first candidate is kept
unless another is faster by over :data:`MARGIN`.  The variables are drawn on the host in the model's shapes
(initialising for real compiles the initialisers).  A large cohort is timed on at most
:data:`MAX_TIMED_CLIENTS` clients of the platform and scaled (on a CPU every layout's time grows about
linearly with the clients; a GPU's vmapped step gains from more).  The choice is
kept in ``conv-impl.json`` in the cache folder, keyed by backend, device, model, input shape, per-client batch,
cohort size, compute dtype and the JAX version, so it is measured once per setting.  The strategy chooser
(:func:`fedpartial._src.engine.strategy.default_strategy`) takes the layout: ``vmap`` runs the fused round,
``map`` the fused round one client at a time (``fused:1``), ``loop`` ``stepwise:1``.
"""

from __future__ import annotations

import json
import os
import time
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedpartial._src.models.adapter import Model

__all__ = ["ConvChoice", "LAYOUTS", "MAX_TIMED_CLIENTS", "REVERSE_ONLY", "SPLIT_CANDIDATES", "candidates", "choose",
           "time_split"]

LAYOUTS = ("loop", "vmap", "map")
#: a cohort larger than this is timed on this many clients and scaled, by platform
MAX_TIMED_CLIENTS = {"cpu": 4, "other": 256}
CACHE_FILE = "conv-impl.json"


class ConvChoice(NamedTuple):
    """What ``auto`` chose: the lowering, the layout, every candidate's seconds per cohort step, and how."""

    impl: str
    layout: str | None  # None: not measured (nothing to choose), the strategy chooser decides as usual
    seconds: dict  # "impl/layout" -> seconds for one step of the whole cohort
    how: str  # "measured", "cached" or why nothing was measured

    def describe(self) -> str:
        if not self.seconds:
            return f"{self.impl} ({self.how})"
        best = self.seconds[f"{self.impl}/{self.layout}"]
        return f"{self.impl}, {self.layout} ({self.how}: {best * 1e3:.1f} ms a cohort step)"


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
    def loss(params, stats, x, y):
        logits, stats = model.apply({"params": params, "batch_stats": stats}, x, True)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), stats

    def step(params, stats, x, y):
        (value, stats), grads = jax.value_and_grad(loss, has_aux=True)(params, stats, x, y)
        return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads), stats, value

    return step


def _best(fn: Callable, repeats: int = 1, beaten_by: float = float("inf")) -> float:
    """The fastest of a warm-up and ``repeats`` timed runs of ``fn``; one run only when even the warm-up took
    over twice ``beaten_by`` (the best candidate so far), which it cannot then beat."""
    start = time.perf_counter()
    jax.block_until_ready(fn())  # warm up (compiled already)
    best = time.perf_counter() - start
    for _ in range(repeats if best <= 2 * beaten_by else 0):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - start)
    return best


def _stand_in_variables(model: Model) -> dict:
    """Variables of the model's shapes, drawn on the host: a step's time does not depend on their values, and
    initialising for real compiles the initialisers (2.5 s for VGG-9 on 2 cores)."""
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda s: jnp.asarray((0.05 * rng.standard_normal(s.shape)).astype(s.dtype)),
                        jax.eval_shape(model.init_variables, jax.random.key(0)))


def timeable(model: Model) -> bool:
    """Whether the stand-in step can time ``model``: real-valued inputs and one label per example (a token
    model's inputs index its embedding, and a language model is labelled per position)."""
    variables = jax.eval_shape(model.init_variables, jax.random.key(0))
    x = jax.ShapeDtypeStruct((1, *model.input_shape), jnp.float32)
    try:
        logits = jax.eval_shape(lambda v, x: model.apply(v, x, False)[0], variables, x)
    except (TypeError, ValueError, IndexError):  # e.g. an embedding that takes integer tokens only
        return False
    return logits.ndim == 2 and model.lora is None


def _timed_clients(cohort_size: int) -> int:
    return min(cohort_size, MAX_TIMED_CLIENTS["cpu" if jax.default_backend() == "cpu" else "other"])


def prepare(model: Model, layout: str, batch_size: int, cohort_size: int,
            variables: dict | None = None, device: jax.Device | None = None,
            home: jax.Device | None = None) -> Callable[[], object]:
    """A compiled ``fn()`` running one local step of the timed clients laid out as ``layout`` (see
    :func:`time_candidate`), compiled ahead (compiling is the slow part).  ``variables``: the model's (every
    lowering has the same), None to draw stand-ins here.  ``device``: where it runs (None: the default
    device); ``fn()`` only dispatches, so the programs of several devices run at once.  ``home``: for ``loop``
    on another device, where each client's state and data are kept and moved from and back around its step."""
    k = _timed_clients(cohort_size)
    if variables is None:
        variables = _stand_in_variables(model)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(k, batch_size, *model.input_shape)).astype(np.float32)
    y = rng.integers(0, model.num_classes, size=(k, batch_size)).astype(np.int32)
    variables, x, y = jax.device_put((variables, x, y), device)
    params, stats = variables["params"], variables["batch_stats"]
    step = _step(model)
    if layout == "loop":
        one = jax.jit(step).lower(params, stats, x[0], y[0]).compile()
        xs, ys = list(x), list(y)
        if home is not None and home != device:
            kept = jax.device_put((params, stats, xs, ys), home)

            def moved(i):  # as stepwise:1 over devices moves a client to its device and back, once a round
                out = one(*jax.device_put((kept[0], kept[1], kept[2][i], kept[3][i]), device))
                return jax.device_put(out[:2], home)
            return lambda: [moved(i) for i in range(k)]
        return lambda: [one(params, stats, xs[i], ys[i])[2] for i in range(k)]
    stack = lambda t: jax.tree.map(lambda a: jnp.broadcast_to(a, (k, *a.shape)), t)  # noqa: E731
    ps, ss = stack(params), stack(stats)
    # ``map`` as the fused round's chunks of one run it: a loop of one-client vmaps
    many = jax.vmap(step) if layout == "vmap" else lambda *a: jax.lax.map(lambda c: step(*c), a, batch_size=1)
    compiled = jax.jit(many).lower(ps, ss, x, y).compile()
    return lambda: compiled(ps, ss, x, y)[2]


def time_candidate(model: Model, layout: str, batch_size: int, cohort_size: int, repeats: int = 1) -> float:
    """Seconds for one local step of ``cohort_size`` clients of ``batch_size`` examples, laid out as ``layout``:
    ``loop`` (a jitted step called per client), ``vmap`` (the step vmapped) or ``map`` (a ``lax.map`` of
    steps over the clients in one jitted call)."""
    return _best(prepare(model, layout, batch_size, cohort_size), repeats) * cohort_size / _timed_clients(cohort_size)


#: the (lowering, layout) pairs timed with the cohort split over several devices: one client's step at a time on
#: each (as ``stepwise:1`` over devices) or a loop inside one program per device (as ``fused:1`` over devices; for
#: convolutions ``mapped``, whose gradients stay fast inside a loop, or ``im2col``); a method that differentiates
#: twice leaves out :data:`REVERSE_ONLY`
SPLIT_CANDIDATES = {"conv": (("lax", "loop"), ("mapped", "map"), ("im2col", "map")),
                    "dense": (("lax", "loop"), ("lax", "map"))}


#: timed runs of each candidate of a split (and of the one-device choice it is held against), after a warm-up:
#: the same step measured 50 and 77 ms a cohort step in two runs an hour apart on a loaded 2-core machine
SPLIT_REPEATS = 4


def time_split(build: Callable[[str], Model], pairs, devices, *, batch_size: int, cohort_size: int) -> dict:
    """Seconds for one local step of ``cohort_size`` clients split over ``devices`` (each device its
    ``ceil(K / D)`` clients, as the rounds split them), per (lowering, layout) of ``pairs``: every device's
    work is dispatched in turn, then all are awaited.  A large share is timed on a few clients and scaled.

    The candidates take turns, a run of each per pass (a warm-up, then :data:`SPLIT_REPEATS` passes; the fastest
    run counts): a shared machine's speed drifts over seconds, and timed one after another a candidate that
    happened to run in a slow spell lost (measured: ``mapped/map`` 382 ms a cohort step against ``im2col/map``'s
    244 ms, whose rounds were 1.2x slower).

    ``loop`` moves each client's state and data from the first device and back around its step, which the
    round does once per client, not once per step: a step timed alone left out that work around it, which made
    ``stepwise:1`` over 2 cores look 15 % faster than ``fused:1`` over them for the MLP at K = 50 where its
    rounds were 1.3x slower; counted once per step it weighs as much as that work for steps as short as the
    MLP's and little for a convolutional model's."""
    share = -(-cohort_size // len(devices))
    models = {impl: build(impl) for impl in dict(pairs)}
    variables = _stand_in_variables(models[pairs[0][0]])
    ready = {f"{impl}/{layout}": [prepare(models[impl], layout, batch_size, share, variables, device=d,
                                          home=devices[0]) for d in devices]
             for impl, layout in pairs}
    best = dict.fromkeys(ready, float("inf"))
    for _ in range(1 + SPLIT_REPEATS):
        for name, fns in ready.items():
            start = time.perf_counter()
            jax.block_until_ready([fn() for fn in fns])
            best[name] = min(best[name], time.perf_counter() - start)
    return {name: seconds * share / _timed_clients(share) for name, seconds in best.items()}


#: the first candidate (the platform's default) is kept unless another is faster by more than this share:
#: a step timed on a few clients only approximates a round, and a near-tie is noise (measured: a 0.6 % lead of
#: ``mapped/map`` over ``lax/loop`` on 28x28 images came out 0.72x the loop in whole rounds)
MARGIN = 0.1


def _pick(seconds: dict) -> tuple[str, str]:
    first, fastest = next(iter(seconds)), min(seconds, key=seconds.get)
    keep = seconds[fastest] > (1 - MARGIN) * seconds[first]
    return tuple((first if keep else fastest).split("/"))


def cache_key(model: Model, batch_size: int, cohort_size: int, dtype: str, second_order: bool = False) -> str:
    device = jax.devices()[0]
    return "|".join(map(str, (jax.default_backend(), device.device_kind, model.name, tuple(model.input_shape),
                               batch_size, cohort_size, dtype, jax.__version__)
                         + (("second-order",) if second_order else ())))


def read_table(path: str | None) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, TypeError, ValueError):
        return {}


def choose(build: Callable[[str], Model], *, batch_size: int, cohort_size: int, dtype: str = "float32",
           cache_dir: str | None = None, second_order: bool = False, time_dense: bool = True) -> ConvChoice:
    """The fastest (lowering, layout) for the model ``build(impl)`` builds, measured once per setting.

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
    key = cache_key(model, batch_size, cohort_size, dtype, second_order)
    known = read_table(path).get(key)
    if known:
        return ConvChoice(known["impl"], known["layout"], known["seconds"], "cached")
    models = {impl: model if impl == "lax" else build(impl) for impl in dict(pairs)}
    variables = _stand_in_variables(model)
    ready = [prepare(models[impl], layout, batch_size, cohort_size, variables) for impl, layout in pairs]
    scale = cohort_size / _timed_clients(cohort_size)
    seconds = {}
    for (impl, layout), fn in zip(pairs, ready):
        seconds[f"{impl}/{layout}"] = _best(fn, beaten_by=min(seconds.values(), default=float("inf"))) * scale
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
