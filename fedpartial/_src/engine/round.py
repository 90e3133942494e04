"""The federated round: ``(server_state, cohort, key) -> (server_state, metrics)``.

One generic round runs every method::

    plan → per group: client_start → prepare → local steps → select → aggregate
         → [server_correct] → server optimizer → update → metrics

The round is a pure function (:attr:`FederatedRound.functions`): a user may
``jit`` it, ``lax.scan`` it over rounds or ``vmap`` it over seeds.  Three
execution strategies compute the same thing:

* :func:`fused` — the whole round is one jitted function (the server state is
  donated): clients vmapped (or ``lax.map``-ped in chunks of vmapped clients),
  local steps in ``lax.scan``.  Best on accelerators: one launch keeps the
  device busy.
* :func:`stepwise` — the same client step, jitted over a chunk of clients and
  driven by a host loop over steps; plan and aggregation are jitted separately.
  Best on CPUs, where XLA runs a conv step inside ``lax.scan`` and vmapped
  per-client conv weights markedly slower than a loop of jitted steps.
* :func:`debug` — nothing jitted, one client at a time, so an error inside a
  method's hook points at the method's own line.

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
every round), :class:`fedpartial._src.experiment.simulation.Simulation` stops the run with a
:class:`fedpartial._src.core.errors.DivergedError` and the last good checkpoint stays.

**Per-client state** (``MethodState.clients``, ``[N, ...]``) is gathered at the
cohort's rows into ``RoundView.client_state`` and written back by the method's
``update`` at ``RoundView.client_rows``.  With ``client_state="host"`` the state
holds only the cohort's ``K`` rows (rows ``0 … K-1``), so the ``[N]`` rows can
live off the device (:mod:`fedpartial._src.experiment.client_state`); the round is the same
function and gives bit-identical results.

**Traffic** is counted per client and layer (``[K, L]`` int32); totals are summed
on the host in int64 (:func:`traffic_totals`), so they never overflow.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedpartial._src.core import aggregation
from fedpartial._src.engine import graphs
from fedpartial._src.core import masks as masks_lib
from fedpartial._src.engine import sharding as sharding_lib
from fedpartial._src.engine.client import ClientFns, as_client_optimizer, make_client_fns, update_scale
from fedpartial._src.core.types import (
    ClientOptimizer,
    OptimizerSettings,
    Batch,
    ClientGroup,
    ClientPlan,
    CohortInfo,
    Holdout,
    InitView,
    Method,
    MethodContext,
    RoundView,
    ServerData,
)
from fedpartial._src.core.errors import UserError
from fedpartial._src.core.population import gather_clients
from fedpartial._src.models.adapter import Model

BN_POLICIES = ("global", "static")
STRATEGY_KINDS = ("fused", "stepwise", "debug", "stream")

#: metric names the engine writes; a method's ``metrics`` hook may not reuse them
ENGINE_METRICS = ("train_loss", "client_steps", "client_loss", "client_steps_per_client",
                  "upload_bytes_per_layer", "download_bytes_per_layer", "decisions",
                  "upload_bytes", "download_bytes", "upload_bytes_per_client", "download_bytes_per_client",
                  "dropout_neurons", "nonfinite_clients", "diverged")


@dataclasses.dataclass(frozen=True)
class Strategy:
    """How a round executes. Build with :func:`fused`, :func:`stepwise`, :func:`debug` or :func:`streamed`."""

    kind: str
    chunk_size: int | None = None
    unroll: int | bool = 1
    #: the streamed strategy only: each chunk trained by a host loop of jitted steps (the stepwise layout,
    #: fast for conv models on CPU) instead of one jitted ``lax.scan`` over its steps
    stepwise_chunks: bool = False

    def __post_init__(self):
        if self.kind not in STRATEGY_KINDS:
            raise ValueError(f"strategy {self.kind!r} is unknown; use one of {', '.join(STRATEGY_KINDS)}.")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError(f"chunk size {self.chunk_size} must be a positive number of clients.")
        if self.stepwise_chunks and self.kind != "stream":
            raise ValueError(f"stepwise chunks are a choice of the streamed strategy, not of {self.kind!r}.")

    @property
    def name(self) -> str:
        """The strategy's name as ``--strategy`` spells it, without the chunk (e.g. ``stream-stepwise``)."""
        return "stream-stepwise" if self.stepwise_chunks else self.kind

    def __str__(self) -> str:
        return self.name if self.chunk_size is None else f"{self.name}:{self.chunk_size}"


def fused(chunk_size: int | None = None, unroll: int | bool = 1) -> Strategy:
    """Whole round in one jit; ``chunk_size`` clients vmapped at a time (None: all).

    ``unroll`` is passed to the local-step ``lax.scan``: ``True`` unrolls all steps,
    which on CPU lets XLA give convolutions their fast layout (compiles longer).
    """
    return Strategy("fused", chunk_size, unroll)


def stepwise(chunk_size: int = 1) -> Strategy:
    """Host loop over local steps of a jitted step over ``chunk_size`` clients."""
    return Strategy("stepwise", chunk_size)


def streamed(chunk_size: int, stepwise: bool = False) -> Strategy:
    """The cohort ``chunk_size`` clients at a time, folded into running sums of the one formula:
    peak memory O(chunk × model), not O(K × model); only :attr:`Method.streamable` methods.

    ``stepwise``: each chunk is trained by a host loop of jitted steps, as :func:`stepwise` trains
    (``chunk_size`` 1: one client, un-vmapped), instead of one jitted ``lax.scan`` of vmapped steps,
    which on CPU runs conv models several times slower than a plain loop."""
    if chunk_size is None:
        raise ValueError("the streamed strategy needs a chunk size (clients trained at a time).")
    return Strategy("stream", chunk_size, stepwise_chunks=stepwise)


def debug() -> Strategy:
    """Nothing jitted, one client and one step at a time (for finding errors, not speed)."""
    return Strategy("debug")


def default_strategy(platform: str | None = None, model: Model | None = None) -> Strategy:
    """The strategy 'auto' resolves to, by platform and model (README "Throughput" has the measurements).

    * GPU/TPU: ``fused(None)``, the whole cohort vmapped in one jit, for every model (H100: 9-40x a
      plain per-client loop; chunks of 20 were no faster at K = 200).  Cohorts too large to vmap at
      once are the memory rule's business, not this one's.
    * CPU: ``stepwise(1)``, one client at a time, for every model.  ``fedpartial bench --preset quick``
      (2 shared cores, S = 5, B = 16): 1.04-1.48x the plain loop for MLP and LeNet5 at K = 20 and 100,
      0.98x for the CNN at K = 20, where ``fused:20`` measured 0.74-0.95x (MLP) and ``stepwise:20``
      0.22-1.04x; vmapped conv steps run 10-20x slower than a loop of jitted steps, and for dense-only
      models no vmapped or chunked variant beat ``stepwise(1)`` either, so the model does not change
      the choice on CPU today.
    """
    platform = platform or jax.default_backend()
    del model  # measured: the same choice for conv and dense-only models on both platforms
    return stepwise(1) if platform == "cpu" else fused(None)


#: clients per chunk of :func:`bounded_strategy` for a dense-only model on CPU (measured, see there)
DENSE_CPU_CHUNK = 10


