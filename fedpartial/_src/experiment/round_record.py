"""One round's record (a line of ``metrics.jsonl``), built the same way for a synchronous round, an asynchronous
server step and each replica's round.

A record starts with the fields every round has (traffic, time, clients, FLOPs, simulated time: :func:`record`),
a mode's own fields inserted after the field they belong beside, then the method's own per-round values, the
decisions of ``--record-decisions``, the privacy budget spent so far and, on evaluation rounds, the accuracies.
"""

from __future__ import annotations

import jax
import numpy as np

from fedpartial._src.core.errors import DivergedError
from fedpartial._src.engine import metrics as engine_metrics
from fedpartial._src.experiment import privacy, simulated_time
from fedpartial._src.experiment.evaluation import record_fields


def checked(metrics: dict, diverged: str) -> dict:
    """The round's metrics on the host with the traffic totals; a round whose update was not finite raises
    :class:`DivergedError` with the sentence ``diverged`` gives for the metrics."""
    metrics = jax.device_get(metrics)
    if bool(metrics["diverged"]):
        raise DivergedError(diverged(metrics))
    metrics.update(engine_metrics.traffic_totals(metrics))
    return metrics


def record(sim, t: int, metrics: dict, *, round_time_s: float, host_time_s: float, clients: int, client_flops: float,
           simulated_time_s: float, inserted: dict[str, dict] | None = None) -> dict:
    """Round ``t``'s record for ``sim`` (a :class:`~fedpartial._src.experiment.simulation.Simulation`), its traffic
    added to ``sim.progress``'s totals; ``inserted``: a mode's own fields after the field that names them."""
    progress = sim.progress
    progress["cumulative_upload_bytes"] += int(metrics["upload_bytes"])
    progress["cumulative_download_bytes"] += int(metrics["download_bytes"])
    fields = {
        "round": t + 1,
        "train_loss": float(metrics["train_loss"]),
        "client_steps": int(metrics["client_steps"]),
        "upload_bytes": int(metrics["upload_bytes"]),
        "download_bytes": int(metrics["download_bytes"]),
        "cumulative_upload_bytes": progress["cumulative_upload_bytes"],
        "cumulative_download_bytes": progress["cumulative_download_bytes"],
        "round_time_s": round_time_s,
        "host_time_s": host_time_s,
        "clients": clients,
        "nonfinite_clients": int(metrics["nonfinite_clients"]),
        "client_flops": round(float(client_flops)),
        "simulated_time_s": simulated_time_s,
    }
    out = {}
    for name, value in fields.items():
        out[name] = value
        out.update((inserted or {}).get(name, {}))
    return out


def method_values(sim, record: dict, metrics: dict, ids: np.ndarray, *, skip: tuple = ()) -> None:
    """The method's own per-round values (its ``metrics`` hook) into ``record`` as JSON numbers / lists, and the
    round's decisions (``--record-decisions``) into ``sim.last_decisions``."""
    for name, value in metrics.items():
        if name not in engine_metrics.ENGINE_METRICS and name != simulated_time.KEEP_PROBABILITY \
                and name not in record and name not in skip:
            record[name] = np.asarray(value).tolist()
    if "decisions" in metrics:
        sim.last_decisions = {"client_ids": ids, **metrics["decisions"]}


def privacy_spent(sim, record: dict, draw) -> None:
    """With ``--dp-clip``: ε after this round, composed with every one before it (resumed runs too)."""
    if sim.accountant is not None:
        record["dp_epsilon"] = privacy.account_round(sim.accountant, sim.progress, draw)


def evaluate_into(sim, record: dict, t: int, last: bool) -> None:
    """On an evaluation round (every ``--eval-every``, and the last): the global model's accuracy (every exit's,
    for a model with exits) and, with held-out data, each client's own model's."""
    if (t + 1) % sim.config.eval_every == 0 or last:
        record.update(record_fields(sim.evaluate()))
        if sim.holdout is not None:
            record.update(sim.evaluate_personal())
