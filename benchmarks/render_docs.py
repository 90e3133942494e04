"""Render the measured numbers of the documentation from ``benchmarks/results/*.json``.

Nothing measured is typed by hand: this script writes ``docs/benchmarks.md`` whole, and fills the
generated blocks of ``README.md`` and ``docs/reproductions/*.md`` (the text between
``<!-- BEGIN generated: NAME -->`` and ``<!-- END generated: NAME -->``).  Every table names the
result file it was read from, and every result file its device, date and command, as far as the file
records them; where it does not, the page says so instead of guessing.

    python -m benchmarks.render_docs            # rewrite the pages
    python -m benchmarks.render_docs --check    # exit 1, naming the pages, when a committed page differs

``tests/test_docs.py`` runs the check.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import statistics
import sys

from benchmarks import render_families, render_figures, render_lora

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"
BLOCK_PAGES = ("README.md", "docs/index.md", "docs/troubleshooting.md", "docs/reproductions/fedldf.md", "docs/reproductions/fedspu.md",
               "docs/reproductions/embracingfl.md", "docs/reproductions/feddhad.md", "docs/deadlines.md",
               "docs/reproductions/families.md", "docs/async.md", "docs/lora.md")
BLOCK = re.compile(r"(<!-- BEGIN generated: (?P<name>[\w-]+) -->\n).*?(<!-- END generated: (?P=name) -->)", re.DOTALL)

# How each result family is produced (the JSON's ``benchmark`` field -> the script that writes it).
SCRIPTS = {
    "lora": "python -m benchmarks.lora", "lora_speed": "python -m benchmarks.lora_speed",
    "strategies": "python -m benchmarks.strategies", "compare_revisions": "python -m benchmarks.compare_revisions",
    "throughput": "fedpartial bench", "seeds": "python -m benchmarks.seeds", "scale": "python -m benchmarks.scale",
    "stream_conv": "python -m benchmarks.stream_conv", "data_placement": "python -m benchmarks.data_placement",
    "gather": "python -m benchmarks.gather", "replica_memory": "python -m benchmarks.replica_memory",
    "fedldf": "python -m benchmarks.fedldf", "fedspu": "python -m benchmarks.fedspu",
    "embracingfl": "python -m benchmarks.embracingfl", "feddh": "python -m benchmarks.feddh",
    "feddhad": "python -m benchmarks.feddhad", "deadlines": "python -m benchmarks.deadlines",
    "conv_probe": "python -m benchmarks.conv_probe", "conv_lowering": "python -m benchmarks.conv_lowering",
    "personalised": "python -m benchmarks.personalised", "privacy": "python -m benchmarks.privacy",
    "tiers": "python -m benchmarks.tiers", "drift": "python -m benchmarks.drift",
    "async": "python -m benchmarks.async", "async_machinery": "python -m benchmarks.async --machinery",
    "peers": "python -m benchmarks.peers",
}
LABELS = {"fedavg": "FedAvg", "fedprox": "FedProx", "fednova": "FedNova", "moon": "MOON", "feddyn": "FedDyn",
          "fedjs": "FedJS", "feddh": "FedDH", "feddhe": "FedDHE", "feddst": "FedDST", "prunefl": "PruneFL",
          "afd": "AFD", "feddrop": "FedDrop", "fjord": "FjORD", "fedad": "FedAD", "feddhad": "FedDHAD",
          "fedldf": "FedLDF", "random": "Random", "hdfl": "HDFL", "fedadp": "FedADP", "hermes": "Hermes",
          "fedmp": "FedMP", "fedselect": "FedSelect", "fedspu": "FedSPU", "fedper": "FedPer",
          "lgfedavg": "LG-FedAvg", "fedrep": "FedRep", "embracingfl": "EmbracingFL",
          "heterofl": "width reduction (HeteroFL)", "fedrolex": "FedRolex", "depthfl": "DepthFL",
          "inclusivefl": "InclusiveFL"}


# ---- reading ---------------------------------------------------------------------------------------


def load_results(directory: pathlib.Path = RESULTS) -> dict[str, dict]:
    """Every result file, by file name, in name order."""
    return {p.name: json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))}


def _device_record(d: dict) -> dict | None:
    if isinstance(d.get("device"), dict):
        return d["device"]
    if isinstance(d.get("platform"), dict) and isinstance(d["platform"].get("device"), dict):
        return d["platform"]["device"]  # compare_revisions
    env = d.get("environment")
    if isinstance(env, dict) and env.get("backend"):
        return {"platform": env["backend"], "jax_version": env.get("packages", {}).get("jax")}
    return None


def device_of(name: str, d: dict) -> str:
    dev = _device_record(d)
    if dev is None:
        return ("GPU" if "-gpu-" in name else "CPU") + " (from the file name)"
    kind = dev.get("device_kind") or dev.get("platform") or dev.get("backend") or "?"
    text = "CPU" if kind.lower() == "cpu" else kind
    if text == "CPU" and dev.get("cpu_count"):
        text += f" ({dev['cpu_count']} cores)"
    if dev.get("jax_version"):
        text += f", jax {dev['jax_version']}"
    return text


def date_of(name: str, d: dict) -> str:
    """The day the file's run was made: as the file recorded it, else as its name says, else no later than the
    day the file was committed (``committed``, written once into files that predate ``time``), else unknown."""
    for value in (d.get("date"), d.get("time"), (d.get("environment") or {}).get("time")):
        if isinstance(value, str) and value:
            return value[:10]
    match = re.search(r"(\d{4})-?(\d{2})-?(\d{2})", name)
    if match:
        return "{}-{}-{} (from the file name)".format(*match.groups())
    if isinstance(d.get("committed"), str):
        return f"run by {d['committed']} (commit date)"
    return "not recorded"


# Where each script's flags are declared (its argparse calls), to rebuild a command from recorded settings.
FLAG_SOURCES = {
    "strategies": "benchmarks/strategies.py", "throughput": "fedpartial/_src/bench/suite.py",
    "seeds": "benchmarks/seeds.py", "stream_conv": "benchmarks/stream_conv.py", "gather": "benchmarks/gather.py",
    "replica_memory": "benchmarks/replica_memory.py", "fedldf": "benchmarks/fedldf.py",
    "fedspu": "benchmarks/fedspu.py", "embracingfl": "benchmarks/embracingfl.py", "feddh": "benchmarks/feddh.py",
    "feddhad": "benchmarks/feddh.py", "privacy": "benchmarks/privacy.py",
}
NOT_REBUILT = ("--out", "--worker", "--params-out", "--tag", "--merge", "--data-dir")


def script_flags(benchmark: str) -> set[str]:
    path = ROOT / FLAG_SOURCES[benchmark]
    return set(re.findall(r'add_argument\(\s*"(--[a-z0-9-]+)"', path.read_text())) if path.exists() else set()


def recorded_settings(d: dict) -> dict | None:
    """The settings a result file recorded, keyed like its script's flags (None: none usable)."""
    benchmark = d.get("benchmark")
    if benchmark == "stream_conv":
        return {"model": d["model"], "cohort": d["cohort_size"], "rounds": d["rounds"],
                "local_steps": d["local_steps"], "batch_size": d["batch_size"],
                "strategies": [r["strategy"] for r in d["runs"]]}
    if benchmark == "replica_memory":
        return {**d["settings"], "axes": [r["axis"] for r in d["results"]]}
    if benchmark == "fedspu" and "merged_from" in d.get("settings", {}):
        return None  # merged from several files: no one command
    return next((d[k] for k in ("protocol", "settings", "config") if isinstance(d.get(k), dict)), None)


