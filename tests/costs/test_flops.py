"""FLOPs of local work: the analytic per-layer count, XLA's count of a compiled step, and the
sub-model estimate (:mod:`fedpartial._src.costs.flops`, applied by :class:`~fedpartial._src.costs.devices.CostModel`)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedpartial._src.costs import devices, flops
from fedpartial._src.engine import graphs
from fedpartial._src.engine.round import FederatedRound
from fedpartial._src.engine.strategy import stepwise
from fedpartial._src.methods import base
from fedpartial._src.methods.submodel import dropout
from fedpartial._src.models.adapter import from_linen
from tests.conftest import make_cohort

# ------------------------------------------------------------------ FLOPs: analytic vs XLA


class TwoDense(nn.Module):
    hidden: int = 64

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.relu(nn.Dense(self.hidden, name="fc1")(x.reshape((x.shape[0], -1))))
        return nn.Dense(10, name="head")(x)


class Widths(nn.Module):
    """conv(c1) → ReLU → pool → conv(c2) → ReLU → pool → flatten → Dense(h) → ReLU → Dense(10), or,
    without convolutions, Dense(c1) → Dense(c2) → Dense(10)."""

    c1: int
    c2: int
    conv: bool = True

    @nn.compact
    def __call__(self, x, train: bool = False):
        if self.conv:
            for i, c in enumerate((self.c1, self.c2)):
                x = nn.Conv(c, (3, 3), padding="SAME", name=f"conv{i + 1}")(x)
                x = nn.max_pool(nn.relu(x), (2, 2), (2, 2))
            x = x.reshape((x.shape[0], -1))
        else:
            x = x.reshape((x.shape[0], -1))
            for i, c in enumerate((self.c1, self.c2)):
                x = nn.relu(nn.Dense(c, name=f"fc{i + 1}")(x))
        return nn.Dense(10, name="head")(x)


def _linen(module, shape):
    return from_linen(module, input_shape=shape, num_classes=10, sequential=True, name=type(module).__name__)


def _zeros_state(fr):
    """A server state of the right shapes, all zeros (compiling a conv model's initialisers is slow on CPU)."""
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(fr.pure_init, jax.random.key(0)))


def _round(model, method, k, sgd_momentum=None):
    return FederatedRound(model, method, num_clients=max(k, 2), cohort_size=k,
                          client_optimizer=optax.sgd(0.1, momentum=sgd_momentum),
                          strategy=stepwise())


def test_dense_step_xla_count_is_close_to_the_analytic_count():
    """Forward 2·in·out per example; backward 2× forward (weight and input gradient), but the
    first layer needs no input gradient: fc1 costs 2·(2·in·h), the head 3·(2·h·c)."""
    b, i, h, c = 64, 96, 128, 10
    model = _linen(TwoDense(h), (i,))
    np.testing.assert_array_equal(flops.layer_forward_flops(model), [2 * i * h, 2 * h * c])
    analytic = flops.training_flops(model, batch_size=b)
    assert analytic == b * (2 * (2 * i * h) + 3 * (2 * h * c)) == 3_637_248
    (cost,) = flops.step_costs(_round(model, base.make_method("fedavg"), 2), make_cohort((i,), k=2, batch=b))
    # XLA also counts bias, ReLU, softmax cross-entropy and the SGD update: a few % on top.
    assert analytic < cost.step_flops < 1.04 * analytic, (cost.step_flops, analytic)
    assert cost.prepare_flops == 0 and cost.step_layers == (0, 1) and cost.prepare_layers == ()
    assert cost.step_peak_bytes is None or cost.step_peak_bytes > 0


