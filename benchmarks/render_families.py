"""The method families' tables and figures for the docs (:mod:`benchmarks.render_docs` calls these): the
personalised methods, the capacity tiers and drift correction (``benchmarks/personalised.py``, ``tiers.py``,
``drift.py``), each with the papers' orderings checked on the numbers of the file.

Each result file's figure (the PNG beside its JSON) is copied to ``docs/assets/benchmarks/`` so the site can
show it; :func:`figures` lists the copies, and ``render_docs --check`` fails when one is missing or stale.
"""

from __future__ import annotations

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
ASSETS = ROOT / "docs" / "assets" / "benchmarks"
FAMILIES = ("personalised", "tiers", "drift")


def _family(results: dict, benchmark: str) -> dict:
    return {n: d for n, d in results.items() if d.get("benchmark") == benchmark}


def figures(results: dict) -> dict[pathlib.Path, pathlib.Path]:
    """Every family file's figure: its copy under ``docs/assets/benchmarks/`` -> the PNG in the results."""
    out = {}
    for benchmark in FAMILIES:
        for name in _family(results, benchmark):
            png = RESULTS / (name[:-5] + ".png")
            if png.exists():
                out[ASSETS / png.name] = png
    return out


def _source(name: str, d: dict) -> str:
    dev = d.get("device", {})
    kind = "CPU" if dev.get("platform") == "cpu" else dev.get("device_kind", "?")
    cores = f" ({dev['cpu_count']} cores)" if dev.get("platform") == "cpu" and dev.get("cpu_count") else ""
    return (f"*Source:* `benchmarks/results/{name}` · device: {kind}{cores}, jax {dev.get('jax_version')} · date: "
            f"{d.get('date', '?')[:10]} · revision: `{d.get('git_revision')}` · command: `{d.get('command')}`")


