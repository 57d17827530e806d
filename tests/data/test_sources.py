"""lit_align.data.sources: where rows come from (built-in tasks, local files, ``datasets`` names) and one error
style for every way that fails. Through ``lit-align fit`` for the mistakes a user meets first."""

from __future__ import annotations

import json
import random
from pathlib import Path

import datasets
import pytest
from helpers import assert_one_line_error, run_main

from lit_align.data.base import DataSource
from lit_align.data.sources import check_mixture, common_features, load_rows
from lit_align.errors import LitAlignError
from lit_align.models import load_tokenizer

DPO = str(Path(__file__).resolve().parents[2] / "configs" / "dpo.yaml")


def test_local_files_of_each_type_load_and_csv_text_stays_text(tmp_path):
    rows = [{"prompt": "sort 0012:", "answer": "0012"}, {"prompt": "sort 31:", "answer": "13"}]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "a.json").write_text(json.dumps(rows))
    (tmp_path / "a.csv").write_text("prompt,answer\nsort 0012:,0012\nsort 31:,13\n")
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "a.parquet"))
    for name in ("a.jsonl", "a.json", "a.csv", "a.parquet"):
        assert load_rows(str(tmp_path / name), "train", "prompt").to_list() == rows, name  # "0012", not 12


def test_a_builtin_task_gives_the_rows_of_its_kind():
    pairs = load_rows("builtin:sort", "train", "preference")
    assert {"prompt", "chosen", "rejected"} <= set(pairs.column_names) and len(pairs) > 0
    assert pairs[0]["chosen"] != pairs[0]["rejected"]
    prompts = load_rows("builtin:sort", "train", "prompt")
    assert {"prompt", "answer"} <= set(prompts.column_names)


@pytest.mark.parametrize("source, split, message", [
    ("builtin:nope", "train", "unknown built-in task 'builtin:nope': expected one of ['builtin:sort', 'builtin:arith', "
                              "'builtin:arith-words', 'builtin:modsum', 'builtin:calculator']"),
    ("builtin:sort", "dev", "builtin:sort: no split 'dev' (expected one of"),
    ("{tmp}/rows.txt", "train", "{tmp}/rows.txt: unsupported file type (expected one of ['.csv', '.json', "
                                "'.jsonl', '.parquet'])"),
    ("{tmp}/rows.jsonl", "test", "{tmp}/rows.jsonl: a single file has one split, 'train', not 'test'"),
    ("{tmp}/empty.jsonl", "train", "{tmp}/empty.jsonl: the file is empty"),
    ("{tmp}/mixed.jsonl", "train", "{tmp}/mixed.jsonl row 1: field 'answer' is a number, but row 0's is a string "
                                   "(a column must have one type)"),
    ("./no/such/dir", "train", "./no/such/dir: no such file or directory"),
])
def test_a_source_that_cannot_be_read_is_one_error_naming_it(tmp_path, source, split, message):
    (tmp_path / "rows.txt").write_text("prompt\n")
    (tmp_path / "rows.jsonl").write_text('{"prompt": "a"}\n')
    (tmp_path / "empty.jsonl").write_text("\n\n")
    (tmp_path / "mixed.jsonl").write_text('{"prompt": "a", "answer": "13"}\n{"prompt": "b", "answer": 13}\n')
    with pytest.raises(LitAlignError) as info:
        load_rows(source.format(tmp=tmp_path), split, "prompt")
    assert str(info.value).startswith(message.format(tmp=tmp_path))


def test_a_mixture_needs_sources_with_positive_finite_weights():
    with pytest.raises(LitAlignError, match="data.mixture is empty"):
        check_mixture(None, [], [])
    with pytest.raises(LitAlignError, match="data.path is null and there is no data.mixture"):
        check_mixture(None, None, [])
    with pytest.raises(LitAlignError) as info:
        check_mixture(None, [{}, {}], [DataSource("a.jsonl"), DataSource("b.jsonl", weight=float("nan"))])
    assert str(info.value) == "data.mixture[1] (b.jsonl): weight is nan, expected a finite number > 0"
    check_mixture("a.jsonl", None, [])  # a path alone is fine


