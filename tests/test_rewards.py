"""Reward functions: dotted-path import, the checks on what a user's function returns, the built-in sort rewards, and
how ``reward_weights`` combine several functions into GRPO's reward (on a hand example)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml

from helpers import assert_one_line_error, read_metrics, run_main, write_sort_rows
from lit_align.errors import LitAlignError
from lit_align.generation import Rollout
from lit_align.generation_round import RoundShape
from lit_align.modules.grpo import GRPOModule
from lit_align.rewards import load_reward, score, sort_accuracy, sort_exact
from numerics import assert_rounding_close

# -- reward functions the tests name by dotted path (this module is importable as ``test_rewards``) -------------------


def reward_raises(completions, **_):
    raise ValueError("boom")


def reward_nan(completions, **_):
    return [0.0, float("nan")]


def reward_inf(completions, **_):
    return [math.inf, 0.0]


def reward_short(completions, **_):
    return [1.0]


def reward_scalar(completions, **_):
    return 1.0


def reward_text(completions, **_):
    return [1.0, "good"]


def reward_numeric_text(completions, **_):
    return ["1.0", 0.0]


def reward_object(completions, **_):
    return [object(), 0.0]


def reward_none_second(completions, **_):
    return [0.25, None]


def reward_numbers(completions, **_):
    return [np.float32(0.5), True, torch.tensor(2.0)]


def reward_echo(prompts, completions, completion_ids, level, **_):
    """Uses every argument: prompts, completion ids and an extra column."""
    return [len(p) + len(ids) + lv for p, ids, lv in zip(prompts, completion_ids, level)]


def reward_length_or_none(completions, **_):
    """Applies to short completions only: None for longer ones (not applicable)."""
    return [None if len(c) > 2 else float(len(c)) for c in completions]


# -- load_reward ------------------------------------------------------------------------------------------------------
def test_load_reward_resolves_dotted_paths():
    assert load_reward("lit_align.rewards.sort_accuracy") is sort_accuracy
    assert load_reward("test_rewards.reward_echo").__name__ == "reward_echo"


def test_reward_functions_given_from_python_are_taken_as_they_are():
    """As TRL's ``reward_funcs=[fn]``: a callable is the reward, named by its ``__name__``."""
    module = GRPOModule(model="builtin:tiny", reward_funcs=[reward_echo, "lit_align.rewards.sort_accuracy"])
    assert module.rollouts.reward_funcs[0] is reward_echo and module.rollouts.reward_names == ["reward_echo", "sort_accuracy"]


@pytest.mark.parametrize("path,match", [
    ("lit_align.rewards.no_such_reward", r"'lit_align.rewards.no_such_reward': cannot import it"),
    ("no_such_package_xyz.reward", r"'no_such_package_xyz.reward': cannot import it .*No module named"),
    ("sort_accuracy", r"'sort_accuracy': expected a dotted path to a callable"),
    ("lit_align.rewards", r"'lit_align.rewards': expected a dotted path to a callable"),
    ("lit_align.rewards.math", r"'lit_align.rewards.math': expected a dotted path to a callable"),
])
def test_load_reward_bad_paths(path, match):
    with pytest.raises(LitAlignError, match=match):
        load_reward(path)


def test_grpo_module_reports_a_bad_reward_path_and_weights():
    with pytest.raises(LitAlignError, match="no_such_reward"):
        GRPOModule(reward_funcs=["lit_align.rewards.no_such_reward"])
    with pytest.raises(LitAlignError, match="reward_weights has 1 values for 2 reward_funcs"):
        GRPOModule(reward_funcs=["lit_align.rewards.sort_accuracy", "lit_align.rewards.sort_exact"],
                   reward_weights=[1.0])


# -- score: what a reward function may return ---------------------------------------------------------------------------
def run(fn, completions=("a", "b"), **columns):
    completions = list(completions)
    return score(fn, ["p"] * len(completions), completions, [[1]] * len(completions), columns)


