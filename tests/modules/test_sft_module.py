"""SFT: SFTModule's loss against hand computations and TRL, a short run that learns.

The rows and batches of CompletionDataModule: tests/data/test_completions_data.py.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from helpers import TOOL_ROW, fit, read_metrics

from lit_align.data.completions import CompletionDataModule, collate_completions, tokenize_completion
from lit_align.errors import LitAlignError
from lit_align.modules.sft import SFTModule, sft_token_stats
from numerics import TINY_TERMS, assert_rounding_close, formula


# -- the loss --------------------------------------------------------------------------------------------------------


class FixedLogits(torch.nn.Module):
    """A stand-in causal LM whose logits are a fixed ``[N, T, V]`` tensor (honours ``logits_to_keep``)."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.logits = torch.nn.Parameter(logits)

    def forward(self, input_ids, attention_mask=None, use_cache=None, logits_to_keep: int = 0):
        return SimpleNamespace(logits=self.logits[:, -logits_to_keep:] if logits_to_keep else self.logits)


def small_batch():
    """Two right-padded rows over a vocabulary of 5: prompt lengths 2 and 3, completion lengths 2 and 1."""
    return {
        "input_ids": torch.tensor([[1, 2, 3, 4, 0], [2, 2, 1, 4, 0]]),
        "attention_mask": torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 0]]),
        "completion_mask": torch.tensor([[0, 0, 1, 1, 0], [0, 0, 0, 1, 0]]),
    }


def hand_loss(logits: torch.Tensor, batch, positions) -> tuple[float, int]:
    """Mean of -log_softmax(logits[n, t - 1])[input_ids[n, t]] over ``positions`` (n, t), in float64, by hand."""
    terms = []
    for n, t in positions:
        row = [float(x) for x in logits[n, t - 1]]
        label = int(batch["input_ids"][n, t])
        terms.append(-(row[label] - math.log(sum(math.exp(x) for x in row))))
    return sum(terms) / len(terms), len(terms)


def test_sft_loss_equals_a_hand_computation():
    batch = small_batch()
    logits = torch.randn(2, 5, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)  # rule 2
    model = FixedLogits(logits)
    loss, correct, count, _ = sft_token_stats(model, batch, completion_only_loss=True)
    expected, n = hand_loss(logits, batch, [(0, 2), (0, 3), (1, 3)])  # the three completion tokens
    assert count == n == 3
    assert loss.item() == formula(expected)
    argmax_hits = sum(int(logits[i, t - 1].argmax() == batch["input_ids"][i, t]) for i, t in [(0, 2), (0, 3), (1, 3)])
    assert correct == argmax_hits
    loss.backward()  # the gradient reaches exactly the positions that predict completion tokens
    touched = (model.logits.grad.abs().sum(-1) > 0).tolist()
    assert touched == [[False, True, True, False, False], [False, False, True, False, False]]

    # completion_only_loss=False: every attended token but the first of each row
    loss, _, count, _ = sft_token_stats(model, batch, completion_only_loss=False)
    expected, n = hand_loss(logits, batch, [(0, 1), (0, 2), (0, 3), (1, 1), (1, 2), (1, 3)])
    assert count == n == 6
    assert loss.item() == formula(expected)


def test_prompt_tokens_are_masked_when_completion_only_loss():
    batch = small_batch()
    logits = torch.randn(2, 5, 5, generator=torch.Generator().manual_seed(1))
    scrambled = logits.clone()
    scrambled[0, 0] = torch.tensor([9.0, -9.0, 3.0, 0.0, 1.0])  # predicts prompt token 1 of row 0
    scrambled[1, :2] = torch.tensor([-5.0, 5.0, 0.0, 2.0, -1.0])  # predict prompt tokens of row 1
    scrambled[:, 4] = 100.0  # predicts nothing (last position)

    def loss(x, only):
        return sft_token_stats(FixedLogits(x), batch, only)[0].item()

    assert loss(scrambled, True) == loss(logits, True)
    assert loss(scrambled, False) != pytest.approx(loss(logits, False))


