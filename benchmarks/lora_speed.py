"""LoRA fine-tuning speed: the engine's round against a plain per-client loop, and against full fine-tuning.

Usage::

    python -m benchmarks.lora_speed [--size tiny] [--clients 32] [--steps 5] [--batch 16] [--rank 8]
                                    [--repeats 5] [--out DIR]

One cohort of ``K`` clients, each ``S`` local steps of ``B`` sequences (``synthetic_lm``'s shape: token ids
``[T]``, a label per position, no padding, so the plain loop's mean cross-entropy is the engine's masked one).
The same ``transformer_lm`` of ``--size`` is trained four ways, every client every round:

* ``plain_full`` / ``plain_lora``: the loop most FL libraries amount to — for each client in turn a
  ``jax.jit``-ted single-client SGD step called ``S`` times from Python, then the ``n_k``-weighted mean.  Under
  LoRA the step differentiates the adapters (and the head) only; the frozen base is an argument, held once.
* ``engine_full`` (FedAvg) / ``engine_lora`` (FedIT, ``--lora RANK``): one :class:`FederatedRound` each, in every
  strategy of ``--strategies`` (default ``stepwise:1`` — what ``fedpartial run`` picks on a CPU — and ``fused``).

Every runner does one warm-up round (compilation; the engine's FedAvg is checked against the plain loop), then
the runners take turns, one timed round each, ``--repeats`` times; the median counts, so load hits them alike.
FLOPs are XLA's count of one compiled client step (the plain loop's), times ``K·S``; the achieved rate is that
over the round time, next to a large float32 matmul's rate measured in the same run (``% of matmul``).
``step_floor_s`` is ``K·S`` times one compiled step alone (the same step called back to back, no Python
between): the time a round would take if nothing but the step's arithmetic counted.  JSON with the device,
date and command goes to ``<out>/lora-speed-<backend>.json``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedpartial._src.bench.kit import best_time, device_info
from fedpartial._src.bench.provenance import stamp
from fedpartial._src.bench.suite import matmul_flops_per_s
from fedpartial._src.core.losses import masked_cross_entropy
from fedpartial._src.core.records import Batch, CohortInfo
from fedpartial._src.core.structure import FROZEN
from fedpartial._src.engine.round import FederatedRound
from fedpartial._src.engine.strategy import parse_strategy
from fedpartial._src.engine.types import Cohort
from fedpartial._src.methods.catalog import get_method
from fedpartial._src.models.adapter import from_linen
from fedpartial._src.models.lora import lora
from fedpartial._src.models.transformer import SIZES as MODEL_SIZES
from fedpartial._src.models.transformer import TransformerLM, TransformerSize

ROOT = pathlib.Path(__file__).resolve().parents[1]
SEQ_LEN, VOCAB = 32, 64 + 2  # synthetic_lm's defaults: 64 words, ids 0 and 1 reserved
LR = 0.05
#: the transformer's sizes; ``micro`` (one narrow block) is the smoke test's, a fraction of ``tiny``'s compile time
SIZES = {**MODEL_SIZES, "micro": TransformerSize(layers=1, d_model=16, heads=2, mlp=32)}


def cohort_data(k: int, steps: int, batch: int, seed: int) -> Cohort:
    """``k`` clients' ``steps`` batches of full-length random sequences with their next-token labels."""
    rng = np.random.default_rng(seed)
    x = rng.integers(2, VOCAB, (k, steps, batch, SEQ_LEN + 1)).astype(np.int32)
    sizes = rng.integers(steps * batch, 4 * steps * batch + 1, k).astype(np.float32)
    return Cohort(Batch(x[..., :-1], x[..., 1:], np.ones((k, steps, batch), bool), np.ones((k, steps), bool)),
                  CohortInfo(np.arange(k, dtype=np.int32), sizes, np.ones((k,), bool)))


class PlainLoop:
    """FedAvg (on a LoRA model: FedIT) as a per-client Python loop over one jitted single-client SGD step.

    Only the fedpartial ``Model`` (its ``apply``) is shared with the engine.  The step differentiates the
    ``params`` collection; a LoRA model's frozen base is passed in unchanged, once, to every call."""

    def __init__(self, model, lr: float):
        self.model, self.optimizer = model, optax.sgd(lr)

        def loss(params, frozen, x, y):
            variables = {"params": params, **({FROZEN: frozen} if frozen else {})}
            logits = model.apply(variables, x, True)[0]
            return masked_cross_entropy(logits, y, jnp.ones(x.shape[:1], bool))

        def step(params, frozen, opt_state, x, y):
            value, grads = jax.value_and_grad(loss)(params, frozen, x, y)
            updates, opt_state = self.optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, value

        self.step = jax.jit(step)

    def __call__(self, variables: dict, cohort: Cohort) -> dict:
        params, frozen = variables["params"], variables.get(FROZEN, {})
        x, y = cohort.data.x, cohort.data.y
        k, s = x.shape[:2]
        clients = []
        for c in range(k):
            p, opt_state = params, self.optimizer.init(params)
            for t in range(s):
                p, opt_state, _ = self.step(p, frozen, opt_state, x[c, t], y[c, t])
            clients.append(p)
        w = jnp.asarray(cohort.info.num_samples / cohort.info.num_samples.sum(), jnp.float32)
        mean = jax.tree.map(lambda *leaves: jnp.tensordot(w, jnp.stack(leaves), axes=1), *clients)
        return {**variables, "params": mean}

    def step_flops(self, variables: dict, cohort: Cohort) -> float:
        """XLA's FLOP count of one compiled client step."""
        params, frozen = variables["params"], variables.get(FROZEN, {})
        args = (params, frozen, self.optimizer.init(params), cohort.data.x[0, 0], cohort.data.y[0, 0])
        cost = self.step.lower(*args).compile().cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        return float(cost.get("flops", 0.0))

    def step_floor(self, variables: dict, cohort: Cohort, repeats: int) -> float:
        """Seconds of one compiled step called back to back (the best of ``repeats`` runs of 20)."""
        params, frozen = variables["params"], variables.get(FROZEN, {})
        x, y = cohort.data.x[0, 0], cohort.data.y[0, 0]
        opt_state = self.optimizer.init(params)

        def twenty():
            p, o = params, opt_state
            for _ in range(20):
                p, o, _ = self.step(p, frozen, o, x, y)
            return p

        return best_time(twenty, repeats) / 20


