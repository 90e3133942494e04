"""Reading run directories back, and mean ± std over seeds: what ``fedpartial compare``,
``fedpartial plot`` and many-seed runs (:mod:`~fedpartial._src.experiment.replicas`) summarise with.

**Mean ± std** over seeds uses the population standard deviation (``ddof=0``, numpy's default): one
seed gives ± 0, not an undefined value.  Values come from each run's ``summary.json``.  **Curves over
seeds** are taken at the evaluated rounds that every seed has; at each such round the x value
(cumulative upload bytes or simulated time) is the seeds' mean and the band is the accuracy's mean ± std.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from fedpartial._src.core.errors import UserError

#: (summary key, column title) of the comparison table, in its order
COLUMNS = (
    ("final_test_accuracy", "final accuracy"),
    ("best_test_accuracy", "best accuracy"),
    ("total_upload_bytes", "upload bytes"),
    ("total_simulated_time_s", "simulated time (s)"),
    ("rounds", "rounds"),
)


def parse_distinct(text: str, flag: str, convert: Callable[[str], Any], allowed: str, item: str) -> list:
    """Comma-separated distinct values of ``flag``: ``convert(part)`` gives a value, or None where the part is
    not ``allowed`` (a phrase, e.g. "whole numbers from 0 to 9"); ``item`` names one value in the message."""
    values = []
    for part in str(text).split(","):
        value = convert(part.strip())
        if value is None:
            raise UserError(f"{flag} {text!r} is not allowed: it must be {allowed}.")
        values.append(value)
    if len(set(values)) < len(values):
        raise UserError(f"{flag} {text!r} names {item} twice; name each {item.split(' ', 1)[1]} once.")
    return values


def metric_records(lines) -> list[dict]:
    """The round records among ``metrics.jsonl``'s lines, as ``--resume`` reads them: a line a kill cut short
    (or any line that is not one JSON record of a round) is left out."""
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # the line a kill cut short
        if isinstance(record, dict) and isinstance(record.get("round"), int):
            records.append(record)
    return records


def load_run(run_dir: str) -> dict:
    """A run directory's ``config`` and per-round ``records`` (and ``summary`` when written, else None)."""
    def read(name):
        with open(os.path.join(run_dir, name)) as f:
            return f.read()

    try:
        config = json.loads(read("config.json"))
        records = metric_records(read("metrics.jsonl").splitlines())
        if not isinstance(config, dict):
            raise ValueError
    except (OSError, ValueError):
        raise UserError(f"{run_dir!r} is not a run directory (it needs a readable config.json and "
                        f"metrics.jsonl, as fedpartial run writes).") from None
    try:
        summary = json.loads(read("summary.json"))
    except (OSError, ValueError):
        summary = None
    return {"dir": run_dir, "config": config, "records": records, "summary": summary}


def _number(value) -> float:
    return math.nan if value is None else float(value)  # strict JSON writes NaN as null


def _label(run: dict, method: str) -> str:
    """A method as tables and figures show it: the name its summary gives (``my_method``, not the import string
    ``package.module:factory`` its config.json keeps to run it again)."""
    label = (run.get("summary") or {}).get("method")
    return (label if isinstance(label, str) and label else method) + mode_label(run.get("config") or {})


def mode_label(config: dict) -> str:
    """``" (async C=… M=…)"`` for an asynchronous run's ``config.json``, ``""`` for a synchronous one."""
    if config.get("mode") != "async":
        return ""
    buffer = config.get("buffer") or config.get("cohort_size")
    return f" (async C={config.get('concurrency') or buffer} M={buffer})"


def table(runs: Sequence[dict], columns: Sequence[tuple[str, str]] = COLUMNS) -> list[dict]:
    """One row per method (in first-seen order): ``method``, ``seeds`` and ``<key>_mean`` / ``<key>_std``
    for every key of ``columns`` (default :data:`COLUMNS`), over the method's runs (their ``summary.json``)."""
    by_method: dict[str, list[dict]] = {}
    for run in runs:
        if run["summary"] is None:
            raise UserError(f"{run['dir']!r} has no summary.json; the run did not finish.")
        by_method.setdefault(run["config"]["method"], []).append(run)
    rows = []
    for method, group in by_method.items():
        row = {"method": _label(group[0], method), "seeds": ",".join(str(r["config"]["seed"]) for r in group)}
        for key, _ in columns:
            values = np.array([_number(r["summary"][key]) for r in group], np.float64)
            row[f"{key}_mean"], row[f"{key}_std"] = float(np.mean(values)), float(np.std(values))
        rows.append(row)
    return rows


