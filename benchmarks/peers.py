"""fedpartial against Flower + PyTorch on this machine: the same FedAvg rounds, side by side, in one invocation.

Usage (needs the ``peers`` extra: ``pip install -e ".[peers]"``, which installs Flower and PyTorch)::

    python -m benchmarks.peers [--rows mlp:10,mlp:50,cnn:10,cnn:50,cnn2c1f:10,digits] [--rounds 3] [--runs 2]
        [--quick] [--out PATH]

The workload (:mod:`benchmarks.peers_rows`): FedAvg over N = 100 clients, K = 10 or 50 a round, 10 local SGD steps
(momentum 0.9) of 32 random 28x28x1 examples, the MLP 784-200-200-10, the CNN conv16-pool-conv32-pool-fc64-fc10
and the zoo's ``cnn2c1f`` (5x5 SAME convolutions), the same layers on both sides; and the default digits run's
shape (``cnn2c1f`` on 8x8, N = 20, K = 10, 9 steps of 16).  Flower 1.42 runs its simulation runtime on Ray, one
actor per core, one torch thread each, at the driver's priority (Ray starts its workers niced by default)
(:mod:`benchmarks.peers_flower`); fedpartial runs in one process every
configuration -- ``auto`` (what ``--strategy auto --conv-impl auto`` runs), the layouts it chooses from, and the
plain JAX loop (a Python loop over clients of one jitted SGD step) -- round by round
(:mod:`benchmarks.peers_fedpartial`); the cohort split over the cores (one single-threaded XLA device per core)
runs in a third process.  The three processes alternate, ``--runs`` times, so the machine's load falls on every
side alike; a row's figure is the median of every run's timed rounds (the first round of each row in each process
compiles or warms the actors up and is left out).  ``auto`` is measured as ``fedpartial run --strategy auto
--conv-impl auto`` measures (the split over the cores included), and timed as the configuration it names (the same
code path; the row says which).  The JSON keeps every round, the load averages before and after each process, and
the versions.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys

from benchmarks.peers_rows import ROWS

DEFAULT_ROWS = ("mlp:10", "mlp:50", "cnn:10", "cnn:50", "cnn2c1f:10", "digits")
#: the fedpartial configurations timed beside ``auto`` and the plain loop, by model family
CONFIGS = {"mlp": ("lax/stepwise:1", "lax/fused:1", "lax/fused"),
           "conv": ("lax/stepwise:1", "mapped/fused:1")}
#: the cohort split over the cores: one XLA:CPU device per core, each single-threaded
SPLIT_FLAGS = "--xla_force_host_platform_device_count={cores} --xla_cpu_multi_thread_eigen=false"
SPLIT_CONFIGS = {"mlp": ("lax/fused:1@{cores}", "lax/stepwise:1@{cores}"),
                 "conv": ("mapped/fused:1@{cores}", "lax/stepwise:1@{cores}", "im2col/fused:1@{cores}")}
#: Ray starts its workers at niceness 15 by default: on a machine other work loads, the actors would wait behind it;
#: the registration timeouts are lengthened for a loaded machine.  Not cured by these: Ray's node manager stops when
#: its dashboard agent takes more than about 15 s to start (seen at load averages over 20); run the benchmark again
FLOWER_ENV = {"RAY_worker_niceness": "0", "RAY_agent_register_timeout_ms": "600000",
              "RAY_worker_register_timeout_seconds": "600"}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker(module: str, args: list[str], env: dict | None = None, timeout: float = 1800) -> dict:
    """One side's process: its ``PEERS-RESULT`` JSON, or its error with the rows it finished (``PEERS-ROW``
    lines: a process cut off or failing keeps them); the load averages around it."""
    before = os.getloadavg()
    try:
        proc = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=ROOT,
                              env={**os.environ, **(env or {})}, timeout=timeout)
        stdout, stderr = proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        stderr = f"stopped after {timeout:.0f} s"
    lines = stdout.splitlines()
    line = next((ln for ln in lines if ln.startswith("PEERS-RESULT ")), None)
    if line:
        out = json.loads(line[len("PEERS-RESULT "):])
    else:
        rows = {}
        for ln in lines:
            if ln.startswith("PEERS-ROW "):
                rows.update(json.loads(ln[len("PEERS-ROW "):]))
        out = {"error": (stderr or stdout)[-600:], "rows": rows}
    out["loadavg_before"], out["loadavg_after"] = before, os.getloadavg()
    return out


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def plans(rows: list[str], cores: int) -> tuple[dict, dict]:
    """Per row, the configurations of the one-device process and of the split process."""
    one, split = {}, {}
    for name in rows:
        family = "mlp" if ROWS[name].model == "mlp" else "conv"
        one[name] = ["auto", "plain", *CONFIGS[family]]
        if cores > 1:
            split[name] = [c.format(cores=cores) for c in SPLIT_CONFIGS[family]]
    return one, split


def run_all(rows: list[str], rounds: int, runs: int, cores: int, log, save=lambda records: None) -> list[dict]:
    """Every side's process in turn, ``runs`` times: Flower (every row in one simulation), fedpartial on one
    device, fedpartial split over the cores; then each row's medians."""
    one, split = plans(rows, cores)
    sides = []
    for r in range(runs):
        run = {"flower": worker("benchmarks.peers_flower", [str(rounds), ",".join(rows)], env=FLOWER_ENV),
               "fedpartial": worker("benchmarks.peers_fedpartial", [str(rounds), json.dumps(one)])}
        if split:
            run["split"] = worker("benchmarks.peers_fedpartial", [str(rounds), json.dumps(split)],
                                  env={"XLA_FLAGS": SPLIT_FLAGS.format(cores=cores)})
        sides.append(run)
        log(f"run {r + 1}/{runs}: " + ", ".join(f"{k}: {v.get('error', 'ok')[:300]}" for k, v in run.items()))
        save(gather(rows, sides, one, split))  # a run cut off keeps the runs it finished
    return gather(rows, sides, one, split)


