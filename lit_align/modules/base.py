"""What every lit_align LightningModule shares: the policy, its tokenizer, the optimizer and the HF export.

Names: ``model`` is the setting (a hub name, a directory, ``builtin:tiny``), ``policy`` the module being trained (a
``PeftModel`` under LoRA), ``network`` the Hugging Face causal LM that forwards run on (the policy, or the model
inside the ``PeftModel``), ``reference`` what recipes with one compare against (``lit_align.reference``).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Literal

import lightning as L
import torch
from lightning.pytorch.cli import OptimizerCallable
from lightning.pytorch.utilities import rank_zero_warn
from torchmetrics import Metric
from transformers import get_scheduler

from lit_align import host_memory
from lit_align.errors import LitAlignError
from lit_align.capabilities import sharded_strategy
from lit_align.data.base import AlignDataModule
from lit_align.models import check_dtype, from_pretrained_kwargs, load_model, load_tokenizer, use_eos_token
from lit_align.optimizers import (DEFAULT_OPTIM, AdamSettings, build_optimizer, check_optimizer_choice, clip_gradients,
                                  unscale_gradients)
from lit_align.pretrained import gguf_path
from lit_align.recompute import check_mode, enable_checkpointing, lean_mlps, lean_norms
from lit_align.reference import Reference, RefModelSync
from lit_align.strategies import zero3_loading


def disable_dropout(model: torch.nn.Module) -> None:
    """Set every dropout probability to 0 (TRL's ``disable_dropout=True``): log-probs must be deterministic."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


class AlignModule(L.LightningModule):
    """Base LightningModule: loads the policy in ``configure_model``, builds AdamW + a warmup schedule, exports.

    Args:
        model: the policy: a hub name, a local Hugging Face directory, ``builtin:tiny`` / ``builtin:small``, a
            ``.gguf`` file, or ``pretrained:smollm2-135m-instruct`` (``python -m lit_align.pretrained`` fetches it).
        dtype: parameter dtype of the loaded models (``float32``, ``bfloat16``, ``float16``, ``auto``). For mixed
            precision keep float32 here and set ``trainer.precision``.
        attn_implementation: ``sdpa`` (default), ``eager``, ``flash_attention_2``, ...
        trust_remote_code: allow models that ship their own code.
        gradient_checkpointing: recompute activations in backward to save memory (``lit_align.recompute``): true
            (transformers' own: each layer's forward again, about a third more step time) or ``selective`` (only the
            elementwise ops again, matmuls and attention kept: bitwise the same results, about half the activation
            memory, 5-10% more time on SmolLM2-135M). False (the default) still leans the Llama-like layers
            (``lean_mlps``, ``lean_norms``): their SwiGLU product and RMSNorm outputs are made again in backward, not
            kept, about as little memory as ``selective`` without its per-op dispatch.
        mmap_activations: on CPU under glibc (Linux), keep freed heap out of the peak RSS: a training step's forward
            maps the tensors of 1 MiB and more that glibc's free heap blocks cannot hold one by one (returned to the
            system when freed) instead of growing the heap, and the free blocks' pages go back to the system before
            backward (``lit_align.host_memory``). GRPO on SmolLM2-135M: peak RSS 13% lower (3.8 -> 3.3 GB), about
            5% more CPU time per training step (page faults). The same values; process-wide, nothing elsewhere.
        release_frozen_weights: on CPU (Linux), the frozen models' weights mapped from their files (a teacher, a
            named reference: safetensors loaded in their checkpoint's dtype) leave the resident set once their
            forward is done (``host_memory.release_mapped``): the page cache keeps them and the next forward reads
            them back (~30-40 ms a step for 500 MB). None (the default): with ``mmap_activations``.
        logps_chunk_size: compute log-probs ``logps_chunk_size`` positions at a time from the decoder's hidden states
            instead of from full ``[N, T, V]`` logits (``lit_align.logps``): same values and gradients, a fraction of
            the memory at large vocabularies. None: off. E.g. 1024 (a chunk holds ``chunk * V`` fp32 logits).
        disable_dropout: zero every dropout (TRL's default).
        learning_rate: the optimizer's learning rate, whichever optimizer (TRL's DPO default: 1e-6).
        weight_decay: the optimizer's weight decay, whichever optimizer.
        adam_beta1: the first beta of ``optim``'s Adam family (AdamW, AdEMAMix, Lion; TRL's name and default).
        adam_beta2: the second beta of ``optim``'s Adam family (TRL's name and default).
        adam_epsilon: the eps of ``optim``'s AdamW and AdEMAMix (TRL's name and default). All three are refused at
            another value for an optimizer that does not read it (or beside ``optimizer``: its ``init_args`` own them).
        lr_scheduler_type: any ``transformers.get_scheduler`` name: ``linear`` (TRL's default), ``cosine``,
            ``constant``, ``constant_with_warmup``, ``cosine_with_min_lr``, ...
        lr_scheduler_kwargs: that scheduler's own arguments (TRL's name), e.g. ``{num_cycles: 2}`` for
            ``cosine_with_restarts`` or ``{min_lr: 1e-7}`` for ``cosine_with_min_lr``.
        optim: the optimizer by TRL's (transformers') name, built as transformers builds it: ``adamw_torch_fused``
            (default, as TRL's), ``adamw_torch``, ``adafactor``, ``sgd``, ``adagrad``, ``rmsprop``; with bitsandbytes
            (``pip install "lit_align[bnb]"``): ``adamw_bnb_8bit`` (= ``adamw_8bit``), ``paged_adamw_8bit``,
            ``paged_adamw_32bit``, ``lion_8bit``, ``lion_32bit``, ``paged_lion_8bit``, ``paged_lion_32bit``,
            ``rmsprop_bnb``, ``rmsprop_bnb_8bit``, ``rmsprop_bnb_32bit``, ``ademamix``, ``ademamix_8bit``,
            ``paged_ademamix_8bit``, ``paged_ademamix_32bit`` (``lit_align.optimizers.OPTIMIZERS``); with
            ``learning_rate``, ``weight_decay`` and the ``adam_*`` settings.
        optimizer: any optimizer the LightningCLI way instead, e.g. ``{class_path: torch.optim.SGD, init_args:
            {momentum: 0.9}}``, with ``learning_rate`` and ``weight_decay`` (an ``lr`` or ``weight_decay`` in
            ``init_args`` that disagrees with them is refused; ``lit_align.optimizers``); the schedule and warmup
            still apply.
        warmup_ratio: fraction of the run's optimizer steps spent warming up (used when ``warmup_steps`` is 0).
        warmup_steps: optimizer steps of linear warmup.
        on_nonfinite_loss: ``error`` (default): stop at a NaN/inf loss with the step and the batch's offending rows
            (and their dataset rows where the batch carries them), or at non-finite gradients naming the parameters;
            ``skip``: skip that batch or update instead, warn, and count it in ``train/skipped_batches``. Under DDP
            every rank skips the same batches (the check is all-reduced).
        peft_config: train LoRA adapters instead of the whole policy: ``peft.LoraConfig`` keyword arguments, e.g.
            ``{r: 16, lora_alpha: 32, target_modules: all-linear}`` (TRL's ``peft_config``; ``task_type`` defaults
            to ``CAUSAL_LM``, a reward model's to ``SEQ_CLS``). The base weights stay frozen and the reference,
            where a recipe needs one, is the policy with its adapters disabled. None: full fine-tuning.
        export_merged: with ``peft_config``, what the HF export writes: false (TRL's ``save_model``) the adapter
            only (``adapter_config.json`` + ``adapter_model.safetensors`` + tokenizer; load it with
            ``peft.AutoPeftModelForCausalLM``); true the merged full model (loads with ``AutoModelForCausalLM``, no
            peft needed) and the adapter alone in its ``adapter/`` subdirectory.
        chat_template: the chat template to train with and export: a Jinja file or the template itself (TRL's
            ``chat_template_path``); None: the tokenizer's. ``lit-align`` passes it on to the data.
        model_init_kwargs: more ``from_pretrained`` arguments for the policy and the reference (TRL's name):
            ``device_map``, ``revision``, config overrides, ``quantization_config`` (``BitsAndBytesConfig``
            arguments, e.g. ``{load_in_4bit: true}`` with ``peft_config`` for QLoRA; bitsandbytes needs a GPU),
            ``gguf_file`` (a ``.gguf`` file inside the directory ``model``).
    """

    peft_task_type = "CAUSAL_LM"  # the LoRA task of the network a recipe trains (a reward model's: SEQ_CLS)
    eos_token: str | None = None  # the tokenizer's EOS replaced (SFT's option, TRL's SFTConfig.eos_token)
    export_class = "AutoModelForCausalLM"  # what loads the export (its model card says so)
    # this class's own options a resume may change: how the same numbers are computed or exported, not which numbers.
    # Each subclass declares its own the same way; ``may_change_on_resume`` gathers them.
    resume_may_change: tuple[str, ...] = ("logps_chunk_size", "gradient_checkpointing", "mmap_activations",
                                          "release_frozen_weights", "on_nonfinite_loss", "export_merged")

    def __init__(
        self,
        model: str = "builtin:tiny",
        dtype: str = "float32",
        attn_implementation: str | None = "sdpa",
        trust_remote_code: bool = False,
        gradient_checkpointing: bool | Literal["selective"] = False,
        mmap_activations: bool = False,
        release_frozen_weights: bool | None = None,
        logps_chunk_size: int | None = None,
        disable_dropout: bool = True,
        learning_rate: float = 1e-6,
        weight_decay: float = 0.0,
        adam_beta1: float = 0.9,
        adam_beta2: float = 0.999,
        adam_epsilon: float = 1e-8,
        lr_scheduler_type: str = "linear",
        lr_scheduler_kwargs: dict | None = None,
        optim: str = DEFAULT_OPTIM,
        optimizer: OptimizerCallable | None = None,
        warmup_ratio: float = 0.0,
        warmup_steps: int = 0,
        on_nonfinite_loss: str = "error",
        peft_config: dict | None = None,
        export_merged: bool = False,
        chat_template: str | None = None,
        model_init_kwargs: dict | None = None,
    ):
        super().__init__()
        if on_nonfinite_loss not in ("error", "skip"):
            raise LitAlignError(f"model.on_nonfinite_loss {on_nonfinite_loss!r}: expected 'error' or 'skip'")
        for name, value in (("learning_rate", learning_rate), ("weight_decay", weight_decay),
                            ("warmup_steps", warmup_steps)):
            if value < 0:
                raise LitAlignError(f"model.{name} must be >= 0, got {value}")
        if not 0 <= warmup_ratio <= 1:
            raise LitAlignError(f"model.warmup_ratio must be in [0, 1], got {warmup_ratio}")
        check_optimizer_choice(optim, optimizer, AdamSettings(adam_beta1, adam_beta2, adam_epsilon))
        check_mode(gradient_checkpointing)
        self.optimizer_factory = optimizer
        self.save_hyperparameters(ignore=["optimizer"])
        self.lora_config = lora_config(peft_config, self.peft_task_type) if peft_config is not None else None
        from_pretrained_kwargs(model_init_kwargs)  # refuse a bad mapping now, not at configure_model
        check_dtype(dtype, "model.dtype")  # and a bad dtype (not after the data are tokenized)
        self.model_name = gguf_path(model, model_init_kwargs)  # the tokenizer and the reference load it too
        if logps_chunk_size is not None and logps_chunk_size < 1:
            raise LitAlignError(f"model.logps_chunk_size must be a positive number of positions or null, "
                                f"got {logps_chunk_size}")
        self.logps_chunk_size = logps_chunk_size
        self.policy: torch.nn.Module | None = None
        self.reference: Reference | None = None  # set by the recipes that compare against one (never checkpointed)
        self.ref_sync: RefModelSync | None = None  # with the reference, TR-DPO's callback that mixes the policy in
        self.tokenizer = None
        self.skipped_batches = 0
        self.num_tokens = 0.0  # attended training tokens so far, all ranks (TRL's num_tokens; recipes that log it)
        self.log_window: tuple[int, dict[str, tuple]] = (-1, {})  # ``log_mean``: the window, (sum, count) by name
        self.total_steps: int | None = None  # optimizer steps the learning-rate schedule spans (set with it)
        self._resumed_total: int | None = None
        self._backward_ran = False  # this batch ran a backward (``optimizers.unscale_gradients``)

    def load(self, name: str) -> torch.nn.Module:
        hp = self.hparams
        model = load_model(name, dtype=hp.dtype, attn_implementation=hp.attn_implementation,
                           trust_remote_code=hp.trust_remote_code, model_init_kwargs=hp.model_init_kwargs)
        if hp.disable_dropout:
            disable_dropout(model)
        return model

    def setup(self, stage: str) -> None:
        """Hand the DataModule what it follows from the model, in one call (``AlignDataModule.connect``): settings
        flow one way, model -> data. Lightning sets the DataModule up first; one that waited for the model's
        tokenizer is set up now."""
        datamodule = self.trainer.datamodule
        if isinstance(datamodule, AlignDataModule):
            self.connected(datamodule.connect(**self.data_settings()))
            datamodule.setup(stage)

    def data_settings(self) -> dict:
        """What the data follows from this model (``connect``'s arguments): the tokenizer."""
        return {"tokenizer": self.model_name}

    def connected(self, answer) -> None:
        """What the data answered ``connect`` with (None here; the online recipes: the round's resolved shape)."""

    def configure_model(self) -> None:
        if self.policy is not None:  # called again by trainer.fit after trainer.validate, or on resume
            return
        self.tokenizer = load_tokenizer(self.model_name, trust_remote_code=self.hparams.trust_remote_code,
                                        chat_template=self.hparams.chat_template, eos_token=self.eos_token)
        self._zero3_loading = zero3_loading(self._trainer)  # kept: transformers holds it by a weak reference
        self.policy = self.load(self.model_name).train()  # from_pretrained returns eval mode; Lightning keeps modes
        self.policy.config.use_cache = False
        if self.eos_token is not None:
            use_eos_token(self.policy, self.tokenizer)
        enable_checkpointing(self.policy, self.hparams.gradient_checkpointing)
        if self.hparams.gradient_checkpointing is False and not (self._trainer is not None
                                                                  and sharded_strategy(self._trainer)):
            lean_mlps(self.policy)  # (sharded: the weight is gathered only in down_proj's own forward)
            lean_norms(self.policy)
        if self.lora_config is not None:
            from peft import get_peft_model

            if self._trainer is not None and sharded_strategy(self._trainer):
                raise LitAlignError("model.peft_config: LoRA is not supported under FSDP or DeepSpeed ZeRO-3 (the "
                                    "adapter export and the adapters-off reference need whole parameters); use ddp "
                                    "or ZeRO-1/2")

            self.policy = get_peft_model(self.policy, copy.deepcopy(self.lora_config))  # freezes the base weights
            if self.hparams.disable_dropout:
                disable_dropout(self.policy)  # lora_dropout too
        for frozen in self.frozen_models():
            frozen.setup(self)

    def frozen_models(self) -> list[Reference]:
        """The frozen models the recipe compares its policy with (a reference; distillation's teacher): each set up
        once the policy is loaded, its files' identity recorded in checkpoints and checked on resume."""
        return [] if self.reference is None else [self.reference]

    def configure_callbacks(self) -> list:
        """TR-DPO's ``RefModelSync`` where the recipe's ``build_reference`` made one: the setting that asks for it
        (``model.sync_ref_model``) belongs to the model, so the model adds the callback."""
        return [self.ref_sync] if self.ref_sync is not None else []

    @property
    def network(self) -> torch.nn.Module:
        """The Hugging Face model that forwards run on: the policy, or under PEFT the model inside the wrapper (its
        layers carry the adapters; its ``forward`` takes ``position_ids`` and ``logits_to_keep`` explicitly)."""
        return self.policy.get_base_model() if self.lora_config is not None else self.policy

    # -- model.mmap_activations: a step's large tensors mapped one by one up to its backward (lit_align.host_memory) --
    def on_train_start(self) -> None:
        self.log_window = (-1, {})  # a second fit of this module starts its own windows

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        self._backward_ran = False
        self._mapped_forward(True)
        self.start_log_window()

    def on_before_backward(self, loss: torch.Tensor) -> None:
        self._backward_ran = True  # this batch's closure runs a backward: Lightning will step the scaler
        self._mapped_forward(False)
        for frozen in self.frozen_models():  # their forwards are done: their files' pages out of the backward's RSS
            if isinstance(getattr(frozen, "model", None), torch.nn.Module):
                self.release_mapped(frozen.model)

    def release_mapped(self, model: torch.nn.Module) -> None:
        """Under ``release_frozen_weights`` (None: ``mmap_activations``) on CPU: the pages of ``model``'s files out of
        the resident set until read again (``host_memory.release_mapped``)."""
        release = self.hparams.get("release_frozen_weights")
        if (self.hparams.mmap_activations if release is None else release) and self.device.type == "cpu":
            host_memory.release_mapped(model)

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        self._mapped_forward(False)  # a skipped step (no backward) ends here

    def _mapped_forward(self, active: bool) -> None:
        if self.hparams.mmap_activations and self.device.type == "cpu":
            host_memory.mapped_forward(active)

    # -- TRL's logged values: a metric's mean over the logging window -------------------------------------------------
    def log_mean(self, metrics: dict[str, torch.Tensor | float], prog_bar: tuple[str, ...] = ()) -> None:
        """Log ``train/<name>`` for each of ``metrics`` (this micro-batch's values, from ``training_step``) as the mean
        of the name's values over every micro-batch since the loggers last wrote, as TRL does (its ``_metrics`` lists
        and the Trainer's loss over ``logging_steps``; ``trainer.log_every_n_steps`` here): Lightning writes at the
        last micro-batch of every ``log_every_n_steps``-th optimizer step, so the window is the optimizer steps
        ``[k * n, (k + 1) * n)``. A name with no value in a window is not written for it (``start_log_window``)."""
        sums = self.log_window[1]
        for name, value in metrics.items():
            value = torch.as_tensor(value, dtype=torch.float32).detach()
            total, count = sums.get(name, (0.0, 0))
            sums[name] = (total + value, count + 1)
            self.log(f"train/{name}", sums[name][0] / sums[name][1], prog_bar=name in prog_bar)

    def start_log_window(self) -> None:
        """At each batch's start: on entering a new logging window, forget the last window's ``log_mean`` names, so
        one with no value in this window (a skipped batch, a side absent) is not written for it (TRL has none to
        average; Lightning alone would write the name's last value again)."""
        window = self.global_step // max(self.trainer.log_every_n_steps, 1)
        if window != self.log_window[0]:
            results = getattr(self.trainer, "_results", None)  # the step's logged values (``self.log`` writes there)
            for name in self.log_window[1] if results is not None else ():
                results.pop(f"training_step.train/{name}", None)
            self.log_window = (window, {})

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer, optimizer_closure=None) -> None:
        """Step, then free the gradients at once (as transformers' Trainer does): Lightning would zero them only
        after the next batch's forward, so they would sit beside its activations (and a GRPO round's sampling)."""
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        optimizer.zero_grad(set_to_none=True)

    # -- the numeric guard: one place, called by every training_step before it returns its loss ------------------------
    def guard_loss(self, loss: torch.Tensor, row_losses: torch.Tensor | None, batch_idx: int,
                   rows: torch.Tensor | list[int] | None = None) -> torch.Tensor | None:
        """``loss`` if it is finite; else stop (``on_nonfinite_loss: error``) or return None, which makes Lightning
        skip the batch (``skip``). ``row_losses``: per-row losses ``[B]`` to name the offending rows; ``rows``: the
        dataset index of each batch row, when the batch carries one (without ``row_losses``, all of them are named)."""
        bad = ~torch.isfinite(loss.detach()).all()
        bad_rows = None
        if row_losses is not None:
            bad_rows = ~torch.isfinite(row_losses.detach())
            bad = bad | bad_rows.any()
        skip = self.hparams.on_nonfinite_loss == "skip"
        if not self.trainer.strategy.reduce(bad.float(), reduce_op="sum") > 0:  # every rank takes the same branch
            if skip:
                self.log("train/skipped_batches", float(self.skipped_batches))
            return loss
        where = f"batch {batch_idx}"
        if not bad:
            where += " (on another rank)"
        elif bad_rows is not None and bad_rows.any():
            positions = bad_rows.nonzero().flatten().tolist()
            where += f", rows {positions}"
            if rows is not None:
                where += f" (dataset rows {[int(rows[i]) for i in positions]})"
        elif rows is not None:  # no per-row losses (SFT's token mean): every row of the batch may be the one
            where += f" (dataset rows {sorted({int(i) for i in rows})})"
        if skip:
            self.skipped_batches += 1
            rank_zero_warn(f"lit_align: non-finite loss at step {self.global_step}, {where}: batch skipped "
                           f"({self.skipped_batches} so far)")
            self.log("train/skipped_batches", float(self.skipped_batches))
            return None
        raise LitAlignError(f"non-finite training loss ({loss.detach().float().item()}) at step {self.global_step}, "
                            f"{where}; nothing was updated (set model.on_nonfinite_loss: skip to skip such batches)")

    def on_before_optimizer_step(self, optimizer) -> None:
        """The second half of the guard: a finite loss can still give non-finite gradients; never step with them.
        Every rank decides alike (the flag is all-reduced: under FSDP a rank holds only its shard of the gradients).
        fp16's GradScaler does its own check; DeepSpeed keeps gradients in its engine, where this guard sees none.
        Under fp16 the gradients are unscaled first, whatever the optimizer (``optimizers.unscale_gradients``)."""
        unscale_gradients(self.trainer, optimizer, self._backward_ran)
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=self.device)
        if sharded_strategy(self.trainer):  # each rank holds a shard: the global norm from the squares' sum
            norm = self.trainer.strategy.reduce(norm.square(), reduce_op="sum").sqrt()
        if grads:  # TRL's names: the norm before clipping (DeepSpeed keeps gradients in its engine: none here)
            self.log("train/grad_norm", norm)
        self.log("train/learning_rate", float(optimizer.param_groups[0]["lr"]))
        if getattr(self.trainer.precision_plugin, "scaler", None) is not None:
            return
        bad = bool(grads) and not torch.isfinite(norm)
        if not self.trainer.strategy.reduce(torch.tensor(float(bad), device=self.device), reduce_op="sum") > 0:
            return
        names = [n for n, p in self.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        if self.hparams.on_nonfinite_loss == "skip":
            optimizer.zero_grad(set_to_none=True)  # AdamW leaves parameters without a gradient untouched
            self.skipped_batches += 1
            rank_zero_warn(f"lit_align: non-finite gradients at step {self.global_step} ({shown}): update skipped "
                           f"({self.skipped_batches} so far)")
            return
        raise LitAlignError(f"non-finite gradients at step {self.global_step} ({shown}); nothing was updated "
                            "(set model.on_nonfinite_loss: skip to skip such updates)")

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """``trainer.gradient_clip_val`` as TRL's ``max_grad_norm`` with any optimizer, under mixed precision and FSDP
        too, where Lightning alone refuses (``optimizers.clip_gradients``)."""
        if not clip_gradients(self.trainer, optimizer, gradient_clip_val, gradient_clip_algorithm):
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["lit_align_recipe"] = type(self).__name__
        for frozen in self.frozen_models():
            frozen.on_save_checkpoint(checkpoint)
        checkpoint["lit_align_total_steps"] = self.total_steps
        checkpoint["lit_align_skipped_batches"] = self.skipped_batches
        checkpoint["lit_align_num_tokens"] = self.num_tokens

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.check_resume(checkpoint)
        self._resumed_total = checkpoint.get("lit_align_total_steps")
        self.skipped_batches = checkpoint.get("lit_align_skipped_batches", 0)
        self.num_tokens = checkpoint.get("lit_align_num_tokens", 0.0)

    @classmethod
    def may_change_on_resume(cls) -> tuple[str, ...]:
        """The model settings a resume may change: every ``resume_may_change`` along the class's MRO, base first."""
        names = (name for klass in reversed(cls.__mro__) for name in vars(klass).get("resume_may_change", ()))
        return tuple(dict.fromkeys(names))

    def check_resume(self, checkpoint: dict) -> None:
        """A resume continues the checkpoint's run: refuse another recipe's checkpoint, and any model setting that
        differs from the checkpoint's except those ``may_change_on_resume`` names (trainer settings, e.g.
        ``max_steps``, logging and callbacks, are not model settings and may change)."""
        where = f"--ckpt_path {self._trainer.ckpt_path}" if self._trainer is not None else "the checkpoint"
        if "hyper_parameters" not in checkpoint:  # every rule below reads them: without them none could be checked
            raise LitAlignError(f"{where}: not a lit_align checkpoint: it has no hyper_parameters (the settings it "
                                "was written with), so a resume could not check that it continues the same run; "
                                "resume a checkpoint a lit-align run wrote")
        recipe = checkpoint.get("lit_align_recipe")
        if recipe is not None and recipe != type(self).__name__:
            raise LitAlignError(f"{where} is a {recipe} checkpoint; this run is {type(self).__name__} (resume a "
                                "checkpoint with the recipe that wrote it)")
        for frozen in self.frozen_models():
            frozen.check_resume(checkpoint, where)
        saved, may_change = checkpoint["hyper_parameters"], self.may_change_on_resume()
        for key, value in self.hparams.items():
            if key.startswith("_") or key in may_change or key not in saved or saved[key] == value:
                continue
            raise LitAlignError(f"{where}: model.{key} is {value!r} in this run but {saved[key]!r} in the checkpoint; "
                                f"a resume continues that run, so only these model settings may change: "
                                f"{', '.join(may_change)} (and trainer settings such as max_steps or logging)")

    def on_validation_epoch_start(self) -> None:
        # trainer.validate runs in inference mode, so the metrics' states become inference tensors, which a later
        # trainer.fit (whose validation runs under no_grad) cannot update in place: each validation starts afresh
        for metric in self.modules():
            if isinstance(metric, Metric):
                metric.reset()

    def configure_optimizers(self):
        hp = self.hparams
        params = [p for p in self.policy.parameters() if p.requires_grad]
        adam = AdamSettings(hp.adam_beta1, hp.adam_beta2, hp.adam_epsilon)
        optimizer = build_optimizer(hp.optim, self.optimizer_factory, params, hp.learning_rate, hp.weight_decay, adam,
                                    self.policy)
        total = int(self.trainer.estimated_stepping_batches)
        if self._resumed_total is not None and self._resumed_total != total:
            rank_zero_warn(f"lit_align: resumed with another length: the learning-rate schedule ({hp.lr_scheduler_type}) "
                           f"now spans {total} optimizer steps instead of the checkpoint's {self._resumed_total}")
        self.total_steps = total
        warmup = hp.warmup_steps or int(hp.warmup_ratio * total)
        try:
            scheduler = get_scheduler(hp.lr_scheduler_type, optimizer, num_warmup_steps=warmup, num_training_steps=total,
                                      scheduler_specific_kwargs=hp.lr_scheduler_kwargs)
        except (TypeError, ValueError) as exc:
            raise LitAlignError(f"model.lr_scheduler_type {hp.lr_scheduler_type!r}: {exc}") from exc
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def export(self, path: str | Path, state_dict: dict[str, torch.Tensor] | None = None) -> Path:
        """Write the policy and tokenizer as a Hugging Face model directory (``from_pretrained`` loads it); under
        PEFT the adapter, or with ``export_merged`` the merged model plus the adapter in ``adapter/``.

        ``state_dict``: the policy's full weights when they are sharded (``lit_align.strategies.full_policy_state_dict``;
        full fine-tuning only: a LoRA export saves the adapter as this process holds it).
        """
        path = Path(path)
        if self.lora_config is not None and self.hparams.export_merged:
            from peft import PeftModel

            self.policy.save_pretrained(path / "adapter")
            base = self.load(self.model_name)  # a fresh base: merging in place would change the training model
            merged = PeftModel.from_pretrained(base, path / "adapter").merge_and_unload()
            merged.save_pretrained(path)
        elif self.lora_config is not None:
            self.policy.save_pretrained(path)
        else:
            self.policy.save_pretrained(path, state_dict=state_dict)
        self.tokenizer.save_pretrained(path)
        return path


def lora_config(kwargs: dict, task_type: str = "CAUSAL_LM"):
    """``peft.LoraConfig(**kwargs)``, ``task_type`` defaulting to ``task_type``; errors name ``model.peft_config``.
    ``target_modules: [all-linear]`` (TRL's one-item list) is PEFT's ``all-linear``, every linear layer."""
    try:
        from peft import LoraConfig
    except ImportError as exc:
        raise LitAlignError("model.peft_config needs the peft package: pip install 'lit_align[lora]' "
                            "(or pip install peft)") from exc
    if not isinstance(kwargs, dict):
        raise LitAlignError(
            f"model.peft_config must be a mapping of LoraConfig arguments, got {type(kwargs).__name__}")
    modules = kwargs.get("target_modules")
    if isinstance(modules, (list, tuple)) and len(modules) == 1 and modules[0] == "all-linear":
        kwargs = {**kwargs, "target_modules": "all-linear"}  # PEFT's keyword, as TRL's ModelConfig turns it
    try:
        return LoraConfig(**{"task_type": task_type, **kwargs})
    except (TypeError, ValueError) as exc:
        raise LitAlignError(f"model.peft_config: {exc} (expected peft.LoraConfig arguments, e.g. r, lora_alpha, "
                            "target_modules)") from exc
