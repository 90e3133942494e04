"""A run directory, written round by round: what :func:`~fedpartial._src.experiment.simulation.run` writes for
one :class:`~fedpartial._src.experiment.simulation.Simulation` (many-seed runs keep one writer per seed).

``config.json``, ``config.toml`` and ``environment.json`` when it starts; ``metrics.jsonl``, ``metrics.csv``,
``decisions/`` and checkpoints each round; ``summary.json`` and ``status.json`` at the end.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import signal
import sys

import jax


from fedpartial._src.core.errors import UserError
from fedpartial._src.experiment import checkpoint, disk, pretrained, run_files, signals
from fedpartial._src.experiment.run_summary import RunSimulation, execution_facts, save_decisions, summarize
from fedpartial._src.experiment.config import RunConfig
from fedpartial._src.experiment.summaries import metric_records



def unique_run_dir(out_dir: str, name: str) -> str:
    """A fresh directory under ``out_dir``; an existing run is never overwritten."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    suffix = 1
    while os.path.exists(path):
        path = os.path.join(out_dir, f"{name}-{suffix}")
        suffix += 1
    os.makedirs(path)
    return path



#: the settings a checkpoint's state depends on: config.json edited in any of them since is refused on resume
IDENTITY = ("method", "options", "early_stopping", "upload_codec", "model", "dataset", "num_clients", "cohort_size",
            "seed")


def _identity(sim: RunSimulation) -> dict:
    from fedpartial._src.experiment import records as run_record

    full = dataclasses.asdict(run_record.resolved(sim.config, sim))
    return json.loads(run_files.strict_json({field: full[field] for field in IDENTITY}))


def _status_or_none(run_dir: str) -> dict | None:
    try:
        status = run_files.read_status(run_dir)
    except (OSError, ValueError):
        return None
    return status if isinstance(status, dict) else None