def rebuilt_command(d: dict) -> str | None:
    """The script's command line with the recorded settings as flags, or None when it cannot be rebuilt."""
    benchmark = d.get("benchmark")
    settings = recorded_settings(d) if benchmark in FLAG_SOURCES else None
    flags = script_flags(benchmark) if settings is not None else set()
    if not flags:
        return None
    parts = [SCRIPTS[benchmark]]
    for key, value in settings.items():
        flag = "--" + key.replace("_", "-")
        if (flag not in flags or flag in NOT_REBUILT or value is None or value is False or isinstance(value, dict)
                or value in ([], ())):
            continue
        if value is True:
            parts.append(flag)
        else:
            text = ",".join(str(v) for v in value) if isinstance(value, (list, tuple)) else str(value)
            parts.append(f"{flag} {text}")
    return " ".join(parts)


def command_of(name: str, d: dict) -> str:
    if d.get("command"):
        return f"`{d['command']}`"
    script = SCRIPTS.get(d.get("benchmark"))
    if "argv" in d and script:
        return f"`{' '.join([script, *d['argv']])}`"
    if d.get("benchmark") == "compare_revisions":
        args = " ".join(d.get("passthrough_args") or [])
        return (f"`{script} --before {d['before']['revision']}{' ' + args if args else ''}` "
                f"(rebuilt from the recorded arguments)")
    rebuilt = rebuilt_command(d)
    if rebuilt:
        return f"`{rebuilt}` (rebuilt from the file's settings)"
    if script:
        return f"`{script}`, arguments not kept"
    return "none: a one-off measurement, described in the file's note" if d.get("note") else "not recorded"


#: result files a later measurement replaces: file -> (the newer file, why); their tables stay, marked
SUPERSEDED = {
    "strategies-cpu-cpu.json": ("conv-lowering-cpu-cpu-20261203.json",
                                "measured before the convolution lowerings and today's `auto`; its CPU cells are "
                                "noisier than the quiet re-run's (0.78× there, 0.98× here for cnn2c1f stepwise:1)"),
    "strategies-cpu-cpu-quiet-rerun.json": ("conv-lowering-cpu-cpu-20261203.json",
                                            "measured before the convolution lowerings and today's `auto`"),
    "replica-layout-cpu-2026-12-03.json": ("replica-layout-cpu-2026-12-04.json",
                                           "measured before replicas followed a single run's layout: they ran the "
                                           "vmapped fused:1 round, 0.05× two separate runs' steady speed"),
    "throughput-cpu-cpu-20261123.json": ("conv-lowering-cpu-cpu-20261203.json",
                                         "measured before the convolution lowerings and today's `auto` (its conv "
                                         "models ran lax's convolution one client at a time)"),
}


def source(name: str, d: dict) -> str:
    """One line naming the file, its device, date and command (and, for a superseded file, what replaces it)."""
    line = (f"*Source:* `benchmarks/results/{name}` · device: {device_of(name, d)} · date: {date_of(name, d)}"
            f" · command: {command_of(name, d)}")
    if name in SUPERSEDED:
        newer, why = SUPERSEDED[name]
        line += f" · **superseded** by `{newer}`: {why}; kept for the record, use the newer numbers"
    return line


# ---- formatting ------------------------------------------------------------------------------------


def num(x, digits: int = 2, suffix: str = "") -> str:
    if x is None or isinstance(x, bool):
        return "—"
    return f"{x:,.{digits}f}{suffix}"


def gib(b) -> str:
    return "—" if b is None else f"{b / 2**30:.2f} GiB"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    out += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return out + [""]


def label(method: str) -> str:
    base, _, variant = method.partition("@")
    return LABELS.get(base, base) + (f" ({variant})" if variant else "")


def family(results: dict[str, dict], benchmark: str) -> dict[str, dict]:
    return {n: d for n, d in results.items() if d.get("benchmark") == benchmark}


# ---- engine measurements ----------------------------------------------------------------------------


def strategies(results) -> list[str]:
    lines = []
    for name, d in family(results, "strategies").items():
        names = [m["strategy"] for m in d["results"][0]["measurements"]]
        rows = []
        for r in d["results"]:
            by = {m["strategy"]: m for m in r["measurements"]}
            plain = by.get("plain_loop", {})
            cells = [f"{num(plain.get('rounds_per_s'))} r/s"]
            for s in names[1:]:
                m = by.get(s, {})
                cells.append("not run" if m.get("skipped") else num(m.get("speedup_vs_plain"), 2, "×"))
            rows.append([r["model"], r["cohort_size"], *cells])
        lines += [source(name, d), ""] + table(["model", "K", "plain loop", *names[1:]], rows)
    return lines


def compare_revisions(results) -> list[str]:
    lines = []
    for name, d in family(results, "compare_revisions").items():
        rows = [[c["model"], c["cohort_size"], c["strategy"], num(c.get("before_rounds_per_s_median")),
                 num(c.get("after_rounds_per_s_median")), num(c.get("after_over_before"), 2, "×")]
                for c in d["comparison"]]
        lines += [source(name, d), "",
                  f"Before: `{d['before']['label']}` ({d['before']['revision']}); after: `{d['after']['label']}` "
                  f"({d['after']['revision']}); {d.get('repeats')} repeats, {d.get('order')}.", ""]
        lines += table(["model", "K", "strategy", "before r/s", "after r/s", "after / before"], rows)
    return lines


def throughput(results) -> list[str]:
    lines = []
    for name, d in family(results, "throughput").items():
        rows = []
        for cell in d["results"]:
            if cell.get("skipped"):
                rows.append([cell["model"], cell["cohort_size"], "—", "—", f"skipped: {cell['skipped']}",
                             "—", "—", "—", "—"])
                continue
            for r in cell["runners"]:
                if r.get("skipped"):
                    rows.append([cell["model"], cell["cohort_size"], r["method"], r["strategy"],
                                 f"skipped: {r['skipped']}", "—", "—", "—", "—"])
                    continue
                strategy = r.get("resolved_strategy", r["strategy"])
                if r["strategy"] not in ("plain_loop", strategy):
                    strategy = f"{r['strategy']} = {strategy}"
                flops = r.get("achieved_flops_per_s")
                rows.append([cell["model"], cell["cohort_size"], r["method"], strategy, num(r.get("round_s"), 3),
                             num(r.get("ratio_to_plain"), 2, "×"), num(r.get("round_time_over_fedavg")),
                             "—" if flops is None else num(flops / 1e9, 1), gib(r.get("peak_memory_bytes"))])
        matmul = d["device"].get("matmul_flops_per_s")
        cfg = d["config"]
        lines += [source(name, d), "",
                  f"Local steps {cfg.get('local_steps')} × batch {cfg.get('batch_size')}, {cfg.get('rounds')} timed "
                  f"rounds; matmul reference {num(matmul and matmul / 1e9, 0)} GFLOP/s.", ""]
        lines += table(["model", "K", "method", "strategy", "s/round", "vs plain loop", "round / FedAvg's",
                        "GFLOP/s", "peak memory"], rows)
    return lines


