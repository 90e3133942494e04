"""One process of a multi-process run (or the one-process reference); prints the final parameters as JSON.

``python -m tests.engine.multihost_case PORT PROCESS_ID NUM_PROCESSES OUT`` joins ``jax.distributed`` at
``localhost:PORT`` (each process with its own fake CPU devices: set ``XLA_FLAGS``), runs with a
checkpoint every round into its own run directory under ``OUT``, then resumes that directory
from round 1 (the newest checkpoint removed, as if killed after round 1) and reports both
final models.  With no arguments it runs the same experiment in one process on one device,
without writing anything.  Started by ``tests/engine/test_sharding.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import jax
import numpy as np

CONFIG = dict(dataset="synthetic", model="mlp", num_clients=10, cohort_size=6, rounds=2, local_steps=2,
              batch_size=8, eval_every=2, out_dir=None, strategy="fused", method="fedspu")


def _params(sim) -> list:
    return [np.asarray(p, np.float64).ravel().tolist()
            for p in jax.tree.leaves(jax.device_get(sim.state.variables["params"]))]


def main(argv: list[str]) -> None:
    out = {}
    if argv:
        port, process_id, num_processes = (int(a) for a in argv[:3])
        jax.distributed.initialize(f"localhost:{port}", num_processes=num_processes, process_id=process_id)
    from fedpartial._src.experiment.config import RunConfig
    from fedpartial._src.experiment.simulation import Simulation, run

    if argv:
        config = RunConfig(**{**CONFIG, "out_dir": os.path.join(argv[3], f"process{process_id}"), "run_name": "r"})
        sim = Simulation(config)
        summary = run(config, sim=sim, checkpoint_every=1)
        records, run_dir = summary["records"], summary["run_dir"]
        shutil.rmtree(os.path.join(run_dir, "checkpoints", str(CONFIG["rounds"])))  # killed after round 1
        resumed = Simulation(config)
        again = run(config, sim=resumed, resume=run_dir)
        out = {"checkpoints": sorted(os.listdir(os.path.join(run_dir, "checkpoints"))),
               "resumed_from": again["resumed_from_round"], "resumed_params": _params(resumed)}
    else:
        sim = Simulation(RunConfig(**CONFIG))
        records = list(sim.rounds())
    print()  # gloo writes to stdout too: the JSON is the last line
    json.dump({"process": jax.process_index(), "processes": jax.process_count(), "devices": jax.device_count(),
               "cohort_size": sim.round.ctx.cohort_size, "clients": [r["clients"] for r in records],
               "upload_bytes": [r["upload_bytes"] for r in records], "accuracy": records[-1]["test_accuracy"],
               "params": _params(sim), **out}, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1:])
