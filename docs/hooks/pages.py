"""A mkdocs hook for what a reader sees of each page:

* every figure is a link to its full-size image, so that a reader can enlarge it (a figure is scaled down to
  the text column's width); an image that is already a link is left alone;
* a short inline code span (a name, a flag: at most :data:`UNBROKEN` characters) never breaks across lines
  (``--cohort`` would otherwise break after its hyphens); a longer one may, at the column's edge.

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


UNBROKEN = 40
INLINE_CODE = re.compile(r"<code>([^<]{1,%d})</code>" % UNBROKEN)
PRE = re.compile(r"<pre\b.*?</pre>", re.DOTALL)


def unbroken_names(html: str) -> str:
    """``html`` with each short inline ``<code>`` outside ``<pre>`` marked ``class="nowrap"``."""
    out, last = [], 0
    for block in PRE.finditer(html):
        out += [INLINE_CODE.sub(r'<code class="nowrap">\1</code>', html[last:block.start()]), block.group(0)]
        last = block.end()
    return "".join(out + [INLINE_CODE.sub(r'<code class="nowrap">\1</code>', html[last:])])


def on_page_content(html, page, config, files):
    return unbroken_names(enlargeable(html))
