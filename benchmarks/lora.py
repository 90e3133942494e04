"""Federated fine-tuning with LoRA against full fine-tuning of a transformer, from a base pre-trained in the script.

Usage::

    python -m benchmarks.lora --size cpu|paper [--model vit|transformer_lm|mlp] [--dataset digits|synthetic_lm]
                              [--model-size tiny] [--methods fedavg,fedit,...] [--out DIR]

Protocol: the training split of ``--dataset`` is cut in two.  A *public* part (30 %, IID) pre-trains the base
centrally (one client holding it, FedAvg = plain training: Adam 1e-3 for a transformer, SGD 0.1 for the MLP); the
rest is split non-IID (Dirichlet α = 0.3 over the classes, or over the topics of a language model's corpus) over
``N`` clients, each keeping 20 % of its examples as its own held-out set.  Every method then fine-tunes the same
base for the same number of rounds, every client in every round, SGD on the clients:

* ``fedavg`` (full fine-tuning) and ``fedpart`` on the base model, FedPart one stage a round on a transformer
  (``train_unit="block"``: the embedding, each block, the head), one layer a round on the MLP;
* ``fedit``, ``ffa_lora``, ``fedsa_lora``, ``hetlora``, ``flexlora``, ``flora`` on the base with LoRA adapters of
  rank ``r`` on the default targets (a transformer's attention projections and MLP in every block; the MLP's hidden
  Dense layers), the head trained;
* ``fedit``, ``hetlora``, ``flexlora``, ``flora`` again under heterogeneous ranks (``r/4, r/2, r``): the ``@ranks``
  rows.

Columns: global accuracy (the test split) and personalised accuracy (each client's model on its own held-out set,
the mean over clients: the global model except for FedSA-LoRA, whose clients keep their own B).  For a language
model accuracy counts next-token predictions (padding excluded) and perplexity (exp of the mean token
cross-entropy; personalised: exp of the clients' mean) is reported beside it.  Upload bytes per round (the
cohort's, the engine's traffic count); client FLOPs per local step (XLA's count of one client's step, the engine's
device model: a LoRA client's count holds the frozen base's forward and backward and no weight gradient of it);
a client's training memory (float32: every Dense output of the base on a batch and each adapter's ``x A``, the
trained parameters and their gradients, a LoRA client's frozen base once).  The papers' orderings are checked yes/no:
FFA-LoRA ≈ FedIT (within 2 points of accuracy) at ≤ 60 % of the upload; FedSA-LoRA best personalised among the
LoRA methods; FLoRA ≥ FedIT under heterogeneous ranks.

JSON with the device, date and command goes to ``<out>/lora-<model>-<size>.json`` (``-<backend>`` added off the
CPU) and a figure beside it.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import figure_style
from fedpartial._src.bench.provenance import stamp
from fedpartial._src.core.errors import UserError
from fedpartial._src.core.losses import count_correct, label_weights
from fedpartial._src.core.memory import tree_bytes
from fedpartial._src.core.records import Batch, CohortInfo
from fedpartial._src.core.structure import FROZEN
from fedpartial._src.costs.flops import step_costs
from fedpartial._src.costs.footprint import layer_output_shapes, memory_footprint
from fedpartial._src.data.partition import partition
from fedpartial._src.data.sources import load_dataset
from fedpartial._src.engine.metrics import traffic_totals
from fedpartial._src.engine.round import FederatedRound
from fedpartial._src.engine.types import Cohort
from fedpartial._src.methods.catalog import METHODS, get_method
from fedpartial._src.models.adapter import from_linen
from fedpartial._src.models.lora import lora
from fedpartial._src.models.lora_ranks import with_lora_ranks
from fedpartial._src.models.params_io import starting_from
from fedpartial._src.models.registry import MODELS, build_model
from fedpartial._src.models.transformer import TransformerSize

ROOT = pathlib.Path(__file__).resolve().parents[1]
FULL = ("fedavg", "fedpart")
LORA = ("fedit", "ffa_lora", "fedsa_lora", "hetlora", "flexlora", "flora")
HETEROGENEOUS = ("fedit", "hetlora", "flexlora", "flora")
#: a transformer small enough for the smoke test (``--size tiny``)
MICRO = TransformerSize(layers=1, d_model=16, heads=2, mlp=32)
SIZES = {  # clients, rounds, local steps, batch, pre-training steps, rank, transformer size
    "tiny": dict(clients=4, rounds=2, steps=2, batch=8, pretrain_steps=20, rank=4, model_size="micro"),
    "cpu": dict(clients=10, rounds=20, steps=10, batch=16, pretrain_steps=600, rank=8, model_size="tiny"),
    "paper": dict(clients=20, rounds=50, steps=20, batch=32, pretrain_steps=2000, rank=8, model_size="small"),
}
#: clients' SGD learning rate; the pre-training optimizer (central, on the public part)
LR = {"mlp": 0.05, "transformer": 0.1}
PRETRAIN = {"mlp": ("sgd", 0.1), "transformer": ("adam", 1e-3)}
EVAL_BATCH = 128


def kind(model_name: str) -> str:
    return "transformer" if MODELS[model_name].sized else "mlp"


def split(data, clients: int, seed: int):
    """The public indices and, per client, its training and held-out indices into the training split."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(data.y_train))
    public, rest = order[: int(0.3 * len(order))], order[int(0.3 * len(order)):]
    parts = partition(np.asarray(data.groups)[rest], clients, "dirichlet", alpha=0.3, seed=seed, min_size=8)
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


