"""The engine's core types: what a round reads, what a method returns, what a client trains on.

These are plain ``NamedTuple`` pytrees (arrays with a leading ``[K]`` cohort axis,
or ``[N]`` for the population) and frozen dataclasses of static facts.  They live
with the engine, below ``methods/``, so that methods, costs, evaluation and the
engine can all import them without a cycle.

A method (:class:`Method`) is a ``NamedTuple`` of small pure functions; the round
(:mod:`fedpartial._src.engine.round`) calls them in this order::

    init          (once)        (ctx, InitView)            -> MethodState
    groups        (static)      (ctx)                      -> ClientGroup…    how the cohort is split
    plan          (cohort)      (ctx, RoundView)           -> ClientPlan      masks per client
    client_start  (one client)  (ctx, global, state, plan) -> variables       where training starts
    ... per group: prepare once, then local steps ...
    step_plan     (one step)    (ctx, plan, key, step)     -> ClientPlan      e.g. resampled dropout
    objective     (one step)    (ctx, params, LocalStep)   -> (loss, LossAux)
    select        (cohort)      (ctx, RoundView)           -> Selection       upload masks, weights
    ... aggregation (engine) ...
    server_correct (cohort)     (ctx, RoundView)           -> params          optional: e.g. FedNova's step
    ... server optimizer (engine) ...
    update        (cohort)      (ctx, RoundView)           -> MethodState
    metrics       (cohort)      (ctx, RoundView)           -> {name: array}   reaches metrics.jsonl

and outside the round ``personal`` (each client's own model) and
``active_clients`` (who may still be sampled).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, TYPE_CHECKING

import jax

from fedpartial._src.core.masks import Mask
from fedpartial._src.core.structure import ModelStructure

if TYPE_CHECKING:  # the model layer sits above core: types only
    from fedpartial._src.models.adapter import Model


class CohortInfo(NamedTuple):
    """Who is in the cohort. All ``[K]``."""

    client_ids: jax.Array  # int32, index into the population
    num_samples: jax.Array  # float32, n_k
    valid: jax.Array  # bool, False for padding clients (they weigh 0)
    # float32, each client's learning rate over the client optimizer's (its updates are multiplied
    # by it), or None for 1: replicas that sweep the learning rate share one round built with rate 1
    lr_scale: jax.Array | None = None


class Batch(NamedTuple):
    """One local step's data for one client (or ``[K, S, ...]`` for a cohort)."""

    x: jax.Array
    y: jax.Array
    example_mask: jax.Array
    step_mask: jax.Array


class Holdout(NamedTuple):
    """A cohort's held-out (validation) examples, ``[K, H, ...]``; padded examples masked."""

    x: jax.Array
    y: jax.Array
    example_mask: jax.Array


class ServerData(NamedTuple):
    """Examples the server holds (e.g. FedDHE's class-balanced set), ``[M, ...]``."""

    x: jax.Array
    y: jax.Array


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
    """

    train: Mask | None = None
    dropout: Mask | None = None
    dropout_scale: tuple[jax.Array, ...] | None = None
    download: Mask | None = None
    extra_download_bytes: jax.Array | None = None
    extra: Any = None
    download_bytes_per_layer: jax.Array | None = None
    lr_scale: jax.Array | None = None


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


class MethodState(NamedTuple):
    """A method's state: server-side part and per-client part with leading ``[N]``."""

    server: Any = ()
    clients: Any = ()


class PersonalModels(NamedTuple):
    """Every client's own model: ``variables`` with leading ``[N]`` (or one unstacked
    model shared by all) and, for sub-model methods, the ``[N]`` neuron mask of the
    sub-model each client holds (None: the full model)."""

    variables: dict
    submodel: Mask | None = None
    stacked: bool = True


@dataclasses.dataclass(frozen=True)
class MethodContext:
    """Static facts a method may use (hashable; never traced)."""

    model: Model
    num_clients: int
    cohort_size: int
    rounds: int | None = None  # planned number of rounds, for schedules (None: unknown)
    batch_statistics: bool = False  # 'static' BatchNorm: evaluate with batch statistics
    # The last ``padding`` rows of every cohort are padding clients (never valid) that fill the devices the
    # cohort is split over; ``cohort_size`` counts them.  Client groups put them in their last group.
    padding: int = 0

    @property
    def structure(self) -> ModelStructure:
        return self.model.structure

    @property
    def clients_per_round(self) -> int:
        """The clients sampled each round: ``cohort_size`` without the padding rows."""
        return self.cohort_size - self.padding


