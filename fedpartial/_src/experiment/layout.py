"""Where a run's pieces live, decided before any array is built: the devices the cohort is split over, the
training data (host or device), the method's per-client state (device, host or disk), the round's
peak-memory estimate, a streamed strategy for a cohort that does not fit at once, and the refusal of a run
that cannot fit at all (:mod:`fedpartial._src.core.memory`).

:func:`decide` makes these decisions from estimates, before :class:`~fedpartial._src.experiment.simulation.Simulation`
builds its round (once, in the layout decided); ``room`` arguments give the free memory less the data that is to
go on the device (called only when a decision needs it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import numpy as np

from fedpartial._src.core import memory
from fedpartial._src.core.types import Method
from fedpartial._src.data import ondevice
from fedpartial._src.engine import round as engine
from fedpartial._src.engine import sharding
from fedpartial._src.engine import strategy as engine_strategy
from fedpartial._src.engine import types as engine_types
from fedpartial._src.engine.client import as_client_optimizer
from fedpartial._src.experiment import client_state as client_state_lib
from fedpartial._src.experiment.config import ConfigError, RunConfig
from fedpartial._src.models.adapter import Model

Room = Callable[[], "tuple[int | None, str]"]


def client_mesh(num_devices: int):
    """The client mesh: this process's first ``num_devices`` devices, or every process's devices when the run
    spans several processes (``jax.distributed``); None for one device."""
    if jax.process_count() > 1:
        return sharding.client_mesh(None)
    return sharding.client_mesh(num_devices) if num_devices > 1 else None


def run_mesh(config: RunConfig, num_devices: int):
    """:func:`client_mesh` for a run: ``--devices`` is refused in a run over several processes, which splits the
    cohort over all their devices."""
    if jax.process_count() > 1 and config.devices is not None:
        raise ConfigError(f"--devices {config.devices} is not used by a run over {jax.process_count()} processes, "
                          f"which splits the cohort over all their {jax.device_count()} devices; leave it out.")
    return client_mesh(num_devices)


def placed(cohort: engine_types.Cohort, mesh, padded_size: int) -> engine_types.Cohort:
    """The cohort split over the devices of ``mesh`` (unchanged on one device).  With several processes each
    keeps only its own devices' rows and the global cohort is assembled from them (:func:`sharding.global_cohort`)."""
    if mesh is None:
        return cohort
    if jax.process_count() == 1:
        return sharding.shard_cohort(cohort, mesh)
    rows = sharding.process_rows(padded_size, mesh)
    mine = jax.tree.map(lambda a: np.asarray(a)[rows], cohort)
    return sharding.global_cohort(mine, mesh, padded_size)


def data_bytes(x: np.ndarray, clients: list[np.ndarray], holdout: tuple | None) -> int:
    """Bytes the data takes on the device (:func:`ondevice.population_bytes` plus the holdout)."""
    return ondevice.population_bytes(x, clients) + (0 if holdout is None else sum(int(a.nbytes) for a in holdout))


def data_placement(config: RunConfig, needed_bytes: int, decided: str | None = None) -> str:
    """``host`` or ``device``: ``config.data_placement`` resolved, or the caller's ``decided`` placement.

    ``auto`` is ``device`` on an accelerator when the placed data - every client's training examples,
    labels and index tables, plus the holdout: ``needed_bytes`` - takes at most
    :data:`ondevice.DEVICE_MEMORY_FRACTION` (a quarter) of its free memory (``bytes_limit`` less what is in
    use), else ``host``; on CPU it is ``host`` (:func:`ondevice.resolve_placement` says why).  A streamed
    cohort is packed a chunk at a time, so its data stays on the host.
    """
    if engine_strategy.parse_strategy(config.strategy).kind == "stream":
        return "host"
    return decided or ondevice.resolve_placement(config.data_placement, needed_bytes, ondevice.available_memory(),
                                                 jax.devices()[0].platform)


