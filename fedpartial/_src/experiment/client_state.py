"""Per-client method state kept off the device: only the cohort's rows travel each round.

A method such as FedSPU keeps ``[N, ...]`` per-client state (N personal models).  With
``FederatedRound(client_state="host")`` the server state holds none of it; a
:class:`HostClientState` keeps the ``[N]`` rows in host memory (numpy arrays) or in
memory-mapped ``.npy`` files on disk, and each round

1. ``rows(ids)`` reads the cohort's rows ``[K, ...]`` (from disk: only those rows are read),
2. the round runs with them as ``state.method_state.clients`` (the method reads and writes
   rows ``0 … K-1``: ``RoundView.client_rows``),
3. ``write(ids, valid, new_rows)`` stores the real clients' updated rows back.

Host code only (numpy, files); the round stays a pure function of arrays.  A disk store
lives in a temporary folder that is removed when the store is closed or collected; a
checkpoint keeps its own copy.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from typing import Any, Callable

import jax
import numpy as np

from fedpartial._src.engine import types as engine_types

#: where a run keeps its per-client state (``--client-state``)
PLACES = ("auto", "device", "host", "disk")
#: the places off the device: only the cohort's rows travel to it each round
OFF_DEVICE = ("host", "disk")
#: per-client state kept off the device is initialised about this many bytes at a time
CHUNK_BYTES = 64 * 2**20
#: the per-client state may take at most this share of the memory it is placed in under ``auto``
AUTO_FRACTION = 0.5


def tree_bytes(shapes: Any) -> int:
    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(shapes))


def resolve(requested: str, state_bytes: int, *, can_leave_device: bool, device_free: int | None,
            host_free: int | None, platform: str) -> str:
    """``device``, ``host`` or ``disk`` for ``--client-state requested``.

    ``auto`` (for a method whose state may leave the device; else ``device``):

    * on an accelerator, the device while the state takes at most :data:`AUTO_FRACTION` of its free
      memory, else the host's RAM while it fits there by the same rule, else disk;
    * on a CPU the device's memory *is* the RAM, and keeping the ``[N]`` rows inside the jitted round
      costs more than handing it the cohort's rows: ``benchmarks/scale.py`` (FedSPU, 10,000 personal
      models of the Synthetic MLP, 2.2 GB, K = 100, shared 2-core CPU) measured 3.2-4.6 s per round
      and 5.0 GB peak RSS on the device against 1.6-2.1 s and 2.9 GB in host RAM.  So ``host`` while
      the state takes at most :data:`AUTO_FRACTION` of the available RAM, else ``disk``.
    """
    if requested != "auto":
        return requested
    if not can_leave_device or state_bytes == 0:
        return "device"
    if platform != "cpu" and (device_free is None or state_bytes <= AUTO_FRACTION * device_free):
        return "device"
    if host_free is None or state_bytes <= AUTO_FRACTION * host_free:
        return "host"
    return "disk"


class HostClientState:
    """``[N, ...]`` per-client state as numpy arrays (``host``) or memory-mapped files (``disk``)."""

    def __init__(self, shapes: Any, *, disk: bool = False, directory: str | None = None):
        leaves, self.treedef = jax.tree.flatten(shapes)
        self.num_clients = int(leaves[0].shape[0]) if leaves else 0
        self.directory = None
        if disk:
            self.directory = tempfile.mkdtemp(prefix="fedpartial-client-state-", dir=directory)
            # removed when the store is closed or garbage-collected (or at interpreter exit)
            self._cleanup = weakref.finalize(self, shutil.rmtree, self.directory, True)
            self.leaves = [np.lib.format.open_memmap(os.path.join(self.directory, f"{i:03d}.npy"), mode="w+",
                                                     dtype=a.dtype, shape=a.shape) for i, a in enumerate(leaves)]
        else:
            self.leaves = [np.empty(a.shape, a.dtype) for a in leaves]

    @property
    def where(self) -> str:
        return "host" if self.directory is None else "disk"

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.leaves)

    def fill(self, rows_of: Callable[[int, int], Any], chunk: int) -> None:
        """Writes every row from ``rows_of(start, size)`` (``[size, ...]``), ``chunk`` clients at a time
        (one size for all calls: the last chunk overlaps the one before)."""
        n = self.num_clients
        chunk = max(1, min(chunk, n))
        for start in range(0, n, chunk):
            start = min(start, n - chunk)
            for a, r in zip(self.leaves, jax.tree.leaves(jax.device_get(rows_of(start, chunk)))):
                a[start:start + chunk] = r

    def rows(self, ids: np.ndarray) -> Any:
        """The clients ``ids``' rows ``[K, ...]`` (copies, in the order of ``ids``)."""
        ids = np.asarray(ids)
        return jax.tree.unflatten(self.treedef, [a[ids] for a in self.leaves])

    def write(self, ids: np.ndarray, valid: np.ndarray, rows: Any) -> None:
        """Stores the updated rows ``[K, ...]`` of the real clients (``valid``) at ``ids``."""
        keep = np.asarray(valid, bool)
        ids = np.asarray(ids)[keep]
        for a, r in zip(self.leaves, jax.tree.leaves(jax.device_get(rows))):
            a[ids] = np.asarray(r)[keep]

    def tree(self) -> Any:
        """Every client's state as a tree of ``[N, ...]`` numpy arrays (for a disk store, views of the files)."""
        return jax.tree.unflatten(self.treedef, list(self.leaves))

    def load(self, tree: Any, chunk: int = 4096) -> None:
        """Overwrites every row from a tree shaped like :meth:`tree` (e.g. a restored checkpoint)."""
        for a, b in zip(self.leaves, jax.tree.leaves(tree)):
            for start in range(0, self.num_clients, chunk):
                a[start:start + chunk] = np.asarray(b[start:start + chunk])

    def close(self) -> None:
        """Removes a disk store's files (nothing for a host store)."""
        if self.directory is not None:
            self.leaves = []
            self._cleanup()


