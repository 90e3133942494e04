"""The FedLDF and FedSPU benchmarks have an mnist5k row whose model takes the real 28x28 digits."""

import pytest

from benchmarks import fedldf, fedspu
from fedpartial._src.models.registry import build_model


@pytest.mark.parametrize("setups", [fedldf.SETUPS, fedspu.SETUPS])
def test_mnist5k_row_builds_for_28x28_digits(setups):
    model = setups["mnist5k"][0]
    assert build_model(model, 10, (28, 28, 1)).stage_names[-1] == "head"


def test_fedspu_memory_table_for_mnist5k_needs_no_data():
    rows = fedspu.memory_rows("mnist5k")
    assert [r["p"] for r in rows] == [0.2, 0.4, 0.6, 0.8, 1.0]
    assert all(r["dataset"] == "mnist5k" and r["model"] == "cnn2c1f" for r in rows)
    assert rows[-1]["reduction"] == 0 and rows[0]["reduction"] > rows[-2]["reduction"] > 0
