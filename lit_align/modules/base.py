"""What every lit_align LightningModule shares: the policy, its tokenizer, the optimizer and the HF export."""

from __future__ import annotations

import copy
from pathlib import Path

import lightning as L
import torch
from transformers import get_scheduler

from lit_align.errors import LitAlignError
from lit_align.models import load_model, load_tokenizer


def disable_dropout(model: torch.nn.Module) -> None:
    """Set every dropout probability to 0 (TRL's ``disable_dropout=True``): log-probs must be deterministic."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def frozen(model: torch.nn.Module) -> torch.nn.Module:
    """Eval mode, no gradients: how a reference model lives."""
    model.eval()
    model.requires_grad_(False)
    return model


def _reference_not_in_checkpoints(module, incompatible_keys) -> None:
    """Checkpoints leave the reference out: its keys are not missing (also when FSDP loads the wrapped module)."""
    incompatible_keys.missing_keys[:] = [k for k in incompatible_keys.missing_keys if "ref_model." not in k]


class AlignModule(L.LightningModule):
    """Base LightningModule: loads the policy in ``configure_model``, builds AdamW + a warmup schedule, exports.

    Args:
        model: the policy: a hub name, a local Hugging Face directory, or ``builtin:tiny`` / ``builtin:small``.
        dtype: parameter dtype of the loaded models (``float32``, ``bfloat16``, ``float16``, ``auto``). For mixed
            precision keep float32 here and set ``trainer.precision``.
        attn_implementation: ``sdpa`` (default), ``eager``, ``flash_attention_2``, ...
        trust_remote_code: allow models that ship their own code.
        gradient_checkpointing: recompute activations in backward to save memory.
        logps_chunk_size: compute log-probs ``logps_chunk_size`` positions at a time from the decoder's hidden states
            instead of from full ``[N, T, V]`` logits (``lit_align.logps``): same values and gradients, a fraction of
            the memory at large vocabularies. None: off. E.g. 1024 (a chunk holds ``chunk * V`` fp32 logits).
        disable_dropout: zero every dropout (TRL's default).
        learning_rate: AdamW learning rate (TRL's DPO default: 1e-6).
        weight_decay: AdamW weight decay.
        lr_scheduler_type: any ``transformers.get_scheduler`` name: ``linear`` (TRL's default), ``cosine``,
            ``constant``, ``constant_with_warmup``, ...
        warmup_ratio: fraction of the run's optimizer steps spent warming up (used when ``warmup_steps`` is 0).
        warmup_steps: optimizer steps of linear warmup.
    """

    def __init__(
        self,
        model: str = "builtin:tiny",
        dtype: str = "float32",
        attn_implementation: str | None = "sdpa",
        trust_remote_code: bool = False,
        gradient_checkpointing: bool = False,
        logps_chunk_size: int | None = None,
        disable_dropout: bool = True,
        learning_rate: float = 1e-6,
        weight_decay: float = 0.0,
        lr_scheduler_type: str = "linear",
        warmup_ratio: float = 0.0,
        warmup_steps: int = 0,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.model_name = model
        if logps_chunk_size is not None and logps_chunk_size < 1:
            raise LitAlignError(f"model.logps_chunk_size must be a positive number of positions or null, "
                                f"got {logps_chunk_size}")
        self.logps_chunk_size = logps_chunk_size
        self.policy: torch.nn.Module | None = None
        self.ref_model: torch.nn.Module | None = None  # set by recipes that need a reference (load_reference)
        self.tokenizer = None
        self.register_load_state_dict_post_hook(_reference_not_in_checkpoints)

    def load(self, name: str) -> torch.nn.Module:
        hp = self.hparams
        model = load_model(name, dtype=hp.dtype, attn_implementation=hp.attn_implementation,
                           trust_remote_code=hp.trust_remote_code)
        if hp.disable_dropout:
            disable_dropout(model)
        return model

    def configure_model(self) -> None:
        if self.policy is not None:  # called again by trainer.fit after trainer.validate, or on resume
            return
        self.tokenizer = load_tokenizer(self.model_name, trust_remote_code=self.hparams.trust_remote_code)
        self.policy = self.load(self.model_name).train()  # from_pretrained returns eval mode; Lightning keeps modes
        self.policy.config.use_cache = False
        if self.hparams.gradient_checkpointing:
            self.policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def load_reference(self, name: str | None) -> torch.nn.Module:
        """A frozen reference: the model ``name``, or (None) a copy of the freshly loaded policy."""
        if name is not None:
            return frozen(self.load(name))
        ref = copy.deepcopy(self.policy)
        if self.hparams.gradient_checkpointing:
            ref.gradient_checkpointing_disable()
        return frozen(ref)

    # -- a reference stays frozen, in eval mode, and is never part of a checkpoint ----------------------------------
    def train(self, mode: bool = True):
        super().train(mode)
        if self.ref_model is not None:
            self.ref_model.eval()
        return self

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        state = super().state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        for key in [k for k in state if k.startswith(prefix + "ref_model.")]:  # in place: FSDP passes `destination`
            del state[key]
        return state

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if self.ref_model is not None:  # refill the reference from itself: checkpoints do not carry it
            state_dict = {**state_dict, **{f"ref_model.{k}": v for k, v in self.ref_model.state_dict().items()}}
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def configure_optimizers(self):
        hp = self.hparams
        params = [p for p in self.policy.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=hp.learning_rate, weight_decay=hp.weight_decay)
        total = int(self.trainer.estimated_stepping_batches)
        warmup = hp.warmup_steps or int(hp.warmup_ratio * total)
        try:
            scheduler = get_scheduler(hp.lr_scheduler_type, optimizer, num_warmup_steps=warmup, num_training_steps=total)
        except ValueError as exc:
            raise LitAlignError(f"model.lr_scheduler_type {hp.lr_scheduler_type!r}: {exc}") from exc
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def export(self, path: str | Path, state_dict: dict[str, torch.Tensor] | None = None) -> Path:
        """Write the policy and tokenizer as a Hugging Face model directory (``from_pretrained`` loads it).

        ``state_dict``: the policy's full weights when they are sharded (``lit_align.strategies.full_policy_state_dict``).
        """
        path = Path(path)
        self.policy.save_pretrained(path, state_dict=state_dict)
        self.tokenizer.save_pretrained(path)
        return path