@pytest.mark.parametrize("completion_only, assistant_only, trained", [
    (True, True, ['<tool_call>{"name": "compute", "arguments": {}}</tool_call></s>', "6</s>"]),  # TRL: both masks
    (False, True, ["hello</s>", '<tool_call>{"name": "compute", "arguments": {}}</tool_call></s>', "6</s>"]),
    (True, False, ['<tool_call>{"name": "compute", "arguments": {}}</tool_call></s><|tool|>66666666\n<|assistant|>6</s>']),
])
def test_assistant_only_loss_trains_a_completions_assistant_turns_not_its_tool_turns(
        write_jsonl, tokenizer, completion_only, assistant_only, trained):
    """A prompt/completion row whose completion calls a tool (helpers.TOOL_ROW): with ``assistant_only_loss`` the
    loss is over the completion's two assistant turns, not the tool's result, not the prompt; every assistant turn
    without ``completion_only_loss``; the whole completion, the tool turn included, without ``assistant_only_loss``."""
    dm = CompletionDataModule(write_jsonl([TOOL_ROW]), tokenizer="builtin:tiny", chat_template="builtin:tools",
                              val_split=None, assistant_only_loss=assistant_only)
    dm.setup("fit")
    batch = dm.collate(list(dm.train_data))
    ids = batch["input_ids"][0].tolist()
    logits = torch.randn(1, len(ids), len(tokenizer), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    model = FixedLogits(logits)
    loss, _, count, _ = sft_token_stats(model, batch, completion_only, assistant_only_loss=assistant_only)
    loss.backward()
    predicting = model.logits.grad[0].abs().sum(-1) > 0  # position t - 1 predicts token t
    positions = [t for t in range(1, len(ids)) if predicting[t - 1]]
    runs = [[positions[0]]]
    for t in positions[1:]:
        runs[-1].append(t) if t == runs[-1][-1] + 1 else runs.append([t])
    assert [tokenizer.decode([ids[t] for t in run]) for run in runs] == trained
    expected, n = hand_loss(logits, batch, [(0, t) for t in positions])
    assert count == n == sum(len(tokenizer(text)["input_ids"]) for text in trained)
    assert loss.item() == formula(expected)


def test_assistant_only_loss_trains_the_positions_trl_trains(write_jsonl, tiny_path, tmp_path):
    """TRL's SFTTrainer on helpers.TOOL_ROW with ``assistant_only_loss`` (its assistant masks come from the chat
    template's generation markers: builtin:tools with them, the same text): the same ``input_ids`` and the same
    trained positions (labels != -100) as our ``loss_mask``, with and without ``completion_only_loss``."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    from lit_align.models import TOOL_CHAT_TEMPLATE, load_tokenizer
    from lit_align.modules.sft import loss_mask

    head, body = TOOL_CHAT_TEMPLATE.split("{%- for message in messages %}")
    calls = body[body.index("{%- for call"): body.index("{%- endfor %}") + len("{%- endfor %}")]
    marked = (head + "{%- for message in messages %}{{ '<|' + message['role'] + '|>' }}"
              "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] or '' }}" + calls +
              "{{ eos_token }}{% endgeneration %}{% else %}{{ message['content'] + '\\n' }}{% endif %}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
    dm = CompletionDataModule(write_jsonl([TOOL_ROW]), tokenizer="builtin:tiny", chat_template="builtin:tools",
                              val_split=None, assistant_only_loss=True)
    dm.setup("fit")
    batch = dm.collate(list(dm.train_data))
    tokenizer = load_tokenizer("builtin:tiny", chat_template=marked)
    assert tokenizer.apply_chat_template(TOOL_ROW["prompt"] + TOOL_ROW["completion"], tokenize=False,
                                         tools=json.loads(TOOL_ROW["tools"])) == tokenizer.decode(batch["input_ids"][0])
    for completion_only in (True, False):
        args = trl.SFTConfig(output_dir=str(tmp_path), max_length=256, report_to="none", use_cpu=True, bf16=False,
                             assistant_only_loss=True, completion_only_loss=completion_only)
        trainer = trl.SFTTrainer(model=tiny_path, args=args, train_dataset=Dataset.from_list([TOOL_ROW]),
                                 processing_class=tokenizer)
        theirs = trainer.train_dataset[0]
        assert theirs["input_ids"] == batch["input_ids"][0].tolist()
        assert [int(x != -100) for x in theirs["labels"]] == loss_mask(batch, completion_only, True)[0].tolist()


def test_sft_loss_equals_the_hf_labels_loss_on_the_tiny_model(write_jsonl, tiny_path):
    """The model's own cross-entropy (labels, -100 on ignored tokens) agrees, completion-only and on all tokens."""
    from transformers import AutoModelForCausalLM

    path = write_jsonl([{"prompt": f"sort {d}:", "completion": "".join(sorted(d))} for d in ("31", "96420", "7", "5151")])
    dm = CompletionDataModule(path, tokenizer="builtin:tiny", val_split=None, shuffle=False, batch_size=4)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    model = AutoModelForCausalLM.from_pretrained(tiny_path)
    for only in (True, False):
        keep = batch["completion_mask"] if only else batch["attention_mask"]
        labels = batch["input_ids"].masked_fill(keep == 0, -100)
        with torch.no_grad():
            reference = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels).loss
            loss, _, count, _ = sft_token_stats(model, batch, only)
        assert count == (labels[:, 1:] != -100).sum()
        assert_rounding_close(loss.item(), reference.item(), terms=TINY_TERMS)  # the same formula, other kernels


