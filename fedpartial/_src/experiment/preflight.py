"""The preflight: whether a valid :class:`~fedpartial._src.experiment.config.RunConfig` fits this machine —
its host memory, its devices and its disk — asked after :meth:`RunConfig.validate` has judged every field and
before anything is loaded, drawn or built.

``validate`` looks at the settings alone, so a config file or a comparison checked on one machine means the
same on another; the preflight's answer depends on where the run starts.  Each refusal is one sentence
(:class:`~fedpartial._src.experiment.config.ConfigError`) naming the flag.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile

import jax

from fedpartial._src.core import memory
from fedpartial._src.core.types import Method
from fedpartial._src.experiment import plan as plan_lib
from fedpartial._src.experiment.config import ConfigError, RunConfig

#: the least host memory one client of the population takes (its device profile, ids, sample counts, data
#: index): a population that cannot fit even that is refused before anything is drawn
MIN_BYTES_PER_CLIENT = 64


def preflight(config: RunConfig) -> None:
    """Refuses, in one sentence, a run this machine cannot hold: a population or synthetic data beyond its host
    memory, more ``--devices`` than it has, an ``--out`` it cannot write, an asynchronous run's pool of in-flight
    updates beyond the device's memory.  ``config`` must be validated first."""
    ram = memory.host_available()
    need = (config.num_clients or 0) * MIN_BYTES_PER_CLIENT  # None: the files' users, counted when read
    if ram is not None and need > ram:
        raise ConfigError(f"--clients {config.num_clients} needs at least {memory.gib(need)} of host memory for the "
                          f"population's per-client records alone ({MIN_BYTES_PER_CLIENT} bytes a client), more "
                          f"than this machine has available.")
    if config.dataset == "synthetic" and ram is not None:  # the generator draws every client's data up front
        check_synthetic_fits(config, ram)
    if config.devices is not None:
        available = jax.local_device_count()
        if config.devices > available:
            raise ConfigError(f"--devices {config.devices} is not allowed: it must be between 1 and {available}, the "
                              f"number of local {jax.default_backend()} devices.")
    if config.out_dir is not None:
        check_writable_dir(config.out_dir, "--out", "a directory to write run folders in")
    if config.mode == "async":
        check_pool_fits(config)


def check_pool_fits(config: RunConfig) -> None:
    """An asynchronous run whose pool of in-flight updates alone (two copies of the model per client in flight)
    would fit neither on the device nor, on an accelerator, in host memory is refused before any data is loaded.  The model's size comes from the config:
    its registry entry on the dataset's known example shape, with two classes (a lower bound; a dataset of no
    fixed shape is left to the full estimate, which :class:`~fedpartial.AsyncSimulation` checks with the round
    beside the pool once the data is loaded)."""
    from fedpartial._src.engine.asynchronous import pool_bytes
    from fedpartial._src.experiment.setting_checks import DATASET_SHAPES, model_name
    from fedpartial._src.models import registry
    from fedpartial._src.models.adapter import from_linen

    shape = DATASET_SHAPES.get(config.dataset)
    if shape is None:
        return
    name = model_name(config)
    spec = registry.find_model(name)
    model = from_linen(spec.factory(2, shape), input_shape=shape, num_classes=2, sequential=spec.sequential,
                       name=name)
    need = pool_bytes(jax.eval_shape(model.init_variables, jax.random.key(0)), config.async_concurrency)
    available, where = memory.available_bytes()
    if available is not None and need > memory.HEADROOM * available:
        if where != "RAM":  # on an accelerator a pool that does not fit there is kept in host memory
            host, _ = memory.available_bytes(jax.devices("cpu")[0])
            if host is None or need <= memory.HEADROOM * host:
                return
        raise ConfigError(
            f"--concurrency {config.async_concurrency} keeps at least {memory.gib(need)} of in-flight updates (two "
            f"copies of the model for each client in flight), more than the {memory.gib(available)} available "
            f"({where}); lower --concurrency.")


def check_synthetic_fits(config: RunConfig, ram: int) -> None:
    """Synthetic data for ``num_clients`` clients that would not fit in ``ram`` bytes to generate is refused
    before anything is drawn, rather than growing until the kernel kills the process."""
    from fedpartial._src.data import synthetic

    cap = config.max_samples
    examples = synthetic.expected_examples(config.num_clients, min_samples=50 if cap is None else min(50, cap),
                                           max_samples=cap)
    need = examples * synthetic.GENERATION_BYTES_PER_EXAMPLE
    if need > memory.HEADROOM * ram:
        raise ConfigError(
            f"--dataset synthetic with --clients {config.num_clients} draws about {examples:,.0f} examples, which "
            f"need about {memory.gib(need)} of host memory to generate, but {memory.gib(ram)} is available; "
            f"use fewer --clients or cap each client with --max-samples.")


def check_writable_dir(path: str, flag: str, what: str) -> None:
    """``path`` is a directory that exists or can be made, and may be written: else one sentence naming ``flag``
    and ``what`` it must be.  Nothing is left behind (an empty probe folder is made in the nearest existing
    ancestor and removed at once)."""
    full = os.path.abspath(os.fspath(path))
    probe = full
    while not os.path.lexists(probe):  # the nearest existing ancestor decides whether the folder can be made
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        where = "is a file" if probe == full else f"cannot be made: {probe} is a file"
        raise ConfigError(f"{flag} {path!r} {where}; it must be {what}.")
    where = "is not writable" if probe == full else f"cannot be made: {probe} is not writable"
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path!r} {where}; choose a directory you may write to.")
    try:  # os.access says yes to root even where the kernel refuses (/proc, /sys): try an empty folder
        os.rmdir(tempfile.mkdtemp(prefix=".fedpartial-probe-", dir=probe))
    except OSError:
        raise ConfigError(f"{flag} {path!r} {where}; choose a directory you may write to.") from None


def for_simulation(config: RunConfig, method: Method | None = None, data_placement: str | None = None):
    """What a :class:`~fedpartial._src.experiment.simulation.Simulation` starts from, before any data is loaded:
    ``config`` (named after the caller's own ``method``, with no options), validated once and judged against this
    machine (:func:`preflight`), its :class:`~fedpartial._src.experiment.plan.RunPlan`, and the caller's
    ``data_placement`` checked.  Returns ``(config, plan)``."""
    if method is not None and (config.method, config.options) != (method.name, {}):
        config = dataclasses.replace(config, method=method.name, options={})
    plan = plan_lib.resolve(config, method)
    preflight(config)  # then whether this machine can hold it
    if data_placement not in (None, "host", "device"):
        raise ConfigError(f"data_placement {data_placement!r} is not allowed: choose host or device (or None for "
                          f"--data-placement {config.data_placement}).")
    return config, plan