@pytest.mark.parametrize("fn,match", [
    (reward_raises, r"reward function 'reward_raises' raised ValueError: boom"),
    (reward_nan, r"reward function 'reward_nan' returned nan for completion 1 \(use None to skip\)"),
    (reward_inf, r"reward function 'reward_inf' returned inf for completion 0"),
    (reward_short, r"reward function 'reward_short' returned 1 values for 2 completions"),
    (reward_scalar, r"reward function 'reward_scalar' returned float values for 2 completions"),
    (reward_text, r"reward function 'reward_text' returned 'good' for completion 1 \(expected a float\)"),
    (reward_numeric_text, r"reward function 'reward_numeric_text' returned '1.0' for completion 0 \(expected a float\)"),
    (reward_object, r"reward function 'reward_object' returned <object object at .*> for completion 0"),
])
def test_bad_reward_values_name_the_function(fn, match):
    with pytest.raises(LitAlignError, match=match) as info:
        run(fn)
    assert "\n" not in str(info.value)


def test_none_becomes_nan_and_numbers_are_accepted():
    out = run(reward_none_second)
    assert out[0] == 0.25 and math.isnan(out[1])
    assert run(reward_numbers, completions=("a", "b", "c")) == [0.5, 1.0, 2.0]


def test_a_tensor_or_an_array_of_rewards_is_taken_as_trl_iterates_it():
    import numpy as np

    assert run(lambda completions, **_: torch.tensor([0.5, 1.0])) == [0.5, 1.0]
    assert run(lambda completions, **_: np.array([0.25, 2.0], dtype=np.float32)) == [0.25, 2.0]
    with pytest.raises(LitAlignError, match=r"returned 1 values for 2 completions"):
        run(lambda completions, **_: torch.tensor([1.0]))
    with pytest.raises(LitAlignError, match=r"returned nan for completion 0 \(use None to skip\)"):
        run(lambda completions, **_: torch.tensor([math.nan, 1.0]))


def test_reward_gets_prompts_ids_and_columns():
    out = score(reward_echo, ["ab", "abcd"], ["x", "y"], [[1, 2, 3], [4]], {"level": [10, 20]})
    assert out == [2 + 3 + 10, 4 + 1 + 20]


# -- the built-in sort rewards --------------------------------------------------------------------------------------
def test_sort_accuracy_and_exact_on_known_completions():
    completions = ["123", " 123\n", "132", "", "1234", "12", [{"role": "assistant", "content": "123"}]]
    answers = ["123"] * len(completions)
    # "132": one position right of 3 -> 0.5 * 1/3; "1234": 3 of max(3, 4) -> 0.5 * 3/4; "12": 2 of 3 -> 0.5 * 2/3
    expected = [1.0, 1.0, 0.5 / 3, 0.0, 0.375, 0.5 * 2 / 3, 1.0]
    assert sort_accuracy(completions, answers) == pytest.approx(expected)
    assert sort_exact(completions, answers) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0]


# -- reward_weights: GRPOModule.make_round on a fixed rollout ----------------------------------------------------------
class FixedEngine:
    """Returns the given completions (EOS-terminated) for any prompts."""

    def __init__(self, tokenizer, texts: list[str]):
        ids = [tokenizer(t)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
        width = max(map(len, ids))
        self.rollout = Rollout(
            completion_ids=torch.tensor([i + [tokenizer.pad_token_id] * (width - len(i)) for i in ids]),
            completion_mask=torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i in ids]),
            truncated=torch.zeros(len(ids), dtype=torch.bool),
            logps=torch.zeros(len(ids), width),
        )
        self.calls = 0

    def generate(self, model, prompt_ids, prompt_mask, num_samples, eos_token_ids, pad_token_id):
        self.calls += 1
        assert prompt_ids.shape[0] * num_samples == self.rollout.completion_ids.shape[0]
        return self.rollout


def stub_trainer(accumulate: int = 1):
    """What make_round asks of the Trainer, single device."""
    return SimpleNamespace(accumulate_grad_batches=accumulate, world_size=1, global_step=0, global_rank=0,
                           strategy=SimpleNamespace(reduce=lambda t, reduce_op=None: t, all_gather=lambda t: t))


def round_for(module: GRPOModule, tokenizer, prompts, texts, columns, num_generations=2, accumulate=1, spg=1,
              iterations=1):
    module.tokenizer = tokenizer
    module.round_shape = RoundShape(num_generations, spg, iterations)
    module.rollouts.engine = FixedEngine(tokenizer, texts)
    module._trainer = stub_trainer(accumulate)
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    width = max(map(len, ids))
    batch = {
        "prompt_ids": torch.tensor([[0] * (width - len(i)) + i for i in ids]),
        "prompt_mask": torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids]),
        "prompts": prompts, "columns": columns, "round_pos": 0,
    }
    return module.make_round(batch)


