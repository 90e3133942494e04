"""A mkdocs hook for what a reader sees of each page:

* every figure is a link to its full-size image, so that a reader can enlarge it (a figure is scaled down to
  the text column's width); an image that is already a link is left alone;
* a short inline code span (a name, a flag: at most :data:`UNBROKEN` characters) never breaks across lines
  (``--cohort`` would otherwise break after its hyphens); a longer one may, at the column's edge;
* a page named by its path in code (``docs/lora.md``, as the changelog, read on GitHub too, names them) is a
  link to the page under its title in the navigation; a path with an anchor the page lacks stays as it is.

``mkdocs.yml`` loads it under ``hooks:``."""

import pathlib
import re

from markdown.extensions.toc import slugify

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
INLINE_CODE = re.compile(rf"<code>([^<]{{1,{UNBROKEN}}})</code>")
PRE = re.compile(r"<pre\b.*?</pre>", re.DOTALL)


def unbroken_names(html: str) -> str:
    """``html`` with each short inline ``<code>`` outside ``<pre>`` marked ``class="nowrap"``."""
    out, last = [], 0
    for block in PRE.finditer(html):
        out += [INLINE_CODE.sub(r'<code class="nowrap">\1</code>', html[last:block.start()]), block.group(0)]
        last = block.end()
    return "".join(out + [INLINE_CODE.sub(r'<code class="nowrap">\1</code>', html[last:])])


PAGE_PATH = re.compile(r'<code[^>]*>docs/([\w/-]+\.md)(#[\w-]+)?</code>')


def nav_titles(nav, section=None) -> dict[str, str]:
    """``{source path: title}`` of the navigation (a section's untitled page goes by the section's title)."""
    found = {}
    for item in nav or ():
        if isinstance(item, str):
            if section:
                found.setdefault(item, section)
            continue
        for title, target in item.items():
            found.update({target: title} if isinstance(target, str) else nav_titles(target, title))
    return found


def _anchors(path) -> set[str]:
    """The heading anchors of a Markdown page (as the ``toc`` extension makes them, or given as ``{#id}``)."""
    anchors = set()
    for line in pathlib.Path(path).read_text(encoding="utf-8").splitlines():
        if line.startswith("#") and not line.startswith("#!"):
            given = re.search(r"\{#([\w-]+)\}\s*$", line)
            anchors.add(given.group(1) if given else slugify(line.lstrip("#").strip(), "-"))
    return anchors


def page_links(html: str, page, config, files) -> str:
    """``html`` with each ``<code>docs/NAME.md</code>`` outside a link made a link to that page."""
    titles = nav_titles(config["nav"])
    linked = [m.span() for m in LINK.finditer(html)]

    def link(match: re.Match) -> str:
        target, anchor = files.get_file_from_path(match.group(1)), match.group(2) or ""
        if target is None or any(start <= match.start() < end for start, end in linked) or (
                anchor and anchor[1:] not in _anchors(target.abs_src_path)):
            return match.group(0)
        title = titles.get(match.group(1), match.group(1))
        return f'<a href="{target.url_relative_to(page.file)}{anchor}">{title}</a>'

    return PAGE_PATH.sub(link, html)


def on_page_content(html, page, config, files):
    return unbroken_names(enlargeable(page_links(html, page, config, files)))
