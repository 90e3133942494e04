"""LEAF's stacked LSTMs: the Shakespeare next-character model and the Sent140 sentiment model.

Both are LEAF's ``stacked_lstm`` reference models (``models/shakespeare/stacked_lstm.py``,
``models/sent140/stacked_lstm.py``): token ids -> embedding -> two LSTM layers -> the output after the last
token -> dense layers. :class:`StackedLSTM` is the one architecture; the registry builds it as

``shakespeare_lstm``
    LEAF's Shakespeare model: embedding of 8 over the character vocabulary of
    :mod:`fedpartial._src.data.leaf` (82 ids: padding, LEAF's 80 characters, other), two LSTM layers of 256,
    Dense to the next character's logits (softmax cross entropy, one label per example: accuracy counts
    characters).
``sent140_lstm``
    LEAF's Sent140 model: embedding of 300 (LEAF's GloVe dimension; here trained, over the vocabulary built
    from the training tweets, 10,000 ids), two LSTM layers of 100, Dense 30 (no activation, as LEAF's), Dense
    to the class logits (2 softmax logits where LEAF has one sigmoid unit).

Each LSTM layer is :class:`~fedpartial._src.models.text.LSTMDirection` (Keras's gate layout, one layer of the
model's structure), so everything said there about padding holds: id 0 is padding and embeds to zeros, a
sequence's length is one past its last non-padding position, and the state after the last real token is the
one read (LEAF's reads the last position, padding or not). Stages: ``embedding``, ``lstm1`` (a sequence of
hidden states, zeros after the length), ``lstm2`` (the final state ``[B, H]``), then ``fc1`` where there is
one and ``head``. No dropout, no BatchNorm; not sequential (neuron-level methods do not apply).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import flax.linen as nn
import jax.numpy as jnp

from fedpartial._src.core.errors import UserError
from fedpartial._src.models.text import LSTMDirection, sequence_lengths
from fedpartial._src.models.zoo import stage_range

__all__ = ["StackedLSTM", "sent140_lstm", "shakespeare_lstm"]


class StackedLSTM(nn.Module):
    """Embedding -> ``len(hidden)`` LSTM layers -> the last real token's state -> Dense layers ``dense`` ->
    Dense ``num_classes`` (module doc). ``x``: ``[batch, T]`` token ids, 0 padding."""

    num_classes: int
    vocab_size: int
    embed_dim: int
    hidden: tuple[int, ...] = (256, 256)
    dense: tuple[int, ...] = ()
    name_prefix: str = "stacked_lstm"

    def __post_init__(self):
        for field, least in (("num_classes", 1), ("vocab_size", 2), ("embed_dim", 1)):
            value = getattr(self, field)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < least:
                raise UserError(f"{self.name_prefix} needs {field} to be an integer of at least {least}, got "
                                f"{value!r}.")
        super().__post_init__()

    @property
    def stage_names(self) -> tuple[str, ...]:
        return (("embedding",) + tuple(f"lstm{i + 1}" for i in range(len(self.hidden)))
                + tuple(f"fc{i + 1}" for i in range(len(self.dense))) + ("head",))

    @nn.nowrap
    def validate_input_shape(self, input_shape: Sequence[int]) -> None:
        shape = tuple(input_shape)
        if len(shape) != 1 or int(shape[0]) < 1:
            raise UserError(f"{self.name_prefix} needs input shape (sequence_length,) of token ids with a positive "
                            f"length, got input shape {shape}.")

    @nn.compact
    def __call__(self, x, train: bool = False, start: int = 0, stop: int | None = None):
        del train  # no dropout, no BatchNorm
        if start == 0:
            x = jnp.asarray(x).astype(jnp.int32)
            self.validate_input_shape(x.shape[1:])
        layers = len(self.hidden)
        for s in stage_range(len(self.stage_names), start, stop):
            if s == 0:
                x = jnp.where((x >= 0) & (x < self.vocab_size), x, 1)  # out of the vocabulary: unknown
                embedded = nn.Embed(self.vocab_size, self.embed_dim, name="embedding")(x)
                x = embedded * (x != 0)[..., None].astype(embedded.dtype)
            elif s <= layers:
                lengths = sequence_lengths(x)
                x = LSTMDirection(self.hidden[s - 1], name=f"lstm{s}")(x, lengths)
                if s == layers:  # the state after the last real token (zeros for padding only)
                    last = jnp.maximum(lengths - 1, 0)[:, None, None]
                    x = jnp.take_along_axis(x, last, axis=1)[:, 0]
            elif s <= layers + len(self.dense):
                x = nn.Dense(self.dense[s - layers - 1], name=f"fc{s - layers}")(x)
            else:
                x = nn.Dense(self.num_classes, name="head")(x)
        return x


def shakespeare_lstm(num_classes: int, vocab_size: int = 82) -> StackedLSTM:
    """LEAF's Shakespeare model: embedding 8, two LSTM layers of 256, next-character logits."""
    return StackedLSTM(num_classes=num_classes, vocab_size=vocab_size, embed_dim=8, hidden=(256, 256),
                       name_prefix="shakespeare_lstm")


def sent140_lstm(num_classes: int, vocab_size: int = 10_000) -> StackedLSTM:
    """LEAF's Sent140 model: embedding 300, two LSTM layers of 100, Dense 30, class logits."""
    return StackedLSTM(num_classes=num_classes, vocab_size=vocab_size, embed_dim=300, hidden=(100, 100),
                       dense=(30,), name_prefix="sent140_lstm")

