"""Deadlines, stragglers and over-selection: who of a sampled cohort reports, how many steps each trains, when
the round ends and what the others wasted (docs/deadlines.md).  Pure numpy over the cohort's ``[K]`` arrays.

Client ``k`` is predicted (:mod:`fedpartial._src.experiment.timing`) to download for ``d_k`` seconds, to take
``c_k`` seconds a local step for its ``n_k`` real steps and to upload for ``u_k`` seconds, one after the other:
it finishes at ``f_k = d_k + n_k·c_k + u_k`` (the device model's ``t_k``).  With a deadline ``D``:

* **drop** (``--straggler-policy drop``): a client with ``f_k > D`` does not report;
* **partial**: it trains the ``s_k = ⌊(D − d_k − u_k) / c_k⌋`` steps that fit (at most ``n_k``) and reports at
  ``d_k + s_k·c_k + u_k ≤ D``; a client for which no step fits does not report.

**Over-selection** (``--over-select F``): ``⌈F·K⌉`` clients are sampled and the first ``K`` to report are kept,
the rest not.  The round ends when the ``K``-th kept client reports (over-selection filled the round), else at
the deadline when anyone missed it (dropped, or trained fewer steps than planned), else when its slowest
client reports.  A sampled client that does not report wasted what it did until the round ended: the bytes it
downloaded (a share of them when the download did not end), the FLOPs of the steps it finished, and the bytes
it uploaded if it got that far (under ``partial``, a client for which no step fits stops after its download).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

POLICIES = ("drop", "partial")


class ClientTimes(NamedTuple):
    """Each cohort client's predicted work, host numpy ``[K]``."""

    download_s: np.ndarray  # d_k
    step_s: np.ndarray  # c_k: seconds of one local step
    upload_s: np.ndarray  # u_k
    steps: np.ndarray  # n_k: real local steps planned (int)
    download_bytes: np.ndarray
    upload_bytes: np.ndarray
    step_flops: np.ndarray  # FLOPs of one local step

    def finish(self, steps=None) -> np.ndarray:
        """``[K]`` when each client reports after ``steps`` steps (default: all it planned)."""
        steps = self.steps if steps is None else steps
        return self.download_s + np.asarray(steps, np.float64) * self.step_s + self.upload_s


class Outcome(NamedTuple):
    """A round's decisions (:func:`decide`)."""

    kept: np.ndarray  # [K] bool: reports and is aggregated
    steps: np.ndarray  # [K] int: the steps a kept client trains (0 for the others)
    end_s: float | None  # when the round was cut (deadline or K-th report); None: nobody was cut
    sampled: int  # real clients sampled
    finished: int  # of them, those kept
    wasted_flops: float
    wasted_bytes: float

    @property
    def dropped(self) -> int:
        return self.sampled - self.finished


def quantile_deadline(times: ClientTimes, valid: np.ndarray, q: float) -> float:
    """The ``q``-quantile (numpy's linear interpolation) of the valid clients' finish times ``f_k``; ∞ when
    none is valid."""
    finish = times.finish()[np.asarray(valid, bool)]
    return float(np.quantile(finish, q)) if finish.size else math.inf


def steps_that_fit(times: ClientTimes, deadline: float) -> np.ndarray:
    """``[K]`` the steps each client can train and still report by ``deadline``: all ``n_k`` when ``f_k ≤ D``,
    else ``⌊(D − d_k − u_k) / c_k⌋`` clipped to ``[0, n_k]`` (0 when the transfers alone overrun)."""
    n = np.asarray(times.steps, np.int64)
    room = deadline - times.download_s - times.upload_s
    with np.errstate(divide="ignore", invalid="ignore"):
        fit = np.where(times.step_s > 0, np.floor(room / np.where(times.step_s > 0, times.step_s, 1)), n)
    fit = np.where(room < 0, 0, np.clip(fit, 0, n)).astype(np.int64)
    return np.where(times.finish() <= deadline, n, fit)


def done_by(times: ClientTimes, steps: np.ndarray, end_s: float, uploads=True) -> tuple[np.ndarray, np.ndarray]:
    """``[K]`` the FLOPs and bytes of each client's work (download, ``steps`` steps, then, where ``uploads``, the
    upload) done by ``end_s``."""
    d, c, u = times.download_s, times.step_s, times.upload_s
    with np.errstate(divide="ignore", invalid="ignore"):
        down = np.where(d > 0, np.clip(end_s / np.where(d > 0, d, 1), 0, 1), 1.0)
        trained = np.where(c > 0, np.floor((end_s - d) / np.where(c > 0, c, 1)), steps)
        trained = np.where(end_s < d, 0, np.clip(trained, 0, steps))
        sent = end_s - d - steps * c
        up = np.where(u > 0, np.clip(sent / np.where(u > 0, u, 1), 0, 1), (sent >= 0).astype(np.float64))
    return trained * times.step_flops, down * times.download_bytes + np.where(uploads, up, 0) * times.upload_bytes


def decide(times: ClientTimes, valid, *, deadline: float = math.inf, policy: str = "drop",
           keep: int | None = None) -> Outcome:
    """Who of the ``valid`` clients reports by ``deadline`` under ``policy``, the first ``keep`` of them to
    report (None: all), the steps each trains, when the round ends and the work the others wasted."""
    if policy not in POLICIES:
        raise ValueError(f"straggler policy {policy!r} is not one of {POLICIES}")
    valid = np.asarray(valid, bool)
    n = np.asarray(times.steps, np.int64)
    if policy == "partial":
        planned = steps_that_fit(times, deadline)
        on_time = valid & (times.download_s + times.upload_s <= deadline) & ((planned > 0) | (n == 0))
    else:
        planned = n
        on_time = valid & (times.finish() <= deadline)
    finish = times.finish(planned)
    keep = int(valid.sum()) if keep is None else keep
    order = np.argsort(np.where(on_time, finish, np.inf), kind="stable")  # ties: cohort order
    kept = np.zeros_like(valid)
    kept[order[:keep]] = True
    kept &= on_time
    if kept.sum() == keep and (valid & ~kept).any():
        end = float(finish[kept].max()) if keep else 0.0  # over-selection filled the round
    elif (valid & (~kept | (planned < n))).any():
        end = float(deadline)  # someone missed the deadline
    else:
        end = None
    wasted_flops = wasted_bytes = 0.0
    if end is not None:
        lost = valid & ~kept
        # (partial: a client for which no step fits trains and uploads nothing after its download)
        flops, sent = done_by(times, planned, end, uploads=on_time | (policy == "drop"))
        wasted_flops, wasted_bytes = float(flops[lost].sum()), float(sent[lost].sum())
    return Outcome(kept, np.where(kept, planned, 0), end, int(valid.sum()), int(kept.sum()), wasted_flops,
                   wasted_bytes)
