"""Users' data layouts, through the real CLI: the exact column layouts of public datasets (``tests/fixtures/formats``):
ultrachat_200k and Capybara conversations, a function-calling set with ``tools``, H4's UltraFeedback pairs, a plain
``text`` corpus; and what each format refuses, as one ``error:`` line with exit status 2."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from helpers import assert_one_line_error, read_metrics, run_main
from lit_align.data import CompletionDataModule, PreferenceDataModule, PromptDataModule

REPO = Path(__file__).resolve().parents[2]
FORMATS = REPO / "tests" / "fixtures" / "formats"
TOOL_TEMPLATE = str(FORMATS / "tool_template.jinja")


def fit(recipe: str, root: Path, path: Path, *extra: str) -> list[str]:
    return ["fit", "-c", str(REPO / "configs" / f"{recipe}.yaml"), "--data.init_args.path", str(path),
            "--data.init_args.val_split", "null", "--data.init_args.batch_size", "2", "--trainer.max_steps", "2",
            "--trainer.val_check_interval", "1.0", "--trainer.log_every_n_steps", "1",
            "--trainer.enable_progress_bar", "false", "--trainer.logger.init_args.save_dir", str(root),
            "--trainer.logger.init_args.version", "run", "--trainer.enable_checkpointing", "false",
            "--export.enabled", "false", *extra]


def spans(tokenizer, ids: list[int], mask: list[int]) -> list[str]:
    """The decoded runs of ``ids`` where ``mask`` is 1."""
    out, run = [], []
    for token, bit in zip([*ids, None], [*mask, 0]):
        if bit:
            run.append(token)
        elif run:
            out.append(tokenizer.decode(run))
            run = []
    return out


# -- SFT -----------------------------------------------------------------------------------------------------------
def test_every_assistant_turn_of_a_conversation_is_marked(tokenizer):
    dm = CompletionDataModule(str(FORMATS / "ultrachat_200k.jsonl"), tokenizer="builtin:tiny", val_split=None)
    dm.setup("fit")
    rows = [json.loads(line) for line in (FORMATS / "ultrachat_200k.jsonl").read_text().splitlines()]
    for row, tokens in zip(rows, dm.train_data):
        assistant = [m["content"] + "</s>" for m in row["messages"] if m["role"] == "assistant"]
        assert spans(tokenizer, tokens["input_ids"], tokens["assistant_mask"]) == assistant  # both turns, only them
        assert tokens["completion_mask"] == [1] * len(tokens["input_ids"])  # language modelling by default (TRL)


def test_tool_calls_are_trained_and_tool_results_are_not(tokenizer):
    dm = CompletionDataModule(str(FORMATS / "function_calling.jsonl"), tokenizer="builtin:tiny", val_split=None,
                              chat_template=TOOL_TEMPLATE)
    dm.setup("fit")
    tokens = dm.train_data[1]
    text = tokenizer.decode(tokens["input_ids"])
    assert text.startswith("<|system|>tools: sort_digits\n<|user|>sort 031 with the tool\n")  # `tools` reached it
    assert spans(tokenizer, tokens["input_ids"], tokens["assistant_mask"]) == [
        '<call>sort_digits {"digits": "031"}</call></s>', "013</s>"]  # the call and the answer; not the result


@pytest.mark.parametrize("fixture,extra", [
    ("ultrachat_200k.jsonl", ["--model.init_args.assistant_only_loss", "true"]),
    ("capybara.jsonl", []),
    ("function_calling.jsonl", ["--model.init_args.assistant_only_loss", "true", "--model.init_args.chat_template",
                                TOOL_TEMPLATE]),
    ("text_corpus.jsonl", []),
])
def test_sft_trains_on_each_layout(tmp_path, fixture, extra, capfd):
    code, _, err = run_main(fit("sft", tmp_path, FORMATS / fixture, *extra), capfd)
    assert code == 0, err
    losses = [r["train/loss"] for r in read_metrics(tmp_path / "sft" / "run") if "train/loss" in r]
    assert len(losses) == 2 and all(math.isfinite(x) and x > 0 for x in losses)


# -- preference pairs and prompts ------------------------------------------------------------------------------------
def test_h4_pairs_take_the_prompt_from_the_conversations(tokenizer, tmp_path, capfd):
    """``prompt`` a string, ``chosen`` / ``rejected`` whole conversations repeating it (ultrafeedback_binarized): the
    prompt is the shared user turn, as TRL's ``maybe_extract_prompt`` makes it; the completions are the answers."""
    dm = PreferenceDataModule(str(FORMATS / "ultrafeedback_binarized.jsonl"), tokenizer="builtin:tiny",
                              val_split=None)
    dm.setup("fit")
    row = json.loads((FORMATS / "ultrafeedback_binarized.jsonl").read_text().splitlines()[0])
    tokens = dm.train_data[0]
    assert tokenizer.decode(tokens["prompt_ids"]) == f"<|user|>{row['prompt']}\n<|assistant|>"
    assert tokenizer.decode(tokens["chosen_ids"]) == row["chosen"][1]["content"] + "</s>"
    assert tokenizer.decode(tokens["rejected_ids"]) == row["rejected"][1]["content"] + "</s>"
    code, _, err = run_main(fit("dpo", tmp_path, FORMATS / "ultrafeedback_binarized.jsonl"), capfd)
    assert code == 0, err


