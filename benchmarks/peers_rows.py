"""The rows of ``python -m benchmarks.peers``: the workload both sides run (no JAX or torch imported here)."""

from __future__ import annotations

from typing import NamedTuple


class Row(NamedTuple):
    model: str  # mlp, cnn (conv16-pool-conv32-pool-fc64-fc10) or cnn2c1f (the zoo's), 5x5 SAME convolutions
    side: int  # square images side x side
    channels: int
    clients: int  # the population N
    cohort: int  # clients a round K
    local_steps: int
    batch_size: int


ROWS = {
    "mlp:10": Row("mlp", 28, 1, 100, 10, 10, 32),
    "mlp:50": Row("mlp", 28, 1, 100, 50, 10, 32),
    "cnn:10": Row("cnn", 28, 1, 100, 10, 10, 32),
    "cnn:50": Row("cnn", 28, 1, 100, 50, 10, 32),
    "cnn2c1f:10": Row("cnn2c1f", 28, 1, 100, 10, 10, 32),
    # the default `fedpartial run` (digits, 8x8 grey, N = 20, K = 10, batch 16, 2 epochs of ~72 examples: 9 steps)
    "digits": Row("cnn2c1f", 8, 1, 20, 10, 9, 16),
    "quick": Row("mlp", 8, 1, 4, 2, 1, 4),
}
