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
    rewrite_global (cohort)     (ctx, RoundView)           -> variables       optional: e.g. FLoRA's merge into the base
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

from fedpartial._src.core.fielddocs import document_fields
from fedpartial._src.core.masks import Mask
from fedpartial._src.core.structure import ModelStructure
from fedpartial._src.core.records import (  # noqa: F401  (re-exported: the records hooks exchange)
    Batch, ClientPlan, CohortInfo, Holdout, MethodState, Selection, ServerData)
from fedpartial._src.core.views import VIEW_FIELDS, InitView, LocalStep, LossAux, RoundView  # noqa: F401  (re-exported)


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


@document_fields
class Carry(NamedTuple):
    """A hook's result with a value it hands on to the later hooks of the same round, so that nothing is
    computed twice in a round (e.g. DP-FedAvg's clip factors, computed in ``aggregate`` and read by ``update``
    and ``metrics``).  ``select``, ``encode``, ``aggregate`` and ``server_correct`` may return one instead of
    their result; the later hooks read ``RoundView.carried[hook]``.  (Under the streamed strategy ``select``
    runs a chunk of clients at a time and may not carry.)

    Attributes:
      result: what the hook returns without a carry (a ``Selection``, params, ...).
      value: any pytree the later hooks of this round read as ``RoundView.carried[hook]``.

    Examples:
      >>> import fedpartial as fp
      >>> fp.Carry(result=1.0, value={"clip": 0.5}).value["clip"]
      0.5
    """

    result: Any
    value: Any


#: the hooks that may return a :class:`Carry`, in the order a round calls them
CARRYING_HOOKS = ("select", "encode", "aggregate", "server_correct")


@document_fields
class PersonalModels(NamedTuple):
    """Every client's own model, as a personalised method's ``personal`` hook returns it.

    Attributes:
      variables: the models' variables with leading ``[N]`` (or one unstacked model shared by all); a LoRA
        model's frozen base (the ``frozen`` collection) is one unstacked copy, shared by every client.
      submodel: for sub-model methods, the ``[N]`` neuron mask of the sub-model each client holds
        (None: the full model).
      stacked: False when ``variables`` is one model shared by every client.
    """

    variables: dict
    submodel: Mask | None = None
    stacked: bool = True


@document_fields
class ClientOptimizer(NamedTuple):
    """The clients' local optimizer: an optax transformation at rate 1 (``direction``) and the rate.

    The engine multiplies every local update by the client's rate in one place
    (the engine): ``lr`` × the cohort's ``CohortInfo.lr_scale``
    (replicas that sweep the rate share one round built with ``lr`` 1) × the plan's
    ``ClientPlan.lr_scale`` (a method's own per-client rates).  A method reads the result as
    ``LocalStep.lr`` and ``RoundView.client_lr``, never by multiplying scales itself.
    Build one with :func:`client_sgd`; a plain optax transformation given instead applies its
    own rate, which the engine then cannot tell a method (``lr`` None).

    Attributes:
      direction: an optax ``GradientTransformation`` at rate 1 (its updates point downhill, unscaled).
      lr: the learning rate, or None when ``direction`` applies its own.
      momentum: the SGD momentum (0: none), for methods that read it.
      weight_decay: the L2 weight decay (0: none), for methods that read it.
    """

    direction: Any
    lr: float | None
    momentum: float = 0.0
    weight_decay: float = 0.0


def client_sgd(lr: float, momentum: float = 0.0, weight_decay: float = 0.0) -> ClientOptimizer:
    """SGD with momentum and L2 weight decay (decoupled from the loss) at rate ``lr``.

    The same arithmetic as ``optax.chain(optax.add_decayed_weights(weight_decay), optax.sgd(lr, momentum))``
    bit for bit: ``(-u)·lr`` and ``u·(-lr)`` round alike.

    Args:
      lr: the learning rate (> 0).
      momentum: the momentum coefficient (0: plain SGD).
      weight_decay: the L2 weight decay coefficient (0: none).

    Returns:
      The :class:`ClientOptimizer` to give a run (``Simulation(config, client_optimizer=...)``).

    Examples:
      >>> import fedpartial as fp
      >>> fp.client_sgd(0.05, momentum=0.9).lr
      0.05
    """
    parts = [optax.add_decayed_weights(weight_decay)] if weight_decay else []
    parts.append(optax.sgd(1.0, momentum=momentum or None))
    return ClientOptimizer(direction=optax.chain(*parts), lr=float(lr), momentum=float(momentum),
                           weight_decay=float(weight_decay))


