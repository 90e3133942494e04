"""FedLDF (layer divergence feedback) and the baselines it is compared with: Random, HDFL, FedADP.

**FedLDF** (docs/decisions.md#fedldf).  Every sampled client trains the whole model from the global
model ``θ^t`` (FedAvg's local training; steps/epochs are the engine's).  Each client
then reports, per layer ``l``, its divergence ``d_{k,l} = ||θ_{k,l} - θ^t_l||₂`` over
all of the layer's parameters flattened (kernel, bias, and the scale/bias of the
BatchNorm that follows it; running statistics are not parameters).  The server
forms the ``[L, K]`` divergence matrix and keeps, in every row, the ``n`` clients
with the largest divergence (ties: lowest client index first — a client's position
in the cohort).  Layer ``l`` of the new global model is the ``n_k``-weighted mean of
layer ``l`` over its ``n`` selected clients, so every layer always has exactly ``n``
contributors; with the 'global' BatchNorm policy a layer's running statistics are
aggregated over the same clients.  ``n = K`` is FedAvg.

Decisions (docs/decisions.md#fedldf where the paper is vague): the feedback is computed against the
previous global model (the one the clients started from); divergence scalars are
float32; a padding client is never selected while a real one is left; the server
optimizer (SGD(1) for the paper) applies to the aggregate as for every method.

**Baselines**, each at the same upload budget as FedLDF (``n/K`` of FedAvg's):

* :func:`random_layers` — per layer, ``n`` clients drawn uniformly at random (the
  server draws them; nothing is fed back).
* :func:`hdfl` — ``n`` clients drawn at random upload their whole model; the others
  upload nothing (all ``K`` still train, as in the paper's comparison).
* :func:`fedadp` — every client uploads, per layer, the ``fraction`` of its output
  neurons with the largest update norm, each with its whole incoming weight column
  (an *unwired* neuron mask); the server averages every element over the clients
  that uploaded it and keeps the global value where nobody did.

**Upload traffic per round** (``M_l``: bytes of layer ``l``'s communicated variables,
``M = Σ_l M_l``: one full model; FedAvg uploads ``K·M``):

* FedLDF: ``Σ_l n·M_l + K·L·4 = (n/K)·(K·M) + 4·K·L`` — the selected layers plus ``L``
  float32 divergence scalars from every client (the feedback).
* Random, HDFL: ``n·M = (n/K)·(K·M)`` exactly; the server's random choice costs no upload.
* FedADP, per client: ``Σ_l c_l·m_l + Σ_l min(4·c_l, ⌈u_l/8⌉)``, with ``u_l`` the layer's
  units, ``c_l = max(1, round(fraction·u_l))`` (halves up) the uploaded neurons and
  ``m_l`` the bytes of one neuron's slice (its kernel column, bias, BatchNorm
  scale/bias, and statistics under the 'global' BatchNorm policy); the second sum is
  the index cost — per layer the cheaper of ``c_l`` int32 indices and a ``u_l``-bit mask.

The paper's Theorem 1 (how far FedLDF's loss can trail FedAvg's) is evaluated by
``benchmarks/fedldf_bound.py``, next to the benchmark that reproduces the paper.
"""

from __future__ import annotations

import jax.numpy as jnp

from fedpartial._src.costs import footprint as costs
from fedpartial._src.core import masks
from fedpartial._src.core.errors import UserError
from fedpartial._src.methods import selection
from fedpartial._src.methods.base import (
    Capabilities,
    InitView,
    Method,
    MethodContext,
    MethodState,
    RoundView,
    Selection,
    make_method,
)
from fedpartial._src.methods.registry import (
    MethodSpec,
    Option,
    check_values,
    in_unit_interval,
    positive_int,
)

#: bytes of one divergence scalar (float32) and of one neuron index (int32)
SCALAR_BYTES = 4
INDEX_BYTES = 4


def _check_n(name: str, n: int):
    """Validates ``n`` now (type, ≥ 1) and against the cohort size when the round is built."""
    check_values(name, (N_OPTION,), n=n)

    def init(ctx: MethodContext, view: InitView) -> MethodState:
        del view
        if n > ctx.clients_per_round:
            raise UserError(f"{name}: n = {n} clients per layer exceeds the cohort size {ctx.clients_per_round}.")
        return MethodState()

    return init


def _cohort_size(view: RoundView) -> int:
    return view.cohort.num_samples.shape[0]


def uploads_per_client(ctx: MethodContext, view: RoundView) -> dict:
    """Per-round metric: how many layers each cohort client uploaded (``[K]``)."""
    del ctx
    return {"layers_uploaded_per_client": jnp.sum(view.selection.upload.layers, axis=-1, dtype=jnp.int32)}


