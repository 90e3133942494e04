"""Transformers: a decoder-only language model, a text classifier and a vision transformer (pre-LayerNorm).

All three share one encoder block and follow the zoo's staged contract (:mod:`fedpartial._src.models.zoo`):

* **Stages** ``embed``, ``block0`` … ``block{n-1}``, ``head``.  ``embed`` turns the input into ``[B, T, d]``
  (token ids through ``embed``, an ``nn.Embed``; image patches through ``embed``, a Dense) and adds the learned
  positions ``pos_embed`` (an ``nn.Embed`` over the positions); each block is pre-LayerNorm::

      x = x + attn/out(attention(attn/query, attn/key, attn/value of ln1(x)))
      x = x + mlp/fc2(gelu(mlp/fc1(ln2(x))))

  ``head`` is the final LayerNorm ``ln_f`` then the Dense ``head``, at every position for the language
  model; the classifiers mean-pool the positions first (then ``ln_f``, as timm's ``fc_norm``).
* **Modules**: plain ``nn.Dense`` (kernel ``[in, out]``) named ``block{i}/attn/query``, ``…/key``,
  ``…/value``, ``…/out``, ``block{i}/mlp/fc1``, ``…/fc2``; LayerNorms ``block{i}/ln1``, ``block{i}/ln2``,
  ``ln_f``.  In the layer structure a LayerNorm joins the layer it feeds (``ln1`` the query, ``ln2`` fc1,
  ``ln_f`` the head), so every block's parameters are its own layers'.  The models have residual
  connections: they are registered non-sequential (layer masks apply, neuron masks do not).
* **GELU** in the MLP (tanh approximation), as GPT-2 and ViT, not the zoo's ReLU; no dropout (the engine
  applies dropout through masks).  Initialisation: normal(0.02) for Dense kernels and embeddings, zero biases.
* **Token ids** are int32 ``[B, T]``, right-padded with 0 (:mod:`fedpartial._src.data.text`); ids outside
  ``[0, vocab_size)`` read as 1, the unknown token.  The language model is causal (position ``t`` attends to
  ``0 … t``), so right padding never reaches a real position and its loss leaves padded targets out.  The
  classifier attends to every position, padding included (a padding token is a learned token like any
  other: the stages pass activations only, so a padding mask could not reach the later stages), and mean-pools
  all positions.
* **Images** (``vit``) are NHWC, cut into non-overlapping ``p x p`` patches, each flattened (row-major,
  channels last) and projected to ``d``; ``p`` is the smallest size that divides height and width and leaves
  at most 7 patches a side (2 for 8x8 digits, 4 for 28x28 MNIST, 8 for 32x32 CIFAR).

Named sizes (:data:`SIZES`): ``tiny`` trains on two CPU cores in a minute; ``gpt2`` is GPT-2 small's shape
(12 blocks, d = 768, 12 heads, MLP 3,072: 85M parameters in the blocks).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence

import flax.linen as nn
from flax.linen.dtypes import promote_dtype
import jax.numpy as jnp

from fedpartial._src.core.errors import UserError
from fedpartial._src.models.zoo import as_float, image_hw, stage_range

__all__ = ["SIZES", "TransformerCLS", "TransformerLM", "TransformerSize", "ViT", "check_size", "vit_patch"]


@dataclasses.dataclass(frozen=True)
class TransformerSize:
    """A named transformer shape: blocks, model width ``d``, attention heads, MLP hidden units."""

    layers: int
    d_model: int
    heads: int
    mlp: int

    def block_parameters(self) -> int:
        """Parameters of one block: four d x d projections, the MLP and two LayerNorms (with biases)."""
        d, m = self.d_model, self.mlp
        return 4 * (d * d + d) + (d * m + m) + (m * d + d) + 2 * 2 * d


#: ``--model-size`` names -> shapes
SIZES: dict[str, TransformerSize] = {
    "tiny": TransformerSize(layers=2, d_model=64, heads=4, mlp=256),
    "small": TransformerSize(layers=4, d_model=256, heads=4, mlp=1024),
    "base": TransformerSize(layers=8, d_model=512, heads=8, mlp=2048),
    "gpt2": TransformerSize(layers=12, d_model=768, heads=12, mlp=3072),
}
DEFAULT_SIZE = "tiny"

_init = nn.initializers.normal(0.02)
#: patches a side at most, when a ViT picks its patch size
_MAX_PATCHES_PER_SIDE = 7


def check_size(size: str | TransformerSize) -> TransformerSize:
    """The shape of ``--model-size`` ``size`` (a name of :data:`SIZES`, or a :class:`TransformerSize` itself);
    a ``UserError`` naming the allowed sizes otherwise."""
    if isinstance(size, TransformerSize):
        return size
    if size not in SIZES:
        raise UserError(f"--model-size {size!r} is unknown; choose one of {', '.join(SIZES)}.")
    return SIZES[size]


class TokenDense(nn.Dense):
    """``nn.Dense`` (same parameters, same initialisers) computed as one ``[N, in] @ [in, out]`` product over every
    leading axis flattened.  On a ``[B, T, in]`` input XLA:CPU lowers the backward of the 3-axis dot to transposes
    and dots with two contracting axes, which ran the tiny and small transformers' training step about twice as
    slow (and LoRA's rank-``r`` gradient products several times slower) as the same products on 2-D operands."""

    @nn.compact
    def __call__(self, inputs):
        kernel = self.param("kernel", self.kernel_init, (jnp.shape(inputs)[-1], self.features), self.param_dtype)
        bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype) if self.use_bias else None
        inputs, kernel, bias = promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        y = jnp.matmul(inputs.reshape(-1, inputs.shape[-1]), kernel, precision=self.precision)
        if bias is not None:
            y = y + bias[None, :]
        return y.reshape(*inputs.shape[:-1], self.features)