def block(tree):
    return jax.block_until_ready(tree)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--strategies", default="stepwise:1,fused")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    k, s, b = args.clients, args.steps, args.batch

    base = from_linen(TransformerLM(num_classes=VOCAB, size=SIZES[args.size]), input_shape=(SEQ_LEN,),
                      num_classes=VOCAB, name="transformer_lm")
    adapted = lora(base, args.rank)
    data = cohort_data(k, s, b, seed=0)
    matmul = matmul_flops_per_s()
    print(f"matmul: {matmul['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s")

    runners, flops, floors, checks = {}, {}, {}, {}
    for kind, model, method in (("full", base, "fedavg"), ("lora", adapted, "fedit")):
        start = jax.device_get(model.init_variables(jax.random.key(0)))
        plain = PlainLoop(model, LR)
        runners[f"plain_{kind}"] = (lambda p=plain, v=start: block(p(v, data)))
        flops[kind] = plain.step_flops(start, data)
        floors[kind] = k * s * plain.step_floor(start, data, args.repeats)
        for name in args.strategies.split(","):
            r = FederatedRound(model, get_method(method), num_clients=k, cohort_size=k,
                               client_optimizer=optax.sgd(LR), strategy=parse_strategy(name))
            state0 = r.init(jax.random.key(0))
            state0 = state0._replace(variables=jax.device_put(start))
            fresh = jax.device_get(state0)

            def one(r=r, fresh=fresh):
                return block(r(jax.device_put(fresh), data, jax.random.key(1))[0])

            runners[f"engine_{kind}[{name}]"] = one
        if kind == "full":  # FedAvg in the engine is the plain loop, up to float order
            got = runners[f"engine_full[{args.strategies.split(',')[0]}]"]().variables["params"]
            want = runners["plain_full"]()["params"]
            checks["engine_fedavg_matches_plain_loop_max_abs"] = float(max(
                np.max(np.abs(np.asarray(a) - np.asarray(b_))) for a, b_ in
                zip(jax.tree.leaves(got), jax.tree.leaves(want))))

    warm = {}
    for name, fn in runners.items():  # warm-up: compilation
        t0 = time.perf_counter()
        fn()
        warm[name] = time.perf_counter() - t0
    times = {name: [] for name in runners}
    for _ in range(args.repeats):  # take turns, one timed round each
        for name, fn in runners.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)

    rows = []
    for name, ts in times.items():
        kind = "lora" if "lora" in name else "full"
        median = statistics.median(ts)
        round_flops = k * s * flops[kind]
        rows.append({"runner": name, "round_s": median, "rounds": ts, "first_round_s": warm[name],
                     "round_flops": round_flops, "achieved_flops_per_s": round_flops / median,
                     "percent_of_matmul": 100 * round_flops / median / matmul["matmul_flops_per_s"],
                     "step_floor_s": floors[kind]})
    by = {r["runner"]: r for r in rows}
    for r in rows:
        kind = "lora" if "lora" in r["runner"] else "full"
        r["speedup_vs_plain_loop"] = by[f"plain_{kind}"]["round_s"] / r["round_s"]
        if kind == "lora":
            twin = r["runner"].replace("lora", "full")
            r["speedup_vs_full_finetuning"] = by[twin]["round_s"] / r["round_s"]
    params = {kind: int(sum(np.size(a) for a in jax.tree.leaves(jax.eval_shape(
        m.init_variables, jax.random.key(0))["params"]))) for kind, m in (("full", base), ("lora", adapted))}

    print(f"{'runner':<26}{'round s':>9}{'vs plain':>9}{'vs full':>9}{'GFLOP/s':>9}{'% matmul':>9}{'floor s':>9}")
    for r in rows:
        print(f"{r['runner']:<26}{r['round_s']:9.3f}{r['speedup_vs_plain_loop']:9.2f}"
              f"{r.get('speedup_vs_full_finetuning', float('nan')):9.2f}{r['achieved_flops_per_s'] / 1e9:9.2f}"
              f"{r['percent_of_matmul']:9.1f}{r['step_floor_s']:9.3f}")
    report = stamp({"benchmark": "lora_speed", "device": device_info(), **matmul,
                    "settings": {"size": args.size, "clients": k, "local_steps": s, "batch": b, "seq_len": SEQ_LEN,
                                 "vocab": VOCAB, "rank": args.rank, "lr": LR, "repeats": args.repeats},
                    "trained_parameters": params, "step_flops": flops, "checks": checks, "rows": rows}, argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"lora-speed-{jax.default_backend()}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