class InitView(NamedTuple):
    """What ``init`` may read."""

    global_vars: dict
    key: jax.Array
    server_data: ServerData | None = None
    label_counts: jax.Array | None = None  # [N, C] every client's training examples per class (None: not given)
    execution_times: jax.Array | None = None  # [N] seconds of full-model local work per device (None: no device model)


class RoundView(NamedTuple):
    """Everything a cohort-level hook may read; fields not yet known are None.

    ``key`` is the calling hook's own key (plan, select, update and metrics each
    get a different one).
    """

    key: jax.Array
    round: jax.Array
    global_vars: dict
    method_state: MethodState
    client_state: Any  # the cohort's rows of method_state.clients
    cohort: CohortInfo
    data: Batch  # the cohort's local data [K, S, B, ...]
    plan: ClientPlan | None = None
    trained_vars: dict | None = None  # [K, ...] after local training
    selection: Selection | None = None
    new_global_vars: dict | None = None
    holdout: Holdout | None = None  # the cohort's validation data, when the run has it
    client_loss: jax.Array | None = None  # [K] mean local training loss
    start_vars: dict | None = None  # [K, ...] the model each client started local training from
    client_steps: jax.Array | None = None  # [K] int32 real local steps each client took
    aggregated: dict | None = None  # Σ w m θ / Σ w m (else global), before server_correct and the server optimizer
    summary: Any = None  # [K, ...] the method's per-client statistic of the trained cohort (``Method.summarize``)
    # [K] int32: the cohort's rows of ``method_state.clients`` — its client ids, or 0…K-1 when the round holds
    # only the cohort's rows (per-client state kept off the device); write rows back at these (``scatter_clients``)
    client_rows: jax.Array | None = None


class LossAux(NamedTuple):
    """What an objective reports besides the value it minimises."""

    loss: jax.Array  # the data loss (reported as the client's training loss)
    batch_stats: dict  # updated running statistics (the input ones when not tracked)


class LocalStep(NamedTuple):
    """One client's inputs to one local step's objective.

    ``forward(params, x)`` runs the client's (possibly truncated, possibly
    sub-model) graph in train mode on ``x`` with this step's example mask and
    returns ``(logits, batch_stats)``; an objective should call it rather than
    the model, so dropout and client groups apply.
    """

    batch: Batch  # this step's data (x may be prepared inputs, e.g. prefix activations)
    key: jax.Array  # this step's own key: the client's round key folded with the step index
    index: jax.Array  # the step index
    plan: ClientPlan  # this step's plan (after ``step_plan``)
    global_vars: dict
    client_state: Any
    forward: Callable[[Any, jax.Array], tuple[jax.Array, dict]]


Objective = Callable[[MethodContext, Any, LocalStep], tuple[jax.Array, LossAux]]


class LocalGraph(NamedTuple):
    """How one client group sees the model during local training (all pure).

    ``extract`` maps any full-shaped variables tree (values, masks, scales) to the
    group's own tree; ``insert(full, part)`` writes a group tree back into a
    full-shaped one; ``prepare(variables, data, batch_statistics)`` turns one
    client's whole local data ``[S, B, ...]`` into the steps' inputs, once per
    round (None: the raw data); ``apply(variables, x, train, example_mask)`` is
    the group's forward pass.
    """

    extract: Callable[[Any], Any]
    insert: Callable[[Any, Any], Any]
    apply: Callable[..., tuple[jax.Array, Any]]
    prepare: Callable[[dict, Batch, bool], Batch] | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class ClientGroup:
    """A static part of every cohort: ``size`` slots, drawn from ``members``.

    The cohort is laid out group after group (group 0 takes rows ``0 … size_0-1``).
    Each group's local training is compiled for its own ``graph`` (None: the
    whole model); its trained variables are written back to full shape, so
    select, aggregation and update see one ``[K, ...]`` cohort.

    Attributes:
      name: shown in errors and metrics.
      size: clients per round in this group (static for the run).
      members: population ids this group samples from (None: everyone).
      graph: the group's local graph (e.g. :func:`fedpartial._src.engine.graphs.suffix`).
    """

    name: str
    size: int
    members: tuple[int, ...] | None = None
    graph: LocalGraph | None = None


