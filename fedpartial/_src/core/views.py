"""What a method's hooks read: :class:`InitView` (``init``), :class:`RoundView` (every cohort-level hook, with
:data:`VIEW_FIELDS` saying which fields each hook can see) and :class:`LocalStep` (a local step's objective),
and what an objective reports besides its loss (:class:`LossAux`).  The records they hold
(:class:`~fedpartial._src.core.types.CohortInfo`, ``Batch``, ``ClientPlan``, ...) are in
:mod:`fedpartial._src.core.records`; :mod:`fedpartial._src.core.types` re-exports both.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax

from fedpartial._src.core.fielddocs import document_fields
from fedpartial._src.core.records import Batch, ClientPlan, CohortInfo, Holdout, MethodState, Selection, ServerData


@document_fields
class InitView(NamedTuple):
    """What ``init`` may read.

    Attributes:
      global_vars: the initial global model's variables.
      key: ``init``'s own PRNG key.
      server_data: examples the server holds (``Capabilities.server_examples_per_class``), else None.
      label_counts: ``[N, C]`` every client's training examples per class (None: not given).
      execution_times: ``[N]`` seconds of full-model local work per device (None: no device model).
    """

    global_vars: dict
    key: jax.Array
    server_data: ServerData | None = None
    label_counts: jax.Array | None = None
    execution_times: jax.Array | None = None


@document_fields
class RoundView(NamedTuple):
    """What a cohort-level hook reads.  One record for every hook; a field is None where its
    hook runs before the value exists.  :data:`VIEW_FIELDS` lists, per hook, the fields that
    can be set (the test suite proves no hook sees more, under every strategy).

    ``key`` is the calling hook's own key (plan, select, update and metrics each
    get a different one).  Under the streamed strategy no hook sees ``data``, and
    ``update`` and ``metrics`` see no ``trained_vars`` or ``start_vars``.  Arrays lead with the cohort's ``[K]``.

    Attributes:
      key: the calling hook's own PRNG key (every hook).
      round: int32 scalar, the round number from 0 (every hook).
      global_vars: the global model's variables at the round's start (every hook).
      method_state: the method's :class:`MethodState` (every hook).
      client_state: the cohort's rows of ``method_state.clients`` (every hook).
      cohort: who is in the cohort, :class:`CohortInfo` (every hook).
      data: the cohort's local data :class:`Batch` ``[K, S, B, ...]`` (every hook; None when streamed).
      plan: the round's :class:`ClientPlan` (from ``summarize`` on).
      trained_vars: ``[K, ...]`` variables after local training (from ``summarize`` on).
      selection: the round's :class:`Selection` (from ``encode`` on).
      new_global_vars: the global model after the server optimizer (``update`` and ``metrics``).
      holdout: the cohort's validation data :class:`Holdout` (every hook, when the run holds data out).
      client_loss: ``[K]`` mean local training loss (from ``summarize`` on).
      start_vars: ``[K, ...]`` the model each client started local training from (from ``summarize`` on).
      client_steps: ``[K]`` int32 real local steps each client took (from ``summarize`` on).
      aggregated: ``Σ w m θ / Σ w m`` (else global), before ``server_correct`` and the server optimizer
        (from ``server_correct`` on).
      summary: ``[K, ...]`` the method's per-client statistic of the trained cohort (``Method.summarize``;
        from ``select`` on).
      client_rows: ``[K]`` int32, the cohort's rows of ``method_state.clients``: its client ids, or
        ``0 … K-1`` when the round holds only the cohort's rows (per-client state kept off the device);
        write rows back at these (:func:`scatter_clients`; every hook).
      client_lr: ``[K]`` float32, the rate each client trained with: the optimizer's ``lr`` × every
        ``lr_scale`` (from ``summarize`` on, when the client optimizer's rate is known).
      carried: ``{hook: value}`` for each hook that returned a :class:`Carry` so far (from ``encode`` on).
      uploaded: the params ``[K, ...]`` as the server receives them: ``encode``'s, else ``trained_vars``'
        (from ``aggregate`` on).

    Examples:
      >>> import fedpartial as fp
      >>> sorted(fp.VIEW_FIELDS["plan"])[:3]
      ['client_rows', 'client_state', 'cohort']
    """

    key: jax.Array
    round: jax.Array
    global_vars: dict
    method_state: MethodState
    client_state: Any
    cohort: CohortInfo
    data: Batch
    plan: ClientPlan | None = None
    trained_vars: dict | None = None
    selection: Selection | None = None
    new_global_vars: dict | None = None
    holdout: Holdout | None = None
    client_loss: jax.Array | None = None
    start_vars: dict | None = None
    client_steps: jax.Array | None = None
    aggregated: dict | None = None
    summary: Any = None
    client_rows: jax.Array | None = None
    client_lr: jax.Array | None = None
    carried: dict | None = None
    uploaded: Any = None


_BEFORE_TRAINING = ("key", "round", "global_vars", "method_state", "client_state", "cohort", "data", "holdout",
                    "client_rows")
_TRAINED = _BEFORE_TRAINING + ("plan", "trained_vars", "client_loss", "start_vars", "client_steps", "client_lr")
#: hook -> the :class:`RoundView` fields that can be set when it runs (the rest are None)
VIEW_FIELDS: dict[str, frozenset[str]] = {
    "plan": frozenset(_BEFORE_TRAINING),
    "summarize": frozenset(_TRAINED),
    "select": frozenset(_TRAINED + ("summary",)),
    "encode": frozenset(_TRAINED + ("summary", "selection", "carried")),
    "aggregate": frozenset(_TRAINED + ("summary", "selection", "carried", "uploaded")),
    "server_correct": frozenset(_TRAINED + ("summary", "selection", "aggregated", "carried", "uploaded")),
    "rewrite_global": frozenset(_TRAINED + ("summary", "selection", "aggregated", "new_global_vars", "carried",
                                            "uploaded")),
    "update": frozenset(_TRAINED + ("summary", "selection", "aggregated", "new_global_vars", "carried", "uploaded")),
    "metrics": frozenset(_TRAINED + ("summary", "selection", "aggregated", "new_global_vars", "carried", "uploaded")),
}


@document_fields
class LossAux(NamedTuple):
    """What an objective reports besides the value it minimises.

    Attributes:
      loss: the data loss (reported as the client's training loss).
      batch_stats: updated running statistics (the input ones when not tracked).
    """

    loss: jax.Array
    batch_stats: dict


@document_fields
class LocalStep(NamedTuple):
    """One client's inputs to one local step's objective.

    ``forward(params, x)`` runs the client's (possibly truncated, possibly
    sub-model) graph in train mode on ``x`` with this step's example mask and
    returns ``(logits, batch_stats)``; an objective should call it rather than
    the model, so dropout and client groups apply.

    Attributes:
      batch: this step's data (``x`` may be prepared inputs, e.g. prefix activations).
      key: this step's own key: the client's round key folded with the step index.
      index: the step index.
      plan: this step's plan (after ``step_plan``).
      global_vars: the global model's variables at the round's start.
      client_state: this client's rows of the method's per-client state.
      forward: ``forward(params, x) -> (logits, batch_stats)``, the client's graph in train mode.
      server_state: the method's server state (``MethodState.server``), e.g. SCAFFOLD's control variate.
      lr: this client's learning rate (a scalar array: the optimizer's rate × every ``lr_scale``), or None
        when the client optimizer is a plain optax transformation whose rate the engine cannot read.
    """

    batch: Batch
    key: jax.Array
    index: jax.Array
    plan: ClientPlan
    global_vars: dict
    client_state: Any
    forward: Callable[[Any, jax.Array], tuple[jax.Array, dict]]
    server_state: Any = ()
    lr: jax.Array | None = None
