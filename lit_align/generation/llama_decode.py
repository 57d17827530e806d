"""A fused decode step for Llama-like models, written against their weights (``NativeEngine``'s fast path)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lit_align.capabilities import is_sharded
from lit_align.generation.cache import SlotCache

# Architectures whose forward is Llama's: embed -> layers (RMSNorm, q/k/v with optional bias, rotary, attention, o,
# residual, RMSNorm, gate/up, act, down, residual) -> RMSNorm -> lm_head. ``LlamaDecodeStep`` runs their decode steps.
LLAMA_LIKE = frozenset({"llama", "mistral", "qwen2"})


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm: normalise in fp32, scale in the model's dtype."""
    return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaDecodeStep:
    """One decode step of a Llama-like model (``LLAMA_LIKE``), written against its weights for ``NativeEngine``.

    A decode step of a small model is mostly per-operation overhead: the model's forward walks ~20 modules per layer
    with their hooks, output classes and mask logic. This runs the same math in ~15 tensor operations per layer:
    q/k/v fused into one matmul and gate/up into another (weights concatenated once per ``generate`` call), the rotary
    tables of every step computed before the loop, keys and values written into the ``SlotCache`` buffers the
    prefill (a normal forward) filled. Results equal the model's forward up to float rounding (tested: greedy tokens
    identical, sampling log-probs equal a fresh forward's to 1e-5). Other architectures decode through their forward.
    """

    @staticmethod
    def supports(model) -> bool:
        config, base = model.config, getattr(model, "model", None)
        if config.model_type not in LLAMA_LIKE or base is None or not hasattr(base, "rotary_emb"):
            return False
        if is_sharded(model):  # the weights are gathered only inside each module's own forward
            return False
        layer = base.layers[0]
        linears = [getattr(layer.self_attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        linears += [getattr(layer.mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        return (all(type(m) is torch.nn.Linear for m in linears)  # plain weights: no LoRA or quantized layers
                and set(layer.self_attn._modules) == {"q_proj", "k_proj", "v_proj", "o_proj"}
                and type(model.get_output_embeddings()) is torch.nn.Linear)

    def __init__(self, model, cache: SlotCache, positions: torch.Tensor, valid: torch.Tensor):
        base, config = model.model, model.config
        self.embed, head = base.embed_tokens.weight, model.get_output_embeddings()
        # on CPU the LM head, the one weight too large for the caches, streams from memory at every step: a [H, V]
        # copy reads in order (at a 152k vocabulary 1.4x faster than the [V, H] weight; GPUs need no copy)
        weight = head.weight.detach()
        self.head_weight = weight.T.contiguous() if weight.device.type == "cpu" else weight.T
        self.head_bias = head.bias
        self.norm = (base.norm.weight, base.norm.variance_epsilon)
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        attn = base.layers[0].self_attn
        self.head_dim, self.scaling = attn.head_dim, attn.scaling
        self.layers = [self._fuse(layer, slots) for layer, slots in zip(base.layers, cache.layers)]
        cos, sin = base.rotary_emb(self.embed, positions)  # [N, steps, D] for every step at once
        self.cos, self.sin = cos.unsqueeze(2), sin.unsqueeze(2)  # [N, steps, 1, D]
        self.valid = valid[:, None, None, :]  # [N, 1, 1, prompt + steps]

    @staticmethod
    def _fuse(layer, slots) -> tuple:
        """One decoder layer's weights as ``__call__`` reads them: q/k/v and gate/up concatenated."""
        a, m = layer.self_attn, layer.mlp
        qkv = (a.q_proj, a.k_proj, a.v_proj)
        return (
            (layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon),
            torch.cat([p.weight for p in qkv]),
            None if a.q_proj.bias is None else torch.cat([p.bias for p in qkv]),
            a.o_proj,
            (layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon),
            torch.cat([m.gate_proj.weight, m.up_proj.weight]),
            None if m.gate_proj.bias is None else torch.cat([m.gate_proj.bias, m.up_proj.bias]),
            m.down_proj, m.act_fn, slots,
        )

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only the rows ``rows`` of the per-row tables (the cache's are kept by ``SlotCache.keep_rows``)."""
        self.cos, self.sin, self.valid = self.cos[rows], self.sin[rows], self.valid[rows]

    def __call__(self, tokens: torch.Tensor, step: int, slot: int) -> torch.Tensor:
        """Logits ``[N, V]`` after feeding ``tokens [N]`` at decode step ``step``, written to cache slot ``slot``."""
        rows, qk_heads = tokens.shape[0], self.heads + self.kv_heads
        cos, sin, mask = self.cos[:, step], self.sin[:, step], self.valid[..., : slot + 1]
        h = F.embedding(tokens, self.embed)
        for norm1, w_qkv, b_qkv, o_proj, norm2, w_gate_up, b_gate_up, down_proj, act, slots in self.layers:
            qkv = F.linear(_rms_norm(h, *norm1), w_qkv, b_qkv).view(rows, -1, self.head_dim)
            qk = qkv[:, :qk_heads] * cos + _rotate_half(qkv[:, :qk_heads]) * sin
            slots.keys[:, :, slot] = qk[:, self.heads :]
            slots.values[:, :, slot] = qkv[:, qk_heads:]
            out = F.scaled_dot_product_attention(
                qk[:, : self.heads, None], slots.keys[:, :, : slot + 1], slots.values[:, :, : slot + 1],
                attn_mask=mask, scale=self.scaling, enable_gqa=self.heads != self.kv_heads)
            h = h + o_proj(out.view(rows, -1))
            gate, up = F.linear(_rms_norm(h, *norm2), w_gate_up, b_gate_up).chunk(2, dim=-1)
            h = h + down_proj(act(gate) * up)
        logits = _rms_norm(h, *self.norm) @ self.head_weight
        return logits if self.head_bias is None else logits.add_(self.head_bias)
