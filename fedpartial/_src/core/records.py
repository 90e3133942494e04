"""The records a round's hooks exchange: who is in the cohort (:class:`CohortInfo`), its data (:class:`Batch`,
:class:`Holdout`, :class:`ServerData`), what each client trains (:class:`ClientPlan`) and uploads
(:class:`Selection`), and a method's state (:class:`MethodState`).  Plain ``NamedTuple`` pytrees with a leading
``[K]`` cohort axis (``[N]`` for the population); :mod:`fedpartial._src.core.types` re-exports them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

from fedpartial._src.core.fielddocs import document_fields
from fedpartial._src.core.masks import Mask


@document_fields
class CohortInfo(NamedTuple):
    """Who is in the cohort. All ``[K]``.

    Attributes:
      client_ids: int32, each client's index into the population ``0 … N-1``.
      num_samples: float32, each client's training examples ``n_k``.
      valid: bool, False for padding clients (they weigh 0).
      lr_scale: float32, each client's learning rate over the client optimizer's (its updates are
        multiplied by it), or None for 1: replicas that sweep the rate share one round built with rate 1.
    """

    client_ids: jax.Array
    num_samples: jax.Array
    valid: jax.Array
    lr_scale: jax.Array | None = None


@document_fields
class Batch(NamedTuple):
    """One local step's data for one client (or ``[K, S, ...]`` for a cohort).

    Attributes:
      x: inputs ``[B, ...]``.
      y: int labels ``[B]``.
      example_mask: bool ``[B]``, False for padded examples (they add nothing to the loss).
      step_mask: bool scalar, False for a padded step (the client had fewer steps; nothing changes).
    """

    x: jax.Array
    y: jax.Array
    example_mask: jax.Array
    step_mask: jax.Array


@document_fields
class Holdout(NamedTuple):
    """A cohort's held-out (validation) examples, ``[K, H, ...]``; padded examples masked.

    Attributes:
      x: inputs ``[K, H, ...]``.
      y: int labels ``[K, H]``.
      example_mask: bool ``[K, H]``, False for padding.
    """

    x: jax.Array
    y: jax.Array
    example_mask: jax.Array


@document_fields
class ServerData(NamedTuple):
    """Examples the server holds (e.g. FedDHE's class-balanced set), ``[M, ...]``.

    Attributes:
      x: inputs ``[M, ...]``.
      y: int labels ``[M]``.
    """

    x: jax.Array
    y: jax.Array


@document_fields
class ClientPlan(NamedTuple):
    """What each client of the cohort trains, keeps and receives. Leading ``[K]``.

    Attributes:
      train: elements a client may change, or None for "everything".
      dropout: neurons that exist in the client's sub-model (its ``neurons``
        field), or None for "no dropout".
      dropout_scale: per-unit forward multipliers ``[K, units_l]`` (e.g. the
        inverted-dropout ``1/(1-d)``), or None to use the dropout mask as 0/1.
      download: elements sent to the client (for traffic accounting), or None
        for the whole model.
      extra_download_bytes: ``[K]`` bytes sent besides parameters (e.g. the
        indices of a client's active neurons), or None for none.
      extra: any per-client array data a method's per-step hooks need (e.g.
        per-neuron dropout rates to resample masks from); leading ``[K]``.
      download_bytes_per_layer: ``[K, L]`` parameter bytes sent per layer when the
        payload is not what ``download`` masks (e.g. FedDST's sparse values and
        bit-masks), or None to count the masked elements.
      lr_scale: ``[K]`` multipliers of each client's optimizer updates, or None for 1.
        The engine multiplies in the cohort's ``lr_scale`` after the method plans.
      window: ``[K]`` int32 where each client's width window starts (FedRolex rolls it
        every round): a windowed graph (``width``) then holds
        units ``window … window + n - 1`` (mod the layer's units) instead of the leading ``n``;
        None: the leading units.  Graphs without windows (the whole model) ignore it.
    """

    train: Mask | None = None
    dropout: Mask | None = None
    dropout_scale: tuple[jax.Array, ...] | None = None
    download: Mask | None = None
    extra_download_bytes: jax.Array | None = None
    extra: Any = None
    download_bytes_per_layer: jax.Array | None = None
    lr_scale: jax.Array | None = None
    window: jax.Array | None = None


@document_fields
class Selection(NamedTuple):
    """What the server aggregates. Leading ``[K]``.

    Attributes:
      upload: elements each client uploads.
      weights: aggregation weights ``w_k`` (padding clients are zeroed by the engine).
      extra_upload_bytes: bytes uploaded besides parameters (feedback, indices).
      upload_bytes_per_layer: ``[K, L]`` parameter bytes uploaded per layer when the
        payload is not what ``upload`` masks (e.g. sparse values), or None to count
        the masked elements.  Aggregation still reads ``upload``.
    """

    upload: Mask
    weights: jax.Array
    extra_upload_bytes: jax.Array
    upload_bytes_per_layer: jax.Array | None = None


@document_fields
class MethodState(NamedTuple):
    """A method's state: server-side part and per-client part with leading ``[N]``.

    Attributes:
      server: any pytree the server keeps between rounds (e.g. SCAFFOLD's control variate); ``()`` for none.
      clients: any pytree with leading ``[N]``, one row per client of the population; ``()`` for none.
    """

    server: Any = ()
    clients: Any = ()
