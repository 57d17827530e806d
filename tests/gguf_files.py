"""Small GGUF files for the tests, written with the ``gguf`` package's GGUFWriter (no download): a Llama with
grouped-query attention and a byte-level BPE tokenizer with ChatML specials, as SmolLM2's file holds them."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # SmolLM2's: unk 0, bos 1, eos and pad 2
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CORPUS = ["sort 3914:1349", "What is 7 plus 5? 7 plus 5 is 12.",
          "Hello, world! The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b\n"] * 20


def bpe_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on a few lines (GPT-2's pre-tokenizer), with SmolLM2's specials and ChatML."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token=SPECIALS[0], bos_token=SPECIALS[1],
                                        eos_token=SPECIALS[2], pad_token=SPECIALS[2])
    tokenizer.chat_template = CHATML
    return tokenizer


def tiny_llama(tokenizer, seed: int = 0) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config).eval()


def _permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's q/k row order (convert_hf_to_gguf.py's ``permute``; transformers undoes it on load)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def gguf_tensors(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """The model's weights under llama.cpp's tensor names."""
    cfg, state = model.config, model.state_dict()
    names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    out = {"token_embd.weight": state["model.embed_tokens.weight"], "output_norm.weight": state["model.norm.weight"]}
    for i in range(cfg.num_hidden_layers):
        for hf, gg in names.items():
            weight = state[f"model.layers.{i}.{hf}.weight"]
            if gg == "attn_q":
                weight = _permute(weight, cfg.num_attention_heads)
            elif gg == "attn_k":
                weight = _permute(weight, cfg.num_key_value_heads)
            out[f"blk.{i}.{gg}.weight"] = weight
    return out


def write_gguf(model: LlamaForCausalLM, tokenizer, path: str | Path, architecture: str = "llama") -> Path:
    """``model`` and ``tokenizer`` as a float32 GGUF file at ``path`` (tied embeddings: no ``output.weight``)."""
    import gguf

    cfg, path = model.config, Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("lit_align test llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    vocab = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    writer.add_token_list(vocab)
    writer.add_token_types([gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in vocab])
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]  # [["a", "b"], ...]
    writer.add_token_merges([" ".join(pair) for pair in merges])
    writer.add_unk_token_id(tokenizer.unk_token_id)
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(tokenizer.chat_template)
    for name, tensor in gguf_tensors(model).items():
        writer.add_tensor(name, tensor.detach().float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