def bounded_strategy(clients_that_fit: int, platform: str | None = None, model: Model | None = None) -> Strategy:
    """The streamed strategy 'auto' becomes when the whole cohort does not fit in memory, with at most
    ``clients_that_fit`` (>= 1) clients in flight (``python -m benchmarks.stream_conv``, FedAvg, 2 shared
    CPU cores; README "Bounded memory"):

    * CPU, a model with convolutions: ``stream-stepwise:1``.  CNN at K = 200 (5 steps of 16): 22.5 s a
      round, as ``stepwise:1``, where ``stream-stepwise:10`` took 118-133 s and ``stream:10`` 498-529 s
      (vmapped conv steps are slow on CPU); VGG-9 at K = 100: peak RSS 1.09 GiB against 4.47 GiB.
    * CPU, dense layers only: ``stream-stepwise:C``, C = :data:`DENSE_CPU_CHUNK`.  MLP at K = 200:
      0.6 s a round against 0.7 s for ``stepwise:1``, 0.8 s for ``stream-stepwise:1`` and 1.1 s for
      ``stream:50``; at K = 2,000 (10 steps of 32): 22-24 s as ``stepwise:1``, where chunks of 100
      took 30-33 s and ``stream:1000`` 36-40 s.
    * GPU/TPU: ``stream:C`` with the largest C that fits: the chunk runs as the fused round does.
    """
    if clients_that_fit < 1:
        raise ValueError(f"clients_that_fit {clients_that_fit} must be at least 1.")
    platform = platform or jax.default_backend()
    if platform != "cpu":
        return streamed(clients_that_fit)
    has_conv = model is None or "conv" in model.structure.kinds
    return streamed(1 if has_conv else min(DENSE_CPU_CHUNK, clients_that_fit), stepwise=True)


def parse_strategy(text: str, model: Model | None = None) -> Strategy:
    """'auto', 'fused', 'fused:N' (N clients vmapped at a time), 'fused-unrolled[:N]',
    'stepwise', 'stepwise:N', 'stream:N' (N clients at a time, bounded memory), 'stream-stepwise:N'
    (the same, each chunk trained step by step) or 'debug'.  'auto' is :func:`default_strategy` for
    this platform and ``model``."""
    if text == "auto":
        return default_strategy(model=model)
    if text == "debug":
        return debug()
    kind, _, chunk = text.partition(":")
    streams = ("stream", "stream-stepwise")
    if kind not in ("fused", "fused-unrolled", "stepwise", *streams) or (
            chunk and not (chunk.isdigit() and int(chunk) > 0)) or (kind in streams and not chunk):
        raise ValueError(
            f"strategy {text!r} is not one of 'auto', 'fused', 'fused:N', 'fused-unrolled', "
            "'fused-unrolled:N', 'stepwise', 'stepwise:N', 'stream:N', 'stream-stepwise:N', 'debug' "
            "(N a positive number of clients)."
        )
    size = int(chunk) if chunk else None
    if kind in streams:
        return streamed(size, stepwise=kind == "stream-stepwise")
    if kind == "stepwise":
        return stepwise(size or 1)
    return fused(size, unroll=kind == "fused-unrolled")


class ServerState(NamedTuple):
    """Everything the server carries between rounds."""

    round: jax.Array
    variables: dict  # global {'params', 'batch_stats'}
    opt_state: Any  # server optimizer state
    method_state: Any
    # A scalar that multiplies the server optimizer's updates (the replicas of ``--server-lrs`` carry each
    # replica's server learning rate here, with the optimizer built at rate 1); None: 1, no leaf.
    server_lr_scale: Any = None


#: where a method's per-client state lives (``FederatedRound(client_state=...)``)
CLIENT_STATES = ("device", "host")


def without_clients(state: ServerState) -> ServerState:
    """The state with no per-client rows (``method_state.clients`` is ``()``)."""
    return state._replace(method_state=state.method_state._replace(clients=()))


def with_clients(state: ServerState, clients: Any) -> ServerState:
    """The state holding ``clients`` as its per-client state (e.g. the cohort's rows from the host)."""
    return state._replace(method_state=state.method_state._replace(clients=clients))


@dataclasses.dataclass(frozen=True, eq=False)
class ClientData:
    """A cohort's local data made on demand, some clients at a time (host side; not a pytree).

    ``take(rows)`` returns the :class:`Batch` ``[len(rows), S, B, ...]`` of the cohort
    positions ``rows`` (a client's batches must not depend on which others are taken
    with it); ``spec`` is the whole cohort's :class:`Batch` of ``jax.ShapeDtypeStruct``
    ``[K, S, B, ...]``.  The streamed strategy takes one chunk at a time, so the host
    never holds ``[K, S, B, ...]``; other strategies take every row at once.
    """

    take: Callable[[np.ndarray], Batch]
    spec: Batch

    @classmethod
    def of(cls, data: Batch) -> "ClientData":
        """Rows of an already packed ``[K, ...]`` batch."""
        spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), data)
        return cls(lambda rows: jax.tree.map(lambda a: a[rows], data), spec)


def data_spec(cohort: "Cohort") -> "Cohort":
    """The cohort with :class:`ClientData` replaced by its shapes (for shape-only uses, e.g. FLOP counts)."""
    return cohort._replace(data=cohort.data.spec) if isinstance(cohort.data, ClientData) else cohort


class Cohort(NamedTuple):
    """A round's input: the cohort's local data and who the clients are."""

    data: Batch | ClientData  # [K, S, B, ...]
    info: CohortInfo
    holdout: Holdout | None = None  # [K, H, ...] validation data (early stopping needs it)


class RoundFunctions(NamedTuple):
    """The round as pure functions: ``init(key) -> state``, ``round(state, cohort, key) -> (state, metrics)``."""

    init: Callable[[jax.Array], ServerState]
    round: Callable[[ServerState, Cohort, jax.Array], tuple[ServerState, dict]]


class RoundPreview(NamedTuple):
    plan: ClientPlan  # [K]
    start_vars: dict  # [K, ...]


class LocalInputs(NamedTuple):
    """What one client group's local training reads in a round; rows are the group's clients."""

    start: dict  # [size, ...] each client's start model (full shape)
    data: Batch  # [size, S, B, ...] raw local data (before the group's preparation)
    plan: ClientPlan  # [size] the group's rows of the plan
    client_state: Any  # [size, ...] the group's rows of the method's per-client state
    client_keys: jax.Array  # [size] typed keys: client k trains with fold_in(train key, id_k)
    server_state: Any = ()  # the method's server state, which every local step sees (``LocalStep.server_state``)


class HookKeys(NamedTuple):
    plan: jax.Array
    train: jax.Array
    select: jax.Array
    update: jax.Array
    metrics: jax.Array


def hook_keys(key: jax.Array) -> HookKeys:
    """One key per hook of a round (plan, local training, select, update, metrics)."""
    return HookKeys(*jax.random.split(key, len(HookKeys._fields)))


def cohort_from_packed(packed, client_ids, valid=None, holdout: Holdout | None = None) -> Cohort:
    """Builds a :class:`Cohort` from :class:`fedpartial._src.data.packing.CohortBatches`."""
    k = len(client_ids)
    return Cohort(
        data=Batch(x=packed.x, y=packed.y, example_mask=packed.example_mask, step_mask=packed.step_mask),
        info=CohortInfo(
            client_ids=np.asarray(client_ids, np.int32),
            num_samples=np.asarray(packed.num_samples, np.float32),
            valid=np.ones((k,), bool) if valid is None else np.asarray(valid, bool),
        ),
        holdout=holdout,
    )


def traffic_totals(metrics: dict) -> dict:
    """Host-side int64 traffic from a round's ``[K, L]`` per-layer counts.

    Returns ``upload_bytes`` / ``download_bytes`` (Python ints) and the per-client
    ``upload_bytes_per_client`` / ``download_bytes_per_client`` (int64 arrays).
    """
    out = {}
    fetched = jax.device_get((metrics["upload_bytes_per_layer"], metrics["download_bytes_per_layer"]))
    for way, per_layer in zip(("upload", "download"), fetched):
        per_layer = np.asarray(per_layer, np.int64)
        per_client = per_layer.sum(axis=-1)
        out[f"{way}_bytes_per_client"] = per_client
        out[f"{way}_bytes"] = int(per_client.sum())
    return out


def _rows(tree: Any, start: int, size: int) -> Any:
    """Rows ``start:start+size`` (static) of every leaf."""
    return jax.tree.map(lambda a: a[start:start + size], tree)