def gpu_scale(results) -> list[str]:
    """The GPU throughput files in one table: per runner rounds/s, its ratio to the plain loop of the same run,
    the full model's training FLOP/s against the run's matmul, and the peak memory against the estimate."""
    rows, names = [], []
    for name, d in family(results, "throughput").items():
        if d["device"].get("platform") != "gpu":
            continue
        names.append(f"`{name}`")
        matmul = d["device"].get("matmul_flops_per_s")
        precision = " (full float32)" if full_float32(name) else ""
        for cell in d["results"]:
            for r in cell.get("runners", []):
                where = [d["device"]["device_kind"], cell["model"], f"{cell['cohort_size']:,}",
                         r["strategy"] + precision]
                if r.get("skipped") or r.get("error"):
                    rows.append(where + [f"not run: {r.get('skipped') or r.get('error')}"] + ["—"] * 4)
                    continue
                work = r.get("full_model_flops_per_s")
                rows.append(where + [num(r.get("rounds_per_s"), 3), num(r.get("ratio_to_plain"), 2, "×"),
                                     "—" if work is None else f"{work / 1e12:.1f}",
                                     "—" if work is None or not matmul else f"{work / matmul:.1%}",
                                     f"{gib(r.get('peak_memory_bytes'))} / {gib(cell.get('estimated_bytes'))}"])
    if not rows:
        return []
    first = next(d for d in family(results, "throughput").values() if d["device"].get("platform") == "gpu")
    cfg = first["config"]
    return [f"*Sources:* {', '.join(names)} · command: `bash benchmarks/gpu_plan.sh essentials` (a `-highest` file: "
            "the same step under `JAX_DEFAULT_MATMUL_PRECISION=highest`, VGG-9's check against the loop)", "",
            f"FedAvg, {cfg['local_steps']} local steps of {cfg['batch_size']} random examples, every client in the "
            f"cohort; the plain loop runs {cfg['plain_clients']} clients and is scaled to K. TFLOP/s: the full model's "
            "training kernels (analytic; XLA's GPU count misses cuDNN convolutions); % of the float32 matmul at "
            "default precision (TF32) timed in the same run. Peak memory against the suite's estimate (which "
            "leaves out activations).", ""] + table(
        ["device", "model", "K", "strategy", "rounds/s", "vs plain loop", "TFLOP/s", "of matmul", "peak / estimate"],
        rows)


def full_float32(name: str) -> bool:
    """A GPU file measured at ``highest`` matmul precision (a correctness check, not the default speed)."""
    return "-highest" in name


def conv_probe(results) -> list[str]:
    lines = []
    for name, d in family(results, "conv_probe").items():
        rows = []
        for r in d["results"]:
            grouped = r.get("vmapped_grouped_convolutions", {})
            for variant, v in r["variants"].items():
                rows.append([r["model"], f"{r['cohort_size']:,}", variant, num(v["seconds"] * 1e3, 1),
                             f"{v['flops_per_s'] / 1e12:.2f}", f"{v['share_of_matmul']:.1%}",
                             num(v.get("speedup_over_plain"), 1, "×"),
                             str(sum(grouped.values())) if variant == "vmapped" else ""])
        lines += [source(name, d), ""] + table(["model", "K", "one step of the cohort", "ms", "TFLOP/s", "of matmul",
                                                "vs plain", "grouped convs"], rows)
    return lines


def conv_lowering(results) -> list[str]:
    lines = []
    for name, d in family(results, "conv_lowering").items():
        rows = []
        for r in d["results"]:
            auto = (r.get("auto") or {}).get("cell")
            for cell, c in r["cells"].items():
                if "round_s" not in c:
                    rows.append([r["row"], r["dtype"], cell, "skipped" if "skipped" in c else "error", "", "", "", ""])
                    continue
                rows.append([r["row"], r["dtype"], cell + (" (auto)" if cell == auto else ""),
                             num(c["rounds_per_s"], 3), num(c.get("speedup_vs_plain"), 2, "×"),
                             num(c["gflops_per_s"], 1), f"{c['share_of_matmul']:.1%}",
                             "" if c.get("max_abs_diff_vs_plain") is None else f"{c['max_abs_diff_vs_plain']:.0e}"])
        matmul = d["device"]["matmul_flops_per_s"] / 1e9
        lines += [source(name, d) + f"; matmul {matmul:.0f} GFLOP/s; git {str(d.get('git_revision'))[:10]}"
                  + (f" · conditions: {d['note']}" if d.get("note") else ""), ""]
        lines += table(["row (model@input:K)", "dtype", "lowering/strategy", "rounds/s", "vs loop", "GFLOP/s",
                        "of matmul", "max abs diff vs loop"], rows)
    return lines


def peers(results) -> list[str]:
    """fedpartial against Flower + PyTorch: per row the medians, the best configuration, ``auto`` and the plain loop."""
    lines = []
    for name, d in family(results, "peers").items():
        rows = []
        for r in d["rows"]:
            s, st, med = r["summary"], r["settings"], r["median_round_s"]
            auto = " / ".join(dict.fromkeys(r.get("auto_choices") or [(r.get("auto") or {}).get("config", "—")]))
            rows.append([f"{r['row'].split(':')[0]} ({st['side']}×{st['side']})", str(st["cohort"]),
                         num(s["flower_s"], 3, " s"),
                         f"{num(s['best_s'], 3, ' s')} (`{s['best']}`) — {num(s['best_speedup_vs_flower'], 2, '×')}",
                         f"{num(s['auto_s'], 3, ' s')} (`{auto}`) — {num(s['auto_speedup_vs_flower'], 2, '×')}",
                         num(s["auto_vs_best"], 2, "×"), num(med.get("plain"), 3, " s")])
        load = d.get("loadavg_at_start")
        lines += [source(name, d) + f"; Flower {d['versions'].get('flwr')}, torch {d['versions'].get('torch')}, "
                  f"ray {d['versions'].get('ray')}; load averages at the start {tuple(round(v, 1) for v in load)}, "
                  f"at the end {tuple(round(v, 1) for v in d.get('loadavg_at_end', load))} on "
                  f"{d['device'].get('cpu_count')} cores", ""]
        lines += table(["model", "K", "Flower + torch", "fedpartial best (vs Flower)", "fedpartial auto (vs Flower)",
                        "auto's time / best's", "plain JAX loop"], rows)
        if d.get("note"):
            lines += ["", d["note"]]
        lines += ["", "Median seconds a round after warm-up. `@2`: the cohort split over 2 single-threaded XLA:CPU "
                  "devices (one per core), `stepwise:1@2` one client per device at a time, `fused:1@2` a loop inside "
                  "one program per device; `auto`: what `fedpartial run --strategy auto --conv-impl auto` measured "
                  "and chose, the split included; `plain`: a Python loop of one jitted SGD step per client."]
    for name, d in family(results, "peers_profile").items():
        jx, tc = d["sides"]["jax"], d["sides"]["torch"]
        st = d["settings"]
        names = {"step_s": "one SGD step (forward, backward, momentum)", "conv1_s": "first convolution block alone",
                 "conv2_s": "second convolution block alone", "dense_s": "dense head alone"}
        lines += ["", f"Where the time goes, per core: one client's step of `{st['model']}` (batch {st['batch']}, "
                  f"{st['side']}×{st['side']}), one thread on each side, `python -m benchmarks.peers_profile` "
                  f"({date_of(name, d)}).", ""]
        lines += table(["piece", "XLA:CPU", "PyTorch", "XLA / PyTorch"],
                       [[names[k], num(jx.get(k, 0) * 1e3, 2, " ms"), num(tc.get(k, 0) * 1e3, 2, " ms"),
                         num(d["jax_over_torch"].get(k), 2, "×")] for k in names if k in d["jax_over_torch"]])
        lines += side_by_side_lines(d)
    return lines


