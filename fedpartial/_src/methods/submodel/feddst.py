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

Decisions (where the paper and its code, bibikar/feddst, leave room):

* **Target sparsity and ERK.**  ``sparsity`` s (default 0.8, the paper's headline
  setting) counts kernel weights only (every parameter leaf of rank ≥ 2 that is not
  a normaliser's: Dense and Conv kernels, embeddings; the classifier is treated like
  every other layer).  Densities follow the standard Erdős–Rényi-Kernel rule:
  ``density_l = ε · Σ(kernel dims)/Π(kernel dims)``, ε chosen so that the kept count
  is ``(1 − s)·total``; layers whose density would exceed 1 are fixed dense and ε is
  recomputed for the rest.  (The reference code counts biases into the layer sizes
  and has no dense fix; we do the standard procedure.)
* **Rounding.**  The total kept is ``round_half_up((1 − s) · total)`` exactly; layer
  counts are the floors of ``density_l · size_l`` plus one for the layers with the
  largest fractional parts (largest-remainder apportionment, ties to the kernel
  that comes first in the ``params`` tree), so every round keeps exactly the same
  count per layer.
* **Initial mask**: per kernel, exactly n_l positions drawn uniformly at random
  (``init``'s key folded with the leaf's index).  ``init`` cannot change the model,
  so the global model is dense until the first round's aggregation; clients always
  start from the masked model (``client_start``) and ``personal`` returns it masked.
