"""The residual family of the model zoo: CIFAR ResNet20 and its basic block.

The models follow the contract of :mod:`fedpartial._src.models.zoo` (stages,
call order, BatchNorm, width reduction by :func:`~fedpartial._src.models.zoo.narrowed`)
and share its building blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from fedpartial._src.models.conv import lowering
from fedpartial._src.models.zoo import batch_norm, he_normal, image_hw, prepare_input, stage_range, train_scaled

__all__ = ["BasicBlock", "ResNet20"]


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
    conv_impl: str = "lax"  # how the convolutions are lowered (fedpartial._src.models.conv.CONV_IMPLS)

    @nn.compact
    def __call__(self, x, train: bool = False):
        in_features = x.shape[-1]
        s = (self.strides, self.strides)
        # Symmetric padding 1 (as He et al./PyTorch): same output size as 'SAME',
        # and output pixel i is centred on input pixel strides*i, which is what the
        # option-A subsampling x[:, ::2, ::2] picks.
        y = nn.Conv(
            self.features, (3, 3), strides=s, padding=1, use_bias=False,
            kernel_init=he_normal, name="conv1", conv_general_dilated=lowering(self.conv_impl),
        )(x)
        y = nn.relu(batch_norm(train, "bn1")(train_scaled(y, train, self.train_scale)))
        y = nn.Conv(
            self.features, (3, 3), padding=1, use_bias=False,
            kernel_init=he_normal, name="conv2", conv_general_dilated=lowering(self.conv_impl),
        )(y)
        y = batch_norm(train, "bn2")(train_scaled(y, train, self.train_scale))
        if self.strides != 1 or in_features != self.features:
            if self.shortcut == "projection":
                r = nn.Conv(
                    self.features, (1, 1), strides=s, padding=0, use_bias=False,
                    kernel_init=he_normal, name="shortcut_conv",
                    conv_general_dilated=lowering(self.conv_impl),
                )(x)
                r = batch_norm(train, "shortcut_bn")(train_scaled(r, train, self.train_scale))
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

    Width reduction (:func:`fedpartial._src.models.zoo.narrowed`) scales ``stage_features``; with
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
    conv_impl: str = "lax"  # how the convolutions are lowered (fedpartial._src.models.conv.CONV_IMPLS)

    _width_fields = ("stage_features",)

    def __post_init__(self):
        if self.shortcut not in ("projection", "zeros"):
            raise ValueError(
                f"ResNet20 shortcut must be 'projection' or 'zeros', got {self.shortcut!r}."
            )
        super().__post_init__()

    @nn.nowrap
    def validate_input_shape(self, input_shape: Sequence[int]) -> None:
        image_hw("resnet20", input_shape)  # stride-2 'SAME'-size convs never vanish

    @nn.nowrap
    def centred_offsets(self) -> tuple[int, ...]:
        """Per stage, where a centred option-A shortcut entering it puts its input channels."""
        widths = (self.stage_features[0], *self.stage_features)
        return tuple((widths[i + 1] - widths[i]) // 2 for i in range(len(self.stage_features)))

    @nn.nowrap
    def kept_when_narrowed(self) -> dict[str, Any]:
        """Fields a width-reduced copy keeps from this model: with option-A shortcuts, their offsets, so
        the narrow residual stream is the full stream's leading channels."""
        if self.shortcut != "zeros":
            return {}
        return {"shortcut_offsets": self.shortcut_offsets or self.centred_offsets()}

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
        x = prepare_input(self, x, start)
        names = self.stage_names
        for s in stage_range(len(names), start, stop):
            if s == 0:
                x = nn.Conv(
                    self.stage_features[0], (3, 3), padding=1, use_bias=False,
                    kernel_init=he_normal, name="conv1",
                    conv_general_dilated=lowering(self.conv_impl),
                )(x)
                x = nn.relu(batch_norm(train, "bn1")(train_scaled(x, train, self.train_scale)))
            elif s == len(names) - 1:
                x = jnp.mean(x, axis=(1, 2))
                x = nn.Dense(self.num_classes, name="head")(x)
            else:
                si, bi = divmod(s - 1, self.blocks_per_stage)
                strides = 2 if (si > 0 and bi == 0) else 1
                offset = None if self.shortcut_offsets is None or bi else self.shortcut_offsets[si]
                x = BasicBlock(
                    self.stage_features[si], strides=strides, shortcut=self.shortcut,
                    shortcut_offset=offset, train_scale=self.train_scale, conv_impl=self.conv_impl,
                    name=names[s],
                )(x, train=train)
        return x