@document_fields
class OptimizerSettings(NamedTuple):
    """The client optimizer's settings a method may read (``MethodContext.client_optimizer``).  The
    learning rate is not here: it may differ per client and per replica (``LocalStep.lr``).

    Attributes:
      momentum: the client optimizer's momentum (0: none).
      weight_decay: the client optimizer's L2 weight decay (0: none).
    """

    momentum: float = 0.0
    weight_decay: float = 0.0


@dataclasses.dataclass(frozen=True)
class MethodContext:
    """Static facts a method may use (hashable; never traced): every hook's first argument ``ctx``.

    Attributes:
      model: the model the run trains (its ``structure``, ``apply``, ``num_classes``, ...).
      num_clients: the population ``N``.
      cohort_size: rows of every cohort ``K``, padding rows included.
      rounds: planned number of rounds, for schedules (None: unknown).
      batch_statistics: 'static' BatchNorm: evaluate with batch statistics.
      padding: the last ``padding`` rows of every cohort are padding clients (never valid) that fill the
        devices the cohort is split over; client groups put them in their last group.
      client_optimizer: the client optimizer's momentum and weight decay (None: a plain optax
        transformation, settings unknown).
    """

    model: ModelLike
    num_clients: int
    cohort_size: int
    rounds: int | None = None
    batch_statistics: bool = False
    padding: int = 0
    client_optimizer: OptimizerSettings | None = None

    @property
    def structure(self) -> ModelStructure:
        """The model's layer structure (``model.structure``): what masks are built against."""
        return self.model.structure

    @property
    def clients_per_round(self) -> int:
        """The clients sampled each round: ``cohort_size`` without the padding rows."""
        return self.cohort_size - self.padding


Objective = Callable[[MethodContext, Any, LocalStep], tuple[jax.Array, LossAux]]


@document_fields
class LocalGraph(NamedTuple):
    """How one client group sees the model during local training (all pure).

    ``extract`` maps any full-shaped variables tree (values, masks, scales) to the
    group's own tree; ``insert(full, part)`` writes a group tree back into a
    full-shaped one; ``prepare(variables, data, batch_statistics)`` turns one
    client's whole local data ``[S, B, ...]`` into the steps' inputs, once per
    round (None: the raw data); ``apply(variables, x, train, example_mask)`` is
    the group's forward pass.  A ``windowed`` graph's ``extract(tree, window)`` and
    ``insert(full, part, window)`` also take a client's window start (``ClientPlan.window``).

    Attributes:
      extract: ``extract(tree[, window])``: a full-shaped tree to the group's own.
      insert: ``insert(full, part[, window])``: a group tree written back into a full-shaped one.
      apply: ``apply(variables, x, train, example_mask)``: the group's forward pass.
      prepare: ``prepare(variables, data, batch_statistics)``: a client's local data to the steps'
        inputs, once per round (None: the raw data).
      windowed: whether ``extract`` and ``insert`` take a window start.
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
      graph: the group's local graph (e.g. ``suffix``).
    """

    name: str
    size: int
    members: tuple[int, ...] | None = None
    graph: LocalGraph | None = None


