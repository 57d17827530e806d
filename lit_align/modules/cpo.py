"""CPO (and SimPO, AlphaPO) as a LightningModule: preference pairs, no reference model; the math lives in
``lit_align.losses.preference_free``.

One step: a single forward of the policy over the batch's pairs (shared-prompt rows where the model allows, as DPO),
the completions' log-probs summed (``sigmoid``, ``hinge``) or averaged per token (``ipo``, ``simpo``), ``cpo_loss`` on
them, plus ``cpo_alpha`` times the NLL of the chosen completions' tokens. No reference model is loaded at all.
Metrics carry the names of TRL's experimental ``CPOTrainer``.
"""

from __future__ import annotations

import torch

from lit_align.losses.dpo import sft_nll
from lit_align.losses.preference_free import CPOLoss
from lit_align.modules.pairs import METRICS, PairModule, pair_statistics


class CPOModule(PairModule):
    """Contrastive Preference Optimization, and SimPO / AlphaPO through ``loss_type``: no reference model.

    Args:
        beta: the temperature of the preference term (TRL's default 0.1).
        loss_type: ``sigmoid`` (CPO), ``hinge``, ``ipo``, ``simpo`` (SimPO: per-token averaged log-probs and the
            target margin ``simpo_gamma``), or ``alphapo`` (TRL's shorthand for ``simpo`` with ``cpo_alpha: 0``;
            set ``alpha`` too).
        label_smoothing: for ``sigmoid`` and ``simpo``, the probability that a preference is flipped, in [0, 0.5).
        cpo_alpha: the weight of the NLL of the chosen completions (CPO's behaviour-cloning term; TRL's default 1.0).
            SimPO as published is ``loss_type: simpo`` with ``cpo_alpha: 0``.
        simpo_gamma: SimPO's target reward margin (TRL's default 0.5); only ``simpo`` reads it.
        alpha: AlphaPO's reward shape, ``r = (1 - p^-alpha) / alpha`` instead of ``log p``, with any loss type
            (0: off, TRL's default).
    """

    metrics = METRICS + ("nll_loss",)

    def __init__(self, model: str = "builtin:tiny", beta: float = 0.1, loss_type: str = "sigmoid",
                 label_smoothing: float = 0.0, cpo_alpha: float = 1.0, simpo_gamma: float = 0.5, alpha: float = 0.0,
                 **kwargs):
        super().__init__(model=model, **kwargs)
        self.loss_fn = CPOLoss(loss_type=loss_type, beta=beta, label_smoothing=label_smoothing, cpo_alpha=cpo_alpha,
                               simpo_gamma=simpo_gamma, alpha=alpha)

    def pair_outputs(self, batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Per-pair losses and statistics ``[B]``, and the weights of the per-token ones (``logits/*``)."""
        policy = self.pair_token_logps(self.network, batch, ("mean_logit",))
        lengths = policy.mask.sum(1)
        logps = policy.tokens.sum(1)
        if self.loss_fn.averaged:
            logps = logps / lengths.clamp(min=1)
        losses, chosen_rewards, rejected_rewards = self.loss_fn(*logps.chunk(2))
        nll = sft_nll(policy.tokens, policy.mask) if self.loss_fn.cpo_alpha != 0 else losses.new_zeros(())
        with torch.no_grad():
            token_logits = (policy.stats["mean_logit"] * policy.mask).sum(1) / lengths.clamp(min=1)
        out = {"loss": losses + self.loss_fn.cpo_alpha * nll,
               **pair_statistics(chosen_rewards, rejected_rewards, logps, token_logits),
               "nll_loss": nll.detach().expand(len(losses))}
        chosen_lengths, rejected_lengths = lengths.chunk(2)
        return out, {"logits/chosen": chosen_lengths, "logits/rejected": rejected_lengths}
