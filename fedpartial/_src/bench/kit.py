"""Measuring pieces shared by ``fedpartial bench`` (:mod:`fedpartial._src.bench.suite`) and ``benchmarks/strategies.py``:
random cohort data, the plain per-client loop every strategy is compared with, timing, device facts, JSON.

Only jax, flax, optax, numpy and :func:`fedpartial._src.data.packing.pack_cohort`: ``benchmarks/compare_revisions.py``
copies this file with ``strategies.py`` into an older checkout, so it must run against older engines.
"""

from __future__ import annotations

import json
import os
import platform
import re
import sys
import time
from typing import Any, Callable

import flax
import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import optax

from fedpartial._src.bench.provenance import stamp
from fedpartial._src.data.packing import CohortBatches, pack_cohort

NUM_CLASSES = 10


def client_optimizer(lr: float, momentum: float) -> optax.GradientTransformation:
    return optax.sgd(lr, momentum=momentum)


def make_data(k: int, *, batch_size: int, local_steps: int, input_shape, seed: int) -> CohortBatches:
    """Random-normal inputs and random labels for ``k`` clients of unequal size (all >= B).

    Every packed example slot is real, so the plain loop's unmasked mean cross-entropy
    is the engine's masked one.
    """
    rng = np.random.default_rng([seed, k])
    b, s = batch_size, local_steps
    sizes = rng.integers(b, 4 * b + 1, size=k)
    total = int(sizes.sum())
    x = rng.normal(size=(total, *input_shape)).astype(np.float32)
    y = rng.integers(0, NUM_CLASSES, size=total).astype(np.int32)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    clients = [np.arange(bounds[i], bounds[i + 1]) for i in range(k)]
    packed = pack_cohort(x, y, clients, batch_size=b, num_steps=s, local_steps=s, seed=rng)
    assert packed.example_mask.all() and packed.step_mask.all(), "benchmark data must have no padding"
    return packed


class PlainLoop:
    """FedAvg as a per-client Python loop over a jitted single-client SGD step (only the
    Flax module is shared with the engine).  BatchNorm statistics, if the model has them,
    are trained and averaged with the same weights (the engine's 'global' policy)."""

    def __init__(self, module, optimizer: optax.GradientTransformation, input_shape):
        self.module = module
        self.optimizer = optimizer
        self.input_shape = tuple(input_shape)

        def loss_fn(params, stats, x, y):
            if not stats:
                logits = module.apply({"params": params}, x, train=True)
            else:
                logits, updated = module.apply({"params": params, "batch_stats": stats}, x, train=True,
                                               mutable=["batch_stats"])
                stats = updated["batch_stats"]
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), stats

        def sgd_step(params, stats, opt_state, x, y):
            (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, stats, x, y)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), stats, opt_state, loss

        self.sgd_step = jax.jit(sgd_step)

    def init_variables(self, key: jax.Array) -> dict:
        return dict(self.module.init(key, jnp.zeros((1, *self.input_shape), jnp.float32), train=False))

    def init(self, key: jax.Array):
        return self.init_variables(key)["params"]

    def round(self, variables: dict, packed):
        """One round: every client trains from ``variables`` ({'params'[, 'batch_stats']}).

        Returns the ``n_k``-weighted mean of the client variables and the mean step
        loss (every client runs the same number of steps, so this is the mean over
        clients of each client's mean loss, the engine's ``train_loss``).
        """
        num_clients, num_steps = packed.step_mask.shape
        params, stats = variables["params"], variables.get("batch_stats", {})
        clients, losses = [], []
        for k in range(num_clients):
            p, s, opt_state = params, stats, self.optimizer.init(params)
            for step in range(num_steps):
                p, s, opt_state, loss = self.sgd_step(p, s, opt_state, packed.x[k, step], packed.y[k, step])
                losses.append(loss)
            clients.append({"params": p, "batch_stats": s} if stats else {"params": p})
        weights = jnp.asarray(packed.num_samples / packed.num_samples.sum(), jnp.float32)
        new = jax.tree.map(lambda *leaves: jnp.tensordot(weights, jnp.stack(leaves), axes=1), *clients)
        return new, jnp.mean(jnp.stack(losses))

    def __call__(self, params, packed):
        """:meth:`round` for a model without BatchNorm, on its parameters alone."""
        new, loss = self.round({"params": params}, packed)
        return new["params"], loss


def first_clients(packed: CohortBatches, m: int) -> CohortBatches:
    """The first ``m`` clients of a packed cohort."""
    return CohortBatches(*(a[:m] for a in packed))


def max_abs_diff(a, b) -> float:
    diffs = jax.tree.map(lambda u, v: float(jnp.max(jnp.abs(u - v))), a, b)
    return max(jax.tree.leaves(diffs))


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """``fn()`` waited for, and the seconds it took."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    return out, time.perf_counter() - start


def best_time(fn: Callable[[], Any], repeats: int) -> float:
    """The fastest of ``repeats`` timed calls of ``fn`` (after one untimed call that compiles)."""
    jax.block_until_ready(fn())
    return min(timed(fn)[1] for _ in range(repeats))


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def device_info() -> dict:
    dev = jax.devices()[0]
    return {
        "backend": jax.default_backend(),
        "platform": dev.platform,
        "device_kind": dev.device_kind,
        "num_devices": jax.device_count(),
        "jax_version": jax.__version__,
        "jaxlib_version": jaxlib.__version__,
        "flax_version": flax.__version__,
        "optax_version": optax.__version__,
        "numpy_version": np.__version__,
        "python_version": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
    }


def write_json(path: str, report: dict) -> None:
    """Writes a result file, stamped with its time and command (:func:`stamp`)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(stamp(report), f, indent=2)


def int_list(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v)


def name_list(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())
