"""The throughput suite's report (``fedpartial bench``): the figures derived from a cell's measurements,
its table, the figure of every runner's ratio to the plain loop, and where the JSON goes.
"""

from __future__ import annotations

import datetime
import math
import os

import numpy as np

from fedpartial._src.bench.kit import slug


def derive(record: dict) -> dict:
    """Adds the figures computed from a cell's measurements (in place; returns the record).

    Per runner: ``ratio_to_plain``, ``achieved_flops_per_s`` (XLA's count), ``full_model_flops_per_s``
    (the analytic full-model training count, FedAvg's work: on a GPU XLA counts no cuDNN conv) and, for a
    method other than FedAvg,
    ``round_time_over_fedavg`` (its round time over FedAvg's with the same resolved strategy, both
    measured in turns) and ``phase_overhead_over_fedavg``: ``1 + (Δ selection + Δ aggregation) /
    FedAvg's round time``, where Δ is the method's phase time minus FedAvg's (the separately jitted
    phases: what the method adds to a FedAvg round, less exposed to a busy machine than the ratio of
    two whole rounds).
    """
    entries = record["runners"]
    plain = next((e.get("rounds_per_s") for e in entries if e["strategy"] == "plain_loop"), None)
    fedavg = {e.get("resolved_strategy"): e for e in entries if e["method"] == "fedavg" and e.get("round_s")}
    phases = record["phases"]
    for e in entries:
        if plain and e.get("rounds_per_s"):
            e["ratio_to_plain"] = e["rounds_per_s"] / plain
        flops = phases.get(e["method"], {}).get("round_flops")
        if flops and e.get("rounds_per_s") and e["strategy"] != "plain_loop":
            e["achieved_flops_per_s"] = flops * e["rounds_per_s"]
        work = next((p["full_model_training_flops"] for p in phases.values() if "full_model_training_flops" in p),
                    None)
        if work and e.get("rounds_per_s"):
            e["full_model_flops_per_s"] = work * e["rounds_per_s"]
        base = fedavg.get(e.get("resolved_strategy"))
        if e["method"] == "fedavg" or not base or not e.get("round_s"):
            continue
        e["round_time_over_fedavg"] = e["round_s"] / base["round_s"]
        own, avg = phases.get(e["method"], {}), phases.get("fedavg", {})
        if all(name in p for p in (own, avg) for name in ("selection_s", "aggregation_s")):
            added = sum(own[name] - avg[name] for name in ("selection_s", "aggregation_s"))
            e["phase_overhead_over_fedavg"] = 1.0 + added / base["round_s"]
    return record


def default_out(device: dict, when: datetime.datetime) -> str:
    name = f"throughput-{slug(device['backend'] + '-' + device['device_kind'])}-{when:%Y%m%d}.json"
    return os.path.join("benchmarks", "results", name)


def table(record: dict) -> str:
    title = f"{record['model']}  K={record['cohort_size']}  ({record['num_params']} params)"
    if record.get("skipped"):
        return f"{title}: skipped, {record['skipped']}"
    head = (f"{'method':<8}{'strategy':<28}{'rounds/s':>10}{'steps/s':>10}{'vs plain':>10}{'vs fedavg':>10}"
            f"{'phases':>8}{'GFLOP/s':>9}{'warm-up s':>10}")
    lines = [title, head, "-" * len(head)]
    for e in record["runners"]:
        strategy = e["strategy"] if e["strategy"] == e.get("resolved_strategy", e["strategy"]) \
            else f"{e['strategy']}={e['resolved_strategy']}"
        if e.get("also"):
            strategy += " (" + ",".join(e["also"]) + ")"
        if e.get("error") or e.get("skipped"):
            lines.append(f"{e['method']:<8}{strategy:<28}  " + (f"error: {e['error'][:80]}" if e.get("error")
                                                                 else f"skipped: {e['skipped'][:80]}"))
            continue

        def fmt(value, spec):
            return "" if value is None else format(value, spec)
        flops = e.get("achieved_flops_per_s")
        lines.append(
            f"{e['method']:<8}{strategy:<28}{fmt(e.get('rounds_per_s'), '.4g'):>10}"
            f"{fmt(e.get('client_steps_per_s'), '.4g'):>10}{fmt(e.get('ratio_to_plain'), '.2f'):>10}"
            f"{fmt(e.get('round_time_over_fedavg'), '.2f'):>10}{fmt(e.get('phase_overhead_over_fedavg'), '.3f'):>8}"
            f"{fmt(flops and flops / 1e9, '.3g'):>9}"
            f"{fmt(e.get('warmup_s'), '.2f'):>10}")
    for method, phases in record["phases"].items():
        parts = [f"{name[:-2]} {phases[name] * 1e3:.1f} ms" for name in
                 ("local_training_s", "selection_s", "aggregation_s", "evaluation_s") if name in phases]
        lines.append(f"phases {method}: " + (", ".join(parts) or phases.get("error") or phases.get("skipped", "")))
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    """Ratio to the plain loop of every runner (bars: strategies; groups: model and cohort), one panel
    per method, and FedLDF's (or any method's) round time over FedAvg's with the same strategy."""
    from matplotlib.figure import Figure

    records = [r for r in report["results"] if not r.get("skipped")]
    methods = list(dict.fromkeys(e["method"] for r in records for e in r["runners"]))
    strategies = list(dict.fromkeys(e["strategy"] for r in records for e in r["runners"]
                                    if e["strategy"] != "plain_loop"))
    others = [m for m in methods if m != "fedavg"]
    fig = Figure(figsize=(max(6.0, 1.2 * len(records) + 2), 3.2 * (len(methods) + bool(others))))
    axes = fig.subplots(len(methods) + bool(others), 1, squeeze=False)[:, 0]
    labels = [f"{r['model']}\nK={r['cohort_size']}" for r in records]
    x = np.arange(len(records))
    width = 0.8 / max(len(strategies), 1)

    def bars(ax, value_of, method, dots_of=None):
        for i, strategy in enumerate(strategies):
            values, dots = [], []
            for r in records:
                e = next((e for e in r["runners"] if e["method"] == method and
                          (e["strategy"] == strategy or strategy in e.get("also", ()))), {})
                values.append(value_of(e) or math.nan)
                dots.append((dots_of and dots_of(e)) or math.nan)
            where = x + (i - (len(strategies) - 1) / 2) * width
            ax.bar(where, values, width, label=strategy)
            if dots_of is not None:
                ax.plot(where, dots, "k.", label="from phases" if i == 0 else None)
        ax.set_xticks(x, labels, fontsize=7)

    for ax, method in zip(axes, methods):
        bars(ax, lambda e: e.get("ratio_to_plain"), method)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(0.95, color="k", lw=0.8, ls=":")
        ax.set_ylabel("rounds/s ÷ plain loop")
        ax.set_title(f"{method}: speed relative to a plain per-client loop (same run)", fontsize=9)
    if others:
        ax = axes[-1]
        for method in others:
            bars(ax, lambda e: e.get("round_time_over_fedavg"), method, lambda e: e.get("phase_overhead_over_fedavg"))
        ax.axhline(1.10, color="r", lw=0.8, ls=":")
        ax.set_ylabel("round time ÷ FedAvg's")
        ax.set_title(f"{', '.join(others)}: round time over FedAvg's (bars: whole rounds, same strategy; "
                     "dots: 1 + added selection and aggregation phases)", fontsize=8)
        ax.legend(fontsize=7, ncol=3)
    axes[0].legend(fontsize=7, ncol=3)
    device = report["device"]
    fig.suptitle(f"fedpartial bench on {device['backend']} ({device['device_kind']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