def test_reward_weights_combine_functions_by_hand(tokenizer):
    module = GRPOModule(reward_funcs=["lit_align.rewards.sort_accuracy", "lit_align.rewards.sort_exact"],
                        reward_weights=[1.0, 2.0])
    # prompt A (answer "13"): "13" (accuracy 1, exact 1), "31" (0, 0)
    # prompt B (answer "025"): "025" (1, 1), "052" (one position right of 3: 1/6, 0)
    r = round_for(module, tokenizer, ["sort 31:", "sort 502:"], ["13", "31", "025", "052"],
                  {"answer": ["13", "025"]})
    rewards = [3.0, 0.0, 3.0, 1 / 6]  # 1 * accuracy + 2 * exact
    assert r.rewards == pytest.approx(rewards)
    assert r.completions == ["13", "31", "025", "052"]
    assert r.prompts == ["sort 31:", "sort 31:", "sort 502:", "sort 502:"]
    # advantages per group of 2: (r - mean) / (unbiased std + 1e-4)
    a = 1.5 / (math.sqrt(4.5) + 1e-4)  # group A: mean 1.5, std sqrt(2 * 1.5^2)
    d = (3 - 1 / 6) / 2
    b = d / (math.sqrt(2 * d * d) + 1e-4)
    assert_rounding_close(r.advantages, [a, -a, b, -b], scale=max(rewards), terms=2)  # fp32, groups of 2
    stats = {k: float(v) for k, v in r.stats.items()}
    assert stats["reward"] == pytest.approx(sum(rewards) / 4)
    assert stats["reward_std"] == pytest.approx(float(torch.tensor(rewards).std()))
    assert stats["rewards/sort_accuracy/mean"] == pytest.approx((1 + 0 + 1 + 1 / 6) / 4)
    assert stats["rewards/sort_exact/mean"] == pytest.approx(0.5)
    assert stats["frac_reward_zero_std"] == 0.0
    assert stats["completions/mean_length"] == pytest.approx((3 + 3 + 4 + 4) / 4)  # text + EOS
    assert stats["completions/clipped_ratio"] == 0.0
    assert r.old_logps is None and r.ref_logps is None  # one step per round, beta 0: neither needed


def test_none_rewards_are_skipped_and_unscorable_completions_get_zero_advantage(tokenizer):
    module = GRPOModule(reward_funcs=["test_rewards.reward_length_or_none", "lit_align.rewards.sort_exact"],
                        reward_weights=[0.5, -1.0])
    # reward_length_or_none: "1" -> 1.0, "12" -> 2.0, "123" -> None; sort_exact always applies
    # completions of prompt A (answer "12"): "1" -> 0.5 - 0 = 0.5; "12" -> 1.0 - 1 = 0.0
    # prompt B (answer "123"): "123" -> (None) - 1 = -1.0; "321" -> (None) - 0 = 0.0
    r = round_for(module, tokenizer, ["sort 21:", "sort 321:"], ["1", "12", "123", "321"],
                  {"answer": ["12", "123"]})
    assert r.rewards == pytest.approx([0.5, 0.0, -1.0, 0.0])
    stats = {k: float(v) for k, v in r.stats.items()}
    assert stats["rewards/reward_length_or_none/mean"] == pytest.approx(1.5)  # the mean over rows it applied to

    # a function whose every value is None leaves the row unscorable: NaN reward, advantage 0, left out of stats
    module = GRPOModule(reward_funcs=["test_rewards.reward_length_or_none"])
    with pytest.warns(UserWarning, match=r"All reward functions returned None .*\(1 of 4 completions unscored\)"):
        r = round_for(module, tokenizer, ["a", "b"], ["1", "123", "12", "1"], {})
    assert r.rewards[:1] == [1.0] and math.isnan(r.rewards[1])
    # group A = [1, NaN]: one scored value, no spread -> advantage 0; group B = [2, 1] -> +-1 / (std + 1e-4)
    b = 0.5 / (math.sqrt(0.5) + 1e-4)
    assert_rounding_close(r.advantages, [0.0, 0.0, b, -b], scale=2.0, terms=2)
    stats = {k: float(v) for k, v in r.stats.items()}
    assert stats["reward"] == pytest.approx((1 + 2 + 1) / 3)
    assert stats["frac_reward_zero_std"] == 0.5  # group A carries no signal