def test_tokens_loss_and_token_accuracy_match_trl_sft_trainer(tmp_path, tiny_path, tokenizer):
    """TRL's SFTTrainer on the same rows: the same input_ids, the same trained positions (labels != -100), the same
    loss from its own compute_loss and the same mean_token_accuracy."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    from lit_align.data.tasks import SortTask

    chat = [{"role": "user", "content": "sort 31:"}]
    cases = [
        (SortTask().completion_rows("train").select(range(8)), False),
        (Dataset.from_list([{"prompt": chat, "completion": [{"role": "assistant", "content": "13"}]}]), True),
    ]
    for i, (rows, conversational) in enumerate(cases):
        args = trl.SFTConfig(output_dir=str(tmp_path / str(i)), max_length=64, report_to="none", use_cpu=True,
                             bf16=False)
        trainer = trl.SFTTrainer(model=tiny_path, args=args, train_dataset=rows, processing_class=tokenizer)
        ours = [tokenize_completion(tokenizer, r["prompt"], r["completion"], conversational) for r in rows]
        theirs = list(trainer.train_dataset)
        assert [r["input_ids"] for r in theirs] == [r["input_ids"] for r in ours]
        assert [[int(x != -100) for x in r["labels"]] for r in theirs] == [r["completion_mask"] for r in ours]

    # the loss and token accuracy on the 8 standard rows, one batch, TRL's collator and compute_loss vs ours
    rows = cases[0][0]
    trainer = trl.SFTTrainer(model=tiny_path, args=args, train_dataset=rows, processing_class=tokenizer)
    trainer.model.eval()
    batch = trainer.data_collator([{k: r[k] for k in ("input_ids", "labels")} for r in trainer.train_dataset])
    ours = collate_completions([tokenize_completion(tokenizer, r["prompt"], r["completion"], False) for r in rows],
                               tokenizer.pad_token_id)
    with torch.no_grad():
        expected = trainer.compute_loss(trainer.model, batch).item()
        loss, correct, count, entropy = sft_token_stats(trainer.model, ours)
    assert_rounding_close(loss.item(), expected, terms=TINY_TERMS)
    assert (correct / count).item() == pytest.approx(trainer._metrics["eval"]["mean_token_accuracy"][-1], rel=1e-6)
    assert_rounding_close((entropy / count).item(), trainer._metrics["eval"]["entropy"][-1], terms=TINY_TERMS)


# -- a short run -------------------------------------------------------------------------------------------------------


def test_short_sft_run_lowers_the_loss(tmp_path, tiny_path):
    """40 steps from scratch on the built-in task: the completion loss falls from about ln(vocab) to about 1."""
    L.seed_everything(0)
    module = SFTModule("builtin:tiny", learning_rate=3e-3, warmup_steps=5, val_exact_match=True, val_max_new_tokens=8)
    data = CompletionDataModule("builtin:sort", batch_size=32, val_batch_size=100, max_length=64)
    fit(module, data, tmp_path, max_steps=40, val_check_interval=40, limit_val_batches=1,
        logger=L.pytorch.loggers.CSVLogger(tmp_path, name="sft"))
    rows = read_metrics(tmp_path / "sft" / "version_0" / "metrics.csv")
    train = {int(r["step"]): r for r in rows if "train/loss" in r}
    first, last = train[0]["train/loss"], train[39]["train/loss"]
    assert first == pytest.approx(math.log(len(module.tokenizer)), abs=0.25)  # a random model: about ln(104) = 4.64
    assert last < 1.3 and last < 0.3 * first  # measured: 4.56 -> 1.08
    assert train[39]["train/mean_token_accuracy"] > 0.55 > 0.2 > train[0]["train/mean_token_accuracy"]  # 0.06 -> 0.69
    # a random model predicts nearly uniform distributions (entropy ~ ln V); a trained one, sharper ones
    assert train[39]["train/entropy"] < 0.5 * train[0]["train/entropy"] < math.log(len(module.tokenizer))
    # 32 rows of ~17 tokens per step, counted cumulatively
    assert train[0]["train/num_tokens"] < train[1]["train/num_tokens"] < train[39]["train/num_tokens"]
    val = next(r for r in rows if "val/loss" in r)
    assert val["val/loss"] < 1.3  # measured: 1.02
    assert 0.55 < val["val/mean_token_accuracy"] <= 1.0  # measured: 0.67
    assert 0.0 < val["val/entropy"] < 0.5 * train[0]["train/entropy"]
    assert 0.0 <= val["val/exact_match"] <= 1.0


class PoisonAtBatch(L.Callback):
    """Before batch 1, NaN in the final norm: every row's loss is NaN (what a diverging run or bad weights give)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 1:
            self.dataset_rows = sorted(set(batch["dataset_rows"].tolist()))
            pl_module.policy.model.norm.weight.data.fill_(math.nan)


