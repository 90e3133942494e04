"""One process of a multi-process run (or the one-process reference); prints the final parameters as JSON.

``python -m tests.multihost_case PORT PROCESS_ID NUM_PROCESSES`` joins ``jax.distributed`` at
``localhost:PORT`` (each process with its own fake CPU devices: set ``XLA_FLAGS``); with no
arguments it runs the same experiment in one process on one device.  Started by
``tests/test_sharding.py``.
"""

from __future__ import annotations

import json
import sys

import jax
import numpy as np

CONFIG = dict(dataset="synthetic", model="mlp", num_clients=10, cohort_size=6, rounds=2, local_steps=2,
              batch_size=8, eval_every=2, out_dir=None, strategy="fused", method="fedspu")


def main(argv: list[str]) -> None:
    if argv:
        port, process_id, num_processes = (int(a) for a in argv)
        jax.distributed.initialize(f"localhost:{port}", num_processes=num_processes, process_id=process_id)
    from fedpartial.simulation import RunConfig, Simulation

    sim = Simulation(RunConfig(**CONFIG))
    records = list(sim.rounds())
    params = jax.tree.leaves(jax.device_get(sim.state.variables["params"]))
    print()  # gloo writes to stdout too: the JSON is the last line
    json.dump({"process": jax.process_index(), "processes": jax.process_count(), "devices": jax.device_count(),
               "cohort_size": sim.round.ctx.cohort_size, "clients": [r["clients"] for r in records],
               "upload_bytes": [r["upload_bytes"] for r in records], "accuracy": records[-1]["test_accuracy"],
               "params": [np.asarray(p, np.float64).ravel().tolist() for p in params]}, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1:])
