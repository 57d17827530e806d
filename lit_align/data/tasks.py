"""Built-in tasks: data lit_align generates itself, so every recipe runs offline.

``sort``: sort a handful of digits. The prompt is ``"sort 3914:"`` and the answer ``"1349"``. Short enough for a
character-level model on two CPU cores, hard enough that a random model is at 0% exact match. One task feeds every
stage: SFT rows (prompt/completion), preference pairs (chosen = the right answer, rejected = a realistic wrong one)
and prompt-only rows with the ``answer`` column that reward functions read.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable

from datasets import Dataset

SPLIT_SEEDS = {"train": 0, "test": 1}


def distinct_problems(n: int, seed: int, exclude: set, draw: Callable[[random.Random], tuple]) -> list[tuple]:
    """``n`` problems that ``draw(rng)`` gives, seeded by ``seed``, none repeated and none in ``exclude`` (a test
    split disjoint from its training split)."""
    rng = random.Random(seed)
    out: list[tuple] = []
    seen = set(exclude)
    while len(out) < n:
        problem = draw(rng)
        if problem not in seen:
            seen.add(problem)
            out.append(problem)
    return out

class GeneratedTask:
    """What every built-in task shares: ``num_train`` / ``num_test`` problems drawn from fixed seeds, the train draw
    excluding every test problem (by ``key``), so train and test never overlap."""

    def __init__(self, num_train: int, num_test: int):
        self.sizes = {"train": num_train, "test": num_test}

    @staticmethod
    def key(problem):
        """What makes two problems the same one (train excludes the test problems' keys)."""
        return problem

    def _problems(self, split: str) -> list:
        if split not in self.sizes:
            raise KeyError(split)
        test = self._draw(self.sizes["test"], SPLIT_SEEDS["test"], exclude=set())
        if split == "test":
            return test
        return self._draw(self.sizes["train"], SPLIT_SEEDS["train"], exclude={self.key(p) for p in test})


class SortTask(GeneratedTask):
    """Sort ``min_digits``..``max_digits`` random digits. Train and test prompts never overlap."""

    name = "sort"

    def __init__(self, num_train: int = 4000, num_test: int = 200, min_digits: int = 3, max_digits: int = 6):
        super().__init__(num_train, num_test)
        self.min_digits, self.max_digits = min_digits, max_digits

    @staticmethod
    def prompt(digits: str) -> str:
        return f"sort {digits}:"

    @staticmethod
    def solve(digits: str) -> str:
        return "".join(sorted(digits))

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


class ArithmeticTask(GeneratedTask):
    """Two-operand arithmetic, bare ("Compute 59 + 63.") or as a one-step word problem, for pretrained chat models.

    Prompts are chat messages (one user turn); the reference answer is one short equation, ``"59 + 63 = 122"``: it
    states which operation the problem asks for and then the result, and its last number is the ``answer`` column
    that ``lit_align.rewards.last_number_match`` scores. Preference pairs: chosen = that equation; rejected = a
    plausible wrong result (off by one or ten, the other operation) in prose, ``"The result is 47."``, so the pair differs
    in correctness *and* format. Train and test share no ``(operation, a, b)``, whatever the wording.
    """

    name = "arith"
    INSTRUCTION = "Answer with one equation, like 7 + 5 = 12."
    ITEMS = ("apples", "books", "coins", "stickers", "marbles", "pencils", "cards", "shells")
    NAMES = ("Tom", "Ana", "Li", "Sara", "Omar", "Mia", "Raj", "Eva")
    WORDED = {  # operation -> templates; {n}: a name, {i}: an item
        "+": ("{n} has {a} {i} and gets {b} more. How many {i} does {n} have now?",
              "A shelf holds {a} {i} and another holds {b}. How many {i} are there in all?"),
        "-": ("{n} had {a} {i} and gave away {b}. How many {i} are left?",
              "A jar held {a} {i}; {b} were taken out. How many {i} are in the jar now?"),
        "*": ("{n} buys {a} bags with {b} {i} in each. How many {i} does {n} buy?",),
    }
    OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}

    def __init__(self, num_train: int = 1000, num_test: int = 100):
        super().__init__(num_train, num_test)

    @staticmethod
    def is_equation(text: str) -> bool:
        """Whether ``text`` is one equation ``a op b = c`` of whole numbers, and nothing else."""
        return re.fullmatch(r"\s*\d+ [-+*] \d+ = -?\d+\s*", text) is not None

    @classmethod
    def equation(cls, op: str, a: int, b: int) -> str:
        return f"{a} {op} {b} = {cls.OPS[op](a, b)}"

    @staticmethod
    def key(problem: dict) -> tuple:
        return problem["key"]  # (operation, a, b), whatever the wording

    def _draw(self, n: int, seed: int, exclude: set) -> list[dict]:
        rng = random.Random(seed)
        out: list[dict] = []
        seen = set(exclude)
        while len(out) < n:
            op = rng.choice("++--*")
            if op == "*":
                a, b = rng.randint(2, 9), rng.randint(2, 12)
            else:
                a, b = rng.randint(10, 99), rng.randint(10, 99)
                a, b = (max(a, b), min(a, b)) if op == "-" else (a, b)
            if (op, a, b) in seen:
                continue
            seen.add((op, a, b))
            if rng.random() < 0.5:
                text = f"Compute {a} {op} {b}."
            else:
                text = rng.choice(self.WORDED[op]).format(n=rng.choice(self.NAMES), i=rng.choice(self.ITEMS), a=a, b=b)
            out.append({"key": (op, a, b), "text": text,
                        "equation": self.equation(op, a, b), "answer": str(self.OPS[op](a, b))})
        return out

    @classmethod
    def wrong_answer(cls, key: tuple, rng: random.Random) -> str:
        """A wrong result in prose: a dropped carry, off by one or ten, or the other operation's result."""
        op, a, b = key
        right = cls.OPS[op](a, b)
        other = cls.OPS["-" if op == "+" else "+"](a, b)
        wrong = rng.choice([right + 1, right - 1, right + 10, right - 10, other])
        wrong = wrong if wrong != right else right + 1
        return f"The result is {wrong}."

    @classmethod
    def _prompt(cls, text: str) -> list[dict[str, str]]:
        """The instruction as the system turn: it replaces the template's default system prompt (18 tokens)."""
        return [{"role": "system", "content": cls.INSTRUCTION}, {"role": "user", "content": text}]

    def prompt_rows(self, split: str) -> Dataset:
        problems = self._problems(split)
        return Dataset.from_dict({"prompt": [self._prompt(p["text"]) for p in problems],
                                  "answer": [p["answer"] for p in problems]})

    def _demonstrated(self, split: str) -> list[dict]:
        """The problems SFT's completions and DPO's pairs answer (the prompts' own here)."""
        return self._problems(split)

    def completion_rows(self, split: str) -> Dataset:
        problems = self._demonstrated(split)
        return Dataset.from_dict({"prompt": [self._prompt(p["text"]) for p in problems],
                                  "completion": [[{"role": "assistant", "content": p["equation"]}] for p in problems]})

    def preference_rows(self, split: str) -> Dataset:
        rng = random.Random(100 + SPLIT_SEEDS[split])
        problems = self._demonstrated(split)
        return Dataset.from_dict({
            "prompt": [self._prompt(p["text"]) for p in problems],
            "chosen": [[{"role": "assistant", "content": p["equation"]}] for p in problems],
            "rejected": [[{"role": "assistant", "content": self.wrong_answer(p["key"], rng)}] for p in problems],
        })