def test_prompts_render_with_the_rows_tools_and_template_arguments(tokenizer, tmp_path):
    rows = tmp_path / "prompts.jsonl"
    tools = json.loads(json.loads((FORMATS / "function_calling.jsonl").read_text().splitlines()[0])["tools"])
    rows.write_text(json.dumps({"prompt": [{"role": "user", "content": "sort 31"}], "tools": tools,
                                "answer": "13"}) + "\n")
    dm = PromptDataModule(str(rows), tokenizer="builtin:tiny", val_split=None, chat_template=TOOL_TEMPLATE,
                          batch_size=2)
    dm.setup("fit")
    assert tokenizer.decode(dm.train_data[0]["prompt_ids"]) == (
        "<|system|>tools: sort_digits\n<|user|>sort 31\n<|assistant|>")
    kwargs = PromptDataModule(str(rows), tokenizer="builtin:tiny", val_split=None, batch_size=2,
                              chat_template="{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
                              chat_template_kwargs={"greeting": "hi: "})
    kwargs.setup("fit")
    assert tokenizer.decode(kwargs.train_data[0]["prompt_ids"]) == "hi: sort 31"


# -- what each format refuses ----------------------------------------------------------------------------------------
def test_bad_layouts_are_one_error_line(tmp_path, capfd):
    bad_tools = tmp_path / "bad_tools.jsonl"
    row = json.loads((FORMATS / "function_calling.jsonl").read_text().splitlines()[0])
    bad_tools.write_text(json.dumps({**row, "tools": "[{not json"}) + "\n")
    code, _, err = run_main(fit("sft", tmp_path, bad_tools), capfd)
    assert_one_line_error(code, err, f"{bad_tools} row 0: field 'tools' is not valid JSON")

    bad_call = tmp_path / "bad_call.jsonl"
    messages = [dict(m) for m in row["messages"]]
    messages[1]["tool_calls"] = {"name": "sort_digits"}  # an object, not a list
    bad_call.write_text(json.dumps({"messages": messages}) + "\n")
    code, _, err = run_main(fit("sft", tmp_path, bad_call), capfd)
    assert_one_line_error(code, err, f"{bad_call} row 0: messages[1].tool_calls must be a list")

    code, _, err = run_main(fit("sft", tmp_path, FORMATS / "text_corpus.jsonl", "--model.init_args.assistant_only_loss",
                                "true"), capfd)
    assert_one_line_error(code, err, "model.assistant_only_loss needs conversational rows")

    code, _, err = run_main(fit("sft", tmp_path, FORMATS / "capybara.jsonl", "--model.init_args.chat_template",
                                str(tmp_path / "missing.jinja")), capfd)
    assert_one_line_error(code, err, f"chat_template {str(tmp_path / 'missing.jinja')!r}: no such file")


# -- mixtures --------------------------------------------------------------------------------------------------------
def mixture(**kw) -> CompletionDataModule:
    sources = [{"path": str(FORMATS / "ultrachat_200k.jsonl")}, {"path": str(FORMATS / "text_corpus.jsonl")}]
    return CompletionDataModule(tokenizer="builtin:tiny", val_split=None, mixture=sources, **kw)


