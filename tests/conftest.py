"""Shared fixtures: tiny models and cohorts small enough to check by hand."""

import gc
import os
import pathlib

import flax.linen as nn
import jax
import numpy as np
import pytest

from fedpartial._src.core import memory
from fedpartial._src.data import ondevice, sources
from fedpartial._src.engine.types import Cohort
from fedpartial._src.methods.base import Batch, CohortInfo
from fedpartial._src.models.adapter import from_linen, from_stages
from fedpartial._src.models.zoo import narrow_units

jax.config.update("jax_numpy_rank_promotion", "raise")

# Most of the suite's time is XLA:CPU compiling small programs.  Its MLIR fusion emitters take about twice as
# long to compile a tiny model's round as the classic emitters (measured 2.2 s against 1.1 s for the contract
# test's fused FedAvg round; the whole suite 22:19 -> 16:43 on 2 cores from a clean clone); the tests compare
# programs compiled the same way, so nothing they prove changes.  LLVM at -O1 instead of -O2 compiles ~15% faster
# and runs these tiny programs as fast (measured: the whole suite 18:15 -> 17:12 on 2 cores, every test passing,
# the bit-for-bit replica checks included; -O0 compiles 40% faster but the benchmark smoke tests, which train
# for real, ran 10x slower).  One LLVM module per program instead of XLA's split into parts compiled in parallel:
# on 2 cores the workers already use both, and splitting a tiny program costs more than it saves (measured: five
# of the transformer contract's rounds at -O0, 23.0-23.7 -> 21.3-21.8 CPU seconds each way in two alternating
# processes, tracing included).  Set before any backend starts; subprocesses (CLI, checkpoint, sharding tests)
# inherit it through the environment.
XLA_TEST_FLAGS = ("--xla_cpu_use_fusion_emitters=false --xla_backend_optimization_level=1 "
                  "--xla_cpu_parallel_codegen_split_count=1")
os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS", ""), XLA_TEST_FLAGS]))

# Many tests compile the same programs (a zoo model's step, evaluation) in fresh closures, which jit's
# in-memory cache cannot share; XLA's persistent cache keys on the program itself, so each is compiled once
# per suite (measured: ~30% less CPU for the benchmark smoke tests on a cold cache).  Subprocesses (CLI,
# checkpoint tests) inherit it through the environment.  The cache lives in pytest's own ignored folder.
_CACHE = pathlib.Path(__file__).resolve().parent.parent / ".pytest_cache" / "jax-compilation"
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(_CACHE))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

# --conv-impl auto measures the lowerings (seconds per model and cohort) and may pick one whose float32 rounding
# differs from lax's: the suite's runs use lax's convolution, as before, and tests/models/test_conv.py and
# tests/engine/test_conv_choice.py check the lowerings and the chooser themselves.  Subprocesses inherit it.
os.environ.setdefault("FEDPARTIAL_CONV_IMPL", "lax")


@pytest.fixture
def engine_compiled_at_o0():
    """The engine's jitted rounds, steps and inits (``runners.base.jit``: the runners', the asynchronous dispatch
    round and server step, the stacked replica round) compiled at XLA's optimization level 0 while the test that
    asks for it runs (``pytest.mark.usefixtures("engine_compiled_at_o0")``); an inlined jit (``functions.round``)
    takes the options of the program it is inlined into, as JAX allows options on a top-level jit only.

    For files of many tiny rounds that compile each method's program and run it for a few steps: their time is
    XLA compiling (measured for the contract's FedLDF: stepwise 4.2 -> 3.1 and fused 5.9 -> 3.5 CPU seconds), and
    what they prove compares programs compiled alike (the persistent cache keys on the options, so nothing is shared
    with the -O1 programs of other files).  Not for benchmarks or long training, which -O0 runs ~10x slower, nor for
    tests that expect two different programs to agree bit for bit: FedRolex's first round equals HeteroFL's at -O1
    (tests/methods/test_fedrolex.py) but not at -O0."""
    from fedpartial._src.engine import asynchronous
    from fedpartial._src.engine import round as round_lib
    from fedpartial._src.engine.runners import base, fused, stepwise, streamed
    from fedpartial._src.experiment import replicas

    original = base.jit

    def jit(fn, **jit_kwargs):
        if jit_kwargs.get("inline"):  # see above: a nested jit with options is an error
            return original(fn, **jit_kwargs)
        return original(fn, compiler_options={"xla_backend_optimization_level": 0}, **jit_kwargs)

    with pytest.MonkeyPatch.context() as patch:
        for module in (base, round_lib, fused, stepwise, streamed, asynchronous, replicas):
            patch.setattr(module, "jit", jit)
        yield