def side_by_side_lines(d: dict) -> list[str]:
    """The profile's clients side by side: a step alone and with one client per core at once, on each side, and the
    least time a round's steps could take at that rate (``peers_profile``'s bound)."""
    pair = {k: v for k, v in d.get("side_by_side", {}).items() if "throughput" in v}
    if len(pair) < 2:
        return []
    from benchmarks.peers_rows import ROWS

    st, rows = d["settings"], []
    cores = pair["jax"]["clients_at_once"]
    # the peer benchmark's rows that train the profiled model on the profiled batches
    bound_rows = [r for r, spec in ROWS.items()
                  if (spec.model, spec.side, spec.batch_size) == (st.get("model"), st.get("side"), st.get("batch"))]
    for name, label in (("jax", f"XLA:CPU (`{st.get('impl', 'mapped')}`, {cores} devices)"),
                        ("torch", f"PyTorch ({cores} processes)")):
        g = pair[name]
        bounds = [num(ROWS[r].cohort * ROWS[r].local_steps * g["side_by_side_step_s"] / cores, 2, " s")
                  for r in bound_rows]
        rows.append([label, num(g["alone_step_s"] * 1e3, 2, " ms"), num(g["side_by_side_step_s"] * 1e3, 2, " ms"),
                     num(g["throughput"], 2, "×"), *bounds])
    lines = ["", f"Clients side by side: one client's local training ({pair['jax']['steps']} steps) alone on one "
             f"core, then one client per core at once, as a round split over the {cores} cores runs them. The last "
             f"column{'s' if len(bound_rows) > 1 else ''}: the least time a peer benchmark row's steps take at "
             "that rate (cohort × local steps × a step side by side / cores), were nothing else to take time.", ""]
    return lines + table(["side", "a step alone", "a step side by side (each)", "the cores together",
                          *[f"{r}'s steps" for r in bound_rows]], rows)


def peers_summary(results) -> list[str]:
    """The README's sentences on Flower + PyTorch from the committed peers file: Flower's round time over
    fedpartial's best per model family, the rows fedpartial loses, and ``auto`` against the best configuration on
    one device (what it chooses from) and against the plain loop."""
    lines = []
    for name, d in family(results, "peers").items():
        rows = [r for r in d["rows"] if r.get("summary", {}).get("flower_s")]
        if not rows:
            continue

        def span(values: list[float], digits: int = 1) -> str:
            low, high = (f"{v:.{digits}f}" for v in (min(values), max(values)))
            return f"{low}×" if low == high else f"{low}–{high}×"

        groups = {"an MLP": [r for r in rows if r["row"].startswith("mlp")],
                  "small CNNs on 28×28": [r for r in rows if r["row"].startswith("cnn")],
                  "the default digits run": [r for r in rows if r["row"] == "digits"]}
        parts = [f"{span([r['summary']['best_speedup_vs_flower'] for r in rs])} for {what}"
                 for what, rs in groups.items() if rs]
        losses = [f"`{r['row']}` ({r['summary']['best_speedup_vs_flower']:.2f}×)" for r in rows
                  if r["summary"]["best_speedup_vs_flower"] < 1]
        cores = d["device"].get("cpu_count")
        split = sum(1 for r in rows if r["summary"]["best"].endswith(f"@{cores}"))
        choices = [c for r in rows for c in r.get("auto_choices") or [(r.get("auto") or {}).get("config", "")]]
        auto_split = sum(1 for c in choices if c.endswith(f"@{cores}"))
        to_best = [r["summary"]["auto_vs_best"] for r in rows]
        plain = [r["summary"]["auto_speedup_vs_plain"] for r in rows]
        load = d.get("loadavg_at_start") or [0.0]
        text = (f"Against Flower + PyTorch on a {cores}-core CPU (FedAvg, N = 100, 10 local SGD steps of 32 on "
                f"28×28×1 inputs, the same layers on both sides; `pip install -e \".[peers]\"`, then "
                f"`python -m benchmarks.peers`; {date_of(name, d)}, load average {load[0]:.1f} at the start), "
                "Flower's round time over fedpartial's best configuration's was "
                + (f"{', '.join(parts[:-1])} and {parts[-1]}" if len(parts) > 1 else parts[0])
                + " (above 1: fedpartial is faster)")
        text += f"; Flower was faster in {', '.join(losses[:-1])} and {losses[-1]}." if len(losses) > 1 else (
            f"; Flower was faster in {losses[0]}." if losses else ".")
        if split:
            text += (f" The best was the cohort split over the {cores} cores in {split} of {len(rows)} rows; "
                     f"`--strategy auto` chose it (the split unless one device measures faster) in {auto_split} of its "
                     f"{len(choices)} choices (one a row in each run; [the decision](docs/decisions.md)).")
        text += (f" `auto` took {span(to_best, 2)} the time of the best configuration (within "
                 f"5 % in {sum(v <= 1.05 for v in to_best)} of {len(rows)} rows) and "
                 f"{span([1 / v for v in plain], 2)} the plain loop's "
                 "([the table](docs/benchmarks.md#against-flower-pytorch)).")
        lines.append(text)
    return lines


def seeds(results) -> list[str]:
    lines = []
    for name, d in family(results, "seeds").items():
        cfg = d["config"]
        sweep = ", ".join(f"{k} {cfg[k]}" for k in ("lrs", "server_lrs", "server_opt") if k in cfg)
        rows = []
        for r in d["results"]:
            for m in r["measurements"]:
                sp = m.get("speedup", {})
                rows.append([r["model"], r["dataset"], m["variant"], num(m["wall_s"], 1), num(m["steady_s"], 2),
                             num(sp.get("sequential_fused", {}).get("wall"), 2, "×"),
                             num(sp.get("sequential_fused", {}).get("steady"), 2, "×"),
                             num(sp.get("sequential_default", {}).get("wall"), 2, "×"),
                             num(sp.get("sequential_default", {}).get("steady"), 2, "×")])
        equal = all(r.get("vmapped_equals_sequential_fused", True) and r.get("mapped_equals_sequential_fused", True)
                    for r in d["results"])
        lines += [source(name, d), "",
                  f"Seeds {cfg['seeds']}{'; ' + sweep if sweep else ''}; N = {cfg['clients']}, K = {cfg['cohort']}, "
                  f"{cfg['rounds']} rounds of {cfg['local_steps']} steps of {cfg['batch_size']}; every replica equal "
                  f"to its own run: {'yes' if equal else 'NO'}. {d.get('note', '')}", ""]
        lines += table(["model", "data", "replicas", "wall s", "steady s", "vs runs, fused: wall", "steady",
                        "vs runs, default: wall", "steady"], rows)
    return lines


def data_placement(results) -> list[str]:
    lines = []
    for name, d in family(results, "data_placement").items():
        rows = []
        for c in d["cases"]:
            for placement in ("host", "device"):
                p = c.get(placement) or {}
                rows.append([c["description"], placement, *(num(p.get(f"{k}_s_median") and 1e3 * p[f"{k}_s_median"], 1)
                                                            for k in ("sample", "prepare", "transfer", "compute")),
                             num(p.get("end_to_end_rounds_per_s"), 3),
                             num(c.get("device_over_host_end_to_end_rounds_per_s"), 2, "×") if placement == "device"
                             else ""])
        lines += [source(name, d), ""] + table(
            ["case", "placement", "sample ms", "pack / gather ms", "transfer ms", "round compute ms", "rounds/s",
             "device / host"], rows)
    return lines


def gather(results) -> list[str]:
    lines = []
    for name, d in family(results, "gather").items():
        cfg = d["config"]
        rows = [[case, r["largest_client"], num(1e3 * r["median_s"], 1)] for case, r in d["results"].items()]
        lines += [source(name, d), "",
                  f"K = {cfg['cohort']} of {cfg['clients']} clients, {cfg['local_steps']} steps of "
                  f"{cfg['batch_size']}; one client of {cfg['large']} examples over as is: "
                  f"{num(d.get('large_over_as_is'), 3, '×')}.", ""]
        lines += table(["population", "largest client", "gather ms (median)"], rows)
    return lines


def replica_memory(results) -> list[str]:
    lines = []
    for name, d in family(results, "replica_memory").items():
        s = d["settings"]
        rows = [[f"`{r['axis']}`", gib(r["estimate_bytes"]), gib(max(r["rss_after_round"])),
                 num(r["peak_over_estimate"], 3, "×"), ", ".join(num(t, 1) for t in r["round_s"])]
                for r in d["results"]]
        lines += [source(name, d), "",
                  f"{s['method']} on {s['dataset']}, N = {s['clients']}, K = {s['cohort_size']}, seeds {s['seeds']}, "
                  f"{s['rounds']} rounds.", ""]
        lines += table(["replica axis", "estimate", "peak RSS", "peak / estimate", "round s"], rows)
    return lines


