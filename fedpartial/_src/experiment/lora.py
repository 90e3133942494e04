"""A run's LoRA settings (``--lora``, ``--lora-alpha``, ``--lora-targets``, ``--lora-ranks``): the model transform
and the rank tiers, each refused in one sentence naming the flag when it cannot apply."""

from __future__ import annotations

from fedpartial._src.core.errors import UserError
from fedpartial._src.experiment.settings import ConfigError
from fedpartial._src.core.types import Method
from fedpartial._src.methods.lora.ranks import rank_tiers
from fedpartial._src.models.adapter import Model
from fedpartial._src.models.lora import lora
from fedpartial._src.models.lora_ranks import with_lora_ranks


def _names(text: str | None) -> tuple[str, ...] | None:
    if text is None:
        return None
    names = tuple(t.strip() for t in str(text).split(",") if t.strip())
    if not names:
        raise ConfigError(f"--lora-targets {text!r} names no layer; give layer names or globs, e.g. block*/attn/*.")
    return names


def lora_ranks(config) -> tuple[int, ...] | None:
    """``--lora-ranks`` as whole numbers, each between 1 and ``--lora`` (None when not given)."""
    text = getattr(config, "lora_ranks", None)
    if text is None:
        return None
    if config.lora is None:
        raise ConfigError(f"--lora-ranks {text} needs adapters to rank; add --lora RANK (the largest rank).")
    try:
        ranks = tuple(int(t) for t in str(text).split(","))
    except ValueError:
        raise ConfigError(f"--lora-ranks {text!r} must be comma-separated whole numbers, e.g. 2,4,8.") from None
    if not ranks or any(not 1 <= r <= config.lora for r in ranks):
        raise ConfigError(f"--lora-ranks {text} must be whole numbers between 1 and --lora {config.lora}.")
    return ranks


def with_lora(config, model: Model) -> Model:
    """``model`` with the run's LoRA adapters (itself without ``--lora``, or when it has adapters already)."""
    rank = getattr(config, "lora", None)
    if rank is None:
        for flag, value in (("--lora-alpha", config.lora_alpha), ("--lora-targets", config.lora_targets),
                            ("--lora-ranks", config.lora_ranks)):
            if value is not None:
                raise ConfigError(f"{flag} {value} applies to LoRA adapters; add --lora RANK.")
        return model
    ranks = lora_ranks(config)
    if model.lora is not None:
        return model
    try:
        model = lora(model, rank, alpha=config.lora_alpha, targets=_names(config.lora_targets))
    except ConfigError:
        raise
    except UserError as error:
        raise ConfigError(str(error)) from None
    return model if ranks is None else with_lora_ranks(model, ranks)


def with_rank_tiers(config, method: Method) -> Method:
    """``method`` with the run's ``--lora-ranks`` tiers around it (itself without them)."""
    return method if lora_ranks(config) is None else rank_tiers(method)
