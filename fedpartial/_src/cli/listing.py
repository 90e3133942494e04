"""``fedpartial list``: the methods, models or datasets, one line each."""

from __future__ import annotations

import argparse

from rich.console import Console

from fedpartial._src.cli.flags import Formatter
from fedpartial._src.data.sources import DATASETS
from fedpartial._src.experiment.config import DATASET_SHAPES, DEFAULT_MODELS
from fedpartial._src.methods.catalog import all_methods
from fedpartial._src.models.registry import MODELS

#: one line per dataset for ``fedpartial list datasets`` (the shape and default model are added)
DATASET_SUMMARIES = {
    "digits": "scikit-learn's handwritten digits, 10 classes, offline",
    "mnist5k": "5,000 MNIST digits bundled with the package, 10 classes, offline",
    "synthetic": "Synthetic(α, β) of the FedProx paper: 60 features, 10 classes, naturally partitioned (offline)",
    "mnist": "MNIST handwritten digits, 10 classes (tensorflow-datasets)",
    "fashion_mnist": "Fashion-MNIST clothing images, 10 classes (tensorflow-datasets)",
    "emnist": "EMNIST byclass letters and digits, 62 classes (tensorflow-datasets)",
    "cifar10": "CIFAR-10 colour images, 10 classes (tensorflow-datasets)",
    "cifar100": "CIFAR-100 colour images, 100 classes (tensorflow-datasets)",
    "svhn_cropped": "SVHN house-number digits, 10 classes (tensorflow-datasets)",
    "synthetic_text": "generated token sequences, 2 classes, offline",
    "imdb_reviews": "IMDB movie reviews as token ids, 2 classes (tensorflow-datasets)",
}



def add_parser(subparsers) -> argparse.ArgumentParser:
    lister = subparsers.add_parser("list", help="the methods, models or datasets, one line each",
                                   formatter_class=Formatter)
    lister.add_argument("what", nargs="?", choices=("methods", "models", "datasets"), default=None,
                        help="what to list (default: all three)")
    return lister


def handle(args, console: Console | None = None, argv: list[str] | None = None) -> int:
    """``fedpartial list``: one plain line per name (no table: easy to grep)."""
    rows = {
        "methods": [(n, s.summary + _marks(s)) for n, s in all_methods().items()],
        "models": [(n, s.description + ("" if s.sequential else " [residual: no neuron-level methods]"))
                   for n, s in MODELS.items()],
        "datasets": [(n, f"{DATASET_SUMMARIES.get(n, '')}; examples "
                         f"{'x'.join(map(str, DATASET_SHAPES[n])) if n in DATASET_SHAPES else 'of varying shape'}, "
                         f"default model {DEFAULT_MODELS.get(n, 'mlp')}")
                     for n in DATASETS],
    }
    for what in [args.what] if args.what else list(rows):
        if not args.what:
            print(f"{what}:")
        width = max(len(n) for n, _ in rows[what])
        for name, summary in rows[what]:
            print(f"{'  ' if not args.what else ''}{name:<{width}}  {summary}")
    return 0


def _marks(spec) -> str:
    """A method's marks: neuron-level (sequential models only) and whether it runs with ``--mode async``, from its
    capabilities built with its defaults; a factory that needs arguments it was not given is listed without marks
    rather than failing the listing."""
    try:
        caps = spec.build().capabilities
    except Exception:  # noqa: BLE001  (another package's factory: anything may go wrong building it bare)
        return ""
    return (" [neuron-level: sequential models only]" if caps.neuron_masks else "") + \
        (" [async]" if caps.asynchronous else "")
