"""Supervised fine-tuning as a LightningModule: next-token cross-entropy on the completion tokens.

One step: a forward of the policy over the right-padded ``prompt + completion`` batch (the model gets no labels and
returns logits), per-token log-probs of the next tokens from ``lit_align.logps.layout_logps`` (the one log-prob
path every recipe uses, plain or chunked), and the negative log-likelihood averaged over the loss tokens of the batch:
completion tokens only by default, every real token with ``completion_only_loss: false``. Metrics carry TRL's names.
"""

from __future__ import annotations

from typing import NamedTuple


import torch
from torchmetrics import MeanMetric

from lit_align import layouts
from lit_align.errors import LitAlignError
from lit_align.generation import AutoEngine
from lit_align.logps import layout_logps
from lit_align.modules.base import AlignModule
from lit_align.rewards import sort_exact


def loss_mask(batch: dict[str, torch.Tensor], completion_only_loss: bool = True,
              assistant_only_loss: bool = False) -> torch.Tensor:
    """Which tokens the loss is taken over, as TRL's ``SFTTrainer`` decides: the completion
    (``completion_only_loss``; for ``messages`` and ``text`` rows that is every token: they are language modelling)
    or every attended token, and of those only the assistant turns' with ``assistant_only_loss`` (a conversational
    prompt/completion row: its completion's assistant turns, not the tool results between them)."""
    mask = batch["completion_mask"] if completion_only_loss else batch["attention_mask"]
    if assistant_only_loss:
        if "assistant_mask" not in batch:
            raise LitAlignError("model.assistant_only_loss needs conversational rows (messages, or prompt/completion "
                                "as message lists); these rows are plain text")
        mask = mask * batch["assistant_mask"]
    return mask


class SFTStats(NamedTuple):
    """One batch's ``sft_token_stats``."""

    loss: torch.Tensor  # the mean NLL over the loss tokens, with gradient
    correct: torch.Tensor  # how many loss tokens the argmax predicts
    count: torch.Tensor  # how many loss tokens there are
    entropy: torch.Tensor  # the sum of the predicted distributions' entropies over them (TRL's entropy, summed)


def sft_token_stats(model: torch.nn.Module, batch: dict[str, torch.Tensor], completion_only_loss: bool = True,
                    chunk_size: int | None = None, assistant_only_loss: bool = False,
                    padding_free: bool | None = None) -> SFTStats:
    """``(loss, correct, count, entropy)`` for one batch: the mean NLL over loss tokens (with gradient), how many of
    them the argmax predicts, how many there are, and their predictions' summed entropy.

    Loss tokens are those of ``loss_mask``; the first token of a sequence is never one (nothing predicts it). The
    batch runs in ``lit_align.layouts.sft``'s layout (with ``padding_free``: one row, no padding; None:
    ``lit_align.layouts.packs_by_default``). ``chunk_size``:
    chunked log-probs (``lit_align.logps``).
    """
    scored = loss_mask(batch, completion_only_loss, assistant_only_loss)
    padding_free = layouts.resolve_padding_free(padding_free, model, scored.device)
    out = layout_logps(model, layouts.sft(batch, scored, padding_free), ("argmax", "entropy"), chunk_size)
    count = out.mask.sum()
    loss = -out.tokens.sum() / count.clamp(min=1)
    correct = ((out.stats["argmax"] == out.labels) & out.mask).sum()
    return SFTStats(loss, correct, count, (out.stats["entropy"] * out.mask).sum())