class RunWriter:
    """A run directory written round by round: what :func:`~fedpartial._src.experiment.simulation.run` writes,
    for one :class:`~fedpartial._src.experiment.simulation.Simulation`.

    Made with the simulation (a fresh directory under ``config.out_dir`` named ``config.run_name`` or
    ``METHOD-DATASET-seedSEED``, or the ``resume`` directory); :meth:`write` takes each round's record,
    :meth:`close` closes the files, :meth:`finish` writes the summary and status.  With no ``out_dir``
    nothing is written and only the records are kept.  :mod:`fedpartial._src.experiment.replicas` keeps one per seed.
    """

    def __init__(self, sim: RunSimulation, *, checkpoint_every: int | None = None, resume: str | None = None):
        config = sim.config
        self.sim, self.checkpoint_every = sim, checkpoint_every
        self.run_dir = None
        self.records: list[dict] = []
        if resume is not None:
            self._lock(resume)  # before anything of it is read: a second process may be writing it
            self.run_dir = resume
            try:
                host = checkpoint.restore(resume, sim, identity=_identity(sim))
                self.extended_from = _extend(resume, config.rounds)
            except BaseException as error:
                previous = _status_or_none(resume) if isinstance(error, checkpoint.CheckpointsDamaged) else None
                if previous is not None:
                    # Say so where the run's state is read, not only on the terminal; nothing else is touched.
                    run_files.write_status(resume, "failed", round=previous.get("round") or 0,
                                            message=str(error), checkpoint_round=previous.get("checkpoint_round"))
                run_files.unlock_run_dir(resume)
                raise
            for step, why, aside in host.get("damaged", ()):
                print(f"note: the checkpoint of round {step} in {resume} does not read back ({why}); it is kept as "
                      f"checkpoints/{aside} and the run resumes from round {sim.progress['round']}.",
                      file=sys.stderr, flush=True)
            if checkpoint_every is None:
                self.checkpoint_every = host.get("checkpoint_every")
            self.records = _truncate_metrics(os.path.join(resume, "metrics.jsonl"), sim.progress["round"])
        elif config.out_dir:
            from fedpartial._src.experiment import records as run_record

            name = config.run_name or f"{config.method_name}-{config.dataset}-seed{config.seed}"
            self.run_dir = unique_run_dir(config.out_dir, name)
            self._lock(self.run_dir)
            # Every value resolved (method options, local epochs, model, train fraction), so the run can be
            # repeated from config.json or config.toml alone; environment.json says what it ran on.
            full = run_record.resolved(config, sim)
            try:
                run_files.write_json(os.path.join(self.run_dir, "config.json"), dataclasses.asdict(full))
                with open(os.path.join(self.run_dir, "config.toml"), "w") as f:
                    f.write(run_record.to_toml(full))
                run_files.write_json(os.path.join(self.run_dir, "environment.json"),
                                      {**run_record.environment(config), **execution_facts(sim)})
            except OSError as error:
                reason = disk.out_of_space(error)
                if reason is None:
                    raise
                run_files.unlock_run_dir(self.run_dir)
                shutil.rmtree(self.run_dir, ignore_errors=True)  # made just now, by this run: nothing is lost
                free = disk.free_bytes(config.out_dir)
                raise disk.OutOfSpace(
                    f"cannot start the run folder {self.run_dir}: {reason}"
                    + (f" ({disk.human_bytes(free)} are free there)" if free is not None else "")
                    + "; make room or choose another --out.") from None
        elif checkpoint_every is not None:
            raise UserError("checkpoints need a run directory; give an output directory (out_dir) or no interval.")
        if resume is None:
            self.extended_from = None
        self.resumed_from = sim.progress["round"] if resume is not None else None
        self.saved = checkpoint.latest_round(self.run_dir) if self.run_dir else None
        self.extra = {"checkpoint_every": self.checkpoint_every, "written_by": _identity(sim)}
        self.status("running", "" if resume is None else f"resumed from round {self.resumed_from}" + (
            f", extended from {self.extended_from} to {config.rounds} rounds" if self.extended_from else ""))
        self.log = self.table = None
        if self.run_dir:  # scalar fields only, written each round (see fedpartial._src.experiment.records.MetricsCSV)
            from fedpartial._src.experiment.records import MetricsCSV

            self.log = open(os.path.join(self.run_dir, "metrics.jsonl"), "a" if resume is not None else "w")
            self.table = MetricsCSV(os.path.join(self.run_dir, "metrics.csv"), self.records)

    @staticmethod
    def _lock(run_dir: str) -> None:
        note = run_files.lock_run_dir(run_dir)
        if note:  # a lock a killed run left behind: taken over, and said
            print(f"note: {note}.", file=sys.stderr, flush=True)

    def status(self, state: str, message: str = "") -> None:
        if self.run_dir:
            run_files.write_status(self.run_dir, state, round=self.sim.progress["round"], message=message,
                                    checkpoint_round=self.saved)

    def write(self, record: dict) -> None:
        """Keeps one round's record and writes it (metrics, decisions, a checkpoint when due, status)."""
        self.records.append(record)
        if not self.run_dir:
            return
        try:
            self.log.write(run_files.strict_json(record) + "\n")
            self.log.flush()
            self.table.write(record)
            if self.sim.last_decisions is not None:
                save_decisions(os.path.join(self.run_dir, "decisions", f"round-{record['round']:05d}.npz"),
                               self.sim.last_decisions)
        except OSError as error:
            self._no_room(error, f"the results of round {record['round']}")
        if self.checkpoint_every and record["round"] % self.checkpoint_every == 0:
            self.saved = checkpoint.save(self.run_dir, self.sim, extra=self.extra)
        try:
            self.status("running")
        except OSError as error:
            self._no_room(error, "status.json")

    def forced(self) -> None:
        """A second signal ends the process mid-round: the status says so (called from a timer thread)."""
        kept = (f"the checkpoint of round {self.saved} is kept" if self.saved is not None
                else "no checkpoint was written")
        self.status("interrupted", f"exited at once by a second signal during round {self.sim.progress['round'] + 1}"
                                   f"; {kept}" + (f"; continue with: fedpartial run --resume {self.run_dir}"
                                                  if self.saved is not None else ""))
        if self.run_dir:
            run_files.unlock_run_dir(self.run_dir)

    def _no_room(self, error: OSError, what: str) -> None:
        """Raises ``error`` again, as one sentence when it is a full disk."""
        reason = disk.out_of_space(error)
        if reason is None:
            raise error
        kept = (f"the checkpoint of round {self.saved} is kept; make room and continue with: fedpartial run "
                f"--resume {self.run_dir}" if self.saved is not None else "no checkpoint was written")
        raise disk.OutOfSpace(f"cannot write {what} in {self.run_dir}: {reason}; {kept}.") from None

    def close(self) -> None:
        if self.log:
            self.log.close()
            self.table.close()
            self.log = None

    def finish(self, error: BaseException | None, signum: int | None, wall: float) -> dict:
        """Writes the final checkpoint, ``summary.json`` and ``status.json``; raises ``error`` again, or
        :class:`~fedpartial._src.experiment.signals.RunInterrupted` when signal ``signum`` stopped the run early;
        returns the summary with ``run_dir`` and ``records``."""
        sim, run_dir, config = self.sim, self.run_dir, self.sim.config
        done = sim.progress["round"]
        where = f"after round {done} of {config.rounds}"
        if error is None and run_dir:
            try:
                self.saved = checkpoint.save(run_dir, sim, extra=self.extra)
                pretrained.write_final_params(run_dir, jax.device_get(sim.state.variables))  # for --init-from
            except disk.OutOfSpace as no_room:
                error = no_room
        if error is None and signum is not None and done < config.rounds:
            name = signal.Signals(signum).name
            message = (f"stopped by {name} {where}; the checkpoint of round {self.saved}, metrics and summary are "
                       f"kept in {run_dir}; continue with: fedpartial run --resume {run_dir}" if run_dir else
                       f"stopped by {name} {where}; nothing was written (no output directory)")
            state = "interrupted"
        elif error is None:
            state, message = "complete", f"{done} rounds"
        else:
            kept = (f"the checkpoint of round {self.saved} is kept" if self.saved is not None
                    else "no checkpoint was written")
            if run_files.is_diverged(error):
                state, message = "diverged", f"{str(error).strip().rstrip('.')}; {kept}."
            elif isinstance(error, KeyboardInterrupt):
                state, message = "interrupted", f"interrupted during round {done + 1}; {kept}"
            elif isinstance(error, disk.OutOfSpace):
                state, message = "failed", str(error)
            else:
                state, message = "failed", f"{type(error).__name__}: {str(error).strip().rstrip('.')}; {kept}."
        try:
            summary = summarize(config, sim, self.records, wall, status=state, resumed_from=self.resumed_from)
        except Exception:  # a failed run's summary must never hide its error
            if error is None:
                raise
            summary = {"status": state, "rounds": len(self.records)}
        if run_dir:
            try:
                run_files.write_json(os.path.join(run_dir, "summary.json"), summary)
                self.status(state, message)
            except OSError as failure:  # written where they can be: a full disk must not hide the run's error
                reason = disk.out_of_space(failure)
                if reason is None:
                    raise
                if error is None:
                    error = disk.OutOfSpace(f"cannot write the summary of {run_dir}: {reason}.")
            finally:
                run_files.unlock_run_dir(run_dir)
        if error is not None:
            raise error
        result = {**summary, "run_dir": run_dir, "records": self.records}
        if state == "interrupted":
            raise signals.RunInterrupted(signum, message, result)
        return result