def test_frac_reward_zero_std_ignores_unscorable_rows(tokenizer):
    module = GRPOModule(reward_funcs=["test_rewards.reward_length_or_none"])
    # G=4, one group: [1, NaN, 1, 1] -> the scored rewards are all equal: zero std, all advantages 0
    with pytest.warns(UserWarning, match="All reward functions returned None"):
        r = round_for(module, tokenizer, ["a"], ["1", "123", "1", "1"], {}, num_generations=4)
    assert r.advantages.tolist() == [0.0, 0.0, 0.0, 0.0]
    stats = {k: float(v) for k, v in r.stats.items()}
    assert stats["frac_reward_zero_std"] == 1.0


# -- TRL's reward conveniences: class_path rewards, async rewards, trainer_state, log_metric, log_extra ------------
class LengthOver:
    """A parametrised reward (``{class_path, init_args}``): 1.0 for completions longer than ``threshold``."""

    def __init__(self, threshold: int):
        self.threshold = threshold

    def __call__(self, completions, trainer_state, log_metric, log_extra, **_):
        texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
        log_metric("long_fraction", sum(len(t) > self.threshold for t in texts) / len(texts))
        log_extra("length", [len(t) for t in texts])
        assert trainer_state.global_step == 0 and trainer_state.max_steps == -1  # the stand-in trainer's
        return [float(len(t) > self.threshold) for t in texts]


async def async_exact(completions, answer, **_):
    """An ``async def`` reward: awaited with the others, concurrently."""
    return sort_exact(completions, answer)


def test_class_path_and_async_rewards_with_trls_extra_arguments(tokenizer):
    module = GRPOModule(reward_funcs=[{"class_path": "test_rewards.LengthOver", "init_args": {"threshold": 2}},
                                      "test_rewards.async_exact"])
    assert module.rollouts.reward_names == ["LengthOver", "async_exact"]
    r = round_for(module, tokenizer, ["sort 31:", "sort 502:"], ["13", "31", "025", "052"], {"answer": ["13", "025"]})
    assert r.rewards == [1.0, 0.0, 2.0, 1.0]  # (length > 2) + exact
    assert float(r.stats["long_fraction"]) == 0.5  # log_metric: logged as train/long_fraction with the round
    assert r.extra == {"length": [2, 2, 3, 3]}  # log_extra: a completions-table column
    with pytest.raises(LitAlignError, match=r"reward function 'test_rewards.LengthOver': .*threshold"):
        GRPOModule(reward_funcs=[{"class_path": "test_rewards.LengthOver"}])


# -- reward models by name: a sequence classifier with its own tokenizer ---------------------------------------------
@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory, tokenizer) -> str:
    """A tiny Llama sequence classifier (one label) with the built-in tokenizer, built offline."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id)
    path = tmp_path_factory.mktemp("reward") / "tiny-rm"
    LlamaForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def logit_alone(path: str, text: str) -> float:
    """The classifier's logit on one unpadded text: what a reward model must give each row of a padded batch."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model, tok = AutoModelForSequenceClassification.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        return float(model(**tok(text, return_tensors="pt", add_special_tokens=False)).logits[0, 0])


def test_a_reward_model_scores_prompt_and_completion_at_the_last_real_token(reward_model_dir):
    from lit_align.rewards import RewardModel, load_reward

    fn = load_reward(reward_model_dir)
    assert isinstance(fn, RewardModel) and fn.__name__ == "tiny-rm"  # TRL's name: the model id's last part
    fn.batch_size = 2  # 5 rows: batches of 2, 2, 1, each right-padded to its longest
    prompts = ["sort 31:", "sort 502:", "sort 7:", "sort 9910:", "sort 4:"]
    completions = ["13", "025", "7 and more text", "0199", ""]
    scores = fn(prompts=prompts, completions=completions, completion_ids=[[]] * 5)
    # each completion ends with the EOS, as a reward model trained on standard rows saw it (TRL's RewardTrainer)
    expected = [logit_alone(reward_model_dir, p + c + "</s>") for p, c in zip(prompts, completions)]
    assert scores == pytest.approx(expected, abs=1e-5) and len(set(scores)) == 5
    assert fn(prompts=prompts[:1], completions=["13</s>"]) == pytest.approx(expected[:1], abs=1e-5)  # not twice
    assert expected[0] != pytest.approx(logit_alone(reward_model_dir, "sort 31:13"), abs=1e-5)

    conversation = [[{"role": "user", "content": "sort 31"}]]
    answer = [[{"role": "assistant", "content": "13"}]]
    text = fn.tokenizer.apply_chat_template(conversation[0] + answer[0], tokenize=False)
    assert fn(prompts=conversation, completions=answer) == pytest.approx([logit_alone(reward_model_dir, text)], abs=1e-5)