class Method(NamedTuple):
    """A federated method as pure functions (build one with :func:`fedpartial.methods.make_method`).

    ``personalised``: clients keep their own models (evaluated per client on held-out
    data).  ``needs_holdout``: the method reads ``RoundView.holdout``.
    ``server_examples_per_class``: the server keeps that many training examples of
    every class (given to ``init`` as :class:`ServerData`; never a client's).

    ``server_correct`` (optional): the server step when it is not the plain aggregate
    (FedNova's normalised averaging, FedDyn's ``h`` correction).  It reads the round
    with ``RoundView.aggregated`` set and returns new global ``params``, which the
    server optimizer then treats as it treats the aggregate (pseudo-gradient
    ``global - params``).  Elements nobody uploaded keep their global value whatever
    it returns.  Its key is ``fold_in(update's key, 1)``.  None: the aggregate.

    ``needs_execution_times``: the method's ``init`` reads ``InitView.execution_times``
    (each device's simulated time for a round of full-model local work, e.g. FedAD's
    per-device dropout targets); a simulation computes them from its device model.

    ``adapt_model`` (optional): the model the method trains, made from the one a run
    names (MOON adds a projection head); :class:`fedpartial._src.experiment.simulation.Simulation`
    applies it to the models it builds (a model passed in is used as it is).

    ``summarize`` (optional): a small per-client statistic of the trained cohort,
    ``[K, ...]`` (FedLDF's ``[K, L]`` layer divergences), read from ``trained_vars``,
    ``start_vars`` and ``global_vars``; the engine sets ``RoundView.summary`` to it
    before ``select``.  Row ``k`` must depend on client ``k``'s rows only.

    ``streamable``: whether the streamed strategy (:func:`fedpartial._src.engine.round.streamed`,
    the cohort a chunk of clients at a time, bounded memory) can run the method.  In
    every case ``plan``, ``select``, ``update`` and ``metrics`` read no ``data``, and
    ``update`` and ``metrics`` no ``trained_vars`` or ``start_vars`` (they are None
    there), there is no ``server_correct``, no client groups and no per-client state:

    * ``"per_client"`` — ``select``'s row ``k`` depends only on client ``k``'s rows
      (FedAvg's ``n_k`` weights and trained parts): it is called chunk by chunk and
      the round trains every client once.
    * ``"summary"`` — ``select`` reads the whole cohort's ``summary`` but not
      ``trained_vars`` (FedLDF's top-n over the ``[L, K]`` divergences): a first pass
      trains every chunk and keeps only the summaries; after selection, the clients
      that upload anything are trained again (same keys: identical results) and
      aggregated.
    * None — the method needs the whole cohort at once (every other strategy).

    ``host_client_state``: the method reads its per-client state only as the cohort's
    rows (``RoundView.client_state``) and writes it back only at ``RoundView.client_rows``
    (:func:`~fedpartial._src.methods.base.cohort_rows`), so a run may keep the ``[N]`` state
    on the host or on disk and hand each round just the cohort's rows
    (``--client-state host|disk``); ``personal`` and ``active_clients`` then receive numpy
    arrays.  False (e.g. FedDH, whose update reads every client's label distribution):
    the state stays on the device.
    """

    name: str
    init: Callable[[MethodContext, InitView], MethodState]
    plan: Callable[[MethodContext, RoundView], ClientPlan]
    client_start: Callable[[MethodContext, dict, Any, ClientPlan], dict]
    step_plan: Callable[[MethodContext, ClientPlan, jax.Array, jax.Array], ClientPlan] | None
    objective: Objective
    select: Callable[[MethodContext, RoundView], Selection]
    update: Callable[[MethodContext, RoundView], MethodState]
    metrics: Callable[[MethodContext, RoundView], dict] | None
    groups: Callable[[MethodContext], tuple[ClientGroup, ...]] | None
    personal: Callable[[MethodContext, MethodState, dict], PersonalModels]
    active_clients: Callable[[MethodContext, MethodState], jax.Array] | None
    personalised: bool = False
    needs_holdout: bool = False
    server_examples_per_class: int = 0
    server_correct: Callable[[MethodContext, RoundView], Any] | None = None
    adapt_model: Callable[[Model], Model] | None = None
    needs_execution_times: bool = False
    summarize: Callable[[MethodContext, RoundView], Any] | None = None
    streamable: str | None = None
    host_client_state: bool = False
