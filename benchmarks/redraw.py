"""Redraws the documentation's figures from the committed result files, without running anything again:
``python -m benchmarks.redraw`` (then ``python -m benchmarks.render_docs`` copies them to the pages).

Each benchmark draws its figure when it runs; this draws the same figure from its JSON with the current
:mod:`benchmarks.figure_style` (after a change of style, every page gets it at once).  It covers the figures
whose drawing reads only the result file: FedSPU's curves and memory, the asynchronous runs, the speed-ups of
``conv_lowering`` (the lowerings against the plain loop, ``auto``'s pick in red) and of ``strategies``.
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


DRAWERS = {"fedspu": fedspu, "async": asynchronous, "conv_lowering": speedups, "strategies": strategies}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.redraw", description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="*", help="result files (default: every file of a benchmark listed above)")
    args = p.parse_args(argv)
    paths = [pathlib.Path(f).resolve() for f in args.files] or sorted(RESULTS.glob("*.json"))
    for path in paths:
        benchmark = json.loads(path.read_text()).get("benchmark")
        if benchmark in DRAWERS:
            for out in DRAWERS[benchmark](path):
                print(f"drew {out.relative_to(RESULTS.parents[1])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