def stream_conv(results) -> list[str]:
    lines = []
    for name, d in family(results, "stream_conv").items():
        rows = [[f"`{r['strategy']}`", ", ".join(num(t, 2) for t in r["round_s"]), gib(r["peak_rss"]),
                 gib(r["rss_ready"])] for r in d["runs"]]
        diff = d.get("max_abs_param_diff")
        lines += [source(name, d), "",
                  f"FedAvg, {d['model']}, K = {d['cohort_size']}, {d['local_steps']} steps of {d['batch_size']}, "
                  f"{d['rounds']} timed rounds; largest parameter difference between the strategies: "
                  f"{'not measured' if diff is None else num(diff, 7)}.", ""]
        lines += table(["strategy", "round s", "peak RSS", "RSS once data and model exist"], rows)
    return lines


def scale(results) -> list[str]:
    lines = []
    for name, d in family(results, "scale").items():
        rows = []
        for case in d["results"]:
            s = case["settings"]
            for r in case["runs"]:
                rows.append([case["case"], f"{s['num_clients']:,}", f"{s['cohort_size']:,}", f"`{s['strategy']}`",
                             r["method"], r.get("client_state_used", "—"), gib(r.get("personal_state_bytes")),
                             num(r.get("build_s"), 1), ", ".join(num(t, 1) for t in r["round_s"]),
                             gib(r.get("peak_rss"))])
        lines += [source(name, d), "", f"{d.get('note', '')}", ""]
        lines += table(["case", "N", "K", "strategy", "method", "client state", "per-client state", "build s",
                        "round s", "peak RSS"], rows)
    return lines


def other_runs(results) -> list[str]:
    lines = []
    for name, d in results.items():
        if d.get("benchmark") == "memory-estimate-calibration":
            rows = [[f"{r['config']['num_clients']:,}", f"`{r['config']['strategy']}`", gib(r["estimate_total"]),
                     gib(r["increase"])] for r in d["runs"]]
            lines += [f"**{d['benchmark']}**", "", source(name, d), "", d.get("note", ""), ""]
            lines += table(["clients = K", "strategy", "estimate", "measured increase"], rows)
        elif "summary" in d and "rounds" in d and "command" in d:
            s = d["summary"]
            rows = [[r["round"], num(r["round_time_s"], 1), num(r["train_loss"], 4)] for r in d["rounds"]]
            lines += [f"**{d['benchmark']}**", "", source(name, d), "",
                      f"Strategy run: `{s['strategy']}` ({s.get('strategy_note', '')}); peak RSS "
                      f"{gib(d.get('peak_rss_bytes'))}. {d.get('note', '')}", ""]
            lines += table(["round", "round s", "train loss"], rows)
    return lines


# ---- the papers ------------------------------------------------------------------------------------


def fedldf(results) -> list[str]:
    lines = []
    for name, d in family(results, "fedldf").items():
        p = d["protocol"]
        methods = list(dict.fromkeys(s["method"] for s in d["summary"]))
        settings = list(dict.fromkeys((s["dataset"], s["setting"]) for s in d["summary"]))
        by = {(s["dataset"], s["setting"], s["method"]): s for s in d["summary"]}
        rows = [[f"{ds}, {st}", *(num(100 * by[ds, st, m]["final_error"], 2, "%") for m in methods),
                 ", ".join(num(by[ds, st, m]["upload_vs_fedavg"], 3) for m in methods[1:])]
                for ds, st in settings]
        lines += [source(name, d), "",
                  f"N = {p['clients']}, K = {p['cohort']}, n = {p['n']}, {p['rounds']} rounds, seeds {p['seeds']} "
                  f"(mean). Final test error:", ""]
        lines += table(["data", *(label(m) for m in methods), "upload vs FedAvg (" + ", ".join(
            label(m) for m in methods[1:]) + ")"], rows)
    return lines


def fedspu(results) -> list[str]:
    lines = []
    for name, d in family(results, "fedspu").items():
        t = d["tables"]
        rows, methods = [], None
        for entry in t["table1_accuracy"] + t["table2_accuracy_es"]:
            methods = methods or list(entry["methods"])
            rows.append([entry["dataset"] + (", all +ES" if entry["early_stopping"] else ""),
                         *(num(entry["methods"].get(m, {}).get("mean"), 1) for m in methods),
                         f"{num(entry['fedspu_minus_best_baseline'], 2)} ({label(entry['best_baseline'])})"])
        s = inner = d["settings"]
        while isinstance(inner.get("settings"), list):  # merged files nest the settings of the files merged
            inner = inner["settings"][0]
        lines += [source(name, d), "",
                  f"N = {inner['clients']}, K = {inner['cohort']}, tiers {inner['tiers']}, α ∈ {inner['alphas']}, "
                  f"{inner['rounds']} rounds, {inner['local_epochs']} local epochs. Mean final personal accuracy (%) "
                  f"over the α values{' and the merged seeds' if 'merged_from' in s else ''}:", ""]
        lines += table(["data", *(label(m) for m in methods), "FedSPU − best dropout baseline"], rows)
        if t.get("table4_rounds"):
            lines += ["Early stopping (FedSPU+ES against FedSPU):", ""]
            lines += table(["data", "α", "rounds", "rounds with ES", "saved", "accuracy", "accuracy with ES"],
                           [[r["dataset"], r["alpha"], num(r["fedspu_rounds"], 1), num(r["fedspu_es_rounds"], 1),
                             num(100 * r["saved"], 1, "%"), num(r["fedspu_accuracy"], 1),
                             num(r["fedspu_es_accuracy"], 1)] for r in t["table4_rounds"]])
        if t.get("memory"):
            lines += ["Training memory per client, FedSPU against full-model training (weights + gradients + "
                      "activations, `fedpartial._src.costs.footprint`):", ""]
            lines += table(["data / model", "p", "reduction"],
                           [[f"{r['dataset']} / {r['model']}", r["p"], num(100 * r["reduction"], 1, "%")]
                            for r in t["memory"]])
        lines += [f"- {v}" for v in d.get("verdicts", [])] + [""]
    return lines


def embracingfl(results) -> list[str]:
    lines = []
    for name, d in family(results, "embracingfl").items():
        p = d["protocol"]
        if d["summary"]:
            methods = list(dict.fromkeys(s["method"] for s in d["summary"]))
            keys = list(dict.fromkeys((s["dataset"], s["experiment"], s["setting"]) for s in d["summary"]))
            by = {(s["dataset"], s["experiment"], s["setting"], s["method"]): s for s in d["summary"]}
            rows = [[ds, exp, setting, *(num((by.get((ds, exp, setting, m)) or {}).get("best_accuracy"), 3)
                                         for m in methods)] for ds, exp, setting in keys]
            lines += [source(name, d), "",
                      f"{p['clients']} clients (scale {p['scale']}), {p['rounds']} rounds of {p['steps']} local "
                      f"steps, seed {p['seed']}. Best test accuracy:", ""]
            lines += table(["data", "experiment", "clients", *(label(m) for m in methods)], rows)
        if d["costs"]:
            rows = [[c["model"], label(c["method"]), f"not measured: {c['error']}", "—", "—", "—", "—"]
                    if "error" in c else
                    [c["model"], label(c["method"]), c["tier"], num(c["flops_vs_strong"], 3),
                     num(c["time_vs_strong"], 3), num(c["memory_vs_strong"], 3),
                     num(c["prepare_flops_per_batch"] / 1e6, 0)] for c in d["costs"]]
            lines += [source(name, d), "", "One local step of batch 32, against the strong tier's:", ""]
            lines += table(["model", "method", "tier", "FLOPs", "time", "peak memory (XLA)",
                            "prefix MFLOPs per batch"], rows)
    return lines