class RoundLayout(NamedTuple):
    """Where a run's round runs, decided before it is built (:func:`decide`)."""

    strategy: engine_strategy.Strategy
    client_state: str  # the method's per-client state: device, host or disk
    data_placement: str  # the training data: host or device
    memory: memory.MemoryEstimate  # the round's peak-memory estimate in this layout
    note: str | None  # why the layout is not what --strategy and --data-placement give by themselves
    mesh: object = None  # the client mesh the cohort is split over (None: one device)
    conv_choice: object = None  # how the model's convolutions are lowered (engine.conv_choice.ConvChoice)


def decide(config: RunConfig, method: Method, ctx, shapes, client_optimizer, *, strategy: engine_strategy.Strategy,
           mesh, data_placement: str, data_bytes: int, num_steps: int, x_dtype, check_memory: bool) -> RoundLayout:
    """The round's layout from estimates alone, before it is built: where the method's per-client state lives
    (:func:`client_state_place`), then with ``check_memory`` the data kept on the host (:func:`device_data_gives_way`)
    or the cohort streamed (:func:`bounded_strategy`) where the round would not fit beside them, then the refusal
    of a run that still does not fit (:func:`refuse_what_does_not_fit`).

    ``ctx``, ``shapes``: the round's :class:`~fedpartial.MethodContext` and the shapes of its initial server state
    (:func:`~fedpartial._src.engine.round.initial_state`); ``strategy``: what the config resolves to;
    ``data_placement``/``data_bytes``: where the data is to go and what it takes on the device (not copied yet).
    """
    placement = data_placement

    def room() -> tuple[int | None, str]:  # the free memory less the data that is to go on the device
        available, where = memory.available_bytes()
        if available is not None and placement == "device":
            available -= data_bytes
        return available, where

    client_shapes = shapes.method_state.clients
    client_state = client_state_place(config, method, client_shapes, mesh=mesh, room=room)
    client_optimizer = as_client_optimizer(client_optimizer)

    def estimate_for(strategy):
        in_flight = strategy.chunk_size if strategy.kind == "stream" else ctx.cohort_size
        est = memory.estimate_shapes(shapes, ctx, client_optimizer, in_flight=in_flight,
                                     client_state="device" if client_state == "device" else "host",
                                     num_steps=num_steps, batch_size=config.batch_size,
                                     example_shape=ctx.model.input_shape, x_itemsize=np.dtype(x_dtype).itemsize)
        return _with_host_store(est, client_state, client_shapes)

    est = estimate_for(strategy)
    if not check_memory:
        return RoundLayout(strategy, client_state, placement, est, None, mesh)
    kept_on_host = device_data_gives_way(config, placement, est, strategy, data_bytes, room=room)
    if kept_on_host:
        placement = "host"
    notes = [kept_on_host]
    bounded = bounded_strategy(config, method, strategy, est, model=ctx.model, mesh=mesh, room=room)
    if bounded is not None:  # 'auto' streams a cohort that does not fit at once
        strategy, streamed = bounded
        notes.append(streamed)
        est = estimate_for(strategy)
        placement = "host"  # a streamed cohort is packed on the host a chunk at a time
    refuse_what_does_not_fit(est, strategy, method, client_state=client_state, client_shapes=client_shapes,
                             cohort_size=config.sampled_size, model=ctx.model, room=room)
    return RoundLayout(strategy, client_state, placement, est, "; ".join(n for n in notes if n) or None, mesh)


