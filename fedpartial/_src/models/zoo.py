"""Model zoo: the Flax (linen) networks used by the papers fedpartial reproduces.

Every model follows one contract, which the engine relies on to discover the
"layer" structure of SPEC §1 by intercepting module calls at init:

* ``__call__(self, x, train: bool = False, start: int = 0, stop: int | None = None)``
  returns float32 logits ``[batch, num_classes]`` with the defaults; images are
  NHWC float32.
* The forward pass is a chain of named *stages* (``stage_names``, a property
  that needs no call): ``start``/``stop`` run stages ``[start, stop)`` only, on
  the raw input when ``start == 0`` and on the output of stage ``start - 1``
  otherwise (input checks and the float32 cast happen only at ``start == 0``).
  Only the running stages create submodules, and parameter names do not depend
  on the range, so a suffix runs with just its own variables: this is how a
  client trains the output side on cached activations (SPEC §4). The last
  stage is the classifier; stage ``-2`` outputs the penultimate representation.
* Submodules are created and called in forward (input -> output) order, each
  exactly once, and an ``nn.BatchNorm`` is called immediately after the Conv it
  belongs to. The classifier (a Dense named ``head``) is the last layer called.
* BatchNorm is ``nn.BatchNorm(use_running_average=not train, momentum=0.9,
  epsilon=1e-5)``; running statistics live in the ``batch_stats`` collection.
* No ``nn.Dropout``: dropout is applied by the engine through masks.
* Activations are ReLU.
* Feature maps are flattened with ``x.reshape((x.shape[0], -1))``, so for an
  ``[H, W, C]`` map the flat index of ``(h, w, c)`` is ``(h * W + w) * C + c``
  (channel ``c`` of a conv feeds dense input rows ``i`` with ``i % C == c``).

**Width reduction** (HeteroFL, FjORD, EmbracingFL's baseline): every zoo model
names the fields that set its hidden widths (``_width_fields``), and
:func:`narrowed` returns the same architecture with ``⌈r·C⌉`` channels/units in
every hidden layer (the classifier keeps every class).  Its variables are the
full model's *leading* channels/units on every axis (a conv→flatten→dense kernel:
the leading channels of every ``H·W`` block of rows), so a narrow model is a
slice of the full one.  ``train_scale`` multiplies every hidden Conv/Dense output
in training only (HeteroFL's "Scaler", ``1/r``); its default 1.0 changes nothing.

Every convolutional model has a :meth:`validate_input_shape` that raises a
``ValueError`` naming the input shape when the image is too small for the
network's pooling/valid convolutions; it is called by ``__call__`` and by
:func:`fedpartial._src.models.registry.build_model`. ``input_shape`` never includes
the batch axis.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from fedpartial._src.core.errors import UserError

__all__ = [
    "CNN2C1F",
    "CNN2C3F",
    "FEMNISTCNN",
    "MLP",
    "VGG9",
    "BasicBlock",
    "LeNet5",
    "ResNet20",
    "narrow_units",
    "narrowed",
    "stage_range",
]

_he_normal = nn.initializers.he_normal()


def _batch_norm(train: bool, name: str) -> nn.BatchNorm:
    return nn.BatchNorm(
        use_running_average=not train, momentum=0.9, epsilon=1e-5, name=name
    )


def _max_pool(x):
    return nn.max_pool(x, window_shape=(2, 2), strides=(2, 2), padding="VALID")


def _flatten(x):
    return x.reshape((x.shape[0], -1))


def _train_scaled(x, train: bool, scale: float):
    """HeteroFL's Scaler: ``x · scale`` in training, ``x`` otherwise (and always for scale 1)."""
    return x * scale if train and scale != 1.0 else x


def _conv_relu_pool(x, index: int, features: int, kernel_size: int, padding: Any = "SAME", *,
                    train: bool = False, scale: float = 1.0):
    """Stage ``conv{index + 1}``: conv -> (train scale) -> ReLU -> 2x2 max-pool.

    Called from a parent's ``@nn.compact`` ``__call__``: the conv becomes its child.
    """
    x = nn.Conv(features, (kernel_size, kernel_size), padding=padding, name=f"conv{index + 1}")(x)
    return _max_pool(nn.relu(_train_scaled(x, train, scale)))


