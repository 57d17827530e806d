"""What the online recipes share: rollouts, the round they feed, the reference, checkpoints and validation.

An online recipe samples completions from its own policy and trains on them. ``OnlineModule`` holds the rollout
component (``lit_align.rollouts.Rollouts``: engine, rewards, tools), the round's shape (``RoundShape``, handed to
``PromptDataModule``), the reference (``lit_align.reference.build_reference``) and a round's life: at a round's first
step (``round_pos == 0`` in the batch, or no round after a resume without one) ``make_round`` samples, scores, takes
the old-policy and reference log-probs the recipe needs and the recipe's advantages, and keeps a
``lit_align.generation_round.GenerationRound``; every step then trains on ``next_step(batch)``, its slice. The round
is in checkpoints, so a resume mid-round trains on what the interrupted run sampled. With ``async_rollouts`` the
policy's samples come from a producer process that runs ahead (``sample_round``; ``lit_align.producer``); the rest of
a round's life is the same.

A recipe (``GRPOModule``, ``RLOOModule``) adds its loss settings in ``__init__``, ``advantages`` (a round's advantages
from its rewards) and ``training_step`` (a step's loss on ``next_step(batch)``); ``old_logps`` when it reads the
sampling policy's log-probs differently. ``DistillationModule`` trains on no rewards (``rewards_required``) and one
completion per prompt (``grouped``), and makes some rounds from other completions (``assemble_round``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torchmetrics import MeanMetric

from lit_align.errors import LitAlignError
from lit_align.generation import SamplingConfig, VLLMOptions
from lit_align.generation_round import GenerationRound, RoundShape, StepBatch
from lit_align.losses.grpo import masked_total, nanstd, sequence_means
from lit_align.models import cast_lm_head_to_fp32
from lit_align.modules.base import AlignModule
from lit_align.producer import RolloutProducer, check_producer_device
from lit_align.reference import FrozenReference, build_reference
from lit_align.rewards import pass_at_k
from lit_align.rollouts import ZERO_STD, Generation, Rollouts, completion_token_logps  # noqa: F401 (its home)

CHECKPOINT_KEY = "lit_align_grpo"  # the round's entry in checkpoints (GRPO's name, kept: older checkpoints resume)


def check_online_settings(temperature: float, max_completion_length: int, num_generations_eval: int | None,
                          pass_threshold: float = 1.0) -> None:
    """Refuse a sampling setting an online recipe cannot train or validate with; warn of a ``pass_threshold`` that
    counts failures as solved (below 0, where rewards are 0 for a failure) without refusing it: rewards may be
    penalties, all below 0."""
    if temperature <= 0:
        raise LitAlignError(f"model.temperature must be > 0 (online recipes sample distinct completions), "
                            f"got {temperature}")
    if max_completion_length < 1:
        raise LitAlignError(f"model.max_completion_length must be >= 1 (tokens sampled per completion), "
                            f"got {max_completion_length}")
    if num_generations_eval is not None and num_generations_eval < 1:
        raise LitAlignError(f"model.num_generations_eval must be >= 1 or null (one greedy completion), "
                            f"got {num_generations_eval}")
    if not math.isfinite(pass_threshold):
        raise LitAlignError(f"model.pass_threshold must be a finite summed reward (a completion at least this good "
                            f"counts as solved in val/pass@k), got {pass_threshold}")
    if num_generations_eval is not None and pass_threshold < 0:
        rank_zero_warn(f"lit_align: model.pass_threshold is {pass_threshold}: a completion whose summed reward is 0 "
                       "(a failure, for accuracy rewards) counts as solved in val/pass@k; set the summed reward a "
                       "solved completion reaches (1.0, the default, for one accuracy reward)")


def check_async_settings(engine: str, dynamic_sampling: bool, rollout_func: str | None, max_staleness: int | None,
                         producer_threads: int | None, producer_device: str | None = None) -> None:
    """Refuse what asynchronous rollouts cannot run, in one line each."""
    why = {"engine": engine == "vllm" and "model.engine 'vllm' samples on vLLM's own copy of the weights (colocated "
                                          "with the trainer, or a server it syncs every step), not in a producer",
           "dynamic_sampling": dynamic_sampling and "model.dynamic_sampling decides across ranks while sampling",
           "rollout_func": rollout_func is not None and "model.rollout_func receives the trainer's module"}
    for name, reason in why.items():
        if reason:
            raise LitAlignError(f"model.async_rollouts: {reason}; it cannot run in the rollout producer: set "
                                f"model.async_rollouts: false, or leave out model.{name}")
    if max_staleness is not None and max_staleness < 0:
        raise LitAlignError(f"model.max_staleness must be >= 0 or null (one round), got {max_staleness}")
    if producer_threads is not None and producer_threads < 1:
        raise LitAlignError(f"model.producer_threads must be >= 1 or null, got {producer_threads}")
    check_producer_device(producer_device)


# round metrics that are counts over the whole run (or the weights' version): logged as they stand, not averaged
RUNNING_STATS = frozenset({"num_tokens", "async/dropped_rounds", "async/weights_version"})


class OnlineModule(AlignModule):
    """The online recipes' shared options (TRL's ``GRPOConfig`` / ``RLOOConfig`` names).

    Args:
        reward_funcs: reward functions: dotted paths (``lit_align.rewards.sort_accuracy``, ``my_pkg.mod.fn``; from
            Python, the functions themselves), ``{class_path, init_args}`` objects, plain or ``async``, with TRL's
            calling convention (``lit_align.rewards``); or reward models by hub name or directory
            (``lit_align.rewards.RewardModel``). Required, as in TRL: none is an error (no reward fits every dataset);
            distillation's are optional (they only watch the task).
        reward_weights: one weight per reward function (default: all 1.0); rewards are summed with these weights.
        num_generations: completions sampled per prompt (G). The module owns the round's shape
            (``lit_align.generation_round.RoundShape``) and hands it to the data (``PromptDataModule.connect``).
        steps_per_generation: training steps fed by one generation round, each on its own slice of the completions.
        num_iterations: passes over each round's completions (TRL's mu).
        generation_batch_size: TRL's alternative to ``steps_per_generation`` (set one of them): the completions of
            one round on every device, ``data.batch_size * devices * steps_per_generation``.
        dynamic_sampling: DAPO's dynamic sampling: leave out of the round the groups whose completions all got the
            same reward (zero advantage: they teach nothing) and sample further prompts in their place, up to
            ``max_num_gen_batches`` batches of the round's prompts per round (DAPO / verl's ``filter_groups``). The
            data serves that many batches per round, and the ones a round did not need are skipped; when the last
            one is sampled and groups are still missing, the round is filled with groups left out. Metrics:
            ``dynamic_sampling/kept_groups``, ``sampled_groups``, ``gen_batches``.
        max_num_gen_batches: with ``dynamic_sampling``, generation batches per round at most (verl's name).
        beta: the KL coefficient to a frozen reference; 0 loads no reference. GRPO puts the KL in its loss, RLOO in
            the rewards.
        ref_model: the reference when ``beta != 0``; None: a frozen copy of the initial policy (under LoRA: the
            policy with its adapters disabled).
        sync_ref_model: TR-DPO's reference sync: every ``ref_model_sync_steps`` optimizer steps,
            ``ref <- ref_model_mixup_alpha * policy + (1 - ref_model_mixup_alpha) * ref``
            (``lit_align.reference.RefModelSync``). Needs ``beta != 0`` and no ``peft_config``.
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
            default): one greedy completion. ``val/reward`` is their mean; with samples, ``val/pass@k`` (the unbiased
            estimator, ``lit_align.rewards.pass_at_k``, for k = 1, 2, 4, ... and ``num_generations_eval``) and
            ``val/mean@k`` (the mean reward over the k = ``num_generations_eval`` samples) are logged too.
        pass_threshold: the summed reward at which a sampled completion counts as solved for ``val/pass@k``.
        engine: the generation engine: ``auto`` (the default: ``native`` where it decodes the model on CPU, else
            ``hf``), ``hf`` (transformers ``generate``), ``native`` (lit_align's batched decode loop, faster) or
            ``vllm`` (TRL's ``use_vllm``: a vLLM engine in the training process, or a vLLM server with
            ``vllm_mode: server``; its own environment, see ``docs/grpo.md``).
        padding_free: compute each step's training log-probs with its rows packed without padding, several per row,
            one row on CPU under sdpa, else rows as wide as the longest (``lit_align.layouts.packed_rows``,
            ``packing_width``), each prompt once for the step's completions of it (``shared_prompt_completions``;
            in one row, the prompts' common start once too where they have one),
            the LM head on completion tokens only: the same values, without the cost of completions that ended
            early, of prompt padding and of repeated prompts. sdpa or eager attention. The round-level no-grad passes
            (old and reference log-probs) stay padded. None (the default): on where it is exact and cheaper
            (``lit_align.layouts.packs_by_default``: a Llama-like model under sdpa on CPU), off elsewhere.
        vllm_mode: ``colocate`` (a vLLM engine in the training process) or ``server`` (a vLLM server started
            apart, ``trl vllm-serve``'s: ``lit_align.generation.vllm_server``). The ``vllm_*`` options are TRL's flat
            names for the vLLM engine's options, routed to it (``lit_align.generation.vllm.VLLMOptions``, which checks
            them) when ``engine`` is ``vllm``.
        vllm_gpu_memory_utilization: with ``engine: vllm``, the fraction of GPU memory vLLM takes (weights and KV
            cache; on CPU of the RAM, unless ``VLLM_CPU_KVCACHE_SPACE`` sets the KV cache in GiB).
        vllm_tensor_parallel_size: GPUs one vLLM engine spans (only 1: an engine per rank).
        vllm_max_model_length: vLLM's context window (None: the model's): at least the longest prompt plus
            ``max_completion_length``.
        vllm_enable_sleep_mode: free vLLM's weights and KV cache during training steps (pushed back before each
            generation): less GPU memory, some transfer time.
        vllm_structured_outputs_regex: with ``engine: vllm``, constrain every completion to this regular expression
            (vLLM's structured outputs; None: free text).
        vllm_server_base_url: with ``vllm_mode: server``, the server's URL (e.g. ``http://10.0.0.2:8000``); None:
            ``http://<vllm_server_host>:<vllm_server_port>``.
        vllm_server_host: the server's host when ``vllm_server_base_url`` is None.
        vllm_server_port: the server's port when ``vllm_server_base_url`` is None.
        vllm_server_timeout: seconds to wait for the server's ``/health`` before one ``error:`` line.
        vllm_group_port: the NCCL group's port through which the weights reach a server on a GPU.
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
        async_rollouts: sample rounds in another process while the policy trains (``lit_align.producer``): the
            producer holds its own copy of the policy, samples and scores the rounds ahead of their turn, and gets
            the trainer's weights every ``weight_sync_steps`` optimizer steps; the old log-probs of a round sampled
            by older weights are the producer's (TRL's ``AsyncGRPOTrainer``: the loss's clipped ratio is to the
            policy that sampled). Validation still samples in the trainer. See ``docs/grpo.md``.
        max_staleness: with ``async_rollouts``, how many optimizer steps older than the step that starts training
            on it a round's weights may be (TRL's ``max_staleness``); a staler round is dropped and sampled again
            by the current policy. The producer runs ``max_staleness // (optimizer steps per round)`` rounds ahead;
            0 is the synchronous limit (each round sampled by the current weights: the same run as without
            ``async_rollouts``). None (the default): one round's optimizer steps (one round ahead).
        weight_sync_steps: the trainer's weights go to what samples on its own copy of them (the producer of
            ``async_rollouts``, a vLLM engine or server) every this many optimizer steps (TRL's; 1: every step).
        producer_threads: with ``async_rollouts`` on CPU, the producer's threads; the trainer keeps the rest of its
            own (None: half of them each).
        producer_device: with ``async_rollouts``, where the producer's policy runs (e.g. ``cuda:1``: sampling on a GPU
            of its own); None: the trainer's device. Weights reach it through the CPU (shared memory).
    """

    resume_may_change = ("engine", "vllm_gpu_memory_utilization", "vllm_max_model_length", "vllm_enable_sleep_mode",
                         "vllm_mode", "vllm_server_base_url", "vllm_server_host", "vllm_server_port",
                         "vllm_server_timeout", "vllm_group_port", "num_generations_eval", "pass_threshold",
                         "async_rollouts", "max_staleness", "weight_sync_steps", "producer_threads",
                         "producer_device")
    rewards_required = True  # the recipe trains on rewards: no reward function is an error (distillation: optional)
    grouped = True  # the recipe compares a prompt's completions with each other (``RoundShape.grouped``)

    def __init__(
        self,
        model: str = "builtin:tiny",
        reward_funcs: list[str | dict] | None = None,
        reward_weights: list[float] | None = None,
        num_generations: int = RoundShape.num_generations,
        steps_per_generation: int | None = None,
        num_iterations: int = RoundShape.num_iterations,
        generation_batch_size: int | None = None,
        dynamic_sampling: bool = False,
        max_num_gen_batches: int = 3,
        beta: float = 0.0,
        ref_model: str | None = None,
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
        pass_threshold: float = 1.0,
        engine: str = "auto",
        padding_free: bool | None = None,
        vllm_mode: str = "colocate",
        vllm_gpu_memory_utilization: float = 0.3,
        vllm_tensor_parallel_size: int = 1,
        vllm_max_model_length: int | None = None,
        vllm_enable_sleep_mode: bool = False,
        vllm_structured_outputs_regex: str | None = None,
        vllm_server_base_url: str | None = None,
        vllm_server_host: str = "0.0.0.0",
        vllm_server_port: int = 8000,
        vllm_server_timeout: float = 240.0,
        vllm_group_port: int = 51216,
        tools: list[str | dict] | None = None,
        max_tool_calling_iterations: int | None = None,
        environment_factory: str | dict | None = None,
        rollout_func: str | None = None,
        async_rollouts: bool = False,
        max_staleness: int | None = None,
        weight_sync_steps: int = 1,
        producer_threads: int | None = None,
        producer_device: str | None = None,
        **kwargs,
    ):
        super().__init__(model=model, **kwargs)
        check_online_settings(temperature, max_completion_length, num_generations_eval, pass_threshold)
        if weight_sync_steps < 1:
            raise LitAlignError(f"model.weight_sync_steps must be >= 1, got {weight_sync_steps}")
        if async_rollouts:
            check_async_settings(engine, dynamic_sampling, rollout_func, max_staleness, producer_threads,
                                 producer_device)
        self.round_shape = RoundShape(num_generations, steps_per_generation, num_iterations, generation_batch_size,
                                      max_num_gen_batches if dynamic_sampling else 1, grouped=self.grouped)
        self.beta, self.temperature, self.padding_free = beta, temperature, padding_free
        self.mask_truncated_completions, self.max_completion_length = mask_truncated_completions, max_completion_length
        self.num_generations_eval, self.pass_threshold = num_generations_eval, pass_threshold
        self.reference, self.ref_sync = build_reference(
            ref_model, self.lora_config is not None, enabled=beta != 0.0, sync_ref_model=sync_ref_model,
            ref_model_mixup_alpha=ref_model_mixup_alpha, ref_model_sync_steps=ref_model_sync_steps)
        self.sampling = SamplingConfig(max_completion_length, temperature, top_p, top_k, min_p=min_p,
                                       repetition_penalty=repetition_penalty, generation_kwargs=generation_kwargs)
        vllm = VLLMOptions.from_flat(self.hparams) if engine == "vllm" else None
        self.importance_sampling = None if vllm is None else self.sampling_correction(vllm)
        self.rollouts = Rollouts(reward_funcs, reward_weights, self.sampling, engine, vllm, self.weights_version,
                                 tools, max_tool_calling_iterations, environment_factory, rollout_func,
                                 rewards_required=self.rewards_required)
        # what the producer builds its own Rollouts from (``lit_align.producer``)
        self.rollouts_settings = dict(
            reward_funcs=reward_funcs, reward_weights=reward_weights, sampling=self.sampling, engine=engine,
            tools=tools, max_tool_calling_iterations=max_tool_calling_iterations,
            environment_factory=environment_factory, rewards_required=self.rewards_required)
        self.producer: RolloutProducer | None = None  # started with training (``on_train_start``)
        self.register_buffer("reward_weights", self.rollouts.reward_weights, persistent=False)
        self.round, self.generation_rounds, self.generation_seed = None, 0, torch.initial_seed()  # (see make_round)
        self.val_metrics = self.validation_metrics()

    def validation_metrics(self) -> torch.nn.ModuleDict:
        """The ``val/*`` means: the reward, each function's, with tools the calls per completion, with samples
        pass@k and mean@k."""
        names = ["reward", *(f"rewards_{n}_mean" for n in self.rollouts.reward_names)]
        names += ["tool_calls"] * self.rollouts.uses_tools + [f"pass@{k}" for k in self.pass_ks()]
        names += ["mean@k"] * (self.num_generations_eval is not None)
        return torch.nn.ModuleDict({n: MeanMetric() for n in names})

    def pass_ks(self) -> list[int]:
        """The k of ``val/pass@k``: 1, 2, 4, ... up to ``num_generations_eval``, and it (none when greedy)."""
        n = self.num_generations_eval
        return [] if n is None else sorted({2**i for i in range(n.bit_length()) if 2**i <= n} | {n})

    def data_settings(self) -> dict:
        """The data follows the round's shape and renders the tools' schemas (``PromptDataModule.connect``)."""
        return {**super().data_settings(), "round_shape": self.round_shape,
                "tools": self.rollouts.tool_schemas or None}

    def connected(self, answer: Any) -> None:
        """The data's answer to ``connect``: the round's shape resolved against its batch size (TRL's
        ``generation_batch_size``)."""
        if isinstance(answer, RoundShape):
            self.round_shape = answer

    def sampling_correction(self, vllm: VLLMOptions) -> tuple[str, float | None, float | None] | None:
        """How the recipe's loss corrects for vLLM's sampling (``VLLMOptions.importance_sampling``); None: it does
        not."""
        return None

    def configure_model(self) -> None:
        super().configure_model()
        hp = self.hparams
        if hp.cast_lm_head_to_fp32 and not getattr(self.network.get_output_embeddings(), "fp32_matmul", False):
            cast_lm_head_to_fp32(self.network)
            if isinstance(self.reference, FrozenReference):  # a reference under LoRA is the policy itself
                cast_lm_head_to_fp32(self.reference.model)
        self.rollouts.setup(self.tokenizer, self.network, hp.dtype, hp.trust_remote_code, hp.model_init_kwargs)

    def weights_version(self) -> int:
        """The policy weights' version, for engines that hold a copy of them (vllm, colocated or a server): the
        optimizer steps taken, rounded down to a multiple of ``weight_sync_steps`` (the engine loads new weights
        when it changes)."""
        return self.global_step - self.global_step % self.hparams.weight_sync_steps

    def completion_logps(self, network, prompt_ids, prompt_mask, completion_ids, completion_mask,
                         with_entropy: bool = False, padding_free: bool | None = False, entropy_grad: bool = False):
        """``completion_token_logps`` at this module's temperature and chunk size."""
        return completion_token_logps(network, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                      self.temperature, with_entropy, self.logps_chunk_size, padding_free,
                                      entropy_grad)

    # -- a round: sampled once, then trained on step by step -----------------------------------------------------------
    def next_step(self, batch: dict[str, Any]) -> StepBatch:
        """This step's slice of the round, sampling a new round at its first step (or when none was restored)."""
        if batch["round_pos"] == 0 or self.round is None:
            self.round = self.make_round(batch)
            stats = self.round.stats  # once a round, as TRL logs its rollouts' metrics; running counts as they stand
            self.log_mean({k: v for k, v in stats.items() if k not in RUNNING_STATS}, prog_bar=("reward",))
            for name in RUNNING_STATS & stats.keys():
                self.log(f"train/{name}", stats[name])
        return self.round.step_batch(batch["round_pos"])

    def round_seed(self, ahead: int = 0) -> int:
        """A round samples from an RNG seeded by (run seed, round number, rank), not from the global stream: its
        completions then depend only on the policy and the round, so a resumed run regenerates exactly what the
        uninterrupted run did (the global stream also feeds DataLoader workers, validation, ... and is not in
        checkpoints), and a producer sampling ``ahead`` rounds before their turn draws what the trainer would."""
        index = self.generation_rounds + ahead
        return (self.generation_seed + 1_000_003 * index + 7_919 * self.global_rank) % 2**63

    @torch.no_grad()
    def make_round(self, batch: dict[str, Any]) -> GenerationRound:
        """Sample and score the round's prompts (``Rollouts.generate``), then what the recipe trains on
        (``assemble_round``)."""
        shape, rollouts = self.round_shape, self.rollouts
        if shape.prompt_batches > 1:  # dynamic sampling
            groups = len(batch["prompts"]) // shape.prompt_batches
            gen, sampled = rollouts.generate_groups(self, batch, shape.num_generations, groups, self.round_seed())
        else:
            gen = sampled = self.sample_round(batch)
        return self.assemble_round(batch, gen, sampled)

    def sample_round(self, batch: dict[str, Any]) -> Generation:
        """The policy's completions of the round's prompts, scored: sampled here, or with ``async_rollouts`` the
        producer's (``lit_align.producer.RolloutProducer.round``)."""
        if self.producer is None:
            return self.rollouts.generate(self, batch, self.round_shape.num_generations, seed=self.round_seed())
        return self.producer.round(self, batch)

    # -- asynchronous rollouts (model.async_rollouts; lit_align.producer) ---------------------------------------------
    def policy_samples(self, ahead: int) -> bool:
        """Whether the round ``ahead`` rounds from now trains on the policy's samples (the producer samples those);
        distillation's off-policy rounds do not."""
        return True

    def assemble_round(self, batch: dict[str, Any], gen: Generation, sampled: Generation) -> GenerationRound:
        """The round of the completions ``gen`` (``sampled``: everything sampled for them, for the metrics): the old
        and reference log-probs the recipe needs, its advantages, the loss tokens and the order its steps take them."""
        shape, rollouts = self.round_shape, self.rollouts
        stats = {**rollouts.stats(self.trainer, sampled, shape.num_generations), **self.dynamic_stats(gen, sampled)}
        loss_mask = gen.sampled_mask
        if self.mask_truncated_completions:
            loss_mask = loss_mask * (~gen.truncated).unsqueeze(1)
        sequences = (gen.prompt_ids, gen.prompt_mask, gen.completion_ids, gen.completion_mask)
        old_logps, is_ratio, sampling_stats = self.old_logps(gen, sequences)
        ref_logps = None
        if self.reference is not None:
            ref_logps = self.reference.logps(batch, lambda network: self.completion_logps(network, *sequences)[0])
        advantages = self.advantages(gen, old_logps, ref_logps, loss_mask)
        # dapo: every token of the round weighs the same; normalized by the loss tokens per step (all ranks)
        num_tokens = self.trainer.strategy.reduce(loss_mask.sum().float(), reduce_op="sum")
        seen = self.trainer.strategy.reduce((gen.prompt_mask.sum() + gen.sampled_mask.sum()).float(), reduce_op="sum")
        self.num_tokens += float(seen)  # TRL's num_tokens: prompt and model tokens so far (tool turns are not)
        stats["num_tokens"] = torch.tensor(self.num_tokens, device=self.device)
        self.generation_rounds += 1
        order = torch.randperm(len(gen.prompts), generator=torch.Generator().manual_seed(self.global_step)).tolist()
        names = self.rollouts.reward_names
        return GenerationRound(
            *sequences, loss_mask, advantages, old_logps, ref_logps, order=order, steps=shape.steps_per_generation,
            num_tokens=shape.tokens_per_step(float(num_tokens), self.trainer.world_size),
            stats={**stats, **sampling_stats}, prompts=gen.prompts, completions=gen.completion_texts,
            rewards=gen.rewards.tolist(), reward_funcs={n: gen.per_func[:, i].tolist() for i, n in enumerate(names)},
            dataset_rows=gen.dataset_rows, extra=gen.columns, is_ratio=is_ratio, tool_mask=gen.tool_mask,
            sampling_logps=self.kept_sampling_logps(gen, is_ratio))

    def dynamic_stats(self, trained: Generation, sampled: Generation) -> dict[str, torch.Tensor]:
        """Dynamic sampling's metrics, summed over ranks: the trained groups whose rewards differ, the groups
        sampled, and the generation batches per rank (none without dynamic sampling)."""
        if self.round_shape.prompt_batches == 1:
            return {}
        group = self.round_shape.num_generations
        spread = nanstd(trained.rewards.view(-1, group), dim=1) >= ZERO_STD
        counts = torch.tensor([float(spread.sum()), len(sampled.rewards) / group,
                               len(sampled.rewards) / len(trained.rewards)], device=self.device)
        kept, sampled_groups, batches = self.trainer.strategy.reduce(counts, reduce_op="sum")
        return {"dynamic_sampling/kept_groups": kept, "dynamic_sampling/sampled_groups": sampled_groups,
                "dynamic_sampling/gen_batches": batches / self.trainer.world_size}

    def kept_sampling_logps(self, generation: Generation, is_ratio: torch.Tensor | None) -> torch.Tensor | None:
        """The engine's log-probs a recipe's loss reads beside the old ones (GRPO's off-policy mask); None: none."""
        return None

    def old_logps(self, generation: Generation, sequences: tuple) -> tuple[torch.Tensor | None, None, dict]:
        """``(old log-probs, importance weights, sampling/* metrics)``. The old (sampling) policy's log-probs matter
        only when the policy moves before the round is used up (``RoundShape.needs_old_logps``) or moved since it
        was sampled (``stale``: then the producer's, TRL's ``AsyncGRPOTrainer``'s): the engine's, or a forward
        pass."""
        if not self.round_shape.needs_old_logps(self.trainer.accumulate_grad_batches) and not self.stale(generation):
            return None, None, {}
        if generation.logps is not None:
            return generation.logps, None, {}
        return self.completion_logps(self.network, *sequences)[0], None, {}

    def stale(self, generation: Generation) -> bool:
        """Whether older weights than the policy's now sampled ``generation`` (an asynchronous round): its old
        log-probs are then the sampling weights' (the producer's), whatever the round's shape."""
        return generation.weights_version is not None and generation.weights_version != self.global_step

    def advantages(self, generation: Generation, old_logps: torch.Tensor | None, ref_logps: torch.Tensor | None,
                   loss_mask: torch.Tensor) -> torch.Tensor:
        """``[N]`` this rank's advantages, from every rank's rewards (a group stays on one rank)."""
        raise NotImplementedError

    def gathered(self, values: torch.Tensor) -> torch.Tensor:
        """Every rank's ``values`` (rows ``[N, ...]``), concatenated in rank order."""
        return self.trainer.strategy.all_gather(values).reshape(-1, *values.shape[1:])

    def mine(self, values: torch.Tensor, rows: int) -> torch.Tensor:
        """This rank's ``rows`` of values gathered over every rank (``gathered``)."""
        rank = self.trainer.global_rank
        return values[rank * rows : (rank + 1) * rows]

    # -- logging -------------------------------------------------------------------------------------------------------
    def log_step(self, loss, entropy, info: dict[str, torch.Tensor], mask: torch.Tensor,
                 extra: dict[str, torch.Tensor] | None = None) -> None:
        """TRL's per-step metrics: the loss (and each 0-d value of ``extra``) averaged over ranks; the token means
        (entropy, the clip ratios, each ``[sum, count]`` of ``extra``: ``masked_total``) over every rank's tokens, as
        TRL's global masked means; ``clip_ratio/low_min`` and ``high_max`` over every rank's completions. The round's
        metrics are logged where it is made (``next_step``)."""
        entropy = entropy.detach()
        mask, one = mask.to(entropy.dtype), torch.ones((), device=entropy.device)
        parts = {"loss": torch.stack([loss.detach().float(), one]), "entropy": masked_total(entropy, mask)}
        per_sequence = {}
        if "low_clipped" in info:
            low, high = info["low_clipped"], info["high_clipped"]
            parts |= {"clip_ratio/low_mean": masked_total(low, mask),
                      "clip_ratio/high_mean": masked_total(high, mask),
                      "clip_ratio/region_mean": masked_total(low + high, mask)}
            per_sequence = {"clip_ratio/low_min": sequence_means(low, mask),
                            "clip_ratio/high_max": sequence_means(high, mask)}
        for name, value in (extra or {}).items():
            parts[name] = value.detach() if value.dim() else torch.stack([value.detach().float(), one])
        strategy = self.trainer.strategy
        sums = strategy.reduce(torch.stack([part.float() for part in parts.values()]), reduce_op="sum")
        metrics = dict(zip(parts, sums[:, 0] / sums[:, 1].clamp(min=1.0)))
        for name, seq in per_sequence.items():
            gathered = strategy.all_gather(seq).reshape(-1)
            gathered = gathered[~gathered.isnan()]
            value = gathered.min() if name.endswith("min") else gathered.max()
            metrics[name] = value if gathered.numel() else torch.tensor(torch.nan)
        self.log_mean(metrics, prog_bar=("loss",))
        self.log("train/generation_rounds", float(self.generation_rounds))

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
        checkpoint[CHECKPOINT_KEY] = {"rounds": rounds, "generation_rounds": self.generation_rounds}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        state = checkpoint.get(CHECKPOINT_KEY, {})
        self.generation_rounds = state.get("generation_rounds", 0)
        rounds = state.get("rounds", [])
        # another world size: the round is regenerated (the resume is then not exact mid-round)
        world, rank = (self._trainer.world_size, self._trainer.global_rank) if self._trainer is not None else (1, 0)
        mine = rounds[rank] if len(rounds) == world else None
        self.round = None if mine is None else GenerationRound(**mine)

    def on_train_start(self) -> None:
        super().on_train_start()
        if self.round is not None:  # restored from a checkpoint (on the CPU)
            self.round = self.round.to(self.device)
        if self.hparams.async_rollouts:
            self.producer = RolloutProducer(self)

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        """With ``async_rollouts``: the producer learns of the step (``RolloutProducer.after_step``)."""
        super().on_train_batch_end(outputs, batch, batch_idx)
        if self.producer is not None:
            self.producer.after_step(self.global_step)

    def on_train_end(self) -> None:
        self.stop_producer()

    def teardown(self, stage: str) -> None:
        """The producer stops with the run, however it ends (an error, Ctrl-C)."""
        self.stop_producer()
        super().teardown(stage)

    def stop_producer(self) -> None:
        if self.producer is not None:
            self.producer.close()
            self.producer = None

    # -- held-out reward -----------------------------------------------------------------------------------------------
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        """Held-out reward: one greedy completion per prompt, or with ``num_generations_eval`` that many sampled
        ones (the training engine's settings), averaged."""
        self.log_val_rewards(self.val_generation(batch))

    def val_generation(self, batch: dict[str, Any]) -> Generation:
        """A validation batch's completions, scored: one greedy per prompt, or ``num_generations_eval`` sampled."""
        num = self.num_generations_eval or 1
        return self.rollouts.generate(self, batch, num, greedy=self.num_generations_eval is None)

    def log_val_rewards(self, gen: Generation) -> None:
        """``val/reward``, each function's mean, with tools the calls per completion, with samples pass@k."""
        rewards = gen.rewards.nan_to_num(0.0)
        self.val_metrics["reward"].update(rewards)
        self.log("val/reward", self.val_metrics["reward"], prog_bar=True)
        for i, name in enumerate(self.rollouts.reward_names):
            metric = self.val_metrics[f"rewards_{name}_mean"]
            values = gen.per_func[:, i]
            if not values.isnan().all():
                metric.update(values[~values.isnan()])
                self.log(f"val/rewards/{name}/mean", metric)
        if "tool_calls" in self.val_metrics:  # tool calls per completion (TRL's tools/call_frequency)
            calls, rows = self.val_metrics["tool_calls"], len(gen.prompts)
            calls.update(torch.tensor(gen.tool_calls / rows, device=self.device), weight=rows)
            self.log("val/tools/call_frequency", calls)
        if self.num_generations_eval is not None:
            self.log_pass_at_k(rewards.view(-1, self.num_generations_eval))

    def log_pass_at_k(self, rewards: torch.Tensor) -> None:
        """``val/pass@k`` over each prompt's ``[P, n]`` sampled rewards (solved: at least ``pass_threshold``), and
        ``val/mean@n``, their mean reward (``val/reward``'s figure, under the name the pass@k literature uses)."""
        solved = rewards >= self.pass_threshold
        for k in self.pass_ks():
            metric = self.val_metrics[f"pass@{k}"]
            metric.update(pass_at_k(solved, k).float())
            self.log(f"val/pass@{k}", metric)
        self.val_metrics["mean@k"].update(rewards.flatten())
        self.log(f"val/mean@{rewards.shape[1]}", self.val_metrics["mean@k"])

    test_step = validation_step
