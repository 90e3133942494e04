"""The capacity report behind ``fedpartial capacity``: what each client tier trains and holds in memory.

Capacity (docs/decisions.md#embracingfl, the EmbracingFL paper's Table 1) = (parameters + activations a
client trains) / (parameters + activations of the full model), activations being
the Conv/Dense/LSTM outputs of the trained layers for one batch.  The paper's own
numbers are shown beside ours where it gives them; differences are explained in
the README and tests:
our ResNet20 lacks one 16→16 projection of the paper's implementation, and the
paper counts FEMNIST's activations for one example rather than a batch.  Width
reduction (HeteroFL, the paper's Table 10) is listed for every model that has a
width-reduced version.
"""

from __future__ import annotations

from typing import Sequence

from fedpartial._src.core.errors import UserError
from fedpartial._src.methods.tiered.embracingfl import capacity_table
from fedpartial._src.methods.tiered.width_capacity import capacity_table as width_capacity_table
from fedpartial._src.models.adapter import Model, from_linen
from fedpartial._src.models.registry import MODELS, build_model

#: the dataset shape and classes each model has in its paper (others: 28×28 grey or 32×32 colour, 10 classes)
REFERENCE_SHAPES: dict[str, tuple[tuple[int, ...], int]] = {
    "resnet20": ((32, 32, 3), 10), "femnist_cnn": ((28, 28, 1), 62), "bilstm": ((256,), 2),
    "mlp": ((28, 28, 1), 10), "cnn2c1f": ((28, 28, 1), 10),
}
DEFAULT_SHAPE = ((32, 32, 3), 10)

#: the paper's Table 1 (EmbracingFL) and Table 10 (width reduction) capacities
PAPER_CAPACITY: dict[tuple[str, str], tuple[float, float, float]] = {
    ("embracingfl", "resnet20"): (1.00, 0.42, 0.16),
    ("embracingfl", "femnist_cnn"): (1.00, 0.99, 0.02),
    ("embracingfl", "bilstm"): (1.00, 0.48, 0.35),
    ("heterofl", "resnet20"): (1.00, 0.43, 0.18),
}


def reference_model(name: str, input_shape: Sequence[int] | None = None, classes: int | None = None) -> Model:
    """Zoo model ``name`` shaped as in its paper unless ``input_shape`` / ``classes`` say otherwise."""
    if name not in MODELS:
        raise UserError(f"model {name!r} is unknown; choose one of {', '.join(MODELS)}.")
    shape, num_classes = REFERENCE_SHAPES.get(name, DEFAULT_SHAPE)
    shape = tuple(input_shape) if input_shape is not None else shape
    num_classes = classes if classes is not None else num_classes
    module = build_model(name, num_classes, shape)
    return from_linen(module, input_shape=shape, num_classes=num_classes, sequential=MODELS[name].sequential,
                      name=name)


def report(model: Model, *, batch_size: int = 32, cut=None) -> list[dict]:
    """Rows of (method, tier, what it trains, params, activations, capacity, paper capacity or None)."""
    rows = []
    paper = PAPER_CAPACITY.get(("embracingfl", model.name))
    for t, row in enumerate(capacity_table(model, batch_size=batch_size, cut=cut)):
        trains = f"from {row['cut_stage']}"
        if row["sequence_fraction"] < 1:
            trains += f", {row['sequence_fraction']:.0%} of tokens"
        rows.append(dict(method="embracingfl", tier=row["tier"], trains=trains, params=row["params"],
                         activations=row["activations"], capacity=row["capacity"],
                         paper=paper[t] if paper else None))
    try:
        widths = width_capacity_table(model, batch_size=batch_size)
    except UserError:  # a model without a width-reduced version (e.g. the BiLSTM)
        return rows
    paper = PAPER_CAPACITY.get(("heterofl", model.name))
    for t, row in enumerate(widths):
        rows.append(dict(method="heterofl", tier=row["tier"], trains=f"{row['width']:.4g} of each layer's units",
                         params=row["params"], activations=row["activations"], capacity=row["capacity"],
                         paper=paper[t] if paper else None))
    return rows
