"""The built-in methods on a transformer language model: each runs (finite, and an element nobody uploaded keeps
its global value bit for bit) or is refused in one sentence naming what to change.

The models are ``transformer_lm``s of the tiny size's structure at a quarter of its width (d = 16; 11 tokens,
sequences of 6); their labels are per position (next tokens, -1 after the end).  The layer-wise methods the
transformers are for (FedLDF, FedPart, EmbracingFL, DepthFL, InclusiveFL, FedPer, FedRep) and FedAvg run in the
default suite, and so does the rest of the catalogue, each method or one that takes the same path on a transformer
(the others with ``-m slow``): the MLP contract cannot stand in for it (pre-norms on a layer's inputs, residual
streams and per-position labels broke FedADP, FedDHE and MOON until this test ran them).
The LoRA methods run on the transformer with rank-2 adapters on every block (and FlexLoRA/HetLoRA with rank
tiers 1 and 2).  The whole engine contract (strategies, padding, determinism) is test_contract.py's, on the small
MLPs.

What it costs is XLA compiling one round per method, so each case compiles the cheapest program that shows it
(measured cold, 2 workers on a busy 2-core machine: 1534 CPU-seconds for the file before, 772 after, about half;
then 795 -> 373 for the last two points below, on a machine at a load average of ~24):

* one block (embedding, pre-norms, attention, MLP, final norm, head: every kind of layer and both residual
  streams) for every method but the depth-tiered ones; DepthFL, InclusiveFL and FedPart's ``--train-unit block``
  need two identical blocks (a prefix of the blocks per tier, momentum distilled from block1 into block0, a unit
  per block) and get the two-block model;
* the whole-cohort fused round (``fused``: the clients vmapped once), not ``fused:2``, whose ``lax.map`` over
  chunks of K = 3 compiles the client's training twice (a full chunk and the remainder); chunked and stepwise
  rounds equal the fused one for every method in test_contract.py;
* XLA's -O0 (``engine_compiled_at_o0``): a round of a few tiny steps, compared only with itself (what nobody
  uploaded, a resumed round);
* the entries that take the same path on a transformer as one that runs by default are ``slow`` (``SAME_PATH_AS``
  below says which), as FedJS and plain HetLoRA are in test_contract.py.
"""

import jax
import numpy as np
import optax
import pytest

from fedpartial._src.core import masks
from fedpartial._src.core.errors import UserError
from fedpartial._src.core.types import Batch, Holdout, ServerData, client_sgd
from fedpartial._src.data.language import next_token_targets
from fedpartial._src.engine import strategy as strategies
from fedpartial._src.engine.round import FederatedRound
from fedpartial._src.engine.types import Cohort
from fedpartial._src.methods.base import CohortInfo
from fedpartial._src.methods.catalog import METHODS
from fedpartial._src.models.adapter import from_linen
from fedpartial._src.models.lora import lora
from fedpartial._src.models.lora_ranks import with_lora_ranks
from fedpartial._src.models.transformer import TransformerLM, TransformerSize
from tests.test_contract import BUILDERS, ON_LORA, ON_LORA_RANKS, ON_STAGED

N, K, V, T = 8, 3, 11, 6
#: the structure of the tiny size (every module) at a quarter of its width: the same program, less work; one block
#: has every kind of layer (and compiles a round in 1.5-1.7x less CPU time), two are for the methods that tell
#: blocks apart
MICRO = TransformerSize(layers=2, d_model=16, heads=2, mlp=32)
ONE_BLOCK = TransformerSize(layers=1, d_model=16, heads=2, mlp=32)
#: the methods that need two identical blocks: depth tiers train a prefix of them, InclusiveFL distils the deeper
#: block's update into the shallower one
TWO_BLOCKS = {"depthfl", "inclusivefl"}
KEY = jax.random.key(0)
# Rounds of a few tiny steps, each compared only with itself: at -O0 (tests/conftest.py says why)
pytestmark = pytest.mark.usefixtures("engine_compiled_at_o0")

#: the methods that cannot train a transformer, and their one-sentence refusal: dropping single neurons needs a
#: chain of layers (a residual block is not one), width tiers need a model with a width-reduced version, and
#: FedDHE's server-side label estimate needs one label per example (a language model has one per position)
NEURONS = "neuron-level masks need a sequential model|drops single neurons"
WIDTH = "width-reduced version"
REFUSED = {**dict.fromkeys(("fedspu", "feddrop", "hermes", "fedmp", "prunefl", "afd", "fedselect", "fedad",
                            "feddhad"), NEURONS),
           "fjord": f"{NEURONS}|{WIDTH}", "fedrolex": WIDTH,
           "feddhe": "one label per example"}


def tokens(rng, shape):
    """Right-padded token ids ``[..., T]`` (lengths 3..T) and their next-token labels."""
    x = rng.integers(2, V, shape + (T,)).astype(np.int32)
    lengths = rng.integers(3, T + 1, shape)
    x = np.where(np.arange(T) < lengths[..., None], x, 0).astype(np.int32)
    return x, next_token_targets(x.reshape(-1, T)).reshape(x.shape)