def gather(rows: list[str], sides: list[dict], one: dict, split: dict) -> list[dict]:
    """Each row's record from the processes' results: every run's rounds, the medians, ``auto``'s choice."""
    records = []
    for name in rows:
        record = {"row": name, "settings": ROWS[name]._asdict(), "configs": one[name] + split.get(name, []),
                  "runs": []}
        seconds: dict[str, list[float]] = {"flower": []}
        for run in sides:
            got = {side: {k: v for k, v in out.items() if k != "rows"} | (out.get("rows") or {}).get(name, {})
                   for side, out in run.items()}
            record["runs"].append(got)
            seconds["flower"] += got["flower"].get("round_s", [])[1:]
            for side in ("fedpartial", "split"):
                for config, times in (got.get(side, {}).get("round_s") or {}).items():
                    if config != "auto":
                        seconds.setdefault(config, []).extend(times[1:])
            chosen = got["fedpartial"].get("auto")
            if chosen:  # each run's auto is the configuration that run chose, timed by the process that has it
                side = "split" if "@" in chosen["config"] else "fedpartial"
                seconds.setdefault("auto", []).extend(
                    (got.get(side, {}).get("round_s") or {}).get(chosen["config"], [])[1:])
        autos = [run["fedpartial"].get("auto") for run in record["runs"] if run["fedpartial"].get("auto")]
        record["auto"] = autos[-1] if autos else None
        record["auto_choices"] = [a["config"] for a in autos]
        record["median_round_s"] = {k: median(v) for k, v in seconds.items()}
        summarise(record)
        records.append(record)
    return records


def summarise(record: dict) -> None:
    """The row's headline: Flower, the best fedpartial configuration, ``auto``, the plain loop, and the ratios."""
    med = record["median_round_s"]
    flower, auto, plain = med.get("flower"), med.get("auto"), med.get("plain")
    ours = {k: v for k, v in med.items() if k not in ("flower", "plain", "auto") and v}
    best = min(ours, key=ours.get) if ours else None
    record["summary"] = {
        "flower_s": flower, "best": best, "best_s": ours.get(best), "auto_s": auto, "plain_s": plain,
        "best_speedup_vs_flower": flower / ours[best] if flower and best else None,
        "auto_speedup_vs_flower": flower / auto if flower and auto else None,
        "auto_vs_best": auto / ours[best] if auto and best else None,
        "auto_speedup_vs_plain": plain / auto if plain and auto else None,
    }


def versions() -> dict:
    out = {}
    for name in ("jax", "jaxlib", "flax", "optax", "numpy", "torch", "flwr", "ray"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = None
    return out


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m benchmarks.peers", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default=",".join(DEFAULT_ROWS), help="comma-separated: " + ", ".join(ROWS))
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per process (after one untimed round)")
    p.add_argument("--runs", type=int, default=2, help="alternating runs of each side per row")
    p.add_argument("--quick", action="store_true", help="smoke test: the tiny 'quick' row, 1 round, 1 run")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "peers-cpu.json"))
    args = p.parse_args(argv)
    rows = ["quick"] if args.quick else [r for r in args.rows.split(",") if r]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        p.error(f"row {unknown[0]!r} is unknown; use one of {', '.join(ROWS)}.")
    rounds, runs = (1, 1) if args.quick else (args.rounds, args.runs)
    cores = os.cpu_count() or 1
    import platform

    import jax

    device = {"backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind, "cpu_count": cores,
              "machine": platform.machine(), "processor": platform.processor(), "python_version": platform.python_version()}
    report = {"benchmark": "peers", "command": "python -m benchmarks.peers " + " ".join(argv), "argv": argv,
              "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": device, "versions": versions(), "loadavg_at_start": os.getloadavg(),
              "settings": {"rounds": rounds, "runs": runs, "split_flags": SPLIT_FLAGS.format(cores=cores),
                           "flower_env": FLOWER_ENV},
              "rows": []}
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731

    def save(records):
        report["rows"], report["loadavg_at_end"] = records, os.getloadavg()
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)

    save(run_all(rows, rounds, runs, cores, log, save))
    print(table(report["rows"]), flush=True)
    return 0


def table(rows: list[dict]) -> str:
    lines = ["| row | Flower + torch | fedpartial best | auto | plain JAX loop |", "|---|---|---|---|---|"]
    for r in rows:
        s = r["summary"]
        fmt = lambda v: "—" if v is None else f"{v:.3f} s"  # noqa: E731
        best = "—" if s["best"] is None else f"{fmt(s['best_s'])} ({s['best']}, {s['best_speedup_vs_flower'] or 0:.2f}x)"
        lines.append(f"| {r['row']} | {fmt(s['flower_s'])} | {best} | {fmt(s['auto_s'])} | {fmt(s['plain_s'])} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
