"""The BiLSTM text classifier: Flax and plain-numpy references, padding, stages, layer masks, training in the engine."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedpartial._src.costs import footprint as costs
from fedpartial._src.core import masks
from fedpartial._src.data.sources import load_dataset
from fedpartial._src.data.text import first_part
from fedpartial._src.core.errors import UserError
from fedpartial._src.models.registry import MODELS, build_model
from fedpartial._src.models.adapter import from_linen
from fedpartial._src.models.text import BidirectionalLSTM, BiLSTM, sequence_lengths
from fedpartial._src.experiment.config import RunConfig
from fedpartial._src.experiment.simulation import Simulation
from fedpartial._src.experiment.parts import build_model as build_for_dataset
from fedpartial._src.core.structure import leaf_paths

VOCAB, EMBED, HIDDEN, CLASSES, T = 20, 3, 4, 3, 7


@functools.cache
def _tiny():
    return from_linen(BiLSTM(num_classes=CLASSES, vocab_size=VOCAB, embed_dim=EMBED, hidden=HIDDEN),
                      input_shape=(T,), num_classes=CLASSES, name="bilstm")


@functools.cache
def _apply(model):
    """``model.apply`` jitted (an un-jitted nn.RNN compiles its scan on every call)."""
    return jax.jit(model.apply, static_argnums=2)


@functools.cache
def _tiny_variables():
    """Random variables (biases and the padding row included, so that nothing is accidentally zero)."""
    abstract = jax.eval_shape(_tiny().init_variables, jax.random.key(0))
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda a: jnp.asarray(0.5 * rng.standard_normal(a.shape), jnp.float32), abstract)


# Right-padded token ids: lengths 5, 7, 2 and 0 (all padding).
TOKENS = np.array([[3, 9, 1, 4, 17, 0, 0],
                   [5, 5, 2, 19, 8, 11, 6],
                   [12, 7, 0, 0, 0, 0, 0],
                   [0, 0, 0, 0, 0, 0, 0]], np.int32)


# ------------------------------------------------------------------ plain numpy reference


def _sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def _lstm_final_h(cell, inputs):
    """The final hidden state of one LSTM direction over ``inputs`` [L, E], one step at a time."""
    h = np.zeros(HIDDEN)
    c = np.zeros(HIDDEN)
    for x in inputs:
        z = x @ np.asarray(cell["kernel_i"]) + h @ np.asarray(cell["kernel_h"]) + np.asarray(cell["bias"])
        i, f, g, o = np.split(z, 4)
        c = _sigmoid(f) * c + _sigmoid(i) * np.tanh(g)
        h = _sigmoid(o) * np.tanh(c)
    return h


def _reference_logits(params, tokens):
    """Per example: embed the real tokens, run forward and backward LSTMs over them only, concat, Dense."""
    out = []
    for row in tokens:
        real = row[: int(np.max(np.nonzero(row)[0], initial=-1)) + 1]
        emb = np.asarray(params["embedding"]["embedding"])[real]
        h_fwd = _lstm_final_h(params["bilstm"]["forward"], emb)
        h_bwd = _lstm_final_h(params["bilstm"]["backward"], emb[::-1])
        features = np.concatenate([h_fwd, h_bwd])
        out.append(features @ np.asarray(params["head"]["kernel"]) + np.asarray(params["head"]["bias"]))
    return np.stack(out)


def test_forward_matches_plain_numpy_reference():
    variables = _tiny_variables()
    logits, _ = _apply(_tiny())(variables, jnp.asarray(TOKENS), False)
    expected = _reference_logits(variables["params"], TOKENS)
    np.testing.assert_allclose(np.asarray(logits), expected, rtol=1e-5, atol=1e-5)
    # A sequence of padding only has zero final states: its logits are the head's bias.
    np.testing.assert_allclose(np.asarray(logits[3]), np.asarray(variables["params"]["head"]["bias"]), atol=1e-7)


def test_bilstm_stage_equals_flax_bidirectional_rnn_with_seq_lengths():
    """Same arithmetic as nn.Bidirectional(nn.RNN(nn.LSTMCell)) once the fused kernels are cut into its per-gate
    Dense layers, with the lengths passed as seq_lengths."""
    variables = _tiny_variables()
    ours = variables["params"]["bilstm"]
    theirs = {}
    for direction in ("forward", "backward"):
        split = {k: np.split(np.asarray(v), 4, axis=-1) for k, v in ours[direction].items()}
        cell = {}
        for n, gate in enumerate("ifgo"):
            cell[f"i{gate}"] = {"kernel": split["kernel_i"][n]}
            cell[f"h{gate}"] = {"kernel": split["kernel_h"][n], "bias": split["bias"][n]}
        theirs[f"{direction}_rnn"] = {"cell": cell}
    embedded, _ = _tiny().apply_stages(variables, jnp.asarray(TOKENS[:3]), stop=1)  # lengths 5, 7, 2
    flax_rnn = nn.Bidirectional(nn.RNN(nn.LSTMCell(HIDDEN)), nn.RNN(nn.LSTMCell(HIDDEN)))
    ((_, h_fwd), (_, h_bwd)), _ = flax_rnn.apply(
        {"params": theirs}, embedded, seq_lengths=jnp.array([5, 7, 2]), return_carry=True)
    mine = BidirectionalLSTM(HIDDEN).apply({"params": ours}, embedded)
    np.testing.assert_allclose(np.asarray(mine), np.concatenate([h_fwd, h_bwd], -1), rtol=1e-5, atol=1e-6)


def test_forget_gate_bias_starts_at_one():
    variables = jax.jit(_tiny().init_variables)(jax.random.key(0, impl="rbg"))
    bias = np.asarray(variables["params"]["bilstm"]["forward"]["bias"])
    np.testing.assert_array_equal(bias, np.repeat([0.0, 1.0, 0.0, 0.0], HIDDEN))


# ------------------------------------------------------------------ padding


def test_trailing_padding_changes_nothing():
    """The same sequences padded to 7 and to 12 positions give the same logits."""
    variables = _tiny_variables()
    longer = np.pad(TOKENS, ((0, 0), (0, 5)))
    wide = from_linen(BiLSTM(num_classes=CLASSES, vocab_size=VOCAB, embed_dim=EMBED, hidden=HIDDEN),
                      input_shape=(12,), num_classes=CLASSES)
    a, _ = _apply(_tiny())(variables, jnp.asarray(TOKENS), False)
    b, _ = _apply(wide)(variables, jnp.asarray(longer), False)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_padding_row_gets_no_gradient_and_lengths_are_read_from_embeddings():
    model, variables = _tiny(), _tiny_variables()

    def loss(params):
        logits, _ = model.apply({"params": params, "batch_stats": {}}, jnp.asarray(TOKENS), True)
        return jnp.sum(logits ** 2)

    grads = jax.jit(jax.grad(loss))(variables["params"])["embedding"]["embedding"]
    assert np.all(np.asarray(grads[0]) == 0)  # id 0 is padding
    assert np.any(np.asarray(grads[3]) != 0)
    embedded, _ = model.apply_stages(variables, jnp.asarray(TOKENS), stop=1)
    assert embedded.shape == (4, T, EMBED) and embedded.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(sequence_lengths(embedded)), [5, 7, 2, 0])


def test_first_part_masked_and_truncated_agree():
    """The weak tier's view: padding the second half and cutting it off give the same prediction."""
    variables = _tiny_variables()
    masked, _ = _apply(_tiny())(variables, jnp.asarray(first_part(TOKENS, 0.5)), False)
    short = from_linen(BiLSTM(num_classes=CLASSES, vocab_size=VOCAB, embed_dim=EMBED, hidden=HIDDEN),
                       input_shape=(4,), num_classes=CLASSES)
    truncated, _ = _apply(short)(variables, jnp.asarray(first_part(TOKENS, 0.5, truncate=True)), False)
    np.testing.assert_allclose(np.asarray(masked), np.asarray(truncated), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(masked), _reference_logits(variables["params"], TOKENS[:, :4]),
                               rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ stages and structure


def test_stages_layers_and_suffix_on_embeddings():
    model, variables = _tiny(), _tiny_variables()
    assert model.stage_names == ("embedding", "bilstm", "head")
    assert model.structure.layer_names == ("embedding", "bilstm/forward", "bilstm/backward", "head")
    assert model.stage_of_layer == (0, 1, 1, 2)
    assert not model.structure.sequential
    assert model.structure.units == (EMBED, 4 * HIDDEN, 4 * HIDDEN, CLASSES)
    assert len(model.structure.roles["params"]) == len(jax.tree.leaves(variables["params"])) == 9

    full, _ = _apply(model)(variables, jnp.asarray(TOKENS), False)
    embedded, _ = model.apply_stages(variables, jnp.asarray(TOKENS), stop=1)
    suffix = model.stage_variables(variables, 1)
    assert sorted(suffix["params"]) == ["bilstm", "head"]
    from_embeddings, _ = model.apply_stages(suffix, embedded, start=1)
    np.testing.assert_array_equal(np.asarray(from_embeddings), np.asarray(full))
    features, _ = model.apply_stages(suffix, embedded, start=1, stop=2)
    assert features.shape == (4, 2 * HIDDEN)
    inter = jax.jit(model.intermediates)(variables, jnp.asarray(TOKENS))
    np.testing.assert_allclose(np.asarray(inter["stage:head"]), np.asarray(full), rtol=1e-6, atol=1e-6)
    # Layer outputs (SVCCA, the capacity report): each direction's hidden states, zero at padding.
    for name in ("bilstm/forward", "bilstm/backward"):
        assert inter[name].shape == (4, T, HIDDEN)
        np.testing.assert_array_equal(np.asarray(inter[name])[TOKENS == 0], 0.0)
    np.testing.assert_allclose(np.asarray(inter["bilstm/forward"][1, -1]), np.asarray(features[1, :HIDDEN]), atol=1e-6)
    np.testing.assert_allclose(np.asarray(inter["bilstm/backward"][0, 0]), np.asarray(features[0, HIDDEN:]), atol=1e-6)
    assert costs.layer_output_shapes(model) == ((T, EMBED), (T, HIDDEN), (T, HIDDEN), (CLASSES,))


def test_train_mode_equals_eval_mode_and_float_ids_are_cast():
    model, variables = _tiny(), _tiny_variables()
    eval_logits, _ = _apply(model)(variables, jnp.asarray(TOKENS), False)
    train_logits, stats = _apply(model)(variables, jnp.asarray(TOKENS), True)
    float_logits, _ = _apply(model)(variables, jnp.asarray(TOKENS, jnp.float32), False)
    np.testing.assert_array_equal(np.asarray(eval_logits), np.asarray(train_logits))
    np.testing.assert_array_equal(np.asarray(eval_logits), np.asarray(float_logits))
    assert stats == {}


def test_paper_sizes_and_registry():
    module = build_model("bilstm", 2, (256,))
    assert isinstance(module, BiLSTM) and (module.vocab_size, module.embed_dim, module.hidden) == (10_000, 256, 256)
    assert not MODELS["bilstm"].sequential
    variables = jax.eval_shape(module.init, jax.random.key(0), jnp.zeros((1, 256), jnp.int32))
    count = {k: sum(int(np.prod(a.shape)) for a in jax.tree.leaves(v)) for k, v in variables["params"].items()}
    # EmbracingFL Table 1: 2,560,000 + 1,050,624 (+ 513 for one sigmoid unit; 1,026 for 2 softmax logits)
    assert count == {"embedding": 2_560_000, "bilstm": 1_050_624, "head": 1_026}


@pytest.mark.parametrize("shape", [(28, 28, 1), (0,), ()])
def test_bad_input_shape_is_one_sentence(shape):
    with pytest.raises(UserError, match=r"sequence_length"):
        build_model("bilstm", 2, shape)


def test_bad_sizes_are_rejected():
    with pytest.raises(UserError, match="hidden"):
        BiLSTM(num_classes=2, hidden=0)
    with pytest.raises(UserError, match="vocab_size"):
        BiLSTM(num_classes=2, vocab_size=1)


def test_out_of_vocabulary_ids_read_as_unknown():
    variables = _tiny_variables()
    unknown = np.where(TOKENS > 0, 1, 0)
    outside = np.where(TOKENS > 0, VOCAB + 5, 0)
    outside[0, 0] = -3
    a, _ = _apply(_tiny())(variables, jnp.asarray(unknown), False)
    b, _ = _apply(_tiny())(variables, jnp.asarray(outside), False)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.all(np.isfinite(np.asarray(b)))


# ------------------------------------------------------------------ in the engine


@pytest.fixture(scope="module")
def text_data():
    return load_dataset("synthetic_text", seed=0, num_examples=240, seq_len=8, vocab_size=VOCAB + 22)


def test_auto_model_for_text_datasets_is_bilstm(text_data):
    model = build_for_dataset("auto", text_data)
    assert model.name == "bilstm" and model.input_shape == (8,) and model.stage_names[1] == "bilstm"


def test_layer_masks_cover_each_direction_whole():
    """A layer-level mask (what FedLDF and EmbracingFL hand the engine) selects whole modules."""
    model, variables = _tiny(), _tiny_variables()
    mask = masks.from_layers(model.structure, jnp.array([False, True, False, True]))  # forward LSTM, head
    expanded = masks.expand(model.structure, mask, variables["params"])
    on = {"/".join(p): bool(np.all(leaf)) for p, leaf in leaf_paths(expanded)}
    off = {"/".join(p): not np.any(leaf) for p, leaf in leaf_paths(expanded)}
    for path in on:
        expected_on = path.startswith(("bilstm/forward/", "head/"))
        assert (on if expected_on else off)[path], path
    count = int(masks.count_elements(model.structure, mask, variables["params"]))
    assert count == (EMBED + HIDDEN + 1) * 4 * HIDDEN + (2 * HIDDEN + 1) * CLASSES


def test_trains_in_the_engine(text_data):
    """Two FedAvg rounds on the synthetic text task: finite losses, every stage's parameters move, evaluation
    runs on token ids."""
    model = from_linen(BiLSTM(num_classes=2, vocab_size=VOCAB + 22, embed_dim=EMBED, hidden=HIDDEN),
                       input_shape=(8,), num_classes=2, name="bilstm")
    config = RunConfig(method="fedavg", dataset="synthetic_text", num_clients=4, cohort_size=3, rounds=2,
                       local_steps=2, batch_size=8, partition="iid", out_dir=None,
                       strategy="stepwise")  # compiles faster than fused on CPU
    sim = Simulation(config, text_data, model=model)
    before = jax.tree.map(np.asarray, sim.state.variables["params"])
    records = list(sim.rounds())
    assert [r["round"] for r in records] == [1, 2]
    for r in records:
        assert np.isfinite(r["train_loss"]) and 0.0 <= r["test_accuracy"] <= 1.0
    after = sim.state.variables["params"]
    for path in (("embedding", "embedding"), ("bilstm", "forward", "kernel_h"), ("head", "kernel")):
        a, b = before, after
        for key in path:
            a, b = a[key], b[key]
        assert not np.array_equal(a, np.asarray(b)), path
