"""The run loop every run goes through: synchronous, asynchronous (``--mode async``) and replica runs
(``--seeds``, ``--lrs``, ``--server-lrs``).

A run is its writers (one :class:`~fedpartial._src.experiment.run_directory.RunWriter` per run folder: one, or
one per replica) and its steps: an iterator that yields, per round or server step, one entry per writer: the
round's record, the error that ended that run (its run goes no further, the others go on), or None once that
run has stopped (early stopping).  :func:`drive` installs the stop flag (SIGINT/SIGTERM stop the run after the
current step: :mod:`~fedpartial._src.experiment.signals`), writes each record (metrics, checkpoints), calls the
caller's progress callback, closes the writers and writes each folder's summary and status.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable

from fedpartial._src.core.errors import UserError
from fedpartial._src.experiment import run_files, signals


def check_checkpoint_every(checkpoint_every) -> None:
    """Refuses a checkpoint interval that is not a whole number of rounds ≥ 1 (None: only at the end)."""
    if checkpoint_every is not None and (isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int)
                                         or checkpoint_every < 1):
        raise UserError(f"--checkpoint-every {checkpoint_every!r} is not allowed: it must be a whole number of "
                        "rounds ≥ 1.")


def drive(writers: list, steps: Iterable[list], *, stop: signals.StopFlag | None = None,
          on_step: Callable[[list], None] | None = None, started: float | None = None,
          each_alone: bool = False) -> tuple[list, signals.StopFlag]:
    """Runs ``steps`` to their end (or a stop signal), writing each entry's record with its writer.

    ``stop``: the caller's flag (None: one is installed here for the run).  ``on_step``: called with each
    step's entries after they are written.  ``started``: when the run began (its wall time; default now).
    ``each_alone``: every writer finishes on its own (an error in one folder's summary is its result, a dict
    with ``error``, and the others still finish); otherwise the one writer's finish raises as it does.

    Returns each writer's result (:meth:`RunWriter.finish`'s summary) and the flag (``signum`` says whether a
    signal stopped the run).
    """
    started = time.perf_counter() if started is None else started
    errors: list[BaseException | None] = [None] * len(writers)
    ended = [False] * len(writers)  # stopped (early stopping) or failed: an error of the loop is not theirs
    with contextlib.nullcontext(stop) if stop is not None else signals.StopFlag() as flag:
        flag.on_force.extend(w.forced for w in writers)  # a second signal: each folder's status says so
        try:
            steps = iter(steps)
            while not flag.stopped:  # (a signal while the run was built stops it before its first step)
                entries = next(steps, None)
                if entries is None:
                    break
                for i, entry in enumerate(entries):
                    if isinstance(entry, BaseException):
                        errors[i], ended[i] = entry, True
                    elif entry is None:
                        ended[i] = True
                    else:
                        writers[i].write(entry)
                if on_step:
                    on_step(entries)
                if all(ended):
                    break
        except BaseException as e:  # written down as each running folder's status, then raised by its finish
            errors = [e if err is None and not done else err for err, done in zip(errors, ended)]
        finally:
            for w in writers:
                flag.on_force.remove(w.forced)
                w.close()
        wall = time.perf_counter() - started
        if not each_alone:
            return [w.finish(err, flag.signum, wall) for w, err in zip(writers, errors)], flag
        results = []
        for w, err in zip(writers, errors):
            try:
                results.append(w.finish(err, flag.signum, wall))
            except BaseException as e:  # written down in its folder; reported in its result
                results.append({"status": run_files.read_status(w.run_dir)["status"] if w.run_dir else "failed",
                                "run_dir": w.run_dir, "records": w.records, "error": e})
        return results, flag
