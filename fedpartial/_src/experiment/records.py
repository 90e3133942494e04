"""The run record: ``config.toml``, ``config.json``'s resolved values, ``environment.json`` and ``metrics.csv``.

Decisions taken (issue 13):

* **Run record.**  :func:`to_toml` writes a run's resolved configuration as a run config file (the flat
  TOML scheme of ``fedpartial run --config``, read by :mod:`fedpartial._src.cli.config_file`): run again
  with ``fedpartial run --config RUN_DIR/config.toml`` to repeat it (same seed, same metrics).
  :func:`environment` records versions, backend, devices, seed, command line and time.
* **metrics.csv** (:class:`MetricsCSV`) has one row per round with the records' scalar fields only
  (numbers and switches; a switch is 1/0).  List values (per-client or per-layer values of a method's
  metrics) are left out: they stay in ``metrics.jsonl``.  A non-finite number is an empty cell.
  Columns are the scalar keys in order of first appearance; a key first seen in a later round (e.g.
  ``test_accuracy`` with ``--eval-every 5``) rewrites the file with the wider header, so the file is
  always a complete, rectangular CSV after every round.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import math
import os
import platform
import sys
from importlib import metadata

from fedpartial._src.core.errors import UserError


def _spec_or_none(find_method, name: str):
    """The method's spec, or None for a method object given to a simulation (its name finds nothing)."""
    try:
        return find_method(name)
    except UserError:
        return None


def resolved(config, sim=None):
    """``config`` with every default it leaves open filled in: the method's options, the local epochs in
    effect, and (given the built :class:`~fedpartial._src.experiment.simulation.Simulation`) the model and train fraction."""
    from fedpartial._src.methods.catalog import find_method
    from fedpartial._src.models import registry

    changes = {"local_epochs": config.epochs}
    spec = _spec_or_none(find_method, config.method)
    if spec is not None:
        changes["options"] = {o.name: config.options.get(o.name, o.default) for o in spec.options}
    if sim is not None:
        if sim.model.name in registry.MODELS:
            changes["model"] = sim.model.name
        changes["train_fraction"] = float(sim.train_fraction)
        changes["data_placement"] = sim.data_placement
    return dataclasses.replace(config, **changes)


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    text = str(value)
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    escaped = "".join(c if c >= " " and c != "\x7f" else f"\\u{ord(c):04x}" for c in escaped)
    return f'"{escaped}"'


def to_toml(config) -> str:
    """``config`` (a :class:`~fedpartial._src.experiment.simulation.RunConfig`) as a run config file for ``--config``.

    Keys are the command-line flags; unset values (None) are left out; method options are written by their
    flags.  Reading it back with ``fedpartial run --config`` gives the same configuration.
    """
    from fedpartial._src.experiment.settings import flag_of
    from fedpartial._src.methods.catalog import find_method

    lines = ["# fedpartial run --config this-file  (keys are the flags of `fedpartial run`)"]
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if field.name == "options" or value is None:
            continue
        if field.name == "local_epochs" and config.local_steps is not None:
            continue
        lines.append(f"{flag_of(field)[2:]} = {_toml_value(value)}")
    if config.options:
        spec = _spec_or_none(find_method, config.method)
        lines.append(f"# options of method {config.method}")
        for name, value in config.options.items():
            flag = spec.option(name).cli_flag if spec is not None else "--" + name.replace("_", "-")
            if isinstance(value, (tuple, list)):
                value = ",".join(map(str, value))  # list options are parsed from text, as on the command line
            lines.append(f"{flag[2:]} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def environment(config) -> dict:
    """What a run ran on: versions, JAX backend and devices, seed, command line and time."""
    import jax

    from fedpartial._src.version import __version__

    return {
        "fedpartial": __version__,
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "packages": {p: _version(p) for p in ("jax", "jaxlib", "flax", "optax", "numpy", "orbax-checkpoint")},
        "backend": jax.default_backend(),
        "devices": sorted({d.device_kind for d in jax.devices()}),
        "device_count": jax.device_count(),
        "seed": config.seed,
        "argv": list(sys.argv),
        "cwd": os.getcwd(),
        "time": datetime.datetime.now(datetime.timezone.utc).astimezone().isoformat(timespec="seconds"),
    }


def _cell(value):
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, float) and not math.isfinite(value):
        return ""
    return value


def _scalar(value) -> bool:
    import numpy as np

    return isinstance(value, (int, float, bool, np.integer, np.floating, np.bool_)) or value is None


class MetricsCSV:
    """``metrics.csv``: one row per round, scalar fields only (see the module's decisions)."""

    def __init__(self, path: str, records: list[dict] = ()):
        self.path = path
        self.columns: list[str] = []
        self.rows: list[dict] = []
        self._file = None
        for record in records:
            self._take(record)
        self._rewrite()

    def _take(self, record: dict) -> bool:
        row = {k: (v.item() if hasattr(v, "item") else v) for k, v in record.items() if _scalar(v)}
        row = {k: ("" if v is None else _cell(v)) for k, v in row.items()}
        new = [k for k in row if k not in self.columns]
        self.columns.extend(new)
        self.rows.append(row)
        return bool(new)

    def _rewrite(self):
        if self._file:
            self._file.close()
        tmp = f"{self.path}.tmp"
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, self.columns, restval="")
            writer.writeheader()
            writer.writerows(self.rows)
        os.replace(tmp, self.path)
        self._file = open(self.path, "a", newline="")
        self._writer = csv.DictWriter(self._file, self.columns, restval="")

    def write(self, record: dict) -> None:
        if self._take(record):
            self._rewrite()
        else:
            self._writer.writerow(self.rows[-1])
            self._file.flush()

    def close(self) -> None:
        if self._file:
            self._file.close()
            self._file = None
