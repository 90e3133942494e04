"""What ``fedpartial run`` says while a run goes and when it ends: the progress fields (``compiling…`` until the
first round is done, then rounds/s and an ETA from the rounds after it), the replicas' labelled progress line
(``seed=1 lr=0.05: acc 0.41``), the closing table's rows and the warnings under it (accuracy near chance, a
weak privacy guarantee)."""

from __future__ import annotations

import math
from typing import Sequence

from fedpartial._src.cli.display import duration, mb

COMPILING = "compiling…"
#: a final test accuracy less than this above chance (1 / classes) is said to be near chance
NEAR_CHANCE = 0.10
#: an ε above this is said to be a weak guarantee
WEAK_EPSILON = 10.0


class RoundClock:
    """Rounds/s and the ETA of a run from its steady rounds.

    The first round a session runs also compiles the round (and evaluation), which can take far longer than
    a round; it is left out, so the ETA is what the remaining rounds will take.  Until that first round is
    done the ETA reads ``compiling…``; after it, ``–`` until a steady round has been timed.

    Args:
      total: the round the run ends at.
    """

    def __init__(self, total: int):
        self.total = total
        self.first: int | None = None  # this session's first round (a resumed run starts at its checkpoint)
        self.first_wall = 0.0
        self.steady_wall = 0.0
        self.steady_rounds = 0

    def tick(self, round_: int, wall_s: float) -> dict[str, str]:
        """Counts one finished round; returns the ``rate`` and ``eta`` fields to show.

        Args:
          round_: the round just finished (from 1).
          wall_s: its wall time in seconds (the record's ``wall_time_s``).

        Returns:
          ``{"rate": rounds/s or "–", "eta": duration, "–" or "done", "compile": first round's time}``.
        """
        if self.first is None:
            self.first, self.first_wall = round_, wall_s
        else:
            self.steady_wall += wall_s
            self.steady_rounds += 1
        rate = self.steady_rounds / self.steady_wall if self.steady_wall > 0 else math.nan
        left = self.total - round_
        eta = "done" if left <= 0 else duration(left / rate) if math.isfinite(rate) and rate > 0 else "–"
        return {"rate": f"{rate:.2f}" if math.isfinite(rate) else "–", "eta": eta,
                "compile": duration(self.first_wall)}


def round_fields(record: dict, accuracy: str, clock: RoundClock) -> dict[str, str]:
    """The progress line's fields for one round's ``record`` (``accuracy``: the latest test accuracy shown)."""
    return dict(acc=accuracy, loss=f"{record['train_loss']:.3f}",
                traffic=mb(record["cumulative_upload_bytes"] + record["cumulative_download_bytes"]),
                **clock.tick(record["round"], record.get("wall_time_s", 0.0)))


def round_line(record: dict, total: int, fields: dict[str, str]) -> str:
    """One plain progress line (off a terminal)."""
    eta = f"ETA {fields['eta']}" if fields["rate"] != "–" else f"first round (compiling included) {fields['compile']}"
    return (f"round {record['round']}/{total}  acc {fields['acc']}  train loss {fields['loss']}  "
            f"traffic {fields['traffic']}  {fields['rate']} rounds/s  {eta}")


def replica_labels(settings: Sequence, seeds_given: bool) -> list[str]:
    """Each replica's label, naming only what varies: ``seed=1``, ``lr=0.05``, ``server lr=0.5`` (a seed is named
    when several seeds run or ``--seeds`` was given)."""
    several = len({s.seed for s in settings}) > 1 or seeds_given
    labels = []
    for s in settings:
        parts = ([f"seed={s.seed}"] if several else []) + ([f"lr={s.lr:g}"] if s.lr is not None else []) + (
            [f"server lr={s.server_lr:g}"] if s.server_lr is not None else [])
        labels.append(" ".join(parts) or f"seed={s.seed}")
    return labels


def replica_line(t: int, total: int, labels: Sequence[str], records: Sequence[dict | None]) -> str:
    """One round of every replica: ``round 3/40  seed=0 lr=0.02: acc 0.4100 train loss 1.234 | ...``; a
    finished replica (record None) is left out."""
    parts = []
    for label, r in zip(labels, records):
        if r is None:
            continue
        acc = f"{r['test_accuracy']:.4f}" if "test_accuracy" in r else "–"
        loss = f" train loss {r['train_loss']:.3f}" if "train_loss" in r else ""
        parts.append(f"{label}: acc {acc}{loss}")
    running = sum(r is not None for r in records)
    tail = "" if running == len(records) else f"  ({running} of {len(records)} replicas running)"
    return f"round {t + 1}/{total}  " + " | ".join(parts) + tail


