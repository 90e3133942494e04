"""Redraws the documentation's figures from the committed result files, without running anything again:
``python -m benchmarks.redraw`` (then ``python -m benchmarks.render_docs`` copies them to the pages).

Each benchmark draws its figure when it runs; this draws the same figure from its JSON with the current
:mod:`benchmarks.figure_style` (after a change of style, every page gets it at once).  It covers every figure a
page shows (:data:`DRAWERS`, by the file's ``benchmark``): FedLDF's error against upload, FedDH's and FedDHAD's
accuracy against simulated time, EmbracingFL's experiments, the deadlines, privacy, personalised, tiers and
drift benchmarks, the LoRA methods, FedSPU's curves and memory, the asynchronous runs, the speed-ups of ``conv_lowering`` (the
lowerings against the plain loop, ``auto``'s pick in red) and of ``strategies``.  A figure is drawn beside its
JSON, under the same name (``fedspu``: ``-curves-`` and ``-memory-`` inserted).
"""

from __future__ import annotations

import argparse
import importlib
import json
import pathlib

from benchmarks import figure_style

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def fedspu(path: pathlib.Path) -> list[pathlib.Path]:
    module = importlib.import_module("benchmarks.fedspu")
    d = json.loads(path.read_text())
    tag = path.stem.removeprefix("fedspu-")
    out = [RESULTS / f"fedspu-memory-{tag}.png"]
    module.plot_memory(d["tables"]["memory"], str(out[0]))
    if d["runs"]:
        out.append(RESULTS / f"fedspu-curves-{tag}.png")
        module.plot_curves(d["runs"], str(out[1]))
    return out


def _drawer(benchmark: str, function: str, key: str):
    """A drawer for a benchmark whose ``function(data[key], path)`` draws its figure from its file's ``key``."""
    def draw(path: pathlib.Path) -> list[pathlib.Path]:
        out = path.with_suffix(".png")
        getattr(importlib.import_module(f"benchmarks.{benchmark}"), function)(json.loads(path.read_text())[key],
                                                                              str(out))
        return [out]
    draw.__doc__ = f"``benchmarks/{benchmark}.py``'s figure from its {key}."
    return draw


def _runs_plot(benchmark: str):
    """A drawer for a benchmark whose ``plot(runs, path)`` reads only the runs of its file."""
    return _drawer(benchmark, "plot", "runs")


def _rows_figure(benchmark: str):
    """A drawer for a method-family benchmark, whose ``figure(rows, path)`` reads the rows of its file."""
    return _drawer(benchmark, "figure", "rows")


def comparison(path: pathlib.Path) -> list[pathlib.Path]:
    """FedDH's or FedDHAD's accuracy curves: the benchmark's methods (and the variants the file ran), its method
    highlighted, the target of each panel from the summary."""
    d = json.loads(path.read_text())
    bench = importlib.import_module(f"benchmarks.{d['benchmark']}")
    out = path.with_suffix(".png")
    importlib.import_module("benchmarks.feddh").plot(d["runs"], d["summary"], str(out), bench.METHODS, bench.LABELS,
                                                     d["benchmark"])
    return [out]


def deadlines(path: pathlib.Path) -> list[pathlib.Path]:
    """The deadline settings' curves (each panel with FedAvg without a deadline as its reference)."""
    runs = json.loads(path.read_text())["runs"]
    settings = [s for s in dict.fromkeys(r["setting"] for r in runs) if s != "no deadline"]
    out = path.with_suffix(".png")
    importlib.import_module("benchmarks.deadlines").plot(runs, settings, str(out))
    return [out]


def privacy(path: pathlib.Path) -> list[pathlib.Path]:
    """Accuracy against ε from the file's summary."""
    out = path.with_suffix(".png")
    importlib.import_module("benchmarks.privacy").plot(json.loads(path.read_text())["summary"], str(out))
    return [out]


def lora(path: pathlib.Path) -> list[pathlib.Path]:
    """The LoRA methods' accuracy (perplexity) against upload, the pre-trained base's as its reference."""
    d = json.loads(path.read_text())
    language = bool(d["language_model"])
    out = path.with_suffix(".png")
    importlib.import_module("benchmarks.lora").figure(
        d["rows"], out, d["pretrained_perplexity"] if language else d["pretrained_accuracy"], language)
    return [out]


def asynchronous(path: pathlib.Path) -> list[pathlib.Path]:
    module = importlib.import_module("benchmarks.async")
    d = json.loads(path.read_text())
    out = path.with_suffix(".png")
    module.plot(d["runs"], d["protocol"]["datasets"], str(out))
    return [out]


