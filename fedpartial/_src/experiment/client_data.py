"""The run's data as its clients hold it: the server's set, every client's training and held-out examples, their
label counts and local steps, where the training data lives (host or device), and each round's cohort packed or
gathered from it.  :class:`~fedpartial._src.experiment.simulation.Simulation` holds one (:attr:`Simulation.data`).
"""

from __future__ import annotations

import jax
import numpy as np

from fedpartial._src.core.types import CohortInfo, Holdout, Method, ServerData
from fedpartial._src.data import ondevice, packing, sources
from fedpartial._src.data.partition import train_holdout_split
from fedpartial._src.engine import types as engine_types
from fedpartial._src.experiment import layout, population
from fedpartial._src.experiment.config import ConfigError, RunConfig
from fedpartial._src.experiment.evaluation import pad_holdouts

__all__ = ["ClientData"]


class ClientData:
    """``dataset`` split among the clients of ``config`` for ``method`` (each training on ``train_fraction`` of its
    examples and holding the rest out, ``holdout_note`` saying why), its training data placed by ``config.data_placement`` (or the caller's
    ``placement``: ``host`` or ``device``).  The data is copied to the device by :meth:`place_on_device` only, once
    the run is known to fit beside it."""

    def __init__(self, config: RunConfig, dataset: sources.ArrayDataset, method: Method, train_fraction: float,
                 holdout_note: str | None = None, placement: str | None = None):
        #: the training and test data
        self.dataset = dataset
        #: the share of each client's examples it trains on (the rest is held out)
        self.train_fraction = train_fraction
        #: why each client holds data out when the run did not say (None: it said, or nothing is held out)
        self.holdout_note = holdout_note
        #: the examples the server holds (methods that ask for some per class), else None
        self.server_data = None
        pool = None
        if method.capabilities.server_examples_per_class:
            if dataset.natural_partition is not None:
                raise ConfigError(f"method {method.name} needs a server set, which a naturally "
                                  f"partitioned dataset ({dataset.name}) cannot spare.")
            server = population.server_examples(dataset.groups, method.capabilities.server_examples_per_class,
                                                config.seed)
            self.server_data = ServerData(dataset.x_train[server], dataset.y_train[server])
            pool = np.setdiff1d(np.arange(len(dataset.y_train)), server)
        #: every client's training example indices
        self.clients = population.partition_clients(config, dataset, train_fraction, pool)
        #: every client's held-out examples padded to one length ``(x, y, mask)``, else None
        self.holdout = None
        if train_fraction < 1:
            self.clients, held = train_holdout_split(self.clients, train_fraction, seed=config.seed)
            self.holdout = pad_holdouts([(dataset.x_train[h], dataset.y_train[h]) for h in held])
        #: ``[N]`` every client's training examples
        self.sizes = np.array([len(c) for c in self.clients])
        #: ``[N, C]`` every client's training examples per class (FedDH's label distributions)
        self.label_counts = population.label_counts(dataset.y_train, self.clients, dataset.num_classes)
        #: local steps of the client with the most (every cohort is packed to this many)
        self.num_steps = packing.max_steps(np.unique(self.sizes), config.batch_size, local_steps=config.local_steps,
                                           local_epochs=config.epochs)
        #: bytes the data takes on the device (:func:`ondevice.population_bytes` plus the holdout)
        self.data_bytes = layout.data_bytes(dataset.x_train, self.clients, self.holdout)
        #: ``host`` or ``device``: where the training data lives (``config.data_placement`` resolved)
        self.placement = layout.data_placement(config, self.data_bytes, placement)
        self._packing = {"batch_size": config.batch_size, "local_steps": config.local_steps,
                         "local_epochs": config.epochs}
        self._on_device = None  # (population, holdout, gather spec) once copied

    @property
    def copied(self) -> bool:
        """Whether the training data is on the device already."""
        return self._on_device is not None

    def keep_on_host(self) -> None:
        """Training data on the host from now on: the device's copy (if any) is let go."""
        self.placement, self._on_device = "host", None

    def place_on_device(self) -> None:
        """Copies the clients' training data (and the padded holdout) to the device, once; later cohorts are
        gathered there (:mod:`fedpartial._src.data.ondevice`)."""
        spec = ondevice.gather_spec(num_steps=self.num_steps, **self._packing)
        placed = ondevice.place(self.dataset.x_train, self.dataset.y_train, self.clients, spec)
        holdout = None if self.holdout is None else jax.device_put(Holdout(*self.holdout))
        self.placement, self._on_device = "device", (placed, holdout, spec)

    def pad(self, num_steps: int, holdout_length: int | None = None) -> None:
        """Pads every later cohort to ``num_steps`` local steps and the holdout to ``holdout_length`` examples
        per client (no-ops for training and evaluation; on the device the gather's bounds follow)."""
        if num_steps < self.num_steps:
            raise ValueError(f"num_steps {num_steps} is below this run's {self.num_steps}; padding only grows it.")
        self.num_steps = num_steps
        placed, holdout, spec = self._on_device or (None, None, None)
        if self.holdout is not None and holdout_length is not None and holdout_length != self.holdout[0].shape[1]:
            extra = holdout_length - self.holdout[0].shape[1]
            if extra < 0:
                raise ValueError(f"holdout_length {holdout_length} is below this run's {self.holdout[0].shape[1]}.")
            before = sum(int(a.nbytes) for a in self.holdout)
            self.holdout = tuple(np.pad(a, [(0, 0), (0, extra)] + [(0, 0)] * (a.ndim - 2)) for a in self.holdout)
            self.data_bytes += sum(int(a.nbytes) for a in self.holdout) - before
            holdout = holdout and jax.device_put(Holdout(*self.holdout))
        if self._on_device is not None:
            self._on_device = (placed, holdout, spec._replace(num_steps=num_steps))

    def cohort(self, ids: np.ndarray, pack_seed: int, valid: np.ndarray, streamed: bool) -> engine_types.Cohort:
        """The clients ``ids``' local data for one round, shuffled with ``pack_seed``: packed on the host (a
        ``streamed`` round's a chunk at a time), or gathered on the device (the two draw different, equally valid
        orders)."""
        settings = {**self._packing, "num_steps": self.num_steps}
        if streamed:
            return population.streamed_cohort(self.dataset, self.clients, self.sizes, self.holdout, ids, valid,
                                              pack_seed, **settings)
        if self._on_device is not None:
            placed, holdout, spec = self._on_device
            ids = np.asarray(ids, np.int32)
            batch, num_samples, held = ondevice.gather_round(placed, holdout, ids, valid, np.uint32(pack_seed),
                                                             spec=spec)
            return engine_types.Cohort(data=batch, info=CohortInfo(client_ids=ids, num_samples=num_samples,
                                                                   valid=valid), holdout=held)
        return population.packed_cohort(self.dataset, self.clients, self.holdout, ids, valid, pack_seed, **settings)