@document_fields
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
        (:func:`~fedpartial.cohort_rows`), so a run may keep the ``[N]`` state on
        the host or on disk (``--client-state host|disk``); ``personal`` and ``active_clients`` then
        receive numpy arrays.  False: the state stays on the device.
      finetune_epochs: personalised by fine-tuning (FedBABU): each client's own model is the global model
        trained this many epochs on the client's training data (the whole model, cross-entropy, the run's
        client optimizer and batch size) and then evaluated on its held-out split; the driver does it
        (the driver) and does not read ``personal``.  0: no fine-tuning.
      local_passes: how many models a client trains over its local steps in a round, on the same batches
        (Ditto: 2, the global model and then its personal one); the device model counts each client's FLOPs of
        local work, and so its simulated time, this many times.
      asynchronous: the method's hooks after local training are defined on any set of updates, each of one
        client trained on the model of its own moment, so a buffered asynchronous run (``--mode async``;
        docs/async.md) may aggregate them; False: refused there.
      second_order: a hook differentiates the loss twice, forward mode over reverse mode (FedAD's
        Hessian-vector products), which the ``hybrid`` and ``mapped`` convolution lowerings, whose gradient is
        a custom reverse-mode rule, do not support: the round refuses such a model and ``--conv-impl auto``
        leaves them out.
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
    second_order: bool = False


@document_fields
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
      their global value; its key is ``fold_in(update's key, 1)``); ``rewrite_global`` (the new global variables,
      every collection, the frozen base of a LoRA model included, from ``RoundView.new_global_vars`` after the
      server optimizer, e.g. FLoRA folding the round's adapters into the base and starting fresh ones; its key is
      ``fold_in(update's key, 4)``); ``update``; ``metrics``.
    * **outside the round**: ``personal`` (every client's own model) and ``active_clients`` (who may
      still be sampled).

    Optional hooks are None where the method has no such step.

    Attributes:
      name: the method's name (run folders, tables).
      init: ``(ctx, InitView) -> MethodState``, once.
      plan: ``(ctx, RoundView) -> ClientPlan``, per cohort before training.
      client_start: ``(ctx, global_vars, client_state, plan) -> variables``, where a client starts training.
      step_plan: ``(ctx, plan, key, step) -> ClientPlan`` per local step (None: the round's plan).
      objective: ``(ctx, params, LocalStep) -> (loss, LossAux)``, the local loss.
      select: ``(ctx, RoundView) -> Selection``: upload masks and aggregation weights.
      update: ``(ctx, RoundView) -> MethodState`` after the server optimizer.
      metrics: ``(ctx, RoundView) -> {name: array}`` for ``metrics.jsonl`` (None: none).
      groups: ``(ctx) -> ClientGroup…``, how the cohort is split (None: one group).
      personal: ``(ctx, MethodState, global_vars) -> PersonalModels``, every client's own model.
      active_clients: ``(ctx, MethodState) -> [N] bool``, who may still be sampled (None: everyone).
      server_correct: ``(ctx, RoundView) -> params``, a server step other than the aggregate (None: none).
      adapt_model: the model the method trains, made from the run's (None: the run's model).
      summarize: ``(ctx, RoundView) -> [K, ...]``, set as ``RoundView.summary`` (None: none).
      transform_grads: ``(ctx, grads, LocalStep) -> grads`` each step (None: unchanged).
      capabilities: what the method needs of a run, :class:`Capabilities`.
      aggregate: ``(ctx, RoundView) -> (params, received)``, replacing the one formula (None: the formula).
      encode: ``(ctx, RoundView) -> params [K, ...]``, what the server receives (None: ``trained_vars``).
      rewrite_global: ``(ctx, RoundView) -> variables``, the new global variables, every collection, from
        ``RoundView.new_global_vars`` (None: those).

    Examples:
      >>> import fedpartial as fp
      >>> method = fp.make_method("mine")
      >>> method.name, method.aggregate is None
      ('mine', True)
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
    rewrite_global: Callable[[MethodContext, RoundView], dict] | None = None

    def with_capabilities(self, **changes) -> "Method":
        """The same method with some capabilities changed (e.g. a wrapper that needs held-out data).

        Args:
          **changes: :class:`Capabilities` fields and their new values.

        Returns:
          A new :class:`Method`; this one is unchanged.
        """
        return self._replace(capabilities=self.capabilities._replace(**changes))