def stage_range(num_stages: int, start: int = 0, stop: int | None = None) -> range:
    """The stage indices ``[start, stop)`` (``stop=None``: to the end), checked.

    Raises:
      ValueError: unless ``0 <= start <= stop <= num_stages`` (static ints; the
        range decides which submodules exist, so it cannot be traced).
    """
    stop = num_stages if stop is None else stop
    ints = all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in (start, stop))
    if not ints or not 0 <= start <= stop <= num_stages:
        raise ValueError(
            f"start={start!r}, stop={stop!r} is not a range of the model's {num_stages} "
            f"stages: need static integers with 0 <= start <= stop <= {num_stages}."
        )
    return range(int(start), int(stop))


def _prepare_input(module, x, start: int):
    """Checks and casts the raw input; a later stage's input is passed through untouched."""
    if start != 0:
        return x
    x = jnp.asarray(x, jnp.float32)
    module.validate_input_shape(x.shape[1:])
    return x


def _image_hw(model: str, input_shape: Sequence[int]) -> tuple[int, int]:
    """Check that ``input_shape`` is an ``(H, W, C)`` image shape; return ``(H, W)``."""
    shape = tuple(input_shape)
    if len(shape) != 3 or any(int(d) < 1 for d in shape):
        raise UserError(
            f"{model} needs an image input shape (height, width, channels) with "
            f"positive sizes, got input shape {shape}."
        )
    return int(shape[0]), int(shape[1])


def _require_min_hw(
    model: str, input_shape: Sequence[int], min_hw: int, why: str
) -> tuple[int, int]:
    h, w = _image_hw(model, input_shape)
    if h < min_hw or w < min_hw:
        raise UserError(
            f"{model} cannot take input shape {tuple(input_shape)}: {why} need "
            f"images of at least {min_hw}x{min_hw} pixels, got {h}x{w}."
        )
    return h, w


# --------------------------------------------------------------------------- MLP


class MLP(nn.Module):
    """Multi-layer perceptron: flatten -> [Dense(h) -> ReLU] * len(hidden) -> Dense.

    Layers (and stages) are ``fc1 .. fcN`` and the classifier ``head``; the
    first stage flattens. Accepts any input shape.
    """

    num_classes: int
    hidden: tuple[int, ...] = (200, 200)
    train_scale: float = 1.0

    _width_fields = ("hidden",)

    @nn.nowrap
    def validate_input_shape(self, input_shape: Sequence[int]) -> None:
        shape = tuple(input_shape)
        if len(shape) == 0 or any(int(d) < 1 for d in shape):
            raise UserError(
                f"MLP needs a non-empty input shape with positive sizes, got "
                f"input shape {shape}."
            )

    @property
    def stage_names(self) -> tuple[str, ...]:
        return tuple(f"fc{i + 1}" for i in range(len(self.hidden))) + ("head",)

    @nn.compact
    def __call__(self, x, train: bool = False, start: int = 0, stop: int | None = None):
        if start == 0:
            x = jnp.asarray(x, jnp.float32)
        for s in stage_range(len(self.stage_names), start, stop):
            if s == 0:
                x = _flatten(x)
            if s < len(self.hidden):
                x = nn.Dense(self.hidden[s], name=f"fc{s + 1}")(x)
                x = nn.relu(_train_scaled(x, train, self.train_scale))
            else:
                x = nn.Dense(self.num_classes, name="head")(x)
        return x


# ------------------------------------------------------------- FedSPU CNN (2c+1f)


