"""FedDST (Bibikar et al., AAAI 2022): federated dynamic sparse training.

The global model is sparse: every kernel carries an element-level binary mask that
keeps a fixed number of its weights; biases and normaliser parameters are dense.
A round::

    clients   start from the masked global model and train it masked (pruned weights
              are zero in the forward pass, get no gradient and stay exactly zero);
              on an adjustment round each client then, per kernel l with n_l active
              weights, prunes the k_l = ⌊α_t · n_l⌋ active weights of smallest |w| and
              regrows the k_l inactive ones of largest |∇L| (at value zero; ⌊·⌋ is
              taken with 10⁻³ slack, so float noise in α_t never costs a weight)
    server    θ = Σ_k n_k m_k θ_k / Σ_k n_k m_k element-wise (m_k: client k's mask);
              an element is a candidate for the new global mask when at least
              ``min_votes`` clients hold it; each kernel keeps exactly its n_l
              candidates of largest |θ| (re-pruning); θ is zero outside the new mask

with ``α_t = α/2 · (1 + cos(π t / T_end))``.

The static ERK layout and the sparse payload live in
:mod:`fedpartial._src.methods.submodel.erk` (decisions: target sparsity and ERK,
rounding), prune/regrow and the sparse aggregation in
:mod:`fedpartial._src.methods.submodel.sparse` (decisions: prune/regrow, votes and
re-pruning).

Decisions (where the paper and its code, bibikar/feddst, leave room):

* **Initial mask**: per kernel, exactly n_l positions drawn uniformly at random
  (``init``'s key folded with the leaf's index).  ``init`` cannot change the model,
  so the global model is dense until the first round's aggregation; clients always
  start from the masked model (``client_start``) and ``personal`` returns it masked.
* **Adjustment rounds**: round ``t`` (0-based, the engine's ``state.round``) adjusts
  when ``(t − 1) mod R_adj = 0`` and ``α_t > 0``, as the reference code (rounds 1,
  1 + R_adj, …; every round when R_adj = 1).  ``T_end`` is the planned number of
  rounds (``MethodContext.rounds``; the reference code defaults to half of it);
  ``α_t = 0`` from ``T_end`` on; with no planned rounds α is not annealed.
* **Where the masks live.**  The global mask is each client's train mask, at the
  engine's element level (``Mask.elements``: the kernels sparse, the dense leaves on),
  so a pruned weight, zero from ``client_start``, stays frozen at zero — its value and
  its optimizer state — and the forward pass needs no masking of its own.  The
  clients' adjusted masks are computed once a round after training (``summarize``,
  ``RoundView.summary``), read by ``server_correct`` (the aggregation) and ``metrics``;
  ``server_correct`` hands the new global mask on to ``update`` (``Carry``), which keeps
  it in ``MethodState.server``.
* **Server optimizer.**  ``server_correct`` returns the sparse aggregate.  With the
  default server SGD(1) the new global model is exactly zero outside the new mask;
  a stateful server optimizer (momentum, Adam) may leave non-zeros there, which the
  clients never see (they start from the masked model).
* **Traffic.**  Each direction carries the sparse model — active kernel values, one
  bit per kernel element for the mask, dense leaves (and BatchNorm statistics when
  communicated) — given to the engine per layer (``ClientPlan.download_bytes_per_layer``,
  ``Selection.upload_bytes_per_layer``), so ``upload_bytes``, ``download_bytes`` and
  the simulated time count it; it is also reported per client as
  ``sparse_upload_bytes`` and ``sparse_download_bytes``.
  Each round also reports ``dst_fraction`` (α_t), ``dst_adjusted`` and
  ``dst_moved`` (``[K]`` weights each client pruned, and regrew).
* **Not built in:** the reference's growing sparsity schedule (``--final-sparsity``),
  its ``--remember-old`` option and fp16 uploads.  FLOPs are counted dense.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedpartial._src.core import masks
from fedpartial._src.core.errors import UserError
from fedpartial._src.core.structure import with_frozen
from fedpartial._src.methods.base import (
    Carry,
    ClientPlan,
    InitView,
    Method,
    MethodContext,
    MethodState,
    PersonalModels,
    RoundView,
    Selection,
    make_method,
    upload_trained,
)
from fedpartial._src.methods.registry import MethodSpec, Option, check_values, in_unit_interval, positive_int, rate
from fedpartial._src.methods.submodel.erk import layout, sparse_layer_bytes
from fedpartial._src.methods.submodel.sparse import (
    adjust_leaves,
    aggregate_leaves,
    cohort_elements,
    last_batch_grad,
    masked,
    moved_counts,
    random_mask,
)


class DSTServer(NamedTuple):
    """FedDST's server state: the global mask, shaped like ``params`` (True on dense leaves)."""

    mask: Any


