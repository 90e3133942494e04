"""Model zoo (Flax linen) and adapters turning any Flax module into an engine :class:`Model`."""

from fedpartial._src.models.adapter import Model, from_linen, from_nnx, from_stages
from fedpartial._src.models.conv import CONV_IMPLS
from fedpartial._src.models.conv import lowering as conv_lowering
from fedpartial._src.models.exits import MultiExitModel, with_exits
from fedpartial._src.models.lora import Adapter, LoraSpec, lora, merge_adapters, merge_into_base
from fedpartial._src.models.lora_ranks import client_ranks, with_lora_ranks
from fedpartial._src.models.params_io import load_params, save_params
from fedpartial._src.models.registry import MODELS, ModelSpec, build_model
from fedpartial._src.models.transformer import SIZES as MODEL_SIZES

__all__ = ["CONV_IMPLS", "MODELS", "MODEL_SIZES", "Model", "conv_lowering", "ModelSpec", "MultiExitModel", "build_model",
           "from_linen", "from_nnx", "from_stages", "load_params", "save_params", "with_exits", "Adapter", "LoraSpec",
           "lora", "merge_adapters", "merge_into_base", "client_ranks", "with_lora_ranks"]
