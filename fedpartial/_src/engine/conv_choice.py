"""``--conv-impl auto``: the convolution lowering (and the cohort layout it runs best in), chosen by measurement.

Which lowering of :mod:`fedpartial._src.models.conv` is fastest depends on the chip, the model, the image size
and the cohort (on a 2-core CPU, im2col wins on 8x8 digits and lax's own convolution on 28x28 images), so
:func:`choose` times one local SGD step of the whole cohort for every candidate and keeps the fastest.  A
candidate is a lowering and a *layout*:

* ``loop`` — one client's step jitted and called for each client in turn (what ``stepwise:1`` runs);
* ``vmap`` — the step vmapped over the cohort in one jitted call (what the fused round runs).

``(lax, vmap)`` — grouped convolutions — is tried only off the CPU, where it is the fused round of today; on
XLA:CPU it measured 10-80x slower than the loop.  Each candidate is compiled, run once, then timed twice (the
best counts); a large cohort is timed on at most :data:`MAX_TIMED_CLIENTS` clients of the platform and scaled
(on a CPU both layouts' time grows linearly with the clients; a GPU's vmapped step gains from more).  The choice is
kept in ``conv-impl.json`` in the cache folder, keyed by backend, device, model, input shape, per-client batch,
cohort size, compute dtype and the JAX version, so it is measured once per setting.  The strategy chooser
(:func:`fedpartial._src.engine.strategy.default_strategy`) takes the layout: ``vmap`` runs the fused round.
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

__all__ = ["ConvChoice", "LAYOUTS", "MAX_TIMED_CLIENTS", "candidates", "choose"]

LAYOUTS = ("loop", "vmap")
#: a cohort larger than this is timed on this many clients and scaled, by platform
MAX_TIMED_CLIENTS = {"cpu": 8, "other": 256}
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


def candidates(platform: str) -> tuple[tuple[str, str], ...]:
    """The (lowering, layout) pairs ``auto`` times on ``platform``, the default first (ties keep it)."""
    pairs = [("lax", "loop"), ("im2col", "loop"), ("im2col", "vmap"), ("hybrid", "vmap")]
    if platform != "cpu":
        pairs.insert(1, ("lax", "vmap"))
    return tuple(pairs)


def _step(model: Model):
    def loss(params, stats, x, y):
        logits, stats = model.apply({"params": params, "batch_stats": stats}, x, True)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), stats

    def step(params, stats, x, y):
        (value, stats), grads = jax.value_and_grad(loss, has_aux=True)(params, stats, x, y)
        return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads), stats, value

    return step


def _best(fn: Callable, repeats: int = 2) -> float:
    jax.block_until_ready(fn())  # compile (or load from the persistent cache) and warm up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - start)
    return best


def time_candidate(model: Model, layout: str, batch_size: int, cohort_size: int) -> float:
    """Seconds for one local step of ``cohort_size`` clients of ``batch_size`` examples, laid out as ``layout``."""
    k = min(cohort_size, MAX_TIMED_CLIENTS["cpu" if jax.default_backend() == "cpu" else "other"])
    variables = model.init_variables(jax.random.key(0))
    params, stats = variables["params"], variables["batch_stats"]
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(k, batch_size, *model.input_shape)).astype(np.float32))
    y = jnp.asarray(rng.integers(0, model.num_classes, size=(k, batch_size)).astype(np.int32))
    step = _step(model)
    if layout == "loop":
        one = jax.jit(step)
        seconds = _best(lambda: [one(params, stats, x[i], y[i])[2] for i in range(k)])
    else:
        stack = lambda t: jax.tree.map(lambda a: jnp.broadcast_to(a, (k, *a.shape)), t)  # noqa: E731
        many = jax.jit(jax.vmap(step))
        ps, ss = stack(params), stack(stats)
        seconds = _best(lambda: many(ps, ss, x, y)[2])
    return seconds * cohort_size / k


def _key(model: Model, batch_size: int, cohort_size: int, dtype: str) -> str:
    device = jax.devices()[0]
    return "|".join(map(str, (jax.default_backend(), device.device_kind, model.name, tuple(model.input_shape),
                               batch_size, cohort_size, dtype, jax.__version__)))


def _read(path: str | None) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, TypeError, ValueError):
        return {}


def choose(build: Callable[[str], Model], *, batch_size: int, cohort_size: int, dtype: str = "float32",
           cache_dir: str | None = None) -> ConvChoice:
    """The fastest (lowering, layout) for the model ``build(impl)`` builds, measured once per setting.

    ``cache_dir``: where ``conv-impl.json`` keeps the choices (None: measure every time, keep nothing).
    """
    model = build("lax")
    if "conv" not in model.structure.kinds:
        return ConvChoice("lax", None, {}, "no convolutions")
    path = None if cache_dir is None else os.path.join(cache_dir, CACHE_FILE)
    key = _key(model, batch_size, cohort_size, dtype)
    known = _read(path).get(key)
    if known:
        return ConvChoice(known["impl"], known["layout"], known["seconds"], "cached")
    seconds = {}
    for impl, layout in candidates(jax.default_backend()):
        seconds[f"{impl}/{layout}"] = time_candidate(model if impl == "lax" else build(impl), layout, batch_size,
                                                     cohort_size)
    impl, layout = min(seconds, key=seconds.get).split("/")
    if path is not None:
        try:
            os.makedirs(cache_dir, exist_ok=True)
            table = _read(path)
            table[key] = {"impl": impl, "layout": layout, "seconds": seconds}
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(table, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except OSError:  # a read-only cache folder: the choice is still made, just not kept
            pass
    return ConvChoice(impl, layout, seconds, "measured")