def fedldf(n: int = 4) -> Method:
    """FedLDF: per layer, the ``n`` clients whose layer moved farthest from the global model.

    Args:
      n: clients that upload each layer (``--n``; at most the cohort).

    Returns:
      The :class:`~fedpartial.Method` (``--method fedldf``).
    """
    init, n = _check_n("fedldf", n), int(n)

    def summarize(ctx: MethodContext, view: RoundView):
        # [K, L]: every client's per-layer divergence from the model it started from (the feedback).
        return selection.layer_divergence(ctx.structure, view.trained_vars["params"], view.global_vars["params"]).T

    def divergence(ctx: MethodContext, view: RoundView):
        """``[L, K]``: the engine's summary (a hook called on its own computes it)."""
        return (summarize(ctx, view) if view.summary is None else view.summary).T

    def select(ctx: MethodContext, view: RoundView) -> Selection:
        k, num_layers = _cohort_size(view), ctx.structure.num_layers
        # Per layer (row of the [L, K] divergence matrix), the n largest; ties to the lowest client index.
        chosen = selection.top_n_per_row(divergence(ctx, view), n, view.cohort.valid)
        return Selection(
            upload=masks.from_layers(ctx.structure, chosen.T),  # [K, L]: the layers each client uploads
            weights=view.cohort.num_samples,  # n_k
            extra_upload_bytes=jnp.full((k,), SCALAR_BYTES * num_layers, jnp.int32),  # L float32 each
        )

    def metrics(ctx: MethodContext, view: RoundView) -> dict:
        valid = view.cohort.valid
        mean = jnp.sum(jnp.where(valid, divergence(ctx, view), 0.0), axis=1) / jnp.maximum(jnp.sum(valid), 1)
        return {**uploads_per_client(ctx, view), "mean_divergence_per_layer": mean}

    # The streamed strategy keeps only the [K, L] divergences of the whole cohort, then trains the
    # selected clients again (at most n·L of them) to aggregate their layers.
    return make_method("fedldf", init=init, select=select, metrics=metrics, summarize=summarize,
                       capabilities=Capabilities(streamable="summary", asynchronous=True))


def random_layers(n: int = 4) -> Method:
    """Random: per layer, ``n`` clients drawn uniformly at random by the server (no feedback).

    Args:
      n: clients drawn per layer (``--n``).

    Returns:
      The :class:`~fedpartial.Method` (``--method random``).
    """
    init, n = _check_n("random", n), int(n)

    def select(ctx: MethodContext, view: RoundView) -> Selection:
        k = _cohort_size(view)
        chosen = selection.random_n_per_row(view.key, ctx.structure.num_layers, k, n, view.cohort.valid)
        return Selection(
            upload=masks.from_layers(ctx.structure, chosen.T),
            weights=view.cohort.num_samples,
            extra_upload_bytes=jnp.zeros((k,), jnp.int32),
        )

    return make_method("random", init=init, select=select, metrics=uploads_per_client,
                       capabilities=Capabilities(streamable="summary", asynchronous=True))


def hdfl(n: int = 4) -> Method:
    """HDFL: ``n`` clients drawn at random upload their whole model, the others nothing.

    Args:
      n: clients that upload their whole model (``--n``).

    Returns:
      The :class:`~fedpartial.Method` (``--method hdfl``).
    """
    init, n = _check_n("hdfl", n), int(n)

    def select(ctx: MethodContext, view: RoundView) -> Selection:
        k, num_layers = _cohort_size(view), ctx.structure.num_layers
        uploaders = selection.random_n_per_row(view.key, 1, k, n, view.cohort.valid)[0]  # [K]
        layers = jnp.broadcast_to(uploaders[:, None], (k, num_layers))
        return Selection(
            upload=masks.from_layers(ctx.structure, layers),
            weights=view.cohort.num_samples,
            extra_upload_bytes=jnp.zeros((k,), jnp.int32),
        )

    return make_method("hdfl", init=init, select=select, metrics=uploads_per_client,
                       capabilities=Capabilities(streamable="summary", asynchronous=True))


def index_bytes(units: int, kept: int) -> int:
    """Bytes telling the server which ``kept`` of ``units`` neurons follow: the cheaper of
    ``kept`` int32 indices and a ``units``-bit mask (FedADP names the classifier's too)."""
    return costs.layer_index_bytes(units, kept, INDEX_BYTES)


def fedadp(fraction: float = 0.2) -> Method:
    """FedADP: each client uploads, per layer, its ``fraction`` of neurons with the largest update.

    Args:
      fraction: each layer's share of neurons a client uploads, in (0, 1].

    Returns:
      The :class:`~fedpartial.Method` (``--method fedadp``).
    """
    masks.keep_count(fraction, 1)  # validates the fraction now

    def select(ctx: MethodContext, view: RoundView) -> Selection:
        structure, k = ctx.structure, _cohort_size(view)
        norms = selection.neuron_update_norms(structure, view.trained_vars["params"], view.global_vars["params"])
        chosen = selection.top_fraction_neurons(norms, fraction)  # [K, units_l] per layer
        extra = sum(index_bytes(u, masks.keep_count(fraction, u)) for u in structure.units)
        return Selection(
            upload=masks.unwired(structure, masks.from_neurons(structure, chosen)),  # whole input columns
            weights=view.cohort.num_samples,
            extra_upload_bytes=jnp.full((k,), extra, jnp.int32),
        )

    return make_method("fedadp", select=select, capabilities=Capabilities(asynchronous=True))


N_OPTION = Option("n", int, 4, "FedLDF / Random / HDFL: clients uploading each layer per round", positive_int)
SPECS = (
    MethodSpec("fedldf", fedldf, "Per layer, the n clients whose layer diverged most upload it.", (N_OPTION,)),
    MethodSpec("random", random_layers, "Per layer, n clients drawn at random upload it.", (N_OPTION,)),
    MethodSpec("hdfl", hdfl, "n clients drawn at random upload their whole model.", (N_OPTION,)),
    MethodSpec("fedadp", fedadp, "Each client uploads its fraction of neurons with the largest update.",
               (Option("fraction", float, 0.2, "FedADP: fraction of each layer's neurons a client uploads",
                       in_unit_interval, flag="--adp-fraction"),)),
)
