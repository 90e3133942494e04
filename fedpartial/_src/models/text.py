"""Text models: the bidirectional LSTM sentiment classifier of EmbracingFL (IMDB).

EmbracingFL §6.2: "an embedding layer followed by a dropout (0.3). The input
dimension is 10,000, the output dimension is 256, and the maximum length of the
input sentence is 256. Then, the bidirectional LSTM layer is attached to the
embedding layer. The LSTM size is 256 [...]. Finally, the LSTM module is followed
by a dense layer." Its Table 1 counts 3,611,137 parameters: the embedding's
2,560,000, the BiLSTM's 1,050,624 (per direction ``4 * (256 * 256 + 256 * 256 +
256)``) and 513 for a dense layer with one sigmoid output on the 512 concatenated
final states.

Choices made here, where the paper is vague or where fedpartial differs:

* **Output**: ``num_classes`` softmax logits (fedpartial's loss is softmax cross
  entropy) instead of one sigmoid unit, so with 2 classes the head has
  ``512 * 2 + 2 = 1,026`` parameters, not 513, and the model 3,611,650 in all.
* **Classifier input**: the concatenation of the two directions' final hidden
  states (the forward LSTM's state after the last real token, the backward
  LSTM's state after reading back to the first token), as Keras's
  ``Bidirectional(LSTM(256))`` gives by default -- not pooled outputs.
* **No dropout**: the paper's two dropouts (0.3) are left out; fedpartial's zoo
  models carry no ``nn.Dropout`` (the engine applies dropout through masks), and
  the model is deterministic in train and eval mode.
* **The LSTM** is written here (:class:`LSTMDirection`, one ``jax.lax.scan`` per
  direction) rather than as Flax's ``nn.RNN(nn.LSTMCell)`` inside
  ``nn.Bidirectional``, for two reasons of fedpartial's layer structure
  (docs/decisions.md#engine): every module that owns parameters is a layer, and Flax's cell keeps each
  gate in its own ``Dense``, which would make 16 "layers" of the BiLSTM; and a
  layer's output is read by intercepting its module's call
  (``Model.intermediates`` for SVCCA, ``costs.layer_output_shapes`` for the
  capacity report), which for a cell inside ``nn.scan`` is a per-step tuple of
  tracers. Here each direction is one module and one layer; it owns Keras's
  layout -- input kernel ``[in, 4H]``, recurrent kernel ``[H, 4H]``, bias
  ``[4H]``, gates in the order input, forget, cell, output, so the parameter
  count is the paper's -- and returns its hidden states ``[B, T, H]``. The
  arithmetic is that of Flax's ``nn.LSTMCell`` run by ``nn.Bidirectional`` with
  ``seq_lengths`` (tested against it). Initialisation: LeCun-normal input kernel,
  orthogonal recurrent kernel, zero bias except 1 for the forget gate (Keras's
  ``unit_forget_bias``). A direction's ``units`` in the layer structure is its
  kernels' last axis, the ``4H`` gate pre-activations.
* **Padding**: inputs are int32 token ids ``[batch, T]``, right-padded with 0
  (id 1 is "unknown" in :mod:`fedpartial._src.data.text`). Stage ``embedding`` sets
  the embedding of every padding position to the zero vector; stage ``bilstm``
  takes a sequence's length to be one past its last position whose embedding is
  not all zero (:func:`sequence_lengths`). Each direction updates its state only
  at positions before that length -- the forward LSTM's final state is the one
  after the last real token, the backward LSTM starts at it -- and outputs zeros
  after it, so trailing padding changes nothing. (A real token whose embedding
  vector were exactly zero would read as padding; with a random normal
  initialisation this does not happen.) A sequence of padding only gives zero
  final states. Zero tokens *before* the last real token are read as tokens
  with a zero embedding.
* **Stages** (the cut points of docs/decisions.md#embracingfl): ``embedding`` (int32 ``[B, T]`` -> float32
  ``[B, T, embed_dim]``), ``bilstm`` (-> ``[B, 2 * hidden]``) and ``head``
  (-> logits). The layers are ``embedding``, ``bilstm/forward``,
  ``bilstm/backward`` and ``head``. The BiLSTM is not a plain chain of units, so
  it is registered non-sequential: layer-level masks work, neuron-level masks
  (dropout, FedSPU) do not apply.
* **Input dtype**: stage ``embedding`` casts its input to int32 (as the image
  models cast to float32), so the float32 dummy inputs that the adapter and the
  cost model use to trace a model work too; token ids are never fractional.
  Ids outside ``[0, vocab_size)`` are read as 1, the unknown word, as a
  tokeniser with this vocabulary would have encoded them (an out-of-range
  lookup would otherwise give NaN embeddings).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedpartial._src.core.errors import UserError
from fedpartial._src.models.zoo import stage_range

__all__ = ["BiLSTM", "BidirectionalLSTM", "LSTMDirection", "sequence_lengths"]


def _forget_bias_init(key, shape, dtype=jnp.float32):
    """Zero bias with the forget gate's quarter (``[H, 2H)`` of ``[4H]``) set to 1."""
    del key
    hidden = shape[0] // 4
    return jnp.zeros(shape, dtype).at[hidden:2 * hidden].set(1.0)


def sequence_lengths(embeddings: jax.Array) -> jax.Array:
    """``[B]`` int32: one past the last position whose embedding ``[B, T, E]`` is not all zero."""
    real = jnp.any(embeddings != 0, axis=-1)  # [B, T]
    positions = jnp.arange(1, embeddings.shape[1] + 1, dtype=jnp.int32)[None, :]
    return jnp.max(jnp.where(real, positions, 0), axis=1)


