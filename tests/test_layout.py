"""The package's shape: layers point one way (the import-linter contracts in pyproject.toml), no import
cycle between any two modules, no module over 600 lines, and tests that mirror the layers."""

import pathlib
import subprocess
import sys

import grimp
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fedpartial"
MAX_LINES = 600


def test_the_import_linter_contracts_hold():
    """``lint-imports``, as a developer runs it (in a subprocess: it writes to the terminal itself)."""
    run = subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports; "
                          "sys.exit(lint_imports(no_cache=True, no_logo=True))"],
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "BROKEN" not in run.stdout and run.stdout.count("KEPT") >= 2


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan, iterative)."""
    index, low, on, stack, groups, counter = {}, {}, set(), [], [], [0]
    modules = sorted(graph.modules)

    def visit(root):
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                    break
                if child in on:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        top = stack.pop()
                        on.discard(top)
                        group.append(top)
                        if top == node:
                            break
                    if len(group) > 1:
                        groups.append(sorted(group))

    for module in modules:
        if module not in index:
            visit(module)
    return groups


def test_no_two_modules_import_each_other_even_inside_functions():
    """grimp reads every import, function-local and type-only (``if TYPE_CHECKING:``) ones included, so a
    cycle hidden in a function or in a type annotation shows too."""
    graph = grimp.build_graph("fedpartial", exclude_type_checking_imports=False)  # as the contracts read it
    cycles = _cycles(graph)
    # the message: each cycle's modules, and a path round it
    assert cycles == [], [(group, graph.find_shortest_chain(importer=group[0], imported=group[1]),
                           graph.find_shortest_chain(importer=group[1], imported=group[0])) for group in cycles]


def test_the_contracts_count_type_only_imports():
    """A type-only import is a dependency like any other: the layers hold with them counted."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    assert config["exclude_type_checking_imports"] is False


def test_the_cycle_finder_finds_a_cycle():
    graph = grimp.ImportGraph()
    for name in ("a", "a.b", "a.c", "a.d"):
        graph.add_module(name)
    graph.add_import(importer="a.b", imported="a.c")
    graph.add_import(importer="a.c", imported="a.b")
    graph.add_import(importer="a.d", imported="a.b")
    assert _cycles(graph) == [["a.b", "a.c"]]


def test_no_module_is_longer_than_600_lines():
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_tests_mirror_the_layers():
    layers = {p.name for p in (PACKAGE / "_src").iterdir() if p.is_dir() and not p.name.startswith("__")}
    tested = {p.name for p in (ROOT / "tests").iterdir() if p.is_dir()}
    # bench is measured by tests/benchmarks (smoke tests of the suite and of benchmarks/)
    assert layers - {"bench"} <= tested, layers - tested


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_importing_the_package_loads_no_plotting_or_orbax():
    """``import fedpartial`` stays light: the figure and checkpoint libraries load when a run needs them."""
    code = "import sys, fedpartial; print(','.join(m for m in ('matplotlib', 'orbax') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == ""