def _rows_padded(train: Callable, multiple: int) -> Callable:
    """``train(global_vars, args)`` over rows ``[n, ...]`` for any ``n``: ``args`` are run with copies of
    their first rows added up to a multiple of ``multiple`` (a client group split over devices), and
    only the first ``n`` rows of the results are kept.  Copies, not zeros: every dtype (PRNG keys
    included) and a real client's arithmetic, so nothing in the dropped rows can fail."""

    def padded(global_vars, args):
        n = jax.tree.leaves(args)[0].shape[0]
        extra = -n % multiple
        if not extra:
            return train(global_vars, args)
        rows = jnp.arange(n + extra) % n
        return _rows(train(global_vars, jax.tree.map(lambda a: a[rows], args)), 0, n)

    return padded


def _inexact(a) -> bool:
    return jnp.issubdtype(jnp.result_type(a), jnp.inexact)


def _finite_rows(tree: Any) -> jax.Array:
    """``[K]`` True where every inexact element of client ``k``'s rows is finite (one reduction per leaf)."""
    rows = [jnp.all(jnp.isfinite(a), axis=tuple(range(1, a.ndim))) for a in jax.tree.leaves(tree) if _inexact(a)]
    return functools.reduce(jnp.logical_and, rows)


def _all_finite(tree: Any) -> jax.Array:
    """A scalar: every inexact element of the tree is finite."""
    return functools.reduce(jnp.logical_and, [jnp.all(jnp.isfinite(a)) for a in jax.tree.leaves(tree) if _inexact(a)],
                            jnp.asarray(True))


def _rows_mask(rows: jax.Array, a: jax.Array) -> jax.Array:
    """``[K]`` booleans shaped to broadcast against ``a`` ``[K, ...]``."""
    return rows.reshape((-1,) + (1,) * (a.ndim - 1))


def _clean_faults(trained: dict, losses: jax.Array, starts: dict):
    """``(finite [K], trained, losses)``: a client whose result is not finite gets its start model, loss 0."""
    finite = _finite_rows((trained, losses))
    trained = jax.tree.map(lambda t, s: jnp.where(_rows_mask(finite, t), t, s.astype(t.dtype)), trained, starts)
    return finite, trained, jnp.where(finite, losses, jnp.zeros_like(losses))


def _concat(parts: list) -> Any:
    return parts[0] if len(parts) == 1 else jax.tree.map(lambda *a: jnp.concatenate(a, axis=0), *parts)