# ---- the schedule -------------------------------------------------------------------------


def cosine_fraction(alpha: float, t: jax.Array, t_end: int | None) -> jax.Array:
    """``α_t = α/2 · (1 + cos(π t / T_end))``, 0 from ``T_end`` on; ``α`` when ``T_end`` is None."""
    if t_end is None:
        return jnp.float32(alpha)
    t = jnp.asarray(t, jnp.float32)
    return jnp.where(t < t_end, alpha / 2 * (1 + jnp.cos(jnp.pi * t / t_end)), 0.0).astype(jnp.float32)


def adjusts(t: jax.Array, every: int) -> jax.Array:
    """Whether round ``t`` (0-based) is an adjustment round: ``(t − 1) mod every = 0``."""
    return jnp.remainder(jnp.asarray(t, jnp.int32) - 1, every) == 0


# ---- the method ---------------------------------------------------------------------------


def client_start(ctx: MethodContext, global_vars: dict, client_state, plan_k: ClientPlan) -> dict:
    """The global model is dense until the first aggregation: a client starts from it masked."""
    return {**global_vars, "params": masked(global_vars["params"], plan_k.train.elements)}


def update(ctx: MethodContext, view: RoundView) -> MethodState:
    """The new global mask, carried from ``server_correct``."""
    return view.method_state._replace(server=DSTServer(mask=view.carried["server_correct"]))


def personal(ctx: MethodContext, state: MethodState, global_vars: dict) -> PersonalModels:
    """The global model, masked."""
    return PersonalModels(variables={**global_vars, "params": masked(global_vars["params"], state.server.mask)},
                          stacked=False)


