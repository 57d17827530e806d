"""Prompt-only rows for the online recipes (GRPO, RLOO, distillation), served one *generation round* at a time.

Generation is autoregressive and costly, so one round of completions must feed several optimizer steps. The
training DataLoader therefore yields every prompt of a round in one batch (``batch_size * steps_per_generation / G``
prompts per device, G completions per prompt: the module's round shape) and yields that same batch
``steps_per_generation * num_iterations`` times in a row, tagged with its position in the round. Lightning's own loop
thus runs one ``training_step`` per yield: the module generates when ``round_pos == 0`` and trains on slice
``round_pos % steps_per_generation`` of the round's completions. ``global_step``, ``max_steps``,
``accumulate_grad_batches``, ``val_check_interval`` and checkpointing keep their
Lightning meaning; only collation is repeated, which costs next to nothing.

::

    prompts of one round (per rank):   p0 p1 p2 p3            (batch_size=8, G=4, steps_per_generation=2)
    yields:        round_pos 0: [p0 p1 p2 p3]   -> generate 4 x 4 = 16 completions, train on completions 0..7
                   round_pos 1: [p0 p1 p2 p3]   -> train on completions 8..15
                   round_pos 0: [p4 p5 p6 p7]   -> next round ...

Under DDP each rank draws different prompts from one seeded permutation, and all G completions of a prompt are
generated and scored on that rank, so group statistics never cross ranks. The sampler subclasses
``DistributedSampler``, so Lightning leaves it in place instead of injecting its own (which would break the pattern).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils.data import DataLoader, Dataset

from lit_align.data.base import AlignDataModule, ResumableLoader, SkippingSampler
from lit_align.data.rows import (
    check_max_length, check_prompt, encode_prompt, encode_prompt_completion, keep_end, naming_row,
    normalize_completion, template_kwargs,
)
from lit_align.errors import LitAlignError
from lit_align.generation_round import RoundShape

TOPK_COLUMNS = ("teacher_topk_ids", "teacher_topk_logps")  # a row's cached teacher top-k (lit_align.teacher_topk)


class RoundSampler(SkippingSampler):
    """Yields ``(index, round_pos, round)``: each round's prompts, ``repeats`` times, tagged with their position in
    the round and the round's number in the epoch; rounds drawn without replacement. ``round_indices`` looks ahead
    (asynchronous rollouts sample rounds before their turn). A ``DistributedSampler``, so Lightning keeps it; ``skip``
    resumes mid-epoch (``SkippingSampler``)."""

    def __init__(self, dataset, prompts_per_round: int, repeats: int, num_replicas: int = 1, rank: int = 0,
                 shuffle: bool = True, seed: int = 0):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=True)
        self.prompts_per_round, self.repeats = prompts_per_round, repeats
        self.num_rounds = len(dataset) // (prompts_per_round * num_replicas)

    def _order(self) -> list[int]:
        n = len(self.dataset)
        if self.shuffle:
            return torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        return list(range(n))

    def round_indices(self, r: int, order: list[int] | None = None) -> list[int]:
        """This rank's dataset indices of round ``r`` of the current epoch."""
        order = self._order() if order is None else order
        per_round, span = self.prompts_per_round, self.prompts_per_round * self.num_replicas
        return order[r * span + self.rank * per_round : r * span + (self.rank + 1) * per_round]

    def _items(self):
        order = self._order()
        for r in range(self.num_rounds):
            mine = self.round_indices(r, order)
            for pos in range(self.repeats):
                yield from ((index, pos, r) for index in mine)

    def __len__(self) -> int:
        return self.num_rounds * self.repeats * self.prompts_per_round


class _RoundItems(Dataset):
    def __init__(self, data):
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, key):
        index, pos, r = key if isinstance(key, tuple) else (key, 0, 0)
        return {**self.data[index], "round_pos": pos, "round": r, "row": index}


def with_system_turn(prompt: str | list, system: str, where: str) -> list[dict]:
    """``prompt`` as a conversation opening with the system turn ``system`` (kept where it has its own)."""
    turns = [{"role": "user", "content": prompt}] if not check_prompt(prompt, where) else list(prompt)
    return turns if turns and turns[0].get("role") == "system" else [{"role": "system", "content": system}, *turns]


