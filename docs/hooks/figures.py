"""A mkdocs hook: every figure of a page is a link to its full-size image, so that a reader can enlarge it
(a figure is scaled down to the text column's width).  An image that is already a link is left alone.
``mkdocs.yml`` loads it under ``hooks:``."""

import re

IMAGE = re.compile(r"<img\b[^>]*\bsrc=\"([^\"]+\.(?:png|svg|jpg|jpeg|gif|webp))\"[^>]*>", re.IGNORECASE)
LINK = re.compile(r"<a\b[^>]*>.*?</a>", re.IGNORECASE | re.DOTALL)


def enlargeable(html: str) -> str:
    """``html`` with each image outside a link wrapped in a link to itself."""
    linked = [m.span() for m in LINK.finditer(html)]

    def wrap(match: re.Match) -> str:
        if any(start <= match.start() < end for start, end in linked):
            return match.group(0)
        return (f'<a class="figure-link" href="{match.group(1)}" title="Open the full-size image">'
                f"{match.group(0)}</a>")

    return IMAGE.sub(wrap, html)


def on_page_content(html, page, config, files):
    return enlargeable(html)