class FederatedRound:
    """A method bound to a model, optimizers and a strategy.

    ``init(key)`` builds the server state; calling the object runs one round and
    returns ``(state, metrics)`` (device arrays; see :func:`traffic_totals`).  The pure
    pieces are :attr:`functions`.  ``trace_count`` counts how often the jitted
    pieces were traced (a round with the same shapes must not retrace).

    Args:
      record_decisions: add the round's plan and selection (structured masks, ``[K]``)
        to the metrics under ``decisions`` (off by default; free when off).
      server_data: examples the server holds, handed to the method's ``init``.
      label_counts: ``[N, C]`` every client's training examples per class, handed to the
        method's ``init`` (FedDH's label distributions); None: not known.
      execution_times: ``[N]`` each device's time for a round of full-model local work,
        handed to the method's ``init`` (FedAD); None: no device model.  An attribute:
        a simulation sets it once it has counted a step's FLOPs, before ``init``.
      devices: split the client axis over devices (fused strategy only): a number ``D``
        of this process's devices, or a :class:`jax.sharding.Mesh` with one axis
        ``'clients'`` (:func:`fedpartial._src.engine.sharding.client_mesh`; several processes: the
        multi-host mesh).  None or 1: one device.  The cohort size must be a multiple of
        the device count (pad the cohort with padding clients, as
        :class:`~fedpartial._src.experiment.simulation.Simulation` does, and say how many in ``padding``).
        The cohort is split over the devices, each device trains its own clients, and the
        server state is replicated (see :mod:`fedpartial._src.engine.sharding`).  A client group whose
        size is not a multiple of the device count trains with copies of its first rows
        added up to one (their results are dropped).
      padding: the last ``padding`` rows of every cohort are padding clients (``valid``
        False), given to the method as ``MethodContext.padding``: a method with client
        groups sizes its groups for the clients actually sampled and puts these rows in
        its last group.
      client_state: where the method's per-client state (``MethodState.clients``, ``[N, ...]``)
        lives.  ``"device"``: in the state, gathered and written back inside the round.
        ``"host"``: off the device (:class:`fedpartial._src.experiment.client_state.HostClientState`, RAM or
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
        self.model = model
        self.method = method
        client_optimizer = as_client_optimizer(client_optimizer)
        settings = None if client_optimizer.lr is None else OptimizerSettings(client_optimizer.momentum,
                                                                              client_optimizer.weight_decay)
        self.ctx = MethodContext(model=model, num_clients=num_clients, cohort_size=cohort_size,
                                 rounds=rounds, batch_statistics=bn_policy == "static", padding=padding,
                                 client_optimizer=settings)
        self.client_optimizer = client_optimizer
        self.server_optimizer = server_optimizer or optax.sgd(1.0)
        self.bn_policy = bn_policy
        self.strategy = strategy or default_strategy()
        self.record_decisions = record_decisions
        self.server_data = server_data
        self.label_counts = None if label_counts is None else np.asarray(label_counts)
        self.execution_times = None if execution_times is None else np.asarray(execution_times)
        self.groups = self._resolve_groups()
        if self.strategy.kind == "stream":
            problem = stream_refusal(method)
            if problem:
                raise UserError(f"{problem}; use the fused, stepwise or debug strategy.")
        self.mesh = self._resolve_mesh(devices)
        self.client_state = self._resolve_client_state(client_state)
        self._client_rows_fns: dict[int, Callable] = {}
        self.offsets = tuple(int(o) for o in np.cumsum([0] + [g.size for g in self.groups])[:-1])
        self.clients: tuple[ClientFns, ...] = tuple(
            make_client_fns(self.ctx, method, client_optimizer, track_batch_stats=bn_policy == "global",
                            graph=g.graph or graphs.whole(model))
            for g in self.groups)
        self.communicated = ("params", "batch_stats") if bn_policy == "global" else ("params",)
        self.trace_count = 0
        # Jitted entry points take raw key data: typed key arrays miss jit's fast C++ dispatch
        # path, which costs ~0.2 ms a call — per local step, in the stepwise strategy.
        self._key_impl = None
        if self.mesh is None:
            self._fused = jax.jit(lambda s, c, k: self.pure_round(s, c, self._wrap(k)), donate_argnums=(0,))
        else:  # the outputs replicated too: every process can read the metrics and feed the state back
            everywhere = sharding_lib.replicated(self.mesh)
            self._fused = jax.jit(
                lambda s, c, k: jax.lax.with_sharding_constraint(self.pure_round(s, c, self._wrap(k)), everywhere),
                in_shardings=(everywhere, sharding_lib.cohort_sharding(self.mesh), everywhere), donate_argnums=(0,))
        self._begin = jax.jit(lambda s, c, k: self._begin_round(s, c, self._wrap(k)))
        self._finish = jax.jit(lambda s, c, k, p, l: self._finish_round(s, c, self._wrap(k), p, l))
        self._steps: dict[tuple[int, int | None, bool], Any] = {}
        self._preview = None
        self._stream_fns: dict[str, Any] = {}

    def _resolve_groups(self) -> tuple[ClientGroup, ...]:
        k = self.ctx.cohort_size
        if self.method.groups is None:
            return (ClientGroup("cohort", k),)
        groups = tuple(self.method.groups(self.ctx))
        sizes = [g.size for g in groups]
        if not groups or any(s < 1 for s in sizes) or sum(sizes) != k:
            raise ValueError(
                f"method {self.method.name}: client groups of sizes {sizes} must each hold at least one "
                f"client and add up to the cohort size {k}.")
        for i, g in enumerate(groups):
            sampled = g.size - (self.ctx.padding if i == len(groups) - 1 else 0)  # the padding rows come last
            if g.members is not None and len(g.members) < sampled:
                raise ValueError(
                    f"method {self.method.name}: group {g.name!r} samples {sampled} clients per round "
                    f"from only {len(g.members)} members.")
        return groups

    def _resolve_mesh(self, devices) -> jax.sharding.Mesh | None:
        """The client mesh (None: one device, nothing sharded)."""
        if devices is None or (isinstance(devices, (int, np.integer)) and devices == 1):
            return None
        mesh = devices if isinstance(devices, jax.sharding.Mesh) else sharding_lib.client_mesh(devices)
        d, k = mesh.size, self.ctx.cohort_size
        if mesh.axis_names != (sharding_lib.CLIENT_AXIS,):
            raise ValueError(f"the device mesh must have the one axis {sharding_lib.CLIENT_AXIS!r}, "
                             f"not {mesh.axis_names}.")
        if d > 1 and self.strategy.kind != "fused":
            raise ValueError(f"the {self.strategy.kind} strategy runs on one device; only the fused strategy "
                             f"splits the cohort over {d} devices.")
        if k % d:
            raise ValueError(f"the cohort size {k} must be a multiple of the {d} devices the cohort is split over.")
        return mesh if d > 1 else None

    def _resolve_client_state(self, where: str) -> str:
        if where not in CLIENT_STATES:
            raise ValueError(f"client state {where!r} is unknown; use one of {CLIENT_STATES}.")
        if where == "host" and jax.tree.leaves(self.client_state_shapes()):
            if not self.method.capabilities.host_client_state:
                raise UserError(f"method {self.method.name} reads every client's state in its hooks, so its "
                                "per-client state cannot be kept off the device; keep it on the device.")
            if self.mesh is not None:
                raise UserError(f"per-client state kept on the host runs on one device, not the {self.mesh.size} "
                                "the cohort is split over; use one device.")
            if any(jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key) for a in
                   jax.tree.leaves(self.client_state_shapes())):
                raise UserError(f"method {self.method.name} keeps PRNG keys per client, which the host store "
                                "cannot hold; keep its state on the device.")
        return where

    def client_state_shapes(self) -> Any:
        """``jax.ShapeDtypeStruct`` of every leaf of the method's per-client state ``[N, ...]`` (nothing computed)."""
        return jax.eval_shape(self.pure_init, jax.random.key(0)).method_state.clients

    def init_client_rows(self, key: jax.Array, start: int, size: int) -> Any:
        """Rows ``start … start+size-1`` of the initial per-client state of ``init(key)`` (the same values,
        computed in one jitted call per chunk size: XLA keeps only the slice, e.g. ``size`` copies of a
        broadcast model, not ``[N]``)."""
        if size not in self._client_rows_fns:
            def rows(key, start):
                clients = self.pure_init(key).method_state.clients
                return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, start, size, 0), clients)
            self._client_rows_fns[size] = jax.jit(rows)
        return self._client_rows_fns[size](key, jnp.asarray(start, jnp.int32))

    def preview(self, state: ServerState, cohort: Cohort, key: jax.Array) -> RoundPreview:
        """The plan and every client's start model that a round with these inputs would use."""
        if self._preview is None:
            def preview(state, cohort, key):
                view = self._view(state, cohort, key)
                plan = self._plan(view, hook_keys(key))
                return RoundPreview(plan, self._starts(view, plan))
            self._preview = jax.jit(preview)
        return self._preview(state, cohort, key)

    def local_inputs(self, state: ServerState, cohort: Cohort, key: jax.Array) -> tuple[LocalInputs, ...]:
        """Per client group, what its clients' local training reads in a round with these inputs
        (pure, not jitted): e.g. to compile one client's step ahead of time (:mod:`fedpartial._src.costs.devices`)."""
        keys = hook_keys(key)
        view = self._view(state, cohort, key)
        plan = self._plan(view, keys)
        rows = self._group_slices(self._starts(view, plan), cohort.data, plan, view.client_state,
                                  self._client_keys(keys, cohort))
        return tuple(LocalInputs(*r, server_state=state.method_state.server) for r in rows)

    @property
    def functions(self) -> RoundFunctions:
        """The pure ``init`` and fused ``round`` (not jitted: jit, scan or vmap them yourself)."""
        return RoundFunctions(self.pure_init, self.pure_round)

    # ---- state -----------------------------------------------------------------

    def pure_init(self, key: jax.Array) -> ServerState:
        """The initial server state (pure)."""
        variables = self.model.init_variables(key)
        method_key = jax.random.fold_in(key, 1)
        return ServerState(
            round=jnp.zeros((), jnp.int32),
            variables=variables,
            opt_state=self.server_optimizer.init(variables["params"]),
            method_state=self.method.init(self.ctx, InitView(global_vars=variables, key=method_key,
                                                             server_data=self.server_data,
                                                             label_counts=self.label_counts,
                                                             execution_times=self.execution_times)),
        )

    def init(self, key: jax.Array) -> ServerState:
        """The initial server state, computed eagerly (the model's own initialisation, bit for bit)
        with no two leaves sharing a buffer (the fused round donates them)."""
        if self.client_state == "host":  # jitted so XLA computes no [N] per-client rows (same values: tested)
            state = jax.jit(lambda k: without_clients(self.pure_init(k)))(key)
        else:
            with jax.disable_jit(self.strategy.kind == "debug"):
                state = self.pure_init(key)
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
        :func:`traffic_totals` turns the per-layer traffic into int64 totals on the host)."""
        self._check_cohort(cohort, state)
        if self.strategy.kind == "stream":
            return self._stream_round(state, cohort, key)
        if isinstance(cohort.data, ClientData):  # every other strategy takes the whole cohort's data at once
            cohort = cohort._replace(data=cohort.data.take(np.arange(self.ctx.cohort_size)))
        if self.strategy.kind == "fused":
            state, metrics = self._fused(state, cohort, self._key_data(key))
        elif self.strategy.kind == "stepwise":
            state, metrics = self._stepwise_round(state, cohort, key)
        else:
            state, metrics = self._debug_round(state, cohort, key)
        return state, metrics

    def _wrap(self, key_data: jax.Array) -> jax.Array:
        return jax.random.wrap_key_data(key_data, impl=self._key_impl)

    def _key_data(self, key: jax.Array) -> jax.Array:
        impl = jax.random.key_impl(key)
        if self._key_impl is None:
            self._key_impl = impl
        elif impl != self._key_impl:
            raise ValueError(f"round keys must all be {self._key_impl} keys, got a {impl} key.")
        return jax.random.key_data(key)

    def _check_cohort(self, cohort: Cohort, state: ServerState | None = None) -> None:
        ids = cohort.info.client_ids
        k = np.shape(ids)[0]
        if k != self.ctx.cohort_size:
            raise ValueError(f"cohort has {k} clients but the round was built for {self.ctx.cohort_size}.")
        if state is not None and self.client_state == "host":
            got = {np.shape(a)[0] for a in jax.tree.leaves(state.method_state.clients)}
            if got - {k}:
                raise ValueError(f"with per-client state on the host the state must hold the cohort's {k} rows "
                                 f"(HostClientState.rows(ids)), not {sorted(got)}.")
        x_shape = tuple(data_spec(cohort).data.x.shape[3:])
        if x_shape != self.model.input_shape:
            raise ValueError(
                f"client data has example shape {x_shape} but model {self.model.name} expects "
                f"{self.model.input_shape}."
            )
        if isinstance(ids, np.ndarray):
            valid = np.asarray(cohort.info.valid, bool)
            for g, start in zip(self.groups, self.offsets):
                if g.members is None:
                    continue
                rows = ids[start:start + g.size][valid[start:start + g.size]]
                outside = np.setdiff1d(rows, np.asarray(g.members))
                if outside.size:
                    raise ValueError(
                        f"client {int(outside[0])} sits in group {g.name!r}'s rows of the cohort but is not "
                        f"one of its members; lay the cohort out group by group (Simulation does).")

    def _view(self, state: ServerState, cohort: Cohort, key: jax.Array) -> RoundView:
        ids = jnp.asarray(cohort.info.client_ids)
        rows = jnp.arange(ids.shape[0], dtype=ids.dtype) if self.client_state == "host" else ids
        return RoundView(
            key=key, round=state.round, global_vars=state.variables, method_state=state.method_state,
            client_state=gather_clients(state.method_state.clients, rows),
            cohort=cohort.info, data=cohort.data, holdout=cohort.holdout, client_rows=rows,
        )

    def _plan(self, view: RoundView, keys: HookKeys) -> ClientPlan:
        plan = self.method.plan(self.ctx, view._replace(key=keys.plan))
        if view.cohort.lr_scale is None:
            return plan
        scale = jnp.asarray(view.cohort.lr_scale, jnp.float32)  # a method's own per-client rates compose with it
        return plan._replace(lr_scale=scale if plan.lr_scale is None else plan.lr_scale * scale)

    def _client_lr(self, plan: ClientPlan) -> jax.Array | None:
        """``[K]`` the rate each client trains with (``RoundView.client_lr``), or None when the client optimizer
        is a plain optax transformation whose rate is unknown."""
        if self.client_optimizer.lr is None:
            return None
        scale = update_scale(self.client_optimizer.lr, plan.lr_scale)
        return jnp.broadcast_to(scale, (self.ctx.cohort_size,)) if plan.lr_scale is None else scale

    def _client_keys(self, keys: HookKeys, cohort: Cohort) -> jax.Array:
        return jax.vmap(lambda i: jax.random.fold_in(keys.train, i))(jnp.asarray(cohort.info.client_ids))

    def _starts(self, view: RoundView, plan: ClientPlan) -> dict:
        start = lambda cstate, plan_k: self.method.client_start(self.ctx, view.global_vars, cstate, plan_k)  # noqa: E731
        return jax.vmap(start, axis_size=self.ctx.cohort_size)(view.client_state, plan)

    def _group_slices(self, *trees):
        """Per group, the static rows of each tree (the trees themselves for one group)."""
        if len(self.groups) == 1:
            return [trees]
        return [tuple(_rows(t, start, g.size) for t in trees) for g, start in zip(self.groups, self.offsets)]

    def _finish_round(self, state: ServerState, cohort: Cohort, key: jax.Array, plan: ClientPlan, locals_):
        """Final client results of every group, then selection, aggregation, server optimizer, update."""
        self.trace_count += 1
        view = self._view(state, cohort, key)
        starts = self._starts(view, plan)
        trained, losses, steps = self._final_results(starts, locals_)
        return self._aggregate_and_update(state, view, hook_keys(key), plan, starts, trained, losses, steps)

    def _final_results(self, starts: dict, locals_) -> tuple:
        """Every group's clients' local states ``locals_`` → ``(trained, losses, steps)`` ``[K, ...]``."""
        parts = [jax.vmap(fns.final)(local, start)
                 for fns, local, (start,) in zip(self.clients, locals_, self._group_slices(starts))]
        return tuple(_concat([p[i] for p in parts]) for i in range(3))

    def _aggregate_and_update(self, state, view: RoundView, keys: HookKeys, plan, starts, trained, losses, steps):
        # Faults: a client whose result is not finite is from here on a padding client (valid False) that
        # trained nothing (its start model, loss 0), so select, aggregation, server_correct, update and
        # metrics all see one consistent cohort and no NaN reaches a sum (0 · NaN is NaN).
        sent = view.cohort.valid
        raw_losses = losses
        finite, trained, losses = _clean_faults(trained, losses, starts)
        view = view._replace(cohort=view.cohort._replace(valid=sent & finite))
        view = view._replace(plan=plan, trained_vars=trained, client_loss=losses, start_vars=starts,
                             client_steps=steps, client_lr=self._client_lr(plan))
        view = self._summarize(view)
        selection = self._select(view, keys)
        aggregated, received = aggregation.aggregate(
            self.ctx.structure, state.variables, trained, selection.upload, selection.weights, self.communicated)
        return self._conclude(state, view, keys, selection, aggregated, received, raw_losses, sent)

    def _summarize(self, view: RoundView) -> RoundView:
        """The view with the method's per-client ``summary`` of the trained cohort (if it has one)."""
        if self.method.summarize is None:
            return view
        return view._replace(summary=self.method.summarize(self.ctx, view))

    def _select(self, view: RoundView, keys: HookKeys):
        """The method's selection, with padding and failed clients' weights zeroed."""
        selection = self.method.select(self.ctx, view._replace(key=keys.select))
        return selection._replace(weights=jnp.where(view.cohort.valid, selection.weights, 0.0))

    def _conclude(self, state, view: RoundView, keys: HookKeys, selection, aggregated, received, raw_losses, sent):
        """From the aggregate: server_correct, server optimizer, update, metrics."""
        valid = view.cohort.valid
        losses, steps = view.client_loss, view.client_steps
        view = view._replace(selection=selection, aggregated=aggregated)
        target = aggregated["params"]
        if self.method.server_correct is not None:  # e.g. FedNova, FedDyn: not the plain aggregate
            proposed = self.method.server_correct(self.ctx, view._replace(key=jax.random.fold_in(keys.update, 1)))
            target = jax.tree.map(jnp.where, received, proposed, target)  # nobody uploaded: the global value
        params, opt_state = aggregation.server_update(
            self.server_optimizer, state.opt_state, state.variables["params"], target, received,
            lr_scale=state.server_lr_scale)
        new_vars = {**aggregated, "params": params}
        view = view._replace(new_global_vars=new_vars)
        # The round is flagged (not undone) when every real client failed or the new global model is not
        # finite: keeping the input state would need a lax.cond or a select over the whole state, which
        # copies a method's [N, ...] rows every round (measured: FedSPU, N = 1000, 12 ms -> 245 ms a round).
        diverged = (jnp.any(sent) & ~jnp.any(valid)) | ~_all_finite(new_vars)
        method_state = self.method.update(self.ctx, view._replace(key=keys.update))
        new_state = ServerState(round=state.round + 1, variables=new_vars, opt_state=opt_state,
                                method_state=method_state, server_lr_scale=state.server_lr_scale)
        metrics = self._metrics(view._replace(key=keys.metrics), selection, losses, steps, sent)
        metrics["client_loss"] = raw_losses  # NaN shows which client failed
        metrics["nonfinite_clients"] = jnp.sum(sent & ~valid).astype(jnp.int32)
        metrics["diverged"] = diverged
        return new_state, metrics

    def _metrics(self, view: RoundView, selection, losses, steps, sent=None) -> dict:
        """The engine's metrics.  ``sent``: the clients that really took part (default: the view's
        valid ones); a client excluded as non-finite still downloaded and trained, but uploads nothing."""
        structure, g = self.ctx.structure, view.global_vars
        k = view.cohort.valid.shape[0]
        valid = view.cohort.valid
        sent = valid if sent is None else sent
        download_mask = view.plan.download if view.plan.download is not None else masks_lib.full(structure, (k,))
        if view.plan.download_bytes_per_layer is not None:  # a payload that is not the masked elements
            down = view.plan.download_bytes_per_layer.astype(jnp.int32)
        else:
            down = masks_lib.count_bytes_per_layer(structure, download_mask, g, self.communicated)
        if selection.upload_bytes_per_layer is not None:
            up = selection.upload_bytes_per_layer.astype(jnp.int32)
        else:
            up = masks_lib.count_bytes_per_layer(structure, selection.upload, g, self.communicated)
        # Extra bytes (indices, feedback) belong to no layer: they are added to the first.
        extra_down = view.plan.extra_download_bytes
        if extra_down is not None:
            down = down.at[:, 0].add(extra_down.astype(jnp.int32))
        up = up.at[:, 0].add(selection.extra_upload_bytes.astype(jnp.int32))
        n_valid = jnp.maximum(jnp.sum(valid), 1)
        metrics = {
            "train_loss": jnp.sum(jnp.where(valid, losses, 0.0)) / n_valid,
            "client_steps": jnp.sum(jnp.where(sent, steps, 0)),
            "client_steps_per_client": jnp.where(sent, steps, 0),
            "upload_bytes_per_layer": jnp.where(valid[:, None], up, 0),
            "download_bytes_per_layer": jnp.where(sent[:, None], down, 0),
            "client_loss": losses,
        }
        if view.plan.dropout is not None:  # sub-model clients' kept units, for the device model's FLOPs
            metrics["dropout_neurons"] = view.plan.dropout.neurons
        if self.record_decisions:
            metrics["decisions"] = {"plan": view.plan, "selection": selection}
        if self.method.metrics is not None:
            own = self.method.metrics(self.ctx, view)
            clash = sorted(set(own) & (set(metrics) | set(ENGINE_METRICS)))
            if clash:
                raise ValueError(f"method {self.method.name}: metric {clash[0]!r} is a name the engine writes; "
                                 "choose another.")
            metrics.update(own)
        return metrics

    # ---- fused strategy ----------------------------------------------------------

    def pure_round(self, state: ServerState, cohort: Cohort, key: jax.Array):
        """One whole round as a pure function of arrays (the fused strategy's body)."""
        self.trace_count += 1
        keys = hook_keys(key)
        view = self._view(state, cohort, key)
        plan = self._plan(view, keys)
        client_keys = self._client_keys(keys, cohort)
        num_steps = cohort.data.step_mask.shape[1]
        outs = []
        for fns, (data, plan_g, cstate, ckeys) in zip(
                self.clients, self._group_slices(cohort.data, plan, view.client_state, client_keys)):

            def train_group(shared, args, fns=fns):
                train_one = functools.partial(self._train_one, shared, fns, num_steps)
                if self.strategy.chunk_size is None:
                    return jax.vmap(train_one)(args)
                return jax.lax.map(train_one, args, batch_size=self.strategy.chunk_size)

            args = (data, plan_g, cstate, ckeys)
            if self.mesh is not None:
                # Each device trains its own rows (chunks are per device).  No collectives inside, so the
                # replication check (which would ask every method to mark its scan carries) is off.
                clients = jax.sharding.PartitionSpec(sharding_lib.CLIENT_AXIS)
                train_group = _rows_padded(jax.shard_map(
                    train_group, mesh=self.mesh, in_specs=(jax.sharding.PartitionSpec(), clients),
                    out_specs=clients, check_vma=False), self.mesh.size)
            outs.append(train_group((state.variables, state.method_state.server), args))
        trained, losses, steps = (_concat([o[i] for o in outs]) for i in range(3))
        starts = self._starts(view, plan)  # recomputed, not carried: XLA fuses it into the fault check's select
        return self._aggregate_and_update(state, view, keys, plan, starts, trained, losses, steps)

    def _train_one(self, shared, fns: ClientFns, num_steps: int, args):
        """One client's local training from ``shared`` (the global variables and the method's server state),
        steps in ``lax.scan``: ``(trained, loss, steps)``."""
        global_vars, server_state = shared
        data_k, plan_k, cstate_k, key_k = args
        start = self.method.client_start(self.ctx, global_vars, cstate_k, plan_k)
        inputs = fns.prepare(start, data_k)

        def body(local, xs):
            batch, index = xs
            return fns.step(local, batch, plan_k, global_vars, cstate_k, key_k, index, server_state), None

        local = jax.lax.scan(body, fns.init(start), (inputs, jnp.arange(num_steps)), unroll=self.strategy.unroll)[0]
        return fns.final(local, start)

    # ---- streamed strategy -------------------------------------------------------
    # The cohort runs ``chunk_size`` clients at a time: each chunk is trained (one jitted
    # call, clients vmapped; with stepwise chunks a host loop of jitted steps) and folded
    # into running sums Σ w·m·θ and Σ w·m per collection (aggregation.add_sums), so no
    # [K, model] array ever exists.  "per_client" methods
    # select chunk by chunk (one pass); "summary" methods keep only each client's summary
    # in a first pass, select over the whole cohort, then train again (same keys: the
    # same results) only the clients that upload anything, and sum those.

    def _stream_fn(self, name: str, fn: Callable, donate=()):
        if name not in self._stream_fns:
            self._stream_fns[name] = jax.jit(fn, donate_argnums=donate)
        return self._stream_fns[name]

    def _stream_begin(self, state: ServerState, info: CohortInfo, key):
        """The whole cohort's plan ``[K]`` and client keys (raw ``[K, ...]``); no data is read."""
        self.trace_count += 1
        keys = hook_keys(self._wrap(key))
        cohort = Cohort(data=None, info=info)
        plan = self._plan(self._view(state, cohort, keys.plan), keys)
        return plan, jax.random.key_data(self._client_keys(keys, cohort))

    def _stream_starts(self, state: ServerState, plan, rows, info: CohortInfo, key):
        """One chunk's (cohort positions ``rows`` ``[C]``) view, plan rows and start models."""
        view = self._view(state, Cohort(data=None, info=info), hook_keys(self._wrap(key)).plan)
        plan = jax.tree.map(lambda a: a[rows], plan)
        start = lambda cstate, plan_k: self.method.client_start(self.ctx, state.variables, cstate, plan_k)  # noqa: E731
        return view, plan, jax.vmap(start, axis_size=rows.shape[0])(view.client_state, plan)

    def _stream_chunk_start(self, state: ServerState, plan, ckeys, rows, info: CohortInfo, key, data):
        """Stepwise chunks: what the host loop of steps needs for one chunk, ``(local states with optimizer
        states, prepared inputs or None, plan, client state, raw keys)``, each without the client axis for a
        chunk of one (the un-vmapped step).  ``data``: the chunk's data when the model prepares its inputs."""
        self.trace_count += 1
        view, plan, starts = self._stream_starts(state, plan, rows, info, key)
        fns = self.clients[0]
        inputs = None if data is None else jax.vmap(fns.prepare)(starts, data)
        out = (jax.vmap(fns.init)(starts), inputs, plan, view.client_state, ckeys[rows])
        return out if rows.shape[0] > 1 else jax.tree.map(lambda a: a[0], out)

    def _stream_train(self, state: ServerState, plan, ckeys, rows, info: CohortInfo, data, key):
        """Trains one chunk (cohort positions ``rows`` ``[C]``); a view of it, faults cleaned as in
        :meth:`_aggregate_and_update`, and its raw losses.  With stepwise chunks ``data`` is the chunk's
        local states, already trained by the host loop of steps (:meth:`_stream_round`)."""
        view, plan, starts = self._stream_starts(state, plan, rows, info, key)
        if self.strategy.stepwise_chunks:
            local = data if rows.shape[0] > 1 else jax.tree.map(lambda a: a[None], data)
            trained, losses, steps = jax.vmap(self.clients[0].final)(local, starts)
        else:
            train_one = functools.partial(self._train_one, (state.variables, state.method_state.server),
                                          self.clients[0], data.step_mask.shape[1])
            trained, losses, steps = jax.vmap(train_one)((data, plan, view.client_state, self._wrap(ckeys[rows])))
        finite, trained, clean = _clean_faults(trained, losses, starts)
        view = view._replace(cohort=info._replace(valid=info.valid & finite), plan=plan, trained_vars=trained,
                             client_loss=clean, start_vars=starts, client_steps=steps, client_lr=self._client_lr(plan))
        return self._summarize(view), losses

    def _stream_per_client(self, state, plan, ckeys, rows, info, data, key, sums):
        """One pass of a "per_client" method: train a chunk, select its rows, add them to ``sums``."""
        self.trace_count += 1
        view, raw = self._stream_train(state, plan, ckeys, rows, info, data, key)
        selection = self._select(view, hook_keys(self._wrap(key)))
        sums = aggregation.add_sums(self.ctx.structure, sums, state.variables, view.trained_vars, selection.upload,
                                    selection.weights)
        return sums, (raw, view.client_steps, view.cohort.valid, view.summary, selection)

    def _stream_summaries(self, state, plan, ckeys, rows, info, data, key):
        """First pass of a "summary" method: train a chunk, keep only its per-client summaries."""
        self.trace_count += 1
        view, raw = self._stream_train(state, plan, ckeys, rows, info, data, key)
        return raw, view.client_steps, view.cohort.valid, view.summary

    def _stream_selection(self, state, info, plan, key, valid, losses, steps, summary):
        """The whole cohort's selection from the summaries; ``[K]`` True for clients that upload anything."""
        self.trace_count += 1
        keys = hook_keys(self._wrap(key))
        view = self._view(state, Cohort(data=None, info=info._replace(valid=valid)), keys.plan)
        view = view._replace(plan=plan, client_loss=jnp.where(valid, losses, 0.0), client_steps=steps,
                             summary=summary, client_lr=self._client_lr(plan))
        selection = self._select(view, keys)
        uploads = (selection.weights > 0) & jnp.any(selection.upload.layers, axis=-1)
        return selection, uploads

    def _stream_add(self, state, plan, ckeys, rows, info, data, key, selection, sums):
        """Second pass of a "summary" method: train a chunk again and add its selected parts to ``sums``."""
        self.trace_count += 1
        view, _ = self._stream_train(state, plan, ckeys, rows, info, data, key)
        selection = jax.tree.map(lambda a: a[rows], selection)
        weights = jnp.where(view.cohort.valid, selection.weights, 0.0)
        return aggregation.add_sums(self.ctx.structure, sums, state.variables, view.trained_vars, selection.upload,
                                    weights)

    def _stream_finish(self, state, info, plan, key, sums, selection, raw, steps, valid, summary):
        self.trace_count += 1
        keys = hook_keys(self._wrap(key))
        view = self._view(state, Cohort(data=None, info=info._replace(valid=valid)), keys.plan)
        losses = jnp.where(valid, raw, 0.0)  # a failed client's loss is NaN; 0 for the metrics, as fused
        view = view._replace(plan=plan, client_loss=losses, client_steps=steps, summary=summary,
                             client_lr=self._client_lr(plan))
        aggregated, received = aggregation.finish_sums(state.variables, sums)
        return self._conclude(state, view, keys, selection, aggregated, received, raw, info.valid)

    def _stream_round(self, state: ServerState, cohort: Cohort, key: jax.Array):
        k, c = self.ctx.cohort_size, min(self.strategy.chunk_size, self.ctx.cohort_size)
        source = cohort.data if isinstance(cohort.data, ClientData) else ClientData.of(cohort.data)
        info = jax.tree.map(np.asarray, cohort.info)
        key_data = self._key_data(key)
        plan, ckeys = self._stream_fn("begin", self._stream_begin)(state, info, key_data)
        sums = aggregation.zero_sums(state.variables, self.communicated)

        def chunks(positions):
            """(rows [C] int32, chunk info, chunk data) for every C of ``positions``; the last padded."""
            for lo in range(0, len(positions), c):
                real = positions[lo:lo + c]
                pad = c - len(real)
                rows = np.concatenate([real, np.full(pad, real[0])]).astype(np.int32)
                real_row = np.arange(c) < len(real)
                chunk_info = CohortInfo(info.client_ids[rows].astype(np.int32),
                                        np.where(real_row, info.num_samples[rows], 0).astype(np.float32),
                                        real_row & info.valid[rows].astype(bool))
                data = source.take(real)
                if pad:  # padding clients: no real example or step
                    data = jax.tree.map(lambda a: np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)]), data)
                yield len(real), rows, chunk_info, data

        prepares = self.groups[0].graph is not None and self.groups[0].graph.prepare is not None

        def trained(rows, chunk_info, data):
            """What the chunk's jitted pass takes: its data, or with stepwise chunks its local states trained
            by a host loop of jitted steps, as the stepwise strategy trains (padding steps skipped, a step
            with no padding in the chunk run without masks)."""
            if not self.strategy.stepwise_chunks:
                return data
            full_step = data.step_mask & data.example_mask.all(axis=-1)  # [C, S], on the host
            start = self._stream_fn("chunk_start", self._stream_chunk_start)
            local, inputs, plan_c, cstate_c, key_c = start(state, plan, ckeys, rows, chunk_info, key_data,
                                                           jax.device_put(data) if prepares else None)
            if inputs is None:
                inputs = jax.device_put(data if c > 1 else jax.tree.map(lambda a: a[0], data))
            return self._run_steps(0, c if c > 1 else None, data.step_mask, full_step, local,
                                   (inputs, plan_c, state.variables, cstate_c, key_c, state.method_state.server))

        # Each chunk is dispatched only once the one before it has finished (jax.block_until_ready of its
        # result): the next chunk is still packed while the last one trains, but dispatch never runs ahead,
        # which would keep every chunk's packed data alive at once (O(K) memory; measured 0.5 GiB at K = 10k).
        outs = []
        if self.method.capabilities.streamable == "per_client":
            step = self._stream_fn("per_client", self._stream_per_client, donate=(7,))
            for size, rows, chunk_info, data in chunks(np.arange(k)):
                sums, out = step(state, plan, ckeys, rows, chunk_info, trained(rows, chunk_info, data), key_data,
                                 jax.block_until_ready(sums))
                outs.append((size, out))
            raw, steps, valid, summary, selection = _concat_rows(outs)
        else:
            first = self._stream_fn("summaries", self._stream_summaries)
            for size, rows, chunk_info, data in chunks(np.arange(k)):
                jax.block_until_ready(outs[-1][1] if outs else None)
                outs.append((size, first(state, plan, ckeys, rows, chunk_info, trained(rows, chunk_info, data),
                                        key_data)))
            raw, steps, valid, summary = _concat_rows(outs)
            selection, uploads = self._stream_fn("selection", self._stream_selection)(
                state, info, plan, key_data, valid, raw, steps, summary)
            again = np.flatnonzero(np.asarray(uploads))  # e.g. FedLDF: at most n·L clients
            add = self._stream_fn("add", self._stream_add, donate=(8,))
            for _, rows, chunk_info, data in chunks(again):
                sums = add(state, plan, ckeys, rows, chunk_info, trained(rows, chunk_info, data), key_data,
                           selection, jax.block_until_ready(sums))
        return self._stream_fn("finish", self._stream_finish, donate=(0,))(
            state, info, plan, key_data, sums, selection, raw, steps, valid, summary)

    # ---- stepwise strategy -------------------------------------------------------

    def _begin_round(self, state: ServerState, cohort: Cohort, key: jax.Array):
        """Plans the round; per group, every client's local state (without optimizer state: each chunk
        gets its own when it starts, so ``[K]`` optimizer states never exist), inputs, plan, state and
        key rows.

        A group's inputs are its prepared inputs, its rows of the cohort data when
        there are several groups, or None (one group without preparation: the
        cohort data itself is used, never copied).
        """
        self.trace_count += 1
        keys = hook_keys(key)
        view = self._view(state, cohort, key)
        plan = self._plan(view, keys)
        client_keys = self._client_keys(keys, cohort)
        starts = self._starts(view, plan)
        groups = []
        for fns, group, (start, data, plan_g, cstate, ckeys) in zip(
                self.clients, self.groups,
                self._group_slices(starts, cohort.data, plan, view.client_state, client_keys)):
            if group.graph is not None and group.graph.prepare is not None:
                inputs = jax.vmap(fns.prepare)(start, data)
            else:
                inputs = data if len(self.groups) > 1 else None
            local = jax.vmap(functools.partial(fns.init, optimizer_state=False))(start)
            groups.append((local, inputs, plan_g, cstate, jax.random.key_data(ckeys)))
        return plan, tuple(groups)

    def _step_fn(self, group: int, chunk: int | None, full: bool = False):
        """A jitted step over ``chunk`` clients of ``group`` (None: one client, un-vmapped).

        Signature ``(local, data, s, plan, global_vars, client_state, client_key, server_state) -> local``.
        ``full``: the host knows step ``s`` and every example of its batches are real for every client of
        the chunk, so the step and example masks become constant True.  XLA then drops the select that
        keeps padded steps no-ops (one more read and write of the whole local state) and the masked
        BatchNorm statistics and loss become the plain ones: measured 4–13% of a VGG-9 step on CPU, where
        the full step runs as fast as a plain jitted step.  The same arithmetic up to float reassociation
        (BatchNorm statistics ~1e-6 apart).  Each variant compiles when first needed:
        a later round whose chunk first holds padding compiles the masked variant then (once, not per round).
        """
        if (group, chunk, full) not in self._steps:
            step = self.clients[group].step

            def one_step(local, data, s, plan, global_vars, cstate, ckey_data, server_state):
                self.trace_count += 1
                batch = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, s, axis=0, keepdims=False), data)
                if full:
                    batch = batch._replace(step_mask=jnp.ones((), bool),
                                           example_mask=jnp.ones(batch.example_mask.shape, bool))
                return step(local, batch, plan, global_vars, cstate, self._wrap(ckey_data), s, server_state)

            fn = one_step if chunk is None else jax.vmap(one_step, in_axes=(0, 0, None, 0, None, 0, 0, None))
            self._steps[group, chunk, full] = jax.jit(fn, donate_argnums=(0,))
        return self._steps[group, chunk, full]

    def _run_steps(self, group: int, chunk: int | None, step_mask: np.ndarray, full_step: np.ndarray, local, args):
        """The host loop of one chunk's jitted steps (``args``: the step's data, plan, global variables,
        client state and keys).  ``step_mask``, ``full_step``: the chunk's ``[C, S]`` host masks.  Steps
        after the chunk's last real step are padding: skipped.  A step without any padding in the chunk
        (every step of one client's packed data but a partial last batch) runs without masks."""
        data, *rest = args
        active = np.flatnonzero(step_mask.any(axis=0))
        for s in range(int(active[-1]) + 1 if active.size else 0):
            local = self._step_fn(group, chunk, bool(full_step[:, s].all()))(local, data, s, *rest)
        return local

    def _stepwise_round(self, state: ServerState, cohort: Cohort, key: jax.Array):
        key_data = self._key_data(key)
        cohort, plan, trained = self._stepwise_train(state, cohort, key_data)
        return self._finish(state, cohort, key_data, plan, trained)

    def _stepwise_train(self, state: ServerState, cohort: Cohort, key_data: jax.Array):
        """The stepwise strategy's local training: ``(cohort on the device, plan, per group every client's
        local state)`` (the benchmark times this phase on its own)."""
        step_mask = np.asarray(cohort.data.step_mask)
        # [K, S]: no padding at all (reduced where the mask lives, so device data sends K × S, not K × S × B)
        full_step = step_mask & np.asarray(cohort.data.example_mask.all(axis=-1))
        cohort = jax.device_put(cohort)  # once; chunks below are sliced on the device
        plan, groups = self._begin(state, cohort, key_data)
        trained = []
        for g, (group, offset, (local, inputs, plan_g, cstate, ckeys)) in enumerate(
                zip(self.groups, self.offsets, groups)):
            data = cohort.data if inputs is None else inputs
            chunk = min(self.strategy.chunk_size or 1, group.size)
            for start in range(0, group.size, chunk):
                size = min(chunk, group.size - start)
                # chunk 1 runs the un-vmapped step on one client's slice.
                batched = None if chunk == 1 else size
                # One jitted call takes the chunk out (and gives it fresh optimizer states), one writes
                # it back in place: slicing leaf by leaf on the host costs a dispatch per leaf and client.
                rows_in = (local, data, plan_g, cstate, ckeys)
                init_opt = self.clients[g].init_optimizer
                local_c, data_c, plan_c, cstate_c, key_c = _take(batched, start, rows_in, init_opt)
                chunk_rows = slice(offset + start, offset + start + size)
                local_c = self._run_steps(g, batched, step_mask[chunk_rows], full_step[chunk_rows], local_c,
                                          (data_c, plan_c, state.variables, cstate_c, key_c,
                                           state.method_state.server))
                local = _put(batched, start, local, local_c._replace(opt_state=()))
            trained.append(local)
        return cohort, plan, tuple(trained)

    # ---- debug strategy ----------------------------------------------------------

    def _debug_round(self, state: ServerState, cohort: Cohort, key: jax.Array):
        """The stepwise round with nothing jitted, one client and one step at a time."""
        with jax.disable_jit():
            keys = hook_keys(key)
            view = self._view(state, cohort, key)
            plan = self._plan(view, keys)
            client_keys = self._client_keys(keys, cohort)
            locals_ = []
            for fns, group, offset in zip(self.clients, self.groups, self.offsets):
                results = []
                for k in range(offset, offset + group.size):
                    one = lambda tree: jax.tree.map(lambda a: a[k], tree)  # noqa: B023,E731
                    plan_k, cstate_k = one(plan), one(view.client_state)
                    start = self.method.client_start(self.ctx, state.variables, cstate_k, plan_k)
                    inputs = fns.prepare(start, one(cohort.data))
                    local = fns.init(start)
                    for s in range(int(np.shape(cohort.data.step_mask)[1])):
                        batch = jax.tree.map(lambda a: a[s], inputs)  # noqa: B023
                        local = fns.step(local, batch, plan_k, state.variables, cstate_k, client_keys[k],
                                         jnp.asarray(s), state.method_state.server)
                    results.append(local)
                locals_.append(jax.tree.map(lambda *a: jnp.stack(a), *results))
            return self._finish_round(state, cohort, key, plan, tuple(locals_))