def test_conv_forward_count_matches_xla_exactly():
    """Per output position only the kernel taps inside the input count (SAME padding taps multiply zeros)."""

    class Convs(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            x = nn.Conv(4, (3, 3), padding="SAME", use_bias=False, name="a")(x)
            x = nn.Conv(6, (3, 3), strides=2, padding="SAME", use_bias=False, name="b")(x)
            x = nn.Conv(5, (2, 2), padding="VALID", use_bias=False, name="c")(x)
            return nn.Dense(10, use_bias=False, name="head")(x.reshape((x.shape[0], -1)))

    model = _linen(Convs(), (7, 7, 2))
    f = flops.layer_forward_flops(model)
    # a: SAME 3×3 on 7 → per axis 2+3·5+2 = 19 taps, 19² · 2 in · 4 out · 2 FLOPs.
    assert f[0] == 19 ** 2 * 2 * 4 * 2
    variables = jax.eval_shape(model.init_variables, jax.random.key(0))
    x = jax.ShapeDtypeStruct((1, 7, 7, 2), np.float32)
    xla = jax.jit(lambda v, x: model.apply(v, x, False)[0]).lower(variables, x).compile().cost_analysis()
    xla = xla[0] if isinstance(xla, (list, tuple)) else xla
    assert xla["flops"] == f.sum()


def test_scan_loops_count_every_iteration():
    """XLA's cost analysis counts a loop body once (a 16-step scan costs what a 4-step one does);
    the step's count adds the other iterations.  Per iteration of h ← tanh(h·W + x), B = 8, 64
    units: forward 2·8·64·64 = 65,536, backward twice that (dh and dW), plus the elementwise tail."""

    def loss(w, xs):
        def body(h, x):
            return jnp.tanh(h @ w + x), None
        return jax.lax.scan(body, jnp.zeros((8, 64)), xs)[0].sum()

    def args(t):
        return jax.ShapeDtypeStruct((64, 64), jnp.float32), jax.ShapeDtypeStruct((t, 8, 64), jnp.float32)

    raw = [jax.jit(jax.grad(loss)).lower(*args(t)).cost_analysis()["flops"] for t in (4, 16)]
    assert raw[0] == raw[1]  # the bodies counted once: what the correction is for
    f4, f16, f10 = (flops.xla_costs(jax.grad(loss), *args(t)) for t in (4, 16, 10))
    assert f4.source == "lowered"
    f4, f16, f10 = f4.flops, f16.flops, f10.flops
    per_step = (f16 - f4) / 12
    assert (f10 - f4) / 6 == per_step  # linear in the trip count
    assert 3 * 65_536 <= per_step < 1.05 * 3 * 65_536


# ------------------------------------------------------------------ preparation, cache


def _two_tiers(cut):
    def groups(ctx):
        return (base.ClientGroup("strong", 2), base.ClientGroup("weak", 1, graph=graphs.suffix(ctx.model, cut)))
    return base.make_method("tiers", groups=groups)


class Staged(nn.Module):
    """Three stages (fc1, fc2, head), as the zoo's staged models."""

    stage_names = ("fc1", "fc2", "head")

    @nn.compact
    def __call__(self, x, train: bool = False, start: int = 0, stop: int | None = None):
        stop = 3 if stop is None else stop
        if start == 0:
            x = x.reshape((x.shape[0], -1))
        for s in range(start, stop):
            x = nn.Dense((48, 32, 10)[s], name=self.stage_names[s])(x)
            x = nn.relu(x) if s < 2 else x
        return x


def test_a_prepare_stage_is_counted_once_per_round_not_per_step():
    b, steps = 16, 3
    model = _linen(Staged(), (20,))
    fr = _round(model, _two_tiers(2), 3)
    cohort = make_cohort((20,), k=3, steps=steps, batch=b, num_classes=10, real_steps=[3, 2, 3])
    strong, weak = flops.step_costs(fr, cohort)
    assert (strong.step_layers, strong.prepare_layers, strong.prepare_flops) == ((0, 1, 2), (), 0.0)
    assert (weak.step_layers, weak.prepare_layers) == ((2,), (0, 1))
    # The weak step trains the head alone (no prefix inside): 2·(2·32·10)·B plus bias, loss and update
    # (13% on top for this 330-parameter head).
    assert 2 * (2 * 32 * 10) * b < weak.step_flops < 1.2 * 2 * (2 * 32 * 10) * b
    assert weak.step_flops < 0.1 * strong.step_flops
    # The prefix of one batch: forward of fc1 and fc2 only (2·20·48 + 2·48·32 per example, plus bias and ReLU).
    prefix = b * (2 * 20 * 48 + 2 * 48 * 32)
    assert prefix < weak.prepare_flops < 1.05 * prefix
    costs = devices.CostModel(fr)
    per_client = costs.client_flops(cohort, np.array([3, 2, 3]))
    np.testing.assert_allclose(per_client, [3 * strong.step_flops, 2 * strong.step_flops,
                                       3 * (weak.step_flops + weak.prepare_flops)])
    # Once per round: preparing the client's whole data [S, B] costs S × one batch, nothing per step on top.
    start = jax.eval_shape(model.init_variables, jax.random.key(0))
    data = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), cohort.data)
    whole = flops.xla_costs(fr.clients[1].prepare, start, data).flops
    assert whole == pytest.approx(steps * weak.prepare_flops, rel=1e-6)