class CNN2C1F(nn.Module):
    """CNN with two conv layers and one fully-connected layer (FedSPU, EMNIST/Speech).

    The FedSPU paper only says "two convolutional layers and one fully-connected
    layer, following the setting of Horváth et al. 2021 (FjORD)" without giving
    sizes, so we use: conv 5x5 32 'SAME' -> ReLU -> maxpool 2 -> conv 5x5 64
    'SAME' -> ReLU -> maxpool 2 -> flatten -> Dense(num_classes).
    Layers and stages: ``conv1``, ``conv2`` (each conv + ReLU + pool), ``head``
    (flatten + Dense). Needs images of at least 4x4.
    """

    num_classes: int
    features: tuple[int, int] = (32, 64)
    kernel_size: int = 5
    train_scale: float = 1.0

    _width_fields = ("features",)

    @property
    def stage_names(self) -> tuple[str, ...]:
        return tuple(f"conv{i + 1}" for i in range(len(self.features))) + ("head",)

    @nn.nowrap
    def validate_input_shape(self, input_shape: Sequence[int]) -> None:
        _require_min_hw("cnn2c1f", input_shape, 4, "its two 2x2 max-pools")

    @nn.compact
    def __call__(self, x, train: bool = False, start: int = 0, stop: int | None = None):
        x = _prepare_input(self, x, start)
        for s in stage_range(len(self.stage_names), start, stop):
            if s < len(self.features):
                x = _conv_relu_pool(x, s, self.features[s], self.kernel_size, train=train, scale=self.train_scale)
            else:
                x = nn.Dense(self.num_classes, name="head")(_flatten(x))
        return x


# ------------------------------------------------- FedSPU CIFAR CNN / LeNet-5 (2c+3f)


class CNN2C3F(nn.Module):
    """CNN with two conv and three fully-connected layers (FedSPU's CIFAR-10 CNN).

    FedSPU follows Li et al. 2021 (Hermes) without giving sizes; we use the classic
    LeNet-style network: conv 5x5 6 -> ReLU -> maxpool 2 -> conv 5x5 16 -> ReLU ->
    maxpool 2 -> flatten -> Dense 120 -> ReLU -> Dense 84 -> ReLU -> Dense(num_classes).
    Layers: ``conv1``, ``conv2``, ``fc1``, ``fc2``, ``head``. 62,006 parameters on
    32x32x3 with 10 classes.

    ``padding`` selects the convolution padding: ``"VALID"`` (the paper network,
    needs images of at least 16x16), ``"SAME"`` (needs at least 4x4), or ``"auto"``
    (default): VALID when both image sides are >= 16 -- so 28x28 MNIST and 32x32
    CIFAR get exactly the paper network -- and SAME otherwise, so the model also
    runs on the 8x8 offline digits instead of failing (with VALID 5x5 convs an
    8x8 image vanishes after the first pool). The choice depends only on the
    static input shape, so one model instance always has one architecture per
    input shape. A stage after the first cannot see the image, so running
    ``conv2`` alone needs the padding fixed first: :meth:`for_input_shape`
    (which :func:`fedpartial.models.from_linen` calls) or an explicit padding.
    Stages: ``conv1``, ``conv2``, ``fc1``, ``fc2``, ``head``.
    """

    num_classes: int
    features: tuple[int, int] = (6, 16)
    hidden: tuple[int, ...] = (120, 84)
    kernel_size: int = 5
    padding: str = "auto"
    train_scale: float = 1.0

    _model_name = "cnn2c3f"
    _width_fields = ("features", "hidden")

    def __post_init__(self):
        if self.padding not in ("auto", "VALID", "SAME"):
            raise ValueError(
                f"{type(self).__name__} padding must be one of 'auto', 'VALID', "
                f"'SAME', got {self.padding!r}."
            )
        super().__post_init__()

    @nn.nowrap
    def _valid_min_hw(self) -> int:
        # Smallest n with: conv (n-k+1) -> pool -> conv -> pool leaving >= 1 pixel.
        n = 1
        for _ in self.features:
            n = 2 * n + self.kernel_size - 1
        return n

    @nn.nowrap
    def resolved_padding(self, input_shape: Sequence[int]) -> str:
        """The padding actually used for images of ``input_shape``."""
        if self.padding != "auto":
            return self.padding
        h, w = _image_hw(self._model_name, input_shape)
        return "VALID" if min(h, w) >= self._valid_min_hw() else "SAME"

    @nn.nowrap
    def for_input_shape(self, input_shape: Sequence[int]) -> CNN2C3F:
        """The same network with the padding ``"auto"`` picks for ``input_shape`` made explicit."""
        return self.clone(padding=self.resolved_padding(input_shape))

    @property
    def stage_names(self) -> tuple[str, ...]:
        convs = tuple(f"conv{i + 1}" for i in range(len(self.features)))
        return convs + tuple(f"fc{i + 1}" for i in range(len(self.hidden))) + ("head",)

    @nn.nowrap
    def validate_input_shape(self, input_shape: Sequence[int]) -> None:
        if self.resolved_padding(input_shape) == "VALID":
            _require_min_hw(
                self._model_name,
                input_shape,
                self._valid_min_hw(),
                f"its two VALID {self.kernel_size}x{self.kernel_size} convolutions "
                "and two 2x2 max-pools",
            )
        else:
            _require_min_hw(self._model_name, input_shape, 4, "its two 2x2 max-pools")

    @nn.compact
    def __call__(self, x, train: bool = False, start: int = 0, stop: int | None = None):
        x = _prepare_input(self, x, start)
        padding = self.resolved_padding(x.shape[1:]) if start == 0 else self.padding
        n_conv, n_fc = len(self.features), len(self.hidden)
        for s in stage_range(len(self.stage_names), start, stop):
            if s < n_conv:
                if padding == "auto":
                    raise ValueError(
                        f"{self._model_name} with padding='auto' chooses its padding from the "
                        f"image size, which stage {s} ({self.stage_names[s]}) cannot see: use "
                        "for_input_shape(input_shape) or an explicit padding."
                    )
                x = _conv_relu_pool(x, s, self.features[s], self.kernel_size, padding, train=train,
                                    scale=self.train_scale)
            elif s < n_conv + n_fc:
                if s == n_conv:
                    x = _flatten(x)
                x = nn.Dense(self.hidden[s - n_conv], name=f"fc{s - n_conv + 1}")(x)
                x = nn.relu(_train_scaled(x, train, self.train_scale))
            else:
                x = nn.Dense(self.num_classes, name="head")(_flatten(x))
        return x


