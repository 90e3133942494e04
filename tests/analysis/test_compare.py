"""``fedpartial compare`` and ``fedpartial plot``: one tiny comparison (2 methods × 2 seeds, 2 rounds),
its table checked by hand against the runs' summaries, the shared partition, the figures, and bad input."""

import csv
import json
import os
import statistics

import numpy as np
import pytest

from fedpartial._src.analysis import compare
from fedpartial._src.analysis.plots import FIGURES
from fedpartial._src.cli.main import main
from fedpartial._src.experiment import summaries

TINY = ["--dataset", "synthetic", "--model", "mlp", "--clients", "6", "--cohort", "3", "--rounds", "2",
        "--local-steps", "1", "--batch-size", "8"]
METHODS, SEEDS = ("fedavg", "fedldf"), (0, 1)


# The module fixture below is costly: the module stays on one xdist worker (--dist loadgroup), which
# builds it once.
pytestmark = pytest.mark.xdist_group("compare")


@pytest.fixture(scope="session")  # kept by its xdist group's worker (see test_sharding.py)
def done(tmp_path_factory):
    out = tmp_path_factory.mktemp("cmp") / "c"
    code = main(["compare", "--methods", ",".join(METHODS), "--seeds", "0,1", "--option", "fedldf:n=1",
                 "--out", str(out)] + TINY)
    assert code == 0
    return out


def _summary(out, method, seed):
    return json.loads((out / f"{method}-seed{seed}" / "summary.json").read_text())


def _records(out, method, seed):
    return [json.loads(line) for line in (out / f"{method}-seed{seed}" / "metrics.jsonl").read_text().splitlines()]


def test_every_pair_is_a_run_dir_and_the_table_is_mean_and_std_of_their_summaries(done):
    for m in METHODS:
        for s in SEEDS:
            assert {"config.json", "metrics.jsonl", "summary.json"} <= set(os.listdir(done / f"{m}-seed{s}"))
    with open(done / "comparison.csv") as f:
        rows = {row["method"]: row for row in csv.DictReader(f)}
    assert list(rows) == list(METHODS)
    for m in METHODS:
        assert rows[m]["seeds"] == "0,1"
        for key, _ in summaries.COLUMNS:
            values = [float(_summary(done, m, s)[key]) for s in SEEDS]
            assert float(rows[m][f"{key}_mean"]) == pytest.approx(statistics.fmean(values), rel=1e-12)
            assert float(rows[m][f"{key}_std"]) == pytest.approx(statistics.pstdev(values), rel=1e-9, abs=1e-15)
        assert float(rows[m]["rounds_mean"]) == 2 and float(rows[m]["rounds_std"]) == 0
    # fedldf with n=1 uploads one layer: fewer bytes than fedavg's whole model (the option reached the run).
    assert float(rows["fedldf"]["total_upload_bytes_mean"]) < float(rows["fedavg"]["total_upload_bytes_mean"])
    md = (done / "comparison.md").read_text().splitlines()
    assert md[0].startswith("| method | seeds | final accuracy") and len(md) == 2 + len(METHODS)
    acc = [_summary(done, "fedavg", s)["final_test_accuracy"] for s in SEEDS]
    assert md[2].startswith("| fedavg | 0,1 | ")
    assert f"{np.mean(acc):.4f} ± {np.std(acc):.4f}" in md[2]


def test_methods_of_one_seed_share_the_partition_and_cohorts(done):
    def setup(m, s):
        config = json.loads((done / f"{m}-seed{s}" / "config.json").read_text())
        return {k: v for k, v in config.items() if k not in ("method", "options", "run_name")}

    for s in SEEDS:
        assert setup("fedavg", s) == setup("fedldf", s)
        assert setup("fedavg", s)["seed"] == s
        steps = [[(r["client_steps"], r["clients"]) for r in _records(done, m, s)] for m in METHODS]
        assert steps[0] == steps[1] == [(3, 3), (3, 3)]
    assert json.loads((done / "fedldf-seed0" / "config.json").read_text())["options"] == {"n": 1}
    assert json.loads((done / "fedavg-seed0" / "config.json").read_text())["options"] == {}