class TinyMLP(nn.Module):
    """Dense(6) → BN → ReLU → Dense(5) → ReLU → Dense(3): three layers, one BatchNorm.

    ``ratio`` < 1: the narrow model of width tiers (⌈ratio·units⌉ hidden units; with ``scaler``, hidden
    outputs ×1/ratio in training, HeteroFL's Scaler)."""

    ratio: float = 1.0
    scaler: bool = True

    @nn.compact
    def __call__(self, x, train: bool = False):
        scale = 1 / self.ratio if self.scaler and train and self.ratio < 1 else 1.0
        x = x.reshape((x.shape[0], -1))
        x = nn.Dense(narrow_units(self.ratio, 6), name="fc1")(x) * scale
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9, name="bn1")(x))
        x = nn.relu(nn.Dense(narrow_units(self.ratio, 5), name="fc2")(x) * scale)
        return nn.Dense(3, name="head")(x)


class TinyCNN(nn.Module):
    """Conv(3) → BN → ReLU → pool → Conv(4) → ReLU → flatten → Dense(3): checks conv→dense wiring."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Conv(3, (3, 3), padding="SAME", name="conv1")(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9, name="bn1")(x))
        x = nn.max_pool(x, (2, 2), (2, 2))
        x = nn.relu(nn.Conv(4, (3, 3), padding="SAME", name="conv2")(x))
        x = x.reshape((x.shape[0], -1))
        return nn.Dense(3, name="head")(x)


@pytest.fixture(scope="session")
def mlp():
    return from_linen(TinyMLP(), input_shape=(4,), num_classes=3, sequential=True, name="tiny_mlp",
                      width=lambda ratio, scaler: TinyMLP(ratio, scaler))


class TinyBlock(nn.Module):
    """Dense → BatchNorm → ReLU: one stage of :func:`staged_mlp`."""

    units: int

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dense(self.units, name="fc")(x.reshape((x.shape[0], -1)))
        return nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9, name="bn")(x))


@pytest.fixture(scope="session")
def staged_mlp():
    """Stages b1, b2, b3 (Dense 5 → BatchNorm → ReLU) and a Dense head: depth tiers hold prefixes of it (default
    depths: moderate 2, weak 1), and b2, b3 have the same shapes (InclusiveFL's transfer between stages)."""
    return from_stages([TinyBlock(5), TinyBlock(5), TinyBlock(5), nn.Dense(3)], input_shape=(4,), num_classes=3,
                       names=("b1", "b2", "b3", "head"), name="staged_mlp")


@pytest.fixture(scope="session")
def cnn():
    return from_linen(TinyCNN(), input_shape=(4, 4, 1), num_classes=3, sequential=True, name="tiny_cnn")


def make_cohort(input_shape, *, k=4, steps=3, batch=5, seed=0, num_classes=3, real_steps=None,
                real_examples=None, client_ids=None) -> Cohort:
    """Random cohort; ``real_steps[k]`` / ``real_examples[k]`` make clients unequal (rest is padding)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(k, steps, batch, *input_shape)).astype(np.float32)
    y = rng.integers(0, num_classes, (k, steps, batch)).astype(np.int32)
    example_mask = np.ones((k, steps, batch), bool)
    step_mask = np.ones((k, steps), bool)
    for i in range(k):
        if real_steps is not None:
            step_mask[i, real_steps[i]:] = False
        if real_examples is not None:
            example_mask[i, :, real_examples[i]:] = False
    example_mask &= step_mask[..., None]
    x = np.where(example_mask.reshape(example_mask.shape + (1,) * len(input_shape)), x, 0.0)
    y = np.where(example_mask, y, 0)
    n = example_mask.sum(axis=(1, 2)).astype(np.float32)
    ids = np.arange(k, dtype=np.int32) if client_ids is None else np.asarray(client_ids, np.int32)
    return Cohort(Batch(x, y, example_mask, step_mask), CohortInfo(ids, n, np.ones((k,), bool)))


def mlp_grad(p, x, y):
    """Mean cross-entropy gradient of the MLP fc1 → ReLU → head, by hand in float64."""
    pre = x @ p["fc1"]["kernel"] + p["fc1"]["bias"]
    h = np.maximum(pre, 0.0)
    logits = h @ p["head"]["kernel"] + p["head"]["bias"]
    prob = np.exp(logits - logits.max(axis=1, keepdims=True))
    prob /= prob.sum(axis=1, keepdims=True)
    dlogits = (prob - np.eye(logits.shape[1])[y]) / len(y)
    dpre = (dlogits @ p["head"]["kernel"].T) * (pre > 0)
    return {"fc1": {"kernel": x.T @ dpre, "bias": dpre.sum(0)},
            "head": {"kernel": h.T @ dlogits, "bias": dlogits.sum(0)}}


def fake_device_memory(monkeypatch, limit_mib: float) -> None:
    """This CPU's memory as an accelerator's of ``limit_mib`` MiB: its free memory is the limit less every array
    made since (so that a copy counts while it is held, and not once let go); the host's RAM stays 64 GiB."""
    gc.collect()
    base = sum(a.nbytes for a in jax.live_arrays())

    def available_bytes(device=None):
        if device is not None:  # the host's RAM (checked for the packed data's host copy)
            return 64 * 2**30, "RAM"
        return int(limit_mib * 2**20) - (sum(a.nbytes for a in jax.live_arrays()) - base), "Fake GPU memory"

    monkeypatch.setattr(memory, "available_bytes", available_bytes)


def count_copies(monkeypatch) -> list:
    """A list that gets an item each time a population is copied to the device (:func:`ondevice.place`)."""
    copies, place = [], ondevice.place
    monkeypatch.setattr(ondevice, "place", lambda *a, **kw: copies.append(1) or place(*a, **kw))
    return copies


def wide_dataset():
    """8,000 examples of 1,000 features, 10 classes: 30.5 MiB of training data, made in a moment."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8000, 1000)).astype(np.float32), rng.integers(0, 10, 8000)
    return sources.ArrayDataset("wide", x, y, x[:100], y[:100], 10)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Warns when ``--dist loadgroup`` lost its groups (pytest 9.2 with pytest-xdist 3.8 does,
    pytest-dev/pytest-xdist#1386): the suite still passes, but each costly grouped fixture (the 4-device
    subprocess, the replica runs) is then built on every worker, adding minutes."""
    if not getattr(config.option, "loadgroup", False):
        return
    lost = [item.nodeid for item in items
            if any(item.iter_markers("xdist_group")) and "@" not in item.nodeid.rsplit("]", 1)[-1]]
    if lost:
        config.issue_config_time_warning(pytest.PytestWarning(
            f"--dist loadgroup did not group {len(lost)} tests marked xdist_group (e.g. {lost[0]}): this pytest "
            f"({pytest.__version__}) drops pytest-xdist's grouping, so grouped fixtures are built once per worker; "
            "install pytest<9.2 (pyproject.toml pins it)."), stacklevel=2)
