"""``lit_align.generation.vllm`` without vLLM installed: the engine's options (TRL's flat ``vllm_*`` names), their
routing from the module and their checks. What needs vLLM itself runs in ``tests/vllm_engine`` (``make test-vllm``)."""

from __future__ import annotations

import socket
import sys
import time
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from helpers import assert_one_line_error, run_main
from lit_align.errors import LitAlignError
from lit_align.generation import SamplingConfig, VLLMEngine, VLLMOptions
from lit_align.generation.vllm_server import ServerSettings, server_weights
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
                                         "structured_outputs_regex": None, "server": None}
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
    ({"mode": "remote"}, "model.vllm_mode 'remote': expected 'colocate' or 'server'"),
    ({"mode": "server", "enable_sleep_mode": True}, "model.vllm_enable_sleep_mode is for vllm_mode 'colocate'"),
    ({"mode": "server", "server_port": 0}, r"model.vllm_server_port must be a port \(1-65535\), got 0"),
    ({"mode": "server", "server_timeout": -1}, "model.vllm_server_timeout must be >= 0 seconds"),
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
                             "remote", "--trainer.default_root_dir", str(tmp_path)], capfd)
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == "error: model.vllm_mode 'remote': expected 'colocate' or 'server'"


def test_a_server_that_does_not_answer_is_one_error_line(capfd, tmp_path):
    """``vllm_mode: server`` needs no vLLM in the trainer's environment; a server that does not answer ``/health``
    within ``vllm_server_timeout`` is one ``error:`` line naming the URL and the option."""
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    code, _, err = run_main(["fit", "-c", str(REPO / "configs" / "grpo.yaml"), "--model.init_args.model",
                             "builtin:tiny", "--model.init_args.engine", "vllm", "--model.init_args.vllm_mode",
                             "server", "--model.init_args.vllm_server_port", str(port),
                             "--model.init_args.vllm_server_host", "127.0.0.1",
                             "--model.init_args.vllm_server_timeout", "1", "--trainer.max_steps", "1",
                             "--trainer.default_root_dir", str(tmp_path), "--trainer.logger", "false"], capfd)
    line = assert_one_line_error(code, err, f"no vLLM server answered at http://127.0.0.1:{port}/health within 1 s",
                                 "model.vllm_server_timeout")
    assert line.startswith("error: model.vllm_mode 'server'")
    assert time.monotonic() - started < 60


def test_server_options_make_the_url_as_trl():
    assert VLLMOptions(mode="server").engine_settings()["server"] == ServerSettings("http://0.0.0.0:8000", 240.0,
                                                                                   51216)
    settings = VLLMOptions(mode="server", server_base_url="http://h:1/", server_port=9).engine_settings()["server"]
    assert settings.base_url == "http://h:1"
    assert VLLMOptions().engine_settings()["server"] is None


def test_the_server_gets_a_tied_head_as_its_own_weight():
    embed = torch.randn(4, 2)
    weights = server_weights([("model.embed_tokens.weight", embed)], tied_head=True)
    assert torch.equal(weights["lm_head.weight"], embed)
    assert weights["lm_head.weight"].data_ptr() != weights["model.embed_tokens.weight"].data_ptr()
    assert list(server_weights([("model.embed_tokens.weight", embed)], tied_head=False)) == [
        "model.embed_tokens.weight"]


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
