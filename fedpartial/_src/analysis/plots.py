"""The standard figures of runs: test accuracy against round, cumulative upload bytes and simulated time.

``fedpartial plot RUN_DIR...`` draws one line per run (labelled ``METHOD seed SEED``);
``fedpartial compare`` draws one line per method, the mean over seeds with a ±std band
(:func:`fedpartial._src.experiment.summaries.method_curves`).  Each figure is written as PNG and SVG.

Decisions: matplotlib's object API (:class:`matplotlib.figure.Figure`, no ``pyplot``), so
no global state or display backend is involved; SVGs carry no date, so the same runs give
the same file; only evaluated rounds are drawn (``--eval-every`` > 1 leaves gaps); figures
of the same name in the output directory are replaced (they are derived from the runs).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from matplotlib.figure import Figure

from fedpartial._src.core.errors import UserError
from fedpartial._src.experiment.preflight import check_writable_dir
from fedpartial._src.experiment.summaries import load_run, mode_label, run_curve

#: file stem -> (curve key of the x axis, x label)
FIGURES = {
    "accuracy_vs_round": ("round", "round"),
    "accuracy_vs_upload_bytes": ("bytes", "cumulative upload (MB)"),
    "accuracy_vs_simulated_time": ("time", "cumulative simulated time (s)"),
}
FORMATS = ("png", "svg")


def check_out_dir(out_dir: str, flag: str = "--out") -> None:
    """The figures can be written in ``out_dir`` without overwriting any: else one sentence (nothing is made)."""
    check_writable_dir(out_dir, flag, "a directory for the figures")
    path = os.path.abspath(out_dir)
    taken = [f"{stem}.{fmt}" for stem in FIGURES for fmt in FORMATS
             if os.path.exists(os.path.join(path, f"{stem}.{fmt}"))]
    if taken:
        raise UserError(f"{flag} {out_dir!r} already holds {taken[0]}; choose a new directory (figures are never "
                        f"overwritten).")


def draw(curves: Sequence[dict], out_dir: str) -> list[str]:
    """Writes every figure of :data:`FIGURES` in every format of :data:`FORMATS`; returns the paths.

    A curve is ``{"label", "round", "bytes", "time", "accuracy", "std"}`` (1-D arrays; ``std`` None
    for a single run, else the band's half-width).
    """
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for stem, (key, xlabel) in FIGURES.items():
        fig = Figure(figsize=(6.4, 4.2), layout="constrained")
        ax = fig.add_subplot()
        for curve in curves:
            x = curve[key] / 1e6 if key == "bytes" else curve[key]
            (line,) = ax.plot(x, curve["accuracy"], marker="o" if len(x) < 20 else None, markersize=3,
                              label=curve["label"])
            if curve["std"] is not None:
                ax.fill_between(x, curve["accuracy"] - curve["std"], curve["accuracy"] + curve["std"],
                                color=line.get_color(), alpha=0.2, linewidth=0)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("test accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        for fmt in FORMATS:
            path = os.path.join(out_dir, f"{stem}.{fmt}")
            fig.savefig(path, dpi=120, metadata={"Date": None} if fmt == "svg" else None)
            paths.append(path)
    return paths


def plot_runs(run_dirs: Sequence[str], out_dir: str) -> list[str]:
    """``fedpartial plot``: every run directory read first (a bad one raises before anything is drawn),
    then one line per run; labels that would repeat get the directory's name."""
    runs = [load_run(d) for d in run_dirs]
    labels = [f"{r['config'].get('method', '?')}{mode_label(r['config'])} seed {r['config'].get('seed', '?')}"
              for r in runs]
    labels = [f"{label} ({os.path.basename(os.path.normpath(r['dir']))})" if labels.count(label) > 1 else label
              for label, r in zip(labels, runs)]
    return draw([run_curve(r, label) for r, label in zip(runs, labels)], out_dir)
