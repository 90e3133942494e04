"""``fedpartial capacity``: parameters, activations and capacity of each client tier of a model
(:mod:`fedpartial._src.analysis.capacity`)."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from fedpartial._src.cli.flags import Formatter, whole_number
from fedpartial._src.core.errors import UserError


def add_parser(subparsers) -> argparse.ArgumentParser:
    cap = subparsers.add_parser(
        "capacity", help="parameters, activations and capacity of each client tier of a model",
        formatter_class=Formatter)
    cap.add_argument("--model", default="resnet20", help="a staged zoo model, e.g. resnet20, femnist_cnn, bilstm")
    cap.add_argument("--input-shape", default=None,
                     help="one example's shape, e.g. 32,32,3 (default: the model's dataset in the paper)")
    cap.add_argument("--classes", type=whole_number, default=None, help="number of classes (default: as above)")
    cap.add_argument("--batch-size", type=whole_number, default=32, help="activations are counted per batch")
    cap.add_argument("--cut", default=None, help="first trained stage of moderate and weak clients, e.g. 4,7 "
                                                  "(default: the paper's)")
    return cap


def handle(args, console: Console, argv: list[str] | None = None) -> int:
    """``fedpartial capacity``."""
    from fedpartial._src.analysis import capacity

    shape = None
    if args.input_shape is not None:
        try:
            shape = tuple(int(d) for d in args.input_shape.split(","))
        except ValueError:
            raise UserError(f"--input-shape {args.input_shape!r} must be whole numbers separated by commas, "
                            "e.g. 32,32,3.") from None
    model = capacity.reference_model(args.model, shape, args.classes)
    table = Table(title=f"client tiers of {model.name} {model.input_shape} — activations per batch of "
                        f"{args.batch_size}")
    for col in ("method", "tier", "trains", "parameters", "activations", "capacity", "paper"):
        table.add_column(col, justify="left" if col in ("method", "tier", "trains") else "right")
    for row in capacity.report(model, batch_size=args.batch_size, cut=args.cut):
        table.add_row(row["method"], row["tier"], row["trains"], f"{row['params']:,}", f"{row['activations']:,}",
                      f"{row['capacity']:.3f}", "–" if row["paper"] is None else f"{row['paper']:.2f}")
    Console(width=max(console.width, 110)).print(table)
    return 0
