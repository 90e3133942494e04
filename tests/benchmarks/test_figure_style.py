"""The documentation's figures follow one style: at most three panels a row, one legend under them, text no
smaller than the page's, and one colour per method on every page."""

import pytest

from benchmarks import figure_style
from fedpartial.methods import METHODS


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
    for together in (("fedspu", "feddrop", "fjord", "hermes", "fedmp", "prunefl", "fedselect"),
                     ("sync", "async M=C=K", "fedasync", "fedbuff", "fedbuff+fedldf", "fedbuff+fedrolex",
                      "fedbuff+heterofl"),
                     ("fedldf", "random", "hdfl", "fedadp", "fedavg"),
                     ("embracingfl", "heterofl", "fedrolex", "depthfl", "inclusivefl"),
                     ("fedper", "lgfedavg", "fedrep", "fedbn", "fedbabu", "ditto", "fedavg"),
                     ("feddh", "fedjs", "feddhe", "fedad", "feddhad", "fedavg"),
                     ("fedavg", "fedpart", "fedit", "ffa_lora", "fedsa_lora", "hetlora", "flexlora", "flora")):
        colours = [figure_style.colour(m) for m in together]
        assert len(set(colours)) == len(colours), together
