"""What Lightning's sharded strategies need to know about Hugging Face models; the strategies themselves are Lightning's.

``configs/strategy/*.yaml`` pick a strategy (``lit-align fit -c configs/dpo.yaml -c configs/strategy/fsdp.yaml``).
FSDP wraps modules by class, and the decoder-layer class depends on the model a recipe loads, so the YAML names
``DecoderLayers``, a policy that finds the classes when FSDP wraps: every Hugging Face model in the LightningModule
(the policy and the frozen reference alike) lists its layer classes in ``_no_split_modules``.

The reference model is wrapped as a unit of its own (what its ``Reference.shard_unit`` names), so none of its
parameters share a flat parameter with the policy's: its forward gathers only its own shards, and its (frozen) weights
stay out of the optimizer and, since the reference drops its keys from every state dict, out of checkpoints.
"""

from __future__ import annotations

import torch

from lit_align.capabilities import deepspeed_zero3
from lit_align.reference import Reference


class DecoderLayers:
    """FSDP auto-wrap (and activation-checkpointing) policy: each Hugging Face decoder layer, plus a reference's own
    network whole (a frozen reference's model).

    A callable ``(module, recurse, nonwrapped_numel) -> bool`` as ``torch.distributed.fsdp.wrap`` calls it, parents
    before children: a ``PreTrainedModel`` met on the way down contributes its ``_no_split_modules`` class names.

    Args:
        wrap_reference: also wrap a reference's ``shard_unit`` as one unit (for ``auto_wrap_policy``; leave it
            false for ``activation_checkpointing_policy``, the reference runs without gradients).
        extra: more class names to wrap.
    """

    def __init__(self, wrap_reference: bool = True, extra: list[str] | None = None):
        self.wrap_reference = wrap_reference
        self.names: set[str] = set(extra or ())
        self.references: set[int] = set()

    def __call__(self, module: torch.nn.Module, recurse: bool, nonwrapped_numel: int = 0) -> bool:
        if recurse:  # on the way down: learn layer names (and which module is a reference); always descend
            self.names.update(getattr(module, "_no_split_modules", None) or ())
            if self.wrap_reference and isinstance(module, Reference) and module.shard_unit is not None:
                self.references.add(id(module.shard_unit))
            return True
        return type(module).__name__ in self.names or id(module) in self.references

    def __repr__(self) -> str:
        return f"DecoderLayers(wrap_reference={self.wrap_reference}, names={sorted(self.names)})"


def zero3_loading(trainer):
    """Under DeepSpeed ZeRO-3, what lets ``from_pretrained`` fill partitioned parameters; None otherwise.

    Lightning runs ``configure_model`` inside ``deepspeed.zero.Init``: each parameter is partitioned (empty on this
    rank) as it is created, and a plain ``from_pretrained`` then fails copying the checkpoint into it. Told through
    ``HfDeepSpeedConfig``, transformers loads the ZeRO-3 way (rank 0 reads the files, each module's parameters
    gathered while filled), and its ``generate`` syncs the ranks. transformers holds it by a weak reference: the
    caller keeps the returned object for as long as models are loaded and sampled from.
    """
    if not deepspeed_zero3(trainer):
        return None
    from transformers.integrations import HfDeepSpeedConfig

    return HfDeepSpeedConfig(trainer.strategy.config)


def full_policy_state_dict(trainer, policy: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """The policy's full weights for an export after a sharded run, on rank 0 (None on the other ranks).

    A collective under FSDP (full state dict, gathered to rank 0) and DeepSpeed ZeRO-3 (parameters gathered): every
    rank must call it. None also where no gathering is needed (single device, DDP, ZeRO-1/2): the policy's own
    ``state_dict`` is complete.
    """
    from lightning.pytorch.strategies import FSDPStrategy

    strategy = trainer.strategy
    if isinstance(strategy, FSDPStrategy):
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        config = FullStateDictConfig(offload_to_cpu=strategy.root_device.type != "cpu", rank0_only=True)
        with FSDP.state_dict_type(strategy.model, StateDictType.FULL_STATE_DICT, config):
            state = strategy.model.state_dict()  # keys as in the LightningModule: policy.<...>
        prefix = "policy."
        return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)} if trainer.is_global_zero else None
    if deepspeed_zero3(trainer):
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(policy.parameters()), modifier_rank=None):
            if not trainer.is_global_zero:
                return None
            return {k: v.detach().cpu().clone() for k, v in policy.state_dict().items()}
    return None
