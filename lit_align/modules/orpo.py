"""ORPO as a LightningModule: preference pairs, no reference model; the math lives in
``lit_align.losses.preference_free``.

One step: a single forward of the policy over the batch's ``[chosen; rejected]`` rows; the completions' log-probs
averaged per token enter ``odds_ratio_loss``; the NLL term is the mean over every token of the chosen rows, prompt
included, as TRL computes it. So the chosen rows' prompt tokens are scored too, and the pairs run as the plain batch
(the shared-prompt rows score completions only); ``padding_free`` packs that batch. No reference model is loaded.
Metrics carry the names of TRL's experimental ``ORPOTrainer``.
"""

from __future__ import annotations

import torch

from lit_align import layouts
from lit_align.errors import LitAlignError
from lit_align.logps import layout_logps
from lit_align.losses.preference_free import odds_ratio_loss
from lit_align.losses.settings import check_positive
from lit_align.modules.pairs import METRICS, PairModule, pair_statistics


class ORPOModule(PairModule):
    """Odds Ratio Preference Optimization: ``nll(chosen) + beta * mean(-logsigmoid(log_odds))``, no reference.

    Args:
        beta: the weight of the odds-ratio term (the paper's lambda; TRL's default 0.1).
        share_prompt: not available: ORPO's NLL scores the chosen rows' prompts, which the shared-prompt rows do not
            (false, the only value).
    """

    metrics = METRICS + ("nll_loss", "log_odds_ratio", "log_odds_chosen")

    def __init__(self, model: str = "builtin:tiny", beta: float = 0.1, share_prompt: bool = False, **kwargs):
        if share_prompt:
            raise LitAlignError("model.share_prompt: ORPO's NLL term scores the chosen rows' prompt tokens too (as "
                                "TRL's), which the shared-prompt rows do not; leave it false")
        check_positive("beta", beta)
        super().__init__(model=model, share_prompt=False, **kwargs)
        self.beta = beta

    def pair_outputs(self, batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Per-pair losses and statistics ``[B]``, and the weights of the per-token ones (``logits/*``)."""
        completion = batch["completion_mask"]
        pairs = len(completion) // 2
        scored = torch.cat([batch["attention_mask"][:pairs], completion[pairs:]])  # chosen: the whole sequence
        layout = layouts.pairs(dict(batch, completion_mask=scored), self.network, False, self.padding_free)
        policy = layout_logps(self.network, layout, ("mean_logit",), self.logps_chunk_size)
        # the grid starts at column 1 (the chosen rows' second token): the completions on it
        mask = completion[:, layout.start:].bool()
        lengths = mask.sum(1)
        logps = (policy.tokens * mask).sum(1) / lengths.clamp(min=1)
        chosen_tokens = policy.mask[:pairs]
        nll = -policy.tokens[:pairs][chosen_tokens].mean()
        ratio_losses, chosen_rewards, rejected_rewards, log_odds = odds_ratio_loss(*logps.chunk(2), beta=self.beta)
        with torch.no_grad():
            token_logits = (policy.stats["mean_logit"] * mask).sum(1) / lengths.clamp(min=1)
        out = {"loss": nll + ratio_losses,
               **pair_statistics(chosen_rewards, rejected_rewards, logps, token_logits),
               "nll_loss": nll.detach().expand(pairs),
               "log_odds_ratio": -ratio_losses.detach() / self.beta,
               "log_odds_chosen": log_odds.detach()}
        chosen_lengths, rejected_lengths = lengths.chunk(2)
        return out, {"logits/chosen": chosen_lengths, "logits/rejected": rejected_lengths}
