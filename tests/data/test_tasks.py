"""Built-in tasks: the arith task's rows (disjoint splits, right answers, pairs that differ in correctness and
format) and its rewards, read through ``lit-align`` as a user meets them."""

from __future__ import annotations

from pathlib import Path

import pytest

from lit_align.cli import run as cli
from lit_align.data.tasks import ArithmeticTask
from lit_align.rewards import arith_exact, arith_format, last_number_match

REPO = Path(__file__).resolve().parents[2]


def test_arith_splits_share_no_problem_and_every_answer_is_right():
    task = ArithmeticTask(num_train=600, num_test=100)
    train, test = task._problems("train"), task._problems("test")
    assert (len(train), len(test)) == (600, 100)
    assert not {p["key"] for p in train} & {p["key"] for p in test}
    assert len({p["key"] for p in train}) == 600  # no problem twice
    for p in train + test:
        op, a, b = p["key"]
        assert int(p["answer"]) == {"+": a + b, "-": a - b, "*": a * b}[op] >= 0
        assert p["equation"] == f"{a} {op} {b} = {p['answer']}"
    assert {p["key"][0] for p in test} == {"+", "-", "*"}
    assert any(p["text"].startswith("Compute") for p in test) and any("How many" in p["text"] for p in test)


def test_arith_rows_are_chats_with_an_answer_column():
    task = ArithmeticTask(num_train=10, num_test=10)
    prompts = task.prompt_rows("test")
    assert prompts.column_names == ["prompt", "answer"]
    first = prompts[0]
    assert first["prompt"] == [{"role": "system", "content": "Answer with one equation, like 7 + 5 = 12."},
                               {"role": "user", "content": "Compute 82 + 18."}]
    assert first["answer"] == "100"
    sft = task.completion_rows("test")
    assert sft[0]["completion"] == [{"role": "assistant", "content": "82 + 18 = 100"}]
    assert sft["prompt"] == prompts["prompt"]


def test_arith_preference_pairs_differ_in_correctness_and_format():
    pairs = ArithmeticTask(num_train=200, num_test=10).preference_rows("train")
    answers = ArithmeticTask(num_train=200, num_test=10).prompt_rows("train")["answer"]
    for score in (arith_exact, last_number_match):
        assert score(pairs["chosen"], answers) == [1.0] * 200
        assert score(pairs["rejected"], answers) == [0.0] * 200
    assert arith_format(pairs["chosen"]) == [1.0] * 200 and arith_format(pairs["rejected"]) == [0.0] * 200
    assert pairs[0]["rejected"][0]["content"].startswith("The result is ")


def test_arith_rewards_score_format_and_result():
    answer = ["122"]
    assert arith_exact(["59 + 63 = 122"], answer) == [1.0]
    assert arith_exact(["59 + 63 = 121"], answer) == [0.0]
    assert arith_exact(["59 + 63 = 122. Done"], answer) == [0.0]  # right number, not the format
    assert last_number_match(["So 59 + 63 = 122"], answer) == [1.0]
    assert arith_format(["9 * 8 = 72", "9 * 8 is 72", "72"]) == [1.0, 0.0, 0.0]


def test_arith_words_asks_word_problems_and_demonstrates_the_bare_ones():
    """builtin:arith-words: prompt rows (GRPO, the eval) are + and * word problems; SFT rows and pairs ask the same
    problems bare, with the same answers; train and test share no (operation, a, b)."""
    from lit_align.data.sources import BUILTIN_PREFIX
    from lit_align.data.tasks import BUILTIN_TASKS, ArithWordsTask

    assert BUILTIN_TASKS["arith-words"] is ArithWordsTask and BUILTIN_PREFIX == "builtin:"
    task = ArithWordsTask()
    train, test = task._problems("train"), task._problems("test")
    assert (len(train), len(test)) == (1000, 100)
    assert not {p["key"] for p in train} & {p["key"] for p in test}
    assert len({(p["key"], p["text"]) for p in train}) == 1000  # a problem comes back only in another wording
    for split, problems in (("train", train), ("test", test)):
        assert {p["key"][0] for p in problems} == {"+", "*"}
        prompts, sft = task.prompt_rows(split), task.completion_rows(split)
        pairs = task.preference_rows(split)
        for p, prompt, demo, pair_prompt, chosen, answer in zip(problems, prompts["prompt"], sft["prompt"],
                                                                pairs["prompt"], sft["completion"], prompts["answer"]):
            op, a, b = p["key"]
            assert answer == str({"+": a + b, "*": a * b}[op])
            assert prompt[0] == demo[0] == {"role": "system", "content": ArithWordsTask.INSTRUCTION}
            assert "How many" in prompt[1]["content"] and not prompt[1]["content"].startswith("Compute")
            assert demo[1]["content"] == pair_prompt[1]["content"] == f"Compute {a} {op} {b}."
            assert chosen == [{"role": "assistant", "content": f"{a} {op} {b} = {answer}"}]
        assert arith_exact(pairs["chosen"], prompts["answer"]) == [1.0] * len(problems)
        assert last_number_match(pairs["rejected"], prompts["answer"]) == [0.0] * len(problems)
    used = {template for op in "+*" for template in ArithWordsTask.WORDED[op]
            if any(p["text"] == template.format(n=n, i=i, a=p["key"][1], b=p["key"][2])
                   for p in train if p["key"][0] == op for n in ArithWordsTask.NAMES for i in ArithWordsTask.ITEMS)}
    assert len(used) == 10  # every phrasing is drawn