class SFTModule(AlignModule):
    """Supervised fine-tuning (TRL's ``SFTTrainer`` loss): cross-entropy on completion tokens, token-averaged.

    The loss is the mean over the loss tokens of each (micro-)batch, as TRL averages over the tokens of a batch; under
    DDP over the loss tokens of all ranks' micro-batches, so 2 ranks x B rows train exactly like 1 process x 2B rows.
    Logged: ``train/loss``, ``train/mean_token_accuracy`` (argmax == label over loss tokens), ``train/entropy`` (of
    the predicted distributions over loss tokens), ``train/num_tokens`` (attended tokens trained on so far, all
    ranks); ``val/loss``, ``val/mean_token_accuracy`` and ``val/entropy`` (token-weighted over the whole validation
    set) and, with ``val_exact_match``, ``val/exact_match``.

    Args:
        completion_only_loss: train on completion tokens only (TRL's default for prompt/completion rows); false:
            on the prompt tokens too. ``messages`` and ``text`` rows are language modelling: every token.
        assistant_only_loss: train on the assistant turns only, every one of a multi-turn conversation (TRL's name;
            default false); for conversational rows. With ``completion_only_loss``, a prompt/completion row's are
            those of its completion: the tool turns between them are not trained.
        val_exact_match: at validation, also complete each prompt greedily and log the fraction whose text equals
            the reference completion (whitespace-stripped; ``lit_align.rewards.sort_exact``).
        val_max_new_tokens: generation cap for ``val_exact_match``.
        padding_free: run each batch's sequences as one row, back to back, no padding (TRL's ``padding_free``;
            ``lit_align.layouts.one_row``), rows packed by ``data.packing`` too. sdpa or eager attention (a
            block-causal mask), or flash attention (the restarting positions mark the sequences). None (the
            default): on where it is exact and cheaper (``lit_align.layouts.packs_by_default``: sdpa on CPU).
        learning_rate: AdamW learning rate (TRL's SFT default: 2e-5, for pretrained models).
        eos_token: the token that ends every text row and standard completion in place of the tokenizer's EOS
            (TRL's ``eos_token``, e.g. ``<|im_end|>`` for a base model trained to chat): the tokenizer, the model's
            config and its generation config carry it, so the export stops there. ``lit-align`` passes it on to the
            data.
    """

    def __init__(self, model: str = "builtin:tiny", completion_only_loss: bool = True,
                 assistant_only_loss: bool = False, val_exact_match: bool = False, val_max_new_tokens: int = 64,
                 padding_free: bool | None = None, learning_rate: float = 2e-5, eos_token: str | None = None,
                 **kwargs):
        super().__init__(model=model, learning_rate=learning_rate, **kwargs)
        self.eos_token = eos_token
        self.completion_only_loss, self.assistant_only_loss = completion_only_loss, assistant_only_loss
        self.padding_free = padding_free
        self.val_exact_match = val_exact_match
        self.greedy_engine = AutoEngine(max_new_tokens=val_max_new_tokens, temperature=0.0)
        self.val_metrics = torch.nn.ModuleDict(
            {name: MeanMetric() for name in ("loss", "mean_token_accuracy", "entropy", "exact_match")})

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, correct, count, entropy = sft_token_stats(self.network, batch, self.completion_only_loss,
                                                       self.logps_chunk_size, self.assistant_only_loss,
                                                       self.padding_free)
        if self.guard_loss(loss, None, batch_idx, batch.get("dataset_rows")) is None:
            return None
        # one all-reduce: the loss tokens of every rank, so the loss is the mean over the global batch's tokens (as
        # transformers' average_tokens_across_devices), and accuracy and entropy are ratios of sums (as TRL's)
        stats = torch.stack([loss.detach() * count, correct.float(), entropy.detach().float(), count.float(),
                             batch["attention_mask"].sum().float()])
        stats = self.trainer.strategy.reduce(stats, reduce_op="sum")
        world = self.trainer.world_size
        if world > 1:  # DDP averages gradients over ranks: scale this rank's token mean to its share of the global one
            loss = loss * (count * world / stats[3].clamp(min=1))
        self.num_tokens += float(stats[4])
        tokens = stats[3].clamp(min=1)
        self.log_mean({"loss": stats[0] / tokens, "mean_token_accuracy": stats[1] / tokens,
                       "entropy": stats[2] / tokens}, prog_bar=("loss",))
        self.log("train/num_tokens", self.num_tokens)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss, correct, count, entropy = sft_token_stats(self.network, batch, self.completion_only_loss,
                                                       self.logps_chunk_size, self.assistant_only_loss,
                                                       self.padding_free)
        self.val_metrics["loss"].update(loss, count)
        self.val_metrics["mean_token_accuracy"].update(correct / count.clamp(min=1), count)
        self.val_metrics["entropy"].update(entropy / count.clamp(min=1), count)
        self.log("val/loss", self.val_metrics["loss"], prog_bar=True)
        self.log("val/mean_token_accuracy", self.val_metrics["mean_token_accuracy"])
        self.log("val/entropy", self.val_metrics["entropy"])
        if self.val_exact_match:
            self.val_metrics["exact_match"].update(torch.tensor(self.exact_match(batch), device=self.device))
            self.log("val/exact_match", self.val_metrics["exact_match"], prog_bar=True)

    test_step = validation_step

    @torch.no_grad()
    def exact_match(self, batch: dict[str, torch.Tensor]) -> list[float]:
        """Greedy-complete each row's prompt; 1.0 where the text equals the row's (decoded) reference completion."""
        tok = self.tokenizer
        input_ids, completion_mask = batch["input_ids"], batch["completion_mask"]
        starts = completion_mask.int().argmax(1).tolist()
        prompts = [row[:s] for row, s in zip(input_ids, starts)]
        references = tok.batch_decode([row[m.bool()] for row, m in zip(input_ids, completion_mask)],
                                      skip_special_tokens=True)
        width = max(len(p) for p in prompts)
        prompt_ids = torch.stack([torch.cat([p.new_full((width - len(p),), tok.pad_token_id), p]) for p in prompts])
        prompt_mask = torch.stack([torch.cat([p.new_zeros(width - len(p)), torch.ones_like(p)]) for p in prompts])
        rollout = self.greedy_engine.generate(self.policy, prompt_ids, prompt_mask, 1, eos_token_ids=[tok.eos_token_id],
                                       pad_token_id=tok.pad_token_id)
        texts = tok.batch_decode(rollout.completion_ids, skip_special_tokens=True)
        return sort_exact(texts, [r.strip() for r in references])