def rows_of(dm) -> list[list[int]]:
    dm.setup("fit")
    return list(dm.train_data["input_ids"])


def test_a_concatenated_mixture_holds_every_source_in_order():
    chats = CompletionDataModule(str(FORMATS / "ultrachat_200k.jsonl"), tokenizer="builtin:tiny", val_split=None)
    text = CompletionDataModule(str(FORMATS / "text_corpus.jsonl"), tokenizer="builtin:tiny", val_split=None)
    assert rows_of(mixture()) == rows_of(chats) + rows_of(text)


def test_an_interleaved_mixture_follows_its_weights_and_seed():
    first, again = rows_of(mixture(mixture_strategy="interleave")), rows_of(mixture(mixture_strategy="interleave"))
    assert first == again  # deterministic from the seed
    assert first != rows_of(mixture(mixture_strategy="interleave", seed=1))
    chats = set(map(tuple, rows_of(CompletionDataModule(str(FORMATS / "ultrachat_200k.jsonl"),
                                                        tokenizer="builtin:tiny", val_split=None))))
    heavy = rows_of(CompletionDataModule(tokenizer="builtin:tiny", val_split=None, mixture_strategy="interleave",
                                         mixture=[{"path": str(FORMATS / "ultrachat_200k.jsonl"), "weight": 9.0},
                                                  {"path": str(FORMATS / "text_corpus.jsonl"), "weight": 1.0}]))
    assert sum(tuple(r) in chats for r in heavy) > sum(tuple(r) in chats for r in first) / 2  # weighted draws
    assert any(tuple(r) in chats for r in first) and any(tuple(r) not in chats for r in first)


def test_a_mixture_resumes_exactly_and_refuses_unlike_sources(tmp_path, capfd):
    sources = json.dumps([{"path": str(FORMATS / "ultrachat_200k.jsonl"), "weight": 2.0},
                          {"path": str(FORMATS / "capybara.jsonl")}])
    common = ["--data.init_args.mixture", sources, "--data.init_args.mixture_strategy", "interleave",
              "--trainer.max_steps", "4", "--trainer.enable_checkpointing", "true",
              "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
              "--trainer.callbacks.every_n_train_steps", "2", "--trainer.callbacks.save_top_k", "-1",
              "--trainer.callbacks.filename", "{step}"]
    code, _, err = run_main(fit("sft", tmp_path / "full", FORMATS / "capybara.jsonl", *common), capfd)
    assert code == 0, err
    full = {int(r["step"]): r["train/loss"] for r in read_metrics(tmp_path / "full" / "sft" / "run")
            if "train/loss" in r}
    ckpt = tmp_path / "full" / "sft" / "run" / "checkpoints" / "step=2.ckpt"
    code, _, err = run_main([*fit("sft", tmp_path / "resumed", FORMATS / "capybara.jsonl", *common),
                             "--ckpt_path", str(ckpt)], capfd)
    assert code == 0, err
    resumed = {int(r["step"]): r["train/loss"]
               for r in read_metrics(tmp_path / "resumed" / "sft" / "run") if "train/loss" in r}
    assert resumed == {2: full[2], 3: full[3]}

    unlike = json.dumps([{"path": str(FORMATS / "ultrachat_200k.jsonl")},
                         {"path": str(FORMATS / "ultrafeedback_binarized.jsonl")}])
    code, _, err = run_main(fit("dpo", tmp_path / "unlike", FORMATS / "capybara.jsonl", "--data.init_args.mixture",
                                unlike), capfd)
    assert_one_line_error(code, err, f"{FORMATS / 'ultrachat_200k.jsonl'} (train) row 0: missing column 'chosen'")
    with_answer, without = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    with_answer.write_text(json.dumps({"prompt": "sort 31:", "answer": "13"}) + "\n")
    without.write_text(json.dumps({"prompt": "sort 21:"}) + "\n")
    prompts = PromptDataModule(tokenizer="builtin:tiny", val_split=None, batch_size=2,
                               mixture=[{"path": str(with_answer)}, {"path": str(without)}])
    with pytest.raises(Exception, match=r"data.mixture: the sources' rows have different columns .*rename_columns"):
        prompts.setup("fit")