def test_costs_are_compiled_once_per_shape(monkeypatch):
    model = _linen(TwoDense(8), (6,))
    fr = _round(model, base.make_method("fedavg"), 2)
    calls = []
    real = flops.xla_costs
    monkeypatch.setattr(flops, "xla_costs", lambda *a, **k: calls.append(1) or real(*a, **k))
    costs = devices.CostModel(fr)
    first = costs.group_costs(make_cohort((6,), k=2, batch=4, seed=0))
    again = costs.group_costs(make_cohort((6,), k=2, batch=4, seed=1))  # other values, same shapes
    assert again is first and len(calls) == 1 and costs.compilations == 1
    bigger = costs.group_costs(make_cohort((6,), k=2, batch=8))
    assert len(calls) == 2 and costs.compilations == 2
    assert bigger[0].step_flops > 1.5 * first[0].step_flops  # twice the examples; the update stays


def test_sparse_flops_credit_the_share_a_client_trains():
    """--sparse-flops: a client training every layer's elements costs what the dense step does; one training half
    of every layer saves half of the analytic kernel FLOPs; without densities nothing changes."""
    model = _linen(TwoDense(8), (6,))
    fr = _round(model, base.make_method("fedavg"), 2)
    cohort = make_cohort((6,), k=2, batch=4)
    costs = devices.CostModel(fr)
    steps = np.array([3, 2])
    dense = costs.client_flops(cohort, steps)
    layers = fr.ctx.structure.num_layers
    np.testing.assert_allclose(costs.client_flops(cohort, steps, densities=np.ones((2, layers))), dense)
    half = costs.client_flops(cohort, steps, densities=np.full((2, layers), 0.5))
    kernels = flops.training_flops(model, batch_size=4)  # analytic kernel FLOPs of one step
    np.testing.assert_allclose(dense - half, 0.5 * kernels * steps, rtol=1e-6)


# ------------------------------------------------------------------ sub-model FLOPs


