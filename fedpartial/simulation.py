"""Host driver: data, partition, cohort sampling and packing, logging — around the pure round.

Everything here is host work (numpy, files, progress); the round itself is
:class:`fedpartial.engine.FederatedRound`.  :func:`run` is what ``fedpartial run``
calls; notebooks can call it too, or drive :class:`Simulation` round by round.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from typing import Any, Callable, Iterator

import jax
import numpy as np
import optax

from fedpartial import engine
from fedpartial.data import packing, sources
from fedpartial.data.partition import partition as split_population
from fedpartial.data.partition import train_holdout_split
from fedpartial.evaluation import evaluate, evaluate_clients, pad_holdouts
from fedpartial.methods import METHODS, PERSONALISED, early_stopping, get_method
from fedpartial.methods.base import Holdout
from fedpartial.methods.submodel import DEFAULT_TIERS
from fedpartial.models import registry
from fedpartial.models.adapter import Model, from_linen

#: Model used when ``model='auto'``.
DEFAULT_MODELS = {
    "digits": "cnn2c1f", "synthetic": "mlp", "mnist": "cnn2c1f", "fashion_mnist": "cnn2c1f",
    "emnist": "femnist_cnn", "cifar10": "vgg9", "cifar100": "resnet20", "svhn_cropped": "vgg9",
}
PARTITIONS = ("iid", "dirichlet", "shards", "natural")
SERVER_OPTIMIZERS = ("sgd", "adam", "yogi", "adagrad")


class ConfigError(ValueError):
    """An invalid run configuration; the message is one sentence for a person."""


@dataclasses.dataclass
class RunConfig:
    """One simulation run. Defaults: the offline digits job of the quick start."""

    method: str = "fedavg"
    dataset: str = "digits"
    data_dir: str | None = None
    model: str = "auto"
    partition: str = "dirichlet"
    alpha: float = 0.5
    classes_per_client: int = 2
    num_clients: int = 20
    cohort_size: int = 10
    rounds: int = 40
    local_steps: int | None = None
    local_epochs: float | None = 2.0
    batch_size: int = 16
    client_lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    server_optimizer: str = "sgd"
    server_lr: float = 1.0
    mu: float = 0.01
    n: int = 4
    adp_fraction: float = 0.2
    tiers: tuple[float, ...] = DEFAULT_TIERS
    select_start: float = 0.25
    select_end: float = 0.5
    early_stopping: bool = False
    train_fraction: float | None = None
    bn_policy: str = "global"
    strategy: str = "auto"
    seed: int = 0
    eval_every: int = 1
    out_dir: str | None = "runs"
    run_name: str | None = None

    def validate(self) -> None:
        """Raises :class:`ConfigError` naming the first bad value and what is allowed."""
        def bad(msg):
            raise ConfigError(msg)

        if self.method not in METHODS:
            bad(f"method {self.method!r} is unknown; choose one of {', '.join(sorted(METHODS))}.")
        if self.dataset not in sources.DATASETS:
            bad(f"dataset {self.dataset!r} is unknown; choose one of {', '.join(sources.DATASETS)}.")
        if self.model != "auto" and self.model not in registry.MODELS:
            bad(f"model {self.model!r} is unknown; choose 'auto' or one of {', '.join(sorted(registry.MODELS))}.")
        if self.partition not in PARTITIONS:
            bad(f"partition {self.partition!r} is unknown; choose one of {', '.join(PARTITIONS)}.")
        if self.partition == "dirichlet" and not self.alpha > 0:
            bad(f"Dirichlet α must be > 0, got {self.alpha}.")
        if self.num_clients < 1:
            bad(f"number of clients must be at least 1, got {self.num_clients}.")
        if not 1 <= self.cohort_size <= self.num_clients:
            bad(f"cohort size {self.cohort_size} must be between 1 and the number of clients ({self.num_clients}).")
        if self.rounds < 1:
            bad(f"rounds must be at least 1, got {self.rounds}.")
        if (self.local_steps is None) == (self.local_epochs is None):
            bad("give exactly one of local steps or local epochs.")
        if self.local_steps is not None and self.local_steps < 1:
            bad(f"local steps must be at least 1, got {self.local_steps}.")
        if self.local_epochs is not None and not self.local_epochs > 0:
            bad(f"local epochs must be > 0, got {self.local_epochs}.")
        if self.batch_size < 1:
            bad(f"batch size must be at least 1, got {self.batch_size}.")
        if not self.client_lr > 0:
            bad(f"client learning rate must be > 0, got {self.client_lr}.")
        if not self.server_lr > 0:
            bad(f"server learning rate must be > 0, got {self.server_lr}.")
        if not 0 <= self.momentum < 1:
            bad(f"momentum must be in [0, 1), got {self.momentum}.")
        if self.weight_decay < 0:
            bad(f"weight decay must be ≥ 0, got {self.weight_decay}.")
        if self.server_optimizer not in SERVER_OPTIMIZERS:
            bad(f"server optimizer {self.server_optimizer!r} is unknown; choose one of {', '.join(SERVER_OPTIMIZERS)}.")
        if self.method in ("fedldf", "random", "hdfl") and not 1 <= self.n <= self.cohort_size:
            bad(f"n = {self.n} uploads per layer must be between 1 and the cohort size ({self.cohort_size}).")
        if self.method == "fedadp" and not 0 < self.adp_fraction <= 1:
            bad(f"FedADP fraction must be in (0, 1], got {self.adp_fraction}.")
        if not self.tiers or any(not 0 < p <= 1 for p in self.tiers):
            bad(f"client tiers {tuple(self.tiers)} must be keep ratios in (0, 1].")
        if not 0 < self.select_start <= 1 or not 0 < self.select_end <= 1:
            bad(f"FedSelect fractions {self.select_start} → {self.select_end} must lie in (0, 1].")
        if self.train_fraction is not None and not 0 < self.train_fraction <= 1:
            bad(f"train fraction {self.train_fraction} must be in (0, 1] (the rest of each client's data is held out).")
        if self.early_stopping and self.client_train_fraction >= 1:
            bad("early stopping needs each client's held-out split; use a train fraction below 1 (e.g. 0.7).")
        if self.bn_policy not in engine.BN_POLICIES:
            bad(f"BatchNorm policy {self.bn_policy!r} is unknown; choose one of {', '.join(engine.BN_POLICIES)}.")
        if self.eval_every < 1:
            bad(f"eval-every must be at least 1, got {self.eval_every}.")
        try:
            engine.parse_strategy(self.strategy)
        except ValueError as e:
            bad(str(e))

    def method_options(self) -> dict:
        """The options of ``method`` taken from this configuration."""
        return {
            "fedprox": {"mu": self.mu},
            "fedldf": {"n": self.n},
            "random": {"n": self.n},
            "hdfl": {"n": self.n},
            "fedadp": {"fraction": self.adp_fraction},
            "fedselect": {"start": self.select_start, "end": self.select_end},
            **{m: {"tiers": tuple(self.tiers)} for m in PERSONALISED if m != "fedselect"},
        }.get(self.method, {})

    @property
    def personalised(self) -> bool:
        """Clients keep their own models (or early stopping needs held-out data)."""
        return self.method in PERSONALISED or self.early_stopping

    @property
    def client_train_fraction(self) -> float:
        """λ: each client's training share (the rest is its held-out split); 0.7 for
        personalised methods and early stopping unless given, else 1."""
        if self.train_fraction is not None:
            return self.train_fraction
        return 0.7 if self.personalised else 1.0


def client_optimizer(config: RunConfig) -> optax.GradientTransformation:
    """SGD with momentum and (decoupled from the loss) L2 weight decay."""
    parts = []
    if config.weight_decay:
        parts.append(optax.add_decayed_weights(config.weight_decay))
    parts.append(optax.sgd(config.client_lr, momentum=config.momentum or None))
    return optax.chain(*parts)


def server_optimizer(config: RunConfig) -> optax.GradientTransformation:
    return {
        "sgd": lambda lr: optax.sgd(lr),
        "adam": lambda lr: optax.adam(lr, b1=0.9, b2=0.99, eps=1e-3),
        "yogi": lambda lr: optax.yogi(lr, eps=1e-3),
        "adagrad": lambda lr: optax.adagrad(lr),
    }[config.server_optimizer](config.server_lr)


def build_model(name: str, dataset: sources.ArrayDataset) -> Model:
    """A zoo model adapted for the engine, shaped for ``dataset``."""
    if name == "auto":
        name = DEFAULT_MODELS.get(dataset.name.split("/")[0], "mlp")
    input_shape = tuple(dataset.x_train.shape[1:])
    spec = registry.MODELS[name]
    module = registry.build_model(name, dataset.num_classes, input_shape)
    return from_linen(module, input_shape=input_shape, num_classes=dataset.num_classes,
                      sequential=spec.sequential, name=name)


def partition_clients(config: RunConfig, dataset: sources.ArrayDataset) -> list[np.ndarray]:
    if config.partition == "natural" or dataset.natural_partition is not None:
        if dataset.natural_partition is None:
            raise ConfigError(f"dataset {dataset.name!r} has no natural partition; use iid, dirichlet or shards.")
        parts = list(dataset.natural_partition)
        if len(parts) != config.num_clients:
            raise ConfigError(
                f"dataset {dataset.name!r} is partitioned into {len(parts)} clients by nature, "
                f"but {config.num_clients} clients were asked for."
            )
        return parts
    options = {"dirichlet": {"alpha": config.alpha}, "shards": {"classes_per_client": config.classes_per_client}}
    # A held-out split needs two examples per client: one to train on, one to hold out.
    min_size = 2 if config.client_train_fraction < 1 and 2 * config.num_clients <= len(dataset.y_train) else 1
    return split_population(dataset.y_train, config.num_clients, config.partition, seed=config.seed,
                            min_size=min_size, **options.get(config.partition, {}))


class Simulation:
    """A run's data, model and round, advanced one round at a time by :meth:`rounds`."""

    def __init__(self, config: RunConfig, dataset: sources.ArrayDataset | None = None):
        config.validate()
        self.config = config
        if dataset is None:
            options = {}
            if config.dataset == "synthetic":
                options = dict(alpha=config.alpha, beta=config.alpha, num_clients=config.num_clients)
            dataset = sources.load_dataset(config.dataset, data_dir=config.data_dir, seed=config.seed, **options)
        self.dataset = dataset
        self.clients = partition_clients(config, dataset)
        self.holdout = None
        if config.client_train_fraction < 1:
            self.clients, held = train_holdout_split(self.clients, config.client_train_fraction, seed=config.seed)
            self.holdout = pad_holdouts([(dataset.x_train[h], dataset.y_train[h]) for h in held])
        self.sizes = np.array([len(c) for c in self.clients])
        self.num_steps = packing.max_steps(self.sizes, config.batch_size, local_steps=config.local_steps,
                                           local_epochs=config.local_epochs)
        self.model = build_model(config.model, dataset)
        self.method = get_method(config.method, **config.method_options())
        if config.early_stopping:
            self.method = early_stopping(self.method, lam=config.client_train_fraction)
        self.round = engine.FederatedRound(
            self.model, self.method,
            num_clients=config.num_clients, cohort_size=config.cohort_size,
            client_optimizer=client_optimizer(config), server_optimizer=server_optimizer(config),
            bn_policy=config.bn_policy, strategy=engine.parse_strategy(config.strategy), rounds=config.rounds,
        )
        init_key, self.rounds_key = jax.random.split(jax.random.key(config.seed))
        self.state = self.round.init(init_key)

    @property
    def num_params(self) -> int:
        return sum(int(np.size(p)) for p in jax.tree.leaves(self.state.variables["params"]))

    @property
    def personal_state_bytes(self) -> int:
        """Device memory of the method's per-client state (e.g. N personal models)."""
        return sum(int(a.nbytes) for a in jax.tree.leaves(self.state.method_state.clients))

    def active_clients(self) -> np.ndarray:
        """``[N]`` bool: who may be sampled (all, unless early stopping removed some)."""
        if self.method.active_clients is None:
            return np.ones(self.config.num_clients, bool)
        return np.asarray(self.method.active_clients(self.round.ctx, self.state.method_state))

    def sample_cohort(self, t: int) -> tuple[np.ndarray, np.ndarray, jax.Array, int]:
        """Round ``t``'s client ids, which are real, the round key and packing seed — all from the run's key.

        Clients are drawn from the active ones; when fewer than ``K`` are active all
        of them take part and the cohort is filled with inactive clients marked not
        valid (they train on nothing and weigh nothing).
        """
        sample_key, round_key, pack_key = jax.random.split(jax.random.fold_in(self.rounds_key, t), 3)
        k = self.config.cohort_size
        active = self.active_clients()
        pool = np.flatnonzero(active)
        if len(pool) == len(active):
            ids = np.sort(np.asarray(jax.random.choice(sample_key, len(active), (k,), replace=False)))
            valid = np.ones(k, bool)
        elif len(pool) >= k:
            # K of the active clients uniformly (Gumbel top-k): the shapes never change, so
            # nothing recompiles as the pool shrinks.
            scores = np.where(active, np.asarray(jax.random.gumbel(sample_key, (len(active),))), -np.inf)
            ids = np.sort(np.argsort(-scores, kind="stable")[:k])
            valid = np.ones(k, bool)
        else:
            filler = np.flatnonzero(~active)[: k - len(pool)]
            ids = np.concatenate([pool, filler])
            valid = np.arange(k) < len(pool)
        pack_seed = int(jax.random.randint(pack_key, (), 0, np.iinfo(np.int32).max))
        return ids, valid, round_key, pack_seed

    def cohort(self, ids: np.ndarray, pack_seed: int, valid: np.ndarray | None = None) -> engine.Cohort:
        cfg = self.config
        valid = np.ones(len(ids), bool) if valid is None else valid
        empty = np.zeros(0, np.int64)
        packed = packing.pack_cohort(
            self.dataset.x_train, self.dataset.y_train, [self.clients[i] if v else empty for i, v in zip(ids, valid)],
            batch_size=cfg.batch_size, num_steps=self.num_steps, local_steps=cfg.local_steps,
            local_epochs=cfg.local_epochs, seed=pack_seed,
        )
        holdout = None
        if self.holdout is not None:
            x, y, mask = self.holdout
            holdout = Holdout(x[ids], y[ids], mask[ids] & valid[:, None])
        return engine.cohort_from_packed(packed, ids, valid, holdout)

    def evaluate_personal(self) -> dict:
        """Every client's own model on its held-out split, and the global model on the same splits."""
        x, y, mask = self.holdout
        static = self.config.bn_policy == "static"
        personal = self.method.personal(self.round.ctx, self.state.method_state, self.state.variables)
        own = evaluate_clients(self.model, personal, x, y, mask, batch_statistics=static)
        shared = evaluate_clients(self.model, type(personal)(variables=self.state.variables, stacked=False),
                                  x, y, mask, batch_statistics=static)
        return {"personal_accuracy": own["mean"], "personal_accuracy_std": own["std"],
                "personal_accuracy_min": own["min"], "personal_accuracy_max": own["max"],
                "global_client_accuracy": shared["mean"]}

    def evaluate(self) -> dict:
        return evaluate(self.model, self.state.variables, self.dataset.x_test, self.dataset.y_test,
                        batch_statistics=self.config.bn_policy == "static")

    def rounds(self) -> Iterator[dict]:
        """Runs the configured rounds, yielding one metrics record per round."""
        cfg = self.config
        up_total = down_total = 0
        for t in range(cfg.rounds):
            if not self.active_clients().any():
                return  # early stopping: every client has stopped
            start = time.perf_counter()
            ids, valid, round_key, pack_seed = self.sample_cohort(t)
            cohort = self.cohort(ids, pack_seed, valid)
            self.state, metrics = self.round(self.state, cohort, round_key)
            metrics = jax.device_get(metrics)
            train_time = time.perf_counter() - start
            up_total += int(metrics["upload_bytes"])
            down_total += int(metrics["download_bytes"])
            record = {
                "round": t + 1,
                "train_loss": float(metrics["train_loss"]),
                "client_steps": int(metrics["client_steps"]),
                "upload_bytes": int(metrics["upload_bytes"]),
                "download_bytes": int(metrics["download_bytes"]),
                "cumulative_upload_bytes": up_total,
                "cumulative_download_bytes": down_total,
                "round_time_s": train_time,
                "clients": int(valid.sum()),
            }
            if self.method.active_clients is not None:
                record["active_clients"] = int(self.active_clients().sum())
            last = t + 1 == cfg.rounds or record.get("active_clients", 1) == 0
            if (t + 1) % cfg.eval_every == 0 or last:
                result = self.evaluate()
                record["test_accuracy"] = result["accuracy"]
                record["test_loss"] = result["loss"]
                if self.holdout is not None:
                    record.update(self.evaluate_personal())
            record["wall_time_s"] = time.perf_counter() - start
            yield record


