"""Built-in models and tokenizer; loading errors."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lit_align.errors import LitAlignError
from lit_align.models import (
    BUILTIN_MODELS, CHARACTERS, SPECIAL_TOKENS, build_builtin, build_tokenizer, cache_dir, load_model, load_tokenizer,
    resolve,
)


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_builtin_tiny_is_deterministic_and_loads_with_auto_classes(tmp_path):
    rng_before = torch.random.get_rng_state()
    a, b, c = (build_builtin("tiny", tmp_path / n, seed=s) for n, s in (("a", 0), ("b", 0), ("c", 1)))
    assert torch.equal(torch.random.get_rng_state(), rng_before)  # the global RNG is left alone

    model_a = AutoModelForCausalLM.from_pretrained(a)
    model_b = AutoModelForCausalLM.from_pretrained(b)
    model_c = AutoModelForCausalLM.from_pretrained(c)
    state_a, state_b, state_c = _state(model_a), _state(model_b), _state(model_c)
    assert state_a.keys() == state_b.keys()
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    assert not torch.equal(state_a["model.embed_tokens.weight"], state_c["model.embed_tokens.weight"])

    cfg = model_a.config
    assert cfg.model_type == "llama"
    assert (cfg.hidden_size, cfg.num_hidden_layers) == (BUILTIN_MODELS["tiny"]["hidden_size"], 4)
    assert cfg.vocab_size == len(SPECIAL_TOKENS) + len(CHARACTERS) == 104
    n_params = sum(p.numel() for p in model_a.parameters())
    assert 0.5e6 < n_params < 1.2e6  # "about 0.8M"

    tok = AutoTokenizer.from_pretrained(a)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert cfg.eos_token_id == tok.eos_token_id and cfg.pad_token_id == tok.pad_token_id


def test_resolve_builds_once_in_lit_align_cache(tiny_path, lit_align_cache):
    assert cache_dir() == lit_align_cache
    assert Path(tiny_path) == lit_align_cache / "builtin" / "tiny"
    weights = next(Path(tiny_path).glob("*.safetensors"))
    mtime = weights.stat().st_mtime_ns
    assert resolve("builtin:tiny") == tiny_path
    assert weights.stat().st_mtime_ns == mtime  # not rebuilt
    assert not [p for p in (lit_align_cache / "builtin").iterdir() if p.name.startswith(".")]  # no staging leftovers
    # and it is the seed-0 build
    built = AutoModelForCausalLM.from_pretrained(tiny_path).state_dict()
    assert resolve("/some/dir") == "/some/dir"  # anything else passes through
    fresh = AutoModelForCausalLM.from_pretrained(build_builtin("tiny", lit_align_cache / "check", seed=0)).state_dict()
    assert all(torch.equal(built[k], fresh[k]) for k in built)


@pytest.mark.parametrize(
    "text",
    ["sort 3914:1349", "Hello, World!\tx = {a: [1, 2]} ~ `q` \"quoted\" 'single' \\ back\nnew line"],
)
def test_tokenizer_round_trips_text(tokenizer, text):
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == len(text)  # one id per character, no BOS added
    assert tokenizer.decode(ids) == text


def test_tokenizer_ids_and_specials(tokenizer):
    # specials first, then string.printable order: '0' is 7, 'a' is 17, ' ' is 101, '\n' is 103
    assert tokenizer("sort 31:")["input_ids"] == [35, 31, 34, 36, 101, 10, 8, 84]
    assert tokenizer("\n")["input_ids"] == [103]
    assert tokenizer.convert_tokens_to_ids(["<pad>", "<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>"]) == [
        0, 1, 2, 3, 5, 6,
    ]
    assert tokenizer("é")["input_ids"] == [tokenizer.unk_token_id]
    assert tokenizer("ab</s>")["input_ids"] == [17, 18, 2]  # the EOS string is one special token
    assert tokenizer.decode([17, 18, 2], skip_special_tokens=True) == "ab"


def test_builtin_chat_template(tokenizer):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ab"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == "<|user|>hi\n<|assistant|>ab</s>"
    assert tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True) == (
        "<|user|>hi\n<|assistant|>"
    )


def test_load_model_builtin(tiny_path):
    model = load_model("builtin:tiny")
    assert next(model.parameters()).dtype == torch.float32
    reference = AutoModelForCausalLM.from_pretrained(tiny_path).state_dict()
    assert all(torch.equal(v, reference[k]) for k, v in model.state_dict().items())
    assert next(load_model("builtin:tiny", dtype="bfloat16").parameters()).dtype == torch.bfloat16


def test_hub_kernels_are_off_unless_asked_for():
    """transformers kernelizes by default when ``kernels`` is installed: on a GPU the first ``train()`` fetched
    kernels from the Hub (an offline run stopped there). Off by default; ``model_init_kwargs`` turns it on."""
    model = load_model("builtin:tiny")
    assert model.use_kernels is False and model.kernels_mode is None
    assert load_model("builtin:tiny", model_init_kwargs={"use_kernels": True}).use_kernels is True


def test_load_tokenizer_adds_pad_token_when_missing(tmp_path):
    tok = build_tokenizer()
    tok.pad_token = None
    tok.save_pretrained(tmp_path / "nopad")
    assert AutoTokenizer.from_pretrained(tmp_path / "nopad").pad_token is None
    loaded = load_tokenizer(str(tmp_path / "nopad"))
    assert loaded.pad_token == "</s>" and loaded.pad_token_id == loaded.eos_token_id == 2


@pytest.mark.parametrize("loader,what", [(load_model, "model"), (load_tokenizer, "tokenizer")])
@pytest.mark.parametrize("path", ["/nonexistent/lit_align/model", "./no/such/dir", "~/no-such-lit-align-model"])
def test_unknown_local_path_names_the_path(loader, what, path):
    with pytest.raises(LitAlignError) as info:
        loader(path)
    message = str(info.value)
    assert message.startswith(f"{what} {path!r}: no such directory")
    assert "\n" not in message


def test_a_file_given_as_a_model_says_so(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    with pytest.raises(LitAlignError, match=r"model '.*model.safetensors' is a file, not a model: give the "
                                            r"directory that holds it"):
        load_model(str(weights))


def test_directory_that_is_not_a_model(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(LitAlignError, match=rf"could not load model '{tmp_path}': ") as info:
        load_model(str(tmp_path))
    assert "\n" not in str(info.value)


def test_a_classifier_with_another_number_of_labels_is_refused_as_a_reward_model(tmp_path, tiny_path):
    """A reward model has one output: a causal LM gets a new one-output head, a 2-label classifier (e.g. a sentiment
    model) is refused in one line instead of transformers' size mismatch that points at a log."""
    from transformers import AutoModelForSequenceClassification

    AutoModelForSequenceClassification.from_pretrained(tiny_path, num_labels=2).save_pretrained(tmp_path / "cls2")
    with pytest.raises(LitAlignError) as info:
        load_model(str(tmp_path / "cls2"), model_init_kwargs={"num_labels": 1},
                   auto_class=AutoModelForSequenceClassification)
    assert str(info.value) == (f"model '{tmp_path / 'cls2'}' is a sequence classifier with 2 labels, not 1 (a reward "
                               "model has one output: give a causal LM, which gets a new head, or a classifier with "
                               "one label)")
    head = load_model(tiny_path, model_init_kwargs={"num_labels": 1}, auto_class=AutoModelForSequenceClassification)
    assert head.score.out_features == 1


