"""Federated fine-tuning with LoRA against full fine-tuning, from a base pre-trained in the script.

Usage::

    python -m benchmarks.lora --size cpu|paper [--model mlp] [--methods fedavg,fedit,...] [--out DIR]

Protocol: the training split of ``--dataset`` (default ``digits``) is cut in two.  A *public* part (30 %, IID)
pre-trains the base centrally (one client holding it, FedAvg = plain SGD); the rest is split non-IID
(Dirichlet α = 0.3) over ``N`` clients, each keeping 20 % of its examples as its own held-out set.  Every method
then fine-tunes the same base for the same number of rounds, every client in every round:

* ``fedavg`` (full fine-tuning) and ``fedpart`` (one layer a round) on the base model;
* ``fedit``, ``ffa_lora``, ``fedsa_lora``, ``hetlora``, ``flexlora``, ``flora`` on the base with
  LoRA adapters of rank ``r`` on every hidden Dense layer (head trained);
* ``fedit``, ``hetlora``, ``flexlora``, ``flora`` again under heterogeneous ranks (``--lora-ranks r/4,r/2,r``):
  the ``…@ranks`` rows.

Columns: global accuracy (the test split), personalised accuracy (each client's model on its own held-out set:
the global model except for FedSA-LoRA, whose clients keep their own B), upload bytes per round (the cohort's),
client FLOPs per local step (analytic: the base's forward and input gradient, the trained layers' weight
gradients and the adapters), and a client's training memory (the base held once + trained weights, gradients
and activations, float32).  The papers' orderings are checked yes/no: FFA-LoRA ≈ FedIT (within 2 points) at about
half the upload; FedSA-LoRA best personalised among the LoRA methods; FLoRA ≥ FedIT under heterogeneous ranks.

The model is named (``--model``, a zoo model); the script needs only that it is a Dense network a LoRA transform
can wrap, so a transformer (``vit``, ``transformer_lm``) is one name away.  JSON with the device, date and command
goes to ``<out>/lora-<backend>.json`` and a figure beside it.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedpartial._src.bench.provenance import stamp
from fedpartial._src.core.records import Batch, CohortInfo
from fedpartial._src.core.structure import FROZEN
from fedpartial._src.core.memory import tree_bytes
from fedpartial._src.costs.footprint import memory_footprint
from fedpartial._src.costs.flops import training_flops
from fedpartial._src.data.partition import partition
from fedpartial._src.data.sources import load_dataset
from fedpartial._src.engine.metrics import traffic_totals
from fedpartial._src.engine.round import FederatedRound
from fedpartial._src.engine.types import Cohort
from fedpartial._src.methods.catalog import METHODS, get_method
from fedpartial._src.models.adapter import from_linen
from fedpartial._src.models.lora import lora
from fedpartial._src.models.lora_ranks import with_lora_ranks
from fedpartial._src.models.registry import build_model

ROOT = pathlib.Path(__file__).resolve().parents[1]
FULL = ("fedavg", "fedpart")
LORA = ("fedit", "ffa_lora", "fedsa_lora", "hetlora", "flexlora", "flora")
HETEROGENEOUS = ("fedit", "hetlora", "flexlora", "flora")
SIZES = {  # clients, rounds, local steps, batch, pre-training steps, rank
    "tiny": dict(clients=4, rounds=2, steps=2, batch=16, pretrain_steps=20, rank=4),
    "cpu": dict(clients=8, rounds=10, steps=5, batch=16, pretrain_steps=200, rank=8),
    "paper": dict(clients=20, rounds=50, steps=20, batch=32, pretrain_steps=1000, rank=8),
}
LR = 0.05


def split(data, clients: int, seed: int):
    """The public indices and, per client, its training and held-out indices into the training split."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(data.y_train))
    public, rest = order[: int(0.3 * len(order))], order[int(0.3 * len(order)):]
    parts = partition(data.y_train[rest], clients, "dirichlet", alpha=0.3, seed=seed, min_size=8)
    train, held = [], []
    for p in parts:
        idx = rest[rng.permutation(p)]
        cut = max(1, int(0.8 * len(idx)))
        train.append(idx[:cut])
        held.append(idx[cut:])
    return public, train, held


def cohort(x, y, indices, steps: int, batch: int, rng) -> Cohort:
    """Every client's ``steps`` batches, drawn with replacement from its examples."""
    k = len(indices)
    picks = np.stack([rng.choice(i, (steps, batch)) for i in indices])
    return Cohort(Batch(x[picks], y[picks].astype(np.int32), np.ones((k, steps, batch), bool),
                        np.ones((k, steps), bool)),
                  CohortInfo(np.arange(k, dtype=np.int32), np.array([len(i) for i in indices], np.float32),
                             np.ones((k,), bool)))