def lm_cohorts(rounds=2, steps=3, batch=5, seed=0):
    """Unequal clients (3, 1, 2 real steps; 5, 2, 4 real sequences), different cohorts each round."""
    out = []
    for t in range(rounds):
        rng = np.random.default_rng([seed, t])
        ids = np.sort(rng.choice(N, K, replace=False)).astype(np.int32)
        x, y = tokens(rng, (K, steps, batch))
        step_mask = np.arange(steps)[None] < np.array([3, 1, 2])[:, None]
        example_mask = (np.arange(batch)[None, None] < np.array([5, 2, 4])[:, None, None]) & step_mask[..., None]
        x = np.where(example_mask[..., None], x, 0)
        y = np.where(example_mask[..., None], y, 0)
        hx, hy = tokens(rng, (K, 4))
        info = CohortInfo(ids, example_mask.sum(axis=(1, 2)).astype(np.float32), np.ones(K, bool))
        out.append(Cohort(Batch(x, y, example_mask, step_mask), info, Holdout(hx, hy, np.ones((K, 4), bool))))
    return out


def label_counts():
    return np.random.default_rng(3).integers(0, 6, (N, V)).astype(np.float32) + np.eye(N, V, dtype=np.float32)


def server_data():
    x, y = tokens(np.random.default_rng(4), (6,))
    return ServerData(x, y)


def transformer(size):
    return from_linen(TransformerLM(num_classes=V, size=size), input_shape=(T,), num_classes=V, name="transformer_lm")


@pytest.fixture(scope="module")
def lm():
    """The two-block transformer."""
    return transformer(MICRO)


@pytest.fixture(scope="module")
def lm1():
    """The one-block transformer."""
    return transformer(ONE_BLOCK)


@pytest.fixture(scope="module")
def data():
    return lm_cohorts()


def build(model, method):
    return FederatedRound(model, method, num_clients=N, cohort_size=K, client_optimizer=client_sgd(0.1, momentum=0.9),
                          server_optimizer=optax.sgd(1.0), strategy=strategies.fused(), rounds=4,
                          record_decisions=True, label_counts=label_counts(), server_data=server_data(),
                          bn_policy="static")


def one_round(lm, data, name):
    method = BUILDERS[name]()
    if name in ON_LORA_RANKS:
        lm = with_lora_ranks(lora(lm, 2), (1, 2))
    elif name in ON_LORA:
        lm = lora(lm, 2)
    model = method.adapt_model(lm) if name in ON_STAGED else lm
    r = build(model, method)
    before = jax.device_get(r.init(KEY))
    after, metrics = r(r.init(KEY), data[0], jax.random.fold_in(KEY, 0))
    return r, before, jax.device_get(after), jax.device_get(metrics)


#: the same code path on a transformer as an entry that runs by default, ``slow``: FedJS is FedDH's weighting with
#: (υ, b) never stepped; plain HetLoRA and FlexLoRA are ``hetlora-ranks`` and ``flexlora-ranks`` with every client at
#: rank 2; Random and HDFL upload the layers (``masks.from_layers``) of clients the server draws, FedLDF those of
#: the clients its divergences over the transformer's layers choose; LG-FedAvg is FedPer's ``personal_layers`` with
#: the other layers personal; FedProx's objective is FedAvg's with Ditto's proximal penalty (``with_penalty(
#: proximal_term)``, its personal step's); FedSA-LoRA (``personal_parts``, as FedBN) runs on the transformer, with
#: every wrapper, in test_combinations_on_a_transformer below
SAME_PATH_AS = {"fedjs": "feddh", "hetlora": "hetlora-ranks", "flexlora": "flexlora-ranks", "random": "fedldf",
                "hdfl": "fedldf", "lgfedavg": "fedper", "fedprox": "ditto",
                "fedsa_lora": "test_combinations_on_a_transformer[fedsa_lora]"}
NAMES = [pytest.param(n, marks=pytest.mark.slow) if n in SAME_PATH_AS else n
         for n in [*METHODS, *sorted(ON_LORA_RANKS)]]


