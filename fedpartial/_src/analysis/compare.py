"""Several methods on the same partitions and seeds: ``fedpartial compare`` (issue 13).

Every (method, seed) pair is a normal run directory ``<out>/<method>-seed<seed>`` made by
:func:`fedpartial._src.experiment.simulation.run` from one base :class:`~fedpartial._src.experiment.config.RunConfig` in
which only ``method``, ``options``, ``seed``, ``out_dir`` and ``run_name`` change.  The
partition, the cohort sequence and the device draw depend only on the seed and the shared
settings, so the runs of one seed see the same clients in the same rounds.

Decisions where the issue leaves room:

* **Method options** are ``--option METHOD:NAME=VALUE`` pairs (``NAME`` as in
  ``fedpartial list methods``' options, ``-`` or ``_`` alike); a method without pairs keeps
  its registry defaults.  Each value is parsed and checked as ``fedpartial run``'s flag is.
* **Everything is validated before any run**: the method and seed lists, every pair, every
  (method, seed) configuration (``RunConfig.validate(check_model=True)``) and that ``--out``
  is a new or empty directory, so results already written are never touched.
* **Mean ± std** over seeds uses the population standard deviation (``ddof=0``, numpy's
  default): one seed gives ± 0, not an undefined value.  Values come from each run's
  ``summary.json``; "rounds" is the rounds run (fewer than planned under ``--es``).
* **Curves over seeds** are taken at the evaluated rounds that every seed of a method has
  (all of them unless early stopping ended one sooner); at each such round the x value
  (cumulative upload bytes or simulated time) is the seeds' mean and the band is the
  accuracy's mean ± std.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from collections.abc import Callable, Sequence


from fedpartial._src.core.errors import UserError
from fedpartial._src.experiment import jobs, run_files
from fedpartial._src.methods.catalog import find_method
from fedpartial._src.experiment.config import RunConfig
from fedpartial._src.experiment.setting_checks import MAX_SEED
from fedpartial._src.experiment.preflight import preflight
from fedpartial._src.experiment.summaries import load_run, method_curves, parse_distinct, table, write_table


def parse_methods(text: str) -> list[str]:
    """``"fedavg,fedldf"`` → ``["fedavg", "fedldf"]``: known, distinct, at least one."""
    names = [name.strip() for name in str(text).split(",")]
    if not any(names) or any(not name for name in names):
        raise UserError(f"--methods {text!r} is not allowed: it must be method names separated by commas, "
                        f"e.g. fedavg,fedldf.")
    for name in names:
        try:
            find_method(name)
        except UserError as e:
            raise UserError(f"--methods names {name!r}, which is unknown; {str(e).split('; ', 1)[-1]}") from None
    if len(set(names)) < len(names):
        raise UserError(f"--methods {text!r} names a method twice; name each method once.")
    return names


def _seed(part: str) -> int | None:
    try:
        seed = int(part)
    except ValueError:
        return None
    return seed if 0 <= seed <= MAX_SEED else None


def parse_seeds(text: str) -> list[int]:
    """``"0,1,2"`` → ``[0, 1, 2]``: distinct whole numbers from 0 to 2³² − 1, at least one."""
    return parse_distinct(text, "--seeds", _seed,
                          f"whole numbers from 0 to {MAX_SEED} separated by commas, e.g. 0,1,2", "a seed")


def parse_options(pairs: Sequence[str], methods: Sequence[str]) -> dict[str, dict]:
    """``["fedldf:n=2"]`` → ``{"fedavg": {}, "fedldf": {"n": 2}}``: each method's options by name."""
    options: dict[str, dict] = {name: {} for name in methods}
    for pair in pairs:
        # METHOD is everything before the last ':' ahead of the '=', so it may itself be package.module:factory
        head, eq, text = pair.partition("=")
        method, sep, name = head.rpartition(":")
        method, name = method.strip(), name.strip().replace("-", "_")
        if not sep or not eq or not method or not name:
            raise UserError(f"--option {pair!r} is not allowed: it must be METHOD:NAME=VALUE, e.g. fedldf:n=2.")
        if method not in options:
            raise UserError(f"--option {pair!r} is for method {method!r}, which is not in --methods "
                            f"({', '.join(methods)}).")
        opt = find_method(method).option(name)  # an unknown name: one sentence listing the method's options
        try:
            options[method][name] = opt.type(text.strip())
        except (ValueError, UserError):
            raise UserError(f"--option {pair!r} is not allowed: {name} of {method} must be as its help says "
                            f"({opt.help}).") from None
    return options


def default_out_dir(root: str = "runs") -> str:
    """``runs/compare-YYYYmmdd-HHMMSS`` (the caller makes it unique)."""
    return os.path.join(root, "compare-" + datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))