def _seed_groups(runs: dict[str, dict]) -> dict[str, list[str]]:
    """Files that differ only by a trailing ``-seedN``, grouped (their summaries are averaged)."""
    groups: dict[str, list[str]] = {}
    for name in runs:
        groups.setdefault(re.sub(r"-seed\d+(?=\.json$)", "", name), []).append(name)
    return groups


def feddh_table(results, benchmark: str) -> list[str]:
    lines = []
    runs = family(results, benchmark)
    for names in _seed_groups(runs).values():
        entries = [s for n in names for s in runs[n]["summary"]]
        cols = list(dict.fromkeys((s["dataset"], s["model"]) for s in entries))
        methods = list(dict.fromkeys(s["method"] for s in entries))
        cell = {}
        for s in entries:
            cell.setdefault((s["dataset"], s["model"], s["method"]), []).append(s)

        def fmt(ss):
            if not ss:
                return "—"
            times = [s["time_to_target_s"] for s in ss]
            time = "never" if any(t is None for t in times) else num(statistics.mean(times), 0)
            return (f"{num(statistics.mean(s['final_accuracy'] for s in ss), 3)} / {time} / "
                    f"{num(statistics.mean(s['mflops_per_round'] for s in ss), 0)}")

        p = runs[names[0]]["protocol"]
        seeds = sorted({seed for s in entries for seed in s["seeds"]})
        epochs = p["local_epochs"] or "the setup's"
        lines += [line for n in names for line in (source(n, runs[n]), "")]
        lines += [f"N = {p['clients']}, K = {p['cohort']}, {p['rounds'] or 'the setup’s'} rounds, {epochs} local "
                  f"epochs, batch {p['batch_size']}; seeds {seeds}"
                  f"{' (mean over the files)' if len(names) > 1 else ''}. Each cell: final accuracy / simulated "
                  f"seconds to the target ({p['target_fraction']} × FedAvg's best) / MFLOPs of local work a round.",
                  ""]
        lines += table(["method", *(f"{ds} / {m}" for ds, m in cols)],
                       [[label(m), *(fmt(cell.get((ds, mo, m), [])) for ds, mo in cols)] for m in methods])
        for n in names:
            lines += [f"- `{n}`: {note}" for note in runs[n].get("notes", [])]
        lines += [""] + claims(runs, names)
    return lines


def claims(runs: dict[str, dict], names: list[str]) -> list[str]:
    """The paper's claims as the benchmark checked them (its ``claims`` records), one row per file and setting."""
    rows, header = [], None
    for n in names:
        for c in runs[n].get("claims", []):
            flat = {k: v for k, v in c.items() if not isinstance(v, (dict, list))}
            header = header or list(flat)
            rows.append([f"`{n}`", *(num(flat.get(k), 3) if isinstance(flat.get(k), float)
                                     else {True: "yes", False: "no"}.get(flat.get(k), flat.get(k))
                                     for k in header)])
    if not rows:
        return []
    return ["The paper's claims, as the benchmark checks them (differences are accuracy fractions, speed-ups "
            "ratios):", ""] + table(["file", *(k.replace("_", " ") for k in header)], rows)


def feddh(results) -> list[str]:
    return feddh_table(results, "feddh")


def feddhad(results) -> list[str]:
    return feddh_table(results, "feddhad")


# ---- pages -----------------------------------------------------------------------------------------

def deadlines(results) -> list[str]:
    """Time to accuracy under a deadline, with and without availability (docs/deadlines.md)."""
    lines = []
    for name, d in family(results, "deadlines").items():
        p = d["protocol"]
        lines += [source(name, d), "",
                  f"{p['clients']} clients, {p['cohort']} a round, {p['rounds']} rounds of {p['local_epochs']:g} local "
                  f"epoch on {p['dataset']} (model {p['model']}), seed {p['seed']}; deadline {p['deadline_s']:.3g} s "
                  f"(the population's median full-model round), policy {p['straggler_policy']}; availability "
                  f"`{p['availability']}`; target accuracy {p['target_accuracy']:.3f} ({p['target']:g} × the best of "
                  "FedAvg without a deadline). Time to target: the simulated clock at the first evaluation reaching "
                  "it.", ""]
        rows = [[label(r["method"]), r["setting"], num(r["final_accuracy"], 3), num(r["best_accuracy"], 3),
                 "not reached" if r["time_to_target_s"] is None else num(r["time_to_target_s"], 1, " s"),
                 num(r["clock_s"], 1, " s"), f"{r['reported']:.0%}", num(r["wasted_gflops"], 2),
                 num(r["wasted_mb"], 1), num(r["upload_mb"], 1)] for r in d["summary"]]
        lines += table(["method", "setting", "final accuracy", "best", "time to target", "clock at the end",
                        "sampled clients that reported", "wasted GFLOPs", "wasted MB", "upload MB"], rows)
    return lines


def asynchronous(results) -> list[str]:
    """Asynchronous against synchronous aggregation on the simulated clock (docs/async.md)."""
    lines = []
    for name, d in family(results, "async").items():
        p = d["protocol"]
        lines += [source(name, d), "",
                  f"{p['clients']} clients, {', '.join(p['datasets'])}, seeds {', '.join(map(str, p['seeds']))}; "
                  f"the reference is {p['rounds']} synchronous FedAvg rounds of {p['cohort']}; every other run gets "
                  f"its simulated time (at most {p['max_factor']:g}× its client updates). FedBuff: C = "
                  f"{p['concurrency']}, M = {p['buffer']}; FedAsync: C = {p['concurrency']}, M = 1; staleness "
                  f"`poly:0.5`. Target: {p['target']:g} × the reference's best accuracy; accuracy at the fixed clock: "
                  "the last evaluation at or before half the reference's last clock (a run that ended earlier: its "
                  "final one). Means over the seeds; a diverged run keeps its records up to the divergence. Wall "
                  "times on the shared CPU are indicative only.", ""]
        rows = [[r["dataset"], r["run"], "not reached" if r["time_to_target_s"] is None
                 else num(r["time_to_target_s"], 1, " s"), r["reached"], num(r["accuracy_at_fixed_clock"], 3),
                 num(r["final_accuracy"], 3), num(r["staleness_mean"], 2), num(r.get("client_updates"), 0),
                 str(r.get("diverged", 0)), num(r["wall_s"], 1, " s")] for r in d["summary"]]
        lines += table(["dataset", "run", "time to target", "seeds reaching it", "accuracy at the fixed clock",
                        "final accuracy", "mean staleness", "client updates", "seeds diverged", "wall"], rows)
    return lines


