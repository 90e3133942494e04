"""A griffe extension for the API reference: the Sphinx roles of the docstrings (``:class:`~a.b.C```,
``:func:`f```) become Markdown code spans (``C``, ``f``), which mkdocstrings would otherwise print as they
are written.  ``mkdocs.yml`` loads it for the python handler; nothing in the package imports it."""

import re

import griffe

ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj|ref):`(~?)([^`<]+?)(?:\s*<[^>]+>)?`")


def _code(match: re.Match) -> str:
    short, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


def plain(text: str) -> str:
    return ROLE.sub(_code, text)


class SphinxRoles(griffe.Extension):
    def on_instance(self, *, obj, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = plain(obj.docstring.value)