class ArithWordsTask(ArithmeticTask):
    """The arith task's + and * as word problems only, with demonstrations of the bare problems: what GRPO's reward
    teaches that SFT's rows do not show.

    SFT rows and preference pairs ask the bare problem (``"Compute 59 + 63."``, the answer format and the arithmetic);
    prompt rows (GRPO, and the held-out eval of every stage) ask the same problems as one-step word problems over more
    phrasings than the arith task has, so reading which operation a story asks for (``"every day for 4 days"``: *) is
    learnt from the reward alone. No subtraction: SmolLM2-135M's two-digit differences are guesses (greedy 0.05-0.12
    on the arith task's test prompts after SFT and DPO), which no reward sharpens. Train and test share no
    ``(operation, a, b)``; within a split a problem may come back in another wording (the 2-9 times table has 64).
    """

    name = "arith-words"
    WORDED = {
        "+": ("{n} has {a} {i} and gets {b} more. How many {i} does {n} have now?",
              "A shelf holds {a} {i} and another holds {b}. How many {i} are there in all?",
              "{n} found {a} {i} on Monday and {b} on Tuesday. How many {i} did {n} find?",
              "There are {a} red {i} and {b} blue {i}. How many {i} are there altogether?",
              "{n} collected {a} {i} and a friend gave {n} {b} more. How many {i} does {n} have?"),
        "*": ("{n} buys {a} bags with {b} {i} in each. How many {i} does {n} buy?",
              "There are {a} boxes and each box holds {b} {i}. How many {i} are there in total?",
              "{n} gets {b} {i} every day for {a} days. How many {i} does {n} get?",
              "{a} children each have {b} {i}. How many {i} do they have together?",
              "A table has {a} rows of {b} {i}. How many {i} are on the table?"),
    }

    def _draw(self, n: int, seed: int, exclude: set) -> list[dict]:
        rng = random.Random(seed)
        out: list[dict] = []
        seen: set = set()  # (operation, a, b, wording): a problem may come back in another story (8 * 9 has 64 keys)
        while len(out) < n:
            op = rng.choice("+*")
            a, b = (rng.randint(2, 9), rng.randint(2, 9)) if op == "*" else (rng.randint(10, 99), rng.randint(10, 99))
            text = rng.choice(self.WORDED[op]).format(n=rng.choice(self.NAMES), i=rng.choice(self.ITEMS), a=a, b=b)
            if (op, a, b) in exclude or (op, a, b, text) in seen:
                continue
            seen.add((op, a, b, text))
            out.append({"key": (op, a, b), "text": text, "bare": f"Compute {a} {op} {b}.",
                        "equation": self.equation(op, a, b), "answer": str(self.OPS[op](a, b))})
        return out

    def _demonstrated(self, split: str) -> list[dict]:
        """SFT's and DPO's rows ask the problems bare."""
        return [{**p, "text": p["bare"]} for p in self._problems(split)]


