"""A policy's weights as an inference engine loads them: under its checkpoint's names, LoRA adapters merged aside
(the colocated vLLM engine's ``reload_weights``, the vLLM server's push)."""

from __future__ import annotations

from collections.abc import Iterator

import torch


def policy_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every weight of the Hugging Face causal LM ``model`` (or a ``PeftModel`` around one) under
    the names its checkpoint uses, which vLLM's ``reload_weights`` takes. LoRA layers are yielded merged (base weight +
    the active adapters' delta), computed aside: the policy's own weights are not touched."""
    lora = model.get_base_model() if hasattr(model, "get_base_model") else None
    if lora is None:
        yield from ((name, param.detach()) for name, param in model.named_parameters())
        return
    for module_name, module in lora.named_modules():
        for name, param in module.named_parameters(prefix=module_name, recurse=False):
            if ".lora_" in name or "original_module" in name:
                continue  # adapters are merged below; modules_to_save keeps its trained copy
            weight = param.detach()
            if name.endswith(".base_layer.weight"):
                layer = lora.get_submodule(name.removesuffix(".base_layer.weight"))
                if not layer.merged:
                    weight = weight + sum(layer.get_delta_weight(a) for a in layer.active_adapters)
            yield name.replace(".base_layer", "").replace("modules_to_save.default.", ""), weight