def build_round(config: RunConfig, method: Method, model: Model, plain_model: Model | None, *, conv_choice, mesh,
                strategy: engine_strategy.Strategy, client_optimizer, server_optimizer, server_data, label_counts,
                data_placement: str, data_bytes: int, num_steps: int, x_dtype, check_memory: bool
                ) -> tuple[RoundLayout, engine.FederatedRound, engine.FederatedRound]:
    """Decides the round's layout from estimates (:func:`decide`, starting from the run plan's ``strategy``), then
    builds the round once in it.  Returns the
    layout, the round, and the round that counts local work's FLOPs: the same one, or, when the run's lowering or
    dtype is not the plain model's, the ``plain_model``'s (a device's simulated time does not depend on how the
    simulator lowers or rounds its arithmetic)."""
    step_devices = None
    if mesh is not None and strategy.kind == "stepwise":  # clients' steps side by side; the rest on one device
        step_devices, mesh = mesh, None
    num_devices = 1 if mesh is None else mesh.size
    # The cohort (⌈F·K⌉ with over-selection) split over devices is padded to a multiple of their number.
    padded_size = sharding.padded_size(config.sampled_size, num_devices)
    sizes = {"num_clients": config.num_clients, "cohort_size": padded_size, "bn_policy": config.bn_policy,
             "padding": padded_size - config.sampled_size, "rounds": config.rounds}
    known = {"server_data": server_data, "label_counts": label_counts}
    ctx = engine.method_context(model, client_optimizer=client_optimizer, **sizes)
    shapes = jax.eval_shape(lambda key: engine.initial_state(method, ctx, server_optimizer, key, **known),
                            jax.random.key(0))
    decided = decide(config, method, ctx, shapes, client_optimizer,
                     strategy=strategy, mesh=mesh,
                     data_placement=data_placement, data_bytes=data_bytes, num_steps=num_steps, x_dtype=x_dtype,
                     check_memory=check_memory)._replace(conv_choice=conv_choice)

    def build(model: Model) -> engine.FederatedRound:
        return engine.FederatedRound(
            model, method, client_optimizer=client_optimizer, server_optimizer=server_optimizer,
            strategy=decided.strategy, record_decisions=config.record_decisions,
            devices=mesh if step_devices is None or decided.strategy.kind != "stepwise" else step_devices,
            client_state="device" if decided.client_state == "device" else "host", **sizes, **known)

    built = build(model)
    return decided, built, built if plain_model is None else build(plain_model)


def client_state_place(config: RunConfig, method: Method, shapes, *, mesh, room: Room) -> str:
    """``config.client_state`` resolved to ``device``, ``host`` or ``disk`` for per-client state of ``shapes``
    (refusing a method that cannot keep its per-client state off the device); ``device`` when the method
    keeps none."""
    state_bytes = client_state_lib.tree_bytes(shapes)
    if config.client_state in client_state_lib.OFF_DEVICE and state_bytes and not method.capabilities.host_client_state:
        raise ConfigError(f"--client-state {config.client_state} is not allowed for --method {method.name}: "
                          "it reads every client's state in its hooks; use --client-state device or auto.")
    if state_bytes == 0:
        return "device"
    device_free, where = room()
    host_free = device_free if where == "RAM" else memory.available_bytes(jax.devices("cpu")[0])[0]
    # (split over several devices the state stays there: the host store feeds one device)
    return client_state_lib.resolve(config.client_state, state_bytes,
                                    can_leave_device=method.capabilities.host_client_state and mesh is None,
                                    device_free=device_free, host_free=host_free,
                                    platform=jax.devices()[0].platform)


def _with_host_store(est: memory.MemoryEstimate, client_state: str, client_shapes) -> memory.MemoryEstimate:
    if client_state == "host" and jax.devices()[0].platform == "cpu":  # the store shares the RAM
        est = est._replace(server=est.server + client_state_lib.tree_bytes(client_shapes))
    return est


def estimate(round: engine.FederatedRound, client_state: str, *, num_steps: int, batch_size: int,
             example_shape: tuple, x_dtype) -> memory.MemoryEstimate:
    """A built round's peak-memory estimate (:func:`memory.estimate`), the host store of per-client state
    included where it shares the RAM."""
    est = memory.estimate(round, num_steps=num_steps, batch_size=batch_size, example_shape=example_shape,
                          x_itemsize=np.dtype(x_dtype).itemsize)
    return _with_host_store(est, client_state, round.client_state_shapes() if client_state == "host" else ())


