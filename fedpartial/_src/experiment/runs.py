"""A run of either mode: :func:`simulation_for` builds a configuration's simulation (synchronous rounds, or the
buffered asynchronous run of ``--mode async``) and :func:`run` runs it as
:func:`fedpartial._src.experiment.simulation.run` does."""

from __future__ import annotations

from fedpartial._src.experiment import simulation
from fedpartial._src.experiment.asynchronous import AsyncSimulation
from fedpartial._src.experiment.config import RunConfig

#: keyword arguments of :func:`run` that build the simulation (the rest are :func:`simulation.run`'s)
PARTS = ("method", "model", "client_optimizer", "server_optimizer", "check_memory", "data_placement")


def simulation_for(config: RunConfig, dataset=None, **parts) -> simulation.Simulation:
    """The run's simulation: an :class:`AsyncSimulation` for ``--mode async``, else a :class:`Simulation`."""
    cls = AsyncSimulation if config.mode == "async" else simulation.Simulation
    return cls(config, dataset, **parts)


def run(config: RunConfig, *, sim: simulation.Simulation | None = None, **kwargs) -> dict:
    """Runs a whole simulation of either mode and writes its run directory: :func:`simulation.run
    <fedpartial._src.experiment.simulation.run>` (the same arguments and result) on :func:`simulation_for`'s
    simulation when ``sim`` is not given."""
    parts = {name: kwargs.pop(name) for name in PARTS if name in kwargs}
    if sim is None:
        sim = simulation_for(config, **parts)
    return simulation.run(config, sim=sim, **kwargs)