class LSTMDirection(nn.Module):
    """One direction of an LSTM over ``x`` ``[B, T, in]``; returns the hidden states ``[B, T, H]``.

    At every position ``t`` before ``lengths`` (in order, or in reverse order when
    ``reverse``), with ``z = x_t @ kernel_i + h @ kernel_h + bias`` split into the
    gates ``i, f, g, o``::

        c = sigmoid(f) * c + sigmoid(i) * tanh(g)
        h = sigmoid(o) * tanh(c)

    from ``c = h = 0``; positions from ``lengths`` on leave the state alone and
    output zeros. The input projections of all positions are one matrix product
    before the scan.
    """

    features: int
    reverse: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, lengths: jax.Array) -> jax.Array:
        width = 4 * self.features
        kernel_i = self.param("kernel_i", nn.initializers.lecun_normal(), (x.shape[-1], width))
        kernel_h = self.param("kernel_h", nn.initializers.orthogonal(), (self.features, width))
        bias = self.param("bias", _forget_bias_init, (width,))
        batch, steps = x.shape[0], x.shape[1]
        projected = x @ kernel_i + bias[None, None, :]  # [B, T, 4H]
        valid = jnp.arange(steps)[None, :] < lengths[:, None]  # [B, T]

        def step(carry, inputs):
            c, h = carry
            z_t, valid_t = inputs  # [B, 4H], [B]
            i, f, g, o = jnp.split(z_t + h @ kernel_h, 4, axis=-1)
            new_c = nn.sigmoid(f) * c + nn.sigmoid(i) * jnp.tanh(g)
            new_h = nn.sigmoid(o) * jnp.tanh(new_c)
            keep = valid_t[:, None]
            c, h = jnp.where(keep, new_c, c), jnp.where(keep, new_h, h)
            return (c, h), jnp.where(keep, h, 0.0)

        zeros = jnp.zeros((batch, self.features), projected.dtype)
        _, hidden = jax.lax.scan(step, (zeros, zeros), (projected.swapaxes(0, 1), valid.T), reverse=self.reverse)
        return hidden.swapaxes(0, 1)


class BidirectionalLSTM(nn.Module):
    """Both directions over embeddings ``[B, T, E]`` (padding: all-zero rows) -> final states ``[B, 2H]``.

    The forward direction's state after the last real token, then the backward
    direction's state after reading back to the first token (Keras's
    ``Bidirectional(LSTM(H))`` with ``merge_mode='concat'``).
    """

    features: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        lengths = sequence_lengths(x)
        forward = LSTMDirection(self.features, name="forward")(x, lengths)
        backward = LSTMDirection(self.features, reverse=True, name="backward")(x, lengths)
        last = jnp.maximum(lengths - 1, 0)[:, None, None]  # a sequence of padding only: zero states
        final_forward = jnp.take_along_axis(forward, last, axis=1)[:, 0]
        return jnp.concatenate([final_forward, backward[:, 0]], axis=-1)


class BiLSTM(nn.Module):
    """Embedding -> bidirectional LSTM -> Dense: EmbracingFL's IMDB classifier.

    Defaults are the paper's (``vocab_size`` 10,000, ``embed_dim`` 256, ``hidden``
    256 per direction). ``__call__(x, train, start, stop)`` follows the zoo's
    staged contract (:mod:`fedpartial._src.models.zoo`); ``x`` is ``[batch, T]`` token
    ids (0 = padding) for ``start == 0`` and ``[batch, T, embed_dim]`` embeddings
    for ``start == 1``. See the module docstring for the choices made.
    """

    num_classes: int
    vocab_size: int = 10_000
    embed_dim: int = 256
    hidden: int = 256

    def __post_init__(self):
        for field, least in (("num_classes", 1), ("vocab_size", 2), ("embed_dim", 1), ("hidden", 1)):
            value = getattr(self, field)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < least:
                raise UserError(f"BiLSTM needs {field} to be an integer of at least {least}, got {value!r}.")
        super().__post_init__()

    @property
    def stage_names(self) -> tuple[str, ...]:
        return ("embedding", "bilstm", "head")

    @nn.nowrap
    def validate_input_shape(self, input_shape: Sequence[int]) -> None:
        shape = tuple(input_shape)
        if len(shape) != 1 or int(shape[0]) < 1:
            raise UserError(
                f"bilstm needs input shape (sequence_length,) of token ids with a positive length, "
                f"got input shape {shape}."
            )

    @nn.compact
    def __call__(self, x, train: bool = False, start: int = 0, stop: int | None = None):
        del train  # no dropout, no BatchNorm: train and eval mode agree
        if start == 0:
            x = jnp.asarray(x).astype(jnp.int32)
            self.validate_input_shape(x.shape[1:])
        for s in stage_range(len(self.stage_names), start, stop):
            if s == 0:
                x = jnp.where((x >= 0) & (x < self.vocab_size), x, 1)  # out of vocabulary: unknown
                embedded = nn.Embed(self.vocab_size, self.embed_dim, name="embedding")(x)
                x = embedded * (x != 0)[..., None].astype(embedded.dtype)
            elif s == 1:
                x = BidirectionalLSTM(self.hidden, name="bilstm")(x)
            else:
                x = nn.Dense(self.num_classes, name="head")(x)
        return x