def device_data_gives_way(config: RunConfig, placement: str, est: memory.MemoryEstimate,
                          strategy: engine_strategy.Strategy, needed_bytes: int, *, room: Room) -> str | None:
    """When ``--data-placement auto`` chose the device (``placement``) and the estimate ``est`` of the round does
    not fit in what the data (``needed_bytes``) would leave, the data stays on the host instead (the round keeps
    its ``strategy``, where streaming would split the cohort into chunks and a refusal would stop the run):
    returns why, for people, else None."""
    if placement != "device" or config.data_placement != "auto":
        return None
    available, where = room()
    if available is None or memory.fits(est, available):
        return None
    return memory.data_stays_on_host("its", needed_bytes, str(strategy), est.total, available, where)


def streamed_strategy(clients_that_fit: int, model: Model) -> engine_strategy.Strategy:
    """The streamed strategy for this platform and ``model`` with at most ``clients_that_fit`` in flight."""
    return engine_strategy.bounded_strategy(clients_that_fit, jax.devices()[0].platform, model)


def bounded_strategy(config: RunConfig, method: Method, strategy: engine_strategy.Strategy,
                     est: memory.MemoryEstimate, *, model: Model, mesh, room: Room
                     ) -> tuple[engine_strategy.Strategy, str] | None:
    """For ``--strategy auto`` on one device, when the estimate ``est`` of a round running ``strategy`` exceeds
    the available memory and the method streams: the streamed strategy (:func:`engine_strategy.bounded_strategy`)
    with a chunk that fits, and why, for people; else None (a run that fits, a named strategy, or one
    :func:`refuse_what_does_not_fit` refuses)."""
    if config.strategy != "auto" or mesh is not None or config.data_placement == "device" \
            or engine_strategy.stream_refusal(method) is not None:
        return None
    available, where = room()
    if available is None or memory.fits(est, available):
        return None
    fit = memory.clients_that_fit(est, available)
    if fit < 1:
        return None
    why = (f"auto streams the cohort: {strategy} would need about {memory.gib(est.total)} "
           f"but {memory.gib(available)} of {where} is available")
    return streamed_strategy(memory.round_down(min(fit, config.cohort_size)), model), why


def refuse_what_does_not_fit(est: memory.MemoryEstimate, strategy: engine_strategy.Strategy, method: Method, *,
                             client_state: str, client_shapes, cohort_size: int, model: Model, room: Room) -> None:
    """Refuses the run in one sentence when its estimate exceeds the available memory (see
    :mod:`fedpartial._src.core.memory`); on an accelerator the packed data's host copy is checked against RAM."""
    available, where = room()
    if available is None:
        return
    if where != "RAM":  # the device holds all but the host copy of the data
        host, _ = memory.available_bytes(jax.devices("cpu")[0])
        if host is not None and est.data / 2 > memory.HEADROOM * host:
            raise ConfigError(f"the run's packed data needs about {memory.gib(est.data / 2)} but "
                              f"{memory.gib(host)} of RAM is available; use --strategy stream:"
                              f"{max(1, int(memory.HEADROOM * host // max(est.data / 2 / est.in_flight, 1)))}.")
    movable = 0
    if client_state == "device" and method.capabilities.host_client_state:
        movable = client_state_lib.tree_bytes(client_shapes)
    host, _ = memory.available_bytes(jax.devices("cpu")[0])
    move = "--client-state host" if where != "RAM" and host and movable <= memory.HEADROOM * host \
        else "--client-state disk"
    problem = memory.refusal(est, available, where, strategy=str(strategy), cohort_size=cohort_size,
                             stream=functools.partial(streamed_strategy, model=model)
                             if engine_strategy.stream_refusal(method) is None else None,
                             movable_bytes=movable, move=move)
    if problem:
        raise ConfigError(problem[0].upper() + problem[1:])
