"""The Flower + PyTorch side of ``python -m benchmarks.peers``: FedAvg in Flower's simulation runtime (Ray, one
actor per core, one torch thread each), timed round by round.

Run by :mod:`benchmarks.peers` in its own process (``python -m benchmarks.peers_flower ROUNDS ROW[,ROW...]``): one
simulation (the actors start once) runs every row in turn, ``ROUNDS + 1`` rounds each (the first one is warm-up), and
prints one JSON line: the seconds of every round and the versions.  The models are the ones
:mod:`benchmarks.peers_fedpartial` builds in Flax, layer for layer; the data are random, drawn on each client from
its id (as a Flower client loads its own partition).  The simulation has as many nodes as the largest population;
a row of a smaller one samples its K from them (a round's work is the same).
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

# the rows' settings (benchmarks.peers.ROWS): model, image side, channels, N, K, local steps, batch size
from benchmarks.peers_rows import ROWS


def torch_model(name: str, side: int):
    import torch.nn as nn

    if name == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(side * side, 200), nn.ReLU(), nn.Linear(200, 200), nn.ReLU(),
                             nn.Linear(200, 10))
    if name == "cnn":  # conv16-pool-conv32-pool-fc64-fc10, 5x5 SAME
        flat = 32 * (side // 4) ** 2
        return nn.Sequential(nn.Conv2d(1, 16, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(16, 32, 5, padding=2),
                             nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(flat, 64), nn.ReLU(), nn.Linear(64, 10))
    if name == "cnn2c1f":  # conv32-pool-conv64-pool-fc10, 5x5 SAME (the zoo's cnn2c1f)
        flat = 64 * (side // 4) ** 2
        return nn.Sequential(nn.Conv2d(1, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(32, 64, 5, padding=2),
                             nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(flat, 10))
    raise ValueError(f"model {name!r} has no torch twin here.")


def main(rounds: int, rows: list[str]) -> dict:
    import torch
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation

    nodes = max(ROWS[r].clients for r in rows)
    cores = os.cpu_count() or 1
    client_app = ClientApp()

    @client_app.train()
    def train(msg: Message, context: Context):
        torch.set_num_threads(1)
        spec = ROWS[str(msg.content["config"]["row"])]
        cid = int(context.node_config["partition-id"])
        rng = np.random.default_rng([0, cid])
        n = spec.local_steps * spec.batch_size
        x = torch.from_numpy(rng.normal(size=(n, spec.channels, spec.side, spec.side)).astype(np.float32))
        y = torch.from_numpy(rng.integers(0, 10, size=n).astype(np.int64))
        model = torch_model(spec.model, spec.side)
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        model.train()
        for s in range(spec.local_steps):
            sl = slice(s * spec.batch_size, (s + 1) * spec.batch_size)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[sl]), y[sl]).backward()
            opt.step()
        content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord({"num-examples": n})})
        return Message(content=content, reply_to=msg)

    stamps: dict[str, list[tuple[float, float]]] = {r: [] for r in rows}

    class TimedFedAvg(FedAvg):
        def configure_train(self, server_round, arrays, config, grid):
            self._started = time.perf_counter()
            return super().configure_train(server_round, arrays, config, grid)

        def aggregate_train(self, server_round, replies):
            out = super().aggregate_train(server_round, replies)
            stamps[self.row].append((self._started, time.perf_counter()))
            if server_round == rounds + 1:  # the row's last round: kept if the process is cut off
                seconds = [end - start for start, end in stamps[self.row]]
                print("PEERS-ROW " + json.dumps({self.row: {"round_s": seconds}}), flush=True)
            return out

    server_app = ServerApp()

    @server_app.main()
    def server(grid: Grid, context: Context):
        from flwr.app import ConfigRecord

        for row in rows:
            spec = ROWS[row]
            torch.manual_seed(0)
            initial = ArrayRecord(torch_model(spec.model, spec.side).state_dict())
            strategy = TimedFedAvg(fraction_train=spec.cohort / nodes, fraction_evaluate=0.0,
                                   min_train_nodes=spec.cohort, min_available_nodes=nodes)
            strategy.row = row
            strategy.start(grid=grid, initial_arrays=initial, num_rounds=rounds + 1,
                           train_config=ConfigRecord({"row": row}))

    backend = {"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
               "init_args": {"num_cpus": cores, "include_dashboard": False, "logging_level": "error",
                             "log_to_driver": False}}
    run_simulation(server_app=server_app, client_app=client_app, num_supernodes=nodes, backend_config=backend)
    import flwr
    import ray

    return {"rows": {r: {"round_s": [end - start for start, end in s]} for r, s in stamps.items()},
            "actors": cores, "torch_threads": 1,
            "versions": {"flwr": flwr.__version__, "torch": torch.__version__, "ray": ray.__version__}}


if __name__ == "__main__":
    result = main(int(sys.argv[1]), sys.argv[2].split(","))
    print("PEERS-RESULT " + json.dumps(result), flush=True)
