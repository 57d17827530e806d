"""What a loaded model can do, each question answered in one place.

The sequence layouts (``lit_align.layouts``), the log-prob kernel (``lit_align.logps``), the engines
(``lit_align.generation``) and the modules ask these instead of reading configs and wrappers themselves.
"""

from __future__ import annotations

import inspect

import torch

CUSTOM_MASK_ATTENTION = ("sdpa", "eager")

# Architectures whose forward honours a custom 4D attention mask and explicit ``position_ids`` with their usual meaning
# (rotary positions; no ALiBi or other bias derived from a 2D mask): they can run DPO's shared-prompt rows.
CUSTOM_MASK_MODEL_TYPES = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2", "phi3", "olmo",
    "olmo2", "granite", "smollm3", "cohere", "starcoder2", "glm", "helium",
})


def attention_implementation(model: torch.nn.Module) -> str | None:
    """``sdpa``, ``eager``, ``flash_attention_2``, ... as the model's config records it (None if it has none)."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def takes_custom_mask(model: torch.nn.Module) -> bool:
    """Whether the model's attention takes a 4D mask we build (``sdpa``: bool, ``eager``: additive)."""
    return attention_implementation(model) in CUSTOM_MASK_ATTENTION


def full_attention_only(model: torch.nn.Module) -> list[str] | None:
    """None when every layer is full attention; else the layer types the model has (sliding, linear, ...)."""
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    return None if layer_types == {"full_attention"} else sorted(layer_types)


def forward_parameters(model: torch.nn.Module):
    """The parameters of the forward a call on ``model`` ends in: through FSDP's wrapper, whose own forward passes
    every keyword on to ``model.module``."""
    return inspect.signature(getattr(model, "module", model).forward).parameters


def cache_keyword(model: torch.nn.Module) -> str:
    """The forward's name for the KV cache: ``cache`` (transformers >= 5.20) or ``past_key_values`` (before)."""
    return "cache" if "cache" in forward_parameters(model) else "past_key_values"


def takes_logits_to_keep(model: torch.nn.Module) -> bool:
    return "logits_to_keep" in forward_parameters(model)


def supports_shared_prompt(model: torch.nn.Module) -> bool:
    """Whether ``model`` can run rows whose tokens see a custom subset of the row (DPO's ``[prompt, chosen,
    rejected]`` rows, ``lit_align.layouts.shared_prompt_pairs``): a known architecture, a custom mask, explicit
    positions, and no router aux loss (it reads a 2D mask)."""
    config = getattr(model, "config", None)
    return (
        config is not None and getattr(model, "forward", None) is not None
        and getattr(config, "model_type", None) in CUSTOM_MASK_MODEL_TYPES
        and takes_custom_mask(model)
        and not getattr(config, "output_router_logits", False)
        and "position_ids" in forward_parameters(model)
    )


def is_fsdp_unit(model: torch.nn.Module) -> bool:
    """Whether ``model`` itself is wrapped as one FSDP unit (its parameters are whole only inside its forward)."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # torch built without distributed
        return False
    return isinstance(model, FullyShardedDataParallel)


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether any of ``model``'s parameters are sharded (FSDP, FSDP2, DeepSpeed ZeRO-3)."""
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    except ImportError:
        return False
    if any(isinstance(m, (FullyShardedDataParallel, FSDPModule)) for m in model.modules()):
        return True
    return any(hasattr(p, "ds_id") for p in model.parameters())


def sharded_strategy(trainer) -> bool:
    """Whether ``trainer``'s strategy keeps parameters sharded outside a forward (FSDP, DeepSpeed ZeRO-3)."""
    from lightning.pytorch.strategies import FSDPStrategy

    return isinstance(trainer.strategy, FSDPStrategy) or deepspeed_zero3(trainer)


def deepspeed_zero3(trainer) -> bool:
    """Whether ``trainer`` runs DeepSpeed ZeRO-3 (``configure_model`` then creates parameters partitioned)."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    return trainer is not None and isinstance(trainer.strategy, DeepSpeedStrategy) and trainer.strategy.zero_stage_3