def test_grpo_loads_reward_models_with_the_policys_settings_and_logs_them(reward_model_dir, tokenizer):
    module = GRPOModule(reward_funcs=["lit_align.rewards.sort_exact", reward_model_dir],
                        model_init_kwargs={"attention_dropout": 0.25})
    assert module.rollouts.reward_names == ["sort_exact", "tiny-rm"]
    module.configure_model()
    rm = module.rollouts.reward_funcs[1]
    assert rm.network.config.attention_dropout == 0.25  # model_init_kwargs reach the reward model too
    assert not rm.network.training and not any(p.requires_grad for p in rm.network.parameters())
    assert not any("tiny-rm" in k or "score" in k for k in module.state_dict())  # not trained, not checkpointed
    prompts, texts = ["sort 31:", "sort 502:"], ["13", "31", "025", "052"]
    r = round_for(module, tokenizer, prompts, texts, {"answer": ["13", "025"]})
    model_scores = rm(prompts=[p for p in prompts for _ in range(2)], completions=texts)
    assert r.reward_funcs["tiny-rm"] == pytest.approx(model_scores)
    assert r.rewards == pytest.approx([e + m for e, m in zip([1.0, 0.0, 1.0, 0.0], model_scores)])
    assert float(r.stats["rewards/tiny-rm/mean"]) == pytest.approx(sum(model_scores) / 4)


def test_a_missing_reward_model_is_named_before_the_run(tmp_path):
    with pytest.raises(LitAlignError, match=r"reward model '.*/no-rm': no such directory"):
        GRPOModule(reward_funcs=[str(tmp_path / "no-rm")])


# -- what a GRPO run through ``lit-align fit`` refuses or warns about ------------------------------------------------------
CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def reward_always_none(completions, **_):
    """Applies to no completion at all."""
    return [None] * len(completions)


@pytest.fixture(scope="module")
def prompt_rows(tmp_path_factory) -> str:
    return write_sort_rows(tmp_path_factory.mktemp("reward_prompts") / "prompts.jsonl", 8, "prompts")


def grpo_fit(root: Path, prompts: str, *extra: str) -> list[str]:
    """One short GRPO step of ``configs/grpo.yaml`` on the tiny model, writing only under ``root``."""
    return ["fit", "-c", str(CONFIGS / "grpo.yaml"), "--model.init_args.model", "builtin:tiny",
            "--model.init_args.max_completion_length", "4", "--data.init_args.path", prompts,
            "--data.init_args.val_split", "null", "--data.init_args.batch_size", "4",
            "--model.init_args.num_generations", "2", "--model.init_args.steps_per_generation", "1",
            "--trainer.max_steps", "1", "--trainer.val_check_interval", "1.0", "--trainer.log_every_n_steps", "1",
            "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(root),
            "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", str(root),
            "--export.enabled", "false", *extra]


def test_grpo_without_reward_functions_is_refused(tmp_path, prompt_rows, capfd):
    """TRL requires reward_funcs: no reward function never means the built-in task's, which does not fit other data."""
    code, _, err = run_main(grpo_fit(tmp_path, prompt_rows, "--model.init_args.reward_funcs", "[]"), capfd)
    assert_one_line_error(code, err, "model.reward_funcs: none given; GRPO scores completions only with the reward "
                                     "functions you name")
    config = tmp_path / "mine.yaml"  # a user's own config that leaves reward_funcs out
    config.write_text(yaml.safe_dump({
        "model": {"class_path": "lit_align.modules.GRPOModule",
                  "init_args": {"model": "builtin:tiny", "num_generations": 2}},
        "data": {"class_path": "lit_align.data.PromptDataModule",
                 "init_args": {"path": prompt_rows, "val_split": None, "batch_size": 4}},
        "trainer": {"max_steps": 1, "logger": False, "default_root_dir": str(tmp_path)},
        "export": {"enabled": False}}))
    code, _, err = run_main(["fit", "-c", str(config)], capfd)
    assert_one_line_error(code, err, "model.reward_funcs: none given", "lit_align.rewards.sort_accuracy")
    assert not list(tmp_path.rglob("*.ckpt"))  # refused before anything ran


