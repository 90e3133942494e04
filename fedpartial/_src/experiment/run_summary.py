"""What a run folder says about its run beyond the records: ``summary.json`` (:func:`summarize`), how the model
executed (:func:`execution_facts`, in ``environment.json``) and ``--record-decisions``' masks
(:func:`save_decisions`)."""

from __future__ import annotations

import math
import os
from typing import Any, Protocol

import jax
import numpy as np

from fedpartial._src.experiment import privacy
from fedpartial._src.experiment.config import RunConfig


class RunSimulation(Protocol):
    """What a run directory reads of the simulation it records: a
    :class:`~fedpartial._src.experiment.simulation.Simulation` (which imports this module, so this module
    names only its shape; :func:`~fedpartial._src.experiment.checkpoint.save` and ``restore`` read its state)."""

    config: RunConfig
    progress: dict
    last_decisions: dict | None
    dataset: Any
    model: Any
    round: Any  # the FederatedRound (its ``strategy``)
    holdout: Any
    mesh: Any
    strategy_note: str | None
    data_placement: str
    client_state: str
    train_fraction: float

    @property
    def num_params(self) -> int: ...

    @property
    def personal_state_bytes(self) -> int: ...

    def active_clients(self) -> np.ndarray: ...

def save_decisions(path: str, decisions: dict) -> None:
    """Writes one round's plan and selection masks to ``path`` (``.npz``, one array per named field).

    Array names are the pytree paths, e.g. ``selection/upload/layers`` (``[K, L]``)
    or ``plan/train/neurons/0`` (``[K, units_0]``); ``client_ids`` says whose rows they are.
    """
    arrays = {}
    for keys, leaf in jax.tree_util.tree_flatten_with_path(decisions)[0]:
        name = "/".join(str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))) for k in keys)
        arrays[name] = np.asarray(leaf)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    np.savez_compressed(path, **arrays)


def execution_facts(sim) -> dict:
    """How the run's model executes: the convolution lowering (and what ``auto`` measured), the compute dtype,
    the compilation cache folder."""
    choice = getattr(sim, "conv_choice", None)
    conv = None if choice is None else {"impl": choice.impl, "layout": choice.layout, "how": choice.how,
                                        "seconds_per_round": choice.seconds}
    return {"conv_impl": conv, "compute_dtype": sim.config.compute_dtype,
            "compile_cache_dir": getattr(sim, "compile_cache_dir", None)}


def _round_times(records: list[dict]) -> dict:
    """The first round's time (it compiles the round) apart from the others': ``compile_time_s`` is the first
    round's time less the median of the rest (an estimate: compiling, or loading from the cache, and warming up)."""
    times = [r["round_time_s"] for r in records]
    if len(times) < 2:
        return {"first_round_time_s": times[0] if times else math.nan, "compile_time_s": math.nan}
    rest = sorted(times[1:])
    return {"first_round_time_s": times[0], "compile_time_s": max(0.0, times[0] - rest[len(rest) // 2]),
            "steady_rounds_per_s": len(rest) / sum(rest) if sum(rest) else math.nan}


def summarize(config: RunConfig, sim: RunSimulation, records: list[dict], wall: float, *, status: str = "complete",
              resumed_from: int | None = None) -> dict:
    """The run's totals from its records.  Values that do not exist yet (no evaluated round) are NaN here
    and ``null`` in ``summary.json``; ``status`` is the run's (see :mod:`fedpartial._src.experiment.run_files`)."""
    evaluated = [r for r in records if "test_accuracy" in r]
    accs = [r["test_accuracy"] for r in evaluated]
    train_time = sum(r["round_time_s"] for r in records)
    personal = {}
    if sim.holdout is not None and evaluated:
        keys = ("personal_accuracy", "personal_accuracy_std", "personal_accuracy_min", "personal_accuracy_max",
                "global_client_accuracy")
        personal = {f"final_{k}": evaluated[-1][k] for k in keys}
        personal["best_personal_accuracy"] = max(r["personal_accuracy"] for r in evaluated)
    target = config.target_accuracy
    reached = next((r for r in evaluated if target is not None and r["test_accuracy"] >= target), None)
    stopping = {}
    if config.early_stopping:
        stopping = {"rounds_saved": config.rounds - len(records),
                    "stopped_clients": int(config.num_clients - sim.active_clients().sum())}
    return {
        "status": status,
        "method": config.method_name,
        "dataset": sim.dataset.name,
        "model": sim.model.name,
        "num_params": sim.num_params,
        "strategy": f"{sim.round.strategy.name}:{sim.round.strategy.chunk_size}",
        **({"strategy_note": sim.strategy_note} if sim.strategy_note else {}),
        "conv_impl": sim.conv_choice.describe() if getattr(sim, "conv_choice", None) else None,
        "compute_dtype": sim.config.compute_dtype,
        "devices": sim.mesh.size if sim.mesh is not None else len(sim.round.step_devices or ()) or 1,
        "backend": jax.default_backend(),
        "data_placement": sim.data_placement,
        "client_state": sim.client_state,
        "rounds": len(records),
        "final_test_accuracy": accs[-1] if accs else math.nan,
        "best_test_accuracy": max(accs) if accs else math.nan,
        "final_test_loss": evaluated[-1]["test_loss"] if evaluated else math.nan,
        # a language model (labels per position): exp(test loss)
        **({"final_perplexity": evaluated[-1]["perplexity"]} if evaluated and "perplexity" in evaluated[-1] else {}),
        # a model with exits: every exit's accuracy and their ensemble's (test_accuracy_exit1, …)
        **{f"final_{k}": v for k, v in (evaluated[-1] if evaluated else {}).items() if k.startswith("test_accuracy_")},
        "final_train_loss": records[-1]["train_loss"] if records else math.nan,
        "total_upload_bytes": records[-1]["cumulative_upload_bytes"] if records else 0,
        "total_download_bytes": records[-1]["cumulative_download_bytes"] if records else 0,
        "total_client_steps": sum(r["client_steps"] for r in records),
        "total_client_flops": sum(r["client_flops"] for r in records),
        "total_simulated_time_s": records[-1]["cumulative_simulated_time_s"] if records else 0.0,
        "simulated_clock_s": records[-1].get("simulated_clock_s", 0.0) if records else 0.0,
        "total_clients_dropped": sum(r.get("clients_dropped", 0) for r in records),
        **({"rounds_training_nothing": n} if (n := sum(r.get("trained_nothing", False) for r in records)) else {}),
        "total_wasted_flops": sum(r.get("wasted_flops", 0) for r in records),
        "total_wasted_bytes": sum(r.get("wasted_bytes", 0) for r in records),
        "target_accuracy": target,
        # the clock (simulated time plus waits for availability; the same without --availability)
        "time_to_target_s": reached.get("simulated_clock_s", reached["cumulative_simulated_time_s"]) if reached
        else None,
        "round_to_target": reached["round"] if reached else None,
        "train_time_s": train_time,
        "rounds_per_s": len(records) / train_time if train_time else math.nan,
        **_round_times(records),
        "wall_time_s": wall,
        "planned_rounds": config.rounds,
        "resumed_from_round": resumed_from,
        "client_train_fraction": sim.train_fraction,
        "personal_state_bytes": sim.personal_state_bytes,
        **personal,
        **stopping,
        **privacy.summary_fields(config, records),
    }
