"""A fused decode step for Llama-like models, written against their weights (``NativeEngine``'s fast path)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lit_align.capabilities import is_sharded
from lit_align.generation.cache import SlotCache

# Architectures whose forward is Llama's: embed -> layers (RMSNorm, q/k/v with optional bias, rotary, attention, o,
# residual, RMSNorm, gate/up, act, down, residual) -> RMSNorm -> lm_head. ``LlamaDecodeStep`` runs their decode steps.
LLAMA_LIKE = frozenset({"llama", "mistral", "qwen2"})


# Rows from which MKL's packed GEMM beats oneDNN's prepacked product on a decode step (SmolLM2-135M's shapes, 2
# threads, the weights streamed from memory: 64 rows 61 vs 80 ms a step, 32 rows 44 vs 50, 16 and 8 rows equal).
MKL_PACKED_ROWS = 32


def _cpu_packs(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.float32
            and not torch.is_autocast_enabled("cpu"))  # autocast: F.linear, in autocast's dtype


class PackedLinear:
    """``x -> F.linear(x, weight, bias)`` for a decode step's few rows. On CPU in fp32 the weight is reordered once
    for ``rows`` rows (the prepacking torch's own compiler does for frozen CPU models): at 1-64 rows ``F.linear``'s
    GEMM repacks the whole weight at every call. From ``MKL_PACKED_ROWS`` rows MKL's packed GEMM
    (``torch.ops.mkl``: ``F.linear``'s own kernel, without the repacking; at most ``rows`` rows, fewer padded to
    them), below that or without ``mkl`` oneDNN's prepacked product (any number of rows): 1.1-3x ``F.linear``'s
    speed at SmolLM2-135M's shapes, the same values up to float rounding. Elsewhere (other devices and dtypes, under
    autocast) ``F.linear`` as it is. ``kind``: ``"mkl"``, ``"onednn"`` or ``None`` (``F.linear``)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, rows: int, mkl: bool = True):
        weight = weight.detach()
        self.bias, self.rows, self.kind = None if bias is None else bias.detach(), max(rows, 1), None
        if _cpu_packs(weight):
            if (mkl and rows >= MKL_PACKED_ROWS and torch.backends.mkl.is_available()
                    and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")):
                self.kind = "mkl"
            elif torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
                self.kind = "onednn"
        if self.kind == "mkl":
            self.weight = torch.ops.mkl._mkl_reorder_linear_weight(weight.contiguous(), self.rows)
            # the product reads only the shape of its "original weight" argument (used when the rows differ from
            # the packed count, which ``__call__`` never lets happen): a stride-0 view keeps no copy of it alive
            self.shape = weight.new_empty(()).expand(weight.shape)
        elif self.kind == "onednn":
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), self.rows)
        else:
            self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "mkl":
            rows = x.shape[0]
            if rows > self.rows:  # MKL would fall back to the original weight, which is not kept
                raise ValueError(f"PackedLinear: {rows} rows, packed for at most {self.rows}")
            if rows < self.rows:  # computed at the packed count (``LlamaDecodeStep`` packs again for oneDNN instead)
                x = torch.cat([x, x.new_zeros(self.rows - rows, x.shape[1])])
            return torch.ops.mkl._mkl_linear(x, self.weight, self.shape, self.bias, self.rows)[:rows]
        if self.kind == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm: normalise in fp32, scale in the model's dtype (in fp32, one operation: the same values)."""
    if x.dtype == weight.dtype == torch.float32:
        return F.rms_norm(x, x.shape[-1:], weight, eps)
    return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


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
        self.embed = base.embed_tokens.weight
        self.model, self.slots = model, cache.layers
        self._pack(len(valid))
        self.norm = (base.norm.weight, base.norm.variance_epsilon)
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        attn = base.layers[0].self_attn
        self.head_dim, self.scaling = attn.head_dim, attn.scaling
        cos, sin = base.rotary_emb(self.embed, positions)  # [N, steps, D] for every step at once
        # rotary: x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1) = roll(x) * (-1, 1): the sign in sin
        half = sin.shape[-1] // 2
        sin = torch.cat([-sin[..., :half], sin[..., half:]], -1)
        self.cos, self.sin = cos.unsqueeze(2), sin.unsqueeze(2)  # [N, steps, 1, D]
        self.hidden = ~valid[:, None, None, :]  # [N, 1, 1, prompt + steps]: the cache columns a row must not see

    def _pack(self, rows: int, mkl: bool = True) -> None:
        """The LM head and every layer's weights packed for ``rows`` rows (``PackedLinear``)."""
        self.head = self.layers = None  # the old packs freed before the new ones are made
        head = self.model.get_output_embeddings()
        self.head = PackedLinear(head.weight, head.bias, rows, mkl)
        self.layers = [self._fuse(layer, slots, rows, mkl) for layer, slots in zip(self.model.model.layers, self.slots)]

    @staticmethod
    def _fuse(layer, slots, rows: int, mkl: bool) -> tuple:
        """One decoder layer's weights as ``__call__`` reads them: q/k/v and gate/up concatenated, each a
        ``PackedLinear`` for ``rows`` rows."""
        a, m = layer.self_attn, layer.mlp
        qkv = (a.q_proj, a.k_proj, a.v_proj)
        return (
            (layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon),
            PackedLinear(torch.cat([p.weight for p in qkv]),
                         None if a.q_proj.bias is None else torch.cat([p.bias for p in qkv]), rows, mkl),
            PackedLinear(a.o_proj.weight, a.o_proj.bias, rows, mkl),
            (layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon),
            PackedLinear(torch.cat([m.gate_proj.weight, m.up_proj.weight]),
                         None if m.gate_proj.bias is None else torch.cat([m.gate_proj.bias, m.up_proj.bias]), rows,
                         mkl),
            PackedLinear(m.down_proj.weight, m.down_proj.bias, rows, mkl), m.act_fn, slots,
        )

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only the rows ``rows`` of the per-row tables (the cache's are kept by ``SlotCache.keep_rows``). MKL's
        packs compute the rows they were made for: at the batch's first drop the weights are packed again, for
        oneDNN's product, which takes any number of rows (a long tail of rows ending one by one follows; padded to
        the packed count, MKL's product would cost a full batch's at every step of it)."""
        self.cos, self.sin, self.hidden = self.cos[rows], self.sin[rows], self.hidden[rows]
        if self.head.kind == "mkl":
            self._pack(len(rows), mkl=False)

    def __call__(self, tokens: torch.Tensor, step: int, slot: int) -> torch.Tensor:
        """Logits ``[N, V]`` after feeding ``tokens [N]`` at decode step ``step``, written to cache slot ``slot``."""
        rows, qk_heads, half = tokens.shape[0], self.heads + self.kv_heads, self.head_dim // 2
        cos, sin, hidden = self.cos[:, step], self.sin[:, step], self.hidden[..., : slot + 1]
        h = F.embedding(tokens, self.embed)
        for norm1, qkv_proj, o_proj, norm2, gate_up_proj, down_proj, act, slots in self.layers:
            qkv = qkv_proj(_rms_norm(h, *norm1)).view(rows, -1, self.head_dim)
            qk = qkv[:, :qk_heads] * cos + qkv[:, :qk_heads].roll(half, -1) * sin
            slots.keys[:, :, slot] = qk[:, self.heads :]
            slots.values[:, :, slot] = qkv[:, qk_heads:]
            # one query per row: attention as two products (SDPA's kernels are for many queries: 10% slower here);
            # the query heads of a key/value head side by side (GQA: head i reads key/value head i // group)
            q = (qk[:, : self.heads] * self.scaling).view(rows, self.kv_heads, -1, self.head_dim)
            scores = (q @ slots.keys[:, :, : slot + 1].transpose(-1, -2)).masked_fill_(hidden, float("-inf"))
            out = scores.softmax(-1, dtype=torch.float32).to(q.dtype) @ slots.values[:, :, : slot + 1]  # as eager
            h = h + o_proj(out.view(rows, -1))
            gate, up = gate_up_proj(_rms_norm(h, *norm2)).chunk(2, dim=-1)
            h = h + down_proj(act(gate) * up)
        return self.head(_rms_norm(h, *self.norm))
