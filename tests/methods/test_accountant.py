"""The DP accountant: published figures, the run's sampling without replacement, composition and calibration."""

import math

import dp_accounting
import numpy as np
import pytest

from fedpartial import PrivacyAccountant
from fedpartial._src.methods.privacy.accountant import noise_multiplier_for

# TF Privacy's MNIST DP-SGD table (tensorflow_privacy/tutorials/README.md, "Select Parameters"): 60,000 examples,
# batches of 256 sampled with probability 256/60,000 (Poisson), δ = 1e-5 — (noise multiplier, epochs, ε).
# Those ε are the classic RDP conversion min_α RDP(α) + log(1/δ)/(α − 1) over the orders below.
TF_PRIVACY = [(1.3, 15, 1.19), (1.1, 60, 3.01), (0.7, 45, 7.10)]
CLASSIC_ORDERS = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))


@pytest.mark.parametrize("z, epochs, published", TF_PRIVACY)
def test_epsilon_against_published_dp_sgd_figures(z, epochs, published):
    acc = PrivacyAccountant(z, 1e-5, sampling="poisson", orders=CLASSIC_ORDERS)
    steps = math.ceil(epochs * 60000 / 256)
    rdp = steps * acc.rdp(60000, 256)
    classic = float(np.min(rdp + math.log(1e-5 ** -1) / (np.asarray(CLASSIC_ORDERS) - 1)))
    assert round(classic, 2) == published
    # What runs report is dp-accounting's tighter conversion of the same RDP: never more.
    assert acc.epsilon({(60000, 256): steps}) <= classic


def test_a_run_samples_without_replacement_under_replace_one():
    """K distinct clients of N: dp-accounting's sampled-without-replacement Gaussian, replace-one, multiplier z/2
    (replacing a client moves the clipped sum by up to 2C)."""
    acc = PrivacyAccountant(1.0, 1e-3)
    direct = dp_accounting.rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    direct.compose(dp_accounting.SampledWithoutReplacementDpEvent(1000, 10, dp_accounting.GaussianDpEvent(0.5)), 100)
    assert acc.epsilon({(1000, 10): 100}) == pytest.approx(direct.get_epsilon(1e-3), rel=1e-12)
    assert acc.epsilon({"1000:10": 60, (1000, 10): 40}) == acc.epsilon({(1000, 10): 100})  # keys as a run stores them
    # Sampling the same share with replace-one costs more than Poisson with add-or-remove.
    assert acc.epsilon({(1000, 10): 100}) > PrivacyAccountant(1.0, 1e-3, "poisson").epsilon({(1000, 10): 100})


def test_rounds_of_different_pools_compose():
    acc = PrivacyAccountant(2.0, 1e-4)
    direct = acc.new_accountant()
    direct.compose(acc.event(100, 10), 5)
    direct.compose(acc.event(40, 10), 3)  # e.g. early stopping left 40 clients
    assert acc.epsilon({(100, 10): 5, (40, 10): 3}) == pytest.approx(direct.get_epsilon(1e-4), rel=1e-12)
    assert acc.epsilon({(100, 10): 5, (40, 10): 3}) > acc.epsilon({(100, 10): 8})
    assert acc.epsilon({}) == 0.0
    assert PrivacyAccountant(0.0, 1e-4).epsilon({(100, 10): 1}) == math.inf  # clipping without noise


def test_calibration_finds_the_noise_for_a_budget():
    # Poisson keeps it fast (a round without replacement takes ~0.2 s to account at every trial z).
    z = noise_multiplier_for(4.0, 1e-3, rounds=50, population=1000, sample=20, sampling="poisson")
    eps = PrivacyAccountant(z, 1e-3, "poisson").epsilon({(1000, 20): 50})
    assert eps == pytest.approx(4.0, abs=1e-2) and eps <= 4.0 + 1e-9
