"""The round's metrics: what the engine writes every round, and its traffic totals on the host.

**Traffic** is counted per client and layer (``[K, L]`` int32) inside the round; :func:`traffic_totals`
sums it on the host in int64, so it never overflows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fedpartial._src.core import masks as masks_lib
from fedpartial._src.core.types import Method, MethodContext, RoundView

#: metric names the engine writes; a method's ``metrics`` hook may not reuse them
ENGINE_METRICS = ("train_loss", "client_steps", "client_loss", "client_steps_per_client",
                  "upload_bytes_per_layer", "download_bytes_per_layer", "decisions",
                  "upload_bytes", "download_bytes", "upload_bytes_per_client", "download_bytes_per_client",
                  "dropout_neurons", "trained_density", "trained_nothing", "nonfinite_clients", "diverged")


def planned_download(structure, plan, global_vars: dict, communicated: tuple[str, ...], num_clients: int):
    """What each of the cohort's ``num_clients`` clients receives under ``plan`` — its download mask
    (everything when the plan gives none) — and ``[K, L]`` the bytes of it per layer (the plan's own
    payload's, when it gives one).  The round's traffic metrics and a deadline's predicted download
    (:mod:`fedpartial._src.experiment.timing`) both count it here."""
    received = plan.download if plan.download is not None else masks_lib.full(structure, (num_clients,))
    if plan.download_bytes_per_layer is not None:  # a payload that is not the masked elements
        return received, plan.download_bytes_per_layer.astype(jnp.int32)
    if plan.download is None:  # the whole model: its bytes per layer are known before anything runs
        whole = masks_lib.whole_model_bytes_per_layer(structure, global_vars, communicated)
        return received, jnp.broadcast_to(whole, (num_clients, whole.shape[-1]))
    return received, masks_lib.count_bytes_per_layer(structure, received, global_vars, communicated)


def round_metrics(ctx: MethodContext, method: Method, communicated: tuple[str, ...], record_decisions: bool,
                  view: RoundView, selection, losses, steps, sent=None) -> dict:
    """The engine's metrics of a round (and the method's own, from its ``metrics`` hook).  ``communicated``:
    the variable collections a client downloads and uploads; ``record_decisions``: add the plan and the
    selection.  ``sent``: the clients that really took part (default: the view's valid ones); a client
    excluded as non-finite still downloaded and trained, but uploads nothing."""
    structure, g = ctx.structure, view.global_vars
    k = view.cohort.valid.shape[0]
    valid = view.cohort.valid
    sent = valid if sent is None else sent
    _, down = planned_download(structure, view.plan, g, communicated, k)
    if selection.upload_bytes_per_layer is not None:
        up = selection.upload_bytes_per_layer.astype(jnp.int32)
    else:
        up = masks_lib.count_bytes_per_layer(structure, selection.upload, g, communicated)
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
    if view.plan.train is not None and view.plan.train.elements is not None:  # element masks: the share each
        # client trains of every layer, which the device model credits under --sparse-flops
        metrics["trained_density"] = masks_lib.layer_densities(structure, view.plan.train, g["params"])
    if view.plan.train is not None:  # a train mask that selects nothing anywhere is a mistake worth saying
        trained = (jnp.sum(metrics["trained_density"], axis=-1) if "trained_density" in metrics
                   else masks_lib.count_elements(structure, view.plan.train, g["params"]))
        metrics["trained_nothing"] = jnp.any(valid) & jnp.all(jnp.where(valid, trained == 0, True))
    if record_decisions:
        metrics["decisions"] = {"plan": view.plan, "selection": selection}
    if method.metrics is not None:
        own = method.metrics(ctx, view)
        clash = sorted(set(own) & (set(metrics) | set(ENGINE_METRICS)))
        if clash:
            raise ValueError(f"method {method.name}: metric {clash[0]!r} is a name the engine writes; "
                             "choose another.")
        metrics.update(own)
    return metrics


def traffic_totals(metrics: dict) -> dict:
    """Host-side int64 traffic from a round's ``[K, L]`` per-layer counts.

    Returns ``upload_bytes`` / ``download_bytes`` (Python ints) and the per-client
    ``upload_bytes_per_client`` / ``download_bytes_per_client`` (int64 arrays).

    Args:
      metrics: a round's metrics (``FederatedRound``'s output).

    Returns:
      The totals dict.
    """
    out = {}
    fetched = jax.device_get((metrics["upload_bytes_per_layer"], metrics["download_bytes_per_layer"]))
    for way, per_layer in zip(("upload", "download"), fetched):
        per_layer = np.asarray(per_layer, np.int64)
        per_client = per_layer.sum(axis=-1)
        out[f"{way}_bytes_per_client"] = per_client
        out[f"{way}_bytes"] = int(per_client.sum())
    return out
