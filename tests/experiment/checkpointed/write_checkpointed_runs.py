"""Writes the run folders beside this file (with the test suite's XLA flags, tests/conftest.py, and the code of the version whose checkpoints they are, once):
``XLA_FLAGS="--xla_cpu_use_fusion_emitters=false --xla_backend_optimization_level=1" python tests/experiment/checkpointed/write_checkpointed_runs.py OUT`` then copy OUT/sync and OUT/async here, and
OUT/sync-whole/metrics.jsonl as sync-uninterrupted.jsonl (async likewise).  Each is the tiny run stopped by SIGTERM
after round 2 of 3 with its checkpoint of round 2."""
import os, signal, sys
from fedpartial._src.experiment import signals
from fedpartial._src.experiment.config import RunConfig
import fedpartial as fp
out = sys.argv[1]
TINY = dict(dataset="digits", model="mlp", num_clients=6, cohort_size=3, rounds=3, local_steps=2, batch_size=8)
def stop_at_2(record):
    if record["round"] == 2:
        os.kill(os.getpid(), signal.SIGTERM)
for name, extra in [("sync", {}), ("async", dict(mode="async", concurrency=3, buffer=2))]:
    cfg = RunConfig(**TINY, **extra, out_dir=out, run_name=name)
    try:
        fp.run(cfg, on_round=stop_at_2, checkpoint_every=5)
    except signals.RunInterrupted as e:
        print(name, "stopped", e.summary["run_dir"])
    cfg = RunConfig(**TINY, **extra, out_dir=out, run_name=name + "-whole")
    fp.run(cfg)
