"""Buffered asynchronous aggregation (FedBuff; FedAsync is a buffer of one): the pure pieces.

The host loop (the simulated clock, who is dispatched, records) is
:mod:`fedpartial._src.experiment.asynchronous`; docs/async.md describes the model.  Here:

* **Dispatch** (:meth:`AsyncRound.dispatch`): ``M`` clients train on the server model of the moment, exactly as
  a synchronous round trains its cohort — the same :class:`~fedpartial._src.engine.program.RoundProgram` pieces
  and the round's own runner (fused, stepwise or debug: vmapped, chunked or one at a time).  Only the end
  differs: :class:`DispatchProgram` returns every client's trained variables, start model, plan, loss and steps
  (:class:`Dispatched`, ``[M]``) instead of aggregating them.
* **The pool** is a stacked :class:`Dispatched` of ``C`` rows (``--concurrency C``) on the device; the host keeps
  each row's arrival time and dispatch version (:mod:`fedpartial._src.experiment.asynchronous`).
  :func:`next_arrivals` picks the next ``M`` arrivals: the top-``M`` of the pool by earliest arrival.
* **The server step** (:meth:`AsyncRound.pure_server_step`): the ``M`` arrived rows become a cohort whose update
  relative to the current global model is their own update scaled by the staleness weight,
  ``θ̃_i = start_i(x) + s(τ_i) · (θ_i − start_i(x_{v_i}))``, and then the *synchronous* round's own
  :meth:`~fedpartial._src.engine.program.RoundProgram.aggregate_and_update` runs on them: faults, the method's
  ``summarize``/``select``/``encode``/``aggregate``, the one formula, ``server_correct``, the server optimizer,
  ``update`` and the metrics.  So the step is ``x ← x + η_g · Σ_i w_i m_i s(τ_i) Δ_i / Σ_i w_i m_i`` per element
  (the formula's weights are the method's ``w_i``, the staleness scales the update only), with no second
  formula.  An update with ``τ_i = 0`` is used as it was received (``s(0) = 1`` for every staleness function),
  so with ``M = C = K``, equal speeds and any staleness the step *is* the synchronous round, bit for bit.

**Staleness** (:func:`parse_staleness`, :func:`staleness_weight`): ``constant`` (1), ``poly:a`` (FedBuff's
``(1 + τ)^-a``, default ``a = 0.5``) or ``hinge:a:b`` (FedAsync's: 1 for ``τ ≤ b``, else ``1 / (a (τ − b) + 1)``).

**Which methods** (:func:`async_refusal`): a method runs asynchronously when its capabilities say
``asynchronous`` (its hooks after training are defined on any set of updates, each of one client): FedAvg,
FedProx, FedLDF and its baselines (their top-n over the buffer), FedADP (each client's top neurons of its
staleness-weighted update), FedPart, FIARSE, the FedSPU/FedDrop family and FedSelect, the personal-layer methods
(FedPer, LG-FedAvg, FedRep, FedBN) and FedBABU, HeteroFL/FedRolex/EmbracingFL width tiers and DepthFL depth tiers
(a client's tier travels with its plan; per-tier loss metrics are by row and mean nothing in a buffer), and
DP-FedAvg around any of these (noise per server step).  A personal part arrives like the rest of the update:
``start(x) + s(τ)·(θ − start)``, and since a client is in flight at most once its own rows have not moved since its
dispatch, so that is its trained personal part with the update scaled by ``s(τ)``.  Refused: methods with a
server correction (FedNova's normaliser, FedDyn's h, FedDST's regrowth, InclusiveFL's transfer are defined over
the synchronous cohort), with SCAFFOLD-style control variates or learned weights over the cohort (SCAFFOLD,
FedDH/FedDHE, FedAD, AFD), with held-out data, Ditto (its ``update`` trains the personal models on the cohort's
data, which arrived updates do not carry) and MOON (its ``update`` keeps each client's last local model, but an
arrived update reaches the hooks as the staleness-weighted model on the current global one, not the model the
client trained).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedpartial._src.core.errors import UserError
from fedpartial._src.core.structure import without_frozen
from fedpartial._src.core.types import ClientPlan, CohortInfo, Method
from fedpartial._src.engine.program import RoundProgram
from fedpartial._src.engine.runners import RUNNERS
from fedpartial._src.engine.runners.base import Runner, jit
from fedpartial._src.engine.runners.fused import Fused
from fedpartial._src.engine.types import Cohort, ServerState, hook_keys

#: what ``--staleness`` accepts, for messages
STALENESS_ALLOWED = "constant, poly[:A] (A ≥ 0, default 0.5) or hinge:A:B (A ≥ 0, B ≥ 0)"
DEFAULT_POLY = 0.5


class Dispatched(NamedTuple):
    """What a dispatched client hands back, ``[M]`` rows (a pool: ``[C]``)."""

    trained: dict  # the client's variables after local training (NaN where it failed: the server step cleans)
    start: dict  # the model it started from (its method's ``client_start`` of the global model at dispatch)
    plan: ClientPlan  # its plan (masks, window, rates), decided at dispatch
    loss: jax.Array  # [M] float32 mean local loss (raw: NaN shows a failed client)
    steps: jax.Array  # [M] int32 real local steps
    client_ids: jax.Array  # [M] int32
    num_samples: jax.Array  # [M] float32
    valid: jax.Array  # [M] bool: a real client (False: a padding row)


def parse_staleness(text: str) -> tuple[str, tuple[float, ...]]:
    """``("constant", ())``, ``("poly", (a,))`` or ``("hinge", (a, b))`` from ``--staleness``; one sentence if bad."""
    kind, _, rest = str(text).strip().partition(":")
    parts = rest.split(":") if rest else []
    try:
        values = tuple(float(p) for p in parts)
    except ValueError:
        values = (-1.0,)
    counts = {"constant": (0,), "poly": (0, 1), "hinge": (2,)}
    if kind not in counts or len(values) not in counts[kind] or any(not (math.isfinite(v) and v >= 0) for v in values):
        raise UserError(f"--staleness {text!r} is not allowed: it must be {STALENESS_ALLOWED}.")
    if kind == "poly" and not values:
        values = (DEFAULT_POLY,)
    return kind, values


def staleness_weight(staleness: tuple[str, tuple[float, ...]], tau):
    """``s(τ)`` element-wise for ``τ`` (an int array of server versions since dispatch; jnp or numpy alike)."""
    kind, params = staleness
    xp = jnp if isinstance(tau, jax.Array) else np
    tau = xp.asarray(tau, xp.float32)
    if kind == "constant":
        return xp.ones_like(tau)
    if kind == "poly":
        return (1.0 + tau) ** -xp.float32(params[0])
    a, b = (xp.float32(p) for p in params)
    return xp.where(tau <= b, xp.float32(1), 1.0 / (a * (tau - b) + 1.0))


def next_arrivals(arrival: np.ndarray, in_flight: np.ndarray, m: int) -> np.ndarray:
    """The slots of the next ``m`` arrivals (fewer when fewer are in flight): the top-``m`` of the pool by
    earliest ``arrival`` time, ties to the lower slot (``[C]`` float64 seconds and bool; host numpy, so the
    simulated clock keeps float64)."""
    times = np.where(in_flight, arrival, np.inf)
    order = np.argsort(times, kind="stable")[:m]
    return order[in_flight[order]]


def async_refusal(method: Method) -> str | None:
    """Why ``method`` cannot run asynchronously (one clause), or None when it can."""
    if not method.capabilities.asynchronous:
        return (f"method {method.name} is not defined on a buffer of asynchronous updates (its Capabilities."
                "asynchronous is off; docs/async.md lists the methods that are), so run it with --mode sync")
    if method.server_correct is not None or method.rewrite_global is not None or method.capabilities.needs_holdout:
        return (f"method {method.name} has a server correction, rewrites the global model or reads held-out data, "
                "which a buffer of asynchronous updates does not give, so run it with --mode sync")
    return None


class DispatchProgram(RoundProgram):
    """A round's program that ends after local training: ``(None, Dispatched)`` instead of the new state and
    metrics (the state is not changed by a dispatch)."""

    def aggregate_and_update(self, state, view, keys, plan, starts, trained, losses, steps):
        del state, keys
        info = view.cohort
        return None, Dispatched(trained, starts, plan, losses, steps, jnp.asarray(info.client_ids, jnp.int32),
                                 jnp.asarray(info.num_samples, jnp.float32), jnp.asarray(info.valid, bool))


def stale_trained(start_now: dict, rows: Dispatched, weight: jax.Array, tau: jax.Array) -> dict:
    """``θ̃ = start_now + s · (θ − start_then)`` per leaf; rows with ``τ = 0`` are ``θ`` as received."""
    def leaf(now, theta, then):
        if not jnp.issubdtype(theta.dtype, jnp.floating):
            return theta
        shape = (-1,) + (1,) * (theta.ndim - 1)
        fresh = jnp.reshape(tau == 0, shape)
        scaled = now + jnp.reshape(weight, shape).astype(theta.dtype) * (theta - then)
        return jnp.where(fresh, theta, scaled)
    return jax.tree.map(leaf, start_now, rows.trained, rows.start)


class AsyncRound:
    """A synchronous round's method, model and optimizers run asynchronously: :meth:`dispatch` trains ``M``
    clients, :meth:`server_step` aggregates ``M`` arrivals from a pool of ``concurrency`` rows.

    ``round``: the :class:`~fedpartial._src.engine.round.FederatedRound` (cohort size ``M``, any strategy but the
    streamed one); ``staleness``: :func:`parse_staleness`'s result.
    """

    def __init__(self, round, concurrency: int, staleness: tuple[str, tuple[float, ...]]):
        if round.strategy.kind == "stream":
            raise UserError(f"the streamed strategy ({round.strategy}) cannot dispatch an asynchronous run's "
                            "clients; use --strategy auto, fused, stepwise or debug.")
        if round.client_state != "device" or round.mesh is not None:
            raise UserError("an asynchronous run keeps the method's per-client state on one device; use "
                            "--client-state device and --devices 1.")
        problem = async_refusal(round.method)
        if problem:
            raise UserError(f"{problem}.")
        self.round, self.concurrency, self.staleness = round, int(concurrency), staleness
        prog = round.program
        self.program = DispatchProgram(
            ctx=prog.ctx, method=prog.method, groups=prog.groups, offsets=prog.offsets, clients=prog.clients,
            strategy=prog.strategy, mesh=prog.mesh, client_state=prog.client_state,
            communicated=prog.communicated, client_optimizer=prog.client_optimizer,
            server_optimizer=prog.server_optimizer, record_decisions=prog.record_decisions)
        self.runner = (_Undonated if prog.strategy.kind == "fused" else RUNNERS[prog.strategy.kind])(self.program)
        self._step = jit(lambda s, rows, tau, k: self.pure_server_step(s, rows, tau, jax.random.wrap_key_data(k)))
        self._take = jax.jit(lambda pool, slots: jax.tree.map(lambda a: a[slots], pool))
        self._put = jax.jit(_put_rows, donate_argnums=(0,))

    @property
    def buffer(self) -> int:
        return self.round.ctx.cohort_size

    def dispatch(self, state: ServerState, cohort: Cohort, key: jax.Array) -> Dispatched:
        """Trains the cohort's clients on ``state`` by the round's runner: their :class:`Dispatched` rows."""
        return self.runner(state, cohort, key)[1]

    def empty_pool(self, state: ServerState, cohort: Cohort, key: jax.Array) -> Dispatched:
        """A pool of ``concurrency`` zero rows shaped as :meth:`dispatch` returns them (nothing trained)."""
        variables = without_frozen(state.variables)  # a LoRA model's base is held once, never in the pool
        plan = jax.eval_shape(self.round.preview, state, cohort, key).plan
        c = self.concurrency
        rows = lambda tree: jax.tree.map(lambda a: jnp.zeros((c, *a.shape), a.dtype), tree)  # noqa: E731
        plan_rows = jax.tree.map(lambda a: jnp.zeros((c, *a.shape[1:]), a.dtype), plan)
        return Dispatched(rows(variables), rows(variables), plan_rows, jnp.zeros(c, jnp.float32),
                          jnp.zeros(c, jnp.int32), jnp.zeros(c, jnp.int32), jnp.zeros(c, jnp.float32),
                          jnp.zeros(c, bool))

    def put(self, pool: Dispatched, rows: Dispatched, slots: np.ndarray) -> Dispatched:
        """The pool with ``rows`` written at ``slots`` (``[M]``; a slot ``≥ C`` drops its row: padding)."""
        return self._put(pool, rows, jnp.asarray(slots, jnp.int32))

    def take(self, pool: Dispatched, slots: np.ndarray) -> Dispatched:
        """``[M]`` rows of the pool at ``slots``."""
        return self._take(pool, jnp.asarray(slots, jnp.int32))

    def server_step(self, state: ServerState, rows: Dispatched, tau: np.ndarray, key: jax.Array):
        """Aggregates the arrived ``rows`` (``[M]``; ``valid`` False for rows that are not arrivals) with staleness
        ``tau`` (``[M]`` server versions since each was dispatched); returns ``(state, metrics)``."""
        return self._step(state, rows, jnp.asarray(tau, jnp.int32), jax.random.key_data(key))

    def pure_server_step(self, state: ServerState, rows: Dispatched, tau: jax.Array, key: jax.Array):
        """The server step as a pure function (module docstring); ``metrics`` as a synchronous round's."""
        prog = self.round.program
        info = CohortInfo(client_ids=rows.client_ids, num_samples=rows.num_samples, valid=rows.valid)
        view = prog.view(state, Cohort(data=None, info=info), key)
        starts = prog.starts(view, rows.plan)
        weight = staleness_weight(self.staleness, tau)
        trained = stale_trained(starts, rows, weight, tau)
        new_state, metrics = prog.aggregate_and_update(state, view, hook_keys(key), rows.plan, starts, trained,
                                                       rows.loss, rows.steps)
        metrics["staleness_weight"] = weight
        return new_state, metrics


class _Undonated(Fused):
    """The fused runner without donating the state (a dispatch leaves it as it is)."""

    def __init__(self, program):
        Runner.__init__(self, program)
        self.round = jit(lambda s, c, k: program.pure_round(s, c, self.wrap_key(k)))


def _put_rows(pool: Any, rows: Any, slots: jax.Array) -> Any:
    return jax.tree.map(lambda p, r: p.at[slots].set(r.astype(p.dtype), mode="drop"), pool, rows)


def pool_bytes(state_variables: dict, concurrency: int) -> int:
    """Bytes of a pool of ``concurrency`` rows: two copies of the variables per row (trained, start), plus
    the small per-row values (plans are masks: at most one byte per unit, not counted here)."""
    per = sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
              for a in jax.tree.leaves(without_frozen(state_variables)))
    return concurrency * (2 * per + 20)