def load_config(run_dir: str) -> RunConfig:
    """The :class:`RunConfig` a run directory was started with (its ``config.json``)."""
    path = os.path.join(run_dir, "config.json")
    try:
        with open(path) as f:
            fields = json.load(f)
    except (OSError, ValueError):
        raise UserError(f"{run_dir!r} is not a run directory to resume (its config.json cannot be read).") from None
    known = {f.name for f in dataclasses.fields(RunConfig)}
    return RunConfig(**{k: v for k, v in fields.items() if k in known})


def refuse_shortening(run_dir: str, rounds: int, planned: int) -> None:
    """``--rounds`` given with ``--resume`` extends a run: fewer than the ``planned`` rounds is refused, since the
    run's results would not say so."""
    if rounds < planned:
        raise UserError(f"--rounds {rounds} cannot shorten {run_dir}, which plans {planned} rounds; give more "
                        f"rounds to extend it, or none to resume it as planned.")


def _extend(run_dir: str, rounds: int) -> int | None:
    """A resumed run given more rounds than it planned (``fedpartial run --resume RUN --rounds N``): its
    ``config.json`` and ``config.toml`` say the new count; returns the planned count it was extended from
    (None: the same count).  Fewer rounds than planned is refused: the run's results would not say so."""
    from fedpartial._src.experiment import records as run_record

    planned = load_config(run_dir)
    if rounds == planned.rounds:
        return None
    refuse_shortening(run_dir, rounds, planned.rounds)
    extended = dataclasses.replace(planned, rounds=rounds)
    run_files.write_json(os.path.join(run_dir, "config.json"), dataclasses.asdict(extended))
    with open(os.path.join(run_dir, "config.toml"), "w") as f:
        f.write(run_record.to_toml(extended))
    return planned.rounds


def _truncate_metrics(path: str, upto: int) -> list[dict]:
    """Rounds ``1..upto`` of ``metrics.jsonl`` (each once; a torn last line is dropped); rewrites the file
    with just those, atomically, and returns them (JSON ``null`` read back as NaN, as it was written)."""
    kept: dict[int, dict] = {}
    if os.path.exists(path):
        with open(path) as f:
            for record in metric_records(f):
                if 1 <= record["round"] <= upto:
                    kept.setdefault(record["round"], record)
    records = [kept[r] for r in sorted(kept)]
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        for record in records:
            f.write(run_files.strict_json(record) + "\n")
    os.replace(tmp, path)
    return [{k: math.nan if v is None else v for k, v in r.items()} for r in records]
