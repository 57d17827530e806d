"""``lit_align.generation.vllm`` without vLLM installed: the engine's options (TRL's flat ``vllm_*`` names), their
routing from the module and their checks. What needs vLLM itself runs in ``tests/vllm_engine`` (``make test-vllm``)."""

from __future__ import annotations

import sys
from dataclasses import fields
from pathlib import Path

import pytest

from helpers import run_main
from lit_align.errors import LitAlignError
from lit_align.generation import SamplingConfig, VLLMEngine, VLLMOptions
from lit_align.modules.grpo import GRPOModule

REPO = Path(__file__).resolve().parents[2]


def test_trls_flat_options_in_a_config_reach_the_engines_options(tiny_path):
    """``model.init_args.vllm_<name>`` in a config, as in TRL, is ``VLLMOptions.<name>`` (the engine checks it)."""
    from lit_align.cli import AlignCLI
    from lit_align.data import AlignDataModule
    from lit_align.modules import AlignModule

    argv, sys.argv = sys.argv, ["lit-align"]
    try:  # engine hf: the options are parsed and kept, the vLLM engine is not built
        cli = AlignCLI(AlignModule, AlignDataModule, subclass_mode_model=True, subclass_mode_data=True, run=False,
                       auto_configure_optimizers=False,
                       args=["-c", str(REPO / "configs" / "grpo.yaml"), "--model.init_args.model", "builtin:tiny",
                             "--model.init_args.vllm_gpu_memory_utilization", "0.5",
                             "--model.init_args.vllm_max_model_length", "256",
                             "--model.init_args.vllm_importance_sampling_mode", "token_mask"])
    finally:
        sys.argv = argv
    options = VLLMOptions.from_flat(cli.model.hparams)
    assert options == VLLMOptions(gpu_memory_utilization=0.5, max_model_length=256,
                                  importance_sampling_mode="token_mask")
    assert options.engine_settings() == {"gpu_memory_utilization": 0.5, "tensor_parallel_size": 1,
                                         "max_model_length": 256, "enable_sleep_mode": False,
                                         "structured_outputs_regex": None}
    assert options.importance_sampling(SamplingConfig()) == ("token_mask", None, 3.0)
    assert VLLMOptions(importance_sampling_correction=False).importance_sampling(SamplingConfig(top_k=5)) is None


def test_every_option_has_its_flat_name_on_the_module_with_the_engines_default():
    """The module's signature (the CLI) offers each option under its TRL name, defaulting as the engine does; the
    resume rules name them the same way."""
    from lit_align.hub import recipe_defaults

    module = recipe_defaults(GRPOModule)
    for option in fields(VLLMOptions):
        assert module[f"vllm_{option.name}"] == option.default, option.name
    may_change = GRPOModule.may_change_on_resume()
    assert {name for name in may_change if name.startswith("vllm_")} <= {f"vllm_{o.name}" for o in fields(VLLMOptions)}
    assert {"engine", "num_generations_eval", "vllm_gpu_memory_utilization"} <= set(may_change)


@pytest.mark.parametrize("options,match", [
    ({"mode": "server"}, "model.vllm_mode 'server': only 'colocate'"),
    ({"gpu_memory_utilization": 0.0}, r"model.vllm_gpu_memory_utilization must be in \(0, 1\], got 0.0"),
    ({"tensor_parallel_size": 2}, "model.vllm_tensor_parallel_size 2: only 1"),
    ({"importance_sampling_mode": "tokens"}, "model.vllm_importance_sampling_mode 'tokens'"),
])
def test_the_engine_checks_its_options_by_their_flat_names(options, match):
    with pytest.raises(LitAlignError, match=match):
        VLLMOptions(**options)
    for changed in ({"top_p": 0.9}, {"min_p": 0.1}, {"repetition_penalty": 1.2}, {"generation_kwargs": {"seed": 1}}):
        with pytest.raises(LitAlignError, match="needs vLLM's sampling log-probs"):
            VLLMOptions().importance_sampling(SamplingConfig(**changed))


def test_the_engine_checks_its_options_before_importing_vllm(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # no vLLM: the option's error comes first
    with pytest.raises(LitAlignError, match="model.vllm_gpu_memory_utilization must be in"):
        VLLMEngine(gpu_memory_utilization=1.5)


def test_an_option_set_wrong_for_the_vllm_engine_is_one_error_line(capfd, tmp_path):
    code, _, err = run_main(["fit", "-c", str(REPO / "configs" / "grpo.yaml"), "--model.init_args.model",
                             "builtin:tiny", "--model.init_args.engine", "vllm", "--model.init_args.vllm_mode",
                             "server", "--trainer.default_root_dir", str(tmp_path)], capfd)
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == ("error: model.vllm_mode 'server': only 'colocate' is supported (server "
                                            "mode is not)")


def test_sampling_options_translate_to_vllms_sampling_params():
    """TRL's translation: lit_align's settings, ``generation_kwargs`` over them, the structured-outputs regex last;
    log-probs only where they are the trainer's (no filter, penalty or other keyword)."""
    from lit_align.generation.vllm import sampling_params

    plain = sampling_params(SamplingConfig(max_new_tokens=7, temperature=0.9), 4, [2], 11)
    assert plain == {"n": 4, "temperature": 0.9, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                     "max_tokens": 7, "logprobs": 0, "stop_token_ids": [2], "ignore_eos": True, "detokenize": False,
                     "seed": 11}
    config = SamplingConfig(min_p=0.1, repetition_penalty=1.2,
                            generation_kwargs={"top_p": 0.5, "structured_outputs": {"json": "{}"}})
    params = sampling_params(config, 2, [2], None, structured_outputs_regex=r"\d+")
    assert params["min_p"] == 0.1 and params["repetition_penalty"] == 1.2 and params["logprobs"] is None
    assert params["top_p"] == 0.5  # generation_kwargs override lit_align's settings
    assert params["structured_outputs"] == {"regex": r"\d+"}  # the regex takes precedence, as in TRL
    with pytest.raises(LitAlignError, match=r"model.vllm_structured_outputs_regex '\[': not a regular expression"):
        VLLMOptions(structured_outputs_regex="[")
