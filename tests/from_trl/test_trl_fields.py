"""TRL's table of fields (``lit_align/from_trl/trl_fields.json``) against the installed TRL's own parsers."""

from lit_align.from_trl import trl_fields


def test_the_table_is_the_installed_trls():
    """The file is what ``python -m lit_align.from_trl.trl_fields`` writes from the TRL the tests run with: a TRL
    upgrade that adds, removes or retypes a field fails here until the table is written again."""
    import json

    assert json.loads(trl_fields.FILE.read_text()) == trl_fields.read_installed()


def test_kinds_and_commands():
    assert trl_fields.fields("dpo")["beta"] == "float" and trl_fields.fields("grpo")["num_generations"] == "int"
    assert trl_fields.fields("sft")["remove_unused_columns"] == "bool!"  # TRL's default true: --no_ exists
    assert trl_fields.fields("grpo")["reward_weights"] == "list:float"
    assert trl_fields.fields("dpo")["dtype"] == ("choice", "auto", "bfloat16", "float16", "float32")
    assert "max_completion_length" not in trl_fields.fields("dpo")
    assert trl_fields.commands_with("num_generations") == ["grpo", "rloo"]
    assert trl_fields.commands_with("teacher_model_name_or_path") == ["distillation"]