def stream_refusal(method: Method) -> str | None:
    """Why the streamed strategy cannot run ``method`` (one clause), or None when it can."""
    if method.capabilities.streamable not in ("per_client", "summary"):
        return f"method {method.name} needs the whole cohort at once, so it cannot be streamed"
    if method.groups is not None or method.server_correct is not None or method.capabilities.needs_holdout:
        return f"method {method.name} has client groups, a server correction or held-out data, so it cannot be streamed"
    return None


def _concat_rows(parts: list) -> Any:
    """Per-chunk outputs ``(size, tree of [C, ...])`` → one tree of ``[K, ...]`` (padding rows dropped).

    Joined on the host (the rows are per-client scalars and small vectors): an eager ``jnp.concatenate`` of
    one operand per chunk compiles for every new chunk count, in time that grows faster than the count
    (a run's first round, eager against host join: 53.2 → 29.8 s at 1,000 chunks, 204 → 107 s at 3,000)."""
    trees = jax.device_get([tree for _, tree in parts])
    return jax.tree.map(lambda *a: jnp.asarray(np.concatenate([x[:size] for (size, _), x in zip(parts, a)])),
                        *trees)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _take(size: int | None, start, tree, init_optimizer=None):
    """Rows ``start:start+size`` of every leaf (``size`` None: row ``start`` without its axis);
    ``init_optimizer``: gives the first element, the chunk's local states, their optimizer states."""
    if size is None:
        rows = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, start, 0, keepdims=False), tree)
    else:
        rows = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, start, size, 0), tree)
    if init_optimizer is not None:
        first = init_optimizer(rows[0]) if size is None else jax.vmap(init_optimizer)(rows[0])
        rows = (first, *rows[1:])
    return rows


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def _put(size: int | None, start, tree, rows):
    """Writes ``rows`` back at ``start`` (in place: ``tree`` is donated)."""
    def leaf(a, r):
        r = r[None] if size is None else r
        return jax.lax.dynamic_update_slice_in_dim(a, r.astype(a.dtype), start, 0)
    return jax.tree.map(leaf, tree, rows)
