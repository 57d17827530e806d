"""Built-in tasks: data lit_align generates itself, so every recipe runs offline.

``sort``: sort a handful of digits. The prompt is ``"sort 3914:"`` and the answer ``"1349"``. Short enough for a
character-level model on two CPU cores, hard enough that a random model is at 0% exact match. One task feeds every
stage: SFT rows (prompt/completion), preference pairs (chosen = the right answer, rejected = a realistic wrong one)
and prompt-only rows with the ``answer`` column that reward functions read.
"""

from __future__ import annotations

import random

from datasets import Dataset

SPLIT_SEEDS = {"train": 0, "test": 1}


class SortTask:
    """Sort ``min_digits``..``max_digits`` random digits. Train and test prompts never overlap."""

    name = "sort"

    def __init__(self, num_train: int = 4000, num_test: int = 200, min_digits: int = 3, max_digits: int = 6):
        self.sizes = {"train": num_train, "test": num_test}
        self.min_digits, self.max_digits = min_digits, max_digits

    @staticmethod
    def prompt(digits: str) -> str:
        return f"sort {digits}:"

    @staticmethod
    def solve(digits: str) -> str:
        return "".join(sorted(digits))

    def _problems(self, split: str) -> list[str]:
        if split not in self.sizes:
            raise KeyError(split)
        test = self._draw(self.sizes["test"], SPLIT_SEEDS["test"], exclude=set())
        if split == "test":
            return test
        return self._draw(self.sizes["train"], SPLIT_SEEDS["train"], exclude=set(test))

    def _draw(self, n: int, seed: int, exclude: set[str]) -> list[str]:
        rng = random.Random(seed)
        out: list[str] = []
        while len(out) < n:
            digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(self.min_digits, self.max_digits)))
            if digits not in exclude:
                out.append(digits)
        return out

    @staticmethod
    def wrong_answer(digits: str, rng: random.Random) -> str:
        """A plausible mistake: two neighbours swapped, a digit dropped, doubled or changed."""
        answer = SortTask.solve(digits)
        for _ in range(100):
            kind = rng.choice(("swap", "drop", "double", "change"))
            i = rng.randrange(len(answer))
            if kind == "swap" and i + 1 < len(answer):
                wrong = answer[:i] + answer[i + 1] + answer[i] + answer[i + 2 :]
            elif kind == "drop":
                wrong = answer[:i] + answer[i + 1 :]
            elif kind == "double":
                wrong = answer[: i + 1] + answer[i:]
            else:
                wrong = answer[:i] + rng.choice("0123456789") + answer[i + 1 :]
            if wrong != answer:
                return wrong
        return answer[::-1] + "0"  # only reached for degenerate inputs; still wrong

    @staticmethod
    def score(completion: str, answer: str) -> float:
        """1.0 for the exact answer; otherwise partial credit: the fraction of answer positions right (0 if empty)."""
        completion = completion.strip()
        if completion == answer:
            return 1.0
        hits = sum(a == b for a, b in zip(completion, answer))
        return 0.5 * hits / max(len(answer), len(completion), 1)

    def preference_rows(self, split: str) -> Dataset:
        rng = random.Random(100 + SPLIT_SEEDS[split])
        problems = self._problems(split)
        return Dataset.from_dict(
            {
                "prompt": [self.prompt(d) for d in problems],
                "chosen": [self.solve(d) for d in problems],
                "rejected": [self.wrong_answer(d, rng) for d in problems],
            }
        )

    def prompt_rows(self, split: str) -> Dataset:
        problems = self._problems(split)
        return Dataset.from_dict({"prompt": [self.prompt(d) for d in problems], "answer": [self.solve(d) for d in problems]})

    def completion_rows(self, split: str) -> Dataset:
        problems = self._problems(split)
        return Dataset.from_dict(
            {"prompt": [self.prompt(d) for d in problems], "completion": [self.solve(d) for d in problems]}
        )


BUILTIN_TASKS = {"sort": SortTask}
