"""Model zoo: the Flax (linen) networks used by the papers fedpartial reproduces.

This module holds the plain chains (MLP and CNNs, VGG-9), the building blocks
the zoo shares, and width reduction; the residual ResNet20 is in
:mod:`fedpartial._src.models.resnet`.  Every model follows one contract, which the engine relies on to discover the
"layer" structure of docs/decisions.md#engine by intercepting module calls at init:

* ``__call__(self, x, train: bool = False, start: int = 0, stop: int | None = None)``
  returns float32 logits ``[batch, num_classes]`` with the defaults; images are
  NHWC float32.
* The forward pass is a chain of named *stages* (``stage_names``, a property
  that needs no call): ``start``/``stop`` run stages ``[start, stop)`` only, on
  the raw input when ``start == 0`` and on the output of stage ``start - 1``
  otherwise (input checks and the float32 cast happen only at ``start == 0``).
  Only the running stages create submodules, and parameter names do not depend
  on the range, so a suffix runs with just its own variables: this is how a
  client trains the output side on cached activations (docs/decisions.md#embracingfl). The last
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
names the fields that set its hidden widths (``_width_fields``), and may name
fields a narrowed copy keeps at their full-width values (``kept_when_narrowed()``);
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
from fedpartial._src.models.conv import lowering
from fedpartial._src.models.pooling import max_pool

__all__ = [
    "CNN2C1F",
    "CNN2C3F",
    "FEMNISTCNN",
    "MLP",
    "VGG9",
    "LeNet5",
    "check_width_ratio",
    "narrow_units",
    "narrowed",
    "stage_range",
]

# ---- building blocks shared by the zoo's models (resnet.py's too) ---------------------------------

he_normal = nn.initializers.he_normal()


def batch_norm(train: bool, name: str) -> nn.BatchNorm:
    """The zoo's BatchNorm: batch statistics in training, running ones (momentum 0.9) otherwise."""
    return nn.BatchNorm(
        use_running_average=not train, momentum=0.9, epsilon=1e-5, name=name
    )


def _max_pool(x):
    return max_pool(x, (2, 2))  # nn.max_pool's 2x2, stride 2, 'VALID', bit for bit (pooling.py says why not it)


def _flatten(x):
    return x.reshape((x.shape[0], -1))


def train_scaled(x, train: bool, scale: float):
    """HeteroFL's Scaler: ``x · scale`` in training, ``x`` otherwise (and always for scale 1)."""
    return x * scale if train and scale != 1.0 else x


def _conv_relu_pool(x, index: int, features: int, kernel_size: int, padding: Any = "SAME", *,
                    train: bool = False, scale: float = 1.0, conv_impl: str = "lax"):
    """Stage ``conv{index + 1}``: conv -> (train scale) -> ReLU -> 2x2 max-pool.

    Called from a parent's ``@nn.compact`` ``__call__``: the conv becomes its child.
    """
    x = nn.Conv(features, (kernel_size, kernel_size), padding=padding, name=f"conv{index + 1}",
                conv_general_dilated=lowering(conv_impl))(x)
    return _max_pool(nn.relu(train_scaled(x, train, scale)))


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


def as_float(x):
    """``x`` as float32, unless it already is a half-precision float (a bfloat16/float16 compute dtype)."""
    x = jnp.asarray(x)
    return x if x.dtype in (jnp.bfloat16, jnp.float16) else x.astype(jnp.float32)


def prepare_input(module, x, start: int):
    """Checks and casts the raw input; a later stage's input is passed through untouched."""
    if start != 0:
        return x
    x = as_float(x)
    module.validate_input_shape(x.shape[1:])
    return x