def test_a_directory_without_a_tokenizer_says_what_it_lacks(tmp_path, tiny_path):
    """transformers' message runs over several lines; the error keeps all of it on one."""
    import shutil

    shutil.copy(Path(tiny_path) / "config.json", tmp_path / "config.json")
    with pytest.raises(LitAlignError) as info:
        load_tokenizer(str(tmp_path))
    message = str(info.value)
    assert "\n" not in message and "from one of: (1)" in message and not message.endswith("one of:")


def test_unknown_hub_name_offline_is_one_line_error():
    assert os.environ["HF_HUB_OFFLINE"] == "1"  # set by conftest: no network, fails fast
    with pytest.raises(LitAlignError, match="could not load tokenizer 'no-such-org/no-such-model': ") as info:
        load_tokenizer("no-such-org/no-such-model")
    assert "\n" not in str(info.value)


def test_bad_builtin_name_and_dtype():
    with pytest.raises(LitAlignError) as info:
        resolve("builtin:huge")
    assert str(info.value) == "unknown built-in model builtin:huge: expected one of ['small', 'tiny']"
    with pytest.raises(LitAlignError) as info:
        load_model("builtin:tiny", dtype="float8")
    assert str(info.value) == "model.dtype 'float8': expected one of float32, bfloat16, float16, auto (or null: float32)"