SECTIONS = (
    ("Execution strategies", "FedAvg rounds/s of every strategy beside a plain per-client Python loop of jitted "
     "steps, as the speed-up over that loop (Flower itself: the section against Flower + PyTorch). `python -m benchmarks.strategies`.",
     strategies),
    ("Two revisions compared", "The strategies benchmark run on two trees, interleaved. "
     "`python -m benchmarks.compare_revisions --before REV`.", compare_revisions),
    ("Throughput suite", "Every method and strategy next to the plain loop, in one process, taking turns round by "
     "round (medians). Memory is the GPU's peak in use or the CPU process's max RSS so far. `fedpartial bench`.",
     throughput),
    ("GPU scale", "The GPU plan's essentials: the 1,000-client CNN, VGG-9, the 10,000-client MLP.", gpu_scale),
    ("Where a conv step goes", "One local step of the whole cohort four ways: the plain loop's step K times, "
     "vmapped over the clients' own weights (the fused round's step: XLA makes its convs grouped), in "
     "`lax.map`, and one model's step on all K·B examples (the same FLOPs as ordinary convs). "
     "`python -m benchmarks.conv_probe`.", conv_probe),
    ("Convolution lowerings", "Every lowering of the models' convolutions (`--conv-impl`) under each strategy, "
     "against the plain loop (lax's convolution), FedAvg on random data of each row's shape; `(auto)` marks what "
     "`--conv-impl auto` picked for the row. `python -m benchmarks.conv_lowering`.", conv_lowering),
    ("Against Flower + PyTorch", "The same FedAvg rounds in Flower 1.42's simulation runtime (Ray, one actor per "
     "core, one torch thread each) and in fedpartial, the sides taking turns process by process (medians). "
     "`python -m benchmarks.peers` (needs `pip install -e \".[peers]\"`).", peers),
    ("Seeds and learning rates as replicas", "`--seeds` / `--lrs` / `--server-lrs` replicas in one jitted round "
     "against the same runs one after another. `python -m benchmarks.seeds`.", seeds),
    ("Data placement", "Host packing against gathering on the device, medians per round. "
     "`python -m benchmarks.data_placement`.", data_placement),
    ("On-device gather", "The cohort's batches gathered inside jit, with and without one very large client. "
     "`python -m benchmarks.gather`.", gather),
    ("Replica memory", "The replica round's memory estimate against the measured peak. "
     "`python -m benchmarks.replica_memory`.", replica_memory),
    ("Streamed strategies", "Peak memory and round time of the streamed layouts on a CPU. "
     "`python -m benchmarks.stream_conv`.", stream_conv),
    ("Large populations and cohorts", "Streaming, per-client state on host or disk, a million clients. "
     "`python -m benchmarks.scale`.", scale),
    ("Other runs", "Single measurements kept with their results.", other_runs),
    ("FedLDF", "See [the FedLDF reproduction](reproductions/fedldf.md).", fedldf),
    ("FedSPU", "See [the FedSPU reproduction](reproductions/fedspu.md).", fedspu),
    ("EmbracingFL", "See [the EmbracingFL reproduction](reproductions/embracingfl.md).", embracingfl),
    ("FedDH", "See [the FedDHAD reproduction](reproductions/feddhad.md).", feddh),
    ("FedDHAD", "See [the FedDHAD reproduction](reproductions/feddhad.md).", feddhad),
    ("Deadlines and availability", "See [Deadlines, stragglers and availability](deadlines.md). "
     "`python -m benchmarks.deadlines`.", deadlines),
    ("Personalised methods", "See [the method families side by side](reproductions/families.md). "
     "`python -m benchmarks.personalised`.", lambda r: render_families.personalised(r, "")),
    ("Capacity tiers", "See [the method families side by side](reproductions/families.md). "
     "`python -m benchmarks.tiers`.", lambda r: render_families.tiers(r, "")),
    ("Drift correction", "See [the method families side by side](reproductions/families.md). "
     "`python -m benchmarks.drift`.", lambda r: render_families.drift(r, "")),
    ("Asynchronous aggregation", "See [Asynchronous aggregation](async.md). `python -m benchmarks.async`.",
     asynchronous),
)


def catalogue(results) -> list[str]:
    """One row per result file; a figure (PNG) written beside it is named with it."""
    figures = sorted(p.name for p in RESULTS.glob("*.png"))
    rows = []
    for name, d in results.items():
        png = [f for f in figures if re.sub(r"-(curves|memory)(?=-)", "", f[:-4], count=1) == name[:-5]]
        rows.append([f"`{name}`" + "".join(f" (+ `{f}`)" for f in png), d.get("benchmark", "—"),
                     device_of(name, d), date_of(name, d), command_of(name, d)])
    return table(["file", "benchmark", "device", "date", "command"], rows)


#: a section with more table rows than this is shown folded (click to open)
LONG_TABLE_ROWS = 12


def render_page(results: dict[str, dict]) -> str:
    lines = ["# Benchmarks", "",
             "<!-- Generated by `python -m benchmarks.render_docs` from benchmarks/results/*.json: do not edit. -->",
             "",
             "How fast the execution strategies run against a plain per-client loop, on a CPU and on GPUs, and "
             "what the reproductions of the papers measure. Every number is read from a result file in "
             "`benchmarks/results/` (this page is written from them by `python -m benchmarks.render_docs`, and the "
             "test suite fails when it is out of date). Each table names its file, the device, the date and the "
             "command, as far as the file records them (where a file did not record its command line, the page says "
             "so, and rebuilds the command from the settings the file did record when it can; where it did not "
             "record its date, the page gives the day the file was committed, which the run was on or before). "
             "Times on the shared 2-core CPU are noisy; compare ratios measured in the same file, not seconds "
             "across files.", ""]
    lines += ["## At a glance", ""] + render_figures.at_a_glance()
    for title, intro, render in SECTIONS:
        body = render(results)
        if body:
            long = sum(line.startswith("|") for line in body) > LONG_TABLE_ROWS
            lines += [f"## {title}", "", intro, ""] + (
                render_figures.collapsible(f"{title}: the tables", body) if long else body)
    lines += ["## Every result file", "",
              "To measure again: every script in `benchmarks/` runs as `python -m benchmarks.<name>` (each section "
              "above names its own) and writes a JSON naming its device to `benchmarks/results/`; "
              "`python -m benchmarks.render_docs` then rewrites this page. `bash benchmarks/gpu_plan.sh list` lists "
              "the GPU measurements still to make, as steps that fit one run of at most ten minutes on one GPU "
              "each.", ""]
    lines += render_figures.collapsible("Every result file: the table", catalogue(results))
    return "\n".join(lines).rstrip() + "\n"


def latest(results, benchmark: str, platform: str) -> tuple[str, dict] | None:
    """The newest result file of ``benchmark`` on ``platform`` (``cpu``/``gpu``) that no later file supersedes."""
    found = [(date_of(n, d), n, d) for n, d in family(results, benchmark).items()
             if n not in SUPERSEDED and (_device_record(d) or {}).get("platform", "cpu" if "-cpu-" in n else "gpu")
             == platform]
    return max(found)[1:] if found else None


def auto_on_cpu(results) -> dict | None:
    """What ``auto`` ran on a CPU against the plain per-client loop, from the newest convolution-lowering file:
    ``{name, device, date, note, rows: [(model, input, K, picked, speed-up)]}``."""
    found = latest(results, "conv_lowering", "cpu")
    if found is None:
        return None
    name, d = found
    earlier = sorted(((date_of(n, e), n, e) for n, e in family(results, "conv_lowering").items()
                      if n != name and "-cpu-" in n), reverse=True)
    rows = []
    for r in d["results"]:
        auto = r.get("auto") or {}
        before = next(((f"`{n}`, {day}", (x.get("auto") or {}).get("speedup_vs_plain")) for day, n, e in earlier
                       for x in e["results"]
                       if x["row"] == r["row"] and x.get("dtype") == r.get("dtype")
                       and (x.get("auto") or {}).get("speedup_vs_plain")), (None, None))
        if auto.get("speedup_vs_plain") is not None and r.get("dtype", "float32") == "float32":
            shape = "×".join(map(str, r["input_shape"]))
            best = max(((n, c["speedup_vs_plain"]) for n, c in r["cells"].items()
                        if n != "plain_loop" and c.get("speedup_vs_plain")), key=lambda nc: nc[1])
            rows.append((r["model"], shape, r["cohort_size"], auto["cell"], auto["speedup_vs_plain"], *best, *before))
    return {"name": name, "device": device_of(name, d), "date": date_of(name, d), "note": d.get("note", ""),
            "rows": rows}