@pytest.mark.parametrize("name", NAMES)
def test_method_runs_on_a_transformer_or_is_refused(lm, lm1, data, name):
    """(``SAME_PATH_AS``, ``slow``: the same path as the entry it names, which runs by default.)"""
    model = lm if name in TWO_BLOCKS else lm1
    if name in REFUSED:
        with pytest.raises(UserError, match=REFUSED[name]) as refusal:
            one_round(model, data, name)
        assert "\n" not in str(refusal.value) and str(refusal.value).endswith(".")
        return
    r, before, after, metrics = one_round(model, data, name)
    for leaf in jax.tree.leaves(after.variables):
        assert np.isfinite(leaf).all()
    selection = metrics["decisions"]["selection"]
    g = before.variables["params"]
    expanded = jax.vmap(lambda mask: masks.expand(r.ctx.structure, mask, g))(selection.upload)
    received = jax.tree.map(lambda e: np.tensordot(np.asarray(selection.weights), np.asarray(e, np.float64),
                                                   axes=(0, 0)) > 0, expanded)
    for new, old, got in zip(jax.tree.leaves(after.variables["params"]), jax.tree.leaves(g), jax.tree.leaves(received)):
        np.testing.assert_array_equal(np.asarray(new)[~got], np.asarray(old)[~got])


@pytest.mark.parametrize("adapters", [False, True])
def test_fedpart_trains_one_block_a_round(lm, data, adapters):
    """``--train-unit block``: the cycle's unit is a stage (embed, block0, block1, head); round 2 of the cycle
    trains every layer of block1 (its pre-norms too) and nothing else.  Under LoRA the frozen embedding is no
    unit, so round 1 already reaches block1's adapters."""
    from fedpartial._src.methods.layerwise.fedpart import fedpart, unit_of_layer

    model = lora(lm, 2) if adapters else lm
    stages = [model.stage_names[s] for s in model.stage_of_layer]
    assert list(unit_of_layer(model, "block")) == [{"embed": 0, "block0": 1, "block1": 2, "head": 3}[s] - adapters
                                                    for s in stages]
    r = build(model, fedpart(train_unit="block"))
    state = r.init(KEY)
    state = state._replace(round=np.int32(1 if adapters else 2))
    before = jax.device_get(state.variables["params"])
    after, _ = r(state, data[0], KEY)
    after = jax.device_get(after.variables["params"])
    changed = {"/".join(map(str, p)) for p, a in jax.tree_util.tree_leaves_with_path(
        jax.tree.map(lambda x, y: bool(np.any(x != y)), before, after)) if a}
    changed = {name.replace("['", "").replace("']", "") for name in changed}
    assert changed and all(name.startswith("block1") for name in changed), changed
    expected = {"ln1", "ln2", "attn", "mlp"} if not adapters else {"attn", "mlp"}
    assert {name.split("/")[1] for name in changed} == expected


def test_fedpart_by_block_refuses_a_model_of_one_stage():
    import flax.linen as nn

    from fedpartial._src.methods.layerwise.fedpart import unit_of_layer

    class Plain(nn.Module):  # a user's module: no stages
        @nn.compact
        def __call__(self, x, train=False):
            return nn.Dense(3, name="head")(nn.relu(nn.Dense(5, name="fc")(x)))

    mlp = from_linen(Plain(), input_shape=(4,), num_classes=3, name="plain")
    with pytest.raises(UserError, match=r"^fedpart --train-unit block needs a model of several stages .*; use "
                                        r"--train-unit layer\.$"):
        unit_of_layer(mlp, "block")


#: combinations on the transformer, at the smallest size that shows them (one block, the whole-cohort fused round):
#: a LoRA method under rank tiers and a layer-wise method, each with every wrapper it allows stacked around it
#: (test_combinations.py's, on the MLPs, under every strategy)
COMBINED = [("fedit", "ranks", "fused"), ("fedldf", None, "fused"), ("fedsa_lora", "lora", "fused")]


@pytest.mark.parametrize("name, adapters, strategy", COMBINED, ids=[c[0] for c in COMBINED])
def test_combinations_on_a_transformer(lm1, data, name, adapters, strategy):
    """No retrace and a resumed round equal bit for bit (the fused round equals the stepwise one for every bare
    method in test_contract.py)."""
    import chex

    from tests.test_combinations import OPT, SERVER, checkpointed, stacked

    model = {"ranks": lambda: with_lora_ranks(lora(lm1, 2), (1, 2)), "lora": lambda: lora(lm1, 2),
             None: lambda: lm1}[adapters]()
    method, refused = stacked(name)
    assert len(refused) < 3, refused

    def make(strategy):
        return FederatedRound(model, stacked(name)[0], num_clients=N, cohort_size=K, client_optimizer=OPT,
                              server_optimizer=SERVER, rounds=4, label_counts=label_counts(),
                              server_data=server_data(), strategy=strategies.parse_strategy(strategy),
                              bn_policy="static")

    r = make(strategy)
    first, _ = r(r.init(KEY), data[0], jax.random.fold_in(KEY, 0))
    traces, restore = r.trace_count, checkpointed(first)
    second = jax.device_get(r(first, data[1], jax.random.fold_in(KEY, 1))[0])
    assert r.trace_count == traces, "round 2 retraced"
    resumed, _ = r(restore(), data[1], jax.random.fold_in(KEY, 1))
    chex.assert_trees_all_equal(jax.device_get(resumed), second)
    for leaf in jax.tree.leaves(second.variables):
        assert np.isfinite(leaf).all()
