"""Simulated device time: device profiles, round times, and the FLOPs each client spends a round.

**Time model** (docs/decisions.md#feddhad, the device model).  Client ``k`` of a round spends

    t_k = F_k / c_k  +  D_k / b↓_k  +  U_k / b↑_k

seconds: ``F_k`` FLOPs of local work at compute speed ``c_k`` (FLOP/s), ``D_k``
bytes downloaded at ``b↓_k`` and ``U_k`` bytes uploaded at ``b↑_k`` (bytes/s),
one after the other (download, train, upload; no overlap).  A round lasts as long
as its slowest *valid* client (padding clients never count); server-side work
(aggregation, evaluation) is taken to be free.  :func:`client_times`,
:func:`round_time` and :func:`expected_execution_time` are that arithmetic.

**Device profiles** (:class:`DeviceProfiles`, host numpy ``[N]``) are drawn from
seeded distributions (:func:`sample_profiles`; every client independently, each
quantity from its own stream, so changing one distribution leaves the others'
draws as they were) or read from a CSV (:func:`load_profiles`).  Default
distributions (log-normal: device populations are skewed, with a long tail of
slow phones) are orders of magnitude for phones and edge boards, not a fit to a
trace:

* compute: median 5 GFLOP/s, σ = 0.7 (10th–90th percentile ≈ 2–12 GFLOP/s) — the
  sustained FP32 throughput of phone CPUs / small edge GPUs in on-device benchmarks
  (AI Benchmark, Ignatov et al. 2019, measures phones' inference in the GFLOP/s
  range; training runs slower than peak inference);
* download: median 20 Mbit/s (2.5 MB/s), upload: median 5 Mbit/s (0.625 MB/s),
  σ = 0.8 each — the order of mobile-network medians in public speed-test reports,
  with the several-fold download/upload asymmetry that Konečný et al. (2016,
  "Federated learning: strategies for improving communication efficiency") build on.

Give measured profiles as a CSV for anything that depends on the absolute numbers.

**FLOPs per round** (``F_k``): :class:`CostModel` applies
:mod:`fedpartial._src.costs.flops`' counts of each client group's compiled step round
by round (real steps × (step + preparation of one batch); a sub-model client is
charged for the units its round kept).
"""

from __future__ import annotations

import csv
import dataclasses
import math
import numbers
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedpartial._src.core import masks
from fedpartial._src.core.errors import UserError
from fedpartial._src.core.masks import Mask
from fedpartial._src.costs.profile_defaults import DEFAULT_COMPUTE, DEFAULT_DOWNLOAD, DEFAULT_UPLOAD
from fedpartial._src.costs.flops import GroupCost, kept_shares, layer_costs, step_costs, submodel_flops

# ---- device profiles -------------------------------------------------------------------

# The default distributions (DEFAULT_COMPUTE, DEFAULT_DOWNLOAD, DEFAULT_UPLOAD) are plain text in profile_defaults,
# so that a run's settings hold them without JAX; the module docstring says where they come from.

#: CSV columns of a device-profiles file (other columns, e.g. a device name, are ignored)
PROFILE_COLUMNS = ("compute_flops_per_s", "download_bytes_per_s", "upload_bytes_per_s")
DISTRIBUTION_KINDS = ("lognormal", "uniform")


