"""The training population on the device, and a cohort's batches gathered from it inside jit.

:func:`place` copies the partitioned training data to the device once, client
after client (:class:`DevicePopulation`: flat arrays, no per-client Python
objects, so a population of a million clients is five arrays).  Each round,
:func:`gather_cohort` (pure, jittable) picks the cohort's rows by client id,
shuffles and batches them on the device and returns the engine's
:class:`~fedpartial._src.core.types.Batch` — with the same shapes, dtypes, ``example_mask``,
``step_mask`` and ``num_samples`` as :func:`fedpartial._src.data.packing.pack_cohort`
gives for the same clients and settings (see that module for how local epochs,
local steps and padding work; padded slots hold 0 and label 0 here too).

Shuffling
---------
Client ``k`` shuffles with ``fold_in(key, client_id_k)``: its batches depend on
the key and its own id, never on who else is in the cohort.  The order is drawn
by JAX's RNG, so it differs from the host path's (numpy) order for the same seed;
both are valid draws of the same scheme, and a run is reproducible for a given
placement (``--data-placement``), not across placements.

A client's examples are taken from a stream of successive random permutations
of them: with ``n`` examples, stream position ``q`` lies in permutation
``p = q // n`` and reads example ``π_p(q mod n)``.  Local epochs read one
permutation per epoch, local steps read the stream straight through, exactly as in
the host path.  Each ``π_p`` is a keyed bijection of ``0 … n-1`` computed position
by position (:func:`_permute`: a 6-round Feistel network on the smallest ``4^h ≥ n``
values, cycle-walked back into ``0 … n-1``), so a round costs O(S x B) per client,
the positions it reads: no client's stream is materialised or sorted, and one very
large client costs its cohort nothing.  (Sorting a random key per stream
position instead would cost up to the population's largest ``permutations x n_k``: 4.7 s a round on CPU for
K = 1,000 with one 20,000-example client, against 0.15 s without that client; the Feistel network costs
1.01x the same cohort without it, ``python -m benchmarks.gather``.)  A Feistel permutation is pseudo-random, not drawn uniformly from all
``n!`` orders; what SGD needs — every example once per epoch, in an order that
changes with the key, the permutation and the client — it gives.

:func:`resolve_placement` is the ``auto`` rule of ``--data-placement``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedpartial._src.core import memory
from fedpartial._src.core.types import Batch, Holdout
from fedpartial._src.data import packing

__all__ = ["DevicePopulation", "GatherSpec", "gather_spec", "layout", "place", "gather_cohort",
           "gather_holdout", "gather_round", "population_bytes", "available_memory", "DEVICE_MEMORY_FRACTION",
           "resolve_placement", "PLACEMENTS"]

PLACEMENTS = ("auto", "host", "device")
#: on an accelerator, ``auto`` places the data on the device when it takes at most this share of its free memory
DEVICE_MEMORY_FRACTION = 0.25


class DevicePopulation(NamedTuple):
    """Every client's training examples on the device, client after client (``T = sum n_k``)."""

    x: jax.Array  # [T, *feature_shape] float32 (integer features keep their dtype)
    y: jax.Array  # [T] int32
    offsets: jax.Array  # [N] int32: client k's examples are rows offsets[k] : offsets[k] + sizes[k]
    sizes: jax.Array  # [N] int32 n_k
    steps: jax.Array  # [N] int32 real local steps of client k (packing.steps_for_client)


class GatherSpec(NamedTuple):
    """Static settings of :func:`gather_cohort` (hashable: a jit static argument)."""

    batch_size: int
    num_steps: int  # S, the padded number of steps (packing.max_steps over the population)
    local_steps: int | None
    local_epochs: float | None


def _client_steps(sizes: np.ndarray, batch_size: int, local_steps, local_epochs) -> np.ndarray:
    """``[N]`` :func:`packing.steps_for_client` of every size, computed once per distinct size."""
    distinct, inverse = np.unique(np.asarray(sizes, np.int64), return_inverse=True)
    steps = np.array([packing.steps_for_client(int(n), batch_size, local_steps=local_steps,
                                               local_epochs=local_epochs) for n in distinct], np.int64)
    return steps[inverse].reshape(np.shape(sizes))


def gather_spec(*, batch_size: int, num_steps: int, local_steps: int | None = None,
                local_epochs: float | None = None) -> GatherSpec:
    """The gather's static settings (its shapes depend on nothing else: not on any client's size)."""
    return GatherSpec(int(batch_size), int(num_steps), local_steps, None if local_epochs is None else float(local_epochs))


