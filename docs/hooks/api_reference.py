"""A griffe extension that makes the API reference show what ``help()`` shows.

The reference reads the source statically, so it misses what the package fills in when it is imported.  This
extension adds it back, for every documented object of the public namespaces:

* an attribute documented in its class's ``Attributes:`` section, by the constructor argument of its name, or
  by a ``#:`` comment above it, gets that text as its own description (otherwise its entry would be an empty
  box with only its name);
* each :class:`~fedpartial.RunConfig` field gets its setting's meaning, type, unit, default and flag, read from
  the settings themselves (the same descriptions as ``--help`` and the configuration page; flags, commands and
  paths shown as code, "the Data page" as a link), its code line
  reads ``name: type = default``, and the class's signature reads ``RunConfig(**settings)`` instead of a
  screen of ``setting(...)`` calls;
* ``>>>`` examples become ``pycon`` code blocks (Markdown would render them as nested quotes);
* a documentation page named by its path (``docs/privacy.md``, as ``help()`` shows it) becomes a link to the
  page under its title.

``mkdocs.yml`` loads it for the python handler; nothing in the package imports it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
import re
import sys

import griffe

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _sibling(name: str):
    """A module of this folder, loaded by its path (as ``mkdocs.yml`` loads this one: the folder is no package)."""
    spec = importlib.util.spec_from_file_location(name, pathlib.Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sphinx_roles = _sibling("sphinx_roles")
RUN_CONFIG = "fedpartial._src.experiment.config.RunConfig"
SECTION_HEADING = re.compile(r"^\s*Attributes:\s*$")
PROMPT = re.compile(r"^(\s*)>>> ")


def pycon_blocks(text: str) -> str:
    """Each run of ``>>>`` lines (with their ``...`` continuations and printed output) fenced as ``pycon``."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        prompt = PROMPT.match(lines[i])
        if not prompt:
            out.append(lines[i])
            i += 1
            continue
        indent = prompt.group(1)
        out.append(f"{indent}```pycon")
        while i < len(lines) and lines[i].strip() and lines[i].startswith(indent):
            out.append(lines[i])
            i += 1
        out.append(f"{indent}```")
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


PAGE_PATH = re.compile(r"``?docs/([\w/-]+)\.md(#[\w-]+)?``?|\bdocs/([\w/-]+)\.md(#[\w-]+)?")


def _title(page: str) -> str:
    path = ROOT / "docs" / f"{page}.md"
    heading = next((line[2:].strip() for line in path.read_text().splitlines() if line.startswith("# ")), page)
    return heading.strip("`")


def page_links(text: str) -> str:
    """Each ``docs/NAME.md`` path as a link to the page (from an API reference page, one level down)."""
    def link(match: re.Match) -> str:
        page = match.group(1) or match.group(3)
        anchor = match.group(2) or match.group(4) or ""
        if not (ROOT / "docs" / f"{page}.md").exists():
            return match.group(0)
        return f"[{_title(page)}](../{page}.md{anchor})"
    return PAGE_PATH.sub(link, text)


def _attribute_sections(docstring: griffe.Docstring) -> dict[str, str]:
    """``{name: description}`` of the docstring's Google ``Attributes:`` sections."""
    found = {}
    for section in docstring.parse("google", warnings=False):
        if section.kind is griffe.DocstringSectionKind.attributes:
            found.update({item.name: item.description for item in section.value if item.description})
    return found


def _init_arguments(cls: griffe.Class) -> dict[str, str]:
    """``{name: description}`` of the class's constructor arguments (its docstring's or ``__init__``'s)."""
    found = {}
    init = cls.members.get("__init__")
    for doc in (cls.docstring, None if init is None or init.is_alias else init.docstring):
        if doc is None:
            continue
        for section in doc.parse("google", warnings=False):
            if section.kind is griffe.DocstringSectionKind.parameters:
                found.update({item.name: item.description for item in section.value if item.description})
    return found


def _comment_above(attr: griffe.Attribute) -> str | None:
    """The ``#:`` comment lines right above an attribute's assignment, joined."""
    try:
        lines = attr.lines_collection[attr.filepath]
    except (KeyError, AttributeError, TypeError):
        return None
    comment, row = [], (attr.lineno or 1) - 2
    while row >= 0 and lines[row].strip().startswith("#:"):
        comment.insert(0, lines[row].strip()[2:].strip())
        row -= 1
    return " ".join(comment) or None