def unique_run_dir(out_dir: str, name: str) -> str:
    """A fresh directory under ``out_dir``; an existing run is never overwritten."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    suffix = 1
    while os.path.exists(path):
        path = os.path.join(out_dir, f"{name}-{suffix}")
        suffix += 1
    os.makedirs(path)
    return path


def run(config: RunConfig, *, on_round: Callable[[dict], None] | None = None,
        sim: Simulation | None = None) -> dict:
    """Runs a whole simulation; writes ``config.json``, ``metrics.jsonl`` and ``summary.json``.

    Pass ``sim`` to reuse an already-built :class:`Simulation` of ``config``.
    Returns the summary dict (also holding ``run_dir`` and the per-round records).
    """
    config.validate()
    t0 = time.perf_counter()
    sim = sim or Simulation(config)
    run_dir = None
    if config.out_dir:
        name = config.run_name or f"{config.method}-{config.dataset}-seed{config.seed}"
        run_dir = unique_run_dir(config.out_dir, name)
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            json.dump(dataclasses.asdict(config), f, indent=2)
    records = []
    log = open(os.path.join(run_dir, "metrics.jsonl"), "w") if run_dir else None
    try:
        for record in sim.rounds():
            records.append(record)
            if log:
                log.write(json.dumps(record) + "\n")
                log.flush()
            if on_round:
                on_round(record)
    finally:
        if log:
            log.close()
    summary = summarize(config, sim, records, time.perf_counter() - t0)
    if run_dir:
        with open(os.path.join(run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
    return {**summary, "run_dir": run_dir, "records": records}


def summarize(config: RunConfig, sim: Simulation, records: list[dict], wall: float) -> dict:
    evaluated = [r for r in records if "test_accuracy" in r]
    accs = [r["test_accuracy"] for r in evaluated]
    train_time = sum(r["round_time_s"] for r in records)
    personal = {}
    if sim.holdout is not None and evaluated:
        keys = ("personal_accuracy", "personal_accuracy_std", "personal_accuracy_min", "personal_accuracy_max",
                "global_client_accuracy")
        personal = {f"final_{k}": evaluated[-1][k] for k in keys}
        personal["best_personal_accuracy"] = max(r["personal_accuracy"] for r in evaluated)
    stopping = {}
    if config.early_stopping:
        stopping = {"rounds_saved": config.rounds - len(records),
                    "stopped_clients": int(config.num_clients - sim.active_clients().sum())}
    return {
        "method": config.method,
        "dataset": sim.dataset.name,
        "model": sim.model.name,
        "num_params": sim.num_params,
        "strategy": f"{sim.round.strategy.kind}:{sim.round.strategy.chunk_size}",
        "backend": jax.default_backend(),
        "rounds": len(records),
        "final_test_accuracy": accs[-1] if accs else math.nan,
        "best_test_accuracy": max(accs) if accs else math.nan,
        "final_test_loss": evaluated[-1]["test_loss"] if evaluated else math.nan,
        "final_train_loss": records[-1]["train_loss"] if records else math.nan,
        "total_upload_bytes": records[-1]["cumulative_upload_bytes"] if records else 0,
        "total_download_bytes": records[-1]["cumulative_download_bytes"] if records else 0,
        "total_client_steps": sum(r["client_steps"] for r in records),
        "train_time_s": train_time,
        "rounds_per_s": len(records) / train_time if train_time else math.nan,
        "wall_time_s": wall,
        "planned_rounds": config.rounds,
        "client_train_fraction": config.client_train_fraction,
        "personal_state_bytes": sim.personal_state_bytes,
        **personal,
        **stopping,
    }