def speedups(path: pathlib.Path) -> list[pathlib.Path]:
    """``conv_lowering``'s rows as bars: the plain loop's speed-up of what ``auto`` picks and of each measured
    cell, one panel per row (model, input, K)."""
    d = json.loads(path.read_text())
    rows = d["results"]
    fig, axes = figure_style.figure(len(rows), height=3.0, columns=2)
    for ax, r in zip(axes, rows):
        auto = (r.get("auto") or {}).get("cell")
        cells = [(name, c["speedup_vs_plain"]) for name, c in r["cells"].items()
                 if name != "plain_loop" and c.get("speedup_vs_plain")]
        names = [n + (" = auto" if n == auto else "") for n, _ in cells]
        ax.barh(range(len(cells)), [s for _, s in cells],
                color=[figure_style.colour("auto") if n == auto else "#9ecae1" for n, _ in cells])
        ax.set_yticks(range(len(cells)), names)
        ax.axvline(1.0, color=figure_style.colour("plain loop"), lw=1.5, ls="--")
        ax.set_xlabel("× the plain loop's rounds/s")
        ax.set_title(r["row"].replace("@", " ").replace(":", ", K = ") + ("" if r.get("dtype", "float32") == "float32"
                                                                          else f", {r['dtype']}"))
        ax.invert_yaxis()
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    figure_style.shared_legend(fig, axes, extra=[
        (Patch(color=figure_style.colour("auto")), "what auto picked"), (Patch(color="#9ecae1"), "the other cells"),
        (Line2D([], [], color=figure_style.colour("plain loop"), ls="--"), "the plain loop (1×)")], columns=3)
    out = path.with_suffix(".png")
    figure_style.save(fig, str(out))
    return [out]


STRATEGY_COLOURS = {"fused": "#2ca02c", "fused_chunk": "#98df8a", "fused_unrolled": "#637939",
                    "stepwise_1": "#1f77b4", "stepwise_chunk": "#9ecae1"}


def strategies(path: pathlib.Path) -> list[pathlib.Path]:
    """``strategies``' speed-ups over the plain loop: a panel per model, a group of bars per cohort size."""
    import numpy as np

    d = json.loads(path.read_text())
    models = list(dict.fromkeys(r["model"] for r in d["results"]))
    fig, axes = figure_style.figure(len(models), height=3.4)
    for ax, model in zip(axes, models):
        rows = [r for r in d["results"] if r["model"] == model]
        names = [m["strategy"] for m in rows[0]["measurements"] if m["strategy"] != "plain_loop"]
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            values = [next((m.get("speedup_vs_plain") or 0 for m in r["measurements"] if m["strategy"] == name), 0)
                      for r in rows]
            ax.bar(np.arange(len(rows)) + (i - (len(names) - 1) / 2) * width, values, width, label=name,
                   color=STRATEGY_COLOURS.get(name))
        ax.axhline(1.0, color=figure_style.colour("plain loop"), lw=1.5, ls="--")
        ax.set_xticks(range(len(rows)), [f"K = {r['cohort_size']}" for r in rows])
        ax.set_ylabel("× the plain loop's rounds/s")
        ax.set_title(model)
    figure_style.shared_legend(fig, axes, columns=3)
    out = path.with_suffix(".png")
    figure_style.save(fig, str(out))
    return [out]


DRAWERS = {"fedspu": fedspu, "async": asynchronous, "conv_lowering": speedups, "strategies": strategies,
           "fedldf": _runs_plot("fedldf"), "embracingfl": _runs_plot("embracingfl"), "feddh": comparison,
           "feddhad": comparison, "deadlines": deadlines, "privacy": privacy, "lora": lora,
           **{name: _rows_figure(name) for name in ("personalised", "tiers", "drift")}}


def shown() -> list[pathlib.Path]:
    """The result files of the figures the pages (``README.md``, ``docs/``) show, in name order."""
    from benchmarks import render_figures

    root = RESULTS.parents[1]
    texts = [p.read_text(encoding="utf-8") for p in [root / "README.md", *(root / "docs").rglob("*.md")]]
    return sorted({RESULTS / render_figures.result_of(png) for png in render_figures.used(texts)})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.redraw", description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="*", help="result files (default: those of the figures the pages show)")
    args = p.parse_args(argv)
    paths = [pathlib.Path(f).resolve() for f in args.files] or shown()
    for path in paths:
        benchmark = json.loads(path.read_text()).get("benchmark")
        if benchmark in DRAWERS:
            for out in DRAWERS[benchmark](path):
                print(f"drew {out.relative_to(RESULTS.parents[1])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