def test_lit_align_validates_a_model_on_the_arith_task(tmp_path, tiny_path):
    """`lit-align validate -c configs/eval_smollm2.yaml` reads the task's chat prompts and scores greedy answers with
    its three rewards (here on the built-in tiny model: figures in [0, 1], the format never met)."""
    args = ["validate", "-c", str(REPO / "configs" / "eval_smollm2.yaml"), "--model.init_args.model", "builtin:tiny",
            "--data.init_args.val_batch_size", "4", "--trainer.limit_val_batches", "1",
            "--trainer.logger.init_args.save_dir", str(tmp_path), "--trainer.enable_progress_bar", "false"]
    metrics = cli(args).trainer.callback_metrics
    assert float(metrics["val/rewards/arith_format/mean"]) == 0.0
    assert 0.0 <= float(metrics["val/rewards/last_number_match/mean"]) <= 1.0


def test_modsum_task_demonstrates_its_tool_on_a_fraction_of_the_sft_rows():
    import json

    from lit_align.data.tasks import ModSumEnvironment, ModSumTask
    from lit_align.errors import LitAlignError

    assert ModSumTask.parse("4821+3907 mod 7?") == (4821, 3907)
    assert ModSumTask.tool_result(4821, 3907) == "66666666"  # (4821 + 3907) % 7 = 6, RESULT_REPEATS times
    with pytest.raises(ValueError, match="not a modsum question"):
        ModSumTask.parse("4821+3907 mod 7")
    task = ModSumTask(num_train=400, num_test=20)
    train, test = task.prompt_rows("train"), task.prompt_rows("test")
    assert not {r["prompt"][0]["content"] for r in train} & {r["prompt"][0]["content"] for r in test}
    for r in train:
        question = r["prompt"][0]["content"]
        a, b = map(int, question.removesuffix(" mod 7?").split("+"))
        assert question == f"{a}+{b} mod 7?" and r["answer"] == str((a + b) % 7)
        assert 100 <= min(a, b) and max(a, b) <= 9999
        environment = ModSumEnvironment()
        environment.reset(**r)
        assert environment.compute() == r["answer"] * 8
    sft = task.completion_rows("train")
    calls = [r for r in sft if len(r["completion"]) == 3]
    assert 0.25 < len(calls) / len(sft) < 0.35  # tool_fraction 0.3, seeded
    for row in calls:
        call, result, answer = row["completion"]
        assert call["tool_calls"][0]["function"] == {"name": "compute", "arguments": {}}
        a, b = map(int, row["prompt"][0]["content"].removesuffix(" mod 7?").split("+"))
        assert (result["role"], result["name"], result["content"]) == ("tool", "compute", str((a + b) % 7) * 8)
        assert (answer["role"], answer["content"]) == ("assistant", str((a + b) % 7))
    direct = [r for r in sft if len(r["completion"]) == 1]
    assert len(direct) + len(calls) == len(sft)
    assert all(r["completion"][0]["content"] == str(sum(ModSumTask.parse(r["prompt"][0]["content"])) % 7)
               for r in direct)
    assert json.loads(sft[0]["tools"])[0]["function"]["name"] == "compute"
    with pytest.raises(LitAlignError, match="builtin:modsum has prompts"):
        task.preference_rows("train")


def test_calculator_task_demonstrates_its_tool_and_its_environment_evaluates_the_calls():
    import json

    from lit_align.data.tasks import CalculatorEnvironment, CalculatorTask
    from lit_align.errors import LitAlignError

    assert CalculatorTask.evaluate(" 347 * 829 ") == 287663 and CalculatorTask.evaluate("2 + 3 * 4 - 1") == 13
    for bad in ("2 ** 9", "2 / 3", "__import__('os')", "1.5 * 2", "3 *", "9" * 70, None):
        with pytest.raises(ValueError):
            CalculatorTask.evaluate(bad)
    task = CalculatorTask(num_train=400, num_test=20)
    train, test = task.prompt_rows("train"), task.prompt_rows("test")
    assert len(train) == 400 and len(test) == 20
    assert not {r["prompt"][1]["content"] for r in train} & {r["prompt"][1]["content"] for r in test}
    environment = CalculatorEnvironment()
    for r in train:
        system, user = r["prompt"]
        assert (system["role"], system["content"]) == ("system", CalculatorTask.INSTRUCTION)
        a, b = map(int, user["content"].removeprefix("What is ").removesuffix("?").split(" * "))
        assert 100 <= min(a, b) and max(a, b) <= 999 and r["answer"] == str(a * b)
        environment.reset(**r)
        assert environment.calculator(f"{a} * {b}") == r["answer"]
    sft = task.completion_rows("train")
    calls = [r for r in sft if len(r["completion"]) == 3]
    assert 0.25 < len(calls) / len(sft) < 0.35  # tool_fraction 0.3, seeded
    for row in calls:
        call, result, answer = row["completion"]
        a, b = map(int, row["prompt"][1]["content"][8:-1].split(" * "))
        assert call["tool_calls"][0]["function"] == {"name": "calculator", "arguments": {"expression": f"{a} * {b}"}}
        assert (result["role"], result["name"], result["content"]) == ("tool", "calculator", str(a * b))
        assert (answer["role"], answer["content"]) == ("assistant", f"The answer is {a * b}.")
    direct = [r for r in sft if len(r["completion"]) == 1]
    assert len(direct) + len(calls) == len(sft)
    expected = [f"The answer is {r['answer']}." for r, s in zip(train, sft) if len(s["completion"]) == 1]
    assert [r["completion"][0]["content"] for r in direct] == expected
    schema = json.loads(sft[0]["tools"])[0]["function"]
    assert schema["name"] == "calculator" and list(schema["parameters"]["properties"]) == ["expression"]
    with pytest.raises(LitAlignError, match="builtin:calculator has prompts"):
        task.preference_rows("train")