class Scorer:
    """Accuracy and mean cross-entropy over the real labels (:func:`label_weights`): one per example of a
    classifier, one per non-padded position of a language model's next-token targets."""

    def __init__(self, model):
        def sums(variables, x, y, mask):
            logits = model.apply(variables, x, False)[0].astype(jnp.float32)
            w = label_weights(y, mask)
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(y, 0))
            return count_correct(logits, y, mask), jnp.sum(w), jnp.sum(ce * w)

        self._sums = jax.jit(sums)

    def __call__(self, variables, x, y) -> tuple[float, float]:
        """(accuracy, mean cross-entropy) of ``variables`` on ``x, y``, in fixed-size padded batches."""
        correct = count = loss = 0.0
        for i in range(0, len(x), EVAL_BATCH):
            xb, yb = x[i:i + EVAL_BATCH], y[i:i + EVAL_BATCH].astype(np.int32)
            pad = EVAL_BATCH - len(xb)
            mask = np.arange(EVAL_BATCH) < len(xb)
            xb = np.concatenate([xb, np.repeat(xb[:1], pad, 0)]) if pad else xb
            yb = np.concatenate([yb, np.repeat(yb[:1], pad, 0)]) if pad else yb
            c, n, ce = jax.device_get(self._sums(variables, xb, yb, mask))
            correct, count, loss = correct + float(c), count + float(n), loss + float(ce)
        return correct / max(count, 1.0), loss / max(count, 1.0)


