"""Where the test suite's time goes: per test, JAX's tracing, lowering and XLA compiling, and which programs
were lowered more than once (work a shared round or model could save).

Two parts:

* a pytest plugin, active only when ``FEDPARTIAL_SUITE_PROFILE`` names a folder: every test appends one JSON
  line to ``<folder>/<xdist worker>.jsonl`` with its wall and CPU seconds, its seconds of tracing, lowering,
  compiling and persistent-cache reads (``jax.monitoring``), and every program it asked XLA for (module name,
  the tail of the persistent-cache key, the trace and lowering seconds before it) ::

      FEDPARTIAL_SUITE_PROFILE=/tmp/prof python -m pytest -p benchmarks.suite_profile

* a summary of such a folder, printed and written as JSON (default
  ``benchmarks/results/suite-profile-<platform>-<N>cores.json``), with the machine's speed when summarised
  (:func:`machine_speed`: profiles taken at different speeds compare only after scaling by it) ::

      python -m benchmarks.suite_profile /tmp/prof [--out PATH] [--top 25]

"Repeated" programs are cache keys lowered in more than one place: the persistent cache (``tests/conftest.py``)
already compiles each program once per suite, but every repeat is traced and lowered again, and the summary
counts those seconds.  Use a cold compilation cache (a fresh clone or ``.pytest_cache`` removed) so that the
compile seconds are the suite's own.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import time
from pathlib import Path

import pytest

ENV = "FEDPARTIAL_SUITE_PROFILE"
#: ``jax.monitoring`` duration events, by the name the summary gives them
EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
          "/jax/core/compile/backend_compile_duration": "compile",
          "/jax/compilation_cache/cache_retrieval_time_sec": "cache_read"}
PHASES = tuple(EVENTS.values())


class Recorder:
    """Collects one test's events; installed into JAX by :meth:`install`, removed by :meth:`remove`."""

    def __init__(self, folder: Path):
        self.folder, self.out, self.events, self._originals = folder, None, [], None

    def on_duration(self, event: str, seconds: float, **_) -> None:
        if event in EVENTS:
            self.events.append([EVENTS[event], round(seconds, 5)])

    def install(self) -> None:
        from jax import monitoring
        from jax._src import compiler

        original = compiler._get_cache_key

        def cache_key(options, backend, computation, devices, *args, **kwargs):
            key = original(options, backend, computation, devices, *args, **kwargs)
            try:
                name = str(computation.operation.attributes["sym_name"]).strip('"')
            except (KeyError, AttributeError):
                name = "?"
            self.events.append(["program", name, key[-20:] if key else None])
            return key

        compiler._get_cache_key = cache_key
        monitoring.register_event_duration_secs_listener(self.on_duration)
        self._originals = (compiler, original)

    def remove(self) -> None:
        from jax import monitoring

        compiler, original = self._originals
        compiler._get_cache_key = original
        monitoring.unregister_event_duration_listener(self.on_duration)

    def write(self, record: dict) -> None:
        if self.out is None:
            self.folder.mkdir(parents=True, exist_ok=True)
            self.out = open(self.folder / f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.jsonl", "a")
        self.out.write(json.dumps(record) + "\n")
        self.out.flush()


_recorder: Recorder | None = None


def pytest_configure(config) -> None:
    global _recorder
    if os.environ.get(ENV) and _recorder is None:
        _recorder = Recorder(Path(os.environ[ENV]))
        _recorder.install()


def pytest_unconfigure(config) -> None:
    global _recorder
    if _recorder is not None:
        _recorder.remove()
        if _recorder.out is not None:
            _recorder.out.close()
        _recorder = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Runs where the test runs (an xdist worker, or the one process): setup, call and teardown together."""
    if _recorder is None:
        yield
        return
    _recorder.events = []
    wall, cpu = time.perf_counter(), time.process_time()
    yield
    _recorder.write({"test": item.nodeid, "wall": round(time.perf_counter() - wall, 4),
                     "cpu": round(time.process_time() - cpu, 4), "events": _recorder.events})
    _recorder.events = []


# ---- the summary ----------------------------------------------------------------------------------------------

def read(folder: Path) -> list[dict]:
    """Every test's record in ``folder``'s ``*.jsonl`` files."""
    records = []
    for path in sorted(folder.glob("*.jsonl")):
        records += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not records:
        raise SystemExit(f"{folder} holds no test records (*.jsonl): run pytest with {ENV}={folder} "
                         "-p benchmarks.suite_profile first.")
    return records


def summarize(records: list[dict], top: int = 25) -> dict:
    """Totals, per file, per program name, and the programs lowered more than once.

    A program's trace and lowering seconds are those recorded after the previous program of the same test
    (JAX traces and lowers a jitted function, then asks for its executable); its compile and cache-read
    seconds are those recorded after it."""
    totals = collections.Counter()
    files: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    names: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    keys: dict[tuple, dict] = {}
    for record in records:
        file = record["test"].split("::")[0]
        files[file]["tests"] += 1
        for field in ("wall", "cpu"):
            totals[field] += record.get(field, 0.0)
            files[file][field] += record.get(field, 0.0)
        before, current = 0.0, None
        for event in record["events"]:
            if event[0] == "program":
                name, key = event[1], event[2]
                entry = keys.setdefault((name, key), {"name": name, "lowered": 0, "seconds": [], "files": set()})
                entry["lowered"] += 1
                entry["seconds"].append(before)
                entry["files"].add(file)
                names[name]["requests"] += 1
                before, current = 0.0, name
                continue
            phase, seconds = event
            totals[phase] += seconds
            files[file][phase] += seconds
            if phase in ("trace", "lower"):
                before += seconds
            elif current is not None:
                names[current][phase] += seconds
                names[current]["compiles" if phase == "compile" else "cache_reads"] += 1
    repeated = [e for e in keys.values() if e["lowered"] > 1]
    # the first lowering is needed; every later one is work a shared function would not do
    for entry in repeated:
        entry["repeat_seconds"] = sum(entry["seconds"][1:])
    repeated.sort(key=lambda e: -e["repeat_seconds"])

    def rounded(counter):
        return {k: (round(v, 2) if isinstance(v, float) else v) for k, v in counter.items()}

    return {
        "tests": len(records),
        "seconds": rounded(totals),
        "programs": {"distinct": len(keys), "requests": sum(e["lowered"] for e in keys.values()),
                     "lowered_more_than_once": len(repeated),
                     "repeat_trace_and_lower_seconds": round(sum(e["repeat_seconds"] for e in repeated), 2)},
        "files": {f: rounded(c) for f, c in sorted(files.items(), key=lambda kv: -kv[1]["wall"])},
        "by_program_name": {n: rounded(c) for n, c in
                            sorted(names.items(), key=lambda kv: -kv[1]["compile"])[:top]},
        "most_repeated": [{"name": e["name"], "lowered": e["lowered"], "repeat_seconds": round(e["repeat_seconds"], 3),
                           "files": sorted(e["files"])} for e in repeated[:top]],
    }


def print_summary(summary: dict, top: int) -> None:
    s = summary["seconds"]
    print(f"{summary['tests']} tests: {s.get('wall', 0):.0f} s of test time, {s.get('cpu', 0):.0f} s CPU; trace "
          f"{s.get('trace', 0):.0f} s, lower {s.get('lower', 0):.0f} s, compile {s.get('compile', 0):.0f} s, "
          f"cache reads {s.get('cache_read', 0):.0f} s")
    p = summary["programs"]
    print(f"{p['distinct']} distinct programs, {p['requests']} requests; {p['lowered_more_than_once']} lowered more "
          f"than once, {p['repeat_trace_and_lower_seconds']:.0f} s of tracing and lowering on the repeats")
    if "machine_speed_seconds" in summary:
        m = summary["machine_speed_seconds"]
        print(f"this machine now: {m['python']:.3f} s for a million Python additions, {m['compile']:.3f} s to "
              "compile a small MLP's gradient step")
    print(f"\n{'wall':>7} {'trace':>6} {'lower':>6} {'compile':>7}  file")
    for file, c in list(summary["files"].items())[:top]:
        print(f"{c.get('wall', 0):7.1f} {c.get('trace', 0):6.1f} {c.get('lower', 0):6.1f} {c.get('compile', 0):7.1f}  "
              f"{file}")
    print(f"\n{'compile':>7} {'count':>5}  program")
    for name, c in summary["by_program_name"].items():
        print(f"{c.get('compile', 0):7.1f} {c.get('compiles', 0):5d}  {name}")


def machine_speed(repeats: int = 3) -> dict:
    """Seconds this machine takes, now, for two fixed pieces of the suite's kind of work (the best of
    ``repeats``): ``python``, a million additions in a Python loop (tracing and lowering are Python);
    ``compile``, tracing, lowering and compiling a small MLP's gradient step (each repeat's program differs by a
    constant, so neither JAX's caches nor the persistent one answer).  Two profiles compare fairly only at
    similar speeds: the shared 2-core machine has measured 3x slower on one day than on another."""
    import jax
    import jax.numpy as jnp

    def loop():
        total = 0
        for i in range(1_000_000):
            total += i
        return total

    def compile_step(k: float):
        def loss(w, x):
            h = jnp.tanh(x @ w[0])
            return jnp.mean((h @ w[1] - k) ** 2)
        w = (jnp.ones((64, 128)), jnp.ones((128, 10)))
        jax.jit(jax.grad(loss)).lower(w, jnp.ones((32, 64))).compile()

    def best(fn):
        times = []
        for r in range(repeats):
            start = time.perf_counter()
            fn(r)
            times.append(time.perf_counter() - start)
        return round(min(times), 4)

    return {"python": best(lambda r: loop()), "compile": best(lambda r: compile_step(0.5 + r + time.time() % 1))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help=f"the folder {ENV} named for the pytest run")
    parser.add_argument("--out", type=Path,
                        help="JSON path (default benchmarks/results/suite-profile-<platform>-<N>cores.json)")
    parser.add_argument("--top", type=int, default=25, help="rows per table (default 25)")
    args = parser.parse_args(argv)
    if not args.folder.is_dir():
        raise SystemExit(f"{args.folder} is not a folder: give the one {ENV} named for the pytest run.")
    from fedpartial._src.bench.kit import device_info

    summary = {"benchmark": "suite_profile", "date": time.strftime("%Y-%m-%d"),
               "command": f"{ENV}=DIR python -m pytest -p benchmarks.suite_profile; "
                          "python -m benchmarks.suite_profile DIR",
               "device": {**device_info(), "processor": platform.processor() or platform.machine()},
               "machine_speed_seconds": machine_speed(),
               **summarize(read(args.folder), args.top)}
    print_summary(summary, args.top)
    device = summary["device"]
    out = args.out or (Path(__file__).resolve().parent / "results"
                       / f"suite-profile-{device['platform']}-{device['cpu_count']}cores.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