def _dense(features: int, name: str) -> nn.Dense:
    return TokenDense(features, kernel_init=_init, name=name)


class SelfAttention(nn.Module):
    """Multi-head scaled dot-product self-attention over ``[B, T, d]``, causal or not."""

    d_model: int
    heads: int
    causal: bool

    @nn.compact
    def __call__(self, x):
        b, t, _ = x.shape
        head_dim = self.d_model // self.heads

        def split(y):  # [B, T, d] -> [B, heads, T, head_dim]
            return y.reshape(b, t, self.heads, head_dim).transpose(0, 2, 1, 3)

        q = split(_dense(self.d_model, "query")(x))
        k = split(_dense(self.d_model, "key")(x))
        v = split(_dense(self.d_model, "value")(x))
        scores = jnp.einsum("bhqe,bhke->bhqk", q, k) / jnp.sqrt(jnp.asarray(head_dim, q.dtype))
        if self.causal:
            allowed = jnp.tril(jnp.ones((t, t), bool))
            scores = jnp.where(allowed, scores, jnp.finfo(scores.dtype).min)
        weights = nn.softmax(scores.astype(jnp.float32), axis=-1).astype(v.dtype)
        mixed = jnp.einsum("bhqk,bhke->bhqe", weights, v).transpose(0, 2, 1, 3).reshape(b, t, self.d_model)
        return _dense(self.d_model, "out")(mixed)


class MLPBlock(nn.Module):
    """``fc2(gelu(fc1(x)))``."""

    d_model: int
    hidden: int

    @nn.compact
    def __call__(self, x):
        return _dense(self.d_model, "fc2")(nn.gelu(_dense(self.hidden, "fc1")(x)))


class Block(nn.Module):
    """One pre-LayerNorm transformer block (see the module docstring)."""

    d_model: int
    heads: int
    mlp: int
    causal: bool

    @nn.compact
    def __call__(self, x):
        x = x + SelfAttention(self.d_model, self.heads, self.causal, name="attn")(nn.LayerNorm(name="ln1")(x))
        return x + MLPBlock(self.d_model, self.mlp, name="mlp")(nn.LayerNorm(name="ln2")(x))