class PromptDataModule(AlignDataModule):
    """Prompts for the online recipes; extra columns (e.g. ``answer``) reach the reward functions. A ``completion``
    column is tokenized too when the module trains on the dataset's completions (distillation's supervised rounds:
    ``connect(dataset_completions=True)``), as SFT tokenizes it (EOS appended to a text completion).

    ``batch_size`` counts *completions* per device per optimizer step, as TRL's ``per_device_train_batch_size``
    does. One generation round per device covers ``batch_size * steps_per_generation`` completions, that is
    ``batch_size * steps_per_generation / G`` prompts (must divide evenly; G completions per prompt).
    ``val_batch_size`` counts prompts (one greedy completion each).

    The round's shape (G, ``steps_per_generation``, ``num_iterations``, ``generation_batch_size``: ``RoundShape``)
    is the module's: set it under ``model:``. The module hands it over (``connect``); alone, the data uses
    ``RoundShape``'s defaults.

    Args:
        max_length: tokens of each prompt kept, cut at tokenize time keeping the end (TRL truncates prompts from the
            left; None: no truncation).
        system_prompt: every prompt as a conversation that opens with this system turn (a text prompt becomes its
            user turn; a conversation that opens with its own system turn keeps it), as recipe repositories'
            GRPO scripts build their prompts (open-r1's ``system_prompt``). The reward functions see the
            conversation.
    """

    kind = "prompt"

    def __init__(self, *args, max_length: int | None = 512, system_prompt: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_length = check_max_length(max_length)
        self.system_prompt = system_prompt
        self.round_shape: RoundShape | None = None
        self.tools: list[dict] | None = None  # the module's tool schemas, rendered into every prompt
        self.dataset_completions = False  # whether the module trains on the rows' ``completion`` column too
        self.round_sampler: RoundSampler | None = None  # the training loader's (``round_batch`` looks ahead in it)

    def connect(self, tokenizer: str | None = None, round_shape: RoundShape | None = None,
                tools: list[dict] | None = None, dataset_completions: bool = False) -> RoundShape | None:
        """The model's tokenizer, the round's shape (the module owns it), the schemas of the tools its
        completions may call (rendered into every prompt, as TRL does, unless a row has its own ``tools``) and
        whether it trains on the rows' own completions (``completion_ids`` then in each batch). Answers with the
        round's shape resolved against ``batch_size`` and the world size (``RoundShape.resolve``)."""
        super().connect(tokenizer)
        if (tools, dataset_completions) != (self.tools, self.dataset_completions):  # rows are tokenized again
            self.train_data = self.val_data = None
        self.tools, self.dataset_completions = tools, dataset_completions
        if round_shape is not None:
            self.round_shape = round_shape.resolve(self.batch_size, self.world_size())
        return self.round_shape

    def add_teacher_topk(self, annotate: Callable) -> None:
        """Give the training rows their completion's cached teacher top-k (``TOPK_COLUMNS``): ``annotate(rows, split,
        batch_size)`` returns them (``lit_align.teacher_topk.TeacherTopK.annotate``, which the model hands over from
        its ``setup``: this module never reads the model). Validation rows need none (validation scores the
        student's own completions)."""
        if self.train_data is not None:
            self.train_data = annotate(self.train_data, "train", self.batch_size)

    def world_size(self) -> int:
        trainer = self.trainer
        return trainer.world_size if trainer is not None else 1

    @property
    def prompts_per_round(self) -> int:
        """Prompts of one round per device (``RoundShape.prompts_per_round``)."""
        return (self.round_shape or RoundShape()).prompts_per_round(self.batch_size)

    def process(self, rows, source: str):
        if "prompt" not in rows.column_names:
            raise LitAlignError(f"{source}: missing column 'prompt' (expected prompt-only rows)")
        tokenizer, max_length = self.tokenizer, self.max_length

        chat_template_kwargs, tools = self.chat_template_kwargs, self.tools
        completions = self.dataset_completions and "completion" in rows.column_names
        if self.system_prompt is not None:
            rows = rows.map(lambda row, index: {"prompt": with_system_turn(row["prompt"], self.system_prompt,
                                                                           f"{source} row {index}")},
                            with_indices=True, desc=f"System turn for {source}")

        def tokenize(row, index):
            where = f"{source} row {index}"
            conversational = check_prompt(row["prompt"], where)
            template = template_kwargs(row, chat_template_kwargs, where)
            if tools:
                if not conversational:
                    raise LitAlignError(f"{where}: field 'prompt' is text, but model.tools needs conversational "
                                        "prompts (a list of {role, content} messages) to render the tools into")
                template.setdefault("tools", tools)
            with naming_row(where):
                ids = encode_prompt(tokenizer, row["prompt"], conversational, template)
                out = {"prompt_ids": keep_end(ids, max_length)}
                if completions:  # SFT's split: where the tokenized prompt and prompt + completion diverge
                    out["completion_ids"] = encode_prompt_completion(
                        tokenizer, *normalize_completion(row, where), template)[1]
            return out

        return rows.map(tokenize, with_indices=True, desc=f"Tokenizing {source}")

    def collate(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """Left-padded ``prompt_ids``/``prompt_mask``, the raw ``prompts``, extra ``columns``, the ``round_pos`` and
        ``round``, the prompts' dataset ``rows`` (training only) and, where the rows have them, their
        ``completion_ids`` and their completion's cached teacher top-k (``TOPK_COLUMNS``, flat; lists)."""
        width = max(len(r["prompt_ids"]) for r in rows)
        pad = self.tokenizer.pad_token_id
        ids = torch.tensor([[pad] * (width - len(r["prompt_ids"])) + r["prompt_ids"] for r in rows])
        mask = torch.tensor([[0] * (width - len(r["prompt_ids"])) + [1] * len(r["prompt_ids"]) for r in rows])
        skip = {"prompt", "prompt_ids", "completion_ids", "round_pos", "round", "row", *TOPK_COLUMNS}
        batch = {
            "prompt_ids": ids,
            "prompt_mask": mask,
            "prompts": [r["prompt"] for r in rows],
            "columns": {k: [r[k] for r in rows] for k in rows[0] if k not in skip},
            "round_pos": rows[0].get("round_pos", 0),
            "round": rows[0].get("round", 0),  # the round's number in the epoch
            "dataset_rows": [r["row"] for r in rows] if "row" in rows[0] else None,  # dataset indices (numeric guard)
        }
        for name in ("completion_ids", *TOPK_COLUMNS):
            if name in rows[0]:
                batch[name] = [r[name] for r in rows]
        return batch

    def train_dataloader(self) -> DataLoader:
        trainer = self.trainer
        world, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        if self.round_shape is None:
            self.round_shape = RoundShape().resolve(self.batch_size, world)  # alone (no module handed one over)
        per_round = self.prompts_per_round * self.round_shape.prompt_batches  # with dynamic sampling, its reserve
        sampler = RoundSampler(self.train_data, per_round, self.round_shape.steps, num_replicas=world, rank=rank,
                               shuffle=self.shuffle, seed=self.seed)
        if sampler.num_rounds == 0:
            raise LitAlignError(
                f"{self.path}: {len(self.train_data)} prompts, but one generation round needs "
                f"{per_round * world} (batch_size * steps_per_generation / G * devices"
                f"{' * max_num_gen_batches' if self.round_shape.prompt_batches > 1 else ''})")
        self.round_sampler = sampler
        return ResumableLoader(_RoundItems(self.train_data), batch_size=per_round, sampler=sampler,
                               collate_fn=self.collate, num_workers=self.num_workers, trainer=trainer)

    def round_batch(self, r: int) -> dict[str, Any] | None:
        """Round ``r`` of the current epoch on this rank, collated as the training loader yields its first step
        (asynchronous rollouts sample it ahead of its turn); None past the epoch's last round."""
        sampler = self.round_sampler
        if not 0 <= r < sampler.num_rounds:
            return None
        items = _RoundItems(self.train_data)
        return self.collate([items[(index, 0, r)] for index in sampler.round_indices(r)])
