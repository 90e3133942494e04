"""The documentation is tested: the site builds with ``mkdocs build --strict`` (no broken link, anchor or
reference), every code block marked runnable in ``docs/`` and ``README.md`` runs, the benchmark tables are
what ``benchmarks/render_docs.py`` renders from the result files, and every registered method is in the
method tables.  ``docs/contributing.md`` describes the markers."""

import json
import os
import pathlib
import re
import runpy
import subprocess
import sys
import time

import pytest

from benchmarks import render_docs
from fedpartial.methods import METHODS

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
RUNNABLE = "<!-- runnable -->"
NOT_RUNNABLE = re.compile(r"<!-- not runnable: \S.*-->")
FENCE = re.compile(r"^```(\S*)\s*$")
BUILD_LIMIT_S = 60  # a strict build takes a few seconds: a minute means something is wrong


def code_blocks(path: pathlib.Path) -> list[tuple[int, str, str, str]]:
    """Every fenced block of a Markdown file: (line of its first code line, language, marker line, code)."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening and opening.group(1):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].rstrip() == "```")
            marker = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            blocks.append((i + 2, opening.group(1), marker, "\n".join(lines[i + 1:end])))
            i = end
        i += 1
    return blocks


def runnable_blocks(path: pathlib.Path) -> list[tuple[int, str]]:
    return [(line, code) for line, lang, marker, code in code_blocks(path) if lang == "python" and marker == RUNNABLE]


def _rel(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.fixture(scope="module")
def built_site(tmp_path_factory):
    """The site as ``mkdocs build --strict`` writes it, built once for every test that reads it:
    ``(site folder, the build's subprocess result, seconds it took)``."""
    site = tmp_path_factory.mktemp("site")
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                         cwd=ROOT, capture_output=True, text=True, timeout=10 * BUILD_LIMIT_S,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    return site, run, time.perf_counter() - start


@pytest.fixture(scope="module")
def site(built_site) -> pathlib.Path:
    folder, run, _ = built_site
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    return folder


@pytest.mark.xdist_group("site")
def test_the_site_builds_strictly_within_a_minute(built_site, site):
    took = built_site[2]
    assert took < BUILD_LIMIT_S, f"mkdocs build took {took:.1f} s"
    assert (site / "api" / "fedpartial" / "index.html").exists()


def test_every_python_block_says_whether_it_runs():
    unmarked = [f"{_rel(p)}:{line}" for p in PAGES for line, lang, marker, _ in code_blocks(p)
                if lang == "python" and marker != RUNNABLE and not NOT_RUNNABLE.fullmatch(marker)]
    assert unmarked == [], "mark each with <!-- runnable --> or <!-- not runnable: why -->"


def test_the_block_finder_reads_markers_and_lines(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# t\n\n<!-- runnable -->\n```python\nx = 1\n```\n\n```bash\nls\n```\n"
                    "<!-- not runnable: a fragment -->\n```python\ny(\n```\n")
    assert code_blocks(page) == [(5, "python", RUNNABLE, "x = 1"), (9, "bash", "```", "ls"),
                                 (13, "python", "<!-- not runnable: a fragment -->", "y(")]
    assert runnable_blocks(page) == [(5, "x = 1")]


# One process per page: its runnable blocks run in order in one namespace (a page may build an example step
# by step), each compiled with the page's file name and line numbers so that a failure points at the page.
RUNNER = """
import json, sys
namespace = {"__name__": "__main__"}
for label, line, code in json.load(open(sys.argv[1])):
    exec(compile("\\n" * (line - 1) + code, label, "exec"), namespace)
"""


@pytest.mark.parametrize("page", [p for p in PAGES if runnable_blocks(p)], ids=_rel)
def test_runnable_blocks_run(page, tmp_path):
    blocks = tmp_path / "blocks.json"
    blocks.write_text(json.dumps([[_rel(page), line, code] for line, code in runnable_blocks(page)]))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"), "MPLBACKEND": "Agg"}
    run = subprocess.run([sys.executable, "-c", RUNNER, str(blocks)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-6000:]


def test_the_docs_have_runnable_examples():
    """The pages the issue names carry examples that run (a guard against markers silently dropped)."""
    for rel in ("README.md", "docs/concepts.md", "docs/tutorial.md", "docs/running.md"):
        assert runnable_blocks(ROOT / rel), rel


def test_benchmark_pages_are_what_the_results_render():
    assert render_docs.stale() == [], "run python -m benchmarks.render_docs and commit the pages"


def test_every_generated_block_is_known_and_filled():
    generated = render_docs.blocks(render_docs.load_results())
    for rel in render_docs.BLOCK_PAGES:
        text = (ROOT / rel).read_text()
        names = re.findall(r"<!-- BEGIN generated: ([\w-]+) -->", text)
        assert names, f"{rel} has no generated block"
        for name in names:
            assert name in generated and generated[name].strip(), (rel, name)
            assert re.search(rf"<!-- END generated: {name} -->", text), (rel, name)


def test_provenance_says_what_a_file_does_not_record():
    bare = {"benchmark": "gather"}
    assert render_docs.device_of("gather-cpu.json", bare) == "CPU (from the file name)"
    assert render_docs.date_of("gather-cpu.json", bare) == "not recorded"
    assert render_docs.date_of("seeds-cpu-2026-11-23.json", bare) == "2026-11-23 (from the file name)"
    committed = {**bare, "committed": "2026-11-22"}
    assert render_docs.date_of("gather-cpu.json", committed) == "run by 2026-11-22 (commit date)"
    assert render_docs.date_of("x.json", {**committed, "time": "2026-11-28T18:00:00+00:00"}) == "2026-11-28"


def test_every_result_file_says_when_it_was_made():
    """A result file records its run's date (or its name does), or the day it was committed."""
    undated = [name for name, d in render_docs.load_results().items()
               if render_docs.date_of(name, d) == "not recorded"]
    assert not undated, undated


def test_the_provenance_of_a_result_file():
    assert render_docs.command_of("x.json", {"benchmark": "scale"}) == (
        "`python -m benchmarks.scale`, arguments not kept")
    recorded = {"benchmark": "data_placement", "time": "2026-11-24T01:57:59+00:00", "argv": ["--cases", "synthetic"],
                "device": {"device_kind": "cpu", "cpu_count": 2, "jax_version": "0.10.2"}}
    assert render_docs.device_of("x.json", recorded) == "CPU (2 cores), jax 0.10.2"
    assert render_docs.date_of("x.json", recorded) == "2026-11-24"
    assert render_docs.command_of("x.json", recorded) == "`python -m benchmarks.data_placement --cases synthetic`"
    rebuilt = {"benchmark": "gather", "config": {"quick": False, "cohort": 1000, "large": 20000, "out": None,
                                                 "features": 60}}
    assert render_docs.command_of("x.json", rebuilt) == (
        "`python -m benchmarks.gather --cohort 1000 --large 20000` (rebuilt from the file's settings)")


def test_an_unknown_generated_block_is_an_error():
    with pytest.raises(KeyError, match="nope"):
        render_docs.fill_blocks("<!-- BEGIN generated: nope -->\nold\n<!-- END generated: nope -->\n", {})


def method_rows(path: pathlib.Path) -> list[str]:
    """The body rows of the table that follows the page's methods-table marker."""
    text = path.read_text().split("<!-- methods-table", 1)[1]
    rows = []
    for line in text.splitlines()[1:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows[2:]


def method_table(path: pathlib.Path) -> set[str]:
    """The `--method` names in the table that follows the page's methods-table marker."""
    return {m.group(1) for row in method_rows(path) if (m := re.match(r"\| `([\w-]+)` \|", row))}


@pytest.mark.parametrize("rel", ["README.md", "docs/methods.md"])
def test_the_method_table_names_every_registered_method(rel):
    assert method_table(ROOT / rel) == set(METHODS)


@pytest.mark.parametrize("rel", ["README.md", "docs/methods.md"])
def test_every_method_row_links_its_paper_or_says_why_not(rel):
    """Each row's paper cell links a DOI, arXiv or OpenReview page, or says that no link was verified."""
    rows = method_rows(ROOT / rel)
    link = re.compile(r"\]\(https://(arxiv\.org/abs/\d{4}\.\d{4,5}|doi\.org/10\.\d{4,}/\S+"
                      r"|openreview\.net/forum\?id=\w+)\)")
    bare = [row.split(" | ")[0] for row in rows
            if not link.search(row.split(" | ")[1]) and "no verified link" not in row.split(" | ")[1]]
    assert rows and not bare, bare


def test_the_readme_is_short_and_keeps_the_quick_start():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]  # CI runs the second command literally
    assert f"```bash\n{ci}\n```" in text
    assert "```bash\npython3 -m venv .venv && . .venv/bin/activate && pip install -e . && fedpartial run\n```" in text


def test_the_api_reference_documents_the_public_api_only():
    import fedpartial

    targets = [m.group(1) for p in (ROOT / "docs" / "api").glob("*.md")
               for m in re.finditer(r"^::: (\S+)", p.read_text(), re.MULTILINE)]
    modules = ["fedpartial", "fedpartial.data", "fedpartial.masks", "fedpartial.methods", "fedpartial.models"]
    assert set(modules) <= set(targets)
    names = [t.removeprefix("fedpartial.") for t in targets if t not in modules]
    assert all(name in fedpartial.__all__ for name in names), names


def module_map() -> list[tuple[str, str]]:
    """(folder cell, modules cell) of each row of the table that follows docs/layout.md's module-map marker."""
    text = (ROOT / "docs" / "layout.md").read_text().split("<!-- module-map", 1)[1]
    rows = []
    for line in text.splitlines()[1:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split(" | ")])
    return [(cells[0], cells[-1]) for cells in rows[2:]]


def test_the_module_map_lists_every_module():
    rows, missing = module_map(), []
    source = ROOT / "fedpartial" / "_src"
    for path in sorted(source.rglob("*.py")):
        if path.name == "__init__.py":
            continue
        rel = path.relative_to(source)
        top = f"`{rel.parts[0]}/`" if len(rel.parts) > 1 else "`./`"
        modules = next((cell for folder, cell in rows if top in folder), "")
        if not all(name in modules for name in [*(f"`{p}/`" for p in rel.parts[1:-1]), f"`{path.stem}`"]):
            missing.append(str(rel))
    assert missing == []


def test_sphinx_roles_in_docstrings_become_code_in_the_api_reference():
    plain = runpy.run_path(str(ROOT / "docs" / "hooks" / "sphinx_roles.py"))["plain"]
    assert plain("see :class:`~fedpartial._src.core.types.Method` and :func:`make_method`.") == (
        "see `Method` and `make_method`.")
    assert plain(":mod:`fedpartial.masks`") == "`fedpartial.masks`"


def test_nothing_points_outside_the_repository():
    """Users have the repository only: the package, docs, tests, benchmarks and examples cite the decisions page
    (docs/decisions.md), never the development specification beside the checkout."""
    outside = re.compile(r"SPEC\s*§|\.\./shared|SPEC\.md")
    found = []
    for folder in ("fedpartial", "docs", "tests", "benchmarks", "examples", "notebooks"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".md", ".ipynb", ".toml", ".yml") and path.is_file():
                text = path.read_text(encoding="utf-8", errors="ignore")
                found += [f"{path.relative_to(ROOT)}:{m.group(0)}" for m in outside.finditer(text)]
    found += [f"{name}:{m.group(0)}" for name in ("README.md", "mkdocs.yml")
              for m in outside.finditer((ROOT / name).read_text(encoding="utf-8"))]
    assert not [f for f in found if not f.startswith("tests/test_docs.py")], found
    sections = set(re.findall(r"\{#([a-z]+)\}", (ROOT / "docs" / "decisions.md").read_text(encoding="utf-8")))
    cited = {m for folder in ("fedpartial", "benchmarks", "tests") for path in (ROOT / folder).rglob("*.py")
             for m in re.findall(r"decisions\.md#([a-z]+)", path.read_text(encoding="utf-8"))}
    assert cited and cited <= sections, cited - sections


def test_each_reproduction_page_shows_its_figures_and_the_site_reaches_them():
    """The figures the benchmarks draw are on the pages, copied where mkdocs builds from (docs/), and the
    benchmarks page leads with plots and folds its long tables."""
    for rel in ("docs/reproductions/fedldf.md", "docs/reproductions/fedspu.md", "docs/reproductions/embracingfl.md",
                "docs/reproductions/feddhad.md", "docs/benchmarks.md"):
        page = ROOT / rel
        shown = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", page.read_text())
        assert shown, f"{rel} shows no figure"
        assert all((page.parent / src).resolve().is_file() for src in shown), (rel, shown)
    bench = (ROOT / "docs" / "benchmarks.md").read_text()
    assert bench.index("## At a glance") < bench.index("## Execution strategies") and '??? note "' in bench


# ---- the built site, as a reader sees it ------------------------------------------------------------------------
# These read the HTML that ``mkdocs build`` wrote (the ``site`` fixture: one build for all of them), so that they
# hold for every page, including pages added later.  The rules: every attribute entry of the API reference has a
# description; no ``>>>`` example is rendered as a quote; RunConfig, Simulation, run and make_method lead the
# ``fedpartial`` page and every RunConfig field says its type, default, flag and section; no literal ``\|``; code in
# tables and code blocks does not wrap (the stylesheet); every figure is a link to its full-size image; the text
# speaks to users (no words of how the project is made, no raw ``docs/*.md`` paths outside code).

INTERNAL_WORDS = re.compile(r"\bthe issue\b|\bissue'?s?\s*#?\d+|issue's|\ba lent\b|\blent (?:GPU|machine)|"
                            r"\b(?:this|a|the) session\b|\bthe lead\b|\bhelper developers?\b", re.IGNORECASE)
DOCS_PATH = re.compile(r"\bdocs/[\w/-]+\.md\b")


def site_pages(site: pathlib.Path) -> dict[str, str]:
    """``{page: the HTML of its article}`` (the text column, without navigation, header and footer)."""
    pages = {}
    for path in sorted(site.rglob("index.html")):
        html = path.read_text(encoding="utf-8")
        start = html.find('<article class="md-content__inner')
        if start < 0:
            continue
        pages[str(path.parent.relative_to(site)) or "home"] = html[start:html.index("</article>", start)]
    return pages


def visible_text(html: str, *, code: bool) -> str:
    """The words a reader sees: tags removed, ``<pre>`` blocks always dropped, inline ``<code>`` dropped unless
    ``code``."""
    import html as html_lib

    html = re.sub(r"<pre\b.*?</pre>", " ", html, flags=re.DOTALL)
    if not code:
        html = re.sub(r"<code\b.*?</code>", " ", html, flags=re.DOTALL)
    return html_lib.unescape(re.sub(r"<[^>]+>", " ", html))


@pytest.mark.xdist_group("site")
def test_every_attribute_in_the_api_reference_says_what_it_is(site):
    empty = []
    for page, html in site_pages(site).items():
        if not page.startswith("api"):
            continue
        for entry in html.split('<div class="doc doc-object doc-attribute">')[1:]:
            name = re.search(r'id="([^"]+)"', entry).group(1)
            contents = entry.split('<div class="doc doc-contents', 1)[1].split('<div class="doc doc-object', 1)[0]
            if not visible_text(contents, code=True).strip():
                empty.append(name)
    assert not empty, f"attribute entries without a description: {empty[:20]}"


@pytest.mark.xdist_group("site")
def test_no_example_renders_as_a_quote(site):
    quoted = [page for page, html in site_pages(site).items()
              if ">>>" in visible_text(html, code=False) or (page.startswith("api") and "<blockquote" in html)]
    assert not quoted, f"a >>> example rendered as text or a quote on {quoted}"


@pytest.mark.xdist_group("site")
def test_the_fedpartial_page_leads_with_running_and_documents_each_run_setting(site):
    from fedpartial import RunConfig
    from fedpartial._src.experiment import settings

    html = site_pages(site)["api/fedpartial"]
    positions = [html.index(f'id="fedpartial.{name}"') for name in ("RunConfig", "Simulation", "run", "make_method",
                                                                     "Mask", "Method", "FederatedRound")]
    assert positions[:4] == sorted(positions[:4]) and max(positions[:4]) < min(positions[4:]), positions
    assert 'href="../../configuration/' in html[:positions[1]]
    signature = visible_text(html[positions[0]:].split("doc-signature", 1)[1].split("</pre>", 1)[0], code=True)
    assert "".join(signature.split()).endswith("RunConfig(**settings)"), signature
    for field in settings.fields(RunConfig):
        entry = html.split(f'id="fedpartial.RunConfig.{field.name}"', 1)[1].split('<div class="doc doc-object', 1)[0]
        text = " ".join(visible_text(entry, code=True).split())
        flag = settings.flag_of(field)
        # the whole description (its first letter capitalised), whatever the markup added around flags and links
        assert "".join(settings.described(field).help[1:].split()) in "".join(text.split()), (field.name, text)
        assert "Type:" in text and f"Default: {settings.default_text(field)}" in text, (field.name, text)
        assert (f"Flag: {flag}" if flag else "Flag: none") in text and 'href="../../configuration/#' in entry, text
    # a setting's words were written for --help: on the page its flags are code and "the Data page" a link
    entry = html.split('id="fedpartial.RunConfig.train_fraction"', 1)[1].split('<div class="doc doc-object', 1)[0]
    assert '<code class="nowrap">--es</code>' in entry, entry
    entry = html.split('id="fedpartial.RunConfig.dataset"', 1)[1].split('<div class="doc doc-object', 1)[0]
    assert '<a href="../../data/">Data</a> page' in entry
    assert '<code class="nowrap">fedpartial list datasets</code>' in entry
    signature = re.search(r'class="doc-signature[^"]*"><pre>(.*?)</pre>', entry, re.DOTALL).group(1)
    assert "".join(visible_text(signature, code=True).split()) == "dataset:str='digits'", signature


@pytest.mark.xdist_group("site")
def test_identifiers_do_not_break(site):
    """No literal ``\\|`` (a table's escaped bar shown as typed), and the stylesheet keeps code in table cells and
    code blocks on one line (they scroll sideways) so that no name, flag or indentation is broken."""
    escaped = [page for page, html in site_pages(site).items() if "\\|" in visible_text(html, code=True)]
    assert not escaped, escaped
    css = re.sub(r"/\*.*?\*/", "", (site / "assets" / "extra.css").read_text(), flags=re.DOTALL)
    rules = {" ".join(sel.split()): body for sel, body in re.findall(r"([^{}]+)\{([^}]*)\}", css)}
    assert "white-space: nowrap" in rules[".md-typeset table:not([class]) code"]
    assert "white-space: nowrap" in rules[".md-typeset code.nowrap"]
    page = site_pages(site)["running"]
    assert '<code class="nowrap">--checkpoint-every</code>' in page
    assert "white-space: pre;" in rules[".md-typeset pre > code"] and "overflow-x: auto" in rules[
        ".md-typeset pre > code"]


@pytest.mark.xdist_group("site")
def test_every_figure_opens_full_size(site):
    unlinked = []
    for page, html in site_pages(site).items():
        for match in re.finditer(r"<img\b[^>]*\bsrc=\"([^\"]+)\"", html):
            before = html[:match.start()]
            opening = before.rfind("<a ")
            if opening < 0 or "</a>" in before[opening:] or f'href="{match.group(1)}"' not in before[opening:]:
                unlinked.append(f"{page}: {match.group(1)}")
    assert not unlinked, unlinked


@pytest.mark.xdist_group("site")
def test_the_pages_speak_to_users(site):
    """No words of how the project is made; a page is named by a link, not by its ``docs/*.md`` path (the API
    reference not even in code; the changelog, a record of changed files, may name them as code)."""
    found = []
    for page, html in site_pages(site).items():
        found += [f"{page}: {m.group(0)}" for m in INTERNAL_WORDS.finditer(visible_text(html, code=True))]
        text = visible_text(html, code=page.startswith("api"))
        found += [f"{page}: {m.group(0)}" for m in DOCS_PATH.finditer(text)]
    readme = (ROOT / "README.md").read_text()
    found += [f"README.md: {m.group(0)}" for m in INTERNAL_WORDS.finditer(readme)]
    assert not found, found


@pytest.mark.xdist_group("site")
def test_a_page_named_by_its_path_is_a_link(site):
    """Even in code (the changelog names pages by path, as GitHub shows it), ``docs/NAME.md`` of a page that
    exists is a link to it on the site."""
    unlinked = [f"{page}: {m.group(1)}" for page, html in site_pages(site).items()
                for m in re.finditer(r"<code[^>]*>docs/([\w/-]+\.md)</code>", html)
                if (ROOT / "docs" / m.group(1)).exists()]
    assert not unlinked, unlinked
    assert '<a href="../lora/">LoRA fine-tuning</a>' in site_pages(site)["changelog"]


@pytest.mark.xdist_group("site")
def test_the_api_reference_names_no_private_module_and_shows_no_role(site):
    """Beyond the sentence that says ``fedpartial._src`` is private, an API page names only what a user can
    import, and no Sphinx role (``:mod:`...```, also in a ``#:`` comment's description) shows as typed."""
    found = []
    for page, html in site_pages(site).items():
        if page.startswith("api"):
            text = " ".join(visible_text(html, code=True).split()).replace("under fedpartial._src is private", "")
            found += [f"{page}: {m.group(0)}" for m in re.finditer(r"fedpartial\._src\S*|:(?:class|mod|func|meth|"
                                                                     r"attr|data|exc):", text)]
    assert not found, found


def test_the_navigation_lists_each_page_once():
    import yaml

    def pages(items):
        for item in items:
            for target in item.values() if isinstance(item, dict) else [item]:
                yield from [target] if isinstance(target, str) else pages(target)

    listed = list(pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]))
    assert len(listed) == len(set(listed)), sorted(p for p in listed if listed.count(p) > 1)