class _Encoder(nn.Module):
    """Shared staging: ``embed`` (by the subclass), the blocks, then ``ln_f`` and ``head``."""

    num_classes: int
    size: str | TransformerSize = DEFAULT_SIZE

    causal = False
    pooled = True

    def __post_init__(self):
        shape = check_size(self.size)
        if shape.d_model % shape.heads:
            raise UserError(f"model size {self.size!r} has d={shape.d_model} not divisible by {shape.heads} heads.")
        if not isinstance(self.num_classes, numbers.Integral) or self.num_classes < 1:
            raise UserError(f"{type(self).__name__} needs num_classes to be a positive integer, "
                            f"got {self.num_classes!r}.")
        super().__post_init__()

    @property
    def shape(self) -> TransformerSize:
        return check_size(self.size)

    @property
    def stage_names(self) -> tuple[str, ...]:
        return ("embed", *(f"block{i}" for i in range(self.shape.layers)), "head")

    def embed_input(self, x):  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def prepare(self, x):
        raise NotImplementedError  # pragma: no cover

    @nn.compact
    def __call__(self, x, train: bool = False, start: int = 0, stop: int | None = None):
        del train  # no dropout, no BatchNorm: train and eval mode agree
        shape = self.shape
        if start == 0:
            x = self.prepare(x)
        last = len(self.stage_names) - 1
        for s in stage_range(len(self.stage_names), start, stop):
            if s == 0:
                x = self.embed_input(x)
                positions = jnp.arange(x.shape[1])
                x = x + nn.Embed(x.shape[1], shape.d_model, embedding_init=_init, name="pos_embed")(positions)[None]
            elif s < last:
                x = Block(shape.d_model, shape.heads, shape.mlp, self.causal, name=f"block{s - 1}")(x)
            else:
                if self.pooled:  # pooled, then normalised (timm's fc_norm): ln_f feeds the head directly
                    x = jnp.mean(x, axis=1)
                x = nn.LayerNorm(name="ln_f")(x)
                x = _dense(self.num_classes, "head")(x)
        return x


class _TokenEncoder(_Encoder):
    vocab_size: int = 10_000

    @nn.nowrap
    def validate_input_shape(self, input_shape: Sequence[int]) -> None:
        shape = tuple(input_shape)
        if len(shape) != 1 or int(shape[0]) < 1:
            raise UserError(f"{self.model_name} needs input shape (sequence_length,) of token ids with a positive "
                            f"length, got input shape {shape}.")

    def prepare(self, x):
        x = jnp.asarray(x).astype(jnp.int32)
        self.validate_input_shape(x.shape[1:])
        return x

    @property
    def vocab(self) -> int:
        return self.vocab_size

    def embed_input(self, x):
        x = jnp.where((x >= 0) & (x < self.vocab), x, 1)  # out of vocabulary: unknown
        return nn.Embed(self.vocab, self.shape.d_model, embedding_init=_init, name="embed")(x)


class TransformerLM(_TokenEncoder):
    """Decoder-only causal language model: token ids ``[B, T]`` -> next-token logits ``[B, T, vocab]``.

    ``num_classes`` is the vocabulary (the logits' last axis); ``vocab_size`` defaults to it.
    """

    vocab_size: int = 0
    model_name = "transformer_lm"
    causal = True
    pooled = False

    @property
    def vocab(self) -> int:
        return self.vocab_size or self.num_classes


class TransformerCLS(_TokenEncoder):
    """Encoder text classifier: token ids ``[B, T]`` -> class logits ``[B, num_classes]`` (mean-pooled)."""

    model_name = "transformer_cls"


def vit_patch(height: int, width: int) -> int:
    """The patch side of a ViT on ``height x width`` images: the smallest common divisor leaving at most 7
    patches a side (the greatest common divisor when none does)."""
    common = math.gcd(height, width)
    for p in range(1, common + 1):
        if common % p == 0 and height // p <= _MAX_PATCHES_PER_SIDE and width // p <= _MAX_PATCHES_PER_SIDE:
            return p
    return common


class ViT(_Encoder):
    """Vision transformer: NHWC images -> patches -> encoder -> class logits (mean-pooled over patches)."""

    model_name = "vit"

    @nn.nowrap
    def validate_input_shape(self, input_shape: Sequence[int]) -> None:
        image_hw("vit", input_shape)

    def prepare(self, x):
        x = as_float(x)
        self.validate_input_shape(x.shape[1:])
        return x

    def embed_input(self, x):
        b, h, w, c = x.shape
        p = vit_patch(h, w)
        patches = x.reshape(b, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5).reshape(b, -1, p * p * c)
        return _dense(self.shape.d_model, "embed")(patches)
