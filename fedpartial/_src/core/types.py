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
    transform_grads (one step)  (ctx, grads, LocalStep)    -> grads           e.g. SCAFFOLD's correction
    select        (cohort)      (ctx, RoundView)           -> Selection       upload masks, weights
    encode        (cohort)      (ctx, RoundView)           -> params [K, ...] optional: what the server receives
    ... aggregation (engine) ...
    aggregate     (cohort)      (ctx, RoundView)           -> (params, received)  optional: replaces it, e.g. DP's noise
    server_correct (cohort)     (ctx, RoundView)           -> params          optional: e.g. FedNova's step
    ... server optimizer (engine) ...
    update        (cohort)      (ctx, RoundView)           -> MethodState
    metrics       (cohort)      (ctx, RoundView)           -> {name: array}   reaches metrics.jsonl

``select``, ``encode``, ``aggregate`` and ``server_correct`` may instead return ``Carry(result, value)``: the later
hooks of the round read ``value`` as ``RoundView.carried[hook]`` (nothing is computed twice in a round).

and outside the round ``personal`` (each client's own model) and
``active_clients`` (who may still be sampled).  What a method needs from the run
(held-out data, a server set, a sequential model, ...) is one record,
:class:`Capabilities`, which the driver reads instead of method names.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Protocol

import jax
import optax

from fedpartial._src.core.masks import Mask
from fedpartial._src.core.structure import ModelStructure



class ModelLike(Protocol):
    """What core needs of a model (structurally: :class:`fedpartial._src.models.adapter.Model` is one, and core,
    below the model layer, imports nothing of it).

    ``apply(variables, x, train, example_mask=None) -> (logits [B, C], batch_stats)``;
    ``init_variables(key) -> variables``.  A method may read more of the model it is given (its stages, its
    exits): those are the model layer's, typed there."""

    @property
    def name(self) -> str: ...

    @property
    def structure(self) -> ModelStructure: ...

    @property
    def input_shape(self) -> tuple[int, ...]: ...

    @property
    def num_classes(self) -> int: ...

    @property
    def num_stages(self) -> int: ...

    def apply(self, variables: dict, x: Any, train: bool, example_mask: Any = None) -> tuple[Any, Any]: ...

    def init_variables(self, key: jax.Array) -> dict: ...


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
      window: ``[K]`` int32 where each client's width window starts (FedRolex rolls it
        every round): a windowed graph (:func:`fedpartial._src.engine.graphs.width`) then holds
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


class Carry(NamedTuple):
    """A hook's result with a value it hands on to the later hooks of the same round, so that nothing is
    computed twice in a round (e.g. DP-FedAvg's clip factors, computed in ``aggregate`` and read by ``update``
    and ``metrics``).  ``select``, ``encode``, ``aggregate`` and ``server_correct`` may return one instead of
    their result; the later hooks read ``RoundView.carried[hook]``.  (Under the streamed strategy ``select``
    runs a chunk of clients at a time and may not carry.)"""

    result: Any
    value: Any


#: the hooks that may return a :class:`Carry`, in the order a round calls them
CARRYING_HOOKS = ("select", "encode", "aggregate", "server_correct")


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


class ClientOptimizer(NamedTuple):
    """The clients' local optimizer: an optax transformation at rate 1 (``direction``) and the rate.

    The engine multiplies every local update by the client's rate in one place
    (:mod:`fedpartial._src.engine.client`): ``lr`` × the cohort's ``CohortInfo.lr_scale``
    (replicas that sweep the rate share one round built with ``lr`` 1) × the plan's
    ``ClientPlan.lr_scale`` (a method's own per-client rates).  A method reads the result as
    ``LocalStep.lr`` and ``RoundView.client_lr``, never by multiplying scales itself.
    Build one with :func:`client_sgd`; a plain optax transformation given instead applies its
    own rate, which the engine then cannot tell a method (``lr`` None).
    """

    direction: Any  # optax.GradientTransformation at rate 1 (its updates point downhill, unscaled)
    lr: float | None
    momentum: float = 0.0
    weight_decay: float = 0.0