def test_a_null_dtype_is_float32_and_model_init_kwargs_set_it_as_in_trl():
    """TRL: ``dtype: null`` (or not set) is float32; ``model_init_kwargs`` carries the dtype as ``dtype`` or its older
    name ``torch_dtype`` (null there: not set) and wins over ``model.dtype``'s default."""
    from lit_align.models import from_pretrained_kwargs

    for dtype, kwargs, expected in [
        (None, None, torch.float32), (None, {"dtype": None}, torch.float32),
        ("float32", {"torch_dtype": None, "max_position_embeddings": 1024}, torch.float32),
        ("float32", {"torch_dtype": "bfloat16"}, torch.bfloat16), (None, {"dtype": "float16"}, torch.float16),
        ("bfloat16", {"dtype": "bfloat16", "torch_dtype": "bfloat16"}, torch.bfloat16),
        ("float64", None, torch.float64),  # any floating torch dtype by name (the numerics tests' fp64)
    ]:
        model = load_model("builtin:tiny", dtype=dtype, model_init_kwargs=kwargs)
        assert {p.dtype for p in model.parameters()} == {expected}, (dtype, kwargs)
    assert from_pretrained_kwargs({"torch_dtype": None, "revision": "main"}) == {"revision": "main"}
    with pytest.raises(LitAlignError) as info:
        from_pretrained_kwargs({"dtype": "bfloat16", "torch_dtype": "float16"}, "model.teacher_model_init_kwargs")
    assert str(info.value) == ("model.teacher_model_init_kwargs: dtype 'bfloat16' and torch_dtype 'float16' disagree "
                               "(torch_dtype is the older name of dtype: give one)")
    with pytest.raises(LitAlignError) as info:
        from_pretrained_kwargs({"dtype": "torch.float16"})
    assert str(info.value) == ("model.model_init_kwargs.dtype 'torch.float16': expected one of float32, bfloat16, "
                               "float16, auto (or null: float32)")


