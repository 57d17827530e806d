"""An online recipe's generation round: what was sampled, scored and computed once, for the training steps it feeds.

``OnlineModule.make_round`` builds one at the round's first step; every step of the round then trains on
``round.step_batch(k)``, its share of the completions in a shuffled order. The round also goes into checkpoints, so a
run resumed mid-round trains on the completions the interrupted run sampled.

Its shape (``num_generations`` completions per prompt, ``steps_per_generation`` steps fed by one round,
``num_iterations`` passes over its completions) is one ``RoundShape``: the module owns it and hands it to the data.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch

from lit_align.errors import LitAlignError

@dataclass(frozen=True)
class RoundShape:
    """A generation round's shape, checked once here, and every number derived from it.

    The online module owns it (``model.num_generations`` etc.; ``OnlineModule``) and hands it to the prompts'
    DataModule (``PromptDataModule.connect``), which resolves TRL's ``generation_batch_size`` against its batch size
    and the world size (``resolve``) and answers with the resolved shape.

    Args:
        num_generations: completions sampled per prompt (G; TRL's default 8).
        steps_per_generation: training steps fed by one round, each on its own slice of the completions (default 1;
            None with ``generation_batch_size``: derived from it by ``resolve``).
        num_iterations: passes over each round's completions (TRL's mu).
        generation_batch_size: TRL's alternative to ``steps_per_generation``: the round's completions on every
            device, ``batch_size * world_size * steps_per_generation``.
        prompt_batches: batches of the round's prompts the data serves per round, of which the module samples as
            many as it needs (dynamic sampling: more prompts when groups score all alike; 1: exactly the round's).
        grouped: the recipe compares each prompt's completions with each other (GRPO's and RLOO's advantages), so a
            prompt needs two at least; False (distillation): one will do.
    """

    num_generations: int = 8
    steps_per_generation: int | None = None
    num_iterations: int = 1
    generation_batch_size: int | None = None
    prompt_batches: int = 1
    grouped: bool = True

    def __post_init__(self):
        if self.generation_batch_size is not None and self.steps_per_generation is not None:
            raise LitAlignError("model.generation_batch_size and model.steps_per_generation cannot both be set (TRL's "
                                "rule: one derives the other); set one of them")
        if self.generation_batch_size is None and self.steps_per_generation is None:
            object.__setattr__(self, "steps_per_generation", 1)
        if self.num_generations < 1 + self.grouped:
            why = " (group statistics need a group)" if self.grouped else ""
            raise LitAlignError(f"model.num_generations must be >= {1 + self.grouped}{why}, got {self.num_generations}")
        if (self.steps_per_generation is not None and self.steps_per_generation < 1) or self.num_iterations < 1:
            raise LitAlignError("model.steps_per_generation and model.num_iterations must be >= 1")
        if self.prompt_batches < 1:
            raise LitAlignError(f"model.max_num_gen_batches must be >= 1, got {self.prompt_batches}")
        gbs = self.generation_batch_size
        if gbs is not None and (gbs < 1 or gbs % self.num_generations):
            raise LitAlignError(f"model.generation_batch_size {gbs} must be a positive multiple of "
                                f"model.num_generations {self.num_generations} (whole groups)")

    def resolve(self, batch_size: int, world_size: int) -> RoundShape:
        """This shape with ``generation_batch_size`` turned into ``steps_per_generation`` for ``batch_size``
        completions per device and step on ``world_size`` devices; refused unless the round's completions make
        whole groups on each device."""
        shape = self
        if self.generation_batch_size is not None:
            per_step = batch_size * world_size
            if self.generation_batch_size % per_step:
                raise LitAlignError(f"model.generation_batch_size {self.generation_batch_size} must be a positive "
                                    f"multiple of the global batch size (data.batch_size {batch_size} x {world_size} "
                                    f"devices = {per_step})")
            shape = replace(self, steps_per_generation=self.generation_batch_size // per_step,
                            generation_batch_size=None)
        shape.prompts_per_round(batch_size)
        return shape

    @property
    def steps(self) -> int:
        """Training steps one round serves: each slice once per iteration (the data yields its prompts this often)."""
        return self.steps_per_generation * self.num_iterations

    def prompts_per_round(self, batch_size: int) -> int:
        """Prompts of one round per device, ``batch_size`` counting completions per step (TRL's
        ``per_device_train_batch_size``); refused unless the round's completions make whole groups."""
        completions = batch_size * self.steps_per_generation
        if completions % self.num_generations:
            raise LitAlignError(f"data.batch_size * model.steps_per_generation = {completions} completions per round "
                                f"must be a multiple of model.num_generations = {self.num_generations}")
        return completions // self.num_generations

    def needs_old_logps(self, accumulate_grad_batches: int) -> bool:
        """Whether the policy moves before the round's completions are used up (the old-policy log-probs then differ
        from the training forward's): unless all its steps fall in one accumulation window (TRL:
        ``gradient_accumulation_steps % generate_every``)."""
        return accumulate_grad_batches % self.steps != 0

    def tokens_per_step(self, round_tokens: float, world_size: int) -> float:
        """dapo's normalizer: the loss tokens of a round on every rank, per rank and step."""
        return round_tokens / (world_size * self.steps_per_generation)


@dataclass
class StepBatch:
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
    sampling_logps: torch.Tensor | None = None  # [n, C'] vLLM's, when the off-policy mask compares them
    tool_mask: torch.Tensor | None = None  # [n, C'] 0 on tool turns' tokens (already out of loss_mask)
    extra: dict[str, list] = field(default_factory=dict)  # per row: the round's ``extra`` columns
    teacher_topk_ids: torch.Tensor | None = None  # [n, C', k] distillation's cached teacher, on the dataset's rounds
    teacher_topk_logps: torch.Tensor | None = None  # [n, C', k]


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
    # per row: columns logged beside the completions (reward functions' log_extra; distillation's teacher_id)
    extra: dict[str, list] = field(default_factory=dict)
    reward_funcs: dict[str, list[float]] = field(default_factory=dict)  # per row: each reward function's value
    is_ratio: torch.Tensor | None = None  # [N, C] or [N, 1]: importance weights for the sampling engine (vLLM)
    sampling_logps: torch.Tensor | None = None  # [N, C] vLLM's log-probs, kept for the off-policy mask
    tool_mask: torch.Tensor | None = None  # [N, C] with tools: 0 on the tool turns' tokens (loss_mask leaves them out)
    # [N, C, k]: distillation's cached teacher top-k ids and log-probs, on a round of the dataset's completions
    teacher_topk_ids: torch.Tensor | None = None
    teacher_topk_logps: torch.Tensor | None = None

    def step_batch(self, position: int) -> StepBatch:
        """The rows of the round's ``position``-th step (passes repeat: ``position`` counts modulo ``steps``).

        The round is as wide as its longest prompt and completion; a step's rows usually need less, and pad columns
        cost as much as real ones, so the columns that are padding in every one of them are cut.
        """
        size = len(self.order) // self.steps
        k = position % self.steps
        picked = self.order[k * size : (k + 1) * size]
        rows = torch.tensor(picked, device=self.prompt_ids.device)
        start = int(self.prompt_mask[rows].any(0).int().argmax())
        width = int(self.completion_mask[rows].sum(1).max())

        def completions(values: torch.Tensor | None) -> torch.Tensor | None:
            return None if values is None else values[rows][:, :width]

        return StepBatch(
            self.prompt_ids[rows][:, start:], self.prompt_mask[rows][:, start:],
            completions(self.completion_ids), completions(self.completion_mask), completions(self.loss_mask),
            self.advantages[rows], completions(self.old_logps), completions(self.ref_logps),
            None if self.dataset_rows is None else [self.dataset_rows[i] for i in picked],
            None if self.is_ratio is None else self.is_ratio[rows][:, :width], completions(self.sampling_logps),
            completions(self.tool_mask), {k: [v[i] for i in picked] for k, v in self.extra.items()},
            completions(self.teacher_topk_ids), completions(self.teacher_topk_logps),
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
