"""Reward modelling as a LightningModule (TRL's ``RewardTrainer``): a sequence classifier with one output trained on
preference pairs so that the chosen sequence scores higher than the rejected one.

One step: a forward of the classifier over the batch's ``[chosen_1..B; rejected_1..B]`` sequences (right-padded;
the model reads its one logit at each row's last real token, found through ``config.pad_token_id`` as in
transformers), the two halves as the pairs' rewards, and ``lit_align.losses.reward.reward_loss`` averaged over pairs.
The network is ``AutoModelForSequenceClassification`` loaded from any causal LM checkpoint (its LM head is dropped
and a ``score`` head starts from random weights, drawn from the seeded RNG) or from a classifier checkpoint with one
label; under LoRA (``peft_config``, task ``SEQ_CLS``) the adapters and the ``score`` head train.

The export is that classifier with its tokenizer: ``AutoModelForSequenceClassification.from_pretrained`` loads it,
and GRPO takes its directory as a reward function (``reward_funcs: [<export>]``, ``lit_align.rewards.RewardModel``).
Left out: DPO's shared-prompt and padding-free layouts (the classifier pools each row at its last token itself, which
rows packed together would defeat) and chunked log-probs (there is no LM head).
"""

from __future__ import annotations

import torch
from torchmetrics import MeanMetric
from transformers import AutoModelForSequenceClassification

from lit_align.data.preference import PreferenceDataModule, RewardDataModule
from lit_align.errors import LitAlignError
from lit_align.losses.reward import reward_loss, reward_metrics
from lit_align.models import load_model
from lit_align.modules.base import AlignModule, disable_dropout

METRICS = ("loss", "accuracy", "margin", "min_reward", "mean_reward", "max_reward")


class RewardModule(AlignModule):
    """A reward model trained with the Bradley-Terry loss (TRL's ``RewardTrainer``).

    Logged (TRL's names): ``train/loss``, ``train/accuracy`` (pairs whose chosen reward is the higher),
    ``train/margin`` (mean chosen - rejected reward), ``train/min_reward`` / ``mean_reward`` / ``max_reward`` (over
    every sequence of the step, all ranks), ``train/num_tokens``; the same under ``val/``, each the mean over the
    held-out pairs (``min_reward`` / ``max_reward``: the mean over validation batches of each batch's, as TRL).

    Args:
        model: a causal LM (a hub name, a directory, ``builtin:tiny``, ...), to which a one-output ``score`` head is
            added, or a sequence classifier with one label (e.g. a reward model to train further).
        center_rewards_coefficient: adds ``coef * mean((r_chosen + r_rejected)^2)`` to the loss, pulling rewards
            towards mean zero (TRL's name; None: off; TRL recommends 0.01).
        learning_rate: the optimizer's learning rate (TRL's reward default: 1e-4).
    """

    peft_task_type = "SEQ_CLS"
    export_class = "AutoModelForSequenceClassification"

    def __init__(self, model: str = "builtin:tiny", center_rewards_coefficient: float | None = None,
                 learning_rate: float = 1e-4, **kwargs):
        super().__init__(model=model, learning_rate=learning_rate, **kwargs)
        if center_rewards_coefficient is not None and center_rewards_coefficient < 0:
            raise LitAlignError(f"model.center_rewards_coefficient must be >= 0 or null, got "
                                f"{center_rewards_coefficient}")
        labels = (self.hparams.model_init_kwargs or {}).get("num_labels", 1)
        if labels != 1:
            raise LitAlignError(f"model.model_init_kwargs.num_labels is {labels}: a reward model has one output "
                                "(leave num_labels out)")
        if self.logps_chunk_size is not None:
            raise LitAlignError("model.logps_chunk_size: a reward model has no LM head to chunk (leave it null)")
        self.center_rewards_coefficient = center_rewards_coefficient
        self.val_metrics = torch.nn.ModuleDict({name: MeanMetric() for name in METRICS})

    def load(self, name: str) -> torch.nn.Module:
        """``name`` as a sequence classifier with one output (TRL's ``num_labels=1``)."""
        hp = self.hparams
        model = load_model(name, dtype=hp.dtype, attn_implementation=hp.attn_implementation,
                           trust_remote_code=hp.trust_remote_code,
                           model_init_kwargs={**(hp.model_init_kwargs or {}), "num_labels": 1},
                           auto_class=AutoModelForSequenceClassification)
        if hp.disable_dropout:
            disable_dropout(model)
        return model

    def configure_model(self) -> None:
        super().configure_model()
        # the classifier reads each row's reward at its last token that is not padding (TRL sets this too)
        self.network.config.get_text_config().pad_token_id = self.tokenizer.pad_token_id

    def setup(self, stage: str) -> None:
        datamodule = self.trainer.datamodule
        if isinstance(datamodule, PreferenceDataModule) and not isinstance(datamodule, RewardDataModule):
            raise LitAlignError("data: RewardModule trains on lit_align.data.RewardDataModule (pairs never cut, the "
                                "long ones dropped, a margin column), not PreferenceDataModule, which cuts sides to "
                                "max_length and would drop the tokens a reward is read at")
        super().setup(stage)

    def rewards(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The chosen and rejected sequences' rewards ``[B]`` each, from one forward over ``[chosen; rejected]``."""
        logits = self.network(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                              use_cache=False).logits
        return logits[:, 0].float().chunk(2)

    def pair_outputs(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-pair losses ``[B]`` and the batch's statistics (``reward_metrics``)."""
        chosen, rejected = self.rewards(batch)
        losses = reward_loss(chosen, rejected, batch.get("margin"), self.center_rewards_coefficient)
        return losses, reward_metrics(chosen, rejected)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        losses, stats = self.pair_outputs(batch)
        loss = self.guard_loss(losses.mean(), losses, batch_idx, batch.get("dataset_rows"))
        if loss is None:  # skipped (on_nonfinite_loss: skip)
            return None
        # one all-reduce for the means and the token count; the extremes over every rank's sequences, as TRL's gather
        means = torch.stack([loss.detach(), stats["accuracy"], stats["margin"], stats["mean_reward"],
                             batch["attention_mask"].sum().float()])
        means = self.trainer.strategy.reduce(means, reduce_op="mean")
        extremes = self.all_gather(torch.stack([stats["min_reward"], -stats["max_reward"]])).reshape(-1, 2).amin(0)
        self.log_mean({**dict(zip(("loss", "accuracy", "margin", "mean_reward"), means)),
                       "min_reward": extremes[0], "max_reward": -extremes[1]}, prog_bar=("loss",))
        self.num_tokens += float(means[-1]) * self.trainer.world_size
        self.log("train/num_tokens", self.num_tokens)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        losses, stats = self.pair_outputs(batch)
        stats["loss"] = losses.mean()
        pairs = len(losses)
        for name in METRICS:
            weight = 1.0 if name in ("min_reward", "max_reward") else pairs
            self.val_metrics[name].update(stats[name].detach(), weight)
            self.log(f"val/{name}", self.val_metrics[name], prog_bar=name == "accuracy")

    test_step = validation_step