def closing_warnings(summary: dict, num_classes: int | None) -> list[str]:
    """What the closing table must not let pass unsaid: a final accuracy within :data:`NEAR_CHANCE` of chance, an
    ε over :data:`WEAK_EPSILON`.

    Args:
      summary: the run's summary (``summary.json``'s fields).
      num_classes: the model's classes (None: unknown, no accuracy warning).

    Returns:
      One sentence per warning (empty: nothing to say).
    """
    out = []
    acc = summary.get("final_test_accuracy")
    if num_classes and acc is not None and math.isfinite(acc) and acc < 1 / num_classes + NEAR_CHANCE:
        out.append(f"final test accuracy {acc:.3f} is within {NEAR_CHANCE * 100:.0f} points of chance "
                   f"({1 / num_classes:.3f} for {num_classes} classes): the model has barely learned "
                   f"(the Troubleshooting page of the documentation).")
    idle = summary.get("rounds_training_nothing")
    if idle:
        out.append(f"in {idle} of {summary.get('rounds', idle)} rounds the method's train masks selected no parameter "
                   f"of any client, so the model did not learn then; check the layers or fractions its masks are "
                   f"built from.")
    eps = summary.get("final_dp_epsilon")
    if eps is not None and (not math.isfinite(eps) or eps > WEAK_EPSILON):
        out.append(f"ε = {eps:.3g} (at δ = {summary.get('dp_delta', float('nan')):.3g}, for the whole run) is over "
                   f"{WEAK_EPSILON:g}: a weak privacy guarantee; more noise, fewer rounds or more clients lower it "
                   f"(the Differential privacy page of the documentation).")
    return out


def held_out_rows(summary: dict, personal: bool) -> list[tuple[str, str]]:
    """The closing table's rows on the clients' held-out data: "personal accuracy" only for a method whose
    clients have models of their own (``personal``); otherwise the global model is what every client holds."""
    if "final_personal_accuracy" not in summary:
        return []
    spread = f"{summary['final_personal_accuracy']:.4f} ± {summary['final_personal_accuracy_std']:.4f}"
    if not personal:
        return [("global model on clients' held-out data (mean ± std over clients)", spread)]
    return [("personal accuracy (mean ± std over clients)", spread),
            ("global model on clients' held-out data", f"{summary['final_global_client_accuracy']:.4f}"),
            ("personal state", mb(summary["personal_state_bytes"]))]


def closing_rows(config, summary: dict, personal: bool = True) -> list[tuple[str, str]]:
    """The closing table's rows: what ran, how well, at what cost, where the results are."""
    return [
        ("model", f"{summary['model']} ({summary['num_params']:,} parameters)"),
        ("clients / cohort", f"{config.num_clients} / {config.cohort_size}"),
        ("strategy", f"{summary['strategy'].removesuffix(':None')} on {summary['backend']}, "
                     f"data on the {summary['data_placement']}"
                     + (f" ({summary['strategy_note']})" if "strategy_note" in summary else "")
                     + ("" if summary.get("client_state", "device") == "device"
                        else f", clients' state on the {summary['client_state']}")),
        ("convolutions", f"{summary['conv_impl']}, training in {summary['compute_dtype']}"),
        ("rounds", str(summary["rounds"])
         + (f" (early stopping saved {summary['rounds_saved']})" if "rounds_saved" in summary else "")),
        ("final test accuracy", f"{summary['final_test_accuracy']:.4f}"),
        ("best test accuracy", f"{summary['best_test_accuracy']:.4f}"),
        ("final test loss", f"{summary['final_test_loss']:.4f}"),
        *([("final perplexity", f"{summary['final_perplexity']:.3f}")] if "final_perplexity" in summary else []),
        *([("exits, shallow → deep",
            " / ".join(f"{v:.4f}" for k, v in summary.items() if k.startswith("final_test_accuracy_exit"))
            + f"; ensemble {summary['final_test_accuracy_ensemble']:.4f}")]
          if "final_test_accuracy_ensemble" in summary else []),
        *held_out_rows(summary, personal),
        *([("differential privacy", f"ε = {summary['final_dp_epsilon']:.3g} at δ = {summary['dp_delta']:.3g} "
                                    f"for the whole run (clip {config.dp_clip:g}, "
                                    f"noise multiplier {config.dp_noise_multiplier:g})")]
          if "final_dp_epsilon" in summary else []),
        ("upload / download", f"{mb(summary['total_upload_bytes'])} / {mb(summary['total_download_bytes'])}"),
        ("simulated device time", (f"{duration(summary['total_simulated_time_s'])} "
                                   f"({summary['total_client_flops'] / 1e9:,.2f} GFLOPs of local work)")),
        *([("stragglers and availability", f"{summary['total_clients_dropped']:,} sampled clients did not report, "
                                           f"wasting {summary['total_wasted_flops'] / 1e9:,.2f} GFLOPs and "
                                           f"{mb(summary['total_wasted_bytes'])}; clock "
                                           f"{duration(summary['simulated_clock_s'])}")]
          if config.deadlines or config.availability != "always" else []),
        *([(f"time to {config.target_accuracy:g} test accuracy",
            f"{duration(summary['time_to_target_s'])} (round {summary['round_to_target']})"
            if summary["time_to_target_s"] is not None else f"not reached in {summary['rounds']} rounds")]
          if config.target_accuracy is not None else []),
        ("time (rounds/s)", f"{summary['wall_time_s']:.1f} s ({summary['rounds_per_s']:.2f} rounds/s; first round "
                            f"{summary['first_round_time_s']:.2f} s, of which compiling ≈ "
                            f"{summary['compile_time_s']:.2f} s)"),
        ("results", str(summary["run_dir"])),
    ]