def client_sgd(lr: float, momentum: float = 0.0, weight_decay: float = 0.0) -> ClientOptimizer:
    """SGD with momentum and L2 weight decay (decoupled from the loss) at rate ``lr``.

    The same arithmetic as ``optax.chain(optax.add_decayed_weights(weight_decay), optax.sgd(lr, momentum))``
    bit for bit: ``(-u)·lr`` and ``u·(-lr)`` round alike.
    """
    parts = [optax.add_decayed_weights(weight_decay)] if weight_decay else []
    parts.append(optax.sgd(1.0, momentum=momentum or None))
    return ClientOptimizer(direction=optax.chain(*parts), lr=float(lr), momentum=float(momentum),
                           weight_decay=float(weight_decay))


class OptimizerSettings(NamedTuple):
    """The client optimizer's settings a method may read (``MethodContext.client_optimizer``).  The
    learning rate is not here: it may differ per client and per replica (``LocalStep.lr``)."""

    momentum: float = 0.0
    weight_decay: float = 0.0


@dataclasses.dataclass(frozen=True)
class MethodContext:
    """Static facts a method may use (hashable; never traced)."""

    model: ModelLike
    num_clients: int
    cohort_size: int
    rounds: int | None = None  # planned number of rounds, for schedules (None: unknown)
    batch_statistics: bool = False  # 'static' BatchNorm: evaluate with batch statistics
    # The last ``padding`` rows of every cohort are padding clients (never valid) that fill the devices the
    # cohort is split over; ``cohort_size`` counts them.  Client groups put them in their last group.
    padding: int = 0
    # The client optimizer's momentum and weight decay (None: a plain optax transformation, settings unknown)
    client_optimizer: OptimizerSettings | None = None

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
    """What a cohort-level hook reads.  One record for every hook; a field is None where its
    hook runs before the value exists.  :data:`VIEW_FIELDS` lists, per hook, the fields that
    can be set (``tests/core/test_views.py`` proves no hook sees more, under every strategy).

    ``key`` is the calling hook's own key (plan, select, update and metrics each
    get a different one).  Under the streamed strategy no hook sees ``data``, and
    ``update`` and ``metrics`` see no ``trained_vars`` or ``start_vars``.
    """

    # ---- every hook --------------------------------------------------------------
    key: jax.Array
    round: jax.Array
    global_vars: dict
    method_state: MethodState
    client_state: Any  # the cohort's rows of method_state.clients
    cohort: CohortInfo
    data: Batch  # the cohort's local data [K, S, B, ...]
    # ---- from summarize on: after local training ---------------------------------------
    plan: ClientPlan | None = None
    trained_vars: dict | None = None  # [K, ...] after local training
    # ---- from server_correct on: after selection and aggregation ------------------------
    selection: Selection | None = None
    # ---- update and metrics: after the server optimizer ---------------------------------
    new_global_vars: dict | None = None
    # ---- every hook, when the run holds out validation data ------------------------------
    holdout: Holdout | None = None  # the cohort's validation data
    # ---- from summarize on -------------------------------------------------------------
    client_loss: jax.Array | None = None  # [K] mean local training loss
    start_vars: dict | None = None  # [K, ...] the model each client started local training from
    client_steps: jax.Array | None = None  # [K] int32 real local steps each client took
    # ---- from server_correct on ----------------------------------------------------------
    aggregated: dict | None = None  # Σ w m θ / Σ w m (else global), before server_correct and the server optimizer
    # ---- from select on, when the method has ``summarize`` --------------------------------
    summary: Any = None  # [K, ...] the method's per-client statistic of the trained cohort (``Method.summarize``)
    # ---- every hook ----------------------------------------------------------------------
    # [K] int32: the cohort's rows of ``method_state.clients`` — its client ids, or 0…K-1 when the round holds
    # only the cohort's rows (per-client state kept off the device); write rows back at these (``scatter_clients``)
    client_rows: jax.Array | None = None
    # ---- from summarize on, when the client optimizer's rate is known (``ClientOptimizer``) -----
    # [K] float32 the rate each client trained with: the optimizer's ``lr`` × every ``lr_scale`` (see ClientOptimizer)
    client_lr: jax.Array | None = None
    # ---- from aggregate on: what earlier hooks of this round handed on (:class:`Carry`) -------------
    carried: dict | None = None  # {hook: value} for each of CARRYING_HOOKS that returned a Carry so far
    # ---- from aggregate on: the params [K, ...] as the server receives them (``encode``'s, else trained_vars')
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
    "update": frozenset(_TRAINED + ("summary", "selection", "aggregated", "new_global_vars", "carried", "uploaded")),
    "metrics": frozenset(_TRAINED + ("summary", "selection", "aggregated", "new_global_vars", "carried", "uploaded")),
}


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
    client_state: Any  # this client's rows of the method's per-client state
    forward: Callable[[Any, jax.Array], tuple[jax.Array, dict]]
    server_state: Any = ()  # the method's server state (``MethodState.server``), e.g. SCAFFOLD's control variate
    # this client's learning rate (a scalar array: the optimizer's rate × every ``lr_scale``), or None when the
    # client optimizer is a plain optax transformation whose rate the engine cannot read (see ClientOptimizer)
    lr: jax.Array | None = None


