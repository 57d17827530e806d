"""Sampling completions from a causal LM, behind one small interface.

A sampler takes left-padded prompts and returns a ``Rollout``: completion ids (right-padded after EOS), the mask of
real completion tokens (EOS included), which rows ran out of tokens before EOS, and, when the engine has them, the
per-token log-probs of the sampled tokens under the temperature-scaled distribution (what GRPO's old-policy
log-probs are, so the trainer can skip a forward pass). Rows are ``num_samples`` consecutive samples per prompt.

``HFSampler`` wraps transformers' ``generate`` (batched, KV cache) and is the reference engine. ``NativeSampler`` runs
its own decode loop over the model's forward (one prefill per prompt shared by its samples, a preallocated KV cache,
sampling on tensors) and returns the same thing. Other engines plug in by implementing ``generate`` with the same
signature.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, DynamicLayer

from lit_align.errors import LitAlignError
from lit_align.logps import attention_mask_4d


@dataclass
class Rollout:
    completion_ids: torch.Tensor  # [N, C]
    completion_mask: torch.Tensor  # [N, C], 1 on tokens up to and including the first EOS
    truncated: torch.Tensor  # [N] bool: no EOS within max_new_tokens
    logps: torch.Tensor | None = None  # [N, C] sampling log-probs (temperature applied), or None


def completion_mask_from_eos(completion_ids: torch.Tensor, eos_token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mask [N, C], truncated [N])``: keep tokens up to and including the first EOS; no EOS means truncated."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos_token_ids, device=completion_ids.device))
    length = completion_ids.shape[1]
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full_like(is_eos[:, 0], length, dtype=torch.long))
    positions = torch.arange(length, device=completion_ids.device).expand_as(completion_ids)
    return (positions <= first.unsqueeze(1)).long(), ~is_eos.any(1)


class HFSampler:
    """Sample with ``model.generate``.

    Args:
        max_new_tokens: completion length cap (TRL's ``max_completion_length``).
        temperature: sampling temperature; 0 means greedy.
        top_p: nucleus sampling mass (1.0: off).
        top_k: keep the k most likely tokens (0: off, TRL's default).
        return_logps: also return the sampling log-probs (from the raw logits generate already computed).
    """

    def __init__(self, max_new_tokens: int = 64, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 return_logps: bool = True):
        self.max_new_tokens, self.temperature, self.top_p, self.top_k = max_new_tokens, temperature, top_p, top_k
        self.return_logps = return_logps

    @torch.no_grad()
    def generate(self, model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, num_samples: int,
                 eos_token_ids: list[int], pad_token_id: int) -> Rollout:
        greedy = self.temperature == 0
        if greedy and num_samples > 1:  # generate() refuses num_return_sequences > 1 without sampling
            prompt_ids = prompt_ids.repeat_interleave(num_samples, 0)
            prompt_mask = prompt_mask.repeat_interleave(num_samples, 0)
            num_samples = 1
        was_training = model.training
        model.eval()
        try:
            out = model.generate(
                input_ids=prompt_ids,
                attention_mask=prompt_mask,
                max_new_tokens=self.max_new_tokens,
                do_sample=not greedy,
                temperature=None if greedy else self.temperature,
                top_p=None if greedy else self.top_p,
                top_k=None if greedy else self.top_k,
                num_return_sequences=num_samples,
                eos_token_id=eos_token_ids,
                pad_token_id=pad_token_id,
                use_cache=True,
                return_dict_in_generate=True,
                output_logits=self.return_logps and not greedy,
            )
        finally:
            model.train(was_training)
        completion_ids = out.sequences[:, prompt_ids.shape[1] :]
        mask, truncated = completion_mask_from_eos(completion_ids, eos_token_ids)
        completion_ids = completion_ids.masked_fill(mask == 0, pad_token_id)
        logps = None
        if self.return_logps and not greedy:
            logits = torch.stack(out.logits, dim=1).float() / self.temperature  # [N, C, V]
            logps = (logits.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, -1)) * mask
        return Rollout(completion_ids, mask, truncated, logps)


# -- the native engine ---------------------------------------------------------------------------------------------

def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Set to ``-inf`` the logits of the tokens top-k / top-p sampling may not emit: ``[..., V] -> [..., V]``.

    Pure (the input is left untouched). ``logits`` are already divided by the temperature. Top-k first, then top-p on
    the softmax of what top-k kept, as transformers' logits warpers do: top-k keeps every token whose logit reaches the
    k-th largest (ties kept); top-p keeps, in order of decreasing probability, the tokens needed to reach mass
    ``top_p`` (a token is dropped once the tokens before it already hold ``top_p``; the most likely is always kept).
    ``top_k=0`` and ``top_p=1.0`` are off.
    """
    if top_k and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        mass_before = probs.cumsum(-1) - probs
        drop_sorted = mass_before >= top_p
        drop_sorted[..., 0] = False
        drop = torch.empty_like(drop_sorted).scatter_(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One token per row from ``logits [N, V]``: ``(tokens [N], logps [N] or None)``.

    Temperature 0 is greedy (argmax, no log-probs). Otherwise the token is drawn from the temperature-scaled,
    top-k/top-p filtered distribution, and its log-prob is taken under the temperature-scaled, *unfiltered*
    distribution (HFSampler's and the training forward's definition).

    The draw is the Gumbel-max trick: ``argmax(log p + g)`` with ``g = -log(-log u)``, ``u`` uniform, is an exact
    sample of ``p``. It costs one uniform per logit and an argmax, where ``torch.multinomial`` on CPU spends most of
    its time drawing exponentials.
    """
    if temperature == 0:
        return logits.argmax(-1), None
    logps = (logits.float() / temperature).log_softmax(-1)
    uniform = torch.rand_like(logps).clamp_(min=torch.finfo(logps.dtype).tiny)  # u = 0 would make a kept token -inf
    gumbel = uniform.log_().neg_().log_().neg_()
    tokens = (filter_logits(logps, top_k, top_p) + gumbel).argmax(-1, keepdim=True)
    return tokens.squeeze(-1), logps.gather(-1, tokens).squeeze(-1)


class _SlotLayer(DynamicLayer):
    """One layer's keys and values for ``B * G`` rows, in buffers allocated once: ``[B * G, H, capacity, D]``.

    The prefill (the first update) runs on the ``B`` prompts alone and is written once into each prompt's ``G`` rows
    (a broadcast copy: the prompt's cache is shared, not recomputed). Each decode step then writes its position in
    place, and attention reads the filled prefix as a view: no concatenation, no attention over empty slots.
    """

    def __init__(self, num_samples: int, capacity: int):
        super().__init__()
        self.num_samples, self.capacity, self.length = num_samples, capacity, 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        rows = key_states.shape[0] * self.num_samples
        self.device = key_states.device
        self.keys = key_states.new_empty((rows, key_states.shape[1], self.capacity, key_states.shape[3]))
        self.values = value_states.new_empty((rows, value_states.shape[1], self.capacity, value_states.shape[3]))
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.length
        end = start + key_states.shape[-2]
        self.length = end
        if start == 0:  # the prefill: B prompts, each copied into its G rows
            self.keys.unflatten(0, (-1, self.num_samples))[:, :, :, :end] = key_states.unsqueeze(1)
            self.values.unflatten(0, (-1, self.num_samples))[:, :, :, :end] = value_states.unsqueeze(1)
            return key_states, value_states
        self.keys[:, :, start:end] = key_states
        self.values[:, :, start:end] = value_states
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return self.capacity


class _SlotCache(Cache):
    """A transformers ``Cache`` of ``_SlotLayer`` (created lazily, one per attention layer)."""

    def __init__(self, num_samples: int, capacity: int):
        super().__init__(layer_class_to_replicate=partial(_SlotLayer, num_samples, capacity))

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only the cache rows ``rows`` (indices), in that order: the rows still decoding."""
        for layer in self.layers:
            layer.keys, layer.values = layer.keys[rows], layer.values[rows]


# Architectures whose forward is Llama's: embed -> layers (RMSNorm, q/k/v with optional bias, rotary, attention, o,
# residual, RMSNorm, gate/up, act, down, residual) -> RMSNorm -> lm_head. ``_LlamaDecodeStep`` runs their decode steps.
LLAMA_LIKE = frozenset({"llama", "mistral", "qwen2"})


def _sharded(model: torch.nn.Module) -> bool:
    """Whether ``model``'s parameters are sharded (FSDP, FSDP2, DeepSpeed ZeRO-3)."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    if any(isinstance(m, (FullyShardedDataParallel, FSDPModule)) for m in model.modules()):
        return True
    return any(hasattr(p, "ds_id") for p in model.parameters())


def _any_rank_decoding(decoding: bool, synced: bool, device: torch.device) -> bool:
    """Whether this rank (or, ``synced``, any rank: an all-reduce every rank makes at the same step) has rows left."""
    if not synced:
        return decoding
    flag = torch.tensor([float(decoding)], device=device)
    torch.distributed.all_reduce(flag)
    return bool(flag.item())


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm: normalise in fp32, scale in the model's dtype."""
    return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _LlamaDecodeStep:
    """One decode step of a Llama-like model (``LLAMA_LIKE``), written against its weights for ``NativeSampler``.

    A decode step of a small model is mostly per-operation overhead: the model's forward walks ~20 modules per layer
    with their hooks, output classes and mask logic. This runs the same math in ~15 tensor operations per layer:
    q/k/v fused into one matmul and gate/up into another (weights concatenated once per ``generate`` call), the rotary
    tables of every step computed before the loop, keys and values written into the ``_SlotCache`` buffers the
    prefill (a normal forward) filled. Results equal the model's forward up to float rounding (tested: greedy tokens
    identical, sampling log-probs equal a fresh forward's to 1e-5). Other architectures decode through their forward.
    """

    @staticmethod
    def supports(model) -> bool:
        config, base = model.config, getattr(model, "model", None)
        if config.model_type not in LLAMA_LIKE or base is None or not hasattr(base, "rotary_emb"):
            return False
        if _sharded(model):  # the weights are gathered only inside each module's own forward
            return False
        layer = base.layers[0]
        linears = [getattr(layer.self_attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        linears += [getattr(layer.mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        return (all(type(m) is torch.nn.Linear for m in linears)  # plain weights: no LoRA or quantized layers
                and set(layer.self_attn._modules) == {"q_proj", "k_proj", "v_proj", "o_proj"}
                and model.get_output_embeddings() is not None)

    def __init__(self, model, cache: _SlotCache, positions: torch.Tensor, valid: torch.Tensor):
        base, config = model.model, model.config
        self.embed, self.head = base.embed_tokens.weight, model.get_output_embeddings()
        self.norm = (base.norm.weight, base.norm.variance_epsilon)
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        attn = base.layers[0].self_attn
        self.head_dim, self.scaling = attn.head_dim, attn.scaling
        self.layers = []
        for layer, slots in zip(base.layers, cache.layers):
            a, m = layer.self_attn, layer.mlp
            qkv = (a.q_proj, a.k_proj, a.v_proj)
            self.layers.append((
                (layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon),
                torch.cat([p.weight for p in qkv]),
                None if a.q_proj.bias is None else torch.cat([p.bias for p in qkv]),
                a.o_proj,
                (layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon),
                torch.cat([m.gate_proj.weight, m.up_proj.weight]),
                None if m.gate_proj.bias is None else torch.cat([m.gate_proj.bias, m.up_proj.bias]),
                m.down_proj, m.act_fn, slots,
            ))
        cos, sin = base.rotary_emb(self.embed, positions)  # [N, steps, D] for every step at once
        self.cos, self.sin = cos.unsqueeze(2), sin.unsqueeze(2)  # [N, steps, 1, D]
        self.valid = valid[:, None, None, :]  # [N, 1, 1, prompt + steps]

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only the rows ``rows`` of the per-row tables (the cache's are kept by ``_SlotCache.keep_rows``)."""
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
        return self.head(_rms_norm(h, *self.norm))


def _check_native_model(model) -> None:
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise LitAlignError(f"engine 'native' handles full-attention layers only; this model has {sorted(layer_types)} "
                            "(use engine 'hf')")
    attn = getattr(model.config, "_attn_implementation", None)
    if attn not in ("sdpa", "eager"):
        raise LitAlignError(f"engine 'native' runs the 'sdpa' and 'eager' attention; this model uses {attn!r} "
                            "(use engine 'hf' or attn_implementation 'sdpa')")


class NativeSampler:
    """Batched sampling with its own decode loop: one prefill per prompt, all ``B * G`` rows decoded together.

    Same arguments and ``generate`` signature as ``HFSampler`` and the same ``Rollout``; what differs is how:

    - each prompt is run once and its KV cache copied into its ``G`` rows (``HFSampler`` repeats the prompts first);
    - the KV cache is preallocated (``_SlotLayer``): a decode step writes one slot, no cache grows by concatenation;
    - the left-padding mask is built once as a 4D mask and sliced per step, positions follow the prompt mask (as
      ``completion_token_logps`` computes them), so transformers builds no mask in the loop;
    - sampling stays on tensors (``sample_next``: temperature, ``filter_logits`` for top-k/top-p, a Gumbel-max
      draw), its log-probs are those of the temperature-scaled, unfiltered distribution (HFSampler's definition);
    - finished rows are tracked on tensors; the loop looks at the host only every ``EOS_CHECK_EVERY`` tokens, to stop
      once every row has ended, and to drop the rows that ended from the batch (their KV cache rows too) once they
      are ``DROP_FINISHED`` of it: completion lengths have a long tail, and a batch decoding only its slowest rows
      costs what a full one does (``generate`` keeps decoding every row until the last one ends).

    The model must use ``sdpa`` or ``eager`` attention and full-attention layers (Llama, Qwen2, GPT-NeoX, ...).
    """

    EOS_CHECK_EVERY = 8
    DROP_FINISHED = 0.25  # drop the rows that ended once they are this fraction of the batch being decoded
    FAST_DECODE = True  # decode Llama-like models with ``_LlamaDecodeStep`` (False: through the model's forward)

    def __init__(self, max_new_tokens: int = 64, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 return_logps: bool = True):
        if temperature < 0 or not 0 < top_p <= 1 or top_k < 0 or max_new_tokens < 1:
            raise LitAlignError(f"sampler: need temperature >= 0, 0 < top_p <= 1, top_k >= 0, max_new_tokens >= 1; "
                                f"got {temperature}, {top_p}, {top_k}, {max_new_tokens}")
        self.max_new_tokens, self.temperature, self.top_p, self.top_k = max_new_tokens, temperature, top_p, top_k
        self.return_logps = return_logps

    def generate(self, model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, num_samples: int,
                 eos_token_ids: list[int], pad_token_id: int) -> Rollout:
        _check_native_model(model)
        was_training = model.training
        model.eval()
        try:
            with torch.inference_mode():  # a little faster than no_grad; the results are cloned out of it below
                ids, logps = self._decode(model, prompt_ids, prompt_mask, num_samples, eos_token_ids, pad_token_id)
        finally:
            model.train(was_training)
        ids, logps = ids.clone(), None if logps is None else logps.clone()  # usable by autograd (training forward)
        mask, truncated = completion_mask_from_eos(ids, eos_token_ids)
        width = int(mask.sum(1).max())  # columns after the longest row hold only pad
        ids, mask = ids[:, :width], mask[:, :width]
        if logps is not None:
            logps = logps[:, :width]
        return Rollout(ids, mask, truncated, logps)

    def _decode(self, model, prompt_ids, prompt_mask, num_samples, eos_token_ids, pad_token_id):
        batch, prompt_len = prompt_ids.shape
        rows, steps, device = batch * num_samples, self.max_new_tokens, prompt_ids.device
        prompt_mask = prompt_mask.bool()

        # prefill: each prompt once; a query attends to earlier real tokens and to itself (pads too: no empty rows)
        causal = torch.ones(prompt_len, prompt_len, dtype=torch.bool, device=device).tril_()
        allowed = (causal & prompt_mask[:, None, None, :]) | torch.eye(prompt_len, dtype=torch.bool, device=device)
        positions = (prompt_mask.long().cumsum(1) - 1).clamp_(min=0)
        cache = _SlotCache(num_samples, prompt_len + steps)
        logits = model(input_ids=prompt_ids, attention_mask=attention_mask_4d(model, allowed), position_ids=positions, cache=cache,
                       use_cache=True, logits_to_keep=1).logits[:, -1]
        logits = logits.repeat_interleave(num_samples, 0)

        # decode: every row attends to its prompt's real tokens and to everything generated
        valid = torch.cat([prompt_mask.repeat_interleave(num_samples, 0),
                           torch.ones(rows, steps, dtype=torch.bool, device=device)], 1)
        step_mask = attention_mask_4d(model, valid[:, None, None, :])
        next_position = prompt_mask.sum(1).repeat_interleave(num_samples, 0).unsqueeze(1)  # [N, 1]

        ids = torch.full((rows, steps), pad_token_id, dtype=torch.long, device=device)
        want_logps = self.return_logps and self.temperature != 0
        logps = torch.zeros(rows, steps, dtype=torch.float32, device=device) if want_logps else None
        live = torch.arange(rows, device=device)  # the row of ``ids`` each row being decoded fills
        finished = torch.zeros(rows, dtype=torch.bool, device=device)
        eos = torch.tensor(eos_token_ids, device=device)[:, None]
        # sharded weights are gathered inside every forward, a collective: each rank decodes until all have ended
        synced = _sharded(model) and torch.distributed.is_available() and torch.distributed.is_initialized()
        fast = None
        if self.FAST_DECODE and _LlamaDecodeStep.supports(model):
            fast = _LlamaDecodeStep(model, cache, next_position + torch.arange(steps, device=device), valid)
        for t in range(steps):
            tokens, token_logps = sample_next(logits, self.temperature, self.top_k, self.top_p)
            tokens = tokens.masked_fill_(finished, pad_token_id)
            ids[live, t] = tokens
            if want_logps:
                logps[live, t] = token_logps.masked_fill_(finished, 0.0)
            finished |= (tokens == eos).any(0)
            if t + 1 == steps:
                break
            if (t + 1) % self.EOS_CHECK_EVERY == 0:
                ended = int(finished.sum())
                if not _any_rank_decoding(ended < len(finished), synced, device):
                    break
                # synced, a rank whose rows have all ended decodes them on while another rank decodes (its
                # forwards take part in the all-gathers): its last rows are never dropped
                if len(finished) > ended >= self.DROP_FINISHED * len(finished):
                    keep = (~finished).nonzero().squeeze(1)
                    live, tokens, finished = live[keep], tokens[keep], finished[keep]
                    cache.keep_rows(keep)
                    if fast is not None:
                        fast.keep_rows(keep)
                    step_mask, next_position = step_mask[keep], next_position[keep]
            if fast is not None:
                logits = fast(tokens, t, prompt_len + t)
            else:
                logits = model(input_ids=tokens.unsqueeze(1), attention_mask=step_mask[..., : prompt_len + t + 1],
                               position_ids=next_position + t, cache=cache, use_cache=True).logits[:, -1]
        return ids, logps