* **Adjustment rounds**: round ``t`` (0-based, the engine's ``state.round``) adjusts
  when ``(t − 1) mod R_adj = 0`` and ``α_t > 0``, as the reference code (rounds 1,
  1 + R_adj, …; every round when R_adj = 1).  ``T_end`` is the planned number of
  rounds (``MethodContext.rounds``; the reference code defaults to half of it);
  ``α_t = 0`` from ``T_end`` on; with no planned rounds α is not annealed.
* **Prune / regrow** happens once, after local training (the reference adjusts at
  the end of the round's last epoch).  The regrowth gradient is the client's
  cross-entropy gradient on its **last real local batch**, at its trained (masked)
  model, in train mode (BatchNorm on that batch's statistics), as the reference
  recomputes it on the last batch.  Regrowth candidates are the weights that were
  inactive during the round: a weight pruned now is not regrown now (the reference
  may regrow it, reset to zero), so every adjustment moves exactly
  ``k_l = min(⌊α_t · n_l⌋, size_l − n_l)`` weights out and as many in.  Ties (equal
  magnitudes) go to the lower flat index.
* **Votes and re-pruning.**  ``min_votes`` (default 1) counts clients with non-zero
  weight holding the element; 1 is the reference's default 0 (its threshold is
  "more than 0", on n-weighted votes).  Candidates are ranked by |aggregated value|,
  then by votes (regrown weights arrive as zeros: among equal magnitudes, the ones
  more clients regrew win), then by index.  If fewer than n_l elements have enough
  votes (only possible with ``min_votes`` > 1), the layer is filled with the best
  of the others in the same order, so the sparsity is always exact (the reference
  leaves such a layer sparser).  When no client has weight, the mask is unchanged.
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

import math
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedpartial._src.core import masks
from fedpartial._src.core.errors import UserError
from fedpartial._src.core.losses import masked_cross_entropy
from fedpartial._src.methods.base import (
    Batch,
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
from fedpartial._src.models.adapter import Model
from fedpartial._src.core.structure import leaf_paths


class DSTServer(NamedTuple):
    """FedDST's server state: the global mask, shaped like ``params`` (True on dense leaves)."""

    mask: Any


class Layout(NamedTuple):
    """Static facts about the ``params`` leaves (flatten order): which are masked and how many they keep."""

    sparse: tuple[bool, ...]
    counts: tuple[int, ...]  # kept elements per leaf (its size for a dense leaf)


# ---- static: ERK ------------------------------------------------------------------


def erk_densities(shapes: Sequence[Sequence[int]], sparsity: float) -> tuple[float, ...]:
    """Erdős–Rényi-Kernel densities of kernels of ``shapes`` at a total ``sparsity``.

    ``density_l = ε · Σ dims_l / Π dims_l``; a layer whose density would exceed 1 is
    fixed dense and ε is solved again over the others (ε only grows when a layer is
    fixed, so fixing every layer over 1 at once is the same as one at a time).
    """
    sizes = [math.prod(s) for s in shapes]
    raw = [sum(s) / n for s, n in zip(shapes, sizes)]
    dense: set[int] = set()
    eps = 0.0
    while len(dense) < len(sizes):
        budget = (1 - sparsity) * sum(sizes) - sum(sizes[i] for i in dense)
        eps = budget / sum(raw[i] * sizes[i] for i in range(len(sizes)) if i not in dense)
        over = {i for i in range(len(sizes)) if i not in dense and raw[i] * eps > 1}
        if not over:
            break
        dense |= over
    return tuple(1.0 if i in dense else raw[i] * eps for i in range(len(sizes)))


def erk_counts(shapes: Sequence[Sequence[int]], sparsity: float) -> tuple[int, ...]:
    """Kept weights per kernel: ERK densities apportioned so the total is exactly
    ``round_half_up((1 − sparsity) · Σ sizes)`` (largest remainders; ties to the earlier kernel in ``shapes``)."""
    sizes = [math.prod(s) for s in shapes]
    # Snap float noise first (0.2·69 = 13.799…98 must not decide a rounding).
    exact = [round(d * n, 9) for d, n in zip(erk_densities(shapes, sparsity), sizes)]
    counts = [min(int(math.floor(e)), n) for e, n in zip(exact, sizes)]
    total = int(math.floor(round((1 - sparsity) * sum(sizes), 9) + 0.5))
    order = sorted((i for i in range(len(sizes)) if counts[i] < sizes[i]), key=lambda i: (counts[i] - exact[i], i))
    for i in order[:max(total - sum(counts), 0)]:
        counts[i] += 1
    return tuple(counts)


def layout(ctx: MethodContext, params: Any, sparsity: float) -> Layout:
    """Which ``params`` leaves are masked (kernels: leaves with an input axis) and their ERK counts."""
    paths = leaf_paths(params)
    sparse = tuple(ctx.structure.role("params", p).has_input_axis for p, _ in paths)
    kernel_counts = iter(erk_counts([jnp.shape(a) for (_, a), s in zip(paths, sparse) if s], sparsity))
    counts = tuple(next(kernel_counts) if s else int(math.prod(jnp.shape(a))) for (_, a), s in zip(paths, sparse))
    return Layout(sparse=sparse, counts=counts)


# ---- pure array pieces ----------------------------------------------------------------


def cosine_fraction(alpha: float, t: jax.Array, t_end: int | None) -> jax.Array:
    """``α_t = α/2 · (1 + cos(π t / T_end))``, 0 from ``T_end`` on; ``α`` when ``T_end`` is None."""
    if t_end is None:
        return jnp.float32(alpha)
    t = jnp.asarray(t, jnp.float32)
    return jnp.where(t < t_end, alpha / 2 * (1 + jnp.cos(jnp.pi * t / t_end)), 0.0).astype(jnp.float32)


def adjusts(t: jax.Array, every: int) -> jax.Array:
    """Whether round ``t`` (0-based) is an adjustment round: ``(t − 1) mod every = 0``."""
    return jnp.remainder(jnp.asarray(t, jnp.int32) - 1, every) == 0


def _rank(score: jax.Array) -> jax.Array:
    """Each element's position when ``score`` (flat) is sorted ascending; ties: lower index first."""
    order = jnp.argsort(score, stable=True)
    return jnp.zeros(score.shape, jnp.int32).at[order].set(jnp.arange(score.size, dtype=jnp.int32))


def prune_and_regrow(mask: jax.Array, weights: jax.Array, grads: jax.Array, k: jax.Array
                     ) -> tuple[jax.Array, jax.Array]:
    """One kernel of one client: drop the ``k`` active weights of smallest |w|, regrow ``k`` of the
    weights inactive before (largest |g|).  Returns ``(new mask, kept)``; ``kept`` is the mask
    after pruning (regrown weights start at zero, so a client's values are ``where(kept, w, 0)``).
    ``k`` may be traced; it must not exceed the active or the inactive count."""
    m, w, g = mask.reshape(-1), weights.reshape(-1), grads.reshape(-1)
    inf = jnp.array(jnp.inf, jnp.float32)
    pruned = m & (_rank(jnp.where(m, jnp.abs(w).astype(jnp.float32), inf)) < k)
    grown = ~m & (_rank(jnp.where(m, inf, -jnp.abs(g).astype(jnp.float32))) < k)
    kept = m & ~pruned
    return (kept | grown).reshape(mask.shape), kept.reshape(mask.shape)


def aggregate_sparse(values: jax.Array, masks: jax.Array, weights: jax.Array, count: int, min_votes: int
                     ) -> tuple[jax.Array, jax.Array]:
    """One kernel: ``Σ w m θ / Σ w m`` over ``[K, ...]`` clients, then the ``count`` elements to keep.

    Elements held by at least ``min_votes`` clients of non-zero weight come first, by
    |aggregate|, then by votes, then by index.  Returns ``(mask, value)`` with ``value``
    zero outside ``mask``; elements nobody holds aggregate to 0.
    """
    shape = values.shape[1:]
    w = weights.astype(jnp.float32)
    on = masks.astype(jnp.float32)
    den = jnp.tensordot(w, on, axes=(0, 0))
    num = jnp.tensordot(w, jnp.where(masks, values, 0).astype(jnp.float32), axes=(0, 0))
    agg = jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)
    votes = jnp.tensordot((weights > 0).astype(jnp.float32), on, axes=(0, 0)).reshape(-1)
    ineligible = (votes < min_votes).astype(jnp.int32)
    index = jnp.arange(votes.size, dtype=jnp.int32)
    order = jnp.lexsort((index, -votes, -jnp.abs(agg).reshape(-1), ineligible))  # last key first
    keep = jnp.zeros(votes.shape, bool).at[order[:count]].set(True).reshape(shape)
    return keep, jnp.where(keep, agg, 0.0).astype(values.dtype)


def last_batch_grad(model: Model, variables: dict, data: Batch) -> Any:
    """One client's cross-entropy gradient w.r.t. ``params`` on its last real batch ``[S, B, ...]``
    (train mode: BatchNorm normalises with that batch's statistics; padded examples excluded)."""
    steps = data.step_mask.shape[0]
    last = jnp.max(jnp.where(data.step_mask, jnp.arange(steps), 0))
    batch = jax.tree.map(lambda a: a[last], data)

    def loss(p):
        logits, _ = model.apply({**variables, "params": p}, batch.x, True, batch.example_mask)
        return masked_cross_entropy(logits, batch.y, batch.example_mask)

    return jax.grad(loss)(variables["params"])


def _flat(tree) -> list:
    return jax.tree.leaves(tree)


def _unflat(like, leaves) -> Any:
    return jax.tree.unflatten(jax.tree.structure(like), leaves)


def masked(params: Any, mask: Any) -> Any:
    """``params`` with every element outside ``mask`` set to zero."""
    return jax.tree.map(lambda p, m: jnp.where(m, p, jnp.zeros_like(p)), params, mask)


# ---- the method ---------------------------------------------------------------------------


def feddst(sparsity: float = 0.8, adjust_every: int = 10, adjust_fraction: float = 0.05,
           min_votes: int = 1) -> Method:
    """FedDST at kernel ``sparsity`` s, adjusting masks every ``adjust_every`` rounds by an annealed
    ``adjust_fraction`` α; an element needs ``min_votes`` clients to stay in the global mask."""
    check_values("feddst", SPEC.options, sparsity=sparsity, adjust_every=adjust_every,
                 adjust_fraction=adjust_fraction, min_votes=min_votes)

    def init(ctx: MethodContext, view: InitView) -> MethodState:
        if min_votes > ctx.clients_per_round:
            raise UserError(f"FedDST min_votes = {min_votes} must not exceed the cohort size "
                            f"{ctx.clients_per_round}.")
        params = view.global_vars["params"]
        lay = layout(ctx, params, sparsity)
        leaves = []
        for i, (a, sparse, count) in enumerate(zip(_flat(params), lay.sparse, lay.counts)):
            if not sparse:
                leaves.append(jnp.ones(jnp.shape(a), bool))
                continue
            score = jax.random.uniform(jax.random.fold_in(view.key, i), (a.size,))
            leaves.append((_rank(score) < count).reshape(a.shape))
        return MethodState(server=DSTServer(mask=_unflat(params, leaves)))

    def plan(ctx: MethodContext, view: RoundView) -> ClientPlan:
        """Every client trains the global mask's elements (an element mask: pruned weights stay frozen at 0)."""
        k, lay = view.cohort.valid.shape[0], layout(ctx, view.method_state.server.mask, sparsity)
        elements = _unflat(view.method_state.server.mask, [
            jnp.broadcast_to(m, (k, *m.shape)) if sparse else jnp.ones((k,), bool)
            for m, sparse in zip(_flat(view.method_state.server.mask), lay.sparse)])
        return ClientPlan(train=masks.with_elements(masks.full(ctx.structure, (k,)), elements),
                          download_bytes_per_layer=payload(ctx, view))

    def client_start(ctx: MethodContext, global_vars: dict, client_state, plan_k: ClientPlan) -> dict:
        # The global model is dense until the first aggregation: a client starts from it masked.
        return {**global_vars, "params": masked(global_vars["params"], plan_k.train.elements)}

    def schedule(ctx: MethodContext, view: RoundView) -> tuple[jax.Array, jax.Array]:
        """``(α_t, whether this round adjusts)``."""
        fraction = cosine_fraction(adjust_fraction, view.round, ctx.rounds)
        return fraction, adjusts(view.round, adjust_every) & (fraction > 0)

    def client_masks(ctx: MethodContext, view: RoundView) -> tuple[Any, Any]:
        """Every client's mask after this round's (possible) adjustment, and its upload values."""
        mask = view.method_state.server.mask
        lay = layout(ctx, mask, sparsity)
        k = view.cohort.valid.shape[0]
        values = jax.tree.map(lambda t, m: jnp.where(m[None], t, jnp.zeros_like(t)),
                              view.trained_vars["params"], mask)
        fraction, adjust = schedule(ctx, view)

        def readjust():
            variables = {**view.trained_vars, "params": values}
            grads = jax.vmap(lambda v, d: last_batch_grad(ctx.model, v, d))(variables, view.data)
            masks_out, values_out = [], []
            for m, v, g, sparse, count in zip(_flat(mask), _flat(values), _flat(grads), lay.sparse, lay.counts):
                if not sparse:
                    masks_out.append(jnp.broadcast_to(m, v.shape))
                    values_out.append(v)
                    continue
                # Snapped: α_t = 0.25 computes as 0.2499999 in float32 and must still move 1/4.
                moved = jnp.minimum(jnp.floor(fraction * count + 1e-3).astype(jnp.int32), m.size - count)
                new, kept = jax.vmap(lambda vk, gk: prune_and_regrow(m, vk, gk, moved))(v, g)  # noqa: B023
                masks_out.append(new)
                values_out.append(jnp.where(kept, v, jnp.zeros_like(v)))
            return _unflat(mask, masks_out), _unflat(mask, values_out)

        def keep():
            return jax.tree.map(lambda m: jnp.broadcast_to(m, (k, *m.shape)), mask), values

        return jax.lax.cond(adjust, readjust, keep)

    def server_round(ctx: MethodContext, view: RoundView) -> Carry:
        """The new sparse global params, carrying the new global mask to ``update``."""
        mask = view.method_state.server.mask
        lay = layout(ctx, mask, sparsity)
        cm, cv = view.summary
        weights = view.selection.weights
        anyone = jnp.sum(weights) > 0
        new_masks, new_params = [], []
        for m, g, a, cmk, cvk, sparse, count in zip(
                _flat(mask), _flat(view.global_vars["params"]), _flat(view.aggregated["params"]),
                _flat(cm), _flat(cv), lay.sparse, lay.counts):
            if not sparse:
                new_masks.append(m)
                new_params.append(a)
                continue
            keep, value = aggregate_sparse(cvk, cmk, weights, count, min_votes)
            new_masks.append(jnp.where(anyone, keep, m))
            new_params.append(jnp.where(anyone, value, g))
        return Carry(_unflat(mask, new_params), _unflat(mask, new_masks))

    def select(ctx: MethodContext, view: RoundView) -> Selection:
        # Aggregation reads every element (server_correct applies the masks); traffic is the sparse payload.
        # (every element: a client's pruned weights are zeros, which the sparse aggregation needs to see)
        return upload_trained(ctx, view._replace(plan=view.plan._replace(train=None)))._replace(
            upload_bytes_per_layer=payload(ctx, view))

    def update(ctx: MethodContext, view: RoundView) -> MethodState:
        return view.method_state._replace(server=DSTServer(mask=view.carried["server_correct"]))

    def sparse_layer_bytes(ctx: MethodContext, variables: dict) -> np.ndarray:
        """``[L]`` bytes of the sparse model per layer (static): active kernel values + one mask bit per
        kernel element + dense leaves (+ BatchNorm statistics when they are communicated)."""
        params = variables["params"]
        out = np.zeros(ctx.structure.num_layers, np.int64)
        for (path, a), sparse, count in zip(leaf_paths(params), *layout(ctx, params, sparsity)):
            itemsize = jnp.dtype(a.dtype).itemsize
            out[ctx.structure.role("params", path).layer] += count * itemsize + (math.ceil(a.size / 8) if sparse else 0)
        if not ctx.batch_statistics:  # 'global' BatchNorm: running statistics travel too
            for path, a in leaf_paths(variables.get("batch_stats", {})):
                out[ctx.structure.role("batch_stats", path).layer] += a.size * jnp.dtype(a.dtype).itemsize
        return out

    def payload(ctx: MethodContext, view: RoundView) -> jax.Array:
        """``[K, L]`` what each valid client sends (and receives): the sparse model."""
        per_layer = jnp.asarray(sparse_layer_bytes(ctx, view.global_vars), jnp.int32)
        return jnp.where(view.cohort.valid[:, None], per_layer[None, :], 0)

    def metrics(ctx: MethodContext, view: RoundView) -> dict:
        valid = view.cohort.valid
        size = jnp.sum(payload(ctx, view), axis=-1)
        fraction, adjust = schedule(ctx, view)
        cm, _ = view.summary
        mask = view.method_state.server.mask
        moved = sum(jnp.sum((m[None] & ~c).reshape(c.shape[0], -1), axis=1, dtype=jnp.int32)
                    for m, c in zip(_flat(mask), _flat(cm)))
        return {"sparse_upload_bytes": size, "sparse_download_bytes": size, "dst_fraction": fraction,
                "dst_adjusted": adjust, "dst_moved": jnp.where(valid, moved, 0)}

    def personal(ctx: MethodContext, state: MethodState, global_vars: dict) -> PersonalModels:
        return PersonalModels(variables={**global_vars, "params": masked(global_vars["params"], state.server.mask)},
                              stacked=False)

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