def _nav_titles() -> dict[str, str]:
    """``{title: page}`` of the site's navigation (``mkdocs.yml``), e.g. ``{"Data": "data"}``."""
    import yaml

    found = {}

    def walk(items, section):
        for item in items:
            if isinstance(item, str) and section:  # a section's own page goes by the section's title
                found.setdefault(section, item.removesuffix(".md"))
            for title, target in item.items() if isinstance(item, dict) else ():
                if isinstance(target, str):
                    found[title] = target.removesuffix(".md")
                else:
                    walk(target, title)

    walk(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"], None)
    return found


PAGE = re.compile(r"\bthe ([A-Z][\w -]*?) page\b")


def marked(text: str, titles: dict[str, str]) -> str:
    """A setting's plain words as Markdown: flags, commands and paths as code (as on the configuration page), a
    page named by its navigation title ("the Data page") as a link to it (from an API reference page, one
    level down)."""
    from fedpartial._src.experiment import settings

    parts = settings.code_marked(text).split("`")  # odd parts are code
    for i in range(0, len(parts), 2):
        parts[i] = PAGE.sub(lambda m: f"the [{m.group(1)}](../{titles[m.group(1)]}.md) page"
                            if m.group(1) in titles else m.group(0), parts[i])
    return "`".join(parts)


def _run_config_docs() -> dict[str, tuple[str, str]]:
    """``{field: (Python default, description)}`` of every RunConfig setting, from the settings' own
    descriptions."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from fedpartial._src.experiment import config, settings

    docs, titles = {}, _nav_titles()
    for field in settings.fields(config.RunConfig):
        described = settings.described(field)
        title = settings.SECTIONS[described.section][0]
        anchor = re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")
        flag = settings.flag_of(field)
        facts = [f"**Type:** `{field.type}`", f"**Default:** {marked(settings.default_text(field), titles)}"]
        if described.unit:
            facts.append(f"**Unit:** {described.unit}")
        facts.append(f"**Flag:** `{flag}`" if flag else "**Flag:** none (Python only)")
        facts.append(f"**Section:** [{title}](../configuration.md#{anchor})")
        help_text = marked(described.help[0].upper() + described.help[1:], titles)
        value = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        docs[field.name] = (repr(value), f"{help_text}.\n\n" + " · ".join(facts))
    return docs


class ApiReference(griffe.Extension):
    def __init__(self) -> None:
        super().__init__()
        self._run_config: dict[str, tuple[str, str]] | None = None

    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        self._visit(pkg, set())

    def _visit(self, obj: griffe.Object, seen: set[str]) -> None:
        if obj.path in seen:
            return
        seen.add(obj.path)
        if obj.docstring is not None:
            obj.docstring.value = page_links(pycon_blocks(obj.docstring.value))
        if obj.is_class:
            self._fill_members(obj)
            if obj.path == RUN_CONFIG:
                self._fill_run_config(obj)
        for member in list(obj.members.values()):
            if member.is_alias:
                continue
            if member.is_attribute and member.docstring is None:
                comment = _comment_above(member)
                if comment:  # read after the Sphinx roles extension ran: its roles are made code here
                    member.docstring = griffe.Docstring(sphinx_roles.plain(comment), parent=member)
            if member.is_attribute and member.docstring is not None:
                member.docstring.value = page_links(pycon_blocks(member.docstring.value))
            if member.is_module or member.is_class or member.is_function:
                self._visit(member, seen)

    @staticmethod
    def _fill_members(klass: griffe.Class) -> None:
        if klass.docstring is None:
            return
        described = {**_init_arguments(klass), **_attribute_sections(klass.docstring)}
        for name, text in described.items():
            member = klass.members.get(name)
            if member is not None and not member.is_alias and member.is_attribute and member.docstring is None:
                member.docstring = griffe.Docstring(text, parent=member)

    def _fill_run_config(self, cls: griffe.Class) -> None:
        if self._run_config is None:
            self._run_config = _run_config_docs()
        for name, (default, text) in self._run_config.items():
            member = cls.members.get(name)
            if member is None or member.is_alias:
                continue
            member.docstring = griffe.Docstring(page_links(text), parent=member)
            # the entry's code line reads ``name: type = default`` as a keyword argument is written, instead
            # of the field's setting(...) call; "class-attribute instance-attribute" says nothing to a reader
            member.value = default
            member.labels -= {"class-attribute", "instance-attribute"}
        cls.set_member("__init__", griffe.Function(
            "__init__", lineno=0, endlineno=0, parent=cls, returns="None",
            parameters=griffe.Parameters(
                griffe.Parameter("self", kind=griffe.ParameterKind.positional_or_keyword),
                griffe.Parameter("settings", kind=griffe.ParameterKind.var_keyword))))