Objective = Callable[[MethodContext, Any, LocalStep], tuple[jax.Array, LossAux]]


class LocalGraph(NamedTuple):
    """How one client group sees the model during local training (all pure).

    ``extract`` maps any full-shaped variables tree (values, masks, scales) to the
    group's own tree; ``insert(full, part)`` writes a group tree back into a
    full-shaped one; ``prepare(variables, data, batch_statistics)`` turns one
    client's whole local data ``[S, B, ...]`` into the steps' inputs, once per
    round (None: the raw data); ``apply(variables, x, train, example_mask)`` is
    the group's forward pass.  A ``windowed`` graph's ``extract(tree, window)`` and
    ``insert(full, part, window)`` also take a client's window start (``ClientPlan.window``).
    """

    extract: Callable[..., Any]
    insert: Callable[..., Any]
    apply: Callable[..., tuple[jax.Array, Any]]
    prepare: Callable[[dict, Batch, bool], Batch] | None = None
    windowed: bool = False


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


class Capabilities(NamedTuple):
    """What a method needs from a run and which executions it allows — read by the driver and the
    engine from this record, never from a method's name.

    Attributes:
      personalised: clients keep their own models (``Method.personal``); runs evaluate each
        client's model on its held-out data, so they hold data out (default train fraction 0.7).
      needs_holdout: a hook reads ``RoundView.holdout`` (e.g. early stopping).
      server_examples_per_class: the server keeps that many training examples of every class
        (``InitView.server_data``; never a client's).
      needs_execution_times: ``init`` reads ``InitView.execution_times`` (each device's simulated
        time for a round of full-model local work, e.g. FedAD's per-device targets).
      neuron_masks: the method drops single neurons (per-neuron masks wired through the layers),
        which needs a sequential model (a chain of layers, no residual connections).
      streamable: whether the streamed strategy (the cohort a chunk of clients at a time) can run
        the method.  In every case ``plan``, ``select``, ``update`` and ``metrics`` read no ``data``,
        ``update`` and ``metrics`` no ``trained_vars`` or ``start_vars``, and the method has no
        ``server_correct``, no client groups and no per-client state.  ``"per_client"``: ``select``'s
        row ``k`` depends only on client ``k``'s rows (FedAvg).  ``"summary"``: ``select`` reads the
        whole cohort's ``summary`` but not ``trained_vars`` (FedLDF's top-n); clients that upload
        anything are trained again (same keys, same results) and aggregated.  None: not streamable.
      host_client_state: the method reads its per-client state only as the cohort's rows
        (``RoundView.client_state``) and writes it only at ``RoundView.client_rows``
        (:func:`~fedpartial._src.core.population.cohort_rows`), so a run may keep the ``[N]`` state on
        the host or on disk (``--client-state host|disk``); ``personal`` and ``active_clients`` then
        receive numpy arrays.  False: the state stays on the device.
      finetune_epochs: personalised by fine-tuning (FedBABU): each client's own model is the global model
        trained this many epochs on the client's training data (the whole model, cross-entropy, the run's
        client optimizer and batch size) and then evaluated on its held-out split; the driver does it
        (:mod:`fedpartial._src.experiment.finetune`) and does not read ``personal``.  0: no fine-tuning.
      local_passes: how many models a client trains over its local steps in a round, on the same batches
        (Ditto: 2, the global model and then its personal one); the device model counts each client's FLOPs of
        local work, and so its simulated time, this many times.
      asynchronous: the method's hooks after local training are defined on any set of updates, each of one
        client trained on the model of its own moment, so a buffered asynchronous run (``--mode async``,
        :mod:`fedpartial._src.engine.asynchronous`) may aggregate them; False: refused there.
    """

    personalised: bool = False
    needs_holdout: bool = False
    server_examples_per_class: int = 0
    needs_execution_times: bool = False
    neuron_masks: bool = False
    streamable: str | None = None
    host_client_state: bool = False
    finetune_epochs: float = 0
    local_passes: int = 1
    asynchronous: bool = False