def feddst(sparsity: float = 0.8, adjust_every: int = 10, adjust_fraction: float = 0.05,
           min_votes: int = 1) -> Method:
    """FedDST at kernel ``sparsity`` s, adjusting masks every ``adjust_every`` rounds by an annealed
    ``adjust_fraction`` α; an element needs ``min_votes`` clients to stay in the global mask.

    Args:
      sparsity: the share of every kernel's elements pruned, in [0, 1).
      adjust_every: rounds between mask adjustments.
      adjust_fraction: the share α of kept elements pruned and regrown at an adjustment (annealed).
      min_votes: clients that must keep an element for it to stay in the global mask.

    Returns:
      The :class:`~fedpartial.Method` (``--method feddst``).
    """
    check_values("feddst", SPEC.options, sparsity=sparsity, adjust_every=adjust_every,
                 adjust_fraction=adjust_fraction, min_votes=min_votes)

    def init(ctx: MethodContext, view: InitView) -> MethodState:
        if min_votes > ctx.clients_per_round:
            raise UserError(f"FedDST min_votes = {min_votes} must not exceed the cohort size "
                            f"{ctx.clients_per_round}.")
        params = view.global_vars["params"]
        return MethodState(server=DSTServer(mask=random_mask(params, layout(ctx, params, sparsity), view.key)))

    def plan(ctx: MethodContext, view: RoundView) -> ClientPlan:
        """Every client trains the global mask's elements (an element mask: pruned weights stay frozen at 0)."""
        k, mask = view.cohort.valid.shape[0], view.method_state.server.mask
        elements = cohort_elements(mask, layout(ctx, mask, sparsity), k)
        return ClientPlan(train=masks.with_elements(masks.full(ctx.structure, (k,)), elements),
                          download_bytes_per_layer=payload(ctx, view))

    def schedule(ctx: MethodContext, view: RoundView) -> tuple[jax.Array, jax.Array]:
        """``(α_t, whether this round adjusts)``."""
        fraction = cosine_fraction(adjust_fraction, view.round, ctx.rounds)
        return fraction, adjusts(view.round, adjust_every) & (fraction > 0)

    def client_masks(ctx: MethodContext, view: RoundView) -> tuple[Any, Any]:
        """Every client's mask after this round's (possible) adjustment, and its upload values."""
        mask = view.method_state.server.mask
        k = view.cohort.valid.shape[0]
        values = jax.tree.map(lambda t, m: jnp.where(m[None], t, jnp.zeros_like(t)),
                              view.trained_vars["params"], mask)
        fraction, adjust = schedule(ctx, view)

        def readjust():
            variables = {**view.trained_vars, "params": values}
            grads = jax.vmap(lambda v, d: last_batch_grad(ctx.model, with_frozen(v, view.global_vars), d))(
                variables, view.data)
            return adjust_leaves(mask, values, grads, layout(ctx, mask, sparsity), fraction)

        def keep():
            return jax.tree.map(lambda m: jnp.broadcast_to(m, (k, *m.shape)), mask), values

        return jax.lax.cond(adjust, readjust, keep)

    def server_round(ctx: MethodContext, view: RoundView) -> Carry:
        """The new sparse global params, carrying the new global mask to ``update``."""
        mask = view.method_state.server.mask
        cm, cv = view.summary
        params, new_mask = aggregate_leaves(mask, view.global_vars["params"], view.aggregated["params"], cm, cv,
                                            view.selection.weights, layout(ctx, mask, sparsity), min_votes)
        return Carry(params, new_mask)

    def select(ctx: MethodContext, view: RoundView) -> Selection:
        # Aggregation reads every element (server_correct applies the masks); traffic is the sparse payload.
        # (every element: a client's pruned weights are zeros, which the sparse aggregation needs to see)
        return upload_trained(ctx, view._replace(plan=view.plan._replace(train=None)))._replace(
            upload_bytes_per_layer=payload(ctx, view))

    def payload(ctx: MethodContext, view: RoundView) -> jax.Array:
        """``[K, L]`` what each valid client sends (and receives): the sparse model."""
        per_layer = jnp.asarray(sparse_layer_bytes(ctx, view.global_vars, sparsity), jnp.int32)
        return jnp.where(view.cohort.valid[:, None], per_layer[None, :], 0)

    def metrics(ctx: MethodContext, view: RoundView) -> dict:
        valid = view.cohort.valid
        size = jnp.sum(payload(ctx, view), axis=-1)
        fraction, adjust = schedule(ctx, view)
        moved = moved_counts(view.method_state.server.mask, view.summary[0])
        return {"sparse_upload_bytes": size, "sparse_download_bytes": size, "dst_fraction": fraction,
                "dst_adjusted": adjust, "dst_moved": jnp.where(valid, moved, 0)}

    # the clients' adjusted masks are computed once a round, after training (summarize: client k's row depends
    # on client k only), and read by server_correct and metrics
    return make_method("feddst", init=init, plan=plan, client_start=client_start, summarize=client_masks,
                       select=select, update=update, metrics=metrics, personal=personal,
                       server_correct=server_round)


SPEC = MethodSpec(
    "feddst", feddst,
    "Dynamic sparse training: ERK element masks, clients prune/regrow, server votes and re-prunes.",
    options=(
        Option("sparsity", float, 0.8, "FedDST: fraction of kernel weights pruned (ERK per layer)", rate),
        Option("adjust_every", int, 10, "FedDST: rounds between mask adjustments R_adj", positive_int),
        Option("adjust_fraction", float, 0.05, "FedDST: fraction α of active weights moved (cosine-annealed)",
               in_unit_interval),
        Option("min_votes", int, 1, "FedDST: clients that must hold a weight for it to stay in the mask",
               positive_int),
    ))
