"""KTO as a LightningModule: what is computed lives in ``training_step``; the math lives in ``lit_align.losses.kto``.

One step over ``B`` unpaired rows (``lit_align.data.unpaired``): the policy's summed completion log-probs of each row,
the reference's (``lit_align.reference``: a frozen model, or the adapters switched off), and for the KL estimate both
models' log-probs of the mismatched pairs (each prompt with another row's completion; no gradient: TRL detaches the
estimate). The estimate is averaged over ranks and clamped at 0, as TRL does, then ``kto_loss`` gives each row its
weighted loss; the step's loss is their mean. Metrics carry TRL's names and meanings: ``*/chosen`` over the batch's
desirable rows, ``*/rejected`` over its undesirable ones, summed over ranks before dividing; a side absent from the
batch (on every rank) is not logged, nor is ``rewards/margins`` then.

Left out: ``precompute_ref_log_probs`` (the reference runs in every step), ``padding_free``.
"""

from __future__ import annotations

import torch
from torchmetrics import MeanMetric

from lit_align import layouts
from lit_align.data.unpaired import UnpairedPreferenceDataModule
from lit_align.errors import LitAlignError
from lit_align.logps import TokenLogps, layout_logps
from lit_align.losses.kto import KTOLoss, kl_estimate
from lit_align.modules.base import AlignModule
from lit_align.reference import build_reference

# What a step logs; ``*/chosen`` and ``*/rejected`` only where the batch has such rows (TRL's rule).
METRICS = ("loss", "kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected",
           "logits/chosen", "logits/rejected", "entropy")


