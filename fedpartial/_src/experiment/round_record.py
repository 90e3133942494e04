"""One round's record (a line of ``metrics.jsonl``), built the same way for a synchronous round, an asynchronous
server step and each replica's round.

A record starts with the fields every round has (traffic, time, clients, FLOPs, simulated time: :func:`record`),
a mode's own fields inserted after the field they belong beside, then the method's own per-round values, the
decisions of ``--record-decisions``, the privacy budget spent so far and, on evaluation rounds, the accuracies.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from fedpartial._src.core.errors import DivergedError, warn_nothing_trained
from fedpartial._src.engine import metrics as engine_metrics
from fedpartial._src.experiment import privacy, simulated_time, timing
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


def synchronous(sim, prepared, metrics: dict, round_time: float | None = None) -> dict:
    """A synchronous round's record (:meth:`~fedpartial._src.experiment.simulation.Simulation.finish_round`) from
    the metrics of its round, ``sim``'s state already updated: divergence check, traffic, simulated time on the
    clock, running totals, the method's values, the privacy spent and, on evaluation rounds, the accuracies."""
    t, ids, valid, cohort = prepared.round, prepared.ids, prepared.valid, prepared.cohort

    def diverged(metrics):
        what = ("every client's update was non-finite (NaN/inf)" if int(metrics["nonfinite_clients"]) ==
                int(np.sum(valid)) else "the global model became non-finite (NaN/inf)")
        return f"round {t + 1}: {what} — lower --lr or --server-lr, or check the data"

    metrics = checked(metrics, diverged)
    trained_nothing = bool(metrics.get("trained_nothing", False))
    if trained_nothing and not sim.trained_nothing_said:  # once a run
        sim.trained_nothing_said = warn_nothing_trained(t + 1)
    finished = time.perf_counter()
    train_time = finished - prepared.start if round_time is None else round_time
    flops, simulated = simulated_time.client_work(sim.costs, sim.devices, cohort, ids, valid, metrics,
                                                  sparse_flops=sim.config.sparse_flops)
    simulated, clock = sim.clock.finish(prepared.timing or timing.Timing(), sim.progress, valid, simulated)
    sim.progress["cumulative_simulated_time_s"] += simulated
    sim.progress["round"] = t + 1
    out = record(
        sim, t, metrics, round_time_s=train_time, host_time_s=prepared.host_time, clients=int(valid.sum()),
        client_flops=np.sum(flops[valid]), simulated_time_s=simulated,
        inserted={"simulated_time_s": {"cumulative_simulated_time_s": sim.progress["cumulative_simulated_time_s"],
                                       **clock}})  # clients sampled, finished and dropped, wasted work, the clock
    method_values(sim, out, metrics, ids)
    if trained_nothing:
        out["trained_nothing"] = True
    if sim.method.active_clients is not None:
        out["active_clients"] = int(sim.active_clients().sum())
    privacy_spent(sim, out, prepared.draw)
    evaluate_into(sim, out, t, t + 1 == sim.config.rounds or out.get("active_clients", 1) == 0)
    out["wall_time_s"] = train_time + time.perf_counter() - finished
    return out
