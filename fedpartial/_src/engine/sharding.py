"""The client axis split over devices: one mesh axis ``'clients'``.

A cohort's arrays all lead with the client axis ``[K, ...]``; with ``D`` devices
each holds ``K / D`` clients' rows (``K`` is padded up to a multiple of ``D`` with
padding clients, ``valid`` False, which weigh nothing).  The server state — the
global model, the server optimizer's state and a method's state, including its
per-client ``[N, ...]`` rows — is replicated: every device reads the global model
every local step, and the cohort's rows of a per-client state are gathered from it
inside the round.  Nothing else changes: the fused round is jitted with these
shardings and XLA partitions it (the aggregation's dot product over the client axis
becomes per-device partial sums and one all-reduce).

Multi-host: :func:`client_mesh` with ``None`` spans every process's devices
(after ``jax.distributed.initialize``); :func:`global_cohort` assembles the
global cohort from each process's own rows.  See ``docs/multihost.md``.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

#: the mesh axis the client axis is split over
CLIENT_AXIS = "clients"


def client_mesh(devices: int | Sequence[jax.Device] | None = None) -> Mesh:
    """A one-axis mesh named ``'clients'``.

    Args:
      devices: a number ``D`` (this process's first ``D`` local devices), a list of
        devices, or None (every device of every process: the multi-host mesh).

    Example::

        >>> client_mesh(1).shape
        OrderedDict({'clients': 1})
    """
    if devices is None:
        devices = jax.devices()
    elif isinstance(devices, (int, np.integer)):
        local = jax.local_devices()
        if not 1 <= devices <= len(local):
            raise ValueError(f"{devices} devices asked for, but this process has {len(local)} "
                             f"({local[0].platform}); use 1 to {len(local)}.")
        devices = local[:devices]
    return Mesh(np.asarray(devices), (CLIENT_AXIS,))


def cohort_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (client) axis split over the mesh; the other axes whole on each device."""
    return NamedSharding(mesh, PartitionSpec(CLIENT_AXIS))


def replicated(mesh: Mesh) -> NamedSharding:
    """A whole copy on every device of the mesh (the server state, the round key)."""
    return NamedSharding(mesh, PartitionSpec())


def padded_size(cohort_size: int, num_devices: int) -> int:
    """``cohort_size`` rounded up to a multiple of ``num_devices`` (each device gets as many clients).

    Example::

        >>> padded_size(6, 4), padded_size(8, 4), padded_size(3, 1)
        (8, 8, 3)
    """
    return -(-cohort_size // num_devices) * num_devices


def padding_ids(cohort: np.ndarray, num_clients: int, count: int) -> np.ndarray:
    """``count`` ids for padding clients: population members outside ``cohort`` (lowest first, cycled
    when fewer than ``count`` exist; the cohort's own ids only when it is the whole population).

    Padding rows are written nowhere (:func:`fedpartial._src.methods.base.scatter_clients` drops them), so a
    repeated id is harmless; ids outside the cohort keep every per-client gather of a padding row off
    the real clients' rows all the same.
    """
    outside = np.setdiff1d(np.arange(num_clients), cohort)
    pool = outside if outside.size else np.asarray(cohort)
    return np.resize(pool, count).astype(np.asarray(cohort).dtype)


def pad_cohort(cohort: Any, size: int, num_clients: int) -> Any:
    """A :class:`~fedpartial._src.engine.types.Cohort` of ``K`` clients (host arrays) padded to ``size`` rows with padding
    clients: zero data and masks (no step, no example), ``valid`` False, ids from :func:`padding_ids`.

    For callers of the engine; :class:`~fedpartial._src.experiment.simulation.Simulation` pads when it samples.
    """
    ids = np.asarray(cohort.info.client_ids)
    extra = size - len(ids)
    if extra <= 0:
        return cohort

    def pad(a):
        a = np.asarray(a)
        return np.concatenate([a, np.zeros((extra, *a.shape[1:]), a.dtype)])

    padded = jax.tree.map(pad, cohort)
    return padded._replace(info=padded.info._replace(
        client_ids=np.concatenate([ids, padding_ids(ids, num_clients, extra)])))


def shard_cohort(cohort: Any, mesh: Mesh) -> Any:
    """Places every leaf of a cohort (leading axis ``K``, a multiple of the mesh size) split over the mesh.

    Single process only: host arrays are cut into the devices' rows.  With several processes each one
    holds only its own rows; use :func:`global_cohort`.
    """
    return jax.device_put(cohort, cohort_sharding(mesh))


def global_cohort(local_rows: Any, mesh: Mesh, cohort_size: int) -> Any:
    """The global ``[K, ...]`` cohort from this process's rows (multi-host).

    Process ``p`` passes the rows its devices hold: rows ``p·K/P … (p+1)·K/P - 1`` of the
    cohort, every leaf with a leading axis of ``K/P`` (``P`` processes with equally many
    devices).  No data crosses hosts.
    """
    sharding = cohort_sharding(mesh)
    return jax.tree.map(
        lambda a: jax.make_array_from_process_local_data(sharding, np.asarray(a), (cohort_size, *np.shape(a)[1:])),
        local_rows)


def process_rows(cohort_size: int, mesh: Mesh) -> slice:
    """The rows of a ``cohort_size`` cohort that this process's devices hold (a contiguous block)."""
    index = cohort_sharding(mesh).addressable_devices_indices_map((cohort_size,))
    starts = sorted(idx[0].start or 0 for idx in index.values())
    stops = sorted(cohort_size if idx[0].stop is None else idx[0].stop for idx in index.values())
    return slice(starts[0], stops[-1])