class Distribution(NamedTuple):
    """A positive per-client quantity: ``lognormal`` (a = median, b = σ of the log),
    ``uniform`` (between a and b) or ``constant`` (a)."""

    kind: str
    a: float
    b: float = 0.0

    def draw(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` independent draws (float64)."""
        if self.kind == "constant":
            return np.full(n, self.a, np.float64)
        if self.kind == "uniform":
            return rng.uniform(self.a, self.b, n)
        return self.a * np.exp(self.b * rng.standard_normal(n))


def _positive_finite(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def parse_distribution(text: str | Distribution, what: str = "value") -> Distribution:
    """``"lognormal:MEDIAN:SIGMA"``, ``"uniform:LOW:HIGH"`` or a plain positive number.

    Raises:
      UserError: one sentence naming ``what``, the bad text and what is allowed.
    """
    if isinstance(text, Distribution):
        text = f"{text.kind}:{text.a}:{text.b}" if text.kind != "constant" else str(text.a)
    allowed = "a positive number, 'lognormal:MEDIAN:SIGMA' or 'uniform:LOW:HIGH'"
    parts = str(text).strip().split(":")
    try:
        numbers_ = [float(p) for p in (parts if len(parts) == 1 else parts[1:])]
    except ValueError:
        raise UserError(f"{what} {text!r} is not {allowed}.") from None
    if len(parts) == 1:
        if not _positive_finite(numbers_[0]):
            raise UserError(f"{what} {text!r} must be a positive finite number.")
        return Distribution("constant", numbers_[0])
    kind = parts[0].strip().lower()
    if kind not in DISTRIBUTION_KINDS or len(numbers_) != 2:
        raise UserError(f"{what} {text!r} is not {allowed}.")
    a, b = numbers_
    if kind == "lognormal" and not (_positive_finite(a) and math.isfinite(b) and b >= 0):
        raise UserError(f"{what} {text!r} needs a positive finite median and a finite σ ≥ 0.")
    if kind == "uniform" and not (_positive_finite(a) and _positive_finite(b) and a <= b):
        raise UserError(f"{what} {text!r} needs finite bounds with 0 < LOW ≤ HIGH.")
    return Distribution(kind, a, b)


class DeviceProfiles(NamedTuple):
    """Every client's device, host numpy ``[N]`` float64 each."""

    compute_flops_per_s: np.ndarray
    download_bytes_per_s: np.ndarray
    upload_bytes_per_s: np.ndarray

    @property
    def num_clients(self) -> int:
        return len(self.compute_flops_per_s)


def sample_profiles(num_clients: int, seed: int, *, compute: str | Distribution = DEFAULT_COMPUTE,
                    download: str | Distribution = DEFAULT_DOWNLOAD,
                    upload: str | Distribution = DEFAULT_UPLOAD) -> DeviceProfiles:
    """``num_clients`` devices drawn independently; the same seed gives the same devices.

    Each quantity has its own random stream (seeded by ``seed`` and its column), so a
    run that changes only the upload distribution keeps every client's compute speed.
    """
    dists = [parse_distribution(d, name) for d, name in
             zip((compute, download, upload), ("compute speed", "download bandwidth", "upload bandwidth"))]
    columns = [d.draw(num_clients, np.random.default_rng([seed, 0xDE1C, i])) for i, d in enumerate(dists)]
    return DeviceProfiles(*columns)


def save_profiles(path: str | os.PathLike, profiles: DeviceProfiles) -> None:
    """Writes ``profiles`` as a CSV with :data:`PROFILE_COLUMNS` (one row per client, exact floats)."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(PROFILE_COLUMNS)
        for row in zip(*profiles):
            writer.writerow([repr(float(v)) for v in row])


def read_csv_columns(path: str | os.PathLike, columns: tuple[str, ...], what: str) -> list[list[str]]:
    """Every data row's stripped text in ``columns`` (in that order) of the CSV at ``path``, whose header may
    hold them in any order among others.  ``what`` names the file in errors (e.g. "device profiles file").

    Raises:
      UserError: one sentence naming the file: it cannot be read, is not CSV text, or lacks a column.
    """
    name = os.fspath(path)
    try:
        with open(name, newline="") as f:
            reader = csv.DictReader(f)
            header = [h.strip() for h in (reader.fieldnames or [])]
            missing = [c for c in columns if c not in header]
            if missing:
                raise UserError(f"{what} {name} has no column {missing[0]!r}; it needs the columns "
                                f"{', '.join(columns)}.")
            reader.fieldnames = header
            return [[(row.get(c) or "").strip() for c in columns] for row in reader]
    except OSError as e:
        raise UserError(f"{what} {name} cannot be read ({e.strerror or e}).") from None
    except (UnicodeDecodeError, csv.Error) as e:
        raise UserError(f"{what} {name} is not a CSV text file ({e}).") from None


def load_profiles(path: str | os.PathLike, num_clients: int) -> DeviceProfiles:
    """Device profiles from a CSV with the columns :data:`PROFILE_COLUMNS` (any order, extra ones ignored).

    Rows are assigned to clients **cycled by id**: client ``i`` gets data row ``i mod R``
    (R rows), so a file with one row per client gives each its own device and a short
    file describes device kinds that repeat across the population.

    Raises:
      UserError: the file is missing or empty, lacks a column, or a value (named by
        row and column; rows count from 1 after the header) is not a positive finite number.
    """
    name = os.fspath(path)
    rows = []
    for i, texts in enumerate(read_csv_columns(name, PROFILE_COLUMNS, "device profiles file"), start=1):
        values = []
        for column, text in zip(PROFILE_COLUMNS, texts):
            try:
                value = float(text)
            except ValueError:
                value = math.nan
            if not _positive_finite(value):
                raise UserError(f"device profiles file {name}: row {i} has {column} = {text!r}, which must "
                                "be a positive finite number.")
            values.append(value)
        rows.append(values)
    if not rows:
        raise UserError(f"device profiles file {name} has a header but no rows; give at least one device.")
    table = np.asarray(rows, np.float64)[np.arange(num_clients) % len(rows)]
    return DeviceProfiles(*table.T.copy())


# ---- the time model --------------------------------------------------------------------


def client_times(profiles: DeviceProfiles, client_ids, flops, download_bytes, upload_bytes) -> np.ndarray:
    """Each client's round time ``F/c + D/b↓ + U/b↑`` in seconds, ``[K]`` float64.

    ``client_ids`` ``[K]`` index the population's profiles (None: every client, in id
    order); ``flops``, ``download_bytes`` and ``upload_bytes`` broadcast against it.
    """
    ids = np.arange(profiles.num_clients) if client_ids is None else np.asarray(client_ids)
    return (np.asarray(flops, np.float64) / profiles.compute_flops_per_s[ids]
            + np.asarray(download_bytes, np.float64) / profiles.download_bytes_per_s[ids]
            + np.asarray(upload_bytes, np.float64) / profiles.upload_bytes_per_s[ids])


def round_time(times, valid) -> float:
    """The round's simulated time: its slowest valid client's (0 when none is valid)."""
    times = np.asarray(times, np.float64)
    return float(np.max(np.where(np.asarray(valid, bool), times, 0.0), initial=0.0))


def expected_execution_time(profiles: DeviceProfiles, flops, download_bytes, upload_bytes) -> np.ndarray:
    """``ET_k`` of every client ``[N]``: the time of a round's work of ``flops`` FLOPs and the
    given bytes on each device (e.g. full-model local training, for FedAD's target
    dropout rates ``d*_k = min(ET_max / ET_k, 1)``)."""
    return client_times(profiles, None, flops, download_bytes, upload_bytes)


# ---- FLOPs round by round ---------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class CostModel:
    """The FLOPs of a :class:`~fedpartial._src.engine.round.FederatedRound`'s local work, round by round.

    Counts (and compiles, unless ``compiled=False``) each group's step once per
    distinct cohort shape (``compilations`` counts how often).  Use::

        costs = CostModel(fr)
        dropout = costs.round_dropout(state, cohort, key)   # before the round (state is donated)
        state, metrics = fr(state, cohort, key)
        flops = costs.client_flops(cohort, metrics["client_steps_per_client"], dropout)  # [K]
    """

    fr: Any
    compiled: bool = True  # count the compiled steps (False: pre-optimisation HLO, see step_costs)
    compilations: int = 0

    def __post_init__(self):
        self._cache: dict = {}
        self._dropout_fn = None
        self._layers = None

    @staticmethod
    def _signature(cohort) -> tuple:
        leaves, treedef = jax.tree.flatten(cohort)
        return treedef, tuple((np.shape(a), np.dtype(a.dtype).str if not jax.dtypes.issubdtype(
            a.dtype, jax.dtypes.extended) else str(a.dtype)) for a in leaves)

    def share_counts(self, other: "CostModel") -> None:
        """Read (and add to) ``other``'s counts from now on: for rounds built alike (the replicas of one
        run: seeds and rates differ, the model, method and shapes do not), so the step is compiled and
        counted once for all of them instead of once each."""
        self._cache = other._cache

    def group_costs(self, cohort, state=None) -> tuple[GroupCost, ...]:
        """:func:`step_costs` for this cohort's shapes, compiled on the first call per shape."""
        sig = self._signature(cohort)
        if sig not in self._cache:
            self._cache[sig] = step_costs(self.fr, cohort, state, compiled=self.compiled)
            self.compilations += 1
        return self._cache[sig]

    def round_dropout(self, state, cohort, key) -> Mask | None:
        """The round's ``[K]`` dropout mask (host numpy), or None for a full-model method.

        Computes the plan the round itself will compute (same state, cohort and key);
        call it before the round, whose fused strategy consumes ``state``.
        """
        if not any(cost.submodel for cost in self.group_costs(cohort)):
            return None
        if self._dropout_fn is None:
            def dropout(state, cohort, key):
                structure = self.fr.model.structure
                parts = [masks.full(structure, (g.size,)) if li.plan.dropout is None else li.plan.dropout
                         for g, li in zip(self.fr.groups, self.fr.local_inputs(state, cohort, key))]
                parts = [p._replace(inputs=None) for p in parts]  # only the neurons say what a sub-model keeps
                return parts[0] if len(parts) == 1 else jax.tree.map(lambda *a: jnp.concatenate(a), *parts)
            self._dropout_fn = jax.jit(dropout)
        return jax.device_get(self._dropout_fn(state, cohort, key))

    def client_flops(self, cohort, steps, dropout: Mask | None = None, densities=None) -> np.ndarray:
        """``[K]`` float64 FLOPs each client spent this round: real steps × (step + preparation
        of one batch), scaled to the kept units for a sub-model client, times the method's
        ``Capabilities.local_passes`` (the models each client trains on those batches).

        ``densities`` (``[K, L]``, the ``trained_density`` metric of element masks; ``--sparse-flops``): the
        share of each layer a client trains, credited as a client computing sparsely — its kernel work and
        its per-parameter work scale with the share, the rest (activations, loss) does not.  None: dense."""
        steps = np.asarray(steps, np.float64)
        out = np.zeros_like(steps)
        for cost, group, offset in zip(self.group_costs(cohort), self.fr.groups, self.fr.offsets):
            rows = slice(offset, offset + group.size)
            step, prepare = cost.step_flops, cost.prepare_flops
            if densities is not None:
                if self._layers is None:
                    self._layers = layer_costs(self.fr.model)
                shares = np.asarray(densities, np.float64)[rows]
                step = submodel_flops(step, self._layers, cost.step_layers, (shares, np.ones_like(shares)),
                                      cost.batch_size, fixed_flops=cost.step_fixed_flops)
            elif cost.submodel and dropout is not None and self.fr.model.lora is None:
                # (a LoRA model's rank tiers: XLA's count of the full-rank step stands, the base's forward and
                # backward being nearly all of it; docs/decisions.md#lora)
                if self._layers is None:
                    self._layers = layer_costs(self.fr.model)
                mask = jax.tree.map(lambda a, rows=rows: np.asarray(a)[rows], dropout)
                shares = kept_shares(self.fr.model, mask)
                step = submodel_flops(step, self._layers, cost.step_layers, shares, cost.batch_size,
                                      fixed_flops=cost.step_fixed_flops)
                prepare = submodel_flops(prepare, self._layers, cost.prepare_layers, shares, cost.batch_size,
                                         backward=False)
            out[rows] = steps[rows] * (step + prepare)
        return out * self.fr.method.capabilities.local_passes