def accuracy(model, variables, x, y) -> float:
    logits = model.apply(variables, jnp.asarray(x), False)[0]
    return float(np.mean(np.argmax(np.asarray(logits), -1) == y))


def pretrain(base, data, public, size, seed):
    r = FederatedRound(base, get_method("fedavg"), num_clients=1, cohort_size=1, client_optimizer=optax.sgd(0.1))
    state = r.init(jax.random.key(seed))
    rng = np.random.default_rng(seed)
    for t in range(max(1, size["pretrain_steps"] // 50)):
        state, _ = r(state, cohort(data.x_train, data.y_train, [public], 50, size["batch"], rng), jax.random.key(t))
    return jax.device_get(state.variables)


def with_base(model, base_vars, key):
    """``model``'s initial variables with the pre-trained base: the base's own, or under a LoRA model its frozen
    collection and head from the base, fresh adapters."""
    if model.lora is None:
        return base_vars
    v = jax.device_get(model.init_variables(key))
    params = jax.tree.map(lambda a: a, v["params"])
    frozen = jax.tree.map(lambda a: a, v[FROZEN])
    for name, tree in base_vars["params"].items():
        if name in frozen:
            frozen[name] = {**frozen[name], **{k: a for k, a in tree.items() if k in frozen[name]}}
        if name in params and "kernel" in params[name]:
            params[name] = tree
    return {**v, "params": params, FROZEN: frozen}


def client_flops(model, base, batch: int) -> float:
    """Analytic FLOPs of one local step: full fine-tuning 3× the forward; LoRA the base's forward and input
    gradient (2×) plus the trained head's weight gradient and 3× the adapters' own products."""
    if model.lora is None:
        return training_flops(base, batch_size=batch)
    full = training_flops(base, batch_size=batch)
    forward = full / 3
    head = base.structure.layers[-1]
    adapters = sum(2 * batch * (a.fan_in * model.lora.rank + model.lora.rank * a.units) for a in model.lora.adapters)
    return 2 * forward + 2 * batch * head.fan_in * head.units + 3 * adapters


def client_memory(model, base, batch: int) -> int:
    """A client's training memory, float32: the base model's activations (every layer's outputs on a batch), the
    trained parameters twice (weights and gradients), and a LoRA model's frozen base once plus its adapters'
    activations (``batch·r`` each)."""
    activations = int(memory_footprint(base, batch_size=batch)["activation_bytes"])
    v = jax.eval_shape(model.init_variables, jax.random.key(0))
    total = activations + 2 * tree_bytes(v["params"]) + tree_bytes(v.get(FROZEN, {}))
    if model.lora is not None:
        total += 4 * batch * model.lora.rank * len(model.lora.adapters)
    return int(total)


def personal_accuracy(r, method, state, model, data, held) -> float:
    personal = method.personal(r.ctx, state.method_state, state.variables)
    accs = []
    for i, idx in enumerate(held):
        if personal.stacked:
            v = {c: (t if c == FROZEN else jax.tree.map(lambda a: a[i], t)) for c, t in personal.variables.items()}
        else:
            v = personal.variables
        accs.append(accuracy(model, v, data.x_train[idx], data.y_train[idx]))
    return float(np.mean(accs))


def run_row(name, ranks, base, base_vars, data, train, held, size, seed):
    model = base if name in FULL else lora(base, size["rank"])
    if ranks is not None:
        model = with_lora_ranks(model, ranks)
    method = get_method(name)
    k = len(train)
    r = FederatedRound(model, method, num_clients=k, cohort_size=k, client_optimizer=optax.sgd(LR),
                       rounds=size["rounds"])
    state = r.init(jax.random.key(seed))
    state = state._replace(variables=with_base(model, base_vars, jax.random.key(seed + 1)))
    rng = np.random.default_rng(seed + 7)
    uploads, errors = [], []
    start = time.perf_counter()
    for t in range(size["rounds"]):
        state, m = r(state, cohort(data.x_train, data.y_train, train, size["steps"], size["batch"], rng),
                     jax.random.key(1000 + t))
        m = jax.device_get(m)
        uploads.append(traffic_totals(m)["upload_bytes"])
        if "lora_aggregation_error" in m:
            errors.append(float(m["lora_aggregation_error"]))
    state = jax.device_get(state)
    return {"method": name, "ranks": list(ranks) if ranks else None,
            "global_accuracy": accuracy(model, state.variables, data.x_test, data.y_test),
            "personal_accuracy": personal_accuracy(r, method, state, model, data, held),
            "upload_bytes_per_round": float(np.mean(uploads)),
            "client_flops_per_step": float(client_flops(model, base, size["batch"])),
            "client_memory_bytes": client_memory(model, base, size["batch"]),
            "lora_aggregation_error_last": errors[-1] if errors else None,
            "seconds": round(time.perf_counter() - start, 1)}


def checks(rows):
    by = {(r["method"], bool(r["ranks"])): r for r in rows}
    out = {}
    if ("fedit", False) in by and ("ffa_lora", False) in by:
        fedit, ffa = by[("fedit", False)], by[("ffa_lora", False)]
        out["ffa_close_to_fedit_at_half_upload"] = bool(
            abs(ffa["global_accuracy"] - fedit["global_accuracy"]) <= 0.02
            and ffa["upload_bytes_per_round"] <= 0.6 * fedit["upload_bytes_per_round"])
    lora_rows = [r for r in rows if r["method"] in LORA and not r["ranks"]]
    if any(r["method"] == "fedsa_lora" for r in lora_rows):
        best = max(lora_rows, key=lambda r: r["personal_accuracy"])
        out["fedsa_best_personalised"] = best["method"] == "fedsa_lora"
    if ("fedit", True) in by and ("flora", True) in by:
        out["flora_at_least_fedit_heterogeneous"] = by[("flora", True)]["global_accuracy"] >= \
            by[("fedit", True)]["global_accuracy"]
    return out


def figure(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        label = r["method"] + ("@ranks" if r["ranks"] else "")
        ax.scatter(r["upload_bytes_per_round"] / 1e6, r["global_accuracy"], marker="s" if r["ranks"] else "o")
        ax.annotate(label, (r["upload_bytes_per_round"] / 1e6, r["global_accuracy"]), fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("upload per round (MB, the cohort)")
    ax.set_ylabel("global test accuracy")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="cpu")
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--dataset", default="digits")
    ap.add_argument("--methods", default=",".join(FULL + LORA))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    size = SIZES[args.size]
    data = load_dataset(args.dataset, seed=args.seed)
    base = from_linen(build_model(args.model, data.num_classes, data.x_train.shape[1:]),
                      input_shape=data.x_train.shape[1:], num_classes=data.num_classes, name=args.model)
    public, train, held = split(data, size["clients"], args.seed)
    t0 = time.perf_counter()
    base_vars = pretrain(base, data, public, size, args.seed)
    pre_acc = accuracy(base, base_vars, data.x_test, data.y_test)
    print(f"pre-trained base: test accuracy {pre_acc:.3f} ({time.perf_counter() - t0:.0f} s)")
    r = size["rank"]
    het = (max(1, r // 4), max(1, r // 2), r)
    wanted = [m for m in args.methods.split(",") if m]
    plan = [(m, None) for m in wanted] + [(m, het) for m in wanted if m in HETEROGENEOUS]
    rows = []
    for name, ranks in plan:
        if name not in METHODS:
            print(f"skip {name}: not registered")
            continue
        row = run_row(name, ranks, base, base_vars, data, train, held, size, args.seed)
        rows.append(row)
        print(f"{name + ('@ranks' if ranks else ''):<18} global {row['global_accuracy']:.3f}  personal "
              f"{row['personal_accuracy']:.3f}  upload {row['upload_bytes_per_round'] / 1e3:9.1f} kB  "
              f"flops {row['client_flops_per_step'] / 1e6:6.2f} M  memory {row['client_memory_bytes'] / 1e3:7.1f} kB"
              f"  ({row['seconds']} s)")
    report = stamp({"benchmark": "lora", "size": args.size, "model": args.model, "dataset": args.dataset,
                    "device": jax.devices()[0].device_kind, "backend": jax.default_backend(),
                    "settings": {**size, "lr": LR, "heterogeneous_ranks": list(het), "seed": args.seed},
                    "pretrained_accuracy": pre_acc, "rows": rows, "checks": checks(rows),
                    "wall_seconds": round(time.perf_counter() - t0, 1)}, argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"lora-{args.size}-{jax.default_backend()}" if args.size != "cpu" else f"lora-{jax.default_backend()}"
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    figure(rows, out / f"{stem}.png")
    print("checks:", report["checks"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
