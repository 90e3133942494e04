"""Load time and memory of a FEMNIST-sized LEAF population (3,500 writers), ragged against padded.

Writes LEAF-format FEMNIST files of the real data set's shape into ``--dir`` (not kept in the repository):
3,500 writers of 28x28 images stored as 784 floats, 100 writers a file as LEAF's ``data_to_json.py`` writes
them, each writer's examples split 90/10 into ``train/`` and ``test/`` as LEAF's ``split_data.py`` does.
Writer sizes are lognormal around LEAF's mean of ~230 examples, from 10 to 1,000. Pixels are LEAF's: grey
values k/255 with a white background of 1.0 (about 80% of the pixels) and darker strokes.

Then loads them with ``--dataset leaf`` in a fresh process (what ``fedpartial run --dataset leaf`` does
first) and records the load time, the process's peak resident memory, the ragged arrays' bytes, what a
padded ``[N, max_examples, 28, 28, 1]`` float32 array would take, and the time to pack a cohort of 10
clients from the population.

  python -m benchmarks.leaf_population --dir /tmp/leaf-femnist-full
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
import time

import numpy as np

from fedpartial._src.bench.provenance import stamp

WRITERS, PER_FILE, TRAIN_FRACTION = 3500, 100, 0.9


def writer_sizes(seed: int = 0) -> np.ndarray:
    """Lognormal sizes with a mean near 230, clipped to [10, 1000]; one writer at each end."""
    rng = np.random.default_rng(seed)
    sizes = np.clip(np.rint(rng.lognormal(np.log(205), 0.5, WRITERS)), 10, 1000).astype(int)
    sizes[0], sizes[1] = 10, 1000
    return sizes


def generate(folder: pathlib.Path, seed: int = 0) -> dict:
    sizes = writer_sizes(seed)
    rng = np.random.default_rng([seed, 1])
    for split in ("train", "test"):
        (folder / split).mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    for f, first in enumerate(range(0, WRITERS, PER_FILE)):
        parts = {"train": {}, "test": {}}
        for w in range(first, min(WRITERS, first + PER_FILE)):
            n = int(sizes[w])
            ink = rng.random((n, 784)) < 0.2
            pixels = np.where(ink, rng.integers(0, 255, (n, 784)) / 255.0, 1.0)
            labels = rng.integers(0, 62, n)
            n_train = max(1, int(TRAIN_FRACTION * n))
            name = f"f{w:04d}_{w % 100:02d}"
            parts["train"][name] = (pixels[:n_train].tolist(), labels[:n_train].tolist())
            parts["test"][name] = (pixels[n_train:].tolist(), labels[n_train:].tolist())
        for split, users in parts.items():
            data = {"users": list(users), "num_samples": [len(y) for _, y in users.values()],
                    "user_data": {u: {"x": x, "y": y} for u, (x, y) in users.items()}}
            with open(folder / split / f"all_data_{f}_niid_0_keep_0_{split}_9.json", "w") as out:
                out.write(json.dumps(data))  # dumps: the C encoder (dump to a file runs the Python one)
    files = list(folder.rglob("*.json"))
    return {"writers": WRITERS, "examples": int(sizes.sum()), "min_examples": int(sizes.min()),
            "max_examples": int(sizes.max()), "mean_examples": float(sizes.mean()),
            "files": len(files), "bytes_on_disk": int(sum(p.stat().st_size for p in files)),
            "generate_s": round(time.perf_counter() - start, 1)}


_LOAD = r"""
import json, resource, sys, time
import numpy as np
from fedpartial._src.data.leaf import load_leaf
from fedpartial._src.data.packing import pack_cohort, max_steps
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
start = time.perf_counter()
ds = load_leaf(sys.argv[1])
load_s = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
sizes = np.array([len(p) for p in ds.natural_partition])
ids = np.random.default_rng(0).choice(len(sizes), 10, replace=False)
steps = max_steps(np.unique(sizes), 32, local_steps=None, local_epochs=1.0)
start = time.perf_counter()
pack_cohort(ds.x_train, ds.y_train, [ds.natural_partition[i] for i in ids], batch_size=32, num_steps=steps,
            local_epochs=1.0, seed=0)
pack_s = time.perf_counter() - start
print(json.dumps({"clients": len(sizes), "train_examples": int(len(ds.y_train)), "test_examples": int(len(ds.y_test)),
                  "load_s": round(load_s, 1), "rss_before_load_bytes": before, "peak_rss_bytes": peak,
                  "ragged_bytes": int(ds.x_train.nbytes + ds.y_train.nbytes + ds.x_test.nbytes + ds.y_test.nbytes),
                  "padded_train_bytes": int(len(sizes) * sizes.max() * 784 * 4),
                  "max_train_examples": int(sizes.max()), "pack_cohort_10_s": round(pack_s, 3)}))
"""


def describe(folder: pathlib.Path) -> dict:
    """What files generated before hold (their users and counts, from each file's head)."""
    from fedpartial._src.data.leaf import _header

    files = sorted(folder.rglob("*.json"))
    train = [n for p in files if p.parent.name == "train" for n in _header(str(p))["num_samples"]]
    test = [n for p in files if p.parent.name == "test" for n in _header(str(p))["num_samples"]]
    sizes = np.add(train, test)
    return {"writers": len(train), "examples": int(sizes.sum()), "min_examples": int(sizes.min()),
            "max_examples": int(sizes.max()), "mean_examples": float(sizes.mean()), "files": len(files),
            "bytes_on_disk": int(sum(p.stat().st_size for p in files))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.leaf_population")
    parser.add_argument("--dir", required=True, help="where the generated LEAF files go (not kept)")
    parser.add_argument("--out", default="benchmarks/results/leaf-population-cpu.json")
    parser.add_argument("--skip-generate", action="store_true", help="load files generated before")
    args = parser.parse_args(argv)
    folder = pathlib.Path(args.dir)
    report = {"device": f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores shared)",
              "data": generate(folder) if not args.skip_generate else describe(folder)}
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    done = subprocess.run([sys.executable, "-c", _LOAD, str(folder)], capture_output=True, text=True, env=env)
    if done.returncode:
        print(done.stderr, file=sys.stderr)
        return done.returncode
    report["load"] = json.loads(done.stdout.strip().splitlines()[-1])
    load = report["load"]
    load["padded_over_ragged"] = round(load["padded_train_bytes"] / (load["train_examples"] * 784 * 4), 2)
    pathlib.Path(args.out).write_text(json.dumps(stamp(report, argv), indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
