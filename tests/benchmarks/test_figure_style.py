"""The documentation's figures follow one style: at most three panels a row, one legend under them, text no
smaller than the page's, and one colour per method on every page; every figure a page shows is redrawn from its
result file (``python -m benchmarks.redraw``) through that style."""

import json
import pathlib
import struct

import pytest

from benchmarks import figure_style, redraw, render_figures
from fedpartial.methods import METHODS

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("panels", [1, 2, 3, 6, 7])
def test_at_most_three_panels_a_row_and_the_width_of_the_page(panels):
    fig, axes = figure_style.figure(panels)
    grid = {(ax.get_subplotspec().rowspan.start, ax.get_subplotspec().colspan.start) for ax in axes}
    assert len(axes) == panels and max(col for _, col in grid) < figure_style.MAX_COLUMNS
    assert fig.get_figwidth() <= figure_style.MAX_WIDTH_IN
    # text at FONT_PT on a figure of at most MAX_WIDTH_IN * DPI pixels shown ~800 px wide stays >= ~13 px
    assert figure_style.FONT_PT * figure_style.DPI / 72 * 800 / (figure_style.MAX_WIDTH_IN * figure_style.DPI) >= 13
    figure_style.pyplot().close(fig)


def test_a_shared_legend_replaces_the_panels_legends():
    fig, axes = figure_style.figure(2)
    for ax in axes:
        for method in ("fedspu", "feddrop"):
            ax.plot([0, 1], [0, 1], color=figure_style.colour(method), label=method)
    figure_style.shared_legend(fig, axes)
    assert len(fig.legends) == 1 and [t.get_text() for t in fig.legends[0].get_texts()] == ["fedspu", "feddrop"]
    assert all(ax.get_legend() is None for ax in axes)
    figure_style.pyplot().close(fig)


def test_one_colour_per_method_everywhere():
    assert figure_style.colour("FedSPU+ES") == figure_style.colour("fedspu") == figure_style.colour("FedSPU")
    assert figure_style.colour("fedbuff+fedldf") == figure_style.colour("fedldf")
    assert figure_style.colour("DP-FedAvg") == figure_style.colour("fedavg")
    assert all(figure_style.colour(name).startswith("#") for name in METHODS)
    # the methods drawn together get different colours
    assert figure_style.colour("fedad@target=literal") == figure_style.colour("fedad")
    for together in (("fedspu", "feddrop", "fjord", "hermes", "fedmp", "prunefl", "fedselect", "fedper", "lgfedavg",
                      "fedrep", "fedbabu", "ditto"),
                     ("fedavg_ft", "fedspu", "feddrop", "fjord", "hermes", "fedmp", "prunefl", "fedselect", "fedper",
                      "lgfedavg", "fedrep", "fedbn", "fedbabu", "ditto"),
                     ("fedavg", "fedprox", "fednova", "moon", "feddyn", "feddst", "prunefl", "afd", "feddrop", "fjord",
                      "fedad", "feddh", "feddhad"),
                     ("fedavg", "feddhad", "embracingfl", "heterofl", "fedrolex"),
                     ("embracingfl", "depthfl", "inclusivefl", "fedrolex", "heterofl", "fiarse"),
                     ("fedavg", "scaffold", "fedprox", "fednova", "feddyn"),
                     ("sync", "async M=C=K", "fedasync", "fedbuff", "fedbuff+fedldf", "fedbuff+fedrolex",
                      "fedbuff+heterofl"),
                     ("fedldf", "random", "hdfl", "fedadp", "fedavg"),
                     ("embracingfl", "heterofl", "fedrolex", "depthfl", "inclusivefl"),
                     ("fedper", "lgfedavg", "fedrep", "fedbn", "fedbabu", "ditto", "fedavg"),
                     ("feddh", "fedjs", "feddhe", "fedad", "feddhad", "fedavg"),
                     ("fedavg", "fedpart", "fedit", "ffa_lora", "fedsa_lora", "hetlora", "flexlora", "flora")):
        colours = [figure_style.colour(m) for m in together]
        assert len(set(colours)) == len(colours), together


def _png_size(path: pathlib.Path) -> tuple[int, int]:
    """A PNG's width and height in pixels, from its header."""
    return struct.unpack(">II", path.read_bytes()[16:24])


def _shown() -> list[str]:
    texts = [p.read_text(encoding="utf-8") for p in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]]
    return sorted(render_figures.used(texts))


def test_every_figure_the_pages_show_is_redrawn_from_its_result_file():
    shown = _shown()
    assert len(shown) >= 20, shown
    assert sorted({render_figures.result_of(png) for png in shown}) == [p.name for p in redraw.shown()]
    for png in shown:
        result = ROOT / "benchmarks" / "results" / render_figures.result_of(png)
        assert result.is_file(), f"{png} is drawn from {result.name}, which is not in benchmarks/results"
        assert json.loads(result.read_text())["benchmark"] in redraw.DRAWERS, f"no redraw entry draws {png}"
    # the figures folder of the site holds only what a page shows
    assert sorted(p.name for p in render_figures.FIGURES.glob("*.png")) == shown


def test_the_figures_the_pages_show_are_what_redraw_draws_in_the_style(monkeypatch):
    """Each shown figure, redrawn from its result file (nothing written): at most three panels a row, no panel
    legend over six entries and at most one shared legend, no text smaller than the style's, the figure at most
    the page's width; and the committed PNG has the size of that drawing (it was drawn by it)."""
    import matplotlib.text

    drawn = {}

    def keep(fig, path):
        axes = [ax for ax in fig.axes if ax.get_visible()]
        columns = {ax.get_subplotspec().colspan.start for ax in axes if ax.get_subplotspec() is not None}
        legends = [ax.get_legend() for ax in axes if ax.get_legend() is not None]
        small = {t.get_text() for t in fig.findobj(matplotlib.text.Text)
                 if t.get_visible() and t.get_text().strip() and t.get_fontsize() < figure_style.FONT_PT - 1}
        drawn[pathlib.Path(path).name] = {
            "size": tuple(round(v * figure_style.DPI) for v in fig.get_size_inches()), "columns": len(columns),
            "panel legend entries": max((len(lg.get_texts()) for lg in legends), default=0),
            "figure legends": len(fig.legends), "small text": small}
        figure_style.pyplot().close(fig)

    monkeypatch.setattr(figure_style, "save", keep)
    for result in redraw.shown():
        redraw.DRAWERS[json.loads(result.read_text())["benchmark"]](result)
    for png in _shown():
        fig = drawn[png]
        assert fig["columns"] <= figure_style.MAX_COLUMNS, (png, fig)
        assert fig["panel legend entries"] <= 6 and fig["figure legends"] <= 1, (png, fig)
        assert not fig["small text"], (png, fig)
        assert fig["size"][0] <= figure_style.MAX_WIDTH_IN * figure_style.DPI, (png, fig)
        committed = _png_size(ROOT / "benchmarks" / "results" / png)
        assert all(abs(a - b) <= 1 for a, b in zip(committed, fig["size"])), (
            f"{png} is {committed} px, redraw draws it {fig['size']}: run python -m benchmarks.redraw")