def initial_state(round, key: jax.Array, place: str, num_clients: int, *, execution_times=None,
                  chunk_bytes: int = CHUNK_BYTES) -> tuple[Any, HostClientState | None]:
    """``round``'s initial server state from ``key`` and, with the per-client state kept off the device (``place``
    host or disk), the store of its ``[N]`` rows, filled in chunks of about ``chunk_bytes`` (else None)."""
    state = round.init(key, execution_times=execution_times)
    if place == "device":
        return state, None
    shapes = round.client_state_shapes()
    store = HostClientState(shapes, disk=place == "disk")
    per_client = max(1, tree_bytes(shapes) // num_clients)
    store.fill(lambda start, size: round.init_client_rows(key, start, size, state.variables,
                                                          execution_times=execution_times),
               chunk=max(1, chunk_bytes // per_client))
    return state, store


def with_rows(state, store: HostClientState | None, ids: np.ndarray):
    """The server state ``state`` the round takes for the cohort ``ids``: with their per-client rows from ``store``
    brought to the device (unchanged when the rows live on the device: ``store`` None)."""
    if store is None:
        return state
    # one copy to the device: the stepwise strategy hands the state to several jitted pieces
    return engine_types.with_clients(state, jax.device_put(store.rows(ids)))


def rows_written(state, store: HostClientState | None, ids: np.ndarray, valid: np.ndarray):
    """The state a round gave back, its cohort's per-client rows written into ``store`` (the real clients' only)
    and taken out of it; unchanged when ``store`` is None."""
    if store is None:
        return state
    store.write(ids, valid, state.method_state.clients)
    return engine_types.without_clients(state)


def whole(state, store: HostClientState | None):
    """The server state with every client's rows (numpy arrays from ``store`` when they live off the device)."""
    if store is None:
        return state
    return engine_types.with_clients(state, store.tree())
