"""A run's peak memory, estimated from shapes before anything is built, and the check that refuses it.

The estimate adds, in bytes (every shape from ``jax.eval_shape``: nothing is allocated):

* ``server``: the global model, the server optimizer state, the method's
  per-client state (``[N, ...]`` rows, e.g. FedSPU's N personal models) and
  ``RUNTIME_BYTES`` for compilation and the runtime's buffers (measured);
* ``clients``: per client *in flight* (the cohort K, or the chunk C of the streamed
  strategy) its start model (a LoRA model's frozen base is held once, with the server's model), trained model,
  gradient, client optimizer state, the
  aggregation's masked copy and expanded upload mask, and its activations
  (``ACTIVATION_FACTOR`` × batch × (input + every layer's units) float32 — exact for
  dense layers, low for convolutions, whose spatial maps the layer structure does
  not tell);
* ``data``: the packed local data ``[F, S, B, ...]`` of the clients in flight (the
  packed host copy and the device's copy).

On a CPU all three share the host RAM; on an accelerator ``data``'s host copy is
RAM and the rest device memory, each compared with its own budget.  The estimate
was checked against measured peak RSS (README, "Bounded memory").
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import NamedTuple

import jax
import numpy as np

from fedpartial._src.core.structure import FROZEN

#: activations kept per example and unit: forward values, their gradients and XLA's temporaries
ACTIVATION_FACTOR = 4
#: compilation and runtime buffers beyond the arrays counted (peak RSS minus the estimate, measured on CPU)
RUNTIME_BYTES = 256 * 2**20
#: share of the available memory a run may plan to use
HEADROOM = 0.9


class MemoryEstimate(NamedTuple):
    """Estimated peak bytes of a run, by part; ``in_flight`` clients are trained at once."""

    server: int
    clients: int
    data: int
    in_flight: int
    per_client: int  # clients + data bytes of one client in flight
    state: int = 0  # the server state held between rounds (part of ``server``): model, optimizer and method state

    @property
    def total(self) -> int:
        return self.server + self.clients + self.data


def tree_bytes(tree) -> int:
    """Bytes of every leaf of a tree of arrays or shapes."""
    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


def estimate(fr, *, num_steps: int, batch_size: int, example_shape: tuple[int, ...], x_itemsize: int = 4,
             in_flight: int | None = None) -> MemoryEstimate:
    """The peak-memory estimate of a round of ``fr`` (a :class:`~fedpartial._src.engine.round.FederatedRound`).

    ``in_flight``: clients trained at once (default: the strategy's — the chunk of the
    streamed strategy, else the whole cohort).
    """
    if in_flight is None:
        in_flight = fr.strategy.chunk_size if fr.strategy.kind == "stream" else fr.ctx.cohort_size
    return estimate_shapes(jax.eval_shape(fr.pure_init, jax.random.key(0)), fr.ctx, fr.client_optimizer,
                           client_state=getattr(fr, "client_state", "device"), num_steps=num_steps,
                           batch_size=batch_size, example_shape=example_shape, x_itemsize=x_itemsize,
                           in_flight=in_flight)


def estimate_shapes(shapes, ctx, client_optimizer, *, client_state: str, num_steps: int, batch_size: int,
                    example_shape: tuple[int, ...], x_itemsize: int = 4, in_flight: int) -> MemoryEstimate:
    """:func:`estimate` before a round is built: from the shapes of its initial server state (``jax.eval_shape``
    of :func:`~fedpartial._src.engine.round.initial_state`), its ``ctx`` (:class:`~fedpartial.MethodContext`),
    client optimizer, where its per-client state lives (``client_state``) and the clients trained at once."""
    in_flight = min(in_flight, ctx.cohort_size)
    model = tree_bytes(shapes.variables)
    # the frozen base is held once (with the server's model), never per client
    client_model = model - tree_bytes(shapes.variables.get(FROZEN, {}))
    params = tree_bytes(shapes.variables["params"])
    client_opt = tree_bytes(jax.eval_shape(client_optimizer.direction.init, shapes.variables["params"]))
    state = tree_bytes(shapes)  # model, optimizer and method state, round counter
    cohort_rows = 0
    if client_state == "host":  # only the cohort's rows reach the device, for the round
        clients = tree_bytes(shapes.method_state.clients)
        state, cohort_rows = state - clients, clients * ctx.cohort_size // ctx.num_clients
    server = model + state + cohort_rows + RUNTIME_BYTES
    # start + trained model, gradient, optimizer state, masked copy (float) and upload mask (bool) for aggregation
    per_client_model = 3 * client_model + params + client_opt + client_model // 4
    units = sum(ctx.structure.units) + math.prod(example_shape)
    activations = ACTIVATION_FACTOR * batch_size * units * 4
    example = math.prod(example_shape) * x_itemsize + 4 + 1  # x, label, example mask
    per_client_data = 2 * (num_steps * batch_size * example + num_steps)  # host pack + device copy
    per_client = per_client_model + activations + per_client_data
    return MemoryEstimate(server=server, clients=in_flight * (per_client_model + activations),
                          data=in_flight * per_client_data, in_flight=in_flight, per_client=per_client, state=state)


def host_available() -> int | None:
    """The host's ``MemAvailable`` (Linux), else its free physical pages; None when neither is known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def available_bytes(device=None) -> tuple[int | None, str]:
    """Bytes a run may still use and where: an accelerator's free memory
    (``memory_stats()['bytes_limit'] - bytes_in_use``), else the host's available RAM."""
    device = device or jax.devices()[0]
    if device.platform != "cpu":
        try:
            stats = device.memory_stats() or {}
        except Exception:  # noqa: BLE001 - some backends do not implement it
            stats = {}
        if stats.get("bytes_limit"):
            return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)), f"{device.device_kind} memory"
    return host_available(), "RAM"


