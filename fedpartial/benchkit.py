"""Measuring pieces shared by ``fedpartial bench`` (:mod:`fedpartial.bench`) and ``benchmarks/strategies.py``:
random cohort data, the plain per-client loop every strategy is compared with, timing, device facts, JSON.

Only jax, flax, optax, numpy and :func:`fedpartial.data.packing.pack_cohort`: ``benchmarks/compare_revisions.py``
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

from fedpartial.data.packing import CohortBatches, pack_cohort

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
    Flax module is shared with the engine)."""

    def __init__(self, module, optimizer: optax.GradientTransformation, input_shape):
        self.module = module
        self.optimizer = optimizer
        self.input_shape = tuple(input_shape)

        def loss_fn(params, x, y):
            logits = module.apply({"params": params}, x, train=True)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        def sgd_step(params, opt_state, x, y):
            loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        self.sgd_step = jax.jit(sgd_step)

    def init(self, key: jax.Array):
        return self.module.init(key, jnp.zeros((1, *self.input_shape), jnp.float32), train=False)["params"]

    def __call__(self, params, packed):
        """One round: every client trains from ``params``.

        Returns the ``n_k``-weighted mean of the client parameters and the mean step
        loss (every client runs the same number of steps, so this is the mean over
        clients of each client's mean loss, the engine's ``train_loss``).
        """
        num_clients, num_steps = packed.step_mask.shape
        client_params, losses = [], []
        for k in range(num_clients):
            p, opt_state = params, self.optimizer.init(params)
            for s in range(num_steps):
                p, opt_state, loss = self.sgd_step(p, opt_state, packed.x[k, s], packed.y[k, s])
                losses.append(loss)
            client_params.append(p)
        weights = jnp.asarray(packed.num_samples / packed.num_samples.sum(), jnp.float32)
        new = jax.tree.map(lambda *leaves: jnp.tensordot(weights, jnp.stack(leaves), axes=1), *client_params)
        return new, jnp.mean(jnp.stack(losses))


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
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2)


def int_list(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v)


def name_list(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())