def pretrain(base, data, public, size, seed, model_kind):
    name, lr = PRETRAIN[model_kind]
    r = FederatedRound(base, get_method("fedavg"), num_clients=1, cohort_size=1,
                       client_optimizer=getattr(optax, name)(lr))
    state = r.init(jax.random.key(seed))
    rng = np.random.default_rng(seed)
    for t in range(max(1, size["pretrain_steps"] // 50)):
        state, _ = r(state, cohort(data.x_train, data.y_train, [public], 50, size["batch"], rng), jax.random.key(t))
    return jax.device_get(state.variables)


def client_flops(r: FederatedRound, batches: Cohort) -> float:
    """FLOPs of one client's local step as the engine's device model counts them: XLA's count of the step
    (pre-optimisation HLO, :func:`step_costs`).  A LoRA client's step holds the frozen base's forward and its
    input gradients, the adapters' and the head's work, and no weight gradient of the base; heterogeneous ranks
    are charged the full-rank step, as the device model does.  The engine computes every gradient of a model
    whose layers a train mask freezes (FedPart) and masks them afterwards: it is charged the full step."""
    return max(cost.step_flops for cost in step_costs(r, batches, compiled=False))


def client_memory(model, base, batch: int) -> int:
    """A client's training memory, float32 (:func:`memory_footprint`'s model: weights + gradients + activations,
    an activation being every Dense output on a batch, kept for the backward pass; a transformer's ``[B, T, d]``
    outputs count every position).  Full fine-tuning: the base's parameters twice (weights and gradients) and its
    activations.  LoRA: the frozen base once, the trained parameters (adapters, head) twice, the base's
    activations, and each adapter's ``x A`` (``r`` values per position, what B's gradient needs; its ``(x A) B``
    joins the wrapped layer's output, already counted)."""
    footprint = memory_footprint(base, batch_size=batch)
    if model.lora is None:
        return int(footprint["total_bytes"])
    outputs = dict(zip((layer.path for layer in base.structure.layers), layer_output_shapes(base)))
    adapters = sum(4 * batch * math.prod(outputs[a.path][:-1]) * model.lora.rank for a in model.lora.adapters)
    v = jax.eval_shape(model.init_variables, jax.random.key(0))
    return int(footprint["activation_bytes"] + adapters + 2 * tree_bytes(v["params"]) + tree_bytes(v[FROZEN]))


def personal_scores(r, method, state, score, data, held) -> tuple[float, float]:
    """(mean accuracy, mean cross-entropy) over the clients, each on its own held-out examples with its model."""
    personal = method.personal(r.ctx, state.method_state, state.variables)
    out = []
    for i, idx in enumerate(held):
        if personal.stacked:
            v = {c: (t if c == FROZEN else jax.tree.map(lambda a: a[i], t)) for c, t in personal.variables.items()}
        else:
            v = personal.variables
        out.append(score(v, data.x_train[idx], data.y_train[idx]))
    return float(np.mean([a for a, _ in out])), float(np.mean([ce for _, ce in out]))


def method_for(name: str, model_kind: str):
    if name == "fedpart" and model_kind == "transformer":
        return get_method("fedpart", train_unit="block")  # one block (a model stage) a round
    return get_method(name)


def run_row(name, ranks, base, base_vars, data, train, held, size, seed, lr, model_kind, language):
    start_model = starting_from(base, base_vars, source="the pre-trained base")
    model = start_model if name in FULL else lora(start_model, size["rank"])
    if ranks is not None:
        model = with_lora_ranks(model, ranks)
    method = method_for(name, model_kind)
    k = len(train)
    r = FederatedRound(model, method, num_clients=k, cohort_size=k, client_optimizer=optax.sgd(lr),
                       rounds=size["rounds"])
    state = r.init(jax.random.key(seed))
    rng = np.random.default_rng(seed + 7)
    uploads, errors = [], []
    start = time.perf_counter()
    for t in range(size["rounds"]):
        batches = cohort(data.x_train, data.y_train, train, size["steps"], size["batch"], rng)
        if t == 0:
            flops = client_flops(r, batches)
        state, m = r(state, batches, jax.random.key(1000 + t))
        m = jax.device_get(m)
        uploads.append(traffic_totals(m)["upload_bytes"])
        if "lora_aggregation_error" in m:
            errors.append(float(m["lora_aggregation_error"]))
    state = jax.device_get(state)
    score = Scorer(model)
    global_acc, global_ce = score(state.variables, data.x_test, data.y_test)
    personal_acc, personal_ce = personal_scores(r, method, state, score, data, held)
    row = {"method": name, "ranks": list(ranks) if ranks else None,
           "global_accuracy": global_acc, "personal_accuracy": personal_acc}
    if language:
        row |= {"global_perplexity": math.exp(global_ce), "personal_perplexity": math.exp(personal_ce)}
    return row | {"upload_bytes_per_round": float(np.mean(uploads)),
                  "client_flops_per_step": float(flops),
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


def figure(rows, path, pretrained: float, language: bool):
    """Global and personalised accuracy (perplexity for a language model) against the cohort's upload per round;
    the pre-trained base's test accuracy (perplexity) ``pretrained`` as a dotted line."""
    if language:
        panels = (("global_perplexity", "global test perplexity"),
                  ("personal_perplexity", "personalised perplexity"))
    else:
        panels = (("global_accuracy", "global test accuracy"), ("personal_accuracy", "personalised accuracy"))
    fig, axes = figure_style.figure(2, height=4.2)
    for ax, (key, ylabel) in zip(axes, panels):
        for r in rows:
            name = r["method"] + ("@ranks" if r["ranks"] else "")
            ax.scatter(r["upload_bytes_per_round"] / 1e6, r[key], color=figure_style.colour(r["method"]), s=60,
                       marker="s" if r["ranks"] else "o", label=name)
        if key.startswith("global"):
            ax.axhline(pretrained, color="#888888", linestyle=":", label="pre-trained base")
        ax.set_xlim(left=0)
        ax.set_xlabel("upload per round (MB, the cohort)")
        ax.set_ylabel(ylabel)
    figure_style.shared_legend(fig, axes)
    figure_style.save(fig, str(path))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="cpu")
    ap.add_argument("--model", choices=("vit", "transformer_lm", "transformer_cls", "mlp"), default="vit")
    ap.add_argument("--dataset", default="digits")
    ap.add_argument("--model-size", default=None, help="a transformer's --model-size (default: the size's own)")
    ap.add_argument("--methods", default=",".join(FULL + LORA))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    try:
        return run(args, argv)
    except UserError as error:
        print(f"error: {error}")
        return 2


def run(args, argv) -> int:
    size = SIZES[args.size]
    model_kind = kind(args.model)
    data = load_dataset(args.dataset, seed=args.seed)
    language = np.ndim(data.y_train) == 2  # one label per position: a language model
    if language != (args.model == "transformer_lm"):
        raise UserError(f"--model {args.model} does not fit --dataset {args.dataset}: a language-model dataset "
                        "(synthetic_lm) needs --model transformer_lm, and transformer_lm needs one.")
    model_size = args.model_size or size.get("model_size", "tiny")
    shape = MICRO if model_size == "micro" else model_size
    extra = {"size": shape} if model_kind == "transformer" else {}
    base = from_linen(build_model(args.model, data.num_classes, data.x_train.shape[1:], **extra),
                      input_shape=data.x_train.shape[1:], num_classes=data.num_classes, name=args.model)
    public, train, held = split(data, size["clients"], args.seed)
    lr = LR[model_kind]
    t0 = time.perf_counter()
    base_vars = pretrain(base, data, public, size, args.seed, model_kind)
    pre_acc, pre_ce = Scorer(base)(base_vars, data.x_test, data.y_test)
    ppl = f", perplexity {math.exp(pre_ce):.2f}" if language else ""
    print(f"pre-trained base: test accuracy {pre_acc:.3f}{ppl} ({time.perf_counter() - t0:.0f} s)", flush=True)
    r = size["rank"]
    het = (max(1, r // 4), max(1, r // 2), r)
    wanted = [m for m in args.methods.split(",") if m]
    plan = [(m, None) for m in wanted] + [(m, het) for m in wanted if m in HETEROGENEOUS]
    rows = []
    for name, ranks in plan:
        if name not in METHODS:
            print(f"skip {name}: not registered")
            continue
        row = run_row(name, ranks, base, base_vars, data, train, held, size, args.seed, lr, model_kind, language)
        rows.append(row)
        ppl = f"  ppl {row['global_perplexity']:6.2f}/{row['personal_perplexity']:6.2f}" if language else ""
        print(f"{name + ('@ranks' if ranks else ''):<18} global {row['global_accuracy']:.3f}  personal "
              f"{row['personal_accuracy']:.3f}{ppl}  upload {row['upload_bytes_per_round'] / 1e3:9.1f} kB  "
              f"flops {row['client_flops_per_step'] / 1e6:7.2f} M  memory {row['client_memory_bytes'] / 1e3:7.1f} kB"
              f"  ({row['seconds']} s)", flush=True)
    settings = {**{k: v for k, v in size.items() if k != "model_size"}, "lr": lr,
                "pretrain_optimizer": list(PRETRAIN[model_kind]), "heterogeneous_ranks": list(het),
                "seed": args.seed}
    if model_kind == "transformer":
        settings["model_size"] = model_size if isinstance(shape, str) else vars(shape) | {"name": model_size}
    report = stamp({"benchmark": "lora", "size": args.size, "model": args.model, "dataset": args.dataset,
                    "language_model": language, "device": jax.devices()[0].device_kind,
                    "backend": jax.default_backend(), "settings": settings,
                    "pretrained_accuracy": pre_acc, "pretrained_perplexity": math.exp(pre_ce) if language else None,
                    "rows": rows, "checks": checks(rows), "wall_seconds": round(time.perf_counter() - t0, 1)}, argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    backend = "" if jax.default_backend() == "cpu" else f"-{jax.default_backend()}"
    stem = f"lora-{args.model}-{args.size}{backend}"
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    figure(rows, out / f"{stem}.png", math.exp(pre_ce) if language else pre_acc, language)
    print("checks:", report["checks"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
