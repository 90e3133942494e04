"""Registry of the model zoo: names -> :class:`ModelSpec`, and :func:`build_model`.

``input_shape`` is the shape of one example without the batch axis, e.g.
``(8, 8, 1)`` for the offline digits, ``(28, 28, 1)`` for (E/FE)MNIST,
``(32, 32, 3)`` for CIFAR, ``(256,)`` (token ids) for IMDB. ``sequential`` tells the engine whether the model is
a plain chain of layers (every layer feeds only the next one), the condition for
neuron-level masks; residual models are not sequential.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import numbers
from collections.abc import Callable, Sequence

import flax.linen as nn

from fedpartial._src.core.errors import UserError
from fedpartial._src.models import conv, recurrent, resnet, text, transformer, zoo

__all__ = ["MODELS", "ModelSpec", "build_model", "build_narrow_model", "find_model", "sized_models"]


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """How to build one zoo model.

    Attributes:
      factory: ``factory(num_classes, input_shape) -> flax.linen.Module``.
      description: one line saying what the model is.
      sequential: True when every layer feeds only the next layer (a chain with no
        residual/skip connections); only such models support neuron-level masks.
      sized: whether the model comes in the named sizes of ``--model-size``
        (:data:`~fedpartial.models.MODEL_SIZES`); its factory then also takes ``size``.
      language_model: whether the model predicts the next token at every position of its token ids (labels
        per position, ``num_classes`` its vocabulary); a run gives it next-character data in that view.
    """

    factory: Callable[..., nn.Module]
    description: str
    sequential: bool
    sized: bool = False
    language_model: bool = False


#: the model zoo: each name of ``--model`` (``fedpartial list models``) -> how to build it
MODELS: dict[str, ModelSpec] = {
    "mlp": ModelSpec(
        factory=lambda num_classes, input_shape: zoo.MLP(num_classes=num_classes),
        description="MLP: flatten -> Dense 200 -> ReLU -> Dense 200 -> ReLU -> Dense.",
        sequential=True,
    ),
    "cnn2c1f": ModelSpec(
        factory=lambda num_classes, input_shape: zoo.CNN2C1F(num_classes=num_classes),
        description="FedSPU EMNIST/Speech CNN: conv5x5 32, conv5x5 64 (max-pool each), 1 Dense.",
        sequential=True,
    ),
    "cnn2c3f": ModelSpec(
        factory=lambda num_classes, input_shape: zoo.CNN2C3F(num_classes=num_classes),
        description="FedSPU CIFAR-10 CNN: conv5x5 6, conv5x5 16 (max-pool each), Dense 120-84-out.",
        sequential=True,
    ),
    "lenet5": ModelSpec(
        factory=lambda num_classes, input_shape: zoo.LeNet5(num_classes=num_classes),
        description="LeNet-5 (ReLU) as in FedDHAD: conv 6, conv 16, Dense 120, 84, out.",
        sequential=True,
    ),
    "vgg9": ModelSpec(
        factory=lambda num_classes, input_shape: zoo.VGG9(num_classes=num_classes),
        description="FedLDF VGG-9: 8 conv3x3+BN (max-pool after every 2nd) + 1 Dense.",
        sequential=True,
    ),
    "resnet20": ModelSpec(
        factory=lambda num_classes, input_shape: resnet.ResNet20(num_classes=num_classes),
        description="CIFAR ResNet20 (BN, 1x1 projection shortcuts), as in EmbracingFL.",
        sequential=False,
    ),
    "femnist_cnn": ModelSpec(
        factory=lambda num_classes, input_shape: zoo.FEMNISTCNN(num_classes=num_classes),
        description="LEAF FEMNIST CNN (EmbracingFL): conv5x5 32, conv5x5 64, Dense 2048, out.",
        sequential=True,
    ),
    "bilstm": ModelSpec(
        factory=lambda num_classes, input_shape: text.BiLSTM(num_classes=num_classes),
        description="EmbracingFL IMDB BiLSTM: embedding 10,000x256, bidirectional LSTM 256, Dense (token ids).",
        sequential=False,
    ),
    "shakespeare_lstm": ModelSpec(
        factory=lambda num_classes, input_shape: recurrent.shakespeare_lstm(num_classes),
        description="LEAF Shakespeare LSTM: embedding 8 (82 character ids), 2 LSTM layers of 256, next-character "
                    "Dense (token ids).",
        sequential=False,
    ),
    "sent140_lstm": ModelSpec(
        factory=lambda num_classes, input_shape: recurrent.sent140_lstm(num_classes),
        description="LEAF Sent140 LSTM: embedding 10,000x300, 2 LSTM layers of 100, Dense 30, Dense (token ids).",
        sequential=False,
    ),
    "transformer_lm": ModelSpec(
        factory=lambda num_classes, input_shape, size=transformer.DEFAULT_SIZE: transformer.TransformerLM(
            num_classes=num_classes, size=size),
        description="Decoder-only causal transformer language model (pre-LayerNorm, GPT-2 style; token ids in, "
                    "next-token logits out; --model-size).",
        sequential=False, sized=True, language_model=True,
    ),
    "transformer_cls": ModelSpec(
        factory=lambda num_classes, input_shape, size=transformer.DEFAULT_SIZE: transformer.TransformerCLS(
            num_classes=num_classes, size=size),
        description="Transformer encoder text classifier (pre-LayerNorm, mean-pooled; token ids; --model-size).",
        sequential=False, sized=True,
    ),
    "vit": ModelSpec(
        factory=lambda num_classes, input_shape, size=transformer.DEFAULT_SIZE: transformer.ViT(
            num_classes=num_classes, size=size),
        description="Vision transformer: image patches -> pre-LayerNorm encoder -> mean-pooled classifier "
                    "(--model-size).",
        sequential=False, sized=True,
    ),
}


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def find_model(name: str) -> ModelSpec:
    """The model ``name`` names: a zoo model, or ``package.module:factory`` for a user's own.

    The attribute a reference names is a :class:`ModelSpec`, a ``flax.linen.Module`` subclass (built as
    ``cls(num_classes=C)``) or a factory ``factory(num_classes, input_shape) -> flax.linen.Module``; the
    module is imported as ``--method`` plug-ins are (the command line puts the working directory on the
    path). A user's model is taken as not sequential (no neuron-level methods) unless the attribute says
    ``sequential = True``, and as a classifier unless it says ``language_model = True``.

    Raises:
      UserError: an unknown name, or a reference that cannot be imported, in one sentence.
    """
    if name in MODELS:
        return MODELS[name]
    if not isinstance(name, str) or ":" not in name:
        raise UserError(f"Unknown model name {name!r}; allowed names are: {', '.join(sorted(MODELS))}, or "
                        "package.module:factory for your own.")
    module_name, _, attribute = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UserError(f"model {name!r}: module {module_name!r} cannot be imported ({e}).") from None
    try:
        obj = functools.reduce(getattr, attribute.split("."), module)
    except AttributeError:
        raise UserError(f"model {name!r}: module {module_name!r} has no {attribute!r}.") from None
    if isinstance(obj, ModelSpec):
        return obj
    sequential = bool(getattr(obj, "sequential", False))
    language_model = bool(getattr(obj, "language_model", False))
    if isinstance(obj, type) and issubclass(obj, nn.Module):
        return ModelSpec(lambda num_classes, input_shape: obj(num_classes=num_classes),
                         (obj.__doc__ or name).strip().splitlines()[0], sequential, language_model=language_model)
    if callable(obj):
        return ModelSpec(obj, ((getattr(obj, "__doc__", None) or name).strip().splitlines() or [name])[0],
                         sequential, language_model=language_model)
    raise UserError(f"model {name!r} is a {type(obj).__name__}, not a flax.linen.Module class, a ModelSpec or a "
                    "factory(num_classes, input_shape) returning a module.")


def build_model(name: str, num_classes: int, input_shape: Sequence[int], *, conv_impl: str = "lax",
                size: str = transformer.DEFAULT_SIZE) -> nn.Module:
    """Build zoo model ``name`` for ``num_classes`` classes and examples of ``input_shape``.

    Args:
      name: a zoo model (``fedpartial list models``; :data:`~fedpartial.models.MODELS`).
      num_classes: output classes.
      input_shape: one example's shape (no batch axis).
      conv_impl: how its convolutions are lowered (:data:`fedpartial.models.CONV_IMPLS`; the same parameters
        and, within float32 rounding, the same results); a model without convolutions ignores it.
      size: a named size (:data:`~fedpartial.models.MODEL_SIZES`) for the models that come in sizes (the
        transformers); the others take only the default, ``'tiny'``.

    Returns:
      The Flax linen module (adapt it with :func:`from_linen`).

    Examples:
      >>> from fedpartial import models
      >>> module = models.build_model("mlp", 10, (64,))
      >>> models.from_linen(module, input_shape=(64,), num_classes=10).structure.num_layers
      3

    Raises:
      ValueError: unknown ``name``, ``num_classes`` not a positive integer, or an
        ``input_shape`` the model cannot take (wrong rank, or too small for its
        pooling).
    """
    spec = find_model(name)
    if not _is_int(num_classes) or num_classes < 1:
        raise UserError(
            f"Model {name!r} needs num_classes to be a positive integer, got {num_classes!r}."
        )
    try:
        shape = tuple(input_shape)
    except TypeError:
        shape = None
    if shape is None or not all(_is_int(d) for d in shape):
        raise UserError(
            f"Model {name!r} needs input_shape to be a tuple of integers without the "
            f"batch axis, got {input_shape!r}."
        )
    shape = tuple(int(d) for d in shape)
    conv.check_conv_impl(conv_impl)
    if spec.sized:
        transformer.check_size(size)
        module = spec.factory(int(num_classes), shape, size)
    elif size != transformer.DEFAULT_SIZE:
        raise UserError(f"--model-size {size!r} applies to the models that come in sizes "
                        f"({', '.join(sized_models())}), not to {name!r}; leave it at "
                        f"{transformer.DEFAULT_SIZE!r}.")
    else:
        module = spec.factory(int(num_classes), shape)
    if not isinstance(module, nn.Module):
        raise UserError(f"model {name!r} built a {type(module).__name__}, not a flax.linen.Module.")
    if conv_impl != "lax" and hasattr(module, "conv_impl"):
        module = module.clone(conv_impl=conv_impl)
    validate = getattr(module, "validate_input_shape", None)
    if validate is not None:
        validate(shape)
    return module


def sized_models() -> tuple[str, ...]:
    """The zoo models that come in the named sizes of ``--model-size``."""
    return tuple(name for name, spec in MODELS.items() if spec.sized)


def build_narrow_model(name: str, num_classes: int, input_shape: Sequence[int], ratio: float, *,
                       scaler: bool = True) -> nn.Module:
    """Zoo model ``name`` with ``⌈ratio·C⌉`` channels/units in every hidden layer (:func:`zoo.narrowed`).

    Raises:
      UserError: as :func:`build_model`, a ratio outside (0, 1], or a model without a
        width-reduced version.
    """
    return zoo.narrowed(build_model(name, num_classes, input_shape), ratio, scaler=scaler)