def test_mixture_sources_get_one_set_of_features_in_either_order():
    """Ints and floats unify as floats, a column of nulls takes the other's type, strings and messages become JSON."""
    plain = datasets.Dataset.from_list([{"prompt": "p", "score": 1, "note": None}])
    chat = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": "p"}], "score": 0.5, "note": "n"}])
    for parts in ([plain, chat], [chat, plain]):
        unified = common_features(parts)
        assert unified[0].features == unified[1].features
        assert unified[0].features["score"].dtype == "float64" and unified[0].features["note"].dtype == "string"
        assert isinstance(unified[0].features["prompt"], datasets.Json)
    first, second = common_features([plain, chat])
    assert first[0]["prompt"] == "p" and second[0]["prompt"] == [{"role": "user", "content": "p"}]
    assert first[0]["score"] == 1.0 and first[0]["note"] is None


def test_garbage_data_file(tmp_path, capfd):
    path = tmp_path / "garbage.jsonl"
    path.write_bytes(random.Random(0).randbytes(256).replace(b"\n", b"x"))
    code, _, err = run_main([
        "fit", "-c", DPO, "--data.init_args.path", str(path), "--data.init_args.val_split", "null",
        "--trainer.logger.init_args.save_dir", str(tmp_path),
    ], capfd)
    assert_one_line_error(code, err, str(path), "line 1: not valid UTF-8")


def test_nonexistent_data_file(tmp_path, capfd):
    path = tmp_path / "missing.jsonl"
    code, _, err = run_main(["fit", "-c", DPO, "--data.init_args.path", str(path),
                             "--trainer.logger.init_args.save_dir", str(tmp_path)], capfd)
    assert_one_line_error(code, err, f"error: {path}: no such file")
    path.mkdir()  # a directory named like a data file
    code, _, err = run_main(["fit", "-c", DPO, "--data.init_args.path", str(path),
                             "--trainer.logger.init_args.save_dir", str(tmp_path)], capfd)
    assert_one_line_error(code, err, f"error: {path}: a directory, not a data file")


def test_a_sources_fraction_keeps_that_share_of_it_seeded_and_a_whole_val_fraction_counts_rows(tmp_path):
    """A recipe's mixture weight (``fraction``): the first rows of a shuffle seeded by data.seed, the same each run;
    a ``val_fraction`` from 1 up holds out that many rows (TRL's test_split_size as a count)."""
    from lit_align.data import PromptDataModule

    path = tmp_path / "p.jsonl"
    path.write_text("".join(f'{{"prompt": "sort {i:02d}:"}}\n' for i in range(20)))
    kept = []
    for _ in range(2):
        dm = PromptDataModule(path=None, mixture=[{"path": str(path), "fraction": 0.25}, {"path": str(path)}],
                              val_split=None, tokenizer="builtin:tiny", seed=3, val_fraction=4)
        dm.setup("fit")
        kept.append(len(dm.train_data) + len(dm.val_data))
        assert len(dm.val_data) == 4
    assert kept == [25, 25]  # 5 of the first source, 20 of the second
    with pytest.raises(LitAlignError, match=r"data.mixture\[0\] \(a\): fraction is 1.5, expected a share in \(0, 1\]"):
        check_mixture(None, [{}], [DataSource("a", fraction=1.5)])
    with pytest.raises(LitAlignError, match="data.val_fraction must be in \\[0, 1\\) or a whole number of rows"):
        PromptDataModule(val_fraction=2.5)


def test_a_sources_columns_are_the_ones_kept_so_rows_read_in_the_format_they_name(tmp_path):
    """TRL's DatasetConfig.columns: a recipe that keeps ``messages`` of rows that also have ``text`` trains on the
    conversation (its chat template), not on the text a row with both columns reads as."""
    from lit_align.data import CompletionDataModule

    row = {"text": "sort 21: 12", "messages": [{"role": "user", "content": "sort 21:"},
                                               {"role": "assistant", "content": "12"}]}
    path = tmp_path / "rows.jsonl"
    path.write_text((json.dumps(row) + "\n") * 4)

    def first_row(columns):
        dm = CompletionDataModule(path=None, mixture=[{"path": str(path), "columns": columns}], val_split=None,
                                  tokenizer="builtin:tiny")
        dm.setup("fit")
        return dm.train_data[0]["input_ids"]

    tokenizer = load_tokenizer("builtin:tiny")
    chat = tokenizer.apply_chat_template(row["messages"], tokenize=False)
    assert first_row(["messages"]) == tokenizer(chat, add_special_tokens=False)["input_ids"]  # the template ends it
    assert first_row(None) != first_row(["messages"])
    with pytest.raises(LitAlignError, match=r"data.mixture\[0\] .*: no column\(s\) \['prompt'\] to keep"):
        first_row(["prompt"])
