"""Where a round of the peer benchmark's CNN spends its time, per core: one client's SGD step split into its layers,
in JAX (XLA:CPU, one thread, as each device of the split over the cores runs) and in PyTorch (one thread, as each
Flower actor runs).

Usage (needs the ``peers`` extra for the PyTorch side)::

    python -m benchmarks.peers_profile [--model cnn] [--batch 32] [--side 28] [--repeats 50] [--out PATH]

Each piece is jitted (JAX) or run eagerly (PyTorch) on the same shapes, warmed up, then timed ``--repeats`` times;
the best of 5 medians is kept.  The pieces: the whole step (forward, backward, SGD with momentum), and the forward
plus backward of each layer alone on its input (the convolutions with their ReLU and pooling, the dense head).
The JSON names the device, date, command and versions; each side runs in its own process so its threading is set
before its library starts.

Then both sides run one client's local training alone on one core, and one client per core all at once, as a round
split over the cores runs them (JAX: ``--local-steps`` steps in a ``lax.scan`` with the ``--impl`` lowering, on
each single-threaded XLA:CPU device, all dispatched together; PyTorch: one process per core, one thread each, as
Flower's actors, started together), each side timing its local trainings for ``--window`` seconds (medians).  What
the cores give together (``throughput``: clients at once × a step alone / a step side by side) bounds a round:
``cohort × local steps × a step side by side / cores`` seconds, were nothing but the steps to take time.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def best_median(run, repeats: int) -> float:
    """Seconds a call: the best of 5 medians of ``repeats`` timed calls after a warm-up."""
    run()
    medians = []
    for _ in range(5):
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        medians.append(statistics.median(times))
    return min(medians)


def jax_side(model: str, batch: int, side: int, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp
    import optax

    from benchmarks.peers_fedpartial import engine_model
    from benchmarks.peers_rows import Row
    from fedpartial._src.models.pooling import max_pool

    row = Row(model, side, 1, 1, 1, 1, batch)
    m = engine_model(row)
    variables = m.init_variables(jax.random.key(0))
    x = jnp.asarray(jax.random.normal(jax.random.key(1), (batch, side, side, 1)))
    y = jnp.arange(batch) % 10
    opt = optax.sgd(0.05, momentum=0.9)
    opt_state = opt.init(variables["params"])

    def loss(params, x, y):
        logits, _ = m.apply({**variables, "params": params}, x, True)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def step(params, opt_state, x, y):
        grads = jax.grad(loss)(params, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def timed(fn, *args):
        return best_median(lambda: jax.block_until_ready(fn(*args)), repeats)

    params = variables["params"]
    out = {"step_s": timed(step, params, opt_state, x, y)}
    # each layer alone, forward and backward on its own input
    c1 = jax.random.normal(jax.random.key(2), (5, 5, 1, 16 if model == "cnn" else 32))
    c2 = jax.random.normal(jax.random.key(3), (5, 5, c1.shape[-1], 2 * c1.shape[-1]))
    h1 = jnp.ones((batch, side // 2, side // 2, c1.shape[-1]))

    def conv_block(w, h):
        z = jax.lax.conv_general_dilated(h, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        z = jax.nn.relu(z)
        return max_pool(z).sum()  # the zoo's pooling

    block = jax.jit(jax.value_and_grad(conv_block, argnums=(0, 1)))
    out["conv1_s"] = timed(block, c1, x)
    out["conv2_s"] = timed(block, c2, h1)
    flat = jnp.ones((batch, (side // 4) ** 2 * c2.shape[-1]))
    head = [p for p in jax.tree.leaves(params) if p.ndim == 2]

    def dense(ws, h):
        for w in ws[:-1]:
            h = jax.nn.relu(h @ w)
        return (h @ ws[-1]).sum()

    out["dense_s"] = timed(jax.jit(jax.grad(dense, argnums=(0, 1))), head, flat)
    out["versions"] = {"jax": jax.__version__}
    return out


def window_median(run, window: float) -> tuple[float, int]:
    """The median seconds of ``run()`` called again and again for ``window`` seconds (at least 3 times), and how
    many times it ran."""
    times, end = [], time.time() + window
    while time.time() < end or len(times) < 3:
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times), len(times)


def jax_side_by_side(model: str, batch: int, side: int, steps: int, window: float, impl: str = "mapped",
                     devices: list | None = None) -> dict:
    """One client's ``steps`` SGD steps (a ``lax.scan``, as ``fused:1`` trains a client) alone on the first of
    ``devices`` (default: every local device), then one client on each of them at once (dispatched together, then
    awaited), each timed for ``window`` seconds after a warm-up.  The median seconds a step."""
    import jax
    import jax.numpy as jnp
    import optax

    from benchmarks.peers_fedpartial import engine_model
    from benchmarks.peers_rows import Row

    devices = devices or jax.local_devices()
    m = engine_model(Row(model, side, 1, 1, 1, 1, batch), impl)
    variables = m.init_variables(jax.random.key(0))
    opt = optax.sgd(0.05, momentum=0.9)

    def local_training(params, opt_state, x, y):
        def step(carry, _):
            p, s = carry
            grads = jax.grad(lambda q: optax.softmax_cross_entropy_with_integer_labels(
                m.apply({**variables, "params": q}, x, True)[0], y).mean())(p)
            updates, s = opt.update(grads, s, p)
            return (optax.apply_updates(p, updates), s), None
        return jax.lax.scan(step, (params, opt_state), None, length=steps)[0]

    train = jax.jit(local_training)
    args = []
    for d in devices:
        x = jax.random.normal(jax.random.key(1), (batch, side, side, 1))
        args.append(jax.device_put((variables["params"], opt.init(variables["params"]), x, jnp.arange(batch) % 10),
                                   d))
    jax.block_until_ready([train(*a) for a in args])
    alone, timed_alone = window_median(lambda: jax.block_until_ready(train(*args[0])), window)
    together, timed_together = window_median(lambda: jax.block_until_ready([train(*a) for a in args]), window)
    return {"impl": impl, "steps": steps, "clients_at_once": len(devices), "alone_step_s": alone / steps,
            "side_by_side_step_s": together / steps, "timed": [timed_alone, timed_together]}


def torch_side(model: str, batch: int, side: int, repeats: int) -> dict:
    import torch
    import torch.nn as nn

    from benchmarks.peers_flower import torch_model

    torch.set_num_threads(1)
    net = torch_model(model, side)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    x = torch.randn(batch, 1, side, side)
    y = torch.arange(batch) % 10

    def step():
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()

    out = {"step_s": best_median(step, repeats)}
    convs = [layer for layer in net if isinstance(layer, nn.Conv2d)]
    inputs = [x.clone().requires_grad_(True), torch.ones(batch, convs[0].out_channels, side // 2, side // 2,
                                                         requires_grad=True)]
    for i, (conv, h) in enumerate(zip(convs, inputs), 1):
        def block(conv=conv, h=h):
            nn.functional.max_pool2d(torch.relu(conv(h)), 2).sum().backward()
        out[f"conv{i}_s"] = best_median(block, repeats)
    linears = [layer for layer in net if isinstance(layer, nn.Linear)]
    flat = torch.ones(batch, linears[0].in_features, requires_grad=True)

    def dense():
        h = flat
        for layer in linears[:-1]:
            h = torch.relu(layer(h))
        linears[-1](h).sum().backward()

    out["dense_s"] = best_median(dense, repeats)
    out["versions"] = {"torch": torch.__version__}
    return out


def torch_local_training(model: str, batch: int, side: int, steps: int, window: float, start_at: float = 0.0) -> dict:
    """One client's ``steps`` SGD steps in this process, one thread, warmed up, then run again and again for
    ``window`` seconds from ``start_at`` (a ``time.time()`` that processes started together wait for, so that each
    is busy for the whole of the others' timing).  The median seconds a step."""
    import torch
    import torch.nn as nn

    from benchmarks.peers_flower import torch_model

    torch.set_num_threads(1)
    net = torch_model(model, side)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    x, y = torch.randn(batch, 1, side, side), torch.arange(batch) % 10

    def local_training():
        for _ in range(steps):
            opt.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
            opt.step()

    local_training()
    time.sleep(max(0.0, start_at - time.time()))
    seconds, timed = window_median(local_training, window)
    return {"step_s": seconds / steps, "timed": timed}


def torch_side_by_side(args) -> dict:
    """:func:`torch_local_training` in one process alone, then in one process per core at once."""
    cores = os.cpu_count() or 1

    def start(start_at: float) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "benchmarks.peers_profile", "--child", "torch-train", "--model", args.model,
               "--batch", str(args.batch), "--side", str(args.side), "--window", str(args.window),
               "--local-steps", str(args.local_steps), "--start-at", str(start_at)]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)

    def results(procs: list) -> list[dict]:
        out = []
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=1800)
            line = next((ln for ln in stdout.splitlines() if ln.startswith("PROFILE ")), None)
            if line is None:
                raise RuntimeError((stderr or stdout)[-600:])
            out.append(json.loads(line[len("PROFILE "):]))
        return out

    try:
        # alone as side by side: every process imported and warm well before its start
        [alone] = results([start(time.time() + 20.0)])
        together = results([start(time.time() + 20.0) for _ in range(cores)])
    except RuntimeError as e:
        return {"error": str(e)}
    return {"steps": args.local_steps, "clients_at_once": cores, "alone_step_s": alone["step_s"],
            "side_by_side_step_s": statistics.mean(r["step_s"] for r in together),
            "timed": [alone["timed"], *(r["timed"] for r in together)]}