def layout(client_indices: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(order, offsets, sizes)``: the clients' example indices concatenated, and where each one starts."""
    sizes = np.fromiter((len(c) for c in client_indices), np.int64, count=len(client_indices))
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]) if len(sizes) else np.zeros(0, np.int64)
    order = np.concatenate([np.asarray(c, np.int64) for c in client_indices]) if len(sizes) else \
        np.zeros(0, np.int64)
    return order, offsets, sizes


def population_bytes(x: np.ndarray, client_indices: Sequence[np.ndarray]) -> int:
    """Device bytes :func:`place` will take for these clients (examples, labels and index tables)."""
    total = sum(len(c) for c in client_indices)
    row = int(np.prod(np.shape(x)[1:], dtype=np.int64)) * _out_dtype(x).itemsize
    return total * (row + 4) + 12 * len(client_indices)


def _out_dtype(x: np.ndarray) -> np.dtype:
    return x.dtype if np.issubdtype(x.dtype, np.integer) else np.dtype(np.float32)


def place(x: np.ndarray, y: np.ndarray, client_indices: Sequence[np.ndarray], spec: GatherSpec,
          device: jax.Device | None = None) -> DevicePopulation:
    """Copies the clients' examples to ``device`` (default: JAX's first) once, client after client."""
    x = np.asarray(x)
    order, offsets, sizes = layout(client_indices)
    steps = _client_steps(sizes, spec.batch_size, spec.local_steps, spec.local_epochs)
    if order.size == 0:  # no client has an example: one zero row keeps the (never real) gathers in bounds
        x, y, order = np.zeros((1,) + x.shape[1:], x.dtype), np.zeros((1,) + np.shape(y)[1:], np.int32), \
            np.zeros(1, np.int64)
    host = DevicePopulation(
        x=np.asarray(x[order], _out_dtype(x)), y=np.asarray(np.asarray(y)[order], np.int32),
        offsets=offsets.astype(np.int32), sizes=sizes.astype(np.int32), steps=steps.astype(np.int32))
    return jax.device_put(host, device)


