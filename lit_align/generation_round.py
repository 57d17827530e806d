"""A GRPO generation round: what was sampled, scored and computed once, for the training steps it feeds.

``GRPOModule.generate_round`` builds one at the round's first step; every step of the round then trains on
``round.step_rows(k)``, its share of the completions in a shuffled order. The round also goes into checkpoints, so a
run resumed mid-round trains on the completions the interrupted run sampled.

The round's shape is set by three settings that the prompts' DataModule and the module both need, and that the
console script links (``lit_align.cli``): ``num_generations`` (completions per prompt), ``steps_per_generation``
(steps fed by one round) and ``num_iterations`` (passes over each round's completions).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from lit_align.errors import LitAlignError

# the settings that shape a round, with their defaults (TRL's; GRPOModule's and PromptDataModule's)
ROUND_SETTINGS = {"num_generations": 8, "steps_per_generation": 1, "num_iterations": 1}


def check_round_settings(num_generations: int, steps_per_generation: int, num_iterations: int,
                         owner: str = "data") -> None:
    """Raise for a round that cannot be formed (``owner``: the config section that set them)."""
    if num_generations < 2:
        raise LitAlignError(f"{owner}.num_generations must be >= 2 (group statistics need a group), "
                            f"got {num_generations}")
    if steps_per_generation < 1 or num_iterations < 1:
        raise LitAlignError(f"{owner}.steps_per_generation and {owner}.num_iterations must be >= 1")


@dataclass
class StepRows:
    """One training step's completions, without the columns that are padding in all of them."""

    prompt_ids: torch.Tensor  # [n, P'] left-padded
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor  # [n, C'] right-padded
    completion_mask: torch.Tensor
    loss_mask: torch.Tensor  # completion_mask, minus truncated completions under mask_truncated_completions
    advantages: torch.Tensor  # [n]
    old_logps: torch.Tensor | None  # [n, C'] the sampling policy's, when the policy moved since
    ref_logps: torch.Tensor | None  # [n, C'] the reference's, when beta != 0
    dataset_rows: list[int] | None  # the dataset index of each completion's prompt
    is_ratio: torch.Tensor | None = None  # [n, C'] or [n, 1]: the sampling engine's importance weights (vLLM)


@dataclass
class GenerationRound:
    """Rows ``N = prompts * num_generations``, each prompt's completions consecutive."""

    prompt_ids: torch.Tensor  # [N, P] left-padded
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor  # [N, C] right-padded
    completion_mask: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor  # [N] group-relative
    old_logps: torch.Tensor | None
    ref_logps: torch.Tensor | None
    order: list[int]  # the rows in training order: step k takes the k-th slice
    steps: int  # steps_per_generation
    num_tokens: float  # dapo's normalizer: loss tokens per step, averaged over the round's steps and all ranks
    stats: dict[str, torch.Tensor]  # the round's metrics (rank-averaged), logged at every step it feeds
    prompts: list  # per row: the prompt, the completion's text, the summed reward (CompletionsLogger)
    completions: list[str]
    rewards: list[float]
    dataset_rows: list[int] | None = None  # per row: the dataset index of its prompt
    extra: dict[str, list] = field(default_factory=dict)  # per row: columns reward functions logged (log_extra)
    reward_funcs: dict[str, list[float]] = field(default_factory=dict)  # per row: each reward function's value
    is_ratio: torch.Tensor | None = None  # [N, C] or [N, 1]: importance weights for the sampling engine (vLLM)

    def step_rows(self, position: int) -> StepRows:
        """The rows of the round's ``position``-th step (passes repeat: ``position`` counts modulo ``steps``).

        The round is as wide as its longest prompt and completion; a step's rows usually need less, and pad columns
        cost as much as real ones, so the columns that are padding in every one of them are cut.
        """
        size = len(self.order) // self.steps
        k = position % self.steps
        rows = torch.tensor(self.order[k * size : (k + 1) * size], device=self.prompt_ids.device)
        start = int(self.prompt_mask[rows].any(0).int().argmax())
        width = int(self.completion_mask[rows].sum(1).max())

        def completions(values: torch.Tensor | None) -> torch.Tensor | None:
            return None if values is None else values[rows][:, :width]

        return StepRows(
            self.prompt_ids[rows][:, start:], self.prompt_mask[rows][:, start:],
            completions(self.completion_ids), completions(self.completion_mask), completions(self.loss_mask),
            self.advantages[rows], completions(self.old_logps), completions(self.ref_logps),
            None if self.dataset_rows is None else [self.dataset_rows[i] for i in rows.tolist()],
            None if self.is_ratio is None else self.is_ratio[rows][:, :width],
        )

    def to(self, device: torch.device | str) -> GenerationRound:
        """The round with its tensors on ``device`` (``cpu`` for a checkpoint)."""
        def move(value):
            if isinstance(value, torch.Tensor):
                return value.to(device)
            if isinstance(value, dict):
                return {k: move(v) for k, v in value.items()}
            return value

        return GenerationRound(**{f.name: move(getattr(self, f.name)) for f in fields(self)})

    def state_dict(self) -> dict:
        """The round as plain values on the CPU, for a checkpoint (``GenerationRound(**state)`` rebuilds it)."""
        return dict(self.to("cpu").__dict__)