class LeNet5(CNN2C3F):
    """LeNet-5 as used by FedDHAD (LeCun et al. 1989/1998), with ReLU activations.

    conv 5x5 6 -> ReLU -> maxpool 2 -> conv 5x5 16 -> ReLU -> maxpool 2 -> flatten ->
    Dense 120 -> ReLU -> Dense 84 -> ReLU -> Dense(num_classes). FedDHAD reports
    62,006 parameters for CIFAR-10, which is exactly this network on 32x32x3 (the
    original's tanh/sigmoid and subsampling layers are replaced by ReLU and
    max-pooling, as in modern FL code; C5 is the equivalent Dense over the 5x5x16
    map). It is therefore the same architecture as :class:`CNN2C3F`, including
    the ``padding="auto"`` rule (VALID convs for images >= 16x16, SAME below).
    Layers: ``conv1``, ``conv2``, ``fc1``, ``fc2``, ``head``.
    """

    _model_name = "lenet5"


# ------------------------------------------------------------------------ VGG-9


class VGG9(nn.Module):
    """VGG-9 of the FedLDF paper: 8 conv layers, each followed by BN, + 1 linear layer.

    Each conv is 3x3 'SAME' without bias (BN's shift replaces it) -> BatchNorm ->
    ReLU; channel widths 64, 64, 128, 128, 256, 256, 512, 512 (the paper gives
    none). The paper says max-pooling follows each conv, but eight 2x2 pools would
    shrink a 32x32 CIFAR image below one pixel after the fifth, so we pool after
    convs 2, 4, 6 and 8 as in VGG's conv pairs (32 -> 2 pixels), flatten, and
    apply one Dense classifier. The four pools need images of at least 16x16
    (smaller inputs, e.g. 8x8 digits, raise ValueError).
    Layers: ``conv1``/``bn1`` .. ``conv8``/``bn8``, ``head``. Stages: ``conv1`` ..
    ``conv8`` (conv + BN + ReLU, + pool where it applies), ``head``.
    """

    num_classes: int
    features: tuple[int, ...] = (64, 64, 128, 128, 256, 256, 512, 512)
    pool_after: tuple[int, ...] = (2, 4, 6, 8)  # 1-based conv indices
    train_scale: float = 1.0

    _width_fields = ("features",)

    @property
    def stage_names(self) -> tuple[str, ...]:
        return tuple(f"conv{i + 1}" for i in range(len(self.features))) + ("head",)

    @nn.nowrap
    def validate_input_shape(self, input_shape: Sequence[int]) -> None:
        n = len(self.pool_after)
        _require_min_hw("vgg9", input_shape, 2**n, f"its {n} 2x2 max-pools")

    @nn.compact
    def __call__(self, x, train: bool = False, start: int = 0, stop: int | None = None):
        x = _prepare_input(self, x, start)
        for s in stage_range(len(self.stage_names), start, stop):
            if s == len(self.features):
                x = nn.Dense(self.num_classes, name="head")(_flatten(x))
                continue
            i = s + 1
            x = nn.Conv(
                self.features[s],
                (3, 3),
                padding="SAME",
                use_bias=False,
                kernel_init=_he_normal,
                name=f"conv{i}",
            )(x)
            x = nn.relu(_batch_norm(train, f"bn{i}")(_train_scaled(x, train, self.train_scale)))
            if i in self.pool_after:
                x = _max_pool(x)
        return x