def test_standard_and_conversational_sources_mix_in_either_order(tmp_path, capfd):
    """Prompt/completion rows with conversations (SFT), string prompts with message prompts (GRPO): either order
    trains, and each order's rows are its sources' rows, one after the other, as each source alone gives them."""
    completions = tmp_path / "completions.jsonl"
    completions.write_text("".join(json.dumps({"prompt": f"sort {d}:", "completion": "".join(sorted(d))}) + "\n"
                                   for d in ("31", "520", "97")))
    strings, messages = tmp_path / "strings.jsonl", tmp_path / "messages.jsonl"
    strings.write_text("".join(json.dumps({"prompt": p, "answer": "".join(sorted(p))}) + "\n"
                               for p in ("sort 31:", "42", "sort 520:")))  # "42": text, though it reads as JSON
    messages.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"sort {d}:"}],
                                            "answer": "".join(sorted(d))}) + "\n" for d in ("64", "802", "19")))
    for recipe, module, sources in [("sft", CompletionDataModule, [completions, FORMATS / "capybara.jsonl"]),
                                    ("grpo", PromptDataModule, [strings, messages])]:
        extra = {"grpo": dict(batch_size=2)}.get(recipe, {})
        alone = [list(rows_of_source(module, source, **extra)) for source in sources]
        for order in (sources, sources[::-1]):
            mixture = json.dumps([{"path": str(source)} for source in order])
            root = tmp_path / f"{recipe}-{order[0].stem}"
            args = ["--data.init_args.mixture", mixture]
            if recipe == "grpo":
                args += ["--model.init_args.model", "builtin:tiny", "--model.init_args.num_generations", "2",
                         "--model.init_args.max_completion_length", "4"]
            code, _, err = run_main(fit(recipe, root, sources[0], *args), capfd)
            assert code == 0, err
            dm = module(tokenizer="builtin:tiny", val_split=None, mixture=[{"path": str(s)} for s in order], **extra)
            dm.setup("fit")
            expected = alone[0] + alone[1] if order == sources else alone[1] + alone[0]
            assert list(dm.train_data) == expected
    assert expected[0]["prompt"] == [{"role": "user", "content": "sort 64:"}] and expected[4]["prompt"] == "42"


def rows_of_source(module, source: Path, **kw):
    dm = module(str(source), tokenizer="builtin:tiny", val_split=None, **kw)
    dm.setup("fit")
    return dm.train_data


def test_assistant_only_loss_drops_rows_cut_before_any_assistant_token(tokenizer, tmp_path, capfd, caplog):
    """With ``assistant_only_loss``, a conversation cut before its first assistant token has nothing to train on:
    it is dropped and counted (as a prompt/completion row cut before its completion), and the run trains on the
    rest; with no row left it is refused."""
    path = FORMATS / "ultrachat_200k.jsonl"
    conversations = [json.loads(line)["messages"] for line in path.read_text().splitlines()]
    starts = []  # where each conversation's first assistant turn starts, in tokens
    for messages in conversations:
        first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
        starts.append(len(tokenizer.apply_chat_template(messages[:first], add_generation_prompt=True)["input_ids"]))
    max_length = min(starts) + 1
    kept = sum(start < max_length for start in starts)
    assert 2 <= kept < len(conversations)
    only = ["--model.init_args.assistant_only_loss", "true"]
    code, _, err = run_main(fit("sft", tmp_path, path, *only, "--data.init_args.max_length", str(max_length)), capfd)
    assert code == 0, err
    assert f"{len(conversations) - kept} dropped (no assistant token left)" in caplog.text  # rank_zero_info
    assert f"lit_align: {kept} training rows from {path}" in caplog.text
    losses = [r["train/loss"] for r in read_metrics(tmp_path / "sft" / "run") if "train/loss" in r]
    assert len(losses) == 2 and all(math.isfinite(x) and x > 0 for x in losses)

    code, _, err = run_main(fit("sft", tmp_path / "none", path, *only, "--data.init_args.max_length",
                                str(min(starts))), capfd)
    assert_one_line_error(code, err, f"{path}: every row was dropped (no assistant token within "
                                     f"max_length={min(starts)})")
