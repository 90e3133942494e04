"""``fedpartial run``'s progress and closing words (fedpartial/_src/cli/progress.py): the ETA leaves out the first
round, which compiles; replicas are labelled by what varies; the training loss is called so; a run near chance or
with a weak privacy guarantee says so under its table.  Pure functions: no run, no JAX."""

from fedpartial._src.cli import progress
from fedpartial._src.experiment.replicas import Setting


def test_the_eta_counts_steady_rounds_only():
    clock = progress.RoundClock(total=10)
    first = clock.tick(1, wall_s=120.0)  # compiling: two minutes, then rounds of a second
    assert first["rate"] == "–" and first["eta"] == "–" and first["compile"] == "2.0 min"
    assert clock.tick(2, wall_s=1.0) == {"rate": "1.00", "eta": "8.0 s", "compile": "2.0 min"}
    assert clock.tick(3, wall_s=3.0)["eta"] == "14.0 s"  # 2 s a round over the steady rounds, 7 rounds left
    assert clock.tick(10, wall_s=2.0)["eta"] == "done"


def test_a_resumed_run_starts_its_clock_at_its_first_round():
    clock = progress.RoundClock(total=20)
    clock.tick(11, wall_s=50.0)
    assert clock.tick(12, wall_s=0.5)["eta"] == "4.0 s"  # 8 rounds left at 2 rounds/s


def test_the_progress_line_says_compiling_then_train_loss_and_eta():
    record = {"round": 1, "train_loss": 1.23456, "cumulative_upload_bytes": 1e6, "cumulative_download_bytes": 1e6,
              "wall_time_s": 30.0}
    clock = progress.RoundClock(total=5)
    line = progress.round_line(record, 5, progress.round_fields(record, "0.4100", clock))
    assert line.startswith("round 1/5  acc 0.4100  train loss 1.235  traffic ")
    assert "first round (compiling included) 30.0 s" in line and "ETA" not in line
    second = {**record, "round": 2, "wall_time_s": 0.5}
    line = progress.round_line(second, 5, progress.round_fields(second, "0.5000", clock))
    assert line.endswith("2.00 rounds/s  ETA 1.5 s")
    assert progress.COMPILING == "compiling…"


def test_replicas_are_labelled_by_what_varies():
    seeds_and_rates = [Setting(s, lr) for lr in (0.02, 0.05) for s in (0, 1)]
    assert progress.replica_labels(seeds_and_rates, seeds_given=True) == [
        "seed=0 lr=0.02", "seed=1 lr=0.02", "seed=0 lr=0.05", "seed=1 lr=0.05"]
    assert progress.replica_labels([Setting(3, 0.1), Setting(3, 0.01)], seeds_given=False) == ["lr=0.1", "lr=0.01"]
    assert progress.replica_labels([Setting(0, None, 0.5)], seeds_given=False) == ["server lr=0.5"]
    assert progress.replica_labels([Setting(0, None), Setting(1, None)], seeds_given=True) == ["seed=0", "seed=1"]


def test_the_replica_line_names_each_replica():
    records = [{"test_accuracy": 0.41, "train_loss": 1.5}, None, {"train_loss": 2.0}]
    line = progress.replica_line(2, 40, ["seed=1 lr=0.05", "seed=2 lr=0.05", "seed=3 lr=0.05"], records)
    assert line == ("round 3/40  seed=1 lr=0.05: acc 0.4100 train loss 1.500 | seed=3 lr=0.05: acc – train loss "
                    "2.000  (2 of 3 replicas running)")


def test_the_closing_table_warns_near_chance_and_on_a_weak_guarantee():
    useless = {"final_test_accuracy": 0.17, "final_dp_epsilon": 109.0, "dp_delta": 0.05}
    warnings = progress.closing_warnings(useless, num_classes=10)
    assert len(warnings) == 2
    assert warnings[0].startswith("final test accuracy 0.170 is within 10 points of chance (0.100 for 10 classes)")
    assert warnings[1].startswith("ε = 109 (at δ = 0.05, for the whole run) is over 10")
    assert progress.closing_warnings({"final_test_accuracy": 0.93, "final_dp_epsilon": 3.4, "dp_delta": 1e-3},
                                     num_classes=10) == []
    assert progress.closing_warnings({"final_test_accuracy": 0.6}, num_classes=2) == [] != \
        progress.closing_warnings({"final_test_accuracy": 0.55}, num_classes=2)
    assert progress.closing_warnings({"final_test_accuracy": 0.1}, num_classes=None) == []


def test_a_run_that_learns_nothing_says_so_under_its_table(tmp_path, capsys):
    """Wired into ``fedpartial run``: compiling said first, then "train loss", then the warning under the table."""
    from fedpartial._src.cli.main import main

    assert main(["run", "--dataset", "digits", "--model", "mlp", "--clients", "4", "--cohort", "2", "--rounds", "2",
                 "--local-steps", "1", "--lr", "1e-7", "--out", str(tmp_path)]) == 0  # a rate that moves nothing
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("compiling the round…")
    assert "train loss" in next(line for line in lines if line.startswith("round 2/2"))
    assert "warning: final test accuracy" in out and "of chance" in out
    assert out.index("final test accuracy") < out.index("warning: final test accuracy")
