"""What a run's settings become on this machine: :func:`resolve` turns a validated
:class:`~fedpartial._src.experiment.config.RunConfig` into its :class:`RunPlan` (the devices the cohort is split
over, the method built from the registry, the strategy the round runs).

The configuration is pure data that JAX never sees; this module is where it meets the hardware (JAX is asked
how many devices there are and of which platform) and the engine (the strategy, the device model's
distributions).  The configuration's own ``run_strategy``, ``device_model``, ``build_method`` and
``num_devices`` are these functions, for callers that hold only a configuration; so this module takes the
configuration as it comes and does not import its module.  The method a configuration names is built as its
checks build it (:func:`~fedpartial._src.experiment.setting_checks.build_method`).
"""

from __future__ import annotations

import dataclasses

import jax

from fedpartial._src.core.types import Method
from fedpartial._src.costs import devices
from fedpartial._src.engine import strategy as engine_strategy
from fedpartial._src.experiment import core_split
from fedpartial._src.experiment.config_checks import validate_once
from fedpartial._src.experiment.setting_checks import build_method

__all__ = ["RunPlan", "build_method", "device_model", "num_devices", "resolve", "run_strategy"]


def num_devices(config) -> int:
    """Devices the client axis is split over: ``--devices``, else every local device when the strategy is fused
    on an accelerator, or the cores of a CPU when ``auto`` measured the split over them faster
    (:mod:`~fedpartial._src.experiment.core_split`), else 1."""
    if config.devices is not None:
        return config.devices
    split = core_split.for_config(config)
    if split is not None:  # the process was restarted for it
        return split.devices
    fused = engine_strategy.parse_strategy(config.strategy).kind == "fused"
    return jax.local_device_count() if fused and jax.default_backend() != "cpu" else 1


def run_strategy(config, split_over: int | None = None, model=None,
                 layout: str | None = None) -> engine_strategy.Strategy:
    """The strategy the round runs: ``--strategy`` ('auto' is fused when the cohort is split over devices:
    ``split_over`` of them, default :func:`num_devices`; otherwise the platform's rule for ``model`` and its
    convolutions' ``layout``)."""
    return _strategy(config.strategy, split_over or num_devices(config), model, layout)


def _strategy(setting: str, split_over: int, model, layout: str | None) -> engine_strategy.Strategy:
    if setting == "auto" and split_over > 1:
        return engine_strategy.fused()
    return engine_strategy.parse_strategy(setting, model, layout)


def device_model(config) -> devices.DeviceProfiles:
    """Every client's device ``[N]``: the profiles CSV when given, else drawn with the seed (the population must
    be known: ``config.num_clients`` set)."""
    if config.device_profiles is not None:
        return devices.load_profiles(config.device_profiles, config.num_clients)
    return devices.sample_profiles(config.num_clients, config.seed, compute=config.compute_speed,
                                   download=config.download_bandwidth, upload=config.upload_bandwidth)


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """A validated configuration resolved on this machine (:func:`resolve`).

    Attributes:
      num_devices: devices the cohort is split over (:func:`num_devices`).
      method: the run's method before the wrappers a run adds (early stopping, codecs, privacy): the caller's,
        else the one the configuration names, built.
      strategy_setting: ``--strategy`` as given, which :meth:`strategy` resolves once the model is known.
      core_split: the split over a CPU's cores that ``auto`` measured faster and this process was restarted to
        run (:func:`~fedpartial._src.experiment.core_split.active`), or None.
    """

    num_devices: int
    method: Method
    strategy_setting: str
    core_split: core_split.CoreSplit | None = None

    def strategy(self, model=None, layout: str | None = None, split_over: int | None = None
                 ) -> engine_strategy.Strategy:
        """The strategy the round runs for ``model`` (its convolutions lowered in ``layout``) over ``split_over``
        devices (default: the plan's): :func:`run_strategy`'s rule, or over a CPU's cores the split's layout."""
        if self.core_split is not None and self.strategy_setting == "auto":
            return engine_strategy.default_strategy(layout=self.core_split.layout)
        return _strategy(self.strategy_setting, split_over or self.num_devices, model, layout)


def resolve(config, method: Method | None = None) -> RunPlan:
    """The run's plan: ``config``, validated once (:func:`~fedpartial._src.experiment.config_checks.validate_once`:
    nothing is checked again when it already passed), resolved against this machine and the registries.
    ``method``: the caller's own :class:`~fedpartial.Method` (``config`` then names it, with no options).
    The device model is :func:`device_model`'s, once the population is known (leaf and hf: from the files)."""
    validate_once(config, custom_method=method is not None)
    return RunPlan(num_devices=num_devices(config), method=method if method is not None else build_method(config),
                   strategy_setting=config.strategy, core_split=core_split.for_config(config))