def image_hw(model: str, input_shape: Sequence[int]) -> tuple[int, int]:
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
    h, w = image_hw(model, input_shape)
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
            x = as_float(x)
        for s in stage_range(len(self.stage_names), start, stop):
            if s == 0:
                x = _flatten(x)
            if s < len(self.hidden):
                x = nn.Dense(self.hidden[s], name=f"fc{s + 1}")(x)
                x = nn.relu(train_scaled(x, train, self.train_scale))
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
    conv_impl: str = "lax"  # how the convolutions are lowered (fedpartial._src.models.conv.CONV_IMPLS)

    _width_fields = ("features",)

    @property
    def stage_names(self) -> tuple[str, ...]:
        return tuple(f"conv{i + 1}" for i in range(len(self.features))) + ("head",)

    @nn.nowrap
    def validate_input_shape(self, input_shape: Sequence[int]) -> None:
        _require_min_hw("cnn2c1f", input_shape, 4, "its two 2x2 max-pools")

    @nn.compact
    def __call__(self, x, train: bool = False, start: int = 0, stop: int | None = None):
        x = prepare_input(self, x, start)
        for s in stage_range(len(self.stage_names), start, stop):
            if s < len(self.features):
                x = _conv_relu_pool(x, s, self.features[s], self.kernel_size, train=train, scale=self.train_scale,
                                    conv_impl=self.conv_impl)
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
    conv_impl: str = "lax"  # how the convolutions are lowered (fedpartial._src.models.conv.CONV_IMPLS)

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
        h, w = image_hw(self._model_name, input_shape)
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
        x = prepare_input(self, x, start)
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
                                    scale=self.train_scale, conv_impl=self.conv_impl)
            elif s < n_conv + n_fc:
                if s == n_conv:
                    x = _flatten(x)
                x = nn.Dense(self.hidden[s - n_conv], name=f"fc{s - n_conv + 1}")(x)
                x = nn.relu(train_scaled(x, train, self.train_scale))
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
    conv_impl: str = "lax"  # how the convolutions are lowered (fedpartial._src.models.conv.CONV_IMPLS)

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
        x = prepare_input(self, x, start)
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
                kernel_init=he_normal,
                name=f"conv{i}",
                conv_general_dilated=lowering(self.conv_impl),
            )(x)
            x = nn.relu(batch_norm(train, f"bn{i}")(train_scaled(x, train, self.train_scale)))
            if i in self.pool_after:
                x = _max_pool(x)
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
    conv_impl: str = "lax"  # how the convolutions are lowered (fedpartial._src.models.conv.CONV_IMPLS)

    _width_fields = ("features", "hidden")

    @property
    def stage_names(self) -> tuple[str, ...]:
        return tuple(f"conv{i + 1}" for i in range(len(self.features))) + ("fc1", "head")

    @nn.nowrap
    def validate_input_shape(self, input_shape: Sequence[int]) -> None:
        _require_min_hw("femnist_cnn", input_shape, 4, "its two 2x2 max-pools")

    @nn.compact
    def __call__(self, x, train: bool = False, start: int = 0, stop: int | None = None):
        x = prepare_input(self, x, start)
        n_conv = len(self.features)
        for s in stage_range(len(self.stage_names), start, stop):
            if s < n_conv:
                x = _conv_relu_pool(x, s, self.features[s], 5, train=train, scale=self.train_scale,
                                    conv_impl=self.conv_impl)
            elif s == n_conv:
                x = nn.Dense(self.hidden, name="fc1")(_flatten(x))
                x = nn.relu(train_scaled(x, train, self.train_scale))
            else:
                x = nn.Dense(self.num_classes, name="head")(x)
        return x


# ----------------------------------------------------------------- width reduction


def narrow_units(ratio: float, units: int) -> int:
    """⌈ratio·units⌉, at least 1 (robust to float noise: 0.4375·16 = 7 exactly)."""
    return max(1, math.ceil(round(ratio * units, 9)))


def check_width_ratio(ratio) -> float:
    """``ratio`` if it is a width ratio, a number in (0, 1].

    Raises:
      UserError: anything else (one sentence).
    """
    if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real) or not 0 < ratio <= 1:
        raise UserError(f"width ratio {ratio!r} must be a number in (0, 1].")
    return ratio


def narrowed(module: nn.Module, ratio: float, *, scaler: bool = True) -> nn.Module:
    """``module`` with ``⌈ratio·C⌉`` channels/units in every hidden layer (width reduction).

    The classifier keeps every class.  ``scaler``: hidden Conv/Dense outputs are
    multiplied by ``1/ratio`` in training (HeteroFL's Scaler); evaluation is never
    scaled.  ``ratio = 1`` with ``scaler`` on is the module itself.

    Raises:
      UserError: ``ratio`` outside (0, 1], or a module without width fields
        (not a zoo model).
    """
    check_width_ratio(ratio)
    fields = getattr(type(module), "_width_fields", None)
    if fields is None:
        raise UserError(
            f"{type(module).__name__} has no width-reduced version; width reduction needs a zoo model "
            "(mlp, cnn2c1f, cnn2c3f, lenet5, vgg9, resnet20, femnist_cnn)."
        )
    changes: dict[str, Any] = {}
    for field in fields:
        value = getattr(module, field)
        changes[field] = (narrow_units(ratio, value) if isinstance(value, numbers.Integral)
                          else tuple(narrow_units(ratio, v) for v in value))
    kept = getattr(module, "kept_when_narrowed", None)
    if callable(kept):
        changes.update(kept())
    changes["train_scale"] = module.train_scale / ratio if scaler else module.train_scale
    return module.clone(**changes)
