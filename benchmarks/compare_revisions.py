"""Run the strategies benchmark on two revisions of the engine, interleaved, in one run.

Usage::

    python -m benchmarks.compare_revisions --before REV [--after WORKTREE_OR_REV] [--repeats N]
        [--out PATH] [strategies.py args: --quick --models mlp --cohorts 4 --skip fused_unrolled ...]

``--before`` is a git revision; it is checked out with ``git worktree add --detach`` into a
temporary directory that is removed at the end (also on error).  ``--after`` defaults to the
working tree this script lives in, uncommitted changes included; it may be another directory
(a working tree) or a revision (then a second temporary worktree).  Each run is
``python -m benchmarks.strategies --out TMP ARGS`` as a subprocess with ``cwd`` and
``PYTHONPATH`` set to its tree (checked: ``fedpartial.__file__`` must lie in that tree), in
the order before, after, before, after, ... (``--repeats`` pairs), so slow drift of the
machine hits both sides.  Both sides run the *after* tree's ``benchmarks/strategies.py``
and ``fedpartial/_src/bench/kit.py`` (copied into the before tree), so the measuring code is the same.

For every (model, K, strategy) the report has the median rounds/s of each side, the ratio
after/before, and each side's median speed-up over the plain loop.  It prints a table and
writes JSON (default ``benchmarks/results/compare-<before>-vs-<after>-<device>.json``).
The exit status is 1 when a run fails (its stderr tail is printed; the other runs go on).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from fedpartial._src.bench.provenance import stamp

HERE = Path(__file__).resolve().parent
BENCH = Path("benchmarks") / "strategies.py"
#: strategies.py's measuring pieces, copied with it: where this layout keeps them, then where the flat layout did
KITS = (Path("fedpartial") / "_src" / "bench" / "kit.py", Path("fedpartial") / "benchkit.py")


def git(*args: str, cwd: Path) -> str:
    proc = subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"git {' '.join(args)}: {proc.stderr.strip()}")
    return proc.stdout.strip()


def slug(text: str) -> str:  # as benchmarks.strategies names devices
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


class Trees:
    """The two source trees; temporary worktrees are removed by :meth:`close`."""

    def __init__(self, root: Path):
        self.root, self.temp = root, []

    def from_rev(self, rev: str, side: str) -> dict:
        commit = git("rev-parse", "--verify", f"{rev}^{{commit}}", cwd=self.root)
        path = Path(tempfile.mkdtemp(prefix=f"fedpartial-{side}-"))
        self.temp.append(path)
        git("worktree", "add", "--detach", str(path), commit, cwd=self.root)
        short = git("rev-parse", "--short", commit, cwd=self.root)
        return {"path": path, "revision": rev, "commit": commit, "label": short}

    def from_dir(self, path: Path) -> dict:
        if not (path / ".git").exists():  # an exported tree (e.g. copied to a machine without git)
            stamp = path / "REVISION"
            revision = stamp.read_text().strip() if stamp.exists() else "working tree"
            label = "worktree" if path == self.root else slug(revision[:12])
            return {"path": path, "revision": revision, "commit": revision, "label": label}
        diff = git("diff", "HEAD", "--stat", cwd=path).splitlines()
        untracked = git("ls-files", "--others", "--exclude-standard", cwd=path).splitlines()
        label = "worktree" if path == self.root else slug(path.name)
        return {"path": path, "revision": "working tree", "commit": git("rev-parse", "HEAD", cwd=path),
                "label": label, "diff_stat": diff[-1].strip() if diff else "clean",
                "diff_stat_files": [line.strip() for line in diff[:-1]], "untracked_files": untracked}

    def close(self) -> None:
        for path in self.temp:
            try:
                git("worktree", "remove", "--force", str(path), cwd=self.root)
            except SystemExit:
                shutil.rmtree(path, ignore_errors=True)
                subprocess.run(["git", "-C", str(self.root), "worktree", "prune"], capture_output=True)


def tree_env(path: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(path)}


def check_import(tree: dict) -> None:
    """``import fedpartial`` in the tree's subprocess must load that tree's package."""
    code = "import fedpartial; print(fedpartial.__file__)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=tree["path"], env=tree_env(tree["path"]),
                          capture_output=True, text=True)
    if proc.returncode != 0:  # a broken tree: its runs will fail and be reported
        tree["fedpartial_file"] = None
        return
    out = tree["fedpartial_file"] = proc.stdout.strip().splitlines()[-1]
    if not Path(out).resolve().is_relative_to(Path(tree["path"]).resolve()):
        raise SystemExit(f"fedpartial in {tree['path']} resolves to {out}, not to that tree")


def run_once(tree: dict, passthrough: list[str], out: Path) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.strategies", "--out", str(out), *passthrough]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=tree["path"], env=tree_env(tree["path"]), capture_output=True, text=True)
    run = {"returncode": proc.returncode, "wall_s": time.perf_counter() - start}
    if out.exists():
        run["report"] = json.loads(out.read_text())
    if proc.returncode != 0 or not run.get("report", {}).get("complete"):
        run["stderr_tail"] = proc.stderr[-3000:]
    return run


def summarize(runs: dict[str, list[dict]]) -> list[dict]:
    """Median rounds/s and speed-up vs the plain loop per (model, K, strategy), and after/before."""
    fields = ("rounds_per_s", "speedup_vs_plain")
    values: dict[tuple, dict] = {}
    for side, side_runs in runs.items():
        for run in side_runs:
            for rec in run.get("report", {}).get("results", []):
                for m in rec["measurements"]:
                    if m.get("skipped"):
                        continue
                    row = values.setdefault((rec["model"], rec["cohort_size"], m["strategy"]), {})
                    for field in fields:
                        if m.get(field):
                            row.setdefault(f"{side}_{field}", []).append(m[field])
                    if m.get("error"):
                        row.setdefault(f"{side}_errors", []).append(m["error"])
    rows = []
    for (model, k, strategy), row in values.items():
        out = {"model": model, "cohort_size": k, "strategy": strategy}
        for side in runs:
            for field in fields:
                samples = out[f"{side}_{field}"] = row.get(f"{side}_{field}", [])
                out[f"{side}_{field}_median"] = statistics.median(samples) if samples else None
            out[f"{side}_errors"] = row.get(f"{side}_errors", [])
        b, a = out["before_rounds_per_s_median"], out["after_rounds_per_s_median"]
        out["after_over_before"] = a / b if a and b else None
        rows.append(out)
    return rows


def table(rows: list[dict], before: dict, after: dict, repeats: int) -> str:
    def cell(r, side, field, spec):
        v = r[f"{side}_{field}_median"]
        return ("error" if r[f"{side}_errors"] else "-") if v is None else format(v, spec)

    lines = [f"before = {before['label']} ({before['revision']}), after = {after['label']} "
             f"({after['revision']}); medians of {repeats} run(s) each"]
    head = (f"{'strategy':<16}{'before r/s':>12}{'after r/s':>12}{'after/before':>14}"
            f"{'before vs plain':>17}{'after vs plain':>16}")
    config = None
    for r in rows:
        if (r["model"], r["cohort_size"]) != config:
            config = (r["model"], r["cohort_size"])
            lines += ["", f"{r['model']}  K={r['cohort_size']}", head, "-" * len(head)]
        ratio = "-" if r["after_over_before"] is None else f"{r['after_over_before']:.3f}x"
        lines.append(f"{r['strategy']:<16}{cell(r, 'before', 'rounds_per_s', '.4g'):>12}"
                     f"{cell(r, 'after', 'rounds_per_s', '.4g'):>12}{ratio:>14}"
                     f"{cell(r, 'before', 'speedup_vs_plain', '.2f'):>17}"
                     f"{cell(r, 'after', 'speedup_vs_plain', '.2f'):>16}")
    for r in rows:
        for side in ("before", "after"):
            for error in sorted(set(r[f"{side}_errors"])):
                lines.append(f"{side} {r['model']} K={r['cohort_size']} {r['strategy']}: error: {error[:150]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compare_revisions", allow_abbrev=False,
                                description=__doc__.split("\n")[0],
                                epilog="Other arguments go to python -m benchmarks.strategies (e.g. --quick).")
    p.add_argument("--before", required=True,
                   help="git revision to compare against, or a directory holding an exported tree "
                        "(`git archive REV | tar -x -C DIR`, with the revision in DIR/REVISION)")
    p.add_argument("--after", help="working-tree directory or git revision (default: this working tree)")
    p.add_argument("--repeats", type=int, default=2, help="before/after pairs, interleaved (default 2)")
    p.add_argument("--out", help="JSON path (default benchmarks/results/compare-<before>-vs-<after>-<device>.json)")
    args, passthrough = p.parse_known_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    root = HERE.parent.resolve()
    trees = Trees(root)
    try:
        if Path(args.before).is_dir():
            before = trees.from_dir(Path(args.before).resolve())
        else:
            before = trees.from_rev(args.before, "before")
        if args.after is None or Path(args.after).is_dir():
            after = trees.from_dir(Path(args.after or root).resolve())
        else:
            after = trees.from_rev(args.after, "after")
        code = (after["path"] / BENCH).read_bytes()
        copied = (before["path"] / BENCH).read_bytes() != code if (before["path"] / BENCH).exists() else True
        if copied:
            (before["path"] / BENCH).parent.mkdir(exist_ok=True)
            (before["path"] / BENCH).write_bytes(code)
            (before["path"] / "benchmarks" / "__init__.py").touch()
        kit = next((after["path"] / k for k in KITS if (after["path"] / k).exists()), None)
        if kit is not None:  # into whichever layout the before tree has (strategies.py imports either)
            target = next((before["path"] / k for k in KITS if (before["path"] / k).exists()), None)
            if target is not None:
                target.write_bytes(kit.read_bytes())
        for tree in (before, after):
            check_import(tree)
        runs: dict[str, list[dict]] = {"before": [], "after": []}
        status = 0
        with tempfile.TemporaryDirectory(prefix="compare-revisions-") as tmp:
            for i in range(args.repeats):
                for side, tree in (("before", before), ("after", after)):
                    print(f"run {i + 1}/{args.repeats} {side} ({tree['label']}) ...", file=sys.stderr, flush=True)
                    run = run_once(tree, passthrough, Path(tmp) / f"{side}-{i}.json")
                    runs[side].append(run)
                    print(f"  exit {run['returncode']} after {run['wall_s']:.1f}s", file=sys.stderr, flush=True)
                    if run["returncode"] != 0 or "report" not in run:
                        status = 1
                        print(f"RUN FAILED: {side} run {i + 1}, exit {run['returncode']}; stderr tail:\n"
                              f"{run.get('stderr_tail', '')}", file=sys.stderr, flush=True)
        rows = summarize(runs)
        print(table(rows, before, after, args.repeats))
        devices = [r["report"]["device"] for side in runs.values() for r in side if "report" in r]
        device = devices[0] if devices else {"backend": "unknown", "device_kind": "unknown"}
        out = Path(args.out or HERE / "results" / f"compare-{before['label']}-vs-{after['label']}-"
                   f"{device['backend']}-{slug(device['device_kind'])}.json")
        clean = lambda t: {k: str(v) if isinstance(v, Path) else v for k, v in t.items()}  # noqa: E731
        report = {
            "benchmark": "compare_revisions", "before": clean(before), "after": clean(after),
            "measurement_code": {"file": str(BENCH), "from": "after", "sha256": hashlib.sha256(code).hexdigest(),
                                 "copied_into_before": copied},
            "platform": {"device": device, "same_device_all_runs": all(d == device for d in devices),
                         "node": platform.node(), "platform": platform.platform(),
                         "processor": platform.processor(), "cpu_count": os.cpu_count(),
                         "python": sys.executable, "python_version": platform.python_version()},
            "passthrough_args": passthrough, "repeats": args.repeats, "order": "before, after, interleaved",
            "runs": runs,
            "comparison": rows,
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(stamp(report), indent=2))
        print(f"wrote {out}")
        return status
    finally:
        trees.close()


if __name__ == "__main__":
    sys.exit(main())