# ---------------------------------------------------------------------- ResNet20


def _place_channels(x, offset: int, features: int):
    """``[..., C]`` -> ``[..., features]``: input channel ``j`` at ``offset + j``, zeros elsewhere."""
    n = max(0, min(x.shape[-1], features - offset))
    if n == 0:
        return jnp.zeros((*x.shape[:-1], features), x.dtype)
    pad = [(0, 0)] * (x.ndim - 1) + [(offset, features - offset - n)]
    return jnp.pad(x[..., :n], pad)


class BasicBlock(nn.Module):
    """ResNet basic block: conv3x3-BN-ReLU-conv3x3-BN, + shortcut, ReLU.

    Call order: ``conv1``, ``bn1``, ``conv2``, ``bn2``, then (downsampling blocks
    with ``shortcut="projection"``) ``shortcut_conv``, ``shortcut_bn``. The
    shortcut is called after the main branch because its output joins the block
    output, i.e. it sits on the output side of the block's first conv.

    ``shortcut="zeros"`` places input channel ``j`` at output channel
    ``shortcut_offset + j`` (channels past ``features`` are cut off); None centres
    the input, offset ``(features - in_features) // 2``.  A width-reduced block
    keeps its full-width block's offset, so its channels are that block's leading
    channels.  ``train_scale`` multiplies every conv output in training (before BN).
    """

    features: int
    strides: int = 1
    shortcut: str = "projection"
    shortcut_offset: int | None = None
    train_scale: float = 1.0

    @nn.compact
    def __call__(self, x, train: bool = False):
        in_features = x.shape[-1]
        s = (self.strides, self.strides)
        # Symmetric padding 1 (as He et al./PyTorch): same output size as 'SAME',
        # and output pixel i is centred on input pixel strides*i, which is what the
        # option-A subsampling x[:, ::2, ::2] picks.
        y = nn.Conv(
            self.features, (3, 3), strides=s, padding=1, use_bias=False,
            kernel_init=_he_normal, name="conv1",
        )(x)
        y = nn.relu(_batch_norm(train, "bn1")(_train_scaled(y, train, self.train_scale)))
        y = nn.Conv(
            self.features, (3, 3), padding=1, use_bias=False,
            kernel_init=_he_normal, name="conv2",
        )(y)
        y = _batch_norm(train, "bn2")(_train_scaled(y, train, self.train_scale))
        if self.strides != 1 or in_features != self.features:
            if self.shortcut == "projection":
                r = nn.Conv(
                    self.features, (1, 1), strides=s, padding=0, use_bias=False,
                    kernel_init=_he_normal, name="shortcut_conv",
                )(x)
                r = _batch_norm(train, "shortcut_bn")(_train_scaled(r, train, self.train_scale))
            elif self.shortcut_offset is None:  # "zeros": option A, parameter-free
                r = x[:, :: self.strides, :: self.strides, :]
                extra = self.features - in_features
                r = jnp.pad(r, ((0, 0), (0, 0), (0, 0), (extra // 2, extra - extra // 2)))
            else:
                r = _place_channels(x[:, :: self.strides, :: self.strides, :], self.shortcut_offset, self.features)
        else:
            r = x
        return nn.relu(y + r)


class ResNet20(nn.Module):
    """CIFAR ResNet20 (He et al. 2016): 3 stages x 3 basic blocks, 16/32/64 channels.

    conv 3x3 16 -> BN -> ReLU -> 9 basic blocks (stages 2 and 3 start with stride 2)
    -> global average pool -> Dense(num_classes). Convs have no bias; every conv is
    followed by BatchNorm. Not sequential (residual connections).

    ``shortcut="projection"`` (default) uses a 1x1 conv + BN on the two
    downsampling blocks (272,474 parameters for 10 classes); ``shortcut="zeros"``
    is option A, strided subsampling + zero-padded channels (269,722 parameters).
    The EmbracingFL paper's 272,762 is 288 more than our projection variant:
    exactly a 1x1 16->16 conv + BN (256 + 32) on the first block of stage 1, which
    their implementation projects although its shape does not change.
    Layers: ``conv1``/``bn1``, ``stage{s}_block{b}`` (see :class:`BasicBlock`),
    ``head``. Works for any image size (8x8 digits included).

    Width reduction (:func:`narrowed`) scales ``stage_features``; with
    ``shortcut="zeros"`` it fixes ``shortcut_offsets`` (per stage, the channel at
    which the option-A shortcut entering the stage places its input; None:
    centred) to the full model's, so the narrow residual stream is the full
    stream's leading channels.  ``train_scale`` multiplies every conv output in
    training (HeteroFL's Scaler, before BN).

    Stages are cut at block boundaries, where the residual stream is one tensor:
    ``stem`` (conv1 + bn1 + ReLU), one stage per block named like its module
    (``stage1_block1`` .. ``stage3_block3``), and ``head`` (global average pool +
    Dense): 11 stages. EmbracingFL's moderate cut (stem + first 3 blocks frozen)
    starts the trained suffix at stage 4, its weak cut at stage 7.
    """

    num_classes: int
    shortcut: str = "projection"
    stage_features: tuple[int, ...] = (16, 32, 64)
    blocks_per_stage: int = 3
    shortcut_offsets: tuple[int, ...] | None = None
    train_scale: float = 1.0

    _width_fields = ("stage_features",)

    def __post_init__(self):
        if self.shortcut not in ("projection", "zeros"):
            raise ValueError(
                f"ResNet20 shortcut must be 'projection' or 'zeros', got {self.shortcut!r}."
            )
        super().__post_init__()

    @nn.nowrap
    def validate_input_shape(self, input_shape: Sequence[int]) -> None:
        _image_hw("resnet20", input_shape)  # stride-2 'SAME'-size convs never vanish

    @nn.nowrap
    def centred_offsets(self) -> tuple[int, ...]:
        """Per stage, where a centred option-A shortcut entering it puts its input channels."""
        widths = (self.stage_features[0], *self.stage_features)
        return tuple((widths[i + 1] - widths[i]) // 2 for i in range(len(self.stage_features)))

    @property
    def stage_names(self) -> tuple[str, ...]:
        blocks = tuple(
            f"stage{si + 1}_block{bi + 1}"
            for si in range(len(self.stage_features))
            for bi in range(self.blocks_per_stage)
        )
        return ("stem",) + blocks + ("head",)

    @nn.compact
    def __call__(self, x, train: bool = False, start: int = 0, stop: int | None = None):
        x = _prepare_input(self, x, start)
        names = self.stage_names
        for s in stage_range(len(names), start, stop):
            if s == 0:
                x = nn.Conv(
                    self.stage_features[0], (3, 3), padding=1, use_bias=False,
                    kernel_init=_he_normal, name="conv1",
                )(x)
                x = nn.relu(_batch_norm(train, "bn1")(_train_scaled(x, train, self.train_scale)))
            elif s == len(names) - 1:
                x = jnp.mean(x, axis=(1, 2))
                x = nn.Dense(self.num_classes, name="head")(x)
            else:
                si, bi = divmod(s - 1, self.blocks_per_stage)
                strides = 2 if (si > 0 and bi == 0) else 1
                offset = None if self.shortcut_offsets is None or bi else self.shortcut_offsets[si]
                x = BasicBlock(
                    self.stage_features[si], strides=strides, shortcut=self.shortcut,
                    shortcut_offset=offset, train_scale=self.train_scale, name=names[s],
                )(x, train=train)
        return x


# --------------------------------------------------------------------- FEMNIST CNN


class FEMNISTCNN(nn.Module):
    """FEMNIST CNN of LEAF, as used by EmbracingFL: 2 conv + 2 dense layers.

    conv 5x5 32 'SAME' -> ReLU -> maxpool 2 -> conv 5x5 64 'SAME' -> ReLU ->
    maxpool 2 -> flatten -> Dense 2048 -> ReLU -> Dense(num_classes). On 28x28x1
    with 62 classes this has 6,603,710 parameters, exactly the paper's count
    (and its "weak" suffix, the last Dense, has 127,038).
    Layers and stages: ``conv1``, ``conv2``, ``fc1``, ``head``. Needs images of at
    least 4x4. EmbracingFL's moderate clients train from stage 2 (``fc1``), weak
    ones from stage 3 (``head``).
    """

    num_classes: int
    features: tuple[int, int] = (32, 64)
    hidden: int = 2048
    train_scale: float = 1.0

    _width_fields = ("features", "hidden")

    @property
    def stage_names(self) -> tuple[str, ...]:
        return tuple(f"conv{i + 1}" for i in range(len(self.features))) + ("fc1", "head")

    @nn.nowrap
    def validate_input_shape(self, input_shape: Sequence[int]) -> None:
        _require_min_hw("femnist_cnn", input_shape, 4, "its two 2x2 max-pools")

    @nn.compact
    def __call__(self, x, train: bool = False, start: int = 0, stop: int | None = None):
        x = _prepare_input(self, x, start)
        n_conv = len(self.features)
        for s in stage_range(len(self.stage_names), start, stop):
            if s < n_conv:
                x = _conv_relu_pool(x, s, self.features[s], 5, train=train, scale=self.train_scale)
            elif s == n_conv:
                x = nn.Dense(self.hidden, name="fc1")(_flatten(x))
                x = nn.relu(_train_scaled(x, train, self.train_scale))
            else:
                x = nn.Dense(self.num_classes, name="head")(x)
        return x


# ----------------------------------------------------------------- width reduction


def narrow_units(ratio: float, units: int) -> int:
    """⌈ratio·units⌉, at least 1 (robust to float noise: 0.4375·16 = 7 exactly)."""
    return max(1, math.ceil(round(ratio * units, 9)))


def narrowed(module: nn.Module, ratio: float, *, scaler: bool = True) -> nn.Module:
    """``module`` with ``⌈ratio·C⌉`` channels/units in every hidden layer (width reduction).

    The classifier keeps every class.  ``scaler``: hidden Conv/Dense outputs are
    multiplied by ``1/ratio`` in training (HeteroFL's Scaler); evaluation is never
    scaled.  ``ratio = 1`` with ``scaler`` on is the module itself.

    Raises:
      UserError: ``ratio`` outside (0, 1], or a module without width fields
        (not a zoo model).
    """
    if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real) or not 0 < ratio <= 1:
        raise UserError(f"width ratio {ratio!r} must be a number in (0, 1].")
    fields = getattr(type(module), "_width_fields", None)
    if fields is None:
        raise UserError(
            f"{type(module).__name__} has no width-reduced version; width reduction needs a model of "
            "fedpartial._src.models.zoo (mlp, cnn2c1f, cnn2c3f, lenet5, vgg9, resnet20, femnist_cnn)."
        )
    changes: dict[str, Any] = {}
    for field in fields:
        value = getattr(module, field)
        changes[field] = (narrow_units(ratio, value) if isinstance(value, numbers.Integral)
                          else tuple(narrow_units(ratio, v) for v in value))
    if isinstance(module, ResNet20) and module.shortcut == "zeros":
        changes["shortcut_offsets"] = module.shortcut_offsets or module.centred_offsets()
    changes["train_scale"] = module.train_scale / ratio if scaler else module.train_scale
    return module.clone(**changes)