def _build_on_rank(rank: int, world: int, init_file: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        build_builtin("tiny", Path(out) / f"rank{rank}")
    finally:
        dist.destroy_process_group()


def test_builtin_builds_complete_on_every_rank_under_torch_distributed(tmp_path, tiny_path):
    """Every DDP rank may build the built-in model (each into its own staging directory): a build on rank 1 must hold
    the weights too (transformers' save_pretrained writes them on rank 0 only once torch.distributed is up)."""
    torch.multiprocessing.spawn(_build_on_rank, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    reference = AutoModelForCausalLM.from_pretrained(tiny_path).state_dict()
    for rank in (0, 1):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / f"rank{rank}")
        assert all(torch.equal(v, reference[k]) for k, v in model.state_dict().items()), rank


def test_model_init_kwargs_reach_from_pretrained_for_policy_and_reference(tmp_path, tiny_path):
    """TRL's ``model_init_kwargs``: here a config override, visible on the loaded policy and frozen reference."""
    from helpers import fit
    from lit_align.data import PreferenceDataModule
    from lit_align.modules import DPOModule

    assert load_model("builtin:tiny").config.max_position_embeddings == 512
    module = DPOModule(model="builtin:tiny", model_init_kwargs={"max_position_embeddings": 1024})
    fit(module, PreferenceDataModule(path="builtin:sort", batch_size=2, max_length=32, val_split=None), tmp_path)
    assert module.policy.config.max_position_embeddings == 1024
    assert module.reference.model.config.max_position_embeddings == 1024


def test_model_init_kwargs_build_a_quantization_config_and_refuse_clashes():
    from transformers import BitsAndBytesConfig

    from lit_align.models import from_pretrained_kwargs

    kwargs = from_pretrained_kwargs({"quantization_config": {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
                                     "device_map": "auto"})
    assert isinstance(kwargs["quantization_config"], BitsAndBytesConfig)
    assert kwargs["quantization_config"].load_in_4bit and kwargs["quantization_config"].bnb_4bit_quant_type == "nf4"
    assert kwargs["device_map"] == "auto"
    with pytest.raises(LitAlignError, match=r"model.model_init_kwargs: \['attn_implementation'\] have their own "):
        from_pretrained_kwargs({"attn_implementation": "eager"})


def test_cast_lm_head_to_fp32_runs_the_head_in_fp32_plain_and_chunked(tiny_path):
    """TRL's ``cast_lm_head_to_fp32`` on a bf16 model: the head's weights and logits are fp32 (the tied embedding still
    returns bf16), and the plain and chunked log-probs both equal an fp32 matmul of the bf16 hidden states, where the
    bf16 head's are off by bf16 rounding."""
    from lit_align.logps import next_token_logps
    from lit_align.models import cast_lm_head_to_fp32
    from numerics import assert_rounding_close

    model = load_model("builtin:tiny", dtype="bfloat16")
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    before, _ = next_token_logps(model, ids, 4)
    cast_lm_head_to_fp32(model)
    assert model.lm_head.weight.dtype == torch.float32 and model(input_ids=ids).logits.dtype == torch.float32
    assert model.get_input_embeddings()(ids).dtype == torch.bfloat16
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state[:, 3:-1]
        expected = torch.log_softmax(hidden.float() @ model.lm_head.weight.T, -1).gather(-1, ids[:, 4:, None])[..., 0]
        for chunk_size in (None, 8):
            logps, _ = next_token_logps(model, ids, 4, chunk_size=chunk_size)
            assert_rounding_close(logps, expected, scale=float(expected.abs().max()), terms=model.config.hidden_size)
        assert (before - expected).abs().max() > 1e-4  # what the cast changes: bf16's rounding of the logits


def test_dtype_null_trains_through_the_cli(capfd, tmp_path):
    """``model.dtype: null`` and ``model_init_kwargs: {torch_dtype: null}`` (a TRL config's way of saying "the
    default") train in float32 (they were a TypeError traceback)."""
    from helpers import run_main

    config = str(Path(__file__).resolve().parents[1] / "configs" / "dpo.yaml")
    code, out, err = run_main(["fit", "-c", config, "--trainer.default_root_dir", str(tmp_path),
                               "--model.init_args.dtype", "null",
                               "--model.init_args.model_init_kwargs", "{torch_dtype: null}", "--trainer.max_steps", "1",
                               "--data.init_args.val_split", "null", "--trainer.logger", "false",
                               "--trainer.enable_checkpointing", "false", "--export.enabled", "false",
                               "--trainer.enable_progress_bar", "false"], capfd)
    assert code == 0, err
    assert "Traceback" not in err


# -- another model family: Gemma 3 (sliding-window layers, no chat template), tiny and random ---------------------------
CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.fixture(scope="module")
def gemma3_path(tmp_path_factory) -> str:
    from tiny_gemma import build_tiny_gemma3

    return str(build_tiny_gemma3(tmp_path_factory.mktemp("gemma3")))


def smollm2_args(recipe: str, model: str, root: Path, *extra: str) -> list[str]:
    """``configs/<recipe>_smollm2.yaml`` on ``model``: a few short steps, validation of 4 prompts."""
    return ["fit", "-c", str(CONFIGS / f"{recipe}_smollm2.yaml"), "--model.init_args.model", model,
            "--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1",
            "--data.init_args.val_batch_size", "4", "--trainer.enable_progress_bar", "false",
            "--trainer.logger.init_args.save_dir", str(root), "--trainer.logger.init_args.version", "run",
            "--export.path", str(root / recipe / "hf_model"), *extra]


def test_a_model_without_a_chat_template_on_conversations_is_one_line_naming_model_chat_template(gemma3_path, tmp_path,
                                                                                                 capfd):
    from helpers import assert_one_line_error, run_main

    code, _, err = run_main(smollm2_args("sft", gemma3_path, tmp_path), capfd)
    assert assert_one_line_error(code, err) == (
        f"error: builtin:arith row 0: the rows are conversations, but tokenizer '{gemma3_path}' has no chat template: "
        "set model.chat_template (a Jinja file, the template itself, or one of ['builtin:chat', 'builtin:gemma', "
        "'builtin:tools'])")
    code, _, err = run_main(smollm2_args("sft", gemma3_path, tmp_path, "--model.init_args.chat_template",
                                         "builtin:gemma3"), capfd)
    assert assert_one_line_error(code, err) == (
        "error: chat_template 'builtin:gemma3': no such named template (expected one of ['builtin:chat', "
        "'builtin:gemma', 'builtin:tools'], a Jinja template file, or the template itself)")


def test_gemma3_sft_renders_gemma_turns_and_validates_greedily_with_hf(gemma3_path, tmp_path):
    """SFT from the shipped SmolLM2 config on the Gemma model with ``model.chat_template: builtin:gemma``: the rows
    are Gemma's turns, the completion is the model turn up to EOS, the greedy validation runs (engine auto: hf for
    the sliding layers), and the export carries the template."""
    from lit_align.cli import run
    from lit_align.logps import chunkable_head
    from lit_align.models import GEMMA_CHAT_TEMPLATE

    cli = run(smollm2_args("sft", gemma3_path, tmp_path, "--model.init_args.chat_template", "builtin:gemma",
                           "--model.init_args.val_exact_match", "true", "--model.init_args.val_max_new_tokens", "6"))
    tok, row = cli.datamodule.tokenizer, cli.datamodule.train_data[0]
    ids, mask = row["input_ids"], row["completion_mask"]
    assert tok.decode(ids).startswith("<bos><start_of_turn>user\nAnswer with one equation, like 7 + 5 = 12.\n\nCompute ")
    completion = tok.decode([t for t, m in zip(ids, mask) if m])
    assert completion.endswith("<end_of_turn><eos>") and " = " in completion and "model" not in completion
    assert cli.model.greedy_engine.chosen == "hf"
    assert chunkable_head(cli.model.policy) is not None  # the head's log-probs chunked: a 262k vocabulary fits
    metrics = cli.trainer.callback_metrics
    assert torch.isfinite(metrics["train/loss"]) and 0.0 <= float(metrics["val/mean_token_accuracy"]) <= 1.0
    assert float(metrics["val/exact_match"]) == 0.0  # 6 tokens of a random model
    assert AutoTokenizer.from_pretrained(tmp_path / "sft" / "hf_model").chat_template == GEMMA_CHAT_TEMPLATE


def test_gemma3_grpo_samples_with_engine_auto_falling_back_to_hf(gemma3_path, tmp_path):
    """GRPO from the shipped SmolLM2 config on the Gemma model: engine auto samples the rounds and the held-out
    greedy completions with hf (native decodes full-attention layers only); a training step runs on them."""
    from lit_align.cli import run
    from lit_align.generation.native import native_decodes

    cli = run(smollm2_args("grpo", gemma3_path, tmp_path, "--model.init_args.chat_template", "builtin:gemma",
                           "--data.init_args.batch_size", "4", "--model.init_args.num_generations", "4",
                           "--model.init_args.max_completion_length", "6", "--trainer.max_steps", "1",
                           "--trainer.val_check_interval", "1"))
    module = cli.model
    assert not native_decodes(module.policy)
    assert module.rollouts.engine.chosen == "hf" and module.rollouts.greedy_engine.chosen == "hf"
    metrics = cli.trainer.callback_metrics
    assert torch.isfinite(metrics["train/loss"]) and metrics["train/completions/mean_length"] <= 6
    assert 0.0 <= float(metrics["val/reward"]) <= 1.0
    assert cli.trainer.global_step == 1
