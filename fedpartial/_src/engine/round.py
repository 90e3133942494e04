"""The federated round: ``(server_state, cohort, key) -> (server_state, metrics)``.

One generic round runs every method::

    plan → per group: client_start → prepare → local steps → select → aggregate (the one formula, or the
         method's own ``aggregate``) → [server_correct] → server optimizer → update → metrics

The round is a pure function (:attr:`FederatedRound.functions`): a user may ``jit`` it,
``lax.scan`` it over rounds or ``vmap`` it over seeds.  The execution strategies
(:mod:`fedpartial._src.engine.strategy`) compute the same thing; each has its runner
(:mod:`fedpartial._src.engine.runners`), which :class:`FederatedRound` picks once, when it is
built, and calls every round.  The pieces the runners share (the view, the plan, every client's
start model, one client's local training, fault cleaning, selection, aggregation, the server's
update and the metrics) are the round's :class:`~fedpartial._src.engine.program.RoundProgram`,
which :class:`FederatedRound` builds and hands to its runner; this module says what they compute.

**Client groups.**  A method may split the cohort into static groups
(:class:`~fedpartial._src.core.types.ClientGroup`, e.g. capacity tiers), laid out one after
another along the client axis.  Each group's local training is compiled for its
own :class:`~fedpartial._src.core.types.LocalGraph` (e.g. only the output-side stages, on
prefix activations prepared once per round); trained variables return to full
shape, so selection, aggregation and update see one ``[K, ...]`` cohort.

**Keys.**  The round key is split into one key per hook (plan, local training,
select, update, metrics).  Client ``k`` trains with ``fold_in(train_key, id_k)``
(its draw does not depend on who else is in the cohort); step ``s`` with that
folded with ``s``.

**Faults.**  After local training each client gets a flag ``finite[k]``: every
trained parameter, BatchNorm statistic and its loss are finite (one reduction per
leaf).  A client that is not finite is from then on treated exactly as a padding
client: the hooks after training (``select``, ``server_correct``, ``update``,
``metrics``) see ``cohort.valid`` False for it, and its ``trained_vars`` are its
start model (loss 0), so no NaN reaches a sum, its weight is 0 and
``scatter_clients`` leaves its state rows alone.  (``plan`` ran before training and
saw it valid.)  It is counted in the metric ``nonfinite_clients``; it still
downloaded and trained (``download_bytes``, ``client_steps`` count it) but uploads
nothing (it reports failure instead of a model).  ``client_loss`` keeps its raw
(NaN) loss.  The metric ``diverged`` is True when every real client failed (the
global model then comes back unchanged: nobody uploaded anything) or the new global
variables are not finite; the round is not undone (that would copy the whole state
every round), :class:`~fedpartial.Simulation` stops the run with a
:class:`~fedpartial.DivergedError` and the last good checkpoint stays.

**Per-client state** (``MethodState.clients``, ``[N, ...]``) is gathered at the
cohort's rows into ``RoundView.client_state`` and written back by the method's
``update`` at ``RoundView.client_rows``.  With ``client_state="host"`` the state
holds only the cohort's ``K`` rows (rows ``0 … K-1``), so the ``[N]`` rows can
live off the device (:mod:`fedpartial._src.experiment.client_state`); the round is the same
function and gives bit-identical results.  Traffic and the other metrics: :mod:`fedpartial._src.engine.metrics`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedpartial._src.core.errors import UserError
from fedpartial._src.core.types import (
    ClientOptimizer,
    InitView,
    Method,
    MethodContext,
    MethodState,
    OptimizerSettings,
    ServerData,
)
from fedpartial._src.engine import checks, graphs
from fedpartial._src.engine import sharding as sharding_lib
from fedpartial._src.engine.client import ClientFns, as_client_optimizer, make_client_fns
from fedpartial._src.engine.program import RoundProgram
from fedpartial._src.engine.runners import RUNNERS
from fedpartial._src.engine.runners.base import count_traces, jit
from fedpartial._src.engine.strategy import Strategy, default_strategy, stream_refusal
from fedpartial._src.engine.types import (
    Cohort,
    LocalInputs,
    RoundFunctions,
    RoundPreview,
    ServerState,
    hook_keys,
)
from fedpartial._src.models.adapter import Model

BN_POLICIES = ("global", "static")


def method_context(model: Model, *, num_clients: int, cohort_size: int,
                   client_optimizer: ClientOptimizer | optax.GradientTransformation, bn_policy: str = "global",
                   rounds: int | None = None, padding: int = 0) -> MethodContext:
    """What a method is told about a round of these settings (:class:`~fedpartial.MethodContext`): the one a
    :class:`FederatedRound` built with them holds, known before it is built (a layout is decided from it)."""
    client_optimizer = as_client_optimizer(client_optimizer)
    settings = None if client_optimizer.lr is None else OptimizerSettings(client_optimizer.momentum,
                                                                          client_optimizer.weight_decay)
    return MethodContext(model=model, num_clients=num_clients, cohort_size=cohort_size, rounds=rounds,
                         batch_statistics=bn_policy == "static", padding=padding, client_optimizer=settings)


def initial_state(method: Method, ctx: MethodContext, server_optimizer: optax.GradientTransformation,
                  key: jax.Array, *, server_data: ServerData | None = None, label_counts: Any = None,
                  execution_times: Any = None) -> ServerState:
    """The initial server state of a round of ``method`` in ``ctx`` (pure; :meth:`FederatedRound.pure_init`).
    Under ``jax.eval_shape`` it gives the state's shapes before any round is built."""
    variables = ctx.model.init_variables(key)
    return ServerState(
        round=jnp.zeros((), jnp.int32),
        variables=variables,
        opt_state=server_optimizer.init(variables["params"]),
        method_state=initial_method_state(method, ctx, variables, key, server_data=server_data,
                                          label_counts=label_counts, execution_times=execution_times),
    )


