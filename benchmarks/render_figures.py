"""The figures of the documentation: the PNGs the benchmarks draw beside their results in ``benchmarks/results/``,
copied into ``docs/assets/benchmarks/`` (the site is built from ``docs/`` and cannot reach the results folder)
and shown on the reproduction pages and at the head of the benchmarks page.  ``benchmarks/render_docs.py`` calls
these; ``tests/test_docs.py`` checks the copies are current as it checks the pages."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
FIGURES = ROOT / "docs" / "assets" / "benchmarks"
#: the figures the benchmarks page leads with: (file, what it shows)
AT_A_GLANCE = (
    ("conv-lowering-cpu-cpu-20261203.png",
     "What the default `auto` runs on a CPU (2 cores, nothing else running; ratios measured side by side in one run), "
     "against a plain per-client loop, FedAvg; red: the layout auto picked, dashed: the loop"),
    ("strategies-gpu-nvidia-h100-80gb-hbm3.png",
     "Each strategy against a plain per-client loop on an NVIDIA H100 (the fused round is what auto runs there)"),
    ("fedldf-gpu-nvidia-h100-80gb-hbm3.png", "FedLDF and its baselines: test error against cumulative upload"),
    ("fedspu-curves-gpu-nvidia-h100-80gb-hbm3.png", "FedSPU and the dropout baselines: accuracy against rounds (GPU)"),
    ("privacy-cpu-cpu.png", "DP-FedAvg and DP-FedLDF: test accuracy against ε (mnist5k, 1,000 clients)"),
)
_KIND = {"curves": "accuracy against rounds", "memory": "memory"}


def result_of(png: str) -> str:
    """The result file a figure was drawn from (``fedspu-curves-X.png`` -> ``fedspu-X.json``)."""
    return re.sub(r"-(curves|memory)(?=-)", "", png[:-4], count=1) + ".json"


def figures_of(result_names) -> list[str]:
    """The PNGs drawn beside the given result files, in name order."""
    names = set(result_names)
    return [p.name for p in sorted(RESULTS.glob("*.png")) if result_of(p.name) in names]


def figure_lines(pngs, prefix: str) -> list[str]:
    """Markdown showing each figure, ``prefix`` the path from the page to ``docs/assets/benchmarks/``."""
    lines = []
    for png in pngs:
        kind = next((v for k, v in _KIND.items() if f"-{k}-" in png), "figure")
        lines += [f"![{kind} from {result_of(png)}]({prefix}{png})", "",
                  f"*Figure:* `benchmarks/results/{png}`, drawn by the benchmark from `{result_of(png)}`.", ""]
    return lines


def at_a_glance(prefix: str = "assets/benchmarks/") -> list[str]:
    """The benchmarks page's opening figures (those whose PNG exists)."""
    lines = []
    for png, caption in AT_A_GLANCE:
        if (RESULTS / png).exists():
            lines += [f"![{caption}]({prefix}{png})", "", f"*{caption}* (`benchmarks/results/{png}`).", ""]
    return lines


def used(texts) -> set[str]:
    """The figures the rendered pages show."""
    return {m for text in texts for m in re.findall(r"assets/benchmarks/([\w.-]+\.png)", text)}


def copies(names) -> dict[pathlib.Path, bytes]:
    """Each shown figure's copy under ``docs/assets/benchmarks/`` with the bytes it should hold."""
    return {FIGURES / n: (RESULTS / n).read_bytes() for n in sorted(names)}


def collapsible(title: str, body: list[str]) -> list[str]:
    """``body`` in a closed ``pymdownx.details`` block (its Markdown indented by four spaces)."""
    return [f'??? note "{title}"', ""] + [("    " + line) if line else "" for line in body] + [""]