def test_a_causal_lm_given_as_a_reward_model_is_refused(tmp_path, prompt_rows, tiny_path, capfd):
    """transformers would give it a randomly initialised ``score`` head and only log the missing weights."""
    code, _, err = run_main(grpo_fit(tmp_path, prompt_rows, "--model.init_args.reward_funcs",
                                     json.dumps(["lit_align.rewards.sort_accuracy", tiny_path])), capfd)
    assert_one_line_error(code, err, f"reward model {tiny_path!r}: its checkpoint has no weights for "
                                     "['score.weight']", "not a reward model")


def test_completions_no_reward_function_applies_to_are_warned_about(tmp_path, prompt_rows, capfd):
    """As TRL: the completion is unscorable (reward NaN, advantage 0: the loss is 0), and the user is told."""
    with pytest.warns(UserWarning, match=r"All reward functions returned None for the following kwargs: "
                                         r"\{'answer': '\d+', 'prompt': 'sort \d+:', 'completion': .*\}; please "
                                         r"ensure that at least one reward function returns a valid reward"):
        code, _, err = run_main(grpo_fit(tmp_path, prompt_rows, "--model.init_args.reward_funcs",
                                         "[test_rewards.reward_always_none]"), capfd)
    assert code == 0, err
    step = [r for r in read_metrics(next(tmp_path.rglob("metrics.csv"))) if "train/loss" in r]
    assert len(step) == 1 and step[0]["train/loss"] == 0.0 and math.isnan(step[0]["train/reward"])


def test_max_completion_length_below_one_names_the_setting(tmp_path, prompt_rows, capfd):
    code, _, err = run_main(grpo_fit(tmp_path, prompt_rows, "--model.init_args.reward_funcs",
                                     "[lit_align.rewards.sort_accuracy]", "--model.init_args.max_completion_length",
                                     "0"), capfd)
    line = assert_one_line_error(code, err, "model.max_completion_length must be >= 1 (tokens sampled per "
                                            "completion), got 0")
    assert "max_new_tokens" not in line


# -- pass@k -------------------------------------------------------------------------------------------------------------
def test_pass_at_k_is_the_unbiased_estimator():
    """``1 - C(n - c, k) / C(n, k)``, by hand for n = 8: c = 1, k = 2: 1 - 21/28; c = 2, k = 4: 1 - 15/70; no sample
    solved: 0; c > n - k: 1; k = 1 is the solved fraction."""
    from lit_align.rewards import pass_at_k

    solved = torch.zeros(4, 8, dtype=torch.bool)
    solved[0, 3] = True  # c = 1
    solved[1, :2] = True  # c = 2
    solved[3, :7] = True  # c = 7
    assert pass_at_k(solved, 2).tolist() == pytest.approx([1 - 21 / 28, 1 - 15 / 28, 0.0, 1.0], abs=1e-12)
    assert pass_at_k(solved, 4).tolist() == pytest.approx([0.5, 1 - 15 / 70, 0.0, 1.0], abs=1e-12)
    assert pass_at_k(solved, 1).tolist() == pytest.approx([1 / 8, 2 / 8, 0.0, 7 / 8], abs=1e-12)
    assert pass_at_k(solved, 8).tolist() == [1.0, 1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(solved, 9)


def test_calculator_call_format_scores_the_calls_of_a_completion_and_skips_those_without():
    from lit_align.rewards import calculator_call_format

    def call(name, arguments):
        return {"type": "function", "function": {"name": name, "arguments": arguments}}

    def episode(*calls):
        return [{"role": "assistant", "content": "", "tool_calls": list(calls)},
                {"role": "tool", "name": "calculator", "content": "1"}, {"role": "assistant", "content": "1"}]

    completions = [
        episode(call("calculator", {"expression": "347 * 829"})),
        episode(call("calculator", {"expression": "347 * 829"}), call("calculator", {"expression": "3 +"})),
        episode(call("calc", {"expression": "1 + 2"})),
        episode(call("calculator", {"x": "1 + 2"})),
        [{"role": "assistant", "content": "287663"}],
        "287663",
    ]
    assert calculator_call_format(completions) == [1.0, 0.0, 0.0, 0.0, None, None]