def initial_method_state(method: Method, ctx: MethodContext, variables: dict, key: jax.Array, *,
                         server_data: ServerData | None = None, label_counts: Any = None,
                         execution_times: Any = None) -> MethodState:
    """The method's initial state for the initial global ``variables`` of :func:`initial_state` (``key``)."""
    return method.init(ctx, InitView(global_vars=variables, key=jax.random.fold_in(key, 1), server_data=server_data,
                                     label_counts=label_counts, execution_times=execution_times))


class FederatedRound:
    """A method bound to a model, optimizers and a strategy.

    ``init(key)`` builds the server state; calling the object runs one round and
    returns ``(state, metrics)`` (device arrays; see
    :func:`~fedpartial.traffic_totals`) by its strategy's ``runner``.
    The pure pieces are :attr:`functions`.  :attr:`trace_count` counts how often the
    jitted pieces were traced (a round with the same shapes must not retrace).

    Args:
      record_decisions: add the round's plan and selection (structured masks, ``[K]``)
        to the metrics under ``decisions`` (off by default; free when off).
      server_data: examples the server holds, handed to the method's ``init``.
      label_counts: ``[N, C]`` every client's training examples per class, handed to the
        method's ``init`` (FedDH's label distributions); None: not known.
      execution_times: ``[N]`` each device's time for a round of full-model local work,
        handed to the method's ``init`` (FedAD); None: no device model.  :meth:`init` takes them too, for a
        caller that counts a step's FLOPs on the built round first.
      devices: split the client axis over devices (fused strategy only): a number ``D``
        of this process's devices, or a :class:`jax.sharding.Mesh` with one axis
        ``'clients'`` (a client mesh; several processes: the
        multi-host mesh).  None or 1: one device.  The cohort size must be a multiple of
        the device count (pad the cohort with padding clients, as
        :class:`~fedpartial.Simulation` does, and say how many in ``padding``).
        The cohort is split over the devices, each device trains its own clients, and the
        server state is replicated (see docs/multihost.md).  A client group whose
        size is not a multiple of the device count trains with copies of its first rows
        added up to one (their results are dropped).
      padding: the last ``padding`` rows of every cohort are padding clients (``valid``
        False), given to the method as ``MethodContext.padding``: a method with client
        groups sizes its groups for the clients actually sampled and puts these rows in
        its last group.
      client_state: where the method's per-client state (``MethodState.clients``, ``[N, ...]``)
        lives.  ``"device"``: in the state, gathered and written back inside the round.
        ``"host"``: off the device (a host store, RAM or
        memory-mapped files): ``init`` leaves it out (``clients`` is ``()``), the caller
        passes each round the cohort's rows ``[K, ...]`` in cohort order in
        ``state.method_state.clients`` and gets them back updated; :meth:`client_state_shapes`
        and :meth:`init_client_rows` build the ``[N]`` store a chunk at a time.  Only for a
        method with ``host_client_state`` (or no per-client state), on one device.
    """

    def __init__(
        self,
        model: Model,
        method: Method,
        *,
        num_clients: int,
        cohort_size: int,
        client_optimizer: ClientOptimizer | optax.GradientTransformation,
        server_optimizer: optax.GradientTransformation | None = None,
        bn_policy: str = "global",
        strategy: Strategy | None = None,
        rounds: int | None = None,
        record_decisions: bool = False,
        server_data: ServerData | None = None,
        label_counts: Any = None,
        execution_times: Any = None,
        devices: int | jax.sharding.Mesh | None = None,
        client_state: str = "device",
        padding: int = 0,
    ):
        if bn_policy not in BN_POLICIES:
            raise ValueError(f"BatchNorm policy {bn_policy!r} is unknown; use one of {BN_POLICIES}.")
        if not 0 <= padding < cohort_size:
            raise ValueError(f"padding {padding} must be between 0 and the cohort size {cohort_size} less one.")
        if not 1 <= cohort_size - padding <= num_clients:  # padding rows may repeat ids (a whole population)
            raise ValueError(f"cohort size {cohort_size - padding} must be between 1 and the population size "
                             f"{num_clients}.")
        #: the model every client trains
        self.model = model
        #: the federated method this round runs
        self.method = method
        client_optimizer = as_client_optimizer(client_optimizer)
        #: what the method is told about the run (:class:`~fedpartial.MethodContext`)
        self.ctx = method_context(model, num_clients=num_clients, cohort_size=cohort_size,
                                  client_optimizer=client_optimizer, bn_policy=bn_policy, rounds=rounds,
                                  padding=padding)
        #: the clients' local optimizer (:class:`~fedpartial.ClientOptimizer`)
        self.client_optimizer = client_optimizer
        #: the optax transformation the server applies to the round's aggregate (plain SGD at 1.0 by default)
        self.server_optimizer = server_optimizer or optax.sgd(1.0)
        #: ``global`` (BatchNorm statistics aggregated like weights) or ``static`` (not tracked)
        self.bn_policy = bn_policy
        #: how the round runs (:class:`~fedpartial.Strategy`; the machine's default when none was given)
        self.strategy = strategy or default_strategy()
        self.record_decisions = record_decisions
        self.server_data = server_data
        self.label_counts = None if label_counts is None else np.asarray(label_counts)
        self.execution_times = None if execution_times is None else np.asarray(execution_times)
        #: the method's client groups (:class:`~fedpartial.ClientGroup`), one per graph the cohort trains
        self.groups = checks.resolve_groups(self)
        checks.check_second_order(self)
        if self.strategy.kind == "stream":
            problem = stream_refusal(method)
            if problem:
                raise UserError(f"{problem}; use the fused, stepwise or debug strategy.")
        #: the client mesh the cohort is split over, or None (one device)
        self.mesh = checks.resolve_mesh(self, devices)
        #: the devices stepwise:1 trains clients on side by side, or None (one device)
        self.step_devices = checks.resolve_step_devices(self, devices)
        self.client_state = checks.resolve_client_state(self, client_state)
        self._client_rows_fns: dict[int, Callable] = {}
        #: each client group's first row in the cohort
        self.offsets = tuple(int(o) for o in np.cumsum([0] + [g.size for g in self.groups])[:-1])
        #: each client group's compiled local training functions
        self.clients: tuple[ClientFns, ...] = tuple(
            make_client_fns(self.ctx, method, client_optimizer, track_batch_stats=bn_policy == "global",
                            graph=g.graph or graphs.whole(model))
            for g in self.groups)
        #: the variable collections clients send and receive (``batch_stats`` only under the global policy)
        self.communicated = ("params", "batch_stats") if bn_policy == "global" else ("params",)
        self._preview = None
        #: the round's pure pieces, which its runner computes a round from
        self.program = RoundProgram(
            ctx=self.ctx, method=method, groups=self.groups, offsets=self.offsets, clients=self.clients,
            strategy=self.strategy, mesh=self.mesh, step_devices=self.step_devices, client_state=self.client_state,
            communicated=self.communicated,
            client_optimizer=client_optimizer, server_optimizer=self.server_optimizer,
            record_decisions=record_decisions)
        # ``functions.round``: ``pure_round`` in a jax.jit that is inlined into whatever traces it (the same
        # computation, e.g. under a user's jit, scan or vmap), so that JAX's trace cache counts its traces
        self._round_fn = jit(self.pure_round, inline=True)
        #: how this round's strategy runs it, picked once
        self.runner = RUNNERS[self.strategy.kind](self.program)

    def client_state_shapes(self) -> Any:
        """``jax.ShapeDtypeStruct`` of every leaf of the method's per-client state ``[N, ...]`` (nothing computed)."""
        return jax.eval_shape(self.pure_init, jax.random.key(0)).method_state.clients

    def init_client_rows(self, key: jax.Array, start: int, size: int, variables: dict, *,
                         execution_times: Any = None) -> Any:
        """Rows ``start … start+size-1`` of the initial per-client state of ``init(key)`` (the same values,
        computed in one jitted call per chunk size: XLA keeps only the slice, e.g. ``size`` copies of a
        broadcast model, not ``[N]``).  ``variables``: ``init(key)``'s global variables (so the model's
        initialisation is not compiled again); ``execution_times``: as :meth:`init` was given."""
        if size not in self._client_rows_fns:
            def rows(key, start, variables, times):
                clients = self._init_method(variables, key, times).clients
                return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, start, size, 0), clients)
            self._client_rows_fns[size] = jax.jit(rows)
        return self._client_rows_fns[size](key, jnp.asarray(start, jnp.int32), variables,
                                           self._times(execution_times))

    def preview(self, state: ServerState, cohort: Cohort, key: jax.Array) -> RoundPreview:
        """The plan and every client's start model that a round with these inputs would use."""
        if self._preview is None:
            program = self.program

            def preview(state, cohort, key):
                view = program.view(state, cohort, key)
                plan = program.plan(view, hook_keys(key))
                return RoundPreview(plan, program.starts(view, plan))
            self._preview = jax.jit(preview)
        return self._preview(state, cohort, key)

    def local_inputs(self, state: ServerState, cohort: Cohort, key: jax.Array) -> tuple[LocalInputs, ...]:
        """Per client group, what its clients' local training reads in a round with these inputs
        (pure, not jitted): e.g. to compile one client's step ahead of time."""
        keys, program = hook_keys(key), self.program
        view = program.view(state, cohort, key)
        plan = program.plan(view, keys)
        rows = program.group_slices(program.starts(view, plan), cohort.data, plan, view.client_state,
                                    program.client_keys(keys, cohort))
        return tuple(LocalInputs(*r, server_state=state.method_state.server) for r in rows)

    @property
    def functions(self) -> RoundFunctions:
        """The pure ``init`` and fused ``round``, for you to jit, scan or vmap (``round`` is ``pure_round`` in a
        jax.jit inlined into whatever traces it, which computes the same; it lets :attr:`trace_count`
        count its traces)."""
        return RoundFunctions(self.pure_init, self._round_fn)

    @property
    def trace_count(self) -> int:
        """How many times the round's jitted pieces were traced: its runner's jitted functions and
        ``functions.round`` (a round with the same shapes must not retrace).  Read from JAX's trace
        cache, outside any traced code."""
        return self.runner.trace_count + count_traces([self._round_fn])

    # ---- state -----------------------------------------------------------------

    def pure_init(self, key: jax.Array, execution_times: Any = None) -> ServerState:
        """The initial server state (pure; ``execution_times``: as :meth:`init` takes them)."""
        return initial_state(self.method, self.ctx, self.server_optimizer, key, server_data=self.server_data,
                             label_counts=self.label_counts, execution_times=self._times(execution_times))

    def _times(self, execution_times: Any) -> Any:
        return self.execution_times if execution_times is None else np.asarray(execution_times)

    def _init_method(self, variables: dict, key: jax.Array, execution_times: Any = None) -> MethodState:
        """The method's initial state for the initial global ``variables`` of ``pure_init(key)``."""
        return initial_method_state(self.method, self.ctx, variables, key, server_data=self.server_data,
                                    label_counts=self.label_counts, execution_times=self._times(execution_times))

    def init(self, key: jax.Array, *, execution_times: Any = None) -> ServerState:
        """The initial server state, computed eagerly (the model's own initialisation, bit for bit)
        with no two leaves sharing a buffer (the fused round donates them).  ``execution_times``: the
        constructor's, given now instead (None: the constructor's)."""
        if self.client_state == "host":
            # The model's initialisation eagerly, as below; the method's jitted so XLA computes no [N]
            # per-client rows (same values: tested).  (Jitting the model's too compiled a conv net's random
            # initialisers for seconds.)
            variables = self.model.init_variables(key)
            times = self._times(execution_times)
            method_state = jax.jit(lambda v, k, t: self._init_method(v, k, t)._replace(clients=()))(variables, key,
                                                                                                   times)
            state = ServerState(round=jnp.zeros((), jnp.int32), variables=variables,
                                opt_state=self.server_optimizer.init(variables["params"]), method_state=method_state)
        else:
            with jax.disable_jit(self.strategy.kind == "debug"):
                state = self.pure_init(key, execution_times)
        seen: set[int] = set()

        def distinct(a):
            if id(a) in seen:
                return a.copy()
            seen.add(id(a))
            return a

        state = jax.tree.map(distinct, state)
        if self.mesh is not None:  # a global array on every device of the mesh (every process computed it)
            state = jax.device_put(state, sharding_lib.replicated(self.mesh))
        return state

    # ---- round -----------------------------------------------------------------

    def __call__(self, state: ServerState, cohort: Cohort, key: jax.Array):
        """Runs one round; returns ``(new_state, metrics)``, device arrays (nothing waits for the device:
        :func:`~fedpartial.traffic_totals` turns the per-layer traffic into int64
        totals on the host)."""
        checks.check_cohort(self, cohort, state)
        return self.runner(state, cohort, key)

    # ---- the whole round, pure ----------------------------------------------------

    def pure_round(self, state: ServerState, cohort: Cohort, key: jax.Array):
        """One whole round as a pure function of arrays (the fused strategy's body,
        :meth:`RoundProgram.pure_round <fedpartial._src.engine.program.RoundProgram.pure_round>`)."""
        return self.program.pure_round(state, cohort, key)
