"""A fused decode step for Llama-like models, written against their weights (``NativeEngine``'s fast path)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lit_align.capabilities import is_sharded
from lit_align.generation.cache import SlotCache

# Architectures whose forward is Llama's: embed -> layers (RMSNorm, q/k/v with optional bias, rotary, attention, o,
# residual, RMSNorm, gate/up, act, down, residual) -> RMSNorm -> lm_head. ``LlamaDecodeStep`` runs their decode steps.
LLAMA_LIKE = frozenset({"llama", "mistral", "qwen2"})


class PackedLinear:
    """``x -> F.linear(x, weight, bias)`` for a decode step's few rows. On CPU in fp32 the weight is reordered once
    into oneDNN's layout for about ``rows`` rows (any number works; ``torch.ops.mkldnn``, the weight prepacking
    torch's own compiler does for frozen CPU models): at 1-64 rows MKL's GEMM, behind ``F.linear``, repacks the whole
    weight at every call, and the prepacked products are 1.3-3x faster at SmolLM2-135M's shapes, the same values up
    to float rounding. Elsewhere (other devices and dtypes, under autocast) ``F.linear`` as it is."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, rows: int):
        weight = weight.detach()
        self.bias = None if bias is None else bias.detach()
        self.packed = (weight.device.type == "cpu" and weight.dtype == torch.float32
                       and not torch.is_autocast_enabled("cpu")  # autocast: F.linear, in autocast's dtype
                       and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))
        self.weight = (torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), max(rows, 1)) if self.packed
                       else weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


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
    q/k/v fused into one matmul and gate/up into another (weights concatenated once per ``generate`` call; each
    weight, the LM head's too, prepacked for the step's few rows on CPU: ``PackedLinear``), the rotary
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
        rows = len(valid)
        self.head = PackedLinear(head.weight, head.bias, rows)
        self.norm = (base.norm.weight, base.norm.variance_epsilon)
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        attn = base.layers[0].self_attn
        self.head_dim, self.scaling = attn.head_dim, attn.scaling
        self.layers = [self._fuse(layer, slots, rows) for layer, slots in zip(base.layers, cache.layers)]
        cos, sin = base.rotary_emb(self.embed, positions)  # [N, steps, D] for every step at once
        self.cos, self.sin = cos.unsqueeze(2), sin.unsqueeze(2)  # [N, steps, 1, D]
        self.valid = valid[:, None, None, :]  # [N, 1, 1, prompt + steps]

    @staticmethod
    def _fuse(layer, slots, rows: int) -> tuple:
        """One decoder layer's weights as ``__call__`` reads them: q/k/v and gate/up concatenated, each a
        ``PackedLinear`` for ``rows`` rows."""
        a, m = layer.self_attn, layer.mlp
        qkv = (a.q_proj, a.k_proj, a.v_proj)
        return (
            (layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon),
            PackedLinear(torch.cat([p.weight for p in qkv]),
                         None if a.q_proj.bias is None else torch.cat([p.bias for p in qkv]), rows),
            PackedLinear(a.o_proj.weight, a.o_proj.bias, rows),
            (layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon),
            PackedLinear(torch.cat([m.gate_proj.weight, m.up_proj.weight]),
                         None if m.gate_proj.bias is None else torch.cat([m.gate_proj.bias, m.up_proj.bias]), rows),
            PackedLinear(m.down_proj.weight, m.down_proj.bias, rows), m.act_fn, slots,
        )

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only the rows ``rows`` of the per-row tables (the cache's are kept by ``SlotCache.keep_rows``)."""
        self.cos, self.sin, self.valid = self.cos[rows], self.sin[rows], self.valid[rows]

    def __call__(self, tokens: torch.Tensor, step: int, slot: int) -> torch.Tensor:
        """Logits ``[N, V]`` after feeding ``tokens [N]`` at decode step ``step``, written to cache slot ``slot``."""
        rows, qk_heads = tokens.shape[0], self.heads + self.kv_heads
        cos, sin, mask = self.cos[:, step], self.sin[:, step], self.valid[..., : slot + 1]
        h = F.embedding(tokens, self.embed)
        for norm1, qkv_proj, o_proj, norm2, gate_up_proj, down_proj, act, slots in self.layers:
            qkv = qkv_proj(_rms_norm(h, *norm1)).view(rows, -1, self.head_dim)
            qk = qkv[:, :qk_heads] * cos + _rotate_half(qkv[:, :qk_heads]) * sin
            slots.keys[:, :, slot] = qk[:, self.heads :]
            slots.values[:, :, slot] = qkv[:, qk_heads:]
            out = F.scaled_dot_product_attention(
                qk[:, : self.heads, None], slots.keys[:, :, : slot + 1], slots.values[:, :, : slot + 1],
                attn_mask=mask, scale=self.scaling, enable_gqa=self.heads != self.kv_heads)
            h = h + o_proj(out.view(rows, -1))
            gate, up = gate_up_proj(_rms_norm(h, *norm2)).chunk(2, dim=-1)
            h = h + down_proj(act(gate) * up)
        return self.head(_rms_norm(h, *self.norm))