def _slots(n: jax.Array, steps: jax.Array, spec: GatherSpec) -> tuple[jax.Array, jax.Array]:
    """One client's ``[S, B]`` stream positions and which slots are real (n examples, ``steps`` steps)."""
    b = spec.batch_size
    s_idx = jnp.arange(spec.num_steps, dtype=jnp.int32)[:, None]
    b_idx = jnp.arange(b, dtype=jnp.int32)[None, :]
    safe_n = jnp.maximum(n, 1)
    if spec.local_epochs is not None:
        per_epoch = (safe_n + b - 1) // b
        pos = (s_idx % per_epoch) * b + b_idx  # position within the epoch's permutation
        real = (s_idx < steps) & (pos < n)
        q = (s_idx // per_epoch) * safe_n + pos
    else:
        take = jnp.minimum(b, n)  # real examples per batch
        real = (s_idx < steps) & (b_idx < take)
        q = s_idx * take + b_idx
    return jnp.where(real, q, 0), real


#: Feistel rounds of :func:`_permute` (4 make a pseudo-random permutation from a random round function; 6 for margin)
FEISTEL_ROUNDS = 6


def _mix32(x: jax.Array) -> jax.Array:
    """A 32-bit integer mixer (xorshift-multiply, "lowbias32"): every input bit flips about half the output."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def _permute(key_bits: jax.Array, n: jax.Array, block: jax.Array, i: jax.Array) -> jax.Array:
    """``π_block(i)``: a keyed bijection of ``0 … n-1`` for every permutation ``block`` (arrays of positions).

    A balanced Feistel network on ``[0, 4^h)``, the smallest such range holding ``n``
    (``key_bits`` ``[FEISTEL_ROUNDS]`` uint32 and ``block`` give the round keys); a value that lands
    at ``n`` or above is sent through the network again (cycle walking) until it is below ``n``,
    which keeps it a bijection of ``0 … n-1``.  At least a quarter of ``[0, 4^h)`` lies below ``n``,
    so a value needs under 4 passes on average.
    """
    n = jnp.maximum(n, 1).astype(jnp.uint32)
    bits = jnp.uint32(32) - jax.lax.clz(n - 1)  # ceil(log2 n): clz(0) = 32 gives 0 for n = 1
    h = (bits + 1) // 2
    mask = (jnp.uint32(1) << h) - 1
    keys = [_mix32(k + block.astype(jnp.uint32) * jnp.uint32(0x9E3779B9)) for k in key_bits]

    def feistel(v):
        left, right = v >> h, v & mask
        for k in keys:
            left, right = right, left ^ (_mix32(right ^ k) & mask)
        return (left << h) | right

    v = feistel(i.astype(jnp.uint32))
    v = jax.lax.while_loop(lambda v: jnp.any(v >= n), lambda v: jnp.where(v >= n, feistel(v), v), v)
    return v.astype(jnp.int32)


def gather_cohort(data: DevicePopulation, client_ids: jax.Array, valid: jax.Array, key: jax.Array,
                  spec: GatherSpec) -> tuple[Batch, jax.Array]:
    """The cohort's ``Batch`` ``[K, S, B, ...]`` and ``num_samples`` ``[K]`` (pure; jit with ``spec`` static).

    ``client_ids`` ``[K]`` index the population; a client whose ``valid`` is False is empty (no
    steps, ``num_samples`` 0), as is a client with no examples.  ``key``: a typed PRNG key.
    """
    ids = jnp.asarray(client_ids, jnp.int32)
    n = jnp.where(valid, data.sizes[ids], 0)
    steps = jnp.where(valid, data.steps[ids], 0)
    offsets = data.offsets[ids]
    keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(ids)

    def one(key_k, n_k, steps_k, offset_k):
        q, real = _slots(n_k, steps_k, spec)
        safe_n = jnp.maximum(n_k, 1)
        local = _permute(jax.random.bits(key_k, (FEISTEL_ROUNDS,), jnp.uint32), n_k, q // safe_n, q % safe_n)
        return jnp.where(real, offset_k + local, 0), real

    rows, mask = jax.vmap(one)(keys, n, steps, offsets)
    x = data.x[rows]
    x = jnp.where(mask.reshape(mask.shape + (1,) * (x.ndim - mask.ndim)), x, jnp.zeros((), x.dtype))
    y = data.y[rows]
    y = jnp.where(mask.reshape(mask.shape + (1,) * (y.ndim - mask.ndim)), y, 0)
    batch = Batch(x=x, y=y, example_mask=mask, step_mask=mask.any(axis=2))
    return batch, n.astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("spec",))
def gather_round(data: DevicePopulation, holdout: Holdout | None, client_ids: jax.Array, valid: jax.Array,
                 seed: jax.Array, *, spec: GatherSpec) -> tuple[Batch, jax.Array, Holdout | None]:
    """One round's :func:`gather_cohort` (key ``jax.random.key(seed)``) and :func:`gather_holdout`, jitted."""
    batch, num_samples = gather_cohort(data, client_ids, valid, jax.random.key(seed), spec)
    return batch, num_samples, None if holdout is None else gather_holdout(holdout, client_ids, valid)


def gather_holdout(holdout: Holdout, client_ids: jax.Array, valid: jax.Array) -> Holdout:
    """The cohort's rows ``[K, H, ...]`` of a padded population holdout ``[N, H, ...]`` (invalid rows masked)."""
    ids = jnp.asarray(client_ids, jnp.int32)
    return Holdout(holdout.x[ids], holdout.y[ids], holdout.example_mask[ids] & jnp.asarray(valid)[:, None])


def available_memory(device: jax.Device | None = None) -> int | None:
    """Bytes the device may hold: an accelerator's free memory; on CPU the machine's available RAM."""
    return memory.available_bytes(device)[0]


def resolve_placement(requested: str, needed_bytes: int, available: int | None, platform: str) -> str:
    """``host`` or ``device``.  ``auto`` is ``device`` on an accelerator (``platform`` not ``cpu``) when
    ``needed_bytes`` is at most :data:`DEVICE_MEMORY_FRACTION` of its ``available`` memory, else ``host``.

    On CPU ``auto`` is ``host``: there the device's memory is the host's, nothing is transferred that the
    gather would save, and the packing it replaces is a few milliseconds of a round that takes a hundred
    or more (``benchmarks/data_placement.py`` measured device/host 0.8-1.0x end to end on CPU).
    """
    if requested != "auto":
        return requested
    if platform == "cpu" or available is None:
        return "host"
    return "device" if needed_bytes <= DEVICE_MEMORY_FRACTION * available else "host"
