"""What a replica run is made of: each replica's setting (seed, client and server learning rate), its run
folder's name and its validated configuration (:mod:`~fedpartial._src.experiment.replicas` runs them)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from fedpartial._src.experiment import client_state as client_state_lib
from fedpartial._src.experiment import replica_axis as replica_axis_lib
from fedpartial._src.experiment import setting_checks, summaries
from fedpartial._src.experiment.config import ConfigError, RunConfig
from fedpartial._src.experiment.config_checks import validate_once, with_validation
from fedpartial._src.experiment.preflight import preflight


def default_name(config: RunConfig, seeds: Sequence[int], lrs: Sequence[float] | None = None,
                 server_lrs: Sequence[float] | None = None) -> str:
    """``METHOD-DATASET-seeds0-3`` for consecutive seeds, else ``METHOD-DATASET-seeds1_5_9``; with learning
    rates ``-lrs0.01_0.1`` after it, with server rates ``-slrs0.5_1.0``."""
    ordered = sorted(seeds)
    consecutive = len(ordered) > 1 and ordered == list(range(ordered[0], ordered[-1] + 1))
    tag = f"{ordered[0]}-{ordered[-1]}" if consecutive else "_".join(map(str, seeds))
    rates = "" if lrs is None else "-lrs" + "_".join(map(repr, lrs))
    rates += "" if server_lrs is None else "-slrs" + "_".join(map(repr, server_lrs))
    return f"{config.method_name}-{config.dataset}-seeds{tag}{rates}"


def _rate(part: str) -> float | None:
    try:
        lr = float(part)
    except ValueError:
        return None
    return lr if np.isfinite(lr) and lr > 0 else None


def parse_lrs(text: str, flag: str = "--lrs") -> list[float]:
    """``"0.01,0.1"`` → ``[0.01, 0.1]``: distinct finite learning rates above 0, at least one."""
    return summaries.parse_distinct(text, flag, _rate,
                                  "learning rates above 0 separated by commas, e.g. 0.01,0.05,0.1", "a learning rate")


class Setting(NamedTuple):
    """One replica: its seed, client learning rate and server learning rate (None: the config's)."""

    seed: int
    lr: float | None
    server_lr: float | None = None


def replica_settings(seeds: Sequence[int], lrs: Sequence[float] | None,
                     server_lrs: Sequence[float] | None = None) -> list[Setting]:
    """Every replica's :class:`Setting`: each server rate with each client rate with every seed (server rate,
    then client rate, then seed), or the seeds alone (rates None: the config's)."""
    return [Setting(seed, lr, server_lr) for server_lr in (server_lrs if server_lrs is not None else [None])
            for lr in (lrs if lrs is not None else [None]) for seed in seeds]


def replica_run_name(config: RunConfig, setting: Setting) -> str | None:
    """``METHOD-DATASET-seedS`` with ``-lrX`` and ``-slrY`` for the rates given; None (the run's own default
    name) for a seed alone."""
    if setting.lr is None and setting.server_lr is None:
        return None
    return (f"{config.method_name}-{config.dataset}-seed{setting.seed}"
            + ("" if setting.lr is None else f"-lr{setting.lr!r}")
            + ("" if setting.server_lr is None else f"-slr{setting.server_lr!r}"))


def replica_configs(config: RunConfig, seeds: Sequence[int], out_dir: str | None,
                    lrs: Sequence[float] | None = None, server_lrs: Sequence[float] | None = None) -> list[RunConfig]:
    """One validated configuration per replica (:func:`replica_settings`): ``config`` with the seed, the
    learning rates, the fused strategy (:func:`~fedpartial._src.experiment.replica_axis.replica_strategy`;
    :class:`~fedpartial._src.experiment.replicas.Replicas` then follows
    :func:`~fedpartial._src.experiment.replica_axis.decided_layout`, the single run's layout) and ``out_dir``."""
    if len(seeds) < 1 or len(set(seeds)) < len(seeds):
        raise ConfigError(f"--seeds {','.join(map(str, seeds))} is not allowed: it must name distinct seeds.")
    for flag, rates in (("--lrs", lrs), ("--server-lrs", server_lrs)):
        if rates is not None and (len(rates) < 1 or len(set(rates)) < len(rates)):
            raise ConfigError(f"{flag} {','.join(map(str, rates))} is not allowed: it must name distinct learning "
                              "rates.")
    strategy = replica_axis_lib.replica_strategy(config.strategy)
    if config.devices is not None and config.devices > 1:
        raise ConfigError(f"--devices {config.devices} cannot run with {replica_axis_lib.REPLICAS_NAMED}: the replicas run on one "
                          "device; use --devices 1.")
    if config.client_state in client_state_lib.OFF_DEVICE:
        raise ConfigError(f"--client-state {config.client_state} cannot run with {replica_axis_lib.REPLICAS_NAMED}: the replicas "
                          "stack every seed's state on the device; use --client-state device.")
    configs = [dataclasses.replace(
        config, seed=r.seed, strategy=strategy, out_dir=out_dir, devices=1, client_state="device",
        client_lr=config.client_lr if r.lr is None else r.lr,
        server_lr=config.server_lr if r.server_lr is None else r.server_lr,
        run_name=replica_run_name(config, r))
        for r in replica_settings(seeds, lrs, server_lrs)]
    # The settings the replicas share are the given configuration's, judged once (the command line has already);
    # each replica's own (seed, rates, folder) are judged with it.  The fused strategy on one device with per-client
    # state there is what every valid configuration may run.
    validate_once(config)
    for c in configs:
        setting_checks.check_replica(c)
    configs = [with_validation(c, config) for c in configs]
    preflight(configs[0])  # the replicas share the population, devices and --out
    return configs