def test_figures_are_written_as_png_and_svg(done):
    for stem in FIGURES:
        assert (done / f"{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert b"<svg" in (done / f"{stem}.svg").read_bytes()[:2000]


def test_plot_draws_the_run_dirs(done, tmp_path, capsys):
    dirs = [str(done / f"{m}-seed{s}") for m in METHODS for s in SEEDS]
    assert main(["plot", *dirs, "--out", str(tmp_path / "p")]) == 0
    assert sorted(os.listdir(tmp_path / "p")) == sorted(f"{s}.{f}" for s in FIGURES for f in ("png", "svg"))
    assert main(["plot", dirs[0], str(tmp_path), "--out", str(tmp_path / "q")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a run directory" in err and not (tmp_path / "q").exists()
    # Earlier figures are never overwritten, a file is not a directory: one sentence each, nothing drawn.
    before = {p.name: p.read_bytes() for p in (tmp_path / "p").iterdir()}
    assert main(["plot", *dirs, "--out", str(tmp_path / "p")]) == 2
    assert "already holds accuracy_vs_round.png; choose a new directory" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in (tmp_path / "p").iterdir()} == before
    (tmp_path / "f").write_text("x")
    assert main(["plot", *dirs, "--out", str(tmp_path / "f" / "sub")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot be made" in err and "is a file" in err


def _run(out, method, seed, accs, upload, time_s):
    records = [{"round": t + 1, "test_accuracy": a, "cumulative_upload_bytes": upload * (t + 1),
                "cumulative_simulated_time_s": time_s * (t + 1)} for t, a in enumerate(accs)]
    summary = {"final_test_accuracy": accs[-1], "best_test_accuracy": max(accs), "total_upload_bytes":
               upload * len(accs), "total_simulated_time_s": time_s * len(accs), "rounds": len(accs)}
    return {"dir": f"{out}/{method}-{seed}", "config": {"method": method, "seed": seed}, "records": records,
            "summary": summary}


def test_table_and_mean_curve_by_hand():
    runs = [_run("o", "a", 0, [0.2, 0.5], 100, 1.0), _run("o", "a", 1, [0.4, 0.7, 0.9], 300, 3.0)]
    (row,) = summaries.table(runs)
    assert row["final_test_accuracy_mean"] == pytest.approx(0.7)  # finals 0.5 and 0.9
    assert row["final_test_accuracy_std"] == pytest.approx(0.2)
    assert row["total_upload_bytes_mean"] == pytest.approx((200 + 900) / 2)
    assert row["rounds_mean"] == 2.5 and row["rounds_std"] == 0.5
    curve = summaries.mean_curve(runs, "a")  # rounds both seeds evaluated: 1 and 2
    np.testing.assert_allclose(curve["round"], [1, 2])
    np.testing.assert_allclose(curve["accuracy"], [0.3, 0.6])
    np.testing.assert_allclose(curve["std"], [0.1, 0.1])
    np.testing.assert_allclose(curve["bytes"], [200, 400])
    np.testing.assert_allclose(curve["time"], [2.0, 4.0])


@pytest.mark.parametrize("args, words", [
    (["--methods", "fedavg,nope"], "--methods names 'nope', which is unknown"),
    (["--methods", ""], "--methods '' is not allowed"),
    (["--methods", "fedavg,,fedldf"], "--methods 'fedavg,,fedldf' is not allowed"),
    (["--methods", "fedavg,fedavg"], "names a method twice"),
    (["--methods", "fedavg", "--seeds", "0,x"], "--seeds '0,x' is not allowed"),
    (["--methods", "fedavg", "--seeds", "-1"], "--seeds '-1' is not allowed"),
    (["--methods", "fedavg", "--seeds", ""], "--seeds '' is not allowed"),
    (["--methods", "fedavg", "--seeds", "1,1"], "names a seed twice"),
    (["--methods", "fedavg", "--option", "fedldf:n=2"], "which is not in --methods"),
    (["--methods", "fedldf", "--option", "fedldf:zzz=2"], "has no option 'zzz'"),
    (["--methods", "fedldf", "--option", "fedldf:n=two"], "--option 'fedldf:n=two' is not allowed"),
    (["--methods", "fedldf", "--option", "n=2"], "it must be METHOD:NAME=VALUE"),
    (["--methods", "fedavg", "--cohort", "7"], "--cohort 7 is not allowed"),
    (["--methods", "fedavg", "--lr", "nan"], "--lr nan is not allowed"),
    (["--methods", "fedavg,fedspu", "--model", "resnet20", "--dataset", "digits"], "--method fedspu drops single"),
])
def test_bad_input_exits_2_with_one_sentence_before_any_run(args, words, tmp_path, capsys, monkeypatch):
    def never(*a, **k):
        raise AssertionError("a run started")

    monkeypatch.setattr(compare, "run_all", never)
    out = tmp_path / "c"
    base = [a for a in TINY if a not in ("--model", "mlp")] if "--model" in args else TINY
    assert main(["compare", *base, *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err, err
    assert not out.exists()


def test_out_with_files_is_refused(tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("mine")
    assert main(["compare", "--methods", "fedavg", "--out", str(tmp_path)] + TINY) == 2
    assert "already holds files" in capsys.readouterr().err
    assert os.listdir(tmp_path) == ["keep.txt"]


def test_a_config_file_gives_the_flags_the_command_line_does_not(tmp_path, capsys, monkeypatch):
    """``compare --config exp.toml`` reads the file as ``run`` does (methods and seeds too), the command line
    winning; a missing file, a bad key and no methods anywhere are one sentence before any run."""
    planned = []

    def capture(configs, **kwargs):
        planned.extend(configs)
        raise compare.UserError("stop here")

    monkeypatch.setattr(compare, "run_all", capture)
    exp = tmp_path / "exp.toml"
    exp.write_text('methods = "fedavg,fedldf"\nseeds = "3"\nrounds = 5\nlr = 0.2\ndataset = "synthetic"\n'
                   'model = "mlp"\nclients = 6\ncohort = 3\nlocal_steps = 1\nbatch_size = 8\n')
    assert main(["compare", "--config", str(exp), "--lr", "0.3", "--out", str(tmp_path / "c")]) == 2
    assert "stop here" in capsys.readouterr().err
    assert [(c.method, c.seed, c.rounds, c.client_lr) for c in planned] == [("fedavg", 3, 5, 0.3),
                                                                             ("fedldf", 3, 5, 0.3)]
    for text, words in [(None, "does not exist"), ('methods = "fedavg"\nbogus = 1\n', "key 'bogus' is not a run"),
                        ("rounds = 2\n", "--methods is required")]:
        path = tmp_path / "missing.toml" if text is None else tmp_path / "bad.toml"
        if text is not None:
            path.write_text(text)
        assert main(["compare", "--config", str(path), "--out", str(tmp_path / "d")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err, err
        assert not (tmp_path / "d").exists()


def test_plot_reads_a_run_whose_last_line_a_kill_cut_short(done, tmp_path, capsys):
    """A torn last line of metrics.jsonl is left out, as --resume leaves it out (was 'not a run directory')."""
    import shutil

    run = tmp_path / "torn"
    shutil.copytree(done / "fedavg-seed0", run)
    whole = summaries.load_run(str(run))["records"]
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"round": 3, "test_accur')
    assert summaries.load_run(str(run))["records"] == whole
    assert main(["plot", str(run), "--out", str(tmp_path / "p")]) == 0


def test_an_interrupted_comparison_resumes_keeps_its_finished_runs_and_writes_the_table_again(done, tmp_path,
                                                                                            capsys):
    """``compare --resume DIR``: finished runs are left byte for byte, a run the stop never started is run
    (to the same records as in the uninterrupted comparison), and the table is the uninterrupted one."""
    import shutil

    out = tmp_path / "c"
    shutil.copytree(done, out)
    shutil.rmtree(out / "fedldf-seed1")  # stopped before its turn
    for name in ("comparison.csv", "comparison.md"):
        (out / name).unlink()
    kept = {p: p.read_bytes() for p in (out / "fedavg-seed0").rglob("*") if p.is_file()}
    assert main(["compare", "--resume", str(out), "--seeds", "3"]) == 2  # the job's own settings only
    assert "--seeds cannot be combined with compare --resume" in capsys.readouterr().err
    assert main(["compare", "--resume", str(out)]) == 0
    said = capsys.readouterr().out
    assert "1/4 fedavg-seed0: complete, kept" in said and "4/4 fedldf-seed1: complete" in said
    assert {p: p.read_bytes() for p in kept} == kept
    wall = ("round_time_s", "wall_time_s", "host_time_s")
    assert [{k: v for k, v in r.items() if k not in wall} for r in _records(out, "fedldf", 1)] == [
        {k: v for k, v in r.items() if k not in wall} for r in _records(done, "fedldf", 1)]
    assert (out / "comparison.csv").read_text() == (done / "comparison.csv").read_text()
    assert main(["compare", "--resume", str(tmp_path)]) == 2
    assert "is not a fedpartial compare folder to resume" in capsys.readouterr().err
