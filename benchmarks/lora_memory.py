"""Peak memory of a LoRA round as the cohort grows: the frozen base held once against the base stacked per client.

Usage::

    python -m benchmarks.lora_memory [--model mlp|transformer_lm] [--size tiny|small|...] [--cohorts 4,16,64]
        [--width 1024] [--rank 8] [--stacked-up-to K] [--run] [--out PATH]

The model is an MLP of three ``--width`` hidden Dense layers on 64 inputs (the base: about 2.2M parameters at
width 1024, 8.7 MB), with LoRA adapters of ``--rank`` on every hidden layer and a trained head, or
(``--model transformer_lm``) the zoo's language model of ``--size`` on sequences of 32 tokens, with adapters on
every block's attention projections and MLP (the default targets) and a trained head.  Two rounds of the
same arithmetic are compared, FedAvg over the fused strategy:

* ``held once``: the LoRA model (``fedpartial.models.lora``): the base is the ``frozen`` collection, held once
  and passed unstacked into every client's forward pass;
* ``stacked``: the same model with its base moved into ``params`` and frozen by a train mask (an element mask
  that is off on every base leaf), which is how a frozen base had to be written before: every client's start
  model, local state, gradient, optimizer state and result then hold a copy of it.

For each, the peak is XLA's buffer assignment for the compiled round (arguments + temporaries + outputs −
aliased: the memory the round needs on its device, read from ``compiled.memory_analysis()``, identical on every
run), and the growth per extra client against the smallest cohort.  It must grow by about
K × (adapters + their optimizer state + activations) held once, not K × the base.  JSON with the device, date and
command goes to ``benchmarks/results/lora-memory-<backend>.json`` (the MLP) or
``lora-memory-<model>-<size>-<backend>.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedpartial._src.bench.provenance import stamp
from fedpartial._src.core import masks as masks_lib
from fedpartial._src.core.records import Batch, CohortInfo, ClientPlan, Selection
from fedpartial._src.core.structure import FROZEN, LeafRole, ModelStructure, leaf_paths
from fedpartial._src.core.memory import tree_bytes
from fedpartial._src.engine.round import FederatedRound
from fedpartial._src.engine.strategy import fused
from fedpartial._src.engine.types import Cohort
from fedpartial._src.methods.base import make_method
from fedpartial._src.methods.basic.fedavg import fedavg
from fedpartial._src.models.adapter import from_linen
from fedpartial._src.models.lora import lora


class Wide(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = x.reshape((x.shape[0], -1))
        for i in range(3):
            x = nn.relu(nn.Dense(self.width, name=f"fc{i + 1}")(x))
        return nn.Dense(10, name="head")(x)


def stacked_twin(model):
    """``model`` (a LoRA model) with its base moved into ``params`` (whole-layer leaves), and the element mask
    ``[K]``-free tree that is on for the adapters and head only."""
    s = model.structure
    roles = {c: dict(r) for c, r in s.roles.items() if c != FROZEN}
    roles["params"].update({p: r for p, r in s.roles[FROZEN].items()})
    twin_structure = ModelStructure(layers=s.layers, roles=roles, sequential=False)

    def init(key, x):
        v = model.init(key, x)
        params = jax.tree.map(lambda a: a, v["params"])
        for path, leaf in leaf_paths(v[FROZEN]):
            node = params
            for k in path[:-1]:
                node = node.setdefault(k, {})
            node[path[-1]] = leaf
        return {c: t for c, t in v.items() if c != FROZEN} | {"params": params}

    frozen_paths = set(s.roles[FROZEN])

    def split(variables):
        params, frozen = {}, {}
        for path, leaf in leaf_paths(variables["params"]):
            node = frozen if path in frozen_paths else params
            for k in path[:-1]:
                node = node.setdefault(k, {})
            node[path[-1]] = leaf
        return {**variables, "params": params, FROZEN: frozen}

    def apply(variables, x, train, example_mask=None):
        return model.apply(split(variables), x, train, example_mask)

    twin = dataclasses.replace(model, init=init, apply=apply, structure=twin_structure, lora=None, run_stages=None,
                               stage_names=("model",), stage_of_layer=())
    return twin, frozen_paths


def base_frozen_by_masks(twin, frozen_paths):
    """FedAvg training and uploading only the adapters and head of ``twin`` (an element mask per leaf)."""
    params = jax.eval_shape(twin.init_variables, jax.random.key(0))["params"]

    def mask(k):
        elements = jax.tree.unflatten(jax.tree.structure(params), [
            jnp.full((k,), path not in frozen_paths) for path, _ in leaf_paths(params)])
        return masks_lib.with_elements(masks_lib.full(twin.structure, (k,)), elements)

    def plan(ctx, view):
        return ClientPlan(train=mask(ctx.cohort_size))

    def select(ctx, view):
        k = ctx.cohort_size
        return Selection(upload=mask(k), weights=view.cohort.num_samples, extra_upload_bytes=jnp.zeros((k,), jnp.int32))

    return make_method("fedavg-masked-base", plan=plan, select=select)


SEQ_LEN, VOCAB = 32, 66  # the language model's sequences: synthetic_lm's shape


def cohort(k: int, steps: int, batch: int, tokens: bool = False) -> Cohort:
    rng = np.random.default_rng(0)
    if tokens:  # full-length sequences and their next tokens
        ids = rng.integers(2, VOCAB, (k, steps, batch, SEQ_LEN + 1)).astype(np.int32)
        x, y = ids[..., :-1], ids[..., 1:]
    else:
        x = rng.normal(size=(k, steps, batch, 64)).astype(np.float32)
        y = rng.integers(0, 10, (k, steps, batch)).astype(np.int32)
    return Cohort(Batch(x, y, np.ones((k, steps, batch), bool), np.ones((k, steps), bool)),
                  CohortInfo(np.arange(k, dtype=np.int32), np.full((k,), float(steps * batch), np.float32),
                             np.ones((k,), bool)))


def peak(model, method, k: int, steps: int, batch: int, run: bool = False) -> dict:
    """XLA's memory analysis of one compiled fused round; with ``run``, also the round run twice (the second
    timed) and, on an accelerator, the device's peak bytes in use."""
    r = FederatedRound(model, method, num_clients=k, cohort_size=k, strategy=fused(),
                       client_optimizer=optax.sgd(0.01, momentum=0.9))
    state = jax.eval_shape(r.pure_init, jax.random.key(0))
    c = cohort(k, steps, batch, tokens=model.input_shape == (SEQ_LEN,))
    compiled = jax.jit(r.pure_round).lower(state, c, jax.random.key(1)).compile()
    m = compiled.memory_analysis()
    total = m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
    out = {"peak_bytes": int(total), "arguments": int(m.argument_size_in_bytes),
           "temporaries": int(m.temp_size_in_bytes), "outputs": int(m.output_size_in_bytes),
           "state_bytes": tree_bytes(state)}
    if run:
        state = r.init(jax.random.key(0))
        for t in range(2):
            start = time.perf_counter()
            state, metrics = r(state, c, jax.random.key(t))
            jax.block_until_ready(metrics["train_loss"])
            out["round_s"] = time.perf_counter() - start
        stats = jax.devices()[0].memory_stats() or {}
        out["device_peak_bytes_in_use"] = stats.get("peak_bytes_in_use")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("mlp", "transformer_lm"), default="mlp")
    ap.add_argument("--size", default="tiny", help="the transformer's --model-size")
    ap.add_argument("--cohorts", default="4,16,64")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--stacked-up-to", type=int, default=None,
                    help="measure the stacked baseline only for cohorts up to this size (default: all)")
    ap.add_argument("--run", action="store_true", help="also run each held-once round (time, device peak)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cohorts = [int(k) for k in args.cohorts.split(",")]
    if args.model == "transformer_lm":
        from fedpartial._src.models.transformer import SIZES, TransformerLM

        base = from_linen(TransformerLM(num_classes=VOCAB, size=SIZES[args.size]), input_shape=(SEQ_LEN,),
                          num_classes=VOCAB, name=f"transformer_lm-{args.size}")
    else:
        base = from_linen(Wide(args.width), input_shape=(64,), num_classes=10, name=f"mlp{args.width}x3")
    model = lora(base, args.rank)
    twin, frozen_paths = stacked_twin(model)
    shapes = jax.eval_shape(model.init_variables, jax.random.key(0))
    sizes = {"base_bytes": tree_bytes(shapes[FROZEN]), "trained_bytes": tree_bytes(shapes["params"])}
    rows = []
    for k in cohorts:
        once = peak(model, fedavg(), k, args.steps, args.batch, run=args.run)
        stacked = None
        if args.stacked_up_to is None or k <= args.stacked_up_to:
            stacked = peak(twin, base_frozen_by_masks(twin, frozen_paths), k, args.steps, args.batch)
        rows.append({"cohort": k, "held_once": once, "stacked": stacked})
        print(f"K={k:5d}  held once {once['peak_bytes'] / 2**20:9.1f} MiB   stacked "
              + ("not measured" if stacked is None else f"{stacked['peak_bytes'] / 2**20:9.1f} MiB"), flush=True)
    k0, first = cohorts[0], rows[0]
    for row in rows[1:]:
        dk = row["cohort"] - k0
        for kind in ("held_once", "stacked"):
            if row[kind] is not None and first[kind] is not None:
                row[kind]["bytes_per_extra_client"] = (row[kind]["peak_bytes"] - first[kind]["peak_bytes"]) / dk
    report = stamp({"what": "peak bytes of one compiled fused FedAvg round of a LoRA model (XLA's buffer "
                            "assignment), base held once vs stacked per client", "model": base.name,
                    "rank": args.rank, "steps": args.steps, "batch": args.batch, **sizes, "rows": rows,
                    "device": str(jax.devices()[0].device_kind), "backend": jax.default_backend()})
    stem = "lora-memory" if args.model == "mlp" else f"lora-memory-{args.model}-{args.size}"
    out = args.out or os.path.join("benchmarks", "results", f"{stem}-{jax.default_backend()}.json")
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"base {sizes['base_bytes'] / 2**20:.1f} MiB, trained {sizes['trained_bytes'] / 2**20:.2f} MiB; wrote {out}")
    return report


if __name__ == "__main__":
    main()