def _provenance(name: str, d: dict, figure_prefix: str) -> list[str]:
    s = d["settings"]
    lines = [_source(name, d), "",
             f"N = {s['clients']}, K = {s['cohort']}, {s['rounds']} rounds, seeds {s['seeds']} (run together as "
             f"replicas); {len(d['rows'])} rows measured in {d.get('total_time_s', 0) / 60:.1f} min of wall time "
             f"({d.get('total_cpu_s', 0) / 60:.1f} min of CPU time).", ""]
    png = RESULTS / (name[:-5] + ".png")
    if png.exists():
        lines += [f"![{d['benchmark']}: {name}]({figure_prefix}assets/benchmarks/{png.name})", ""]
    return lines + [f"- {n}" for n in d.get("notes", [])] + ([""] if d.get("notes") else [])


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return (["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
            + ["| " + " | ".join(map(str, r)) + " |" for r in rows] + [""])


def _pct(x, digits: int = 1) -> str:
    return "—" if x is None else f"{100 * x:.{digits}f}"


def _order(values: dict, names: tuple[str, ...], labels: dict) -> str:
    """Whether ``values`` (method -> accuracy) are in the order ``names`` (each at least the next): yes / no."""
    if not all(n in values for n in names):
        return "not measured"
    held = all(values[a] >= values[b] for a, b in zip(names, names[1:]))
    shown = ", ".join(f"{labels[n]} {100 * values[n]:.1f}" for n in names)
    return ("yes" if held else "no") + f" ({shown})"


def personalised(results: dict, figure_prefix: str = "../") -> list[str]:
    from benchmarks.personalised import LABELS, METHODS

    lines = []
    for name, d in _family(results, "personalised").items():
        rows = d["rows"]
        cols = list(dict.fromkeys((r["dataset"], r["alpha"]) for r in rows))
        by = {(r["dataset"], r["alpha"], r["method"]): r for r in rows}
        def cell(r):
            return "—" if r is None else f"{_pct(r['personal_accuracy'])} ± {_pct(r['personal_accuracy_std'])}"

        body = [[LABELS[m], *(cell(by.get(c + (m,))) for c in cols)]
                for m in METHODS if any(c + (m,) in by for c in cols)]
        lines += _provenance(name, d, figure_prefix)
        lines += ["Personalised accuracy (%): each client's own model on its held-out split, mean ± std over the "
                  "clients of every seed.", ""]
        lines += _table(["method", *(f"{ds}, α={a}" for ds, a in cols)], body)
        claims = [[f"{ds}, α={a}", _order({m: by[ds, a, m]["personal_accuracy"] for m in METHODS if (ds, a, m) in by},
                                          ("fedrep", "fedper", "lgfedavg"), LABELS)] for ds, a in cols]
        lines += ["FedRep's paper: FedRep > FedPer > LG-FedAvg on label skew. Measured:", ""]
        lines += _table(["data", "FedRep ≥ FedPer ≥ LG-FedAvg"], claims)
    return lines


def tiers(results: dict, figure_prefix: str = "../") -> list[str]:
    from benchmarks.tiers import LABELS

    lines = []
    for name, d in _family(results, "tiers").items():
        rows = d["rows"]
        body = [[f"{r['dataset']}, α={r['alpha']}", f"{r['case']} {tuple(r['mix'])}", r["label"],
                 f"{_pct(r['test_accuracy'])} ± {_pct(r['test_accuracy_std'])}",
                 _pct(r["weak_accuracy"]) + (f" (exit 1: {_pct(r['weak_exit_accuracy'])})"
                                             if r.get("weak_exit_accuracy") is not None else ""),
                 f"{r['upload_mb_per_round']:.3f}", f"{r['simulated_s_per_round']:.2f}"] for r in rows]
        lines += _provenance(name, d, figure_prefix)
        lines += ["Global accuracy: the final global model on the test set (± std over seeds); weak clients': the "
                  "global model on the weak clients' held-out splits (for the depth methods also the shallowest "
                  "exit on the test set); upload and simulated time: means per round.", ""]
        lines += _table(["data", "case (S, M, W)", "method", "global acc %", "weak clients' acc %", "upload MB/round",
                         "simulated s/round"], body)
        settings = list(dict.fromkeys((r["dataset"], r["alpha"], r["case"]) for r in rows))
        claims = []
        for ds, a, case in settings:
            acc = {r["method"]: r["test_accuracy"] for r in rows
                   if (r["dataset"], r["alpha"], r["case"]) == (ds, a, case)}
            claims.append([f"{ds}, α={a}, case {case}", _order(acc, ("depthfl", "heterofl"), LABELS),
                           _order(acc, ("fedrolex", "heterofl"), LABELS)])
        lines += ["DepthFL's paper: DepthFL ≥ HeteroFL at equal budget; FedRolex's: FedRolex ≥ HeteroFL. Measured "
                  "(global accuracy):", ""]
        lines += _table(["setting", "DepthFL ≥ HeteroFL", "FedRolex ≥ HeteroFL"], claims)
    return lines


def drift(results: dict, figure_prefix: str = "../") -> list[str]:
    lines = []
    for name, d in _family(results, "drift").items():
        body = [[f"{r['dataset']}, α={r['alpha']}", r["label"], f"{_pct(r['test_accuracy'])} ± "
                 f"{_pct(r['test_accuracy_std'])}", _pct(r["best_accuracy"]), f"{r['mb_per_round']:.3f}",
                 f"{r['total_mb']:.1f}"] for r in d["rows"]]
        lines += _provenance(name, d, figure_prefix)
        lines += ["Test accuracy of the global model (final ± std over seeds, and the best evaluation); bytes are "
                  "upload plus download.", ""]
        lines += _table(["data", "method", "final acc %", "best acc %", "MB/round", "total MB"], body)
        claims = [[f"{c['dataset']}, α={c['alpha']}", ("yes" if c["scaffold_minus_fedavg"] >= 0 else "no")
                   + f" ({100 * c['scaffold_minus_fedavg']:+.1f} points)", _pct(c["fedavg_final"]),
                   _pct(c["scaffold_at_fedavg_bytes"])] for c in d.get("claims", [])]
        if claims:
            lines += ["SCAFFOLD's paper: SCAFFOLD ≥ FedAvg at low α. Measured, per round and per byte (SCAFFOLD's "
                      "accuracy when it had sent what FedAvg sent in its whole run):", ""]
            lines += _table(["data", "SCAFFOLD ≥ FedAvg (final)", "FedAvg final %", "SCAFFOLD at FedAvg's bytes %"],
                            claims)
    return lines


def fedrolex_scaler(results: dict) -> list[str]:
    """``benchmarks/fedrolex_scaler.py``: HeteroFL and FedRolex as the tiers benchmark runs them, without the
    Scaler, and at a lower learning rate; accuracy, the weak tier's loss and the dead conv channels."""
    from benchmarks.tiers import LABELS

    lines = []
    for name, d in _family(results, "fedrolex_scaler").items():
        s, groups = d["settings"], {}
        for r in d["rows"]:
            groups.setdefault((r["case"], r["variant"], r["method"]), []).append(r)
        lines += [_source(name, d), "", f"The tiers benchmark's digits setting, {s['rounds']} rounds, one run per "
                  f"seed {s['seeds']}; {len(d['rows'])} runs in {d.get('total_time_s', 0) / 60:.1f} min of wall "
                  f"time. Weak loss: the weak tier's mean training loss over the last 10 rounds (ln 10 = 2.30 is a "
                  f"constant guess) and the dead conv channels of the final global model (ReLU output zero on "
                  f"every one of {s['images']} training images) are given per seed.", ""]
        body = []
        for (case, variant, method), rows in groups.items():
            acc = [r["test_accuracy"] for r in rows]
            weak = "; ".join(f"{sum(r['weak_train_loss'][-10:]) / len(r['weak_train_loss'][-10:]):.2f}" for r in rows)
            dead = ["; ".join(f"{len(r['dead'][layer])}/{r['units'][layer]}" for r in rows)
                    for layer in ("conv1", "conv2")]
            mean = sum(acc) / len(acc)
            std = (sum((a - mean) ** 2 for a in acc) / len(acc)) ** 0.5
            body.append([case, variant, LABELS[method], f"{_pct(mean)} ± {_pct(std)}", weak, *dead])
        lines += _table(["case", "variant", "method", "final acc %", "weak loss", "dead conv1", "dead conv2"], body)
    return lines


def blocks(results: dict) -> dict[str, str]:
    """The generated blocks of ``docs/reproductions/families.md``."""
    commands = {"personalised": "python -m benchmarks.personalised", "tiers": "python -m benchmarks.tiers",
                "drift": "python -m benchmarks.drift", "fedrolex-scaler": "python -m benchmarks.fedrolex_scaler"}
    sized = " (`--size cpu`, the default)"
    return {f"families-{f}": "\n".join(render(results)).rstrip()
            or f"No result file yet: run `{commands[f]}`{'' if f == 'fedrolex-scaler' else sized} and then "
               "`python -m benchmarks.render_docs`."
            for f, render in (("personalised", personalised), ("tiers", tiers), ("drift", drift),
                              ("fedrolex-scaler", fedrolex_scaler))}