@pytest.mark.parametrize("conv", [False, True], ids=["mlp", "cnn"])
def test_submodel_flops_match_a_physically_smaller_model(conv):
    """A FedDrop client keeping half of every hidden layer against the same network built at
    half width (batch 8, SGD with momentum 0.9).

    MLP 48→40→30→10 keeping 20 and 15 units: XLA counts 66,489 FLOPs for the small model's
    compiled step and the estimate is 67,196 (+1.1%); on pre-optimisation HLO 63,184 against
    63,028 (−0.25%).  CNN 8×8×1, conv 8 and 16 channels (3×3 SAME, pool 2) keeping 4 and 8:
    290,104 against 284,599 (−1.9%); pre-optimisation 256,401 against 256,291 (−0.04%).
    Tolerances: 3% on compiled counts (the compiler's count of a narrower network is not a
    fixed share of the wider one's), 0.5% before optimisation.  The analytic kernel count
    alone (no bias, activations, loss or update) is 79–80% of the compiled count.  A client
    keeping everything costs exactly the full step, which is FedAvg's step."""
    b = 8
    shape, (w1, w2), (k1, k2) = ((8, 8, 1), (8, 16), (4, 8)) if conv else ((48,), (40, 30), (20, 15))
    full = _linen(Widths(w1, w2, conv), shape)
    small = _linen(Widths(k1, k2, conv), shape)
    fr = _round(full, dropout.feddrop(tiers=(0.5, 1.0)), 2, sgd_momentum=0.9)
    cohort = make_cohort(shape, k=2, steps=1, batch=b, num_classes=10, client_ids=[0, 1])  # tiers 0.5 and 1.0
    mask = devices.CostModel(fr, compiled=False).round_dropout(_zeros_state(fr), cohort, jax.random.key(1))
    assert [int(n[0].sum()) for n in mask.neurons] == [k1, k2, 10]
    assert [int(n[1].sum()) for n in mask.neurons] == [w1, w2, 10]
    small_round = _round(small, base.make_method("fedavg"), 2, sgd_momentum=0.9)
    for compiled, tolerance in ((True, 0.03), (False, 0.005)):
        costs = devices.CostModel(fr, compiled=compiled)
        estimate = costs.client_flops(cohort, np.array([1, 1]), mask)
        (small_cost,) = flops.step_costs(small_round, cohort, compiled=compiled)
        assert estimate[0] == pytest.approx(small_cost.step_flops, rel=tolerance), (estimate[0], small_cost)
        assert estimate[1] == costs.group_costs(cohort)[0].step_flops
        if compiled:
            analytic = flops.training_flops(full, jax.tree.map(lambda a: a[:1], mask), batch_size=b)[0]
            assert analytic == flops.training_flops(small, batch_size=b)
            assert 0.75 * small_cost.step_flops < analytic < small_cost.step_flops
    if not conv:  # the unmasked step is FedAvg's step
        (fedavg_cost,) = flops.step_costs(_round(full, base.make_method("fedavg"), 2, sgd_momentum=0.9), cohort,
                                            compiled=False)
        assert estimate[1] == fedavg_cost.step_flops


def test_fedspu_is_not_a_submodel_method():
    """Frozen units stay in the forward pass: FedSPU's XLA count stands, with no dropout."""
    from fedpartial._src.methods.submodel.fedspu import fedspu

    model = _linen(Widths(8, 6, conv=False), (12,))
    fr = _round(model, fedspu(tiers=(0.5, 1.0)), 2)
    cohort = make_cohort((12,), k=2, batch=4, num_classes=10)
    costs = devices.CostModel(fr)
    assert not costs.group_costs(cohort)[0].submodel
    assert costs.round_dropout(_zeros_state(fr), cohort, jax.random.key(1)) is None


def test_simulation_charges_sub_models_for_the_units_their_round_kept():
    """The units come from the round's own plan (engine metrics): the same count as planning it again."""
    from fedpartial._src.experiment.config import RunConfig
    from fedpartial._src.experiment.simulation import Simulation

    sim = Simulation(RunConfig(method="fjord", num_clients=10, cohort_size=5, rounds=1, local_steps=2, batch_size=8,
                               out_dir=None, strategy="stepwise"))
    ids, valid, key, pack_seed = sim.sample_cohort(0)
    cohort = sim.cohort(ids, pack_seed, valid)
    planned = sim.costs.round_dropout(jax.device_get(sim.state), cohort, key)
    record = next(sim.rounds())
    steps = np.full(len(ids), 2)
    expected = sim.costs.client_flops(cohort, steps, planned)
    full = sim.costs.client_flops(cohort, steps, None)
    assert record["client_flops"] == round(float(np.sum(expected)))
    assert record["client_flops"] < np.sum(full)  # the tiers' smaller sub-models cost less