def child(side_name: str, args) -> dict:
    """One side in its own process, its threading set before its library starts."""
    env = dict(os.environ)
    if side_name.startswith("jax"):
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false").strip()
    if side_name == "jax-pair":
        env["XLA_FLAGS"] += f" --xla_force_host_platform_device_count={os.cpu_count() or 1}"
    cmd = [sys.executable, "-m", "benchmarks.peers_profile", "--child", side_name, "--model", args.model,
           "--batch", str(args.batch), "--side", str(args.side), "--repeats", str(args.repeats),
           "--local-steps", str(args.local_steps), "--impl", args.impl, "--window", str(args.window)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=1800)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("PROFILE ")), None)
    if line is None:
        return {"error": (proc.stderr or proc.stdout)[-600:]}
    return json.loads(line[len("PROFILE "):])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="cnn", choices=("cnn", "cnn2c1f"))
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--side", type=int, default=28)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--local-steps", type=int, default=10, help="a client's steps when clients run side by side")
    p.add_argument("--impl", default="mapped", help="the JAX side's convolution lowering side by side (what the "
                   "split's fused:1 runs)")
    p.add_argument("--window", type=float, default=5.0, help="seconds each side times its local trainings alone, "
                   "and again side by side")
    p.add_argument("--child", choices=("jax", "torch", "jax-pair", "torch-train"), default=None,
                   help=argparse.SUPPRESS)
    p.add_argument("--start-at", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "peers-profile-cpu.json"))
    args = p.parse_args(argv)
    if args.child:
        if args.child == "jax-pair":
            got = jax_side_by_side(args.model, args.batch, args.side, args.local_steps, args.window, args.impl)
        elif args.child == "torch-train":
            got = torch_local_training(args.model, args.batch, args.side, args.local_steps, args.window,
                                       args.start_at)
        else:
            got = (jax_side if args.child == "jax" else torch_side)(args.model, args.batch, args.side, args.repeats)
        print("PROFILE " + json.dumps(got))
        return {}
    sides = {name: child(name, args) for name in ("jax", "torch")}
    side_by_side = {"jax": child("jax-pair", args), "torch": torch_side_by_side(args)}
    for got in side_by_side.values():
        if "alone_step_s" in got:
            got["throughput"] = got["clients_at_once"] * got["alone_step_s"] / got["side_by_side_step_s"]
    pieces = ("step_s", "conv1_s", "conv2_s", "dense_s")
    ratio = {k: sides["jax"][k] / sides["torch"][k] for k in pieces
             if k in sides["jax"] and k in sides["torch"]}
    result = {"benchmark": "peers_profile", "command": "python -m benchmarks.peers_profile " + " ".join(argv or
              sys.argv[1:]), "date": datetime.date.today().isoformat(), "time": datetime.datetime.now(
              datetime.UTC).isoformat(timespec="seconds"),
              "device": {"backend": "cpu", "cpu_count": os.cpu_count()}, "loadavg": os.getloadavg(),
              "settings": {"model": args.model, "batch": args.batch, "side": args.side, "repeats": args.repeats,
                           "threads": 1, "local_steps": args.local_steps, "impl": args.impl,
                           "window_s": args.window},
              "sides": sides, "jax_over_torch": ratio, "side_by_side": side_by_side}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for k in pieces:
        print(f"{k:9s} jax {sides['jax'].get(k, float('nan')) * 1e3:7.2f} ms  torch "
              f"{sides['torch'].get(k, float('nan')) * 1e3:7.2f} ms  jax/torch {ratio.get(k, float('nan')):.2f}")
    for name, got in side_by_side.items():
        if "throughput" in got:
            print(f"{name:5s} a step alone {got['alone_step_s'] * 1e3:6.2f} ms, {got['clients_at_once']} clients "
                  f"side by side {got['side_by_side_step_s'] * 1e3:6.2f} ms each: throughput x{got['throughput']:.2f}")
        else:
            print(f"{name:5s} side by side failed: {got.get('error')}")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
