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


def run(config: RunConfig, *, on_round=None, sim: simulation.Simulation | None = None,
        checkpoint_every: int | None = None, resume: str | None = None, stop=None, **parts) -> dict:
    """Runs a whole simulation of either mode (synchronous rounds, or ``--mode async``), writing
    ``config.json``, ``config.toml`` (for ``--config``), ``environment.json``, ``metrics.jsonl``,
    ``metrics.csv``, ``summary.json``, ``status.json`` and checkpoints to a new run folder.

    SIGINT/SIGTERM stop the run after the current round (a checkpoint, ``status.json`` ``interrupted`` and
    the summary are written, then ``KeyboardInterrupt`` is raised).  A :class:`~fedpartial.DivergedError`
    leaves status ``diverged`` and the last good checkpoint, any other error ``failed``; both are raised
    again after the summary is written.  Result files are strict JSON (non-finite numbers are ``null``).

    Args:
      config: the run's settings (:class:`~fedpartial.RunConfig`); the folder is made in ``config.out_dir``.
      on_round: called with each round's record (a dict) as it finishes, or None.
      sim: an already-built simulation of ``config`` to reuse, or None.
      checkpoint_every: rounds between checkpoints (None: only at the end).
      resume: a run directory whose newest readable checkpoint is loaded into ``sim`` (built from that
        folder's ``config.toml``); ``metrics.jsonl`` is truncated to the checkpoint's round.
      stop: a stop flag of the caller's (None: one is installed here for SIGINT/SIGTERM).
      **parts: any of :class:`~fedpartial.Simulation`'s ``method``, ``model``, ``client_optimizer``,
        ``server_optimizer``, ``check_memory``, ``data_placement``.

    Returns:
      The summary dict (``summary.json``'s fields, ``run_dir`` and the per-round records).

    Raises:
      UserError: a setting that cannot run.
      DivergedError: the loss became non-finite.

    Examples:
      >>> import tempfile, fedpartial as fp
      >>> config = fp.RunConfig(num_clients=6, cohort_size=3, rounds=1, local_steps=1,
      ...                       out_dir=tempfile.mkdtemp())
      >>> 0 <= fp.run(config)["final_test_accuracy"] <= 1
      True
    """
    if sim is None:
        sim = simulation_for(config, **{name: parts.pop(name) for name in PARTS if name in parts})
    return simulation.run(config, on_round=on_round, sim=sim, checkpoint_every=checkpoint_every, resume=resume,
                          stop=stop, **parts)