def test_the_internal_words_rule_reads_what_it_should():
    assert INTERNAL_WORDS.search("This is the issue's protocol") and INTERNAL_WORDS.search("one call of a lent GPU")
    assert not INTERNAL_WORDS.search("a known issue with tfds; the leading units; a resumed run")
    assert visible_text("<p>see <code>docs/a.md</code></p><pre>docs/b.md</pre>", code=False).split() == ["see"]


def test_the_models_page_quotes_the_lowering_benchmark():
    """The speed-ups the Models page gives for the convolution lowerings are those of the result file it names."""
    name = "conv-lowering-cpu-cpu.json"
    rows = {r["row"]: r["cells"] for r in json.loads((ROOT / "benchmarks" / "results" / name).read_text())["results"]}
    x = lambda row, cell: rows[row][cell]["speedup_vs_plain"]  # noqa: E731
    small = [x(r, c) for r in ("cnn2c1f@8x8x1:10", "cnn2c1f@8x8x1:50") for c in ("im2col/fused:1", "hybrid/fused")]
    one_at_a_time = [max(x(r, "mapped/fused:1"), x(r, "im2col/fused:1"))
                     for r in ("cnn2c1f@28x28x1:10", "cnn2c1f@28x28x1:50", "lenet5@32x32x3:10", "vgg9@32x32x3:10")]
    vmapped = [x(r, c) for r in ("cnn2c1f@28x28x1:10", "cnn2c1f@28x28x1:50") for c in ("mapped/fused", "hybrid/fused")]
    page = " ".join((ROOT / "docs" / "models.md").read_text().split())
    assert f"`benchmarks/results/{name}`" in page and "2-core CPU" in page
    assert f"({min(small):.1f}–{max(small):.1f}× the plain loop)" in page, small
    assert f"({min(one_at_a_time):.2f}–{max(one_at_a_time):.1f}×)" in page, one_at_a_time
    assert f"({min(vmapped):.1f}–{max(vmapped):.1f}×)" in page, vmapped
