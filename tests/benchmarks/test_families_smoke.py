"""The method-family benchmarks (personalised, tiers, drift) run end to end at their tiny size, write their JSON
and figure row by row, continue a cut-off file without redoing its rows, refuse a file of other settings, and
render into the docs with their figures; the pooled statistics and FIARSE's tier-aligned ratios are right."""

import json

import numpy as np
import pytest

from benchmarks import drift, families, personalised, render_families, tiers

pytestmark = pytest.mark.xdist_group("families")  # the module fixture runs the benchmarks once, on one worker


def result(out, benchmark):
    (path,) = out.glob(f"{benchmark}-*-tiny.json")
    return path, json.loads(path.read_text())


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """Each benchmark at its tiny size: FedAvg + FT (personalised), FIARSE (tiers), FedAvg and SCAFFOLD (drift)."""
    out = tmp_path_factory.mktemp("families")
    assert personalised.main(["--size", "tiny", "--methods", "fedavg_ft,fedbn", "--out", str(out)]) == 0
    assert tiers.main(["--size", "tiny", "--methods", "fiarse", "--out", str(out)]) == 0
    assert drift.main(["--size", "tiny", "--methods", "fedavg,scaffold", "--out", str(out)]) == 0
    return out


def test_each_benchmark_writes_its_rows_provenance_and_figure(ran):
    for benchmark, count in (("personalised", 1), ("tiers", 1), ("drift", 2)):
        path, d = result(ran, benchmark)
        assert d["benchmark"] == benchmark and d["device"]["platform"] and d["date"] and d["git_revision"]
        assert d["command"].startswith(f"python -m benchmarks.{benchmark} --size tiny")
        assert len(d["rows"]) == count and d["total_time_s"] > 0 and d["total_cpu_s"] > 0
        assert path.with_suffix(".png").stat().st_size > 0
    _, p = result(ran, "personalised")
    (row,) = p["rows"]
    assert row["method"] == "fedavg_ft" and len(row["per_seed"]) == 2 and 0 <= row["personal_accuracy"] <= 1
    assert row["personal_accuracy"] == pytest.approx(np.mean(row["per_seed"]))
    assert any("FedBN is left out on synthetic" in n for n in p["notes"])  # no BatchNorm model for vectors
    _, t = result(ran, "tiers")
    (row,) = t["rows"]
    assert row["mix"] == [1, 1, 6] and 0 <= row["weak_accuracy"] <= 1 and row["simulated_s_per_round"] > 0
    _, d = result(ran, "drift")
    by = {r["method"]: r for r in d["rows"]}
    assert by["scaffold"]["mb_per_round"] == pytest.approx(2 * by["fedavg"]["mb_per_round"], rel=0.01)  # sends twice
    (claim,) = d["claims"]
    gap = by["scaffold"]["test_accuracy"] - by["fedavg"]["test_accuracy"]
    assert claim["scaffold_minus_fedavg"] == pytest.approx(gap)


def test_a_rerun_continues_the_file_and_other_settings_are_refused(ran, monkeypatch):
    path, before = result(ran, "drift")
    monkeypatch.setattr(drift, "run_row", lambda *a: pytest.fail("a row already in the file ran again"))
    assert drift.main(["--size", "tiny", "--methods", "fedavg,scaffold", "--out", str(ran)]) == 0
    assert json.loads(path.read_text())["rows"] == before["rows"]
    with pytest.raises(families.SettingsDiffer, match="other settings \\(methods\\).*--fresh"):
        drift.main(["--size", "tiny", "--methods", "fedavg", "--out", str(ran)])
    # cut off after its first row: the file keeps that row, and a re-run measures only the missing one
    cut = dict(before, rows=before["rows"][:1])
    path.write_text(json.dumps(cut))
    ran_rows = []
    monkeypatch.setattr(drift, "run_row", lambda dataset, alpha, method, s: ran_rows.append(method) or next(
        r for r in before["rows"] if r["method"] == method))
    assert drift.main(["--size", "tiny", "--methods", "fedavg,scaffold", "--out", str(ran)]) == 0
    assert ran_rows == ["scaffold"] and json.loads(path.read_text())["rows"] == before["rows"]


def test_the_docs_show_each_family_with_its_figure_and_the_papers_orderings(ran, monkeypatch):
    results = {p.name: json.loads(p.read_text()) for p in ran.glob("*.json")}
    monkeypatch.setattr(render_families, "RESULTS", ran)
    blocks = render_families.blocks(results)
    assert "FedAvg + FT" in blocks["families-personalised"] and "FedRep ≥ FedPer ≥ LG-FedAvg" in blocks[
        "families-personalised"] and "not measured" in blocks["families-personalised"]
    assert "| synthetic, α=0.5 | 10 (1, 1, 6) | FIARSE |" in blocks["families-tiers"]
    assert "SCAFFOLD ≥ FedAvg (final)" in blocks["families-drift"]
    for name in results:
        assert f"](../assets/benchmarks/{name[:-5]}.png)" in "\n".join(blocks.values())
    assert sorted(p.name for p in render_families.figures(results).values()) == sorted(
        n[:-5] + ".png" for n in results)
    assert "No result file yet" in render_families.blocks({})["families-drift"]


def test_pooled_is_the_mean_and_std_over_every_client_of_every_seed():
    clients = [np.array([0.2, 0.4, 0.9]), np.array([0.5, 0.7, 0.6])]
    mean, std = families.pooled([c.mean() for c in clients], [c.std() for c in clients])
    assert (mean, std) == pytest.approx((np.concatenate(clients).mean(), np.concatenate(clients).std()))


def test_fiarse_clusters_line_up_with_the_capacity_tiers():
    # case 10 at N = 40 is 5 strong, 5 moderate, 30 weak: eight clusters of five, one per tier share
    assert tiers.fiarse_ratios(40, 10) == (1.0, 0.191406, *[0.035156] * 6)
    assert tiers.fiarse_ratios(32, 5) == (1.0, 0.035156)  # 16 strong, 16 weak


@pytest.mark.parametrize("size", ["cpu", "paper"])
def test_every_row_of_the_cpu_and_paper_sizes_is_a_valid_run(size):
    """No training: each benchmark's configurations at the two sizes are accepted (methods, options, data)."""
    for bench, extra in ((personalised, ()), (drift, ()), (tiers, ("cases",))):
        s = bench.SIZES[size]
        assert s["seeds"] == (0, 1) and (size == "cpu" or (s["clients"], s["cohort"]) == (100, 10))
        for dataset in s["datasets"]:
            for alpha in s["alphas"]:
                for method in bench.METHODS:
                    for case in (s["cases"] if extra else [None]):
                        args = (dataset, alpha, case, method, s) if extra else (dataset, alpha, method, s)
                        bench.config_for(*args).validate()
    assert personalised.SIZES["paper"]["datasets"] == ("digits", "mnist5k", "synthetic")
    assert len(tiers.fiarse_ratios(100, 10)) == 100 and len(tiers.fiarse_ratios(100, 5)) == 2