class ModSumEnvironment:
    """The modsum task's environment (GRPO's ``model.environment_factory: lit_align.data.tasks.ModSumEnvironment``):
    a calculator that has read the question, so its one tool, ``compute``, takes no arguments."""

    def reset(self, **row) -> None:
        self.question = row["prompt"][-1]["content"]

    def compute(self) -> str:
        """Compute the answer to the question."""
        return ModSumTask.tool_result(*ModSumTask.parse(self.question))


class ModSumTask(GeneratedTask):
    """The sum of two numbers of ``min_digits``..``max_digits`` digits, mod 7: ``"4821+3907 mod 7?"`` -> ``"6"``,
    with a tool.

    The tool task of the built-in models (``configs/sft_tools.yaml``, ``configs/grpo_tools.yaml``). The tiny
    character-level model does not learn this arithmetic in a short run (a guess is right one time in seven); calling
    the environment's ``compute`` tool (``ModSumEnvironment``) and copying the digit of its result is within its
    reach. Prompts are one user turn; the ``answer`` column is the digit. SFT rows demonstrate the tool on a seeded
    ``tool_fraction`` of the problems (call, result, the digit as the answer) and answer directly on the others, so a
    model trained on them samples a call about that often: room for GRPO to learn that calling pays. Train them with
    ``assistant_only_loss`` (the tool's result is not the model's to write). Their ``tools`` column holds the tool's
    schema, rendered into the prompt as GRPO renders it. No preference rows.

    What makes the copy learnable in ``configs/sft_tools.yaml``'s 600 steps (measured with the tiny model): the
    result is the digit ``RESULT_REPEATS`` times (``"66666666"``; with the digit once, the model's answers after it
    stayed guesses), and 30% of the rows demonstrate it (with 20%, guesses too).
    """

    name = "modsum"
    RESULT_REPEATS = 8

    def __init__(self, num_train: int = 2000, num_test: int = 100, min_digits: int = 3, max_digits: int = 4,
                 tool_fraction: float = 0.3):
        super().__init__(num_train, num_test)
        self.min_digits, self.max_digits, self.tool_fraction = min_digits, max_digits, tool_fraction

    @staticmethod
    def solve(a: int, b: int) -> int:
        return (a + b) % 7

    @staticmethod
    def question(a: int, b: int) -> str:
        return f"{a}+{b} mod 7?"

    @staticmethod
    def parse(question: str) -> tuple[int, int]:
        """The two numbers of a ``question``: ``"4821+3907 mod 7?"`` -> ``(4821, 3907)``."""
        match = re.fullmatch(r"(\d+)\+(\d+) mod 7\?", question.strip())
        if match is None:
            raise ValueError(f"not a modsum question: {question!r}")
        return int(match[1]), int(match[2])

    @classmethod
    def tool_result(cls, a: int, b: int) -> str:
        """What ``compute`` answers: the result's digit ``RESULT_REPEATS`` times."""
        return str(cls.solve(a, b)) * cls.RESULT_REPEATS

    def _number(self, rng: random.Random) -> int:
        digits = rng.randint(self.min_digits, self.max_digits)
        return rng.randint(10 ** (digits - 1), 10**digits - 1)

    def _draw(self, n: int, seed: int, exclude: set) -> list[tuple[int, int]]:
        return distinct_problems(n, seed, exclude, lambda rng: (self._number(rng), self._number(rng)))

    @classmethod
    def prompt(cls, a: int, b: int) -> list[dict[str, str]]:
        return [{"role": "user", "content": cls.question(a, b)}]

    @classmethod
    def tool_turns(cls, a: int, b: int) -> list[dict]:
        """The demonstration: call ``compute``, get its result, answer with the result's digit."""
        call = {"type": "function", "function": {"name": "compute", "arguments": {}}}
        return [{"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": "compute", "content": cls.tool_result(a, b)},
                {"role": "assistant", "content": str(cls.solve(a, b))}]

    def prompt_rows(self, split: str) -> Dataset:
        problems = self._problems(split)
        return Dataset.from_dict({"prompt": [self.prompt(a, b) for a, b in problems],
                                  "answer": [str(self.solve(a, b)) for a, b in problems]})

    def completion_rows(self, split: str) -> Dataset:
        from transformers.utils import get_json_schema

        rng = random.Random(200 + SPLIT_SEEDS[split])
        problems = self._problems(split)
        completions = [self.tool_turns(a, b) if rng.random() < self.tool_fraction
                       else [{"role": "assistant", "content": str(self.solve(a, b))}] for a, b in problems]
        schemas = json.dumps([get_json_schema(ModSumEnvironment().compute)])
        return Dataset.from_dict({"prompt": [self.prompt(a, b) for a, b in problems],
                                  "completion": completions, "tools": [schemas] * len(problems)})

    def preference_rows(self, split: str) -> Dataset:
        from lit_align.errors import LitAlignError

        raise LitAlignError("builtin:modsum has prompts (GRPO) and SFT rows, no preference pairs")


