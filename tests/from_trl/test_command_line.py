"""TRL's command-line syntax, as TRL's parser reads it (``trl dpo --config FILE --field value ...``)."""

import pytest
from helpers import assert_one_line_error, run_main

from lit_align.errors import LitAlignError
from lit_align.from_trl.command_line import command_line_fields


def test_flags_negations_dashes_and_values_typed_by_the_field():
    fields = command_line_fields(["--no_remove_unused_columns", "--gradient-accumulation-steps", "4", "--bf16", "no",
                                  "--use_peft", "--lora_target_modules", "all-linear", "--dataset_config", "2020",
                                  "--learning_rate=5e-7", "--max_steps", "None", "--model_init_kwargs",
                                  '{"revision": "v2"}'], "sft")
    assert fields == {"remove_unused_columns": False, "gradient_accumulation_steps": 4, "bf16": False,
                      "use_peft": True, "lora_target_modules": ["all-linear"], "dataset_config": "2020",
                      "learning_rate": 5e-7, "max_steps": None, "model_init_kwargs": {"revision": "v2"}}
    assert command_line_fields(["--reward_weights", "1", "0.5"], "grpo") == {"reward_weights": [1.0, 0.5]}
    # a field TRL does not have is typed by its text (and refused later, by name)
    assert command_line_fields(["--my_field", "3", "--other"], "dpo") == {"my_field": 3, "other": True}


@pytest.mark.parametrize("tokens, message", [
    (["--beta", "abc"], "--beta abc: expected a number"),
    (["--bf16", "maybe"], "--bf16 maybe: expected one of yes/no"),
    (["--beta", "0.1", "0.2"], "expected one value"),
    (["--no_remove_unused_columns", "x"], "takes no value"),
    (["stray"], "'stray' follows no --field"),
])
def test_what_trls_parser_refuses_is_refused(tokens, message):
    with pytest.raises(LitAlignError, match=message):
        command_line_fields(tokens, "dpo")


def test_trls_documented_qlora_command_line_translates(capfd):
    """TRL's documented QLoRA command (``--use_peft --load_in_4bit --lora_target_modules all-linear``): the one-item
    list is the string PEFT reads as every linear layer, as TRL's ModelConfig makes it."""
    code, out, err = run_main(["from-trl", "sft", "--model_name_or_path", "builtin:tiny", "--dataset_name",
                               "builtin:sort", "--use_peft", "--lora_r", "32", "--lora_alpha", "16",
                               "--lora_target_modules", "all-linear", "--load_in_4bit", "--dtype", "bfloat16"], capfd)
    assert code == 0, err
    import yaml

    model = yaml.safe_load(out)["model"]["init_args"]
    assert model["peft_config"] == {"r": 32, "lora_alpha": 16, "lora_dropout": 0.05, "target_modules": "all-linear"}
    assert model["model_init_kwargs"]["quantization_config"]["bnb_4bit_compute_dtype"] == "bfloat16"
    code, _, err = run_main(["from-trl", "dpo", "--beta", "abc"], capfd)
    assert_one_line_error(code, err, "--beta abc: expected a number")
