"""A DP run's host side: the draw the accountant is given, ε every round and in the summary."""

import json

import numpy as np

from fedpartial._src.core.types import ClientGroup
from fedpartial._src.experiment import privacy
from fedpartial._src.experiment.config import RunConfig
from fedpartial._src.experiment.simulation import Simulation, run
from fedpartial._src.methods.privacy.accountant import PrivacyAccountant

TINY = dict(num_clients=8, cohort_size=3, rounds=2, local_steps=1, local_epochs=None, out_dir=None)


def test_the_draw_is_the_group_sampling_the_largest_share_of_its_active_members():
    active = np.ones(10, bool)
    one = (ClientGroup("all", 4),)
    assert privacy.draw_share(active, one, cohort_size=3, padded_size=4) == (10, 3)  # padding rows are not drawn
    tiers = (ClientGroup("strong", 2, members=(0, 1, 2, 3)), ClientGroup("weak", 2, members=tuple(range(4, 10))))
    assert privacy.draw_share(active, tiers, cohort_size=4, padded_size=4) == (4, 2)  # 2 of 4 beats 2 of 6
    active[[0, 1, 2]] = False  # one strong client left: it takes part every round
    assert privacy.draw_share(active, tiers, cohort_size=4, padded_size=4) == (1, 1)
    progress = {}
    eps = [privacy.account_round(PrivacyAccountant(2.0, 1e-3), progress, (100, 10)) for _ in range(2)]
    assert progress == {"dp_rounds": {"100:10": 2}} and 0 < eps[0] < eps[1]


def test_a_private_run_reports_epsilon_every_round_and_in_the_summary(tmp_path):
    """DP-FedAvg from the run's flags: ε of every round at δ = 1/N from the accountant, for K of N without
    replacement; the summary's ``final_dp_epsilon`` and ``dp_delta``; the rounds in the progress a checkpoint
    keeps (a resumed run continues the same sum)."""
    config = RunConfig(**{**TINY, "out_dir": str(tmp_path)}, model="mlp", dp_clip=0.5, dp_noise_multiplier=1.5,
                       dp_clip_per_layer=True)
    sim = Simulation(config)
    summary = run(config, sim=sim)
    assert sim.progress["dp_rounds"] == {"8:3": 2}
    accountant = PrivacyAccountant(1.5, 1 / 8)
    assert [r["dp_epsilon"] for r in summary["records"]] == [accountant.epsilon({(8, 3): t}) for t in (1, 2)]
    assert summary["records"][0]["dp_clip"] == 0.5 and summary["records"][0]["dp_noise_std"] == 0.75
    written = json.loads((tmp_path / summary["run_dir"] / "summary.json").read_text())
    assert written["final_dp_epsilon"] == summary["records"][-1]["dp_epsilon"] > 0 and written["dp_delta"] == 1 / 8