class Method(NamedTuple):
    """A federated method: small pure functions (hooks) and one :class:`Capabilities` record.
    Build one with :func:`fedpartial.make_method`, which fills every hook not given with FedAvg's.

    Hooks, by phase (the module docstring gives their signatures and order):

    * **server, once**: ``init``; ``groups`` (how the cohort is split into static client groups);
      ``adapt_model`` (the model the method trains, made from the one a run names, e.g. MOON's
      projection head; a model passed to a simulation is used as it is).
    * **cohort, before training**: ``plan`` (masks, per-client rates).
    * **one client, local training**: ``client_start``, ``step_plan``, ``objective`` and
      ``transform_grads`` (each step's gradient before the frozen elements are zeroed, e.g.
      SCAFFOLD's ``g − c_i + c``).  They see :class:`LocalStep`: the client's own state rows,
      the method's server state and the client's learning rate.
    * **cohort, after training**: ``summarize`` (a ``[K, ...]`` per-client statistic read from
      ``trained_vars``, ``start_vars`` and ``global_vars``, set as ``RoundView.summary`` before
      ``select``; row ``k`` depends on client ``k``'s rows only); ``select``; ``encode`` (what the server
      receives of each client's ``params``, ``[K, ...]``: an upload codec's decoded values; read by the
      aggregation and the later hooks as ``RoundView.uploaded``; its key is ``fold_in(update's key, 3)``);
      ``aggregate`` (replaces
      the one formula for the ``params`` collection, e.g. DP-FedAvg's clipped, noised sum over a fixed
      denominator; it returns ``(params, received)``, ``received`` a boolean tree, True where the server
      optimizer may move an element; other collections, such as BatchNorm statistics, still take the
      formula; its key is ``fold_in(update's key, 2)``); ``server_correct``
      (the server step when it is not the plain aggregate, e.g. FedNova; it returns new global
      ``params``, which the server optimizer treats as the aggregate; elements nobody uploaded keep
      their global value; its key is ``fold_in(update's key, 1)``); ``update``; ``metrics``.
    * **outside the round**: ``personal`` (every client's own model) and ``active_clients`` (who may
      still be sampled).

    Optional hooks are None where the method has no such step.
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
    server_correct: Callable[[MethodContext, RoundView], Any] | None = None
    adapt_model: Callable[[ModelLike], ModelLike] | None = None
    summarize: Callable[[MethodContext, RoundView], Any] | None = None
    transform_grads: Callable[[MethodContext, Any, LocalStep], Any] | None = None
    capabilities: Capabilities = Capabilities()
    aggregate: Callable[[MethodContext, RoundView], tuple[Any, Any]] | None = None
    encode: Callable[[MethodContext, RoundView], Any] | None = None

    def with_capabilities(self, **changes) -> "Method":
        """The same method with some capabilities changed (e.g. a wrapper that needs held-out data)."""
        return self._replace(capabilities=self.capabilities._replace(**changes))
