"""Privacy accounting for DP-FedAvg, on the host, with Google's dp-accounting library (RDP).

Each round releases one subsampled Gaussian mechanism: the sum of clipped updates (L2 norm ≤ C each)
plus noise of std ``z·C`` (:mod:`fedpartial._src.methods.privacy.dp_fedavg`).  How clients are sampled
decides the event that round composes:

* ``"fixed"`` — what a run does (:func:`fedpartial._src.experiment.population.sample_cohort`): ``K``
  distinct clients of the ``N`` that may be sampled, every ``K``-subset equally likely (sampling without
  replacement).  Its neighbouring relation is *replace one* (``N`` is public): replacing one client's
  data by another's moves the clipped sum by up to ``2C``, so the noise is ``z/2`` times that
  sensitivity: ``SampledWithoutReplacementDpEvent(N, K, GaussianDpEvent(z / 2))`` (Wang, Balle and
  Kasiviswanathan 2019, as dp-accounting implements it).
* ``"poisson"`` — every client independently with probability ``q = K/N``, *add or remove one*
  (Abadi et al. 2016; McMahan et al. 2018): ``PoissonSampledDpEvent(q, GaussianDpEvent(z))``.  Runs do not
  sample this way; it is here to compare with published figures (tests/methods/test_accountant.py).

Rounds with different ``(N, K)`` (early stopping shrinks the pool; a method's client groups each sample
their own members) compose as they happened: a run keeps how many rounds had each ``(N, K)`` and the
ε of the whole run is computed from those counts, so a resumed run continues the same sum.  ε at δ uses
dp-accounting's RDP-to-(ε, δ) conversion, which is tighter than the classic ``min_α RDP(α) +
log(1/δ)/(α − 1)`` of older tools (TF Privacy's tutorial figures are the classic one).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Sequence, TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import dp_accounting

SAMPLINGS = ("fixed", "poisson")


def _dp():
    """dp-accounting, imported when first used (it takes ~2 s to import, with scipy): ``import fedpartial`` and
    the command line's refusals stay fast."""
    import dp_accounting
    from dp_accounting.rdp import rdp_privacy_accountant

    return dp_accounting, rdp_privacy_accountant


def round_key(population: int, sample: int) -> str:
    """How a run's progress names rounds that sampled ``sample`` of ``population`` clients (JSON keys)."""
    return f"{int(population)}:{int(sample)}"


class PrivacyAccountant:
    """The (ε, δ) of DP-FedAvg rounds: ``epsilon({(N, K): rounds, ...})``.

    Args:
      noise_multiplier: ``z``, the noise std over the clipping norm (0: no privacy, ε = ∞).
      delta: the δ at which ε is reported.
      sampling: ``"fixed"`` (a run's: ``K`` of ``N`` without replacement) or ``"poisson"``.
      orders: RDP orders (default: dp-accounting's).

    Example::

        acc = PrivacyAccountant(noise_multiplier=1.0, delta=1e-3)
        acc.epsilon({(1000, 10): 100})   # 100 rounds of 10 clients out of 1,000
    """

    def __init__(self, noise_multiplier: float, delta: float, sampling: str = "fixed",
                 orders: "Sequence[float] | None" = None):
        if sampling not in SAMPLINGS:
            raise ValueError(f"sampling {sampling!r} is unknown; use one of {SAMPLINGS}.")
        if not 0 < delta < 1:
            raise ValueError(f"δ = {delta!r} must be in (0, 1).")
        self.noise_multiplier, self.delta, self.sampling = float(noise_multiplier), float(delta), sampling
        self.orders = np.asarray(_dp()[1].DEFAULT_RDP_ORDERS if orders is None else orders, np.float64)
        self._rdp: dict[tuple[int, int], np.ndarray] = {}

    def event(self, population: int, sample: int) -> dp_accounting.DpEvent:
        """One round's event: ``sample`` of ``population`` clients, Gaussian noise ``z·C`` on the clipped sum."""
        if not 0 < sample <= population:
            raise ValueError(f"a round samples between 1 and {population} clients, not {sample}.")
        dp_accounting, z = _dp()[0], self.noise_multiplier
        if z == 0:
            return dp_accounting.NonPrivateDpEvent()
        if self.sampling == "poisson":
            return dp_accounting.PoissonSampledDpEvent(sample / population, dp_accounting.GaussianDpEvent(z))
        return dp_accounting.SampledWithoutReplacementDpEvent(population, sample, dp_accounting.GaussianDpEvent(z / 2))

    def new_accountant(self) -> dp_accounting.rdp.RdpAccountant:
        dp_accounting = _dp()[0]
        relation = (dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE if self.sampling == "poisson"
                    else dp_accounting.NeighboringRelation.REPLACE_ONE)
        return dp_accounting.rdp.RdpAccountant(list(self.orders), relation)

    def rdp(self, population: int, sample: int) -> np.ndarray:
        """One round's RDP at every order (computed once per ``(N, K)``: a round without replacement takes
        a fraction of a second)."""
        key = (int(population), int(sample))
        if key not in self._rdp:
            accountant = self.new_accountant()
            accountant.compose(self.event(*key))
            self._rdp[key] = np.array(accountant._rdp, np.float64)  # noqa: SLF001  (composed once, summed below)
        return self._rdp[key]

    def epsilon(self, rounds: Mapping) -> float:
        """ε at :attr:`delta` after ``rounds``: ``{(N, K) or "N:K": how many rounds sampled K of N}``."""
        counts = {}
        for key, count in rounds.items():
            n, k = map(int, key.split(":")) if isinstance(key, str) else key
            counts[(n, k)] = counts.get((n, k), 0) + int(count)
        if not any(counts.values()):
            return 0.0
        if self.noise_multiplier == 0:
            return math.inf
        total = sum(c * self.rdp(n, k) for (n, k), c in counts.items())
        return float(_dp()[1].compute_epsilon(self.orders, total, self.delta)[0])


def noise_multiplier_for(epsilon: float, delta: float, rounds: int, population: int, sample: int,
                         sampling: str = "fixed", tol: float = 1e-3) -> float:
    """The smallest ``z`` (within ``tol``) whose ``rounds`` rounds of ``sample`` of ``population`` clients
    stay within ``(epsilon, delta)`` (dp-accounting's calibration)."""
    dp_accounting, acc = _dp()[0], PrivacyAccountant(1.0, delta, sampling)
    make_event = lambda z: dp_accounting.SelfComposedDpEvent(  # noqa: E731
        PrivacyAccountant(z, delta, sampling).event(population, sample), rounds)
    return float(dp_accounting.calibrate_dp_mechanism(acc.new_accountant, make_event, epsilon, delta, tol=tol))
