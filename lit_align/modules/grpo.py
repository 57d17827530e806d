"""GRPO as a LightningModule: generate once per round, then train on the round's completions step by step.

``PromptDataModule`` hands every step the whole round's prompts with its position in the round (``round_pos``).
At ``round_pos == 0`` (or when there is no round, e.g. after a resume without one) ``generate_round`` samples
``num_generations`` completions per prompt, scores them, computes group-relative advantages and keeps the
old-policy and reference log-probs only when the loss needs them: a ``lit_align.generation_round.GenerationRound``.
Every step then trains on ``round.step_batch(round_pos)``. The math is in ``lit_align.losses.grpo``; sampling is
behind ``lit_align.generation``; the reference behind ``lit_align.reference``.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torchmetrics import MeanMetric

from lit_align import layouts
from lit_align.callbacks import RefModelSync
from lit_align.errors import LitAlignError
from lit_align.generation import SamplingConfig, VLLMOptions, make_engine
from lit_align.generation.environments import Environments
from lit_align.generation.tools import ToolLoop, load_tool, rollout_from_output, tool_schema, turns_text
from lit_align.generation_round import GenerationRound, RoundShape
from lit_align.imports import callable_name
from lit_align.logps import layout_logps
from lit_align.losses.grpo import (
    decoupled_advantages, group_advantages, importance_sampling_ratio, masked_mean, nanstd, sequence_means,
)
from lit_align.losses.grpo_loss import EntropyControl, GRPOLoss
from lit_align.models import cast_lm_head_to_fp32
from lit_align.modules.base import AlignModule
from lit_align.reference import FrozenReference, choose_reference
from lit_align.rewards import RewardModel, RewardState, load_reward, score_all


def _repeat(values: list, times: int) -> list:
    return [v for v in values for _ in range(times)]


def completion_token_logps(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature: float = 1.0,
                           with_entropy: bool = False, chunk_size: int | None = None, padding_free: bool = False,
                           entropy_grad: bool = False):
    """Per-token log-probs ``[N, C]`` of completions after left-padded prompts, logits divided by ``temperature``
    (and, ``with_entropy``, the tempered distribution's entropy, without gradient unless ``entropy_grad``); 0 at
    padding. Laid out by ``lit_align.layouts.completions``."""
    layout = layouts.completions(prompt_ids, prompt_mask, completion_ids, completion_mask, padding_free, model)
    out = layout_logps(model, layout, ("entropy",) if with_entropy else (), chunk_size, temperature, entropy_grad)
    return out.tokens, out.stats.get("entropy")


def check_sampling(temperature: float, max_completion_length: int) -> None:
    """Refuse a sampling setting GRPO cannot train with (errors name ``model.<setting>``; the loss settings are
    ``lit_align.losses.grpo_loss.GRPOLoss``'s to check)."""
    if temperature <= 0:
        raise LitAlignError(f"model.temperature must be > 0 (GRPO samples distinct completions), got {temperature}")
    if max_completion_length < 1:
        raise LitAlignError(f"model.max_completion_length must be >= 1 (tokens sampled per completion), "
                            f"got {max_completion_length}")


def load_rewards(specs: list[str | dict] | None, weights: list[float] | None,
                 owned: list | None = None) -> tuple[list, list[str], list[float]]:
    """``(reward functions, their names, their weights)`` from ``model.reward_funcs`` / ``model.reward_weights``, and
    the rewards environments own (``owned``: weight 1, after them, as TRL)."""
    owned = owned or []
    if not specs and owned:
        return owned, [callable_name(fn) for fn in owned], [1.0] * len(owned)
    if not specs:  # TRL requires them: a default reward would fit one dataset and silently score others
        raise LitAlignError("model.reward_funcs: none given; GRPO scores completions only with the reward functions "
                            "you name (TRL's reward_funcs): e.g. [lit_align.rewards.sort_accuracy] for the built-in "
                            "sort task, [my_pkg.rewards.fn] for your own data, or a reward model's directory")
    funcs = [load_reward(spec) for spec in specs]
    weights = weights or [1.0] * len(funcs)
    if len(weights) != len(funcs):
        raise LitAlignError(f"model.reward_weights has {len(weights)} values for {len(funcs)} reward_funcs")
    funcs += owned
    return funcs, [callable_name(fn) for fn in funcs], list(weights) + [1.0] * len(owned)


class GRPOModule(AlignModule):
    """Group Relative Policy Optimization, with TRL's loss types and metric names.

    Args:
        reward_funcs: reward functions: dotted paths (``lit_align.rewards.sort_accuracy``, ``my_pkg.mod.fn``; from
            Python, the functions themselves),
            ``{class_path, init_args}`` objects, plain or ``async``, with TRL's calling convention
            (``lit_align.rewards``); or reward models by hub name or directory (``lit_align.rewards.RewardModel``).
            Required, as in TRL: none is an error (no reward fits every dataset).
        reward_weights: one weight per reward function (default: all 1.0); rewards are summed with these weights.
        num_generations: completions sampled per prompt (G; TRL's default 8). With ``lit-align`` it is set once,
            under ``data:`` (linked here). The module owns the round's shape (``lit_align.generation_round.RoundShape``)
            and hands it to the DataModule (``PromptDataModule.connect``).
        steps_per_generation: training steps fed by one generation round (linked from ``data:`` as above).
        num_iterations: passes over each round's completions (TRL's mu; linked from ``data:`` as above).
        loss_type: ``dapo`` (TRL's default), ``grpo``, ``bnpo``, ``dr_grpo``, ``cispo``, ``sapo``, ``luspo`` or
            ``vespo`` (formulas: ``lit_align.losses.grpo.grpo_token_losses`` and ``aggregate_grpo_loss``).
        beta: KL coefficient to a frozen reference (k3 estimator); 0 (TRL's default) loads no reference.
        ref_model: the reference when ``beta > 0``; None: a frozen copy of the initial policy (under LoRA: the policy
            with its adapters disabled).
        epsilon: lower clipping bound of the ratio (``1 - epsilon``).
        epsilon_high: upper bound (``1 + epsilon_high``; default: ``epsilon``; DAPO uses 0.28); for ``cispo`` the
            cap of the detached weight itself (ScaleRL recommends 5.0).
        delta: two-sided clipping (INTELLECT-2): the unclipped ratio is capped at ``delta`` too (None: off;
            above ``1 + epsilon_high`` is recommended).
        importance_sampling_level: ``token`` (a ratio per token) or ``sequence`` (GSPO: the exp of the completion's
            mean log-ratio, one per completion).
        sapo_temperature_pos: ``sapo``'s gate temperature for tokens with a positive advantage.
        sapo_temperature_neg: ``sapo``'s gate temperature for the others.
        vespo_k_pos: ``vespo``'s power k for a non-negative advantage (how hard ratios below 1 are down-weighted).
        vespo_lambda_pos: ``vespo``'s decay lambda for a non-negative advantage (ratios above 1).
        vespo_k_neg: k for a negative advantage.
        vespo_lambda_neg: lambda for a negative advantage.
        scale_rewards: ``group`` (divide by the group's std), ``batch`` or ``none``.
        multi_objective_aggregation: ``sum_then_normalize`` (sum the weighted rewards, then ``scale_rewards``) or
            ``normalize_then_sum`` (GDPO: normalize each reward function within its group, sum with the weights,
            normalize the sum over the batch; ``lit_align.losses.grpo.decoupled_advantages``).
        top_entropy_quantile: train only on the tokens whose entropy is in this top fraction (over every rank's loss
            tokens; 1.0: all, the paper uses 0.2).
        off_policy_mask_threshold: drop the completions with a negative advantage whose mean KL from the sampling
            policy (its log-probs: vLLM's, else the old policy's) exceeds this (DeepSeek-V3.2; None: off).
        use_bias_correction_kl: multiply the KL term by the importance ratio (its gradient then is the unbiased
            reverse-KL one, even on-policy where the ratio is 1).
        entropy_coef: subtract this times the mean entropy of the loss tokens from the loss (an exploration bonus,
            trained through the entropy's gradient; 0: off).
        use_adaptive_entropy: adapt ``entropy_coef`` every optimizer step (Skywork-OR1): up by ``entropy_coef_delta``
            when the last step's entropy was at most ``entropy_target`` (the bonus then applies), down otherwise.
        entropy_coef_min: lower bound of the adaptive coefficient.
        entropy_coef_max: upper bound of the adaptive coefficient.
        entropy_coef_delta: the adaptive coefficient's step.
        entropy_target: the mean token entropy (nats) below which the adaptive bonus applies.
        sync_ref_model: TR-DPO's reference sync for GRPO: every ``ref_model_sync_steps`` optimizer steps,
            ``ref <- ref_model_mixup_alpha * policy + (1 - ref_model_mixup_alpha) * ref``
            (``lit_align.callbacks.RefModelSync``). Needs ``beta != 0`` and no ``peft_config``.
        ref_model_mixup_alpha: the policy's weight in that mix (TRL's default 0.6).
        ref_model_sync_steps: the sync cadence in optimizer steps (TRL's default 512).
        cast_lm_head_to_fp32: the LM head of the policy and the reference in fp32, its matmul too (ScaleRL); with
            ``logps_chunk_size`` or ``padding_free`` the chunked head then runs in fp32.
        mask_truncated_completions: leave completions that hit ``max_completion_length`` out of the loss.
        max_completion_length: tokens generated per completion at most (TRL's default, 512).
        temperature: sampling temperature; the training log-probs use the same temperature, as TRL does.
        top_p: nucleus sampling (1.0: off).
        top_k: top-k sampling (0: off).
        min_p: keep only tokens at least ``min_p`` times as likely as the most likely one (None: off).
        repetition_penalty: divide the logits of tokens already in the prompt or completion by it where positive,
            multiply where negative (transformers' and vLLM's; 1.0: off); greedy validation too.
        generation_kwargs: more keywords for the engine's own generation call, overriding the settings above, as
            TRL: transformers' ``generate`` (``engine: hf``) or vLLM's ``SamplingParams`` (``engine: vllm``);
            ``native`` has none and refuses them. Validation's engine gets them too.
        num_generations_eval: completions per validation prompt, sampled as in training (TRL's); None (lit_align's
            default): one greedy completion. ``val/reward`` is their mean.
        engine: the generation engine: ``hf`` (transformers ``generate``), ``native`` (lit_align's batched decode loop, faster) or
            ``vllm`` (a vLLM engine in the training process, TRL's ``use_vllm`` with ``vllm_mode: colocate``; its own
            environment, see the README).
        padding_free: compute each step's training log-probs with its rows packed without padding, several per row,
            one row on CPU under sdpa, else rows as wide as the longest (``lit_align.layouts.packed_rows``,
            ``packing_width``), each prompt once for the step's completions of it (``shared_prompt_completions``),
            the LM head on completion tokens only: the same
            values, without the cost of completions that ended early, of prompt padding and of repeated prompts.
            sdpa or eager attention. The round-level no-grad passes (old and reference log-probs) stay padded.
        vllm_mode: ``colocate`` (the only one: TRL's ``server`` mode is not supported). The ``vllm_*`` options are
            TRL's flat names for the vLLM engine's options, routed to it (``lit_align.generation.vllm.VLLMOptions``,
            which checks them) when ``engine`` is ``vllm``.
        vllm_gpu_memory_utilization: with ``engine: vllm``, the fraction of GPU memory vLLM takes (weights and KV
            cache; on CPU of the RAM, unless ``VLLM_CPU_KVCACHE_SPACE`` sets the KV cache in GiB).
        vllm_tensor_parallel_size: GPUs one vLLM engine spans (only 1: an engine per rank).
        vllm_max_model_length: vLLM's context window (None: the model's): at least the longest prompt plus
            ``max_completion_length``.
        vllm_enable_sleep_mode: free vLLM's weights and KV cache during training steps (pushed back before each
            generation): less GPU memory, some transfer time.
        vllm_importance_sampling_correction: weigh each token's loss by the ratio of the training forward's
            probability to vLLM's (TRL's; ``lit_align.losses.grpo.importance_sampling_ratio``); the old log-probs are
            then the training forward's. Needs vLLM's log-probs: top_k 0 and top_p 1.0.
        vllm_importance_sampling_mode: ``sequence_mask`` (TRL's default), ``sequence_truncate``, ``token_truncate``
            or ``token_mask``.
        vllm_importance_sampling_clip_min: lower bound of the ratio (None: none).
        vllm_importance_sampling_clip_max: upper bound of the ratio (TRL's cap; None: none).
        vllm_structured_outputs_regex: with ``engine: vllm``, constrain every completion to this regular expression
            (vLLM's structured outputs; None: free text).
        tools: functions the model may call during its rollouts (TRL's ``tools``): dotted paths or
            ``{class_path, init_args}`` objects, plain or ``async``, with type hints and a Google-style docstring
            (their schemas go to the chat template). Completions then run as ``lit_align.generation.tools.ToolLoop``
            does: tool turns appended token in token out and left out of the loss (``tool_mask``). Needs
            conversational prompts and a chat template that renders tool calls (``builtin:tools`` for the
            built-in models). None: one completion per sample, no tools.
        max_tool_calling_iterations: rounds of tool calls per completion at most (TRL's; None: until no call).
        environment_factory: an environment class per rollout (TRL's): a class path, ``{class_path, init_args}``, or
            a mapping of names to those picked per row by its ``environment`` column. Its ``reset(**row)`` may append
            text to the prompt, its public methods are the rollout's tools, and a ``get_reward()`` makes it a reward
            source (``reward_funcs`` may then be empty). See ``lit_align.generation.environments``.
        rollout_func: a dotted path to ``f(prompts, module) -> dict`` that makes the round's completions instead of
            the engine (TRL's ``rollout_func``; ``prompts``: one per completion, each prompt ``num_generations``
            times in a row): per completion its ``prompt_ids``, ``completion_ids`` and ``logprobs`` (lists; None:
            computed by a forward), optionally ``env_mask`` (0 on tokens the model did not sample, as the tool mask)
            and other keys, passed to the reward functions. It makes the validation completions too.
    """

    def __init__(
        self,
        model: str = "builtin:tiny",
        reward_funcs: list[str | dict] | None = None,
        reward_weights: list[float] | None = None,
        num_generations: int = 8,
        steps_per_generation: int = 1,
        num_iterations: int = 1,
        loss_type: str = "dapo",
        beta: float = 0.0,
        ref_model: str | None = None,
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        delta: float | None = None,
        importance_sampling_level: str = "token",
        sapo_temperature_pos: float = 1.0,
        sapo_temperature_neg: float = 1.05,
        vespo_k_pos: float = 2.0,
        vespo_lambda_pos: float = 3.0,
        vespo_k_neg: float = 3.0,
        vespo_lambda_neg: float = 2.0,
        scale_rewards: str = "group",
        multi_objective_aggregation: str = "sum_then_normalize",
        top_entropy_quantile: float = 1.0,
        off_policy_mask_threshold: float | None = None,
        use_bias_correction_kl: bool = True,
        entropy_coef: float = 0.0,
        use_adaptive_entropy: bool = False,
        entropy_coef_min: float = 0.0,
        entropy_coef_max: float = 1.0,
        entropy_coef_delta: float = 0.005,
        entropy_target: float = 0.2,
        sync_ref_model: bool = False,
        ref_model_mixup_alpha: float = 0.6,
        ref_model_sync_steps: int = 512,
        cast_lm_head_to_fp32: bool = False,
        mask_truncated_completions: bool = False,
        max_completion_length: int = 512,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float | None = None,
        repetition_penalty: float = 1.0,
        generation_kwargs: dict | None = None,
        num_generations_eval: int | None = None,
        engine: str = "hf",
        padding_free: bool = False,
        vllm_mode: str = "colocate",
        vllm_gpu_memory_utilization: float = 0.3,
        vllm_tensor_parallel_size: int = 1,
        vllm_max_model_length: int | None = None,
        vllm_enable_sleep_mode: bool = False,
        vllm_importance_sampling_correction: bool = True,
        vllm_importance_sampling_mode: str = "sequence_mask",
        vllm_importance_sampling_clip_min: float | None = None,
        vllm_importance_sampling_clip_max: float | None = 3.0,
        vllm_structured_outputs_regex: str | None = None,
        tools: list[str | dict] | None = None,
        max_tool_calling_iterations: int | None = None,
        environment_factory: str | dict | None = None,
        rollout_func: str | None = None,
        **kwargs,
    ):
        # the arguments as given: under LightningCLI ``self.hparams`` is the parsed config, which leaves out what a
        # subclass fixes (RLOOModule's loss settings)
        arguments = dict(locals())
        super().__init__(model=model, **kwargs)
        self.round_shape = RoundShape(num_generations, steps_per_generation, num_iterations, owner="model")
        check_sampling(temperature, max_completion_length)
        self.loss_fn = GRPOLoss(**{name: arguments[name] for name in GRPOLoss.__dataclass_fields__})
        self.entropy_control = EntropyControl.from_loss(self.loss_fn)
        self.entropy_window: torch.Tensor | None = None  # adaptive: (entropy sum, tokens) of this accumulation window
        self.environments = None if environment_factory is None else Environments(environment_factory)
        owned = [] if self.environments is None else self.environments.reward_functions()
        self.reward_funcs, self.reward_names, weights = load_rewards(reward_funcs, reward_weights, owned)
        self.register_buffer("reward_weights", torch.tensor(weights, dtype=torch.float32), persistent=False)
        self.mask_truncated_completions, self.max_completion_length = mask_truncated_completions, max_completion_length
        self.temperature, self.padding_free = temperature, padding_free
        lora = self.lora_config is not None
        if sync_ref_model and (beta == 0.0 or lora):
            raise LitAlignError("model.sync_ref_model mixes the policy into the reference model: it needs model.beta "
                                "!= 0 (beta 0 loads no reference) and no model.peft_config (the reference is then the "
                                "policy without its adapters)")
        self.ref_sync = RefModelSync(ref_model_sync_steps, ref_model_mixup_alpha) if sync_ref_model else None
        if beta != 0.0:
            self.reference = choose_reference(ref_model, lora)
        self.importance_sampling = None  # (mode, clip_min, clip_max) when vLLM's sampling is corrected for
        if num_generations_eval is not None and num_generations_eval < 1:
            raise LitAlignError(f"model.num_generations_eval must be >= 1 or null (one greedy completion), "
                                f"got {num_generations_eval}")
        self.num_generations_eval = num_generations_eval
        self.engine, self.greedy_engine = self.make_engines(
            engine, arguments, max_new_tokens=max_completion_length, temperature=temperature, top_p=top_p, top_k=top_k,
            min_p=min_p, repetition_penalty=repetition_penalty, generation_kwargs=generation_kwargs)
        self.tools = [load_tool(spec) for spec in tools or []]
        self.tool_schemas = [tool_schema(tool) for tool in self.tools]  # the data renders its prompts with them
        if max_tool_calling_iterations is not None and max_tool_calling_iterations < 0:
            raise LitAlignError(f"model.max_tool_calling_iterations must be >= 0 or null, got "
                                f"{max_tool_calling_iterations}")
        self.tool_loop: ToolLoop | None = None  # built with the tokenizer (configure_model)
        self.rollout_func = None if rollout_func is None else load_tool(rollout_func, "model.rollout_func")
        self.round: GenerationRound | None = None
        self.reward_metrics: dict[str, list[float]] = {}  # what reward functions log this round (log_metric)
        self.reward_columns: dict[str, list] = {}  # and their completions-table columns (log_extra)
        self.generation_rounds = 0
        self.generation_seed = torch.initial_seed()  # re-read at fit start (after ``seed_everything``)
        self.val_metrics = torch.nn.ModuleDict(
            {name: MeanMetric() for name in ["reward", *(f"rewards_{n}_mean" for n in self.reward_names),
                                             *(["tool_calls"] if tools or environment_factory else [])]})

    def make_engines(self, engine: str, settings: dict[str, Any], temperature: float, **sampling):
        """The ``engine`` sampling the rounds and its greedy twin for validation (``SamplingConfig``'s settings; the
        greedy one keeps the repetition penalty and ``generation_kwargs``). The vLLM engine's options, set flat as in
        TRL (``model.vllm_*``, among the module's ``settings``), are routed to it, which checks them
        (``VLLMOptions``)."""
        engine_settings = {}
        if engine == "vllm":
            options = VLLMOptions.from_flat(settings)
            self.importance_sampling = options.importance_sampling(SamplingConfig(temperature=temperature, **sampling))
            if (self.loss_fn.loss_type == "vespo" and self.importance_sampling is not None
                    and not self.importance_sampling[0].startswith("token")):
                raise LitAlignError(f"model.vllm_importance_sampling_mode {self.importance_sampling[0]!r}: loss_type "
                                    "'vespo' folds vLLM's importance weights into its per-sequence weight token by "
                                    "token: expected 'token_truncate' or 'token_mask'")
            engine_settings = {**options.engine_settings(), "weights_version": self.weights_version}
        return (make_engine(engine, temperature=temperature, **sampling, **engine_settings),
                make_engine(engine, temperature=0.0, **sampling, **engine_settings))

    def data_settings(self) -> dict:
        """The data follows the round's shape too (``PromptDataModule.connect``)."""
        return {**super().data_settings(), "round_shape": self.round_shape, "tools": self.tool_schemas or None}

    def configure_callbacks(self):
        return [self.ref_sync] if self.ref_sync is not None else []

    def configure_model(self) -> None:
        super().configure_model()
        hp = self.hparams
        if hp.cast_lm_head_to_fp32 and not getattr(self.network.get_output_embeddings(), "fp32_matmul", False):
            cast_lm_head_to_fp32(self.network)
            if isinstance(self.reference, FrozenReference):  # a reference under LoRA is the policy itself
                cast_lm_head_to_fp32(self.reference.model)
        for fn in self.reward_funcs:  # reward models load with the policy's settings (TRL: model_init_kwargs)
            if isinstance(fn, RewardModel):
                fn.load(hp.dtype, hp.trust_remote_code, hp.model_init_kwargs)
        # the tool loop refuses a template that cannot call tools: now, before training
        if (self.tools or self.environments is not None) and self.tool_loop is None:
            self.tool_loop = ToolLoop(self.tools, self.tokenizer, self.max_completion_length,
                                      hp.max_tool_calling_iterations,
                                      getattr(self.network.config, "max_position_embeddings", None))

    def weights_version(self) -> int:
        """The policy weights' version, for engines that hold a copy of them (vllm): the optimizer steps taken."""
        return self.global_step

    # -- the pieces of a generation round ------------------------------------------------------------------------------
    def sample(self, engine, batch: dict[str, Any], num_samples: int):
        """``num_samples`` completions per prompt: the ``Rollout``, the prompts (repeated) and the completions (text,
        or an assistant message for conversational prompts)."""
        tok = self.tokenizer
        eos_pad = {"eos_token_ids": [tok.eos_token_id], "pad_token_id": tok.pad_token_id}
        if self.rollout_func is not None:  # the user's rollouts (TRL's rollout_func), in training and validation
            output = self.rollout_func(_repeat(batch["prompts"], num_samples), self)
            rollout = rollout_from_output(output, self.hparams.rollout_func, len(batch["prompts"]) * num_samples,
                                          device=self.device, **eos_pad)
        elif self.environments is not None:  # a fresh environment per rollout, its prompt rendered after its reset
            rollout = self.environments.rollout(self.tool_loop, engine, self.policy, batch, num_samples, **eos_pad)
        else:
            generate = engine.generate if self.tool_loop is None else partial(self.tool_loop.generate, engine)
            rollout = generate(self.policy, batch["prompt_ids"], batch["prompt_mask"], num_samples, **eos_pad)
        prompts = _repeat(batch["prompts"], num_samples)
        if getattr(rollout, "messages", None) is not None:  # the turns: assistant (with tool_calls), tool, ...
            return rollout, prompts, rollout.messages
        texts = tok.batch_decode(rollout.completion_ids, skip_special_tokens=True)
        completions = [[{"role": "assistant", "content": t}] if isinstance(p, list) else t for p, t in zip(prompts, texts)]
        return rollout, prompts, completions

    def score(self, batch: dict[str, Any], rollout, prompts: list, completions: list, num_samples: int) -> torch.Tensor:
        """``[N, F]`` rewards, one column per reward function (NaN where a function returned None)."""
        columns = {k: _repeat(v, num_samples) for k, v in batch["columns"].items()}
        ids = [row[mask.bool()].tolist() for row, mask in zip(rollout.completion_ids, rollout.completion_mask)]
        trainer = self._trainer
        state = RewardState(self.global_step, getattr(trainer, "max_steps", -1), getattr(trainer, "current_epoch", 0))
        extra = {"trainer_state": state, "log_metric": lambda name, value: self.reward_metrics.setdefault(
                     name, []).append(float(value)),
                 "log_extra": lambda column, values: self.reward_columns.setdefault(column, []).extend(values)}
        if getattr(rollout, "environments", None) is not None:  # TRL: every reward function sees them
            extra["environments"] = rollout.environments
        extra.update(getattr(rollout, "extra", None) or {})  # a rollout_func's own columns
        for fn in self.reward_funcs:
            if isinstance(fn, RewardModel):
                fn.to(self.device)
        per_func = score_all(self.reward_funcs, prompts, completions, ids, columns, extra)
        return torch.tensor(per_func, dtype=torch.float32, device=self.device).T.reshape(len(prompts), -1)

    def advantages(self, per_func: torch.Tensor, old_logps: torch.Tensor | None = None,
                   ref_logps: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(rewards [N], advantages [N], every rank's rewards)``. As TRL: advantages over every rank's rewards (the
        same per group: a group stays on one rank; ``scale_rewards: batch`` divides by the global batch's std),
        then this rank's rows. The round's log-probs are for recipes that put the KL in the reward (RLOO); GRPO's
        KL is in the loss."""
        weighted = per_func * self.reward_weights
        rewards = torch.where(per_func.isnan().all(1), torch.nan, weighted.nansum(1))
        all_rewards = self.trainer.strategy.all_gather(rewards).reshape(-1)
        rank = self.trainer.global_rank
        mine = slice(rank * len(rewards), (rank + 1) * len(rewards))
        group = self.round_shape.num_generations
        if self.loss_fn.multi_objective_aggregation == "normalize_then_sum":
            all_per_func = self.trainer.strategy.all_gather(per_func).reshape(-1, per_func.shape[1])
            advantages = decoupled_advantages(all_per_func, self.reward_weights, group)
        else:
            advantages = group_advantages(all_rewards, group, self.loss_fn.scale_rewards)
        return rewards, advantages[mine], all_rewards

    def completion_logps(self, network, prompt_ids, prompt_mask, completion_ids, completion_mask,
                         with_entropy: bool = False, padding_free: bool = False, entropy_grad: bool = False):
        """``completion_token_logps`` at this module's temperature and chunk size."""
        return completion_token_logps(network, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                      self.temperature, with_entropy, self.logps_chunk_size, padding_free,
                                      entropy_grad)

    @torch.no_grad()
    def generate_round(self, batch: dict[str, Any]) -> GenerationRound:
        group, shape = self.round_shape.num_generations, self.round_shape
        self.reward_metrics, self.reward_columns = {}, {}
        with self.round_rng():
            rollout, prompts, completions = self.sample(self.engine, batch, group)
        per_func = self.score(batch, rollout, prompts, completions, group)

        prompt_ids = batch["prompt_ids"].repeat_interleave(group, 0)
        prompt_mask = batch["prompt_mask"].repeat_interleave(group, 0)
        if getattr(rollout, "prompt_ids", None) is not None:  # each rollout's own prompt (environments)
            prompt_ids, prompt_mask = rollout.prompt_ids, rollout.prompt_mask
        completion_ids, completion_mask = rollout.completion_ids, rollout.completion_mask
        tool_mask = getattr(rollout, "tool_mask", None)  # 0 on tool turns: not the policy's tokens
        loss_mask = completion_mask if tool_mask is None else completion_mask * tool_mask
        if self.mask_truncated_completions:
            loss_mask = loss_mask * (~rollout.truncated).unsqueeze(1)
        sequences = (prompt_ids, prompt_mask, completion_ids, completion_mask)

        old_logps, is_ratio, sampling_stats = self.old_logps(rollout, sequences)
        ref_logps = None
        if self.reference is not None:
            ref_logps = self.reference.logps(batch, lambda network: self.completion_logps(network, *sequences)[0])
        rewards, advantages, all_rewards = self.advantages(per_func, old_logps, ref_logps, loss_mask)

        # dapo: every token of the round weighs the same; normalized by the loss tokens per step (all ranks)
        num_tokens = self.trainer.strategy.reduce(loss_mask.sum().float(), reduce_op="sum")
        self.generation_rounds += 1
        order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(self.global_step)).tolist()
        prompt_rows = batch.get("dataset_rows")  # each prompt's dataset index; completion i is of prompt i // G
        return GenerationRound(
            prompt_ids, prompt_mask, completion_ids, completion_mask, loss_mask, advantages, old_logps, ref_logps,
            order=order, steps=shape.steps_per_generation,
            num_tokens=shape.tokens_per_step(float(num_tokens), self.trainer.world_size),
            stats={**self.round_stats(rollout, per_func, rewards, all_rewards), **sampling_stats},
            prompts=prompts, completions=[c if isinstance(c, str) else turns_text(c) for c in completions],
            rewards=rewards.tolist(), dataset_rows=None if prompt_rows is None else _repeat(prompt_rows, group),
            extra={k: v for k, v in self.reward_columns.items() if len(v) == len(prompts)}, is_ratio=is_ratio,
            sampling_logps=rollout.logps if is_ratio is not None and self.loss_fn.off_policy_mask_threshold is not None
            else None,
            reward_funcs={name: per_func[:, i].tolist() for i, name in enumerate(self.reward_names)},
            tool_mask=tool_mask,
        )

    def old_logps(self, rollout, sequences: tuple) -> tuple[torch.Tensor | None, torch.Tensor | None, dict]:
        """``(old log-probs, importance weights, sampling/* metrics)`` of a round's ``sequences`` (prompt ids and mask,
        completion ids and mask; the weights over the sampled tokens only, not tool turns). The old (sampling) policy's
        log-probs matter only when the policy moves before the round is used up
        (``RoundShape.needs_old_logps``): the engine's, or a forward pass. With vLLM's sampling corrected for, they
        are the training forward's (TRL) and the weights compare them with vLLM's."""
        if self.importance_sampling is not None:
            old_logps = self.completion_logps(self.network, *sequences)[0]
            tool_mask = getattr(rollout, "tool_mask", None)
            mask = sequences[3] if tool_mask is None else sequences[3] * tool_mask
            is_ratio = importance_sampling_ratio(old_logps, rollout.logps, mask, *self.importance_sampling)
            return old_logps, is_ratio, self.sampling_stats(old_logps, rollout.logps, mask, is_ratio)
        if not self.round_shape.needs_old_logps(self.trainer.accumulate_grad_batches):
            return None, None, {}
        if rollout.logps is not None:
            return rollout.logps, None, {}
        return self.completion_logps(self.network, *sequences)[0], None, {}

    def sampling_stats(self, train_logps, sampling_logps, mask, is_ratio) -> dict[str, torch.Tensor]:
        """TRL's ``sampling/*`` metrics: how far vLLM's log-probs are from the training forward's, and the importance
        weights (over real tokens; per completion for the sequence modes); rank-averaged means, every rank's
        extremes."""
        real = mask.bool()
        gap = (train_logps - sampling_logps).abs()[real]
        weights = is_ratio[real] if is_ratio.shape == mask.shape else is_ratio.flatten()
        strategy = self.trainer.strategy
        means = strategy.reduce(torch.stack([gap.mean(), weights.mean()]), reduce_op="mean")
        extremes = strategy.all_gather(torch.stack([gap.max(), weights.max(), -weights.min()])).reshape(-1, 3).amax(0)
        return {"sampling/sampling_logp_difference/mean": means[0],
                "sampling/sampling_logp_difference/max": extremes[0],
                "sampling/importance_sampling_ratio/min": -extremes[2],
                "sampling/importance_sampling_ratio/mean": means[1],
                "sampling/importance_sampling_ratio/max": extremes[1]}

    def round_stats(self, rollout, per_func, rewards, all_rewards) -> dict[str, torch.Tensor]:
        """TRL's per-round metrics, averaged over ranks; std, min and max are over every rank's completions
        (gathered), not averages of per-rank values."""
        tool_mask = getattr(rollout, "tool_mask", None)  # TRL counts the sampled tokens only
        lengths = (rollout.completion_mask if tool_mask is None else rollout.completion_mask * tool_mask).sum(1).float()
        all_lengths = self.trainer.strategy.all_gather(lengths).reshape(-1)
        groups = rewards.view(-1, self.round_shape.num_generations)
        zero_std = (nanstd(groups, dim=1) < 1e-6).float()  # as the advantages see it
        stats = {
            "reward": rewards.nanmean(),
            "reward_std": nanstd(all_rewards.view(1, -1), dim=1).view(()),
            "frac_reward_zero_std": zero_std.mean(),
            "completions/mean_length": lengths.mean(),
            "completions/min_length": all_lengths.min(),
            "completions/max_length": all_lengths.max(),
            "completions/clipped_ratio": rollout.truncated.float().mean(),
            **{f"rewards/{n}/mean": per_func[:, i].nanmean() for i, n in enumerate(self.reward_names)},
            **{name: torch.tensor(sum(v) / len(v), device=self.device) for name, v in self.reward_metrics.items()},
        }
        if self.tool_loop is not None:  # TRL's: calls per completion, and the failed share of the calls (all ranks)
            calls, failures = self.trainer.strategy.reduce(
                torch.tensor([rollout.tool_calls, rollout.tool_failures], dtype=torch.float32, device=self.device),
                reduce_op="sum")
            stats["tools/call_frequency"] = calls / (len(lengths) * self.trainer.world_size)
            stats["tools/failure_frequency"] = failures / calls if calls > 0 else torch.zeros((), device=self.device)
        values = self.trainer.strategy.reduce(torch.stack(list(stats.values())), reduce_op="mean")
        return dict(zip(stats, values))

    @contextmanager
    def round_rng(self):
        """Sample from an RNG seeded by (run seed, step, rank), not from the global stream: a round's completions then
        depend only on the policy and the step, so a resumed run regenerates exactly what the uninterrupted run did
        (the global stream also feeds DataLoader workers, validation, ... and is not in checkpoints)."""
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed((self.generation_seed + 1_000_003 * self.global_step + 7_919 * self.global_rank) % 2**63)
            yield

    # -- a resume mid-round continues on the saved round (its completions came from an earlier policy) -----------------
    def on_fit_start(self) -> None:
        self.generation_seed = torch.initial_seed()

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Every rank's round (each generated from its own prompts): gathered, as only rank 0 writes the file."""
        super().on_save_checkpoint(checkpoint)
        mine = None if self.round is None else self.round.state_dict()
        rounds = [mine]
        if torch.distributed.is_available() and torch.distributed.is_initialized() and self.trainer.world_size > 1:
            rounds = [None] * self.trainer.world_size
            torch.distributed.all_gather_object(rounds, mine)
        checkpoint["lit_align_grpo"] = {"rounds": rounds, "generation_rounds": self.generation_rounds,
                                        "entropy_control": self.entropy_control.state_dict()}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        state = checkpoint.get("lit_align_grpo", {})
        self.generation_rounds = state.get("generation_rounds", 0)
        if "entropy_control" in state:
            self.entropy_control.load_state_dict(state["entropy_control"])
        rounds = state.get("rounds", [])
        # another world size: the round is regenerated (the resume is then not exact mid-round)
        world, rank = (self._trainer.world_size, self._trainer.global_rank) if self._trainer is not None else (1, 0)
        mine = rounds[rank] if len(rounds) == world else None
        self.round = None if mine is None else GenerationRound(**mine)

    def on_train_start(self) -> None:
        if self.round is not None:  # restored from a checkpoint (on the CPU)
            self.round = self.round.to(self.device)

    # -- what is computed -------------------------------------------------------------------------------------------
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Any] | None:
        if batch["round_pos"] == 0 or self.round is None:
            self.round = self.generate_round(batch)
        step = self.round.step_batch(batch["round_pos"])
        mask, settings = step.loss_mask, self.loss_fn
        logps, entropy = self.completion_logps(self.network, step.prompt_ids, step.prompt_mask, step.completion_ids,
                                               step.completion_mask, with_entropy=True,
                                               padding_free=self.padding_free, entropy_grad=settings.entropy_bonus)
        out = settings(logps, step.old_logps, step.advantages, mask, ref_logps=step.ref_logps, entropy=entropy,
                       entropy_pool=self.entropy_pool(entropy, mask) if settings.top_entropy_quantile < 1 else None,
                       sampling_logps=step.sampling_logps, is_ratio=step.is_ratio,
                       max_completion_length=self.max_completion_length, num_tokens=self.round.num_tokens,
                       entropy_coef=self.entropy_control.applied())
        if settings.use_adaptive_entropy:  # this accumulation window's entropy, for the coefficient's update
            window = torch.stack([(entropy.detach() * out.trained).sum(), out.trained.sum()])
            self.entropy_window = window if self.entropy_window is None else self.entropy_window + window
        loss = self.guard_loss(out.loss, (out.token_losses * mask).sum(1), batch_idx, step.dataset_rows)
        if loss is None:  # skipped (on_nonfinite_loss: skip)
            return None
        self.log_step(loss, out.policy_loss, entropy.detach(), out.info, mask)
        return {"loss": loss, "step": step, "logps": logps.detach()}  # callbacks see the step's batch (outputs)

    def entropy_pool(self, entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Every rank's loss tokens' entropies (``top_entropy_quantile``'s threshold is their quantile, as TRL's)."""
        mine = entropy.detach()[mask.bool()].float()
        sizes = self.trainer.strategy.all_gather(torch.tensor(len(mine), device=self.device)).reshape(-1)
        padded = torch.full((int(sizes.max()),), -1.0, device=self.device)  # entropies are >= 0: -1 marks padding
        padded[: len(mine)] = mine
        gathered = self.trainer.strategy.all_gather(padded).reshape(-1)
        return gathered[gathered >= 0]

    def log_step(self, loss, policy_loss, entropy, info: dict[str, torch.Tensor], mask: torch.Tensor) -> None:
        """TRL's per-step metrics (rank-averaged; ``clip_ratio/low_min`` and ``high_max`` over every rank's
        completions), then the round's."""
        mask = mask.to(entropy.dtype)
        step_stats = {"loss": loss.detach(), "entropy": masked_mean(entropy, mask)}
        per_sequence = {}
        if "low_clipped" in info:
            low, high = info["low_clipped"], info["high_clipped"]
            step_stats |= {"clip_ratio/low_mean": masked_mean(low, mask),
                           "clip_ratio/high_mean": masked_mean(high, mask),
                           "clip_ratio/region_mean": masked_mean(low + high, mask)}
            per_sequence = {"clip_ratio/low_min": sequence_means(low, mask),
                            "clip_ratio/high_max": sequence_means(high, mask)}
        if "cispo_clipped" in info:
            step_stats["cispo_clip_ratio"] = masked_mean(info["cispo_clipped"], mask)
        if "phi_seq" in info:
            step_stats["vespo/phi_seq_mean"] = masked_mean(info["phi_seq"], mask)
        if "kl" in info:
            step_stats["kl"] = masked_mean(info["kl"], mask)
        if self.loss_fn.entropy_bonus:
            step_stats["policy_loss"] = policy_loss
        strategy = self.trainer.strategy
        values = strategy.reduce(torch.stack(list(step_stats.values())), reduce_op="mean")
        for name, seq in per_sequence.items():
            gathered = strategy.all_gather(seq).reshape(-1)
            gathered = gathered[~gathered.isnan()]
            value = gathered.min() if name.endswith("min") else gathered.max()
            self.log(f"train/{name}", value if gathered.numel() else torch.tensor(torch.nan))
        for name, value in [*zip(step_stats, values), *self.round.stats.items()]:
            self.log(f"train/{name}", value, prog_bar=name in ("loss", "reward"))
        self.log("train/generation_rounds", float(self.generation_rounds))

    def on_before_optimizer_step(self, optimizer) -> None:
        """After an accumulation window: the adaptive entropy coefficient of the next step, from this window's mean
        entropy over every rank's trained tokens (TRL updates it at the same boundary)."""
        super().on_before_optimizer_step(optimizer)
        if self.entropy_window is not None:
            totals = self.trainer.strategy.reduce(self.entropy_window, reduce_op="sum")
            self.entropy_control.step(float(totals[0] / totals[1].clamp(min=1.0)))
            self.entropy_window = None
        if self.loss_fn.entropy_bonus:  # the coefficient the next step applies (TRL logs it here too)
            self.log("train/entropy_coef", float(self.entropy_control.coef))

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        """Held-out reward: one greedy completion per prompt, or with ``num_generations_eval`` that many sampled
        ones (the training engine's settings), averaged."""
        engine, num = (self.greedy_engine, 1) if self.num_generations_eval is None else (self.engine,
                                                                                         self.num_generations_eval)
        rollout, prompts, completions = self.sample(engine, batch, num)
        per_func = self.score(batch, rollout, prompts, completions, num)
        rewards = (per_func * self.reward_weights).nansum(1)
        self.val_metrics["reward"].update(rewards)
        self.log("val/reward", self.val_metrics["reward"], prog_bar=True)
        for i, name in enumerate(self.reward_names):
            metric = self.val_metrics[f"rewards_{name}_mean"]
            values = per_func[:, i]
            if not values.isnan().all():
                metric.update(values[~values.isnan()])
                self.log(f"val/rewards/{name}/mean", metric)
        if "tool_calls" in self.val_metrics:  # tool calls per completion (TRL's tools/call_frequency)
            calls = self.val_metrics["tool_calls"]
            calls.update(torch.tensor(rollout.tool_calls / len(prompts), device=self.device), weight=len(prompts))
            self.log("val/tools/call_frequency", calls)

    test_step = validation_step