def table_csv(rows: Sequence[dict]) -> str:
    fields = ["method", "seeds"] + [f"{key}_{part}" for key, _ in COLUMNS for part in ("mean", "std")]
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=fields, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: (repr(v) if isinstance(v, float) else v) for k, v in row.items()})
    return out.getvalue()


def _cell(key: str, mean: float, std: float) -> str:
    if key == "total_upload_bytes":  # bytes read best in MB
        return f"{mean / 1e6:,.2f} ± {std / 1e6:,.2f} MB"
    if key == "rounds":
        return f"{mean:g} ± {std:g}"
    if key in ("total_simulated_time_s", "rounds_per_s"):
        return f"{mean:,.1f} ± {std:,.1f}"
    return f"{mean:.4f} ± {std:.4f}"


def table_markdown(rows: Sequence[dict], columns: Sequence[tuple[str, str]] = COLUMNS) -> str:
    head = ["method", "seeds"] + [title for _, title in columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 2 + ["---:"] * len(columns)) + "|"]
    for row in rows:
        cells = [row["method"], row["seeds"]] + [_cell(k, row[f"{k}_mean"], row[f"{k}_std"]) for k, _ in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_table(rows: Sequence[dict], out_dir: str) -> tuple[str, str]:
    """Writes ``comparison.csv`` and ``comparison.md``; returns their paths."""
    paths = os.path.join(out_dir, "comparison.csv"), os.path.join(out_dir, "comparison.md")
    for path, text in zip(paths, (table_csv(rows), table_markdown(rows))):
        with open(path, "w") as f:
            f.write(text)
    return paths


def _evaluated(run: dict) -> dict[int, dict]:
    return {r["round"]: r for r in run["records"] if r.get("test_accuracy") is not None}


def _clock(record: dict) -> float:
    """The simulated clock at the end of a round (runs before it existed: their simulated time, the same)."""
    return float(record.get("simulated_clock_s", record["cumulative_simulated_time_s"]))


def run_curve(run: dict, label: str) -> dict:
    """One run's accuracy at its evaluated rounds against round, upload bytes and the simulated clock."""
    points = sorted(_evaluated(run).items())
    column = lambda key: np.array([float(r[key]) for _, r in points], np.float64)  # noqa: E731
    return {"label": label, "round": np.array([t for t, _ in points], np.float64),
            "bytes": column("cumulative_upload_bytes"), "time": np.array([_clock(r) for _, r in points], np.float64),
            "accuracy": column("test_accuracy"), "std": None}


def mean_curve(runs: Sequence[dict], label: str) -> dict:
    """The seeds' mean accuracy (and std) at the evaluated rounds all of them have; x values are means too."""
    evaluated = [_evaluated(run) for run in runs]
    rounds = sorted(set.intersection(*(set(e) for e in evaluated)))
    stack = lambda key: np.array([[float(e[t][key]) for t in rounds] for e in evaluated], np.float64)  # noqa: E731
    acc = stack("test_accuracy")
    return {"label": label, "round": np.array(rounds, np.float64),
            "bytes": stack("cumulative_upload_bytes").mean(0),
            "time": np.array([[_clock(e[t]) for t in rounds] for e in evaluated], np.float64).mean(0),
            "accuracy": acc.mean(0), "std": acc.std(0)}


def method_curves(runs: Sequence[dict]) -> list[dict]:
    by_method: dict[str, list[dict]] = {}
    for run in runs:
        by_method.setdefault(run["config"]["method"], []).append(run)
    return [mean_curve(group, f"{_label(group[0], method)} (mean ± std of {len(group)} seed{'s' * (len(group) > 1)})")
            for method, group in by_method.items()]