def fresh_out_dir(out_dir: str | None) -> str:
    """The compare directory: the given one when new or empty, else a new timestamped one (the runs create it)."""
    if out_dir is None:
        base = out_dir = default_out_dir()
        suffix = 1
        while os.path.exists(out_dir):
            out_dir, suffix = f"{base}-{suffix}", suffix + 1
    elif os.path.isfile(out_dir) or (os.path.isdir(out_dir) and os.listdir(out_dir)):
        raise UserError(f"--out {out_dir!r} already holds files; choose a new or empty directory "
                        f"(results already written are never touched).")
    return out_dir


def plan(base: RunConfig, methods: Sequence[str], seeds: Sequence[int], options: dict[str, dict],
         out_dir: str) -> list[RunConfig]:
    """One validated configuration per (method, seed), methods outer; raises before anything is run."""
    configs = [dataclasses.replace(base, method=m, options=dict(options.get(m, {})), seed=s, out_dir=out_dir)
               for m in methods for s in seeds]
    # each run's folder by the method's own name (an import string's colon has no place in a folder name)
    configs = [dataclasses.replace(c, run_name=f"{c.method_name}-seed{c.seed}") for c in configs]
    for config in configs:
        config.validate(check_model=True)
    for config in configs[:1]:  # every run shares the population, devices and --out
        preflight(config)
    return configs


def run_all(configs: Sequence[RunConfig], *, on_run: Callable[[int, RunConfig, dict], None] | None = None,
            **run_kwargs) -> list[str]:
    """Runs the configurations one after another; returns their run directories."""
    from fedpartial._src.experiment import simulation  # JAX set-up only when something runs

    dirs = []
    for i, config in enumerate(configs):
        result = simulation.run(config, **run_kwargs)
        dirs.append(result["run_dir"])
        if on_run:
            on_run(i, config, result)
    return dirs


def compare(base: RunConfig, methods: Sequence[str], seeds: Sequence[int], options: dict[str, dict],
            out_dir: str, *, on_run: Callable[[int, RunConfig, dict], None] | None = None,
            configs: Sequence[RunConfig] | None = None) -> dict:
    """Validates every run, runs them, then writes the table and figures to ``out_dir``.

    ``configs``: :func:`plan`'s configurations of these arguments when the caller has them already (each is
    then not checked again); None: planned here.  Returns ``{"out_dir", "run_dirs", "rows", "table_files",
    "figures"}``.
    """
    if configs is None:
        configs = plan(base, methods, seeds, options, out_dir)
    os.makedirs(out_dir, exist_ok=True)  # what the job runs, so that an interrupted one can be continued
    jobs.write_job(out_dir, "compare", methods=list(methods), seeds=list(seeds),
                   options={m: dict(options.get(m, {})) for m in methods}, base=dataclasses.asdict(base))
    run_dirs = run_all(configs, on_run=on_run)
    return {"out_dir": out_dir, "run_dirs": run_dirs, **_tables(run_dirs, out_dir)}


def _tables(run_dirs: Sequence[str], out_dir: str) -> dict:
    """The comparison table and figures of ``run_dirs``, written to ``out_dir``."""
    from fedpartial._src.analysis import plots as plotting

    runs = [load_run(d) for d in run_dirs]
    rows = table(runs)
    files = write_table(rows, out_dir)
    return {"rows": rows, "table_files": files, "figures": plotting.draw(method_curves(runs), out_dir)}


def resume(out_dir: str, *, stop=None, on_run: Callable[[int, int, dict], None] | None = None) -> dict:
    """Continues the comparison in ``out_dir`` (``fedpartial compare --resume``): its complete runs are kept,
    the ones a stop interrupted are resumed from their checkpoints, the ones it never started are run
    (:func:`fedpartial._src.experiment.jobs.continue_runs`), then the table and figures are written again
    from every finished run.  Returns :func:`compare`'s dict with ``results`` (each run's status); a stop
    signal ends it after the current run and raises ``RunInterrupted`` once the table is written."""
    job = jobs.job_of(out_dir, "compare")
    known = {f.name for f in dataclasses.fields(RunConfig)}
    base = dataclasses.replace(RunConfig(**{k: v for k, v in job["base"].items() if k in known}), out_dir=out_dir)
    configs = plan(base, job["methods"], job["seeds"], job["options"], out_dir)
    results, stopped = jobs.continue_runs([(os.path.join(out_dir, c.run_name), c) for c in configs],
                                          stop=stop, on_run=on_run)
    finished = [r["run_dir"] for r in results if os.path.exists(os.path.join(r["run_dir"], "summary.json"))
                and (run_files.read_status(r["run_dir"]) or {}).get("status") == "complete"]
    out = {"out_dir": out_dir, "run_dirs": finished, "results": results, **_tables(finished, out_dir)}
    if stopped:
        raise jobs.interrupted(stop, out_dir, out)
    return out