class CalculatorEnvironment:
    """The calculator task's environment (GRPO's ``model.environment_factory:
    lit_align.data.tasks.CalculatorEnvironment``): one tool, ``calculator``, that evaluates what the model writes."""

    def reset(self, **row) -> None:
        pass

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression of whole numbers.

        Args:
            expression: whole numbers joined by +, - and *, e.g. "347 * 829".
        """
        return str(CalculatorTask.evaluate(expression))


class CalculatorTask(GeneratedTask):
    """The product of two 3-digit numbers, ``"What is 347 * 829?"`` -> ``"287663"``, with a calculator tool: what
    SmolLM2-135M-Instruct cannot compute (a guess is almost never right) and can copy from the tool's result.

    Prompts are a system turn (a calculator is there; end with ``The answer is <number>.``) and one user turn; the
    ``answer`` column is the product. SFT rows demonstrate the tool on a seeded ``tool_fraction`` of the problems (the
    call ``calculator(expression="347 * 829")``, its result as a tool turn, then ``"The answer is 287663."``) and
    answer directly on the others (the same sentence), so a model trained on them calls now and then when sampling
    and not greedily (the sentence's first token outweighs the call's): the room GRPO has to learn that calling pays
    (``ModSumTask``'s pattern on a real model). Their ``tools`` column holds the tool's
    schema; train them with ``assistant_only_loss``. No preference rows. Train and test share no ``(a, b)``.
    """

    name = "calculator"
    INSTRUCTION = "You have a calculator tool. End with: The answer is <number>."

    def __init__(self, num_train: int = 1000, num_test: int = 100, tool_fraction: float = 0.3):
        super().__init__(num_train, num_test)
        self.tool_fraction = tool_fraction

    @staticmethod
    def evaluate(expression: str) -> int:
        """The value of whole numbers joined by ``+``, ``-`` and ``*`` (anything else raises ``ValueError``)."""
        import ast
        import operator

        ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}

        def value(node):
            if isinstance(node, ast.Constant) and type(node.value) is int:
                return node.value
            if isinstance(node, ast.BinOp) and type(node.op) in ops:
                return ops[type(node.op)](value(node.left), value(node.right))
            raise ValueError(f"not an expression of whole numbers and + - *: {expression!r}")

        if not isinstance(expression, str) or len(expression) > 64:
            raise ValueError(f"expected an expression of at most 64 characters, got {expression!r}")
        try:
            tree = ast.parse(expression.strip(), mode="eval")
        except SyntaxError:
            raise ValueError(f"not an expression of whole numbers and + - *: {expression!r}") from None
        return value(tree.body)

    def _draw(self, n: int, seed: int, exclude: set) -> list[tuple[int, int]]:
        return distinct_problems(n, seed, exclude, lambda rng: (rng.randint(100, 999), rng.randint(100, 999)))

    @classmethod
    def prompt(cls, a: int, b: int) -> list[dict[str, str]]:
        return [{"role": "system", "content": cls.INSTRUCTION}, {"role": "user", "content": f"What is {a} * {b}?"}]

    @staticmethod
    def answer_text(a: int, b: int) -> str:
        """The final turn, with or without a call before it."""
        return f"The answer is {a * b}."

    @staticmethod
    def tool_turns(a: int, b: int) -> list[dict]:
        """The demonstration: call ``calculator``, get its result, answer with it."""
        call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": f"{a} * {b}"}}}
        return [{"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": "calculator", "content": str(a * b)},
                {"role": "assistant", "content": CalculatorTask.answer_text(a, b)}]

    def prompt_rows(self, split: str) -> Dataset:
        problems = self._problems(split)
        return Dataset.from_dict({"prompt": [self.prompt(a, b) for a, b in problems],
                                  "answer": [str(a * b) for a, b in problems]})

    def completion_rows(self, split: str) -> Dataset:
        from transformers.utils import get_json_schema

        rng = random.Random(200 + SPLIT_SEEDS[split])
        problems = self._problems(split)
        completions = [self.tool_turns(a, b) if rng.random() < self.tool_fraction
                       else [{"role": "assistant", "content": self.answer_text(a, b)}] for a, b in problems]
        schemas = json.dumps([get_json_schema(CalculatorEnvironment().calculator)])
        return Dataset.from_dict({"prompt": [self.prompt(a, b) for a, b in problems],
                                  "completion": completions, "tools": [schemas] * len(problems)})

    def preference_rows(self, split: str) -> Dataset:
        from lit_align.errors import LitAlignError

        raise LitAlignError("builtin:calculator has prompts (GRPO) and SFT rows, no preference pairs")


BUILTIN_TASKS = {"sort": SortTask, "arith": ArithmeticTask, "arith-words": ArithWordsTask, "modsum": ModSumTask,
                 "calculator": CalculatorTask}
