"""A DP run's host side: the method wrapped in DP-FedAvg, each round's draw for the accountant, ε per round.

:class:`~fedpartial._src.experiment.simulation.Simulation` calls these when ``--dp-clip`` is given
(docs/privacy.md).  The rounds composed so far live in ``Simulation.progress["dp_rounds"]`` (``{"N:K": rounds}``),
so a checkpoint keeps them and a resumed run continues the same sum.
"""

from __future__ import annotations

import numpy as np

from fedpartial._src.core.types import ClientGroup, Method
from fedpartial._src.experiment.config import RunConfig
from fedpartial._src.methods.privacy.accountant import PrivacyAccountant, round_key
from fedpartial._src.methods.privacy.dp_fedavg import dp_fedavg


def private(config: RunConfig, method: Method) -> tuple[Method, PrivacyAccountant | None]:
    """``method`` in DP-FedAvg with ``config``'s settings and the run's accountant, or ``method`` and None."""
    if not config.private:
        return method, None
    wrapped = dp_fedavg(method, config.dp_clip, config.dp_noise_multiplier, per_layer=config.dp_clip_per_layer,
                        target_quantile=config.dp_target_quantile)
    return wrapped, PrivacyAccountant(config.dp_noise_multiplier, config.privacy_delta)


def draw_share(active: np.ndarray, groups: tuple[ClientGroup, ...], cohort_size: int,
               padded_size: int) -> tuple[int, int]:
    """``(N, K)`` of a round's draw as :func:`~fedpartial._src.experiment.population.sample_cohort` makes it:
    the clients that may be sampled and how many are, in the client group that samples the largest share of
    its active members (each group draws its own; a client is in one group).  When fewer than ``K`` are
    active all of them take part: ``K = N``."""
    best = (1, 0)
    for g, group in enumerate(groups):
        members = active if group.members is None else active[np.asarray(group.members)]
        n = int(members.sum())
        k = min(group.size - (padded_size - cohort_size if g == len(groups) - 1 else 0), n)
        if n and k * best[0] > best[1] * n:
            best = (n, k)
    return best


def account_round(accountant: PrivacyAccountant, progress: dict, draw: tuple[int, int]) -> float:
    """Adds a round that drew ``draw = (N, K)`` to ``progress["dp_rounds"]`` (``{"N:K": count}``, updated in
    place: checkpoints keep it); the run's ε so far."""
    rounds = progress.setdefault("dp_rounds", {})
    rounds[round_key(*draw)] = rounds.get(round_key(*draw), 0) + 1
    return accountant.epsilon(rounds)


def summary_fields(config: RunConfig, records: list[dict]) -> dict:
    """The summary's ``final_dp_epsilon`` (∞ without noise; 0 before any round) and ``dp_delta``; {} without DP."""
    if not config.private:
        return {}
    return {"final_dp_epsilon": records[-1]["dp_epsilon"] if records else 0.0, "dp_delta": config.privacy_delta}