def speed_cpu(results) -> list[str]:
    """The CPU headline: ``auto`` against the plain loop, model by model, with its source."""
    cpu = auto_on_cpu(results)
    if cpu is None or not cpu["rows"]:
        return ["No CPU measurement of `auto` yet: run `python -m benchmarks.conv_lowering`."]
    low, high = min(r[4] for r in cpu["rows"]), max(r[4] for r in cpu["rows"])
    missed = [r for r in cpu["rows"] if r[6] > 1.25 * r[4]]
    return [f"**On a CPU** ({cpu['device']}, {cpu['date']}), the default `--strategy auto --conv-impl auto` ran "
            f"FedAvg at {low:.2f}× to {high:.2f}× the rounds per second of a plain per-client Python loop of jitted "
            f"steps, measured side by side in one run" + (f" ({cpu['note']})" if cpu["note"] else "") + ":", ""] + \
        table(["model", "input", "K", "auto ran", "× the plain loop", "fastest in the same run",
               "auto in an earlier run"],
              [[m, shape, k, f"`{cell}`", f"{s:.2f}×", f"`{best}` {b:.2f}×",
                "—" if quiet is None else f"{quiet:.2f}× ({earlier})"]
               for m, shape, k, cell, s, best, b, earlier, quiet in cpu["rows"]]) + \
        ([f"Where `auto` ran slower than the fastest cell ({', '.join(r[0] for r in missed)}): for a dense model "
          "`auto` takes `stepwise:1` without timing anything; for a conv model it times a few steps of each "
          "candidate once per model and cohort (then keeps the choice in the compile cache), so a busy machine can "
          "mislead it.", ""] if missed else []) + \
        [f"*Source:* `benchmarks/results/{cpu['name']}`."]


def speed_gpu(results) -> list[str]:
    """The GPU headline: the fused round (``auto`` on a GPU) against the plain loop, with its sources."""
    found = latest(results, "strategies", "gpu")
    if found is None:
        return ["No GPU measurement of the strategies yet."]
    name, d = found
    fused = [(r["model"], r["cohort_size"], m["speedup_vs_plain"]) for r in d["results"] for m in r["measurements"]
             if m["strategy"] == "fused" and m.get("speedup_vs_plain")]
    newest = {}  # (model, K) -> the newest default-precision GPU file's best runner
    for n, t in family(results, "throughput").items():
        if (t.get("device") or {}).get("platform") == "gpu" and not full_float32(n):
            for cell in t["results"]:
                best = max((r for r in cell.get("runners", []) if r["strategy"] != "plain_loop"
                            and r.get("ratio_to_plain")), key=lambda r: r["ratio_to_plain"], default=None)
                key = (cell["model"], cell["cohort_size"])
                if best and (key not in newest or date_of(n, t) >= newest[key][0]):
                    newest[key] = (date_of(n, t), t["device"]["device_kind"], best["strategy"],
                                   best["ratio_to_plain"])
    large = [(m, k, f"{s}, {dev}", x) for (m, k), (_, dev, s, x) in sorted(newest.items())]
    text = (f"**On a GPU** ({device_of(name, d)}), the fused round — what `auto` runs there — ran FedAvg at "
            f"{min(s for *_, s in fused):.1f}× to {max(s for *_, s in fused):.1f}× the plain loop "
            f"({', '.join(sorted({m for m, _, _ in fused}))}, K = "
            f"{' and '.join(str(k) for k in sorted({k for _, k, _ in fused}))}; `benchmarks/results/{name}`)")
    if large:
        text += "; with larger cohorts " + ", ".join(f"{m} K = {k:,} ({s}) {x:.1f}×" for m, k, s, x in large)
    return [text + "."]


def blocks(results: dict[str, dict]) -> dict[str, str]:
    """The generated blocks other pages embed, by name."""
    gpu = {n: d for n, d in family(results, "strategies").items() if "-gpu-" in n}
    headline = strategies(gpu) if gpu else ["No GPU measurement of the strategies yet."]
    speed = "\n".join(speed_cpu(results) + [""] + speed_gpu(results)).rstrip()
    return {"readme-headline": "\n".join(headline).rstrip(), "speed": speed,
            "readme-peers-summary": "\n".join(peers_summary(results)) or "No peer measurement yet: run "
                                    "`python -m benchmarks.peers`.",
            "readme-peers": "\n".join(peers(results)).rstrip() or "No peer measurement yet: run "
                            "`python -m benchmarks.peers`.",
            "readme-gpu-scale": "\n".join(gpu_scale(results)).rstrip() or "No GPU measurement of large cohorts yet.",
            "fedldf": _with_figures(fedldf(results), results, "fedldf"),
            "fedspu": _with_figures(fedspu(results), results, "fedspu"),
            "embracingfl": _with_figures(embracingfl(results), results, "embracingfl"),
            "feddh": _with_figures(feddh(results), results, "feddh"),
            "feddhad": _with_figures(feddhad(results), results, "feddhad"),
            "deadlines": _with_figures(deadlines(results), results, "deadlines", prefix="assets/benchmarks/")
            or "No result file yet: run `python -m benchmarks.deadlines`.",
            "async": _with_figures(asynchronous(results), results, "async", prefix="assets/benchmarks/")
            or "No result file yet: run `python -m benchmarks.async`.",
            "lora": render_lora.block(results, table, device_of, date_of, command_of, render_figures.figures_of,
                                      render_figures.figure_lines),
            "lora-speed": render_lora.speed_block(results, table, device_of, date_of, command_of),
            **render_families.blocks(results)}


def _with_figures(lines: list[str], results: dict[str, dict], benchmark: str,
                  prefix: str = "../assets/benchmarks/") -> str:
    """A block's tables followed by the figures its benchmark drew beside the same result files."""
    if not lines:
        return ""
    pngs = render_figures.figures_of(family(results, benchmark))
    return "\n".join(lines + ([""] + render_figures.figure_lines(pngs, prefix) if pngs else [])).rstrip()


def fill_blocks(text: str, generated: dict[str, str]) -> str:
    def replace(match):
        name = match.group("name")
        if name not in generated:
            raise KeyError(f"unknown generated block {name!r}")
        return f"{match.group(1)}\n{generated[name]}\n\n{match.group(3)}"
    return BLOCK.sub(replace, text)


def outputs(root: pathlib.Path = ROOT) -> dict[pathlib.Path, str | bytes]:
    """Every page this script writes, with the text it should hold, and the figures they show (bytes)."""
    results = load_results()
    generated = blocks(results)
    pages: dict[pathlib.Path, str | bytes] = {PAGE: render_page(results)}
    for rel in BLOCK_PAGES:
        path = root / rel
        if path.exists():
            pages[path] = fill_blocks(path.read_text(), generated)
    return {**pages, **render_figures.copies(render_figures.used(pages.values()))}


def _holds(path: pathlib.Path, content: str | bytes) -> bool:
    if not path.exists():
        return False
    return path.read_bytes() == content if isinstance(content, bytes) else path.read_text() == content


def stale(root: pathlib.Path = ROOT) -> list[str]:
    """The pages (and figure copies) whose committed content differs from what this script renders, and the
    family pages' figures that are missing or differ from their result's."""
    pages = [str(p.relative_to(root)) for p, content in outputs(root).items() if not _holds(p, content)]
    shown = render_families.figures(load_results())
    return pages + [str(copy.relative_to(root)) for copy, png in shown.items()
                    if not copy.exists() or copy.read_bytes() != png.read_bytes()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 when a committed page differs; write nothing")
    args = p.parse_args(argv)
    if args.check:
        differ = stale()
        if differ:
            print("out of date (run python -m benchmarks.render_docs): " + ", ".join(differ), file=sys.stderr)
            return 1
        return 0
    for path, content in outputs().items():
        if not _holds(path, content):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
            print(f"wrote {path.relative_to(ROOT)}")
    for copy, png in render_families.figures(load_results()).items():  # the figures the pages show
        if not copy.exists() or copy.read_bytes() != png.read_bytes():
            copy.parent.mkdir(parents=True, exist_ok=True)
            copy.write_bytes(png.read_bytes())
            print(f"wrote {copy.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