class KTOModule(AlignModule):
    """Kahneman-Tversky Optimization from unpaired desirable / undesirable completions, against a reference model.

    The data is ``lit_align.data.UnpairedPreferenceDataModule`` (``prompt`` / ``completion`` / ``label`` rows, or
    preference pairs unpaired as TRL does). The reference (docs/dpo.md, "Reference model"): a frozen copy of the initial
    policy (default), ``ref_model``, or the policy with its LoRA adapters disabled (``peft_config``);
    ``sync_ref_model`` mixes the policy into it as training goes (TR-DPO).

    Args:
        ref_model: the reference: a model name/path, or None for a frozen copy of the policy at step 0 (TRL's default).
        beta: the KTO temperature (TRL's default 0.1); higher keeps the policy closer to the reference.
        loss_type: ``kto`` (the KTO paper's loss, with the KL estimate) or ``apo_zero_unpaired`` (APO-zero for
            unpaired rows; no KL estimate, so no mismatched pairs are run).
        desirable_weight: the desirable rows' losses are multiplied by this, to balance unequal numbers of desirable
            and undesirable rows (the KTO paper: ``desirable_weight * n_desirable`` /
            ``undesirable_weight * n_undesirable`` in [1, 4/3]).
        undesirable_weight: the undesirable rows' losses are multiplied by this.
        sync_ref_model: TR-DPO: every ``ref_model_sync_steps`` optimizer steps,
            ``ref <- ref_model_mixup_alpha * policy + (1 - ref_model_mixup_alpha) * ref``. Not with ``peft_config``.
        ref_model_mixup_alpha: the policy's weight in that mix (TRL's default 0.6).
        ref_model_sync_steps: the sync cadence in optimizer steps (TRL's default 512).
    """

    def __init__(self, model: str = "builtin:tiny", ref_model: str | None = None, beta: float = 0.1,
                 loss_type: str = "kto", desirable_weight: float = 1.0, undesirable_weight: float = 1.0,
                 sync_ref_model: bool = False, ref_model_mixup_alpha: float = 0.6, ref_model_sync_steps: int = 512,
                 **kwargs):
        super().__init__(model=model, **kwargs)
        self.loss_fn = KTOLoss(loss_type=loss_type, beta=beta, desirable_weight=desirable_weight,
                               undesirable_weight=undesirable_weight)
        self.reference, self.ref_sync = build_reference(
            ref_model, self.lora_config is not None, sync_ref_model=sync_ref_model,
            ref_model_mixup_alpha=ref_model_mixup_alpha, ref_model_sync_steps=ref_model_sync_steps)
        self.val_metrics = torch.nn.ModuleDict({name.replace("/", "_"): MeanMetric() for name in METRICS})

    def setup(self, stage: str) -> None:
        datamodule = self.trainer.datamodule
        if datamodule is not None and not isinstance(datamodule, UnpairedPreferenceDataModule):
            raise LitAlignError(f"KTOModule trains on unpaired rows: data must be lit_align.data."
                                f"UnpairedPreferenceDataModule (it reads preference pairs too), got "
                                f"{type(datamodule).__name__}")
        super().setup(stage)

    def data_settings(self) -> dict:
        """The tokenizer, and whether the data builds the mismatched pairs (only the KL estimate reads them)."""
        return {**super().data_settings(), "kl_pairs": self.loss_fn.uses_kl}

    # -- log-probs ----------------------------------------------------------------------------------------------------
    def row_token_logps(self, network: torch.nn.Module, batch: dict[str, torch.Tensor], prefix: str = "",
                        stats: tuple[str, ...] = ()) -> TokenLogps:
        """Per-token completion log-probs ``[B, T]`` of the batch's rows (``prefix="KL_"``: of its mismatched pairs)."""
        layout = layouts.padded(batch[f"{prefix}input_ids"], batch[f"{prefix}attention_mask"],
                                batch[f"{prefix}completion_mask"])
        return layout_logps(network, layout, stats, self.logps_chunk_size)

    def sequence_logps(self, network: torch.nn.Module, batch: dict[str, torch.Tensor], prefix: str = "") -> torch.Tensor:
        """Summed completion log-probs ``[B]``."""
        return self.row_token_logps(network, batch, prefix).tokens.sum(1)

    def reference_logps(self, network: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The reference's ``[B]`` summed log-probs of the rows, followed by those of the mismatched pairs (``[2B]``)
        where the loss reads them."""
        logps = [self.sequence_logps(network, batch)]
        if self.loss_fn.uses_kl:
            logps.append(self.sequence_logps(network, batch, "KL_"))
        return torch.cat(logps)

    # -- what is computed ---------------------------------------------------------------------------------------------
    def row_outputs(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per-row losses, rewards and log-probs ``[B]``, the KL estimate (a scalar, averaged over ranks) and the
        per-token statistics of the completions (``[B, T]``, with their ``mask``)."""
        policy = self.row_token_logps(self.network, batch, stats=("mean_logit", "entropy"))
        logps = policy.tokens.sum(1)
        n = len(logps)
        ref = self.reference.logps(batch, lambda net: self.reference_logps(net, batch))
        kl = torch.zeros((), device=logps.device, dtype=logps.dtype)
        if self.loss_fn.uses_kl:
            with torch.no_grad():
                policy_kl = self.sequence_logps(self.network, batch, "KL_")
            kl = self.reduce(kl_estimate(policy_kl, ref[n:]), "mean").clamp(min=0)
        losses, rewards = self.loss_fn(logps, ref[:n], batch["label"], kl)
        return {"losses": losses, "rewards": rewards, "logps": logps.detach(), "kl": kl, "mask": policy.mask,
                "mean_logit": policy.stats["mean_logit"], "entropy": policy.stats["entropy"]}

    def batch_sums(self, batch: dict[str, torch.Tensor], out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What each metric sums over the batch's rows or tokens, and what it divides by, as ``name: (sum, count)``."""
        labels = batch["label"].bool()
        sides = {"chosen": labels, "rejected": ~labels}
        mask = out["mask"]
        sums = {}
        for side, rows in sides.items():
            count = rows.sum().to(out["logps"].dtype)
            sums[f"rewards/{side}"] = (out["rewards"][rows].sum(), count)
            sums[f"logps/{side}"] = (out["logps"][rows].sum(), count)
            tokens = mask & rows[:, None]
            sums[f"logits/{side}"] = ((out["mean_logit"] * tokens).sum(), tokens.sum().to(count.dtype))
        sums["entropy"] = ((out["entropy"] * mask).sum(), mask.sum().to(out["logps"].dtype))
        return sums

    def reduce(self, value: torch.Tensor, op: str) -> torch.Tensor:
        """``value`` reduced over ranks (``mean`` or ``sum``); itself outside a trainer."""
        return value if self._trainer is None else self.trainer.strategy.reduce(value, reduce_op=op)

    def step_metrics(self, batch: dict[str, torch.Tensor], out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The step's metrics as TRL logs them: every sum and count over ranks before dividing (one all-reduce), a
        side without rows on any rank left out, and ``num_tokens``: the attended tokens of the step, all ranks."""
        sums = self.batch_sums(batch, out)
        values = [v.detach().float() for pair in sums.values() for v in pair]
        values = self.reduce(torch.stack(values + [batch["attention_mask"].sum().float()]), "sum")
        metrics = {"loss": self.reduce(out["losses"].detach().mean().float(), "mean"), "kl": out["kl"].float()}
        for i, name in enumerate(sums):
            total, count = values[2 * i], values[2 * i + 1]
            if count > 0:
                metrics[name] = total / count
        if "rewards/chosen" in metrics and "rewards/rejected" in metrics:
            metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
        metrics["num_tokens"] = values[-1]
        return metrics

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        out = self.row_outputs(batch)
        loss = self.guard_loss(out["losses"].mean(), out["losses"], batch_idx, batch.get("dataset_rows"))
        if loss is None:  # skipped (on_nonfinite_loss: skip)
            return None
        metrics = self.step_metrics(batch, out)
        self.num_tokens += float(metrics.pop("num_tokens"))
        self.log_mean(metrics, prog_bar=("loss",))
        self.log("train/num_tokens", self.num_tokens)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        out = self.row_outputs(batch)
        metrics = self.val_metrics
        metrics["loss"].update(out["losses"])  # over the validation rows, as TRL's eval loss weighs its batches
        metrics["kl"].update(out["kl"])
        for name, (total, count) in self.batch_sums(batch, out).items():
            if count > 0:  # a mean over the validation set's rows or tokens: each batch weighs by its count
                metrics[name.replace("/", "_")].update(total / count, count)

    def on_validation_epoch_end(self) -> None:
        metrics = self.val_metrics
        seen = {name: metrics[name.replace("/", "_")].update_count > 0 for name in METRICS}
        for name in METRICS:
            if seen[name]:
                self.log(f"val/{name}", metrics[name.replace("/", "_")].compute(), prog_bar=name == "loss")
        if seen["rewards/chosen"] and seen["rewards/rejected"]:
            self.log("val/rewards/margins", metrics["rewards_chosen"].compute() - metrics["rewards_rejected"].compute())

    test_step = validation_step
    on_test_epoch_end = on_validation_epoch_end
