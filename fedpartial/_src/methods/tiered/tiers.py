"""Capacity tiers: strong, moderate and weak clients in given counts (EmbracingFL §4, HeteroFL).

A population of ``N`` clients is split by id into consecutive ranges: clients
``0 … S-1`` are strong, ``S … S+M-1`` moderate, the rest weak (ids carry no data
order — partitions are drawn independently of ids — so ranges are as good as a
random assignment and easier to read in logs).  The mix is given as counts
(``--tier-mix S,M,W``, summing to ``N``) or as one of the EmbracingFL paper's
128-client cases (``--capacity-case 1..10``, Table 2; for another ``N`` the case's
proportions are scaled, largest remainder first).

Every round samples a fixed number of clients per tier (stratified, static for the
run, so each tier compiles once): ``K``'s share of each tier, proportional to its
count, largest remainder first, and at least one client for every tier that has
members when ``K`` allows.  With ``K = N`` (the paper's full participation) every
client trains every round.  A tier with no members or no cohort slots simply has
no client group.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from fedpartial._src.core.errors import UserError
from fedpartial._src.methods.registry import Option

TIER_NAMES = ("strong", "moderate", "weak")

#: EmbracingFL's client mixes (strong, moderate, weak) of 128 clients, Tables 2–5.
CAPACITY_CASES: dict[int, tuple[int, int, int]] = {
    1: (128, 0, 0), 2: (64, 64, 0), 3: (32, 96, 0), 4: (16, 112, 0), 5: (64, 0, 64),
    6: (32, 0, 96), 7: (16, 0, 112), 8: (32, 32, 64), 9: (16, 32, 80), 10: (16, 16, 96),
}
PAPER_POPULATION = 128


def parse_counts(text) -> tuple[int, int, int]:
    """``"S,M,W"`` (or a sequence) -> three non-negative ints."""
    parts = [p.strip() for p in text.split(",")] if isinstance(text, str) else list(text)
    try:
        counts = tuple(int(p) for p in parts)
    except (TypeError, ValueError):
        raise UserError(f"tier mix {text!r} must be three whole numbers S,M,W (strong, moderate, weak).") from None
    if len(counts) != 3 or any(c < 0 for c in counts):
        raise UserError(f"tier mix {text!r} must be three non-negative counts S,M,W (strong, moderate, weak).")
    return counts


def check_case(case) -> str | None:
    """An Option check: None when ``case`` is one of the paper's cases (or not given)."""
    return None if case is None or case in CAPACITY_CASES else f"must be a case from 1 to {len(CAPACITY_CASES)}"


TIER_MIX_OPTION = Option("tier_mix", parse_counts, None,
                         "capacity tiers (EmbracingFL, HeteroFL, FedRolex, DepthFL, InclusiveFL): strong,moderate,"
                         "weak client counts summing to --clients (default: every client strong)", flag="--tier-mix")
CAPACITY_CASE_OPTION = Option("capacity_case", int, None,
                              "capacity tiers: EmbracingFL's client mix 1..10 (its Table 2), scaled to --clients",
                              check=check_case, flag="--capacity-case")


def largest_remainder(weights, total: int) -> np.ndarray:
    """Integers proportional to ``weights`` summing to ``total`` (ties: the earlier entry)."""
    w = np.asarray(weights, np.float64)
    exact = w / w.sum() * total
    out = np.floor(exact).astype(np.int64)
    order = np.argsort(-(exact - out), kind="stable")
    out[order[: total - int(out.sum())]] += 1
    return out


@dataclasses.dataclass(frozen=True)
class TierMix:
    """Population counts per tier (strong, moderate, weak)."""

    counts: tuple[int, int, int]

    @property
    def num_clients(self) -> int:
        return sum(self.counts)

    def members(self, tier: int) -> tuple[int, ...]:
        start = sum(self.counts[:tier])
        return tuple(range(start, start + self.counts[tier]))

    def cohort_sizes(self, cohort_size: int) -> tuple[int, int, int]:
        """Clients per round of each tier: proportional to the counts, every populated tier ≥ 1 if K allows."""
        counts = np.asarray(self.counts)
        if cohort_size >= self.num_clients:
            return tuple(int(c) for c in counts)
        sizes = largest_remainder(counts, cohort_size)
        populated = np.flatnonzero(counts > 0)
        if cohort_size >= len(populated):
            for t in populated:
                if sizes[t] == 0:  # take the slot from the tier with the most
                    sizes[np.argmax(sizes)] -= 1
                    sizes[t] = 1
        return tuple(int(s) for s in sizes)

    def average(self, per_tier) -> float:
        """The population mean of a per-tier value (e.g. the paper's Avg. Capacity)."""
        return float(np.dot(self.counts, per_tier) / self.num_clients)


def resolve_mix(num_clients: int, tier_mix=None, capacity_case: int | None = None) -> TierMix:
    """The run's mix: ``tier_mix`` counts, a paper case scaled to ``num_clients``, or all strong."""
    if tier_mix is not None and capacity_case is not None:
        raise UserError("give either --tier-mix or --capacity-case, not both.")
    if tier_mix is not None:
        counts = parse_counts(tier_mix)
        if sum(counts) != num_clients:
            raise UserError(f"tier mix {','.join(map(str, counts))} adds up to {sum(counts)} clients, "
                            f"but the population has {num_clients} (--clients); make the counts sum to it.")
        return TierMix(counts)
    if capacity_case is not None:
        if check_case(capacity_case):
            raise UserError(f"capacity case {capacity_case!r} {check_case(capacity_case)}.")
        case = CAPACITY_CASES[capacity_case]
        if num_clients == PAPER_POPULATION:
            return TierMix(case)
        return TierMix(tuple(int(c) for c in largest_remainder(case, num_clients)))
    return TierMix((num_clients, 0, 0))


def cohort_rows(mix: TierMix, ctx) -> tuple[int, int, int]:
    """Rows of each tier in the round's cohort, which is laid out tier after tier: the tier's sampled
    clients (:meth:`TierMix.cohort_sizes` of ``ctx.clients_per_round``), the padding rows that fill the
    devices (``ctx.padding``) counted in the last populated tier."""
    sizes = list(mix.cohort_sizes(ctx.clients_per_round))
    sizes[max(t for t in range(3) if sizes[t] > 0)] += ctx.padding
    return tuple(sizes)


def tier_losses(rows: tuple[int, int, int], valid, client_loss) -> dict:
    """``train_loss_<tier>``: the mean local loss of each tier's real clients (``rows`` from :func:`cohort_rows`)."""
    tiers = np.repeat(np.arange(3), rows)
    out = {}
    for t in np.unique(tiers):
        real = jnp.asarray(tiers == t) & valid
        out[f"train_loss_{TIER_NAMES[t]}"] = jnp.sum(jnp.where(real, client_loss, 0.0)) / jnp.maximum(jnp.sum(real), 1)
    return out


def describe(mix: TierMix, cohort_size: int) -> str:
    """One line for logs, e.g. ``16 strong + 112 weak; per round 2 + 14``."""
    sizes = mix.cohort_sizes(cohort_size)
    pop = " + ".join(f"{c} {n}" for c, n in zip(mix.counts, TIER_NAMES) if c)
    per_round = " + ".join(str(s) for s, c in zip(sizes, mix.counts) if c)
    return f"{pop}; per round {per_round}"