def gib(n: float) -> str:
    """Bytes for people: GiB with one decimal, or whole MiB below 1 GiB."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def fits(est: MemoryEstimate, available: int) -> bool:
    """Whether the estimate is within ``HEADROOM`` of ``available`` bytes."""
    return est.total <= HEADROOM * available


def clients_that_fit(est: MemoryEstimate, available: int) -> int:
    """How many clients may be in flight at once within ``HEADROOM`` of ``available`` (0: not even one)."""
    return max(0, int((HEADROOM * available - est.server) // max(est.per_client, 1)))


def refusal(est: MemoryEstimate, available: int, where: str, *, strategy: str, cohort_size: int,
            stream: Callable[[int], object] | None, movable_bytes: int = 0, move: str | None = None) -> str | None:
    """One sentence when ``est`` exceeds ``HEADROOM`` of ``available``: the estimate, what is available
    and the option that fixes it; None when it fits.  ``stream(n)``: the streamed strategy to name for at
    most ``n`` clients in flight (None: the run cannot stream).  ``movable_bytes`` of the estimate
    (per-client state) could leave this memory with the option ``move`` (e.g. ``--client-state disk``)."""
    if fits(est, available):
        return None
    fit = clients_that_fit(est, available)
    head = (f"the run needs about {gib(est.total)} ({strategy} strategy, {est.in_flight} clients in flight) "
            f"but {gib(available)} of {where} is available")
    if move and movable_bytes and est.total - movable_bytes <= HEADROOM * available:
        return f"{head}, {gib(movable_bytes)} of it the clients' own state; use {move}."
    if fit >= 1 and stream is not None:
        return f"{head}; use --strategy {stream(round_down(min(fit, cohort_size)))}."
    if fit >= 1:
        return f"{head}; use a --cohort of at most {round_down(min(fit, cohort_size))}."
    return (f"{head}, even for one client at a time; use fewer --clients (per-client state), "
            "a smaller --batch-size or fewer --local-steps.")


def data_stays_on_host(whose: str, data_bytes: int, who: str, need: int, left: int, where: str) -> str:
    """Why ``--data-placement auto`` keeps ``whose`` data on the host, for people: with its ``data_bytes`` on the
    device, ``who`` would need ``need`` bytes where ``left`` would be left."""
    return (f"auto keeps the data on the host: with {whose} {gib(data_bytes)} on the device, {who} would need "
            f"about {gib(need)} but {gib(left)} of {where} would be left")


def for_replicas(est: MemoryEstimate, count: int, at_once: int) -> MemoryEstimate:
    """The estimate of one jitted round over ``count`` replicas (:mod:`fedpartial._src.experiment.replicas`) from one replica's
    ``est``: every replica's server state and packed cohort (the round's stacked input), each replica's own
    copy of its state (its ``Simulation``'s, for evaluation and checkpoints), the clients of ``at_once``
    replicas in flight together, the rows of their states taken out of the stacked state when they are a
    part of it (``map``), and the runtime's buffers once.  Checked against peak RSS with FedSPU's 5,000
    personal models, 4 replicas (README, "Many seeds in one run")."""
    rows = at_once * est.state if at_once < count else 0
    return est._replace(server=count * (est.server - RUNTIME_BYTES + est.state) + rows + RUNTIME_BYTES,
                        clients=at_once * est.clients, data=count * est.data, in_flight=at_once * est.in_flight)


def round_down(n: int) -> int:
    """``n`` rounded down to 2 significant digits (a number people type)."""
    if n < 100:
        return max(n, 1)
    scale = 10 ** (len(str(n)) - 2)
    return n // scale * scale
