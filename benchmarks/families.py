"""What the method-family benchmarks share (``benchmarks/personalised.py``, ``tiers.py``, ``drift.py``): sizes,
seeds run as replicas, a result file written row by row that a re-run continues, and pooled statistics.

* **Sizes.**  Each benchmark has a ``--size``: ``cpu`` (the default, sized to finish within its budget on two
  quiet CPU cores), ``paper`` (the issue's full protocol: N = 100, K = 10, digits, mnist5k and Synthetic,
  Dirichlet α ∈ {0.1, 0.5}, two seeds) and ``tiny`` (seconds: the smoke tests).
* **Seeds** run as replicas of one simulation (:func:`fedpartial._src.experiment.replicas.run_seeds`): one
  build and one compile for all seeds.  On a CPU the replica axis is a scan over the seeds inside the
  jitted round, so their training still costs about one run each; what the replicas save there is the
  per-run build and compile (``docs/benchmarks.md``, "Seeds and learning rates as replicas").  On an
  accelerator they run vmapped, at once.
* **Progress.**  :class:`Progress` writes the whole JSON (device, date, command, git revision, settings,
  rows) after every row, then the figure, so a run cut off keeps what it measured; run again with the
  same settings it skips the rows already in the file.  A file holding other settings is refused
  (``--fresh`` starts it over).
"""

from __future__ import annotations

import argparse

import datetime
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import numpy as np

from benchmarks import device_slug

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = ("cpu", "paper", "tiny")


def git_revision() -> str | None:
    """The checkout's commit (short), ``+dirty`` when tracked files differ from it; None outside git."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return rev + ("+dirty" if dirty else "")


def device() -> dict:
    d = jax.devices()[0]
    return {"platform": d.platform, "device_kind": d.device_kind, "cpu_count": os.cpu_count(),
            "jax_version": jax.__version__}


def _plain(value):
    """``value`` as JSON reads it back (tuples become lists), to compare settings with a file's."""
    return json.loads(json.dumps(value, default=_default))


def _default(o):
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, float) and math.isnan(o):
        return None
    return str(o)


class SettingsDiffer(SystemExit):
    """The result file holds a run with other settings (one sentence; the command exits with it)."""


class Progress:
    """A benchmark's JSON, rewritten whole after every row (and its figure after it), continued on a re-run.

    ``key`` names the row fields that identify a row (e.g. ``("dataset", "alpha", "method")``).  ``figure``,
    when given, is called as ``figure(rows, png_path)`` after every row that adds one.
    """

    def __init__(self, benchmark: str, path: str, settings: dict, key: Sequence[str], argv: Sequence[str], *,
                 fresh: bool = False, figure: Callable[[list, str], None] | None = None):
        self.path, self.key, self.figure = path, tuple(key), figure
        self.png = os.path.splitext(path)[0] + ".png"
        settings = _plain(settings)
        old = None
        if os.path.exists(path) and not fresh:
            with open(path) as f:
                old = json.load(f)
            if old.get("settings") != settings:
                changed = sorted(k for k in set(settings) | set(old.get("settings", {}))
                                 if settings.get(k) != old.get("settings", {}).get(k))
                raise SettingsDiffer(f"{path} holds a run with other settings ({', '.join(changed)}); run with "
                                     f"--fresh to start it over, or --tag to write another file.")
        self.data = {"benchmark": benchmark, "device": device(),
                     "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                     "command": " ".join([f"python -m benchmarks.{benchmark}", *argv]),
                     "git_revision": git_revision(), "settings": settings, "notes": [], "rows": [],
                     "total_time_s": 0.0, "total_cpu_s": 0.0}
        if old is not None:  # continued: the rows and time so far; this run's date, command and revision
            self.data.update(rows=old["rows"], notes=old.get("notes", []), total_time_s=old.get("total_time_s", 0.0),
                             total_cpu_s=old.get("total_cpu_s", 0.0),
                             started=old.get("started", old.get("date")))
        self.data.setdefault("started", self.data["date"])

    @property
    def rows(self) -> list[dict]:
        return self.data["rows"]

    def has(self, **where) -> bool:
        """Whether a row with these key values is in the file already."""
        want = _plain({k: where[k] for k in self.key})
        return any(all(r.get(k) == v for k, v in want.items()) for r in self.rows)

    def note(self, text: str) -> None:
        if text not in self.data["notes"]:
            self.data["notes"].append(text)
            print(text, file=sys.stderr, flush=True)
        self.write()

    def add(self, row: dict) -> None:
        """Appends ``row`` (its ``wall_s`` counted in the total) and writes the file and the figure."""
        self.rows.append(_plain(row))
        self.data["total_time_s"] += float(row.get("wall_s", 0.0))
        self.data["total_cpu_s"] += float(row.get("cpu_s", 0.0))
        self.write()
        if self.figure is not None:
            self.figure(self.rows, self.png)

    def write(self) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        partial = self.path + ".partial"
        with open(partial, "w") as f:
            json.dump(self.data, f, default=_default)
        os.replace(partial, self.path)  # never a half-written file


