"""Jobs of several run folders — ``fedpartial run --seeds``/``--lrs`` replicas and ``fedpartial compare`` —
continued after an interruption, and their tables written again.

A job writes ``job.json`` in its folder when it starts (what it runs: the seeds and rates, or the methods,
seeds, options and shared configuration).  :func:`resume_job` then resumes each run folder that did not
complete from its newest checkpoint, one after another, exactly as ``fedpartial run --resume`` does (a
replica's folder equals its separate run, so a resumed replica continues that run), runs the ones the job
never started (``compare`` starts its runs one by one), and writes the job's table again from every folder.
Folders already complete are not touched.  A folder that cannot be resumed (no checkpoint, damaged) is
reported and the others go on; the table then says which runs it lacks.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence

from fedpartial._src.core.errors import UserError
from fedpartial._src.experiment import run_files, signals, summaries
from fedpartial._src.experiment.config import RunConfig
from fedpartial._src.experiment.config_checks import with_validation

#: the job's description, written in its folder when it starts
JOB_FILE = "job.json"

#: the columns of ``seeds_summary.md``: fedpartial compare's, and the rounds per second
COLUMNS = summaries.COLUMNS + (("rounds_per_s", "rounds/s"),)


def write_job(folder: str, kind: str, **fields) -> None:
    """Writes ``folder/job.json``: ``kind`` (``"replicas"`` or ``"compare"``) and what the job runs."""
    run_files.write_json(os.path.join(folder, JOB_FILE), {"kind": kind, **fields})


def read_job_file(folder: str, name: str) -> dict | None:
    """``folder/name`` as a JSON object (None: missing or not one)."""
    try:
        with open(os.path.join(folder, name)) as f:
            value = json.load(f)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def read_job(folder: str) -> dict | None:
    """``folder``'s job (None: not a job folder).  A replicas folder from before ``job.json`` existed is
    read from its ``seeds_summary.json``."""
    job = read_job_file(folder, JOB_FILE)
    if job is not None:
        return job
    summary = read_job_file(folder, "seeds_summary.json")
    if summary is None:
        return None
    return {"kind": "replicas", "seeds": summary.get("seeds", []), "lrs": summary.get("lrs"),
            "server_lrs": summary.get("server_lrs"), "run_dirs": summary.get("run_dirs", []),
            "replica_axis": summary.get("replica_axis", "vmap")}


def is_job_folder(path: str) -> bool:
    """A folder of several runs (it has a job, and no run of its own)."""
    return os.path.isdir(path) and not os.path.exists(os.path.join(path, "config.json")) and read_job(path) is not None


def _continue(run_dir: str, config: RunConfig | None, stop) -> dict:
    """Resumes ``run_dir`` (or, when it does not exist, runs ``config`` there); its result, or its status."""
    from fedpartial._src.experiment import run_directory, runs

    status = run_files.read_status(run_dir) if os.path.isdir(run_dir) else None
    if status is not None and status.get("status") == "complete":
        return {"run_dir": run_dir, "status": "complete", "resumed": False}
    try:
        if os.path.isdir(run_dir):
            saved = run_directory.load_config(run_dir)
            if config is not None and saved == config:  # the planned run, judged when it was planned
                saved = with_validation(saved, config)
            result = runs.run(saved, resume=run_dir, stop=stop)
        else:
            result = runs.run(config, stop=stop)
    except signals.RunInterrupted:
        raise
    except Exception as error:  # this run ends; the job goes on with the others
        message = str(error).strip() if isinstance(error, UserError) else f"{type(error).__name__}: {error}"
        status = run_files.read_status(run_dir) if os.path.isdir(run_dir) else None
        return {"run_dir": run_dir, "status": status["status"] if status else "failed", "error": message,
                "resumed": True}
    return {**result, "run_dir": result["run_dir"], "status": "complete", "resumed": True}


def continue_runs(plan: list[tuple[str, RunConfig | None]], *, stop: signals.StopFlag | None = None,
                  on_run: Callable[[int, int, dict], None] | None = None) -> tuple[list[dict], bool]:
    """Each ``(run_dir, config)`` of ``plan`` continued in turn (:func:`_continue`); returns the results and
    whether a stop signal ended it early (the current run's folder is then resumable again)."""
    results = []
    for i, (run_dir, config) in enumerate(plan):
        if stop is not None and stop.stopped:
            return results, True
        try:
            results.append(_continue(run_dir, config, stop))
        except signals.RunInterrupted:
            return results, True
        if on_run:
            on_run(i, len(plan), results[-1])
    return results, stop is not None and stop.stopped


def interrupted(stop: signals.StopFlag | None, folder: str, out: dict) -> signals.RunInterrupted:
    """What a job stopped by a signal raises, once its table is written."""
    return signals.RunInterrupted(stop.signum if stop is not None and stop.signum else 2,
                                     f"stopped; the runs are kept in {folder}; continue with the same command", out)


def job_of(folder: str, kind: str) -> dict:
    """``folder``'s job of ``kind``; anything else is one sentence."""
    job = read_job(folder)
    if job is None or os.path.exists(os.path.join(folder, "config.json")) or job.get("kind") != kind:
        what = "a --seeds/--lrs replicas folder" if kind == "replicas" else "a fedpartial compare folder"
        raise UserError(f"{folder!r} is not {what} to resume (its job.json is missing or names another kind of "
                        f"job); resume a single run folder with fedpartial run --resume RUN_DIR.")
    return job


def resume_replicas(folder: str, *, stop: signals.StopFlag | None = None,
                    on_run: Callable[[int, int, dict], None] | None = None) -> dict:
    """Continues the ``--seeds``/``--lrs`` replicas in ``folder`` (see the module's note) and writes
    ``seeds_summary.json``/``.md`` again.  ``on_run(i, total, result)`` after each replica folder
    (``result["status"]``, ``"resumed"``, ``"error"``).  Returns ``{"out_dir", "results", "summary"}``; a stop
    signal ends it after the current replica and raises
    :class:`~fedpartial._src.experiment.signals.RunInterrupted` once the summary is written."""
    job = job_of(folder, "replicas")
    t0 = time.perf_counter()
    plan = [(os.path.join(folder, d), None) for d in job["run_dirs"]]
    results, stopped = continue_runs(plan, stop=stop, on_run=on_run)
    out = {"out_dir": folder, "results": results,
           "summary": _replica_summary(folder, job, plan, results, time.perf_counter() - t0)}
    if stopped:
        raise interrupted(stop, folder, out)
    return out


def _replica_summary(folder: str, job: dict, plan: list, results: list[dict], wall: float) -> dict:
    statuses = [(run_files.read_status(d) or {}).get("status", "missing") for d, _ in plan]
    finished = [(d, s) for (d, _), s in zip(plan, statuses) if os.path.exists(os.path.join(d, "summary.json"))]
    resumed = sum(r.get("resumed", False) for r in results)
    note = f"{resumed} of {len(plan)} replica folders resumed one at a time" if resumed else None
    before = read_job_file(folder, "seeds_summary.json") or {}
    return write_summary(folder, job["seeds"], [d for d, _ in finished], before.get("wall_time_s", 0.0) + wall,
                                  [s for _, s in finished], replica_axis=job.get("replica_axis", "vmap"),
                                  lrs=job.get("lrs"), server_lrs=job.get("server_lrs"), note=note)


def _summary_rows(run_dirs: Sequence[str], lrs: Sequence[float] | None = None,
                  server_lrs: Sequence[float] | None = None) -> list[dict]:
    """``fedpartial compare``'s mean ± std row over the seeds' ``summary.json``, with rounds/s added; with
    learning rates one row per (server rate, client rate) (``client_lr`` / ``server_lr``, and the rates in
    ``method`` for the Markdown table)."""
    runs = [summaries.load_run(d) for d in run_dirs]
    if lrs is None and server_lrs is None:
        return summaries.table(runs, COLUMNS)
    rows = []
    for server_lr in server_lrs if server_lrs is not None else [None]:
        for lr in lrs if lrs is not None else [None]:
            [row] = summaries.table([r for r in runs if (lr is None or r["config"]["client_lr"] == lr) and (
                server_lr is None or r["config"]["server_lr"] == server_lr)], COLUMNS)
            label = ("" if lr is None else f" lr {lr!r}") + ("" if server_lr is None else f" server lr {server_lr!r}")
            rows.append({**row, "method": row["method"] + label,
                         **({} if lr is None else {"client_lr": lr}),
                         **({} if server_lr is None else {"server_lr": server_lr})})
    return rows


def write_summary(parent: str, seeds: Sequence[int], run_dirs: Sequence[str], wall: float,
                  statuses: Sequence[str], replica_axis: str = "vmap", lrs: Sequence[float] | None = None,
                  server_lrs: Sequence[float] | None = None, data_placement: str | None = None,
                  note: str | None = None) -> dict:
    """Writes ``seeds_summary.json`` and ``seeds_summary.md`` in ``parent``; returns the JSON's content.

    Seeds only: the one row's fields at the top level.  With learning rates: ``lrs`` and/or ``server_lrs``
    and ``rows``, one row per rate or pair of rates (mean ± std over the seeds).  ``data_placement`` (every
    replica's) and ``layout_note`` (:attr:`Replicas.note`) are written when given."""
    rows = _summary_rows(run_dirs, lrs, server_lrs)
    top = rows[0] if lrs is None and server_lrs is None else {
        **({} if lrs is None else {"lrs": list(lrs)}),
        **({} if server_lrs is None else {"server_lrs": list(server_lrs)}), "rows": rows}
    summary = {**top, "seeds": list(dict.fromkeys(seeds)),
               "run_dirs": [os.path.relpath(d, parent) for d in run_dirs],
               "statuses": list(statuses), "vmapped": replica_axis == "vmap", "replica_axis": replica_axis,
               "wall_time_s": wall, "std": "population (ddof=0)",
               **({} if data_placement is None else {"data_placement": data_placement}),
               **({} if note is None else {"layout_note": note})}
    run_files.write_json(os.path.join(parent, "seeds_summary.json"), summary)
    with open(os.path.join(parent, "seeds_summary.md"), "w") as f:
        f.write(summaries.table_markdown(rows, COLUMNS))
    return summary
