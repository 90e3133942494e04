"""The documented method example runs as written (it asserts its own result)."""

import pathlib
import runpy

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_custom_method_example_runs(capsys):
    runpy.run_path(str(ROOT / "notebooks" / "custom_method.py"), run_name="__main__")
    assert "uploads per client and layer" in capsys.readouterr().out
