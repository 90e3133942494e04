"""One look for every figure of the documentation: readable at the page's width, one colour per method.

The site scales a figure down to its text column (about 800 px at a 1400 px window), so a figure is drawn at most
:data:`MAX_WIDTH_IN` inches wide at :data:`DPI` (about 1,000 px) with :data:`FONT_PT`-point text: its axis text
lands no smaller than the page's body text.  At most :data:`MAX_COLUMNS` panels share a row (more wrap onto
further rows), and the legend is one shared legend under the panels (:func:`shared_legend`), not one per panel.
Each method has one colour on every page (:func:`colour`); a variant of a method (``FedSPU+ES``,
``fedbuff+fedldf``) takes its method's colour and differs by line style.

``figure(n)`` gives the figure and its axes, ``shared_legend(fig, axes)`` places the legend, ``save(fig, path)``
writes the PNG.  ``tests/benchmarks/test_figure_style.py`` keeps these rules.
"""

from __future__ import annotations

import math
import re
import zlib

MAX_COLUMNS = 3
MAX_WIDTH_IN = 10.0
PANEL_HEIGHT_IN = 3.6
DPI = 100
FONT_PT = 13
#: the colour of each method (and of the reference lines every comparison has), on every page
METHOD_COLOURS = {
    "plain loop": "#555555", "sync": "#222222", "fedavg": "#222222",
    "fedprox": "#8c564b", "fednova": "#1f77b4", "feddyn": "#7f7f7f", "moon": "#17becf", "scaffold": "#9467bd",
    "fedldf": "#d62728", "random": "#7f7f7f", "random_layers": "#7f7f7f", "hdfl": "#1f77b4", "fedadp": "#2ca02c",
    "fedpart": "#dbdb8d",
    "fedspu": "#1f77b4", "feddrop": "#ff7f0e", "fjord": "#2ca02c", "hermes": "#9467bd", "fedmp": "#8c564b",
    "prunefl": "#e377c2", "afd": "#bcbd22", "fedselect": "#17becf", "feddst": "#393b79", "fiarse": "#637939",
    "embracingfl": "#1f77b4", "heterofl": "#2ca02c", "fedrolex": "#ff7f0e", "depthfl": "#9467bd",
    "inclusivefl": "#8c564b",
    "fedper": "#393b79", "lgfedavg": "#ff9896", "fedrep": "#637939", "fedbn": "#843c39", "fedbabu": "#7b4173",
    "ditto": "#bcbd22", "fedavg_ft": "#222222",
    "feddh": "#d62728", "fedjs": "#2ca02c", "feddhe": "#ff7f0e", "fedad": "#9467bd", "feddhad": "#843c39",
    "fedasync": "#e377c2", "fedbuff": "#1f77b4", "async": "#17becf",
    "fedit": "#1f77b4", "ffa_lora": "#ff7f0e", "fedsa_lora": "#2ca02c", "hetlora": "#d62728", "flexlora": "#9467bd",
    "flora": "#17becf",
    "auto": "#d62728", "stepwise": "#1f77b4", "fused": "#2ca02c",
}
_FALLBACK = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
             "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173")


def method_key(label: str) -> str:
    """The method a label names: its last ``+``-part that is a known method, else its first word, lower case
    (``FedSPU+ES`` -> ``fedspu``, ``fedbuff+fedldf`` -> ``fedldf``, ``DP-FedAvg`` -> ``fedavg``,
    ``fedad@target=literal`` -> ``fedad``)."""
    parts = [re.sub(r"^dp-", "", p.strip().lower()) for p in re.split(r"\+", label)]
    known = [p for p in parts if p in METHOD_COLOURS]
    return known[-1] if known else re.split(r"[\s:(=@]", parts[0])[0]


def colour(label: str) -> str:
    """The colour of the method a label names, the same on every page (an unknown one: fixed by its name)."""
    key = method_key(label)
    return METHOD_COLOURS.get(key) or _FALLBACK[zlib.crc32(key.encode()) % len(_FALLBACK)]


def pyplot():
    """matplotlib's pyplot, headless, with the documentation's text sizes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": FONT_PT, "axes.titlesize": FONT_PT, "axes.labelsize": FONT_PT,
                         "xtick.labelsize": FONT_PT - 1, "ytick.labelsize": FONT_PT - 1,
                         "legend.fontsize": FONT_PT - 1, "figure.dpi": DPI})
    return plt


def figure(panels: int, height: float = PANEL_HEIGHT_IN, columns: int | None = None):
    """``(fig, axes)``: ``panels`` axes, at most ``columns`` (at most :data:`MAX_COLUMNS`; by default that, or
    two for four panels so that the rows are even) a row, the figure at most :data:`MAX_WIDTH_IN` wide; ``axes``
    is a flat list, row by row (extra cells of the last row are hidden)."""
    plt = pyplot()
    columns = min(panels, columns or (2 if panels == 4 else MAX_COLUMNS), MAX_COLUMNS)
    rows = math.ceil(panels / columns)
    width = min(MAX_WIDTH_IN, (3.6 if columns > 2 else 4.9) * columns + 0.6)
    fig, grid = plt.subplots(rows, columns, figsize=(width, height * rows + 0.9), squeeze=False)
    axes = [ax for row in grid for ax in row]
    for ax in axes[panels:]:
        ax.set_visible(False)
    return fig, axes[:panels]


def shared_legend(fig, axes, extra=(), columns: int | None = None) -> None:
    """One legend under the panels with every label the axes drew once (``extra``: more ``(handle, label)``
    pairs, e.g. what a line style means)."""
    seen = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(label, handle)
    pairs = list(seen.items()) + [(label, handle) for handle, label in extra]
    if not pairs:
        fig.tight_layout()
        return
    longest = max(len(label) for label, _ in pairs)
    columns = columns or max(1, min(len(pairs), 4, int(fig.get_figwidth() // (0.1 * longest + 0.9))))
    rows = math.ceil(len(pairs) / columns)
    legend_in = 0.28 * rows + 0.15
    height = fig.get_figheight()
    fig.legend([h for _, h in pairs], [lab for lab, _ in pairs], loc="lower center", ncol=columns, frameon=False)
    fig.tight_layout(rect=(0, legend_in / height, 1, 1))


def save(fig, path: str) -> None:
    fig.savefig(path, dpi=DPI)
    import matplotlib.pyplot as plt

    plt.close(fig)
