"""A round's simulated time on the clients' devices (:mod:`fedpartial._src.costs.devices`): each client's
FLOPs of local work, counting only the units its sub-model kept, at its compute speed, plus its download
and upload at its bandwidths; and every device's time for a round of full-model work (FedAD's targets).
"""

from __future__ import annotations

import jax
import numpy as np

from fedpartial._src.core.masks import Mask
from fedpartial._src.costs import devices
from fedpartial._src.data import packing
from fedpartial._src.engine import round as engine
from fedpartial._src.engine import types as engine_types

#: a method metric (per layer ``[K, units]``) giving each unit's keep probability when masks are drawn
#: per local step (FedAD ``resample='step'``): the device model counts expected kept units from it
KEEP_PROBABILITY = "dropout_keep_probability"


def kept_units(metrics: dict, num_clients: int) -> Mask | None:
    """The units each of the cohort's ``num_clients`` sub-models kept, as the round's own plan chose them
    (a sub-model method's ``dropout_neurons`` or :data:`KEEP_PROBABILITY` metric); None: the full model."""
    if KEEP_PROBABILITY in metrics:  # masks drawn per local step: each unit's keep probability
        neurons = tuple(np.asarray(n, np.float64) for n in metrics[KEEP_PROBABILITY])
    elif "dropout_neurons" in metrics:
        neurons = tuple(np.asarray(n) for n in metrics["dropout_neurons"])
    else:
        return None
    return Mask(layers=np.ones((num_clients, len(neurons)), bool), neurons=neurons)


def client_work(costs: devices.CostModel, profiles: devices.DeviceProfiles, cohort: engine_types.Cohort,
                ids: np.ndarray, valid: np.ndarray, metrics: dict, *, sparse_flops: bool = False
                ) -> tuple[np.ndarray, float]:
    """``[K]`` every cohort client's FLOPs of local work, and the round's simulated time
    (:func:`devices.round_time` of the real clients' compute and traffic times).  ``sparse_flops``: a client
    training an element mask is credited with computing sparsely (``trained_density``); default dense."""
    densities = metrics.get("trained_density") if sparse_flops else None
    flops = costs.client_flops(engine_types.data_spec(cohort), metrics["client_steps_per_client"],
                               kept_units(metrics, len(ids)), densities)
    seconds = devices.client_times(profiles, ids, flops, metrics["download_bytes_per_client"],
                                   metrics["upload_bytes_per_client"])
    return flops, devices.round_time(seconds, valid)


def full_model_times(round: engine.FederatedRound, costs: devices.CostModel, profiles: devices.DeviceProfiles,
                     cohort: engine_types.Cohort, sizes: np.ndarray, *, batch_size: int, local_steps: int | None,
                     local_epochs: float | None) -> np.ndarray:
    """``[N]`` each device's simulated time for one round of *full-model* local work on its
    own data (its real steps × the step's FLOPs at its speed, plus the whole model down
    and up): ``ET°_k`` of :func:`fedpartial._src.costs.devices.expected_execution_time`.
    ``cohort``: any cohort of the round's shapes; ``sizes``: ``[N]`` every client's training examples."""
    group_costs = costs.group_costs(cohort)
    per_step = max(c.step_flops + c.prepare_flops for c in group_costs)  # a sub-model's count is full-width
    per_step *= round.method.capabilities.local_passes
    steps = np.array([packing.steps_for_client(int(n), batch_size, local_steps=local_steps,
                                               local_epochs=local_epochs) if n else 0 for n in sizes])
    shapes = jax.eval_shape(round.pure_init, jax.random.key(0)).variables
    model_bytes = sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
                      for c in round.communicated for a in jax.tree.leaves(shapes.get(c, {})))
    return devices.expected_execution_time(profiles, steps * per_step, model_bytes, model_bytes)
