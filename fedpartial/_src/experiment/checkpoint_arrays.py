"""A checkpoint's arrays: a run's state as flat numpy arrays, and what of them a storage format is given.

:mod:`~fedpartial._src.experiment.checkpoint` writes these with orbax (one process) or as ``state.npz`` (one
checkpoint per process).  Decisions taken here:

* **Names and order.**  The leaves of the live state in ``jax.tree.flatten`` order, named by position
  (``00000``, ``00001``, …); typed PRNG keys as ``jax.random.key_data``, rewrapped with the template's key
  implementation.  The tree structure comes from the template (a freshly built simulation), never from disk.
* **Leaves a format refuses.**  Orbax refuses an array with no elements (``Cannot save arrays with zero
  size``: InclusiveFL's ``[pairs]`` flags on a model with no pair of stages to transfer between) and dtypes
  tensorstore does not know (``uint4``); ``np.savez`` writes ml_dtypes' types (``bfloat16``, ``int4``, …) as
  opaque bytes that load back as ``void``.  So, for both formats alike (:func:`encode`):

  - a **zero-size** leaf is not stored at all: it has no values, so its shape and dtype (in the checkpoint's
    host record, ``"unstored"``) rebuild it exactly.  Storing it as a placeholder array instead would put an
    array in the file that the state does not have, and a shape record is what the template checks anyway;
  - a leaf whose dtype is not a plain numpy one (kind ``b``, ``i``, ``u``, ``f`` or ``c``) is stored as its
    raw bytes (``uint8``, one trailing axis of the item size) and its dtype named in ``"as_bytes"``;
  - every other leaf is stored as the plain array it is, under its index.

  Which leaves were left out or re-encoded is read from the host record on restore (:func:`stored_like`,
  :func:`decode`), not from the present state, so a checkpoint says how to read itself; one written before
  these records existed has neither and restores as plain arrays (it could hold no refused leaf: its write
  would have failed, except a zero-size leaf in ``state.npz``, which is read back as the array it is).
* **Checksum.**  Over the arrays as stored (:func:`checksum`), so it is checked before anything is decoded.
"""

from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np

from fedpartial._src.core.errors import UserError

#: numpy dtype kinds both formats store as they are: bool, signed and unsigned integers, floats, complex
PLAIN_KINDS = "biufc"
#: host-record keys: zero-size leaves left out (name → [shape, dtype]), leaves stored as bytes (name → dtype)
UNSTORED, AS_BYTES = "unstored", "as_bytes"


def is_key(leaf) -> bool:
    return hasattr(leaf, "dtype") and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def to_arrays(state) -> dict:
    """The state's leaves as numpy arrays keyed by position (PRNG keys as their raw key data)."""
    leaves = jax.tree.leaves(state)
    return {f"{i:05d}": np.asarray(jax.random.key_data(x) if is_key(x) else x) for i, x in enumerate(leaves)}


def from_arrays(arrays: dict, template, *, put: bool = True):
    """Rebuilds a state shaped like ``template`` from :func:`to_arrays`'s output (numpy leaves on the host
    unless ``put``; PRNG keys are always JAX arrays)."""
    leaves, treedef = jax.tree.flatten(template)
    if len(arrays) != len(leaves):
        raise UserError(f"the checkpoint holds {len(arrays)} arrays but this run's state has {len(leaves)}; "
                        "it was written by a different configuration or version.")
    out = []
    for i, t in enumerate(leaves):
        a = arrays[f"{i:05d}"]
        if is_key(t):
            out.append(jax.random.wrap_key_data(jnp.asarray(a), impl=jax.random.key_impl(t)))
        else:
            if tuple(a.shape) != tuple(t.shape):
                raise UserError(f"checkpoint array {i} has shape {tuple(a.shape)} but this run's state needs "
                                f"{tuple(t.shape)}; it was written by a different configuration.")
            a = np.asarray(a, dtype=t.dtype)
            out.append(jax.device_put(a) if put else a)
    return jax.tree.unflatten(treedef, out)


def _as_bytes(a: np.ndarray) -> np.ndarray:
    """``a``'s raw bytes, ``[*a.shape, itemsize]`` uint8 (a 0-d array too: viewed through one axis first)."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8).reshape(*a.shape, a.dtype.itemsize)


def _from_bytes(b: np.ndarray, dtype: str) -> np.ndarray:
    """Inverse of :func:`_as_bytes`."""
    return np.ascontiguousarray(b, np.uint8).reshape(-1).view(jnp.dtype(dtype)).reshape(b.shape[:-1])


def encode(arrays: dict) -> tuple[dict, dict]:
    """What the storage formats are given, and the host record that says how to read it back:
    ``(stored, record)``; ``record`` is empty (``{}``) when every leaf is stored as it is."""
    stored, unstored, as_bytes = {}, {}, {}
    for name, a in arrays.items():
        if a.size == 0:
            unstored[name] = [list(a.shape), a.dtype.name]
        elif a.dtype.kind not in PLAIN_KINDS:
            stored[name], as_bytes[name] = _as_bytes(a), a.dtype.name
        else:
            stored[name] = a
    return stored, {k: v for k, v in ((UNSTORED, unstored), (AS_BYTES, as_bytes)) if v}


def stored_like(template: dict, host: dict) -> dict:
    """The arrays a checkpoint with host record ``host`` stored, shaped like ``template`` (:func:`to_arrays` of
    this run's state): what orbax restores into."""
    unstored, as_bytes = host.get(UNSTORED) or {}, host.get(AS_BYTES) or {}
    return {name: _as_bytes(np.asarray(a, jnp.dtype(as_bytes[name]))) if name in as_bytes else a
            for name, a in template.items() if name not in unstored}


def decode(stored: dict, host: dict) -> dict:
    """:func:`to_arrays`'s output back from what was stored and its host record (inverse of :func:`encode`)."""
    as_bytes = host.get(AS_BYTES) or {}
    arrays = {name: _from_bytes(a, as_bytes[name]) if name in as_bytes else a for name, a in stored.items()}
    for name, (shape, dtype) in (host.get(UNSTORED) or {}).items():
        arrays[name] = np.zeros(shape, jnp.dtype(dtype))
    return dict(sorted(arrays.items()))


def checksum(arrays: dict) -> str:
    """SHA-256 over the stored arrays (names, dtypes, shapes and bytes, in order): kept with each checkpoint, so
    a restore notices flipped or zeroed bytes that the storage format itself reads back."""
    digest = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        digest.update(f"{name}:{a.dtype.str}:{a.shape};".encode())
        digest.update(a.tobytes())
    return digest.hexdigest()
