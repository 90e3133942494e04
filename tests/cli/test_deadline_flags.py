"""``fedpartial run`` with a deadline, over-selection and availability: the flags and TOML keys, one-sentence
refusals, and a small run whose metrics carry the six per-round fields, consistent with each other."""

import json
import math

import pytest

from fedpartial._src.cli import config_file
from fedpartial._src.cli.main import build_parser, config_from_args, main

SMALL = ["run", "--rounds", "3", "--clients", "8", "--cohort", "3", "--local-steps", "2", "--batch-size", "8",
         "--model", "mlp"]
FIELDS = ("clients_sampled", "clients_finished", "clients_dropped", "wasted_flops", "wasted_bytes",
          "simulated_clock_s")


def test_flags_and_toml_keys_set_the_run_config(tmp_path):
    args = build_parser().parse_args(["run", "--round-deadline", "2.5", "--straggler-policy", "partial",
                                      "--over-select", "1.3", "--availability", "diurnal:0.2:0.8"])
    config = config_from_args(args)
    assert (config.round_deadline, config.deadline_quantile, config.straggler_policy, config.over_select,
            config.availability) == (2.5, None, "partial", 1.3, "diurnal:0.2:0.8")
    assert config.sampled_size == math.ceil(1.3 * 10) == 13
    path = tmp_path / "exp.toml"
    path.write_text('deadline-quantile = 0.8\nover-select = 2\navailability = "0.7"\n')
    tokens = ["--config", str(path)]
    parser = build_parser()
    args = parser.parse_args(["run", *tokens])
    config_file.merge(args, parser.command("run"), tokens, str(path))
    config = config_from_args(args)
    assert (config.deadline_quantile, config.over_select, config.availability) == (0.8, 2.0, "0.7")


@pytest.mark.parametrize("args, words", [
    (["--round-deadline", "3", "--deadline-quantile", "0.5"], "not allowed with argument --round-deadline"),
    (["--round-deadline", "-1"], "--round-deadline -1 is not allowed"),
    (["--straggler-policy", "partial"], "needs a deadline"),
    (["--over-select", "0.9"], "--over-select 0.9 is not allowed"),
    (["--availability", "1.2"], "a probability must be in (0, 1]"),
    (["--availability", "/nonexistent/trace.csv"], "no such file"),
])
def test_bad_values_exit_2_with_one_sentence(tmp_path, capsys, args, words):
    assert main(SMALL + ["--out", str(tmp_path / "out")] + args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err
    assert not (tmp_path / "out").exists()


def test_a_run_records_who_reported_what_was_wasted_and_the_clock(tmp_path, capsys):
    """Over-selection (5 sampled for 3), the partial policy at the 0.8-quantile deadline, and a trace in which
    client 7 is never available and the others only from 30 s on."""
    trace = tmp_path / "trace.csv"
    trace.write_text("client_id,start_s,end_s\n" + "".join(f"{i},30,1e9\n" for i in range(7)))
    assert main(SMALL + ["--out", str(tmp_path), "--name", "r", "--over-select", "1.5", "--deadline-quantile",
                         "0.8", "--straggler-policy", "partial", "--availability", str(trace)]) == 0
    records = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    clock = 30.0  # the server waited for the trace's intervals to open
    for r in records:
        assert all(name in r for name in FIELDS)
        assert r["clients_sampled"] == 5 and r["clients_finished"] == r["clients"] <= 3
        assert r["clients_finished"] + r["clients_dropped"] == r["clients_sampled"]
        assert r["wasted_flops"] >= 0 and r["wasted_bytes"] > 0  # the two cut clients had downloaded
        clock += r["simulated_time_s"]
        assert r["simulated_clock_s"] == pytest.approx(clock, rel=1e-12)
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["total_clients_dropped"] == sum(r["clients_dropped"] for r in records)
    assert summary["simulated_clock_s"] == records[-1]["simulated_clock_s"]
    assert "did not report" in capsys.readouterr().out
    csv_header = (tmp_path / "r" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert set(FIELDS) <= set(csv_header)