@pytest.mark.parametrize("packing", [False, True])
def test_a_nonfinite_loss_names_the_batchs_dataset_rows(tmp_path, write_jsonl, packing):
    """SFT's loss is a token mean (no per-row losses): the guard names every dataset row of the batch, packed or not."""
    path = write_jsonl([{"prompt": f"sort {i}{i + 3}:", "completion": f" {i}{i + 3}"} for i in range(12)])
    data = CompletionDataModule(path, tokenizer="builtin:tiny", val_split=None, batch_size=4 if not packing else 2,
                                shuffle=False, max_length=32, packing=packing)
    poison = PoisonAtBatch()
    with pytest.raises(LitAlignError) as error:
        fit(SFTModule(model="builtin:tiny"), data, tmp_path, max_steps=2, callbacks=[poison])
    assert str(error.value) == (f"non-finite training loss (nan) at step 1, batch 1 (dataset rows "
                                f"{poison.dataset_rows}); nothing was updated (set model.on_nonfinite_loss: skip to "
                                "skip such batches)")
    if not packing:
        assert poison.dataset_rows == [4, 5, 6, 7]


def test_an_eos_token_ends_the_rows_and_the_exported_model_stops_there(tmp_path, write_jsonl, capfd):
    """TRL's SFT ``eos_token``: every standard completion ends with it instead of the tokenizer's EOS; the model's
    config and generation config and the exported tokenizer carry it; a token the tokenizer lacks is one line."""
    import yaml
    from helpers import assert_one_line_error, run_main

    from lit_align.cli import run

    path = write_jsonl([{"prompt": "sort 21:", "completion": "12"}] * 4)
    config = tmp_path / "sft.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"class_path": "lit_align.modules.SFTModule", "init_args": {"eos_token": "<|assistant|>"}},
        "data": {"class_path": "lit_align.data.CompletionDataModule",
                 "init_args": {"path": path, "val_split": None, "batch_size": 2}},
        "trainer": {"max_steps": 1, "logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
                    "default_root_dir": str(tmp_path / "run")},
        "export": {"path": str(tmp_path / "out")}}))
    cli = run(["fit", "-c", str(config)])
    eos = cli.model.tokenizer.convert_tokens_to_ids("<|assistant|>")
    row = cli.datamodule.train_data[0]
    assert row["input_ids"][-1] == eos and cli.datamodule.tokenizer.eos_token == "<|assistant|>"
    assert cli.model.policy.config.eos_token_id == eos and cli.model.policy.generation_config.eos_token_id[0] == eos
    exported = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert exported["eos_token"] == "<|assistant|>"
    code, _, err = run_main(["fit", "-c", str(config), "--model.init_args.eos_token", "<|nope|>"], capfd)
    assert_one_line_error(code, err, "eos_token '<|nope|>' is not a token of tokenizer")