def result_path(out: str, benchmark: str, size: str, tag: str | None) -> str:
    """``<out>/<benchmark>-<device>-<size>[-tag].json``."""
    return os.path.join(out, f"{benchmark}-{device_slug()}-{size}" + (f"-{tag}" if tag else "") + ".json")


class Seeds(NamedTuple):
    """What :func:`run_seeds` returns: every seed's records and simulation (its final state), and the time."""

    records: list[list[dict]]
    sims: list
    wall_s: float
    cpu_s: float  # this process's CPU time (every thread): on a shared machine, steadier than the wall time


def run_seeds(config, seeds: Sequence[int], dataset_for: Callable | None = None) -> Seeds:
    """``config`` once per seed as replicas of one simulation (nothing written)."""
    from fedpartial._src.experiment import replicas

    start, cpu = time.perf_counter(), time.process_time()
    done = replicas.run_seeds(config, list(seeds), dataset_for=dataset_for)
    for seed, result in zip(seeds, done["results"]):
        if result.get("error") is not None:
            raise RuntimeError(f"seed {seed} of {config.method} on {config.dataset} failed: {result['error']}")
    return Seeds([r["records"] for r in done["results"]], done["simulations"], time.perf_counter() - start,
                 time.process_time() - cpu)


def pooled(means: Sequence[float], stds: Sequence[float]) -> tuple[float, float]:
    """Mean and (population) std over every client of every seed, from each seed's client mean and std
    (every seed has the same number of clients)."""
    means, stds = np.asarray(means, float), np.asarray(stds, float)
    grand = float(means.mean())
    return grand, float(np.sqrt(np.mean(stds ** 2 + (means - grand) ** 2)))


def mean_curve(records: list[list[dict]], field: str, x: str = "round") -> list[tuple[float, float]]:
    """``(x, mean over seeds of field)`` at every round where every seed recorded ``field``."""
    by_seed = [{r[x]: r[field] for r in rs if r.get(field) is not None} for rs in records]
    common = sorted(set.intersection(*(set(s) for s in by_seed))) if by_seed else []
    return [(float(t), float(np.mean([s[t] for s in by_seed]))) for t in common]


def floats(text: str) -> tuple[float, ...]:
    return tuple(float(v) for v in text.split(",") if v.strip())


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v.strip())


def names(text: str) -> tuple[str, ...]:
    return tuple(v.strip().lower() for v in text.split(",") if v.strip())


def parser(benchmark: str, doc: str, methods: Sequence[str], size_help: str) -> argparse.ArgumentParser:
    """The flags every family benchmark takes: ``--size``, ``--methods``, ``--datasets``, ``--out``, ``--tag``,
    ``--fresh`` (a benchmark adds its own); ``doc``: the benchmark's docstring (its first line describes it)."""
    p = argparse.ArgumentParser(prog=f"python -m benchmarks.{benchmark}", description=doc.splitlines()[0])
    p.add_argument("--size", choices=SIZES, default="cpu", help=size_help)
    p.add_argument("--methods", default=",".join(methods), help=f"a subset of {', '.join(methods)}")
    p.add_argument("--datasets", default=None, help="default: the size's")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tag", default=None, help="appended to the file name")
    p.add_argument("--fresh", action="store_true", help="start the result file over instead of continuing it")
    return p


def chosen(p: argparse.ArgumentParser, args, sizes: dict, methods: Sequence[str], setups: dict
           ) -> tuple[dict, tuple[str, ...]]:
    """The size's settings (``--datasets`` applied) and the methods asked for; an unknown method or data set is
    refused through ``p`` in one sentence."""
    s = dict(sizes[args.size])
    asked = names(args.methods)
    if bad := [m for m in asked if m not in methods]:
        p.error(f"method {bad[0]!r} is not compared here; choose from {', '.join(methods)}")
    if args.datasets:
        s["datasets"] = names(args.datasets)
    if bad := [d for d in s["datasets"] if d not in setups]:
        p.error(f"dataset {bad[0]!r} has no setup here; choose from {', '.join(setups)}")
    return s, asked
