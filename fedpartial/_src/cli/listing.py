"""``fedpartial list``: the methods, models or datasets, one line each."""

from __future__ import annotations

import argparse

from rich.console import Console

from fedpartial._src.cli.flags import Formatter
from fedpartial._src.data.sources import DATASETS
from fedpartial._src.experiment.setting_checks import DATASET_SHAPES, DEFAULT_MODELS
from fedpartial._src.core.errors import UserError
from fedpartial._src.methods.catalog import all_methods, find_method
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
    "synthetic_lm": "generated token sequences from 4 Markov topics, next-token targets (language model), offline",
    "imdb_reviews": "IMDB movie reviews as token ids, 2 classes (tensorflow-datasets)",
    "leaf": "LEAF's JSON files you have (FEMNIST, Shakespeare, Sent140; --data-dir), one LEAF user a client",
    "hf": "a Hugging Face dataset saved to disk or a parquet folder (--data-dir), one value of --client-column a "
          "client",
}
#: the usual model of a dataset whose files decide it
NATURAL_MODELS = {"leaf": "femnist_cnn, shakespeare_lstm or sent140_lstm by the files' task",
                  "hf": "by the examples (femnist_cnn for 28x28 images, cnn2c1f, shakespeare_lstm, sent140_lstm, "
                        "mlp)"}



def add_parser(subparsers) -> argparse.ArgumentParser:
    lister = subparsers.add_parser("list", help="the methods, models or datasets, one line each; a method's options",
                                   formatter_class=Formatter,
                                   usage="fedpartial list [methods [--options] | models | datasets | options METHOD]")
    lister.add_argument("what", nargs="?", choices=("methods", "models", "datasets", "options"), default=None,
                        help="what to list (default: methods, models and datasets); options METHOD: one method's "
                             "options")
    lister.add_argument("method", nargs="?", default=None, help="the method whose options to list (with options)")
    lister.add_argument("--options", action="store_true", help="with methods: each method's options under it")
    return lister


def option_lines(spec, indent: str = "  ") -> list[str]:
    """One line per option of the method ``spec``: its flag, what it takes, its default and its help."""
    lines = []
    for opt in spec.options:
        lines.append(f"{indent}{opt.cli_flag}  {opt.described()}")
    return lines or [f"{indent}(no options)"]


def handle(args, console: Console | None = None, argv: list[str] | None = None) -> int:
    """``fedpartial list``: one plain line per name (no table: easy to grep)."""
    if args.what == "options" or args.method is not None:
        if args.what != "options" or args.method is None:
            raise UserError("give a method after options, e.g. fedpartial list options fedldf.")
        spec = find_method(args.method)  # an unknown name: one sentence naming the known ones
        print("\n".join([f"{spec.name}: {spec.summary}", *option_lines(spec)]))
        return 0
    if args.options and args.what not in (None, "methods"):
        raise UserError(f"--options goes with fedpartial list methods, not {args.what}.")
    rows = {
        "methods": [(n, s.summary + _marks(s)) for n, s in all_methods().items()],
        "models": [(n, s.description + ("" if s.sequential else " [residual: no neuron-level methods]"))
                   for n, s in MODELS.items()],
        "datasets": [(n, f"{DATASET_SUMMARIES.get(n, '')}; examples "
                         f"{'x'.join(map(str, DATASET_SHAPES[n])) if n in DATASET_SHAPES else 'of varying shape'}, "
                         f"default model {NATURAL_MODELS.get(n) or DEFAULT_MODELS.get(n, 'mlp')}")
                     for n in DATASETS],
    }
    for what in [args.what] if args.what else list(rows):
        if not args.what:
            print(f"{what}:")
        width = max(len(n) for n, _ in rows[what])
        specs = all_methods() if what == "methods" and args.options else {}
        for name, summary in rows[what]:
            print(f"{'  ' if not args.what else ''}{name:<{width}}  {summary}")
            if name in specs:
                print("\n".join(option_lines(specs[name], "    " if not args.what else "  ")))
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
