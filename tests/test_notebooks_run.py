"""The notebooks of notebooks/ run top to bottom with small settings and draw their figures.

Each notebook is executed by nbclient in a fresh kernel of *this* interpreter (``sys.executable``
with ipykernel from the same environment, whatever kernel specs the machine has installed), from
the repository root, with ``FEDPARTIAL_NOTEBOOK_SMALL=1`` so that it takes seconds.
"""

import pathlib
import sys

import nbformat
import pytest
from ipykernel.kernelspec import RESOURCES, get_kernel_dict
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = ("quickstart", "masks_explained", "throughput", "lora")
TIMEOUT_S = 300  # per cell: generous for a loaded machine; the whole notebook takes seconds when idle


class _ThisInterpreter(KernelSpecManager):
    """Every kernel name resolves to ipykernel on ``sys.executable``: a user-installed ``python3`` spec
    pointing at another Python (``ipykernel install --user``) cannot hijack the test."""

    def get_kernel_spec(self, kernel_name):
        return KernelSpec(resource_dir=RESOURCES, **get_kernel_dict())


def execute(name: str) -> nbformat.NotebookNode:
    nb = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
    km = KernelManager(kernel_name="python3", kernel_spec_manager=_ThisInterpreter())
    client = NotebookClient(nb, km=km, timeout=TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT)}})
    client.execute()
    return nb


def outputs(nb, kind=None):
    return [out for cell in nb.cells if cell.cell_type == "code" for out in cell.get("outputs", [])
            if kind is None or out.output_type == kind]


def test_kernel_is_this_interpreter():
    """The kernel the notebooks run in is this venv's Python, started from the repository root."""
    km = KernelManager(kernel_name="python3", kernel_spec_manager=_ThisInterpreter())
    assert km.kernel_spec.argv[0] == sys.executable
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import os, sys\nprint(sys.executable)\n"
                                                                   "print(os.getcwd())")])
    NotebookClient(nb, km=km, timeout=60, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    printed = "".join(out["text"] for out in outputs(nb, "stream")).split()
    assert printed == [sys.executable, str(ROOT)]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_notebook_is_valid_and_cleared(name):
    nb = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
    nbformat.validate(nb)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code and all(not cell.outputs and cell.execution_count is None for cell in code)
    assert "FEDPARTIAL_NOTEBOOK_SMALL" in code[0].source  # the first code cell picks the sizes


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_and_draws(name, monkeypatch):
    monkeypatch.setenv("FEDPARTIAL_NOTEBOOK_SMALL", "1")
    nb = execute(name)  # raises CellExecutionError (with the cell and traceback) if any cell fails
    assert not outputs(nb, "error")
    figures = [out for out in outputs(nb) if "image/png" in out.get("data", {})]
    assert figures, f"{name} drew no figure"
