"""Field descriptions that ``help()`` shows: a record's Google-style ``Attributes:`` section, one source.

The API reference (mkdocstrings) reads a class docstring's ``Attributes:`` section; ``help()`` and IDEs read
each ``NamedTuple`` field's own ``__doc__`` (by default "Alias for field number 0").  :func:`document_fields`
copies the first into the second, so a field is described once, in the class docstring.
"""

from __future__ import annotations

import inspect
import re

_ENTRY = re.compile(r"^(\w+)(?:\s*\([^)]*\))?:\s*(.*)$")


def attribute_docs(doc: str | None) -> dict[str, str]:
    """The ``Attributes:`` section of a Google-style docstring as ``{name: description}``.

    Args:
      doc: a docstring (indented or not), or None.

    Returns:
      Each entry's name and its description, continuation lines joined with single spaces; empty
      when the docstring has no ``Attributes:`` section.
    """
    lines = inspect.cleandoc(doc or "").splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Attributes:")
    except StopIteration:
        return {}
    entries: dict[str, str] = {}
    indent, name = None, None
    for line in lines[start + 1:]:
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        if depth == 0:
            break  # the next section (or prose) starts at the left margin
        if indent is None:
            indent = depth
        match = _ENTRY.match(line.strip())
        if depth == indent and match:
            name = match.group(1)
            entries[name] = match.group(2).strip()
        elif depth > indent and name is not None:
            entries[name] = f"{entries[name]} {line.strip()}".strip()
        else:
            break
    return entries


def document_fields(cls):
    """Class decorator: give each ``NamedTuple`` field the description its class docstring's ``Attributes:``
    section holds, so that ``help(cls)`` lists it (fields without an entry keep Python's default).

    Args:
      cls: a ``NamedTuple`` class (any other class is returned unchanged).

    Returns:
      ``cls`` itself.
    """
    docs = attribute_docs(cls.__doc__)
    for field in getattr(cls, "_fields", ()):
        if field in docs:
            getattr(cls, field).__doc__ = docs[field]
    return cls
