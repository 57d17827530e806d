"""GRPO as a LightningModule: generate once per round, then train on the round's completions step by step.

``PromptDataModule`` hands every step the whole round's prompts with its position in the round (``round_pos``);
at ``round_pos == 0`` (or when the buffer is empty, e.g. after a resume) ``training_step`` samples
``num_generations`` completions per prompt, scores them, computes group-relative advantages and keeps the old-policy
and reference log-probs only when the loss needs them. Every step then takes its slice of that buffer. The math is in
``lit_align.losses``; sampling is behind ``lit_align.generation``.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from torchmetrics import MeanMetric

from lit_align.errors import LitAlignError
from lit_align.generation import HFSampler, NativeSampler
from lit_align.losses import (
    GRPO_LOSS_TYPES, SCALE_REWARDS, nanstd, aggregate_grpo_loss, group_advantages, grpo_token_losses,
)
from lit_align.logps import attention_mask_4d, next_token_logps
from lit_align.modules.base import AlignModule
from lit_align.rewards import import_reward, reward_name, score

SAMPLERS = {"hf": HFSampler, "native": NativeSampler}


def completion_token_logps(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature: float = 1.0,
                           with_entropy: bool = False, chunk_size: int | None = None):
    """Per-token log-probs ``[N, C]`` of the completions given left-padded prompts (logits divided by temperature).

    Position ids follow the attention mask, as in generation, so left padding does not shift positions.
    With ``with_entropy``, also the per-token entropy of the (tempered) distribution, without gradient.
    ``chunk_size``: chunked log-probs (``lit_align.logps``).
    """
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention_mask = torch.cat([prompt_mask, completion_mask], 1)
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    logps, stats = next_token_logps(model, input_ids, prompt_ids.shape[1], chunk_size, temperature,
                                    stats=("entropy",) if with_entropy else (), attention_mask=attention_mask,
                                    position_ids=position_ids)
    return logps, stats.get("entropy")


def packed_completion_logps(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature: float = 1.0,
                            with_entropy: bool = False, chunk_size: int | None = None):
    """``completion_token_logps`` without padding: the same ``[N, C]`` log-probs (and entropy), from one row.

    Every prompt's real tokens, then every completion's real tokens, go into a single sequence::

        [ p_1 | p_2 | ... | p_N | c_1 | c_2 | ... | c_N ]      positions restart in each prompt and go on in its
                                                               completion; a block-causal mask keeps the rows apart

    so the layers compute real tokens only, where a padded batch computes ``N * (P + C)`` positions however short most
    rows are (completion lengths have a long tail). The mask is ``[T, T]`` for ``T`` real tokens: for sdpa and eager
    attention, at batch sizes where that fits.
    """
    if getattr(model.config, "_attn_implementation", None) not in ("sdpa", "eager"):
        raise LitAlignError(f"padding_free needs sdpa or eager attention; the model uses "
                            f"{model.config._attn_implementation!r}")
    prompt_real, completion_real = prompt_mask.bool(), completion_mask.bool()
    prompt_lengths, rows = prompt_real.sum(1), torch.arange(len(prompt_ids), device=prompt_ids.device)
    input_ids = torch.cat([prompt_ids[prompt_real], completion_ids[completion_real]])[None]
    segment = torch.cat([rows.repeat_interleave(prompt_lengths), rows.repeat_interleave(completion_real.sum(1))])
    position = torch.cat([(prompt_real.cumsum(1) - 1)[prompt_real],
                          (completion_real.cumsum(1) - 1 + prompt_lengths[:, None])[completion_real]])
    allowed = (segment[:, None] == segment[None, :]) & (position[None, :] <= position[:, None])
    # each completion token is predicted by the token before it: its row's last prompt token for the first one
    start = int(prompt_lengths.sum())
    source = torch.arange(start - 1, input_ids.shape[1] - 1, device=input_ids.device)
    first_token = (completion_real.cumsum(1) == 1) & completion_real
    source[first_token[completion_real]] = prompt_lengths.cumsum(0)[first_token.any(1)] - 1
    logps, stats = next_token_logps(model, input_ids, start, chunk_size, temperature,
                                    stats=("entropy",) if with_entropy else (), source=source[None],
                                    attention_mask=attention_mask_4d(model, allowed[None, None]),
                                    position_ids=position[None])
    unpack = lambda flat: flat.new_zeros(completion_ids.shape).masked_scatter(completion_real, flat[0])  # noqa: E731
    return unpack(logps), None if not with_entropy else unpack(stats["entropy"])


def _repeat(values: list, times: int) -> list:
    return [v for v in values for _ in range(times)]


class GRPOModule(AlignModule):
    """Group Relative Policy Optimization, with TRL's loss types and metric names.

    Args:
        reward_funcs: dotted paths of reward functions (``lit_align.rewards.sort_accuracy``, ``my_pkg.mod.fn``).
        reward_weights: one weight per reward function (default: all 1.0); rewards are summed with these weights.
        loss_type: ``dapo`` (TRL's default), ``grpo``, ``bnpo`` or ``dr_grpo``.
        beta: KL coefficient to a frozen reference (k3 estimator); 0 (TRL's default) loads no reference.
        ref_model: the reference when ``beta > 0``; None: a frozen copy of the initial policy.
        epsilon: lower clipping bound of the ratio (``1 - epsilon``).
        epsilon_high: upper bound (``1 + epsilon_high``; default: ``epsilon``; DAPO uses 0.28).
        scale_rewards: ``group`` (divide by the group's std), ``batch`` or ``none``.
        mask_truncated_completions: leave completions that hit ``max_completion_length`` out of the loss.
        max_completion_length: tokens generated per completion at most.
        temperature: sampling temperature; the training log-probs use the same temperature, as TRL does.
        top_p: nucleus sampling (1.0: off).
        top_k: top-k sampling (0: off).
        engine: sampler: ``hf`` (transformers ``generate``) or ``native`` (lit_align's batched decode loop, faster).
        padding_free: compute each step's training log-probs with its rows packed into one sequence
            (``packed_completion_logps``): the same values, without the cost of padding. Pays with long-tailed
            lengths and few rows per step; with many short rows the packed row's attention (quadratic in its ``T``
            tokens) costs more than the padding saved. sdpa or eager attention; the mask is ``T * T`` bytes. The
            round-level no-grad passes (old and reference log-probs) stay padded.
    """

    def __init__(
        self,
        model: str = "builtin:tiny",
        reward_funcs: list[str] | None = None,
        reward_weights: list[float] | None = None,
        loss_type: str = "dapo",
        beta: float = 0.0,
        ref_model: str | None = None,
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        scale_rewards: str = "group",
        mask_truncated_completions: bool = False,
        max_completion_length: int = 64,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        engine: str = "hf",
        padding_free: bool = False,
        **kwargs,
    ):
        super().__init__(model=model, **kwargs)
        if loss_type not in GRPO_LOSS_TYPES:
            raise LitAlignError(f"model.loss_type {loss_type!r}: expected one of {GRPO_LOSS_TYPES}")
        if scale_rewards not in SCALE_REWARDS:
            raise LitAlignError(f"model.scale_rewards {scale_rewards!r}: expected one of {SCALE_REWARDS}")
        if temperature <= 0:
            raise LitAlignError(f"model.temperature must be > 0 (GRPO samples distinct completions), got {temperature}")
        if engine not in SAMPLERS:
            raise LitAlignError(f"model.engine {engine!r}: expected one of {sorted(SAMPLERS)}")
        reward_funcs = reward_funcs or ["lit_align.rewards.sort_accuracy"]
        self.reward_funcs = [import_reward(path) for path in reward_funcs]
        self.reward_names = [reward_name(fn) for fn in self.reward_funcs]
        weights = reward_weights or [1.0] * len(self.reward_funcs)
        if len(weights) != len(self.reward_funcs):
            raise LitAlignError(f"model.reward_weights has {len(weights)} values for {len(self.reward_funcs)} reward_funcs")
        self.register_buffer("reward_weights", torch.tensor(weights, dtype=torch.float32), persistent=False)
        self.loss_type, self.beta, self.ref_model_name = loss_type, beta, ref_model
        self.epsilon, self.epsilon_high, self.scale_rewards = epsilon, epsilon_high, scale_rewards
        self.mask_truncated_completions, self.max_completion_length = mask_truncated_completions, max_completion_length
        self.temperature, self.padding_free = temperature, padding_free
        self.sampler = SAMPLERS[engine](max_new_tokens=max_completion_length, temperature=temperature, top_p=top_p,
                                        top_k=top_k)
        self.greedy = SAMPLERS[engine](max_new_tokens=max_completion_length, temperature=0.0)
        self.round: dict[str, Any] | None = None  # the current generation round's buffer
        self.generation_rounds = 0
        self.generation_seed = torch.initial_seed()  # re-read at fit start (after ``seed_everything``)
        self.val_metrics = torch.nn.ModuleDict(
            {name: MeanMetric() for name in ["reward", *(f"rewards_{n}_mean" for n in self.reward_names)]})

    def configure_model(self) -> None:
        if self.policy is not None:
            return
        super().configure_model()
        if self.beta != 0.0:
            self.ref_model = self.load_reference(self.ref_model_name)

    # -- generation rounds -----------------------------------------------------------------------------------------
    def sample(self, sampler, batch: dict[str, Any], num_samples: int):
        tok = self.tokenizer
        rollout = sampler.generate(self.policy, batch["prompt_ids"], batch["prompt_mask"], num_samples,
                                   eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
        texts = tok.batch_decode(rollout.completion_ids, skip_special_tokens=True)
        prompts = _repeat(batch["prompts"], num_samples)
        completions = [[{"role": "assistant", "content": t}] if isinstance(p, list) else t for p, t in zip(prompts, texts)]
        columns = {k: _repeat(v, num_samples) for k, v in batch["columns"].items()}
        ids = [row[mask.bool()].tolist() for row, mask in zip(rollout.completion_ids, rollout.completion_mask)]
        return rollout, prompts, completions, self.score_completions(prompts, completions, ids, columns)

    def score_completions(self, prompts, completions, completion_ids, columns) -> torch.Tensor:
        """``[N, F]`` rewards, one column per reward function (NaN where a function returned None)."""
        per_func = [score(fn, prompts, completions, completion_ids, columns) for fn in self.reward_funcs]
        return torch.tensor(per_func, dtype=torch.float32, device=self.device).T.reshape(len(prompts), -1)

    @torch.no_grad()
    def generate_round(self, batch: dict[str, Any]) -> dict[str, Any]:
        num_generations, steps = batch["num_generations"], batch["steps_per_generation"]
        with self.round_rng():
            rollout, prompts, completions, per_func = self.sample(self.sampler, batch, num_generations)
        weighted = per_func * self.reward_weights
        rewards = torch.where(per_func.isnan().all(1), torch.nan, weighted.nansum(1))
        # as TRL: advantages over every rank's rewards (the same per group: a group stays on one rank; scale_rewards
        # batch divides by the global batch's std), then this rank's rows
        gather, rank = self.trainer.strategy.all_gather, self.trainer.global_rank
        all_rewards = gather(rewards).reshape(-1)
        mine = slice(rank * len(rewards), (rank + 1) * len(rewards))
        advantages = group_advantages(all_rewards, num_generations, self.scale_rewards)[mine]

        prompt_ids = batch["prompt_ids"].repeat_interleave(num_generations, 0)
        prompt_mask = batch["prompt_mask"].repeat_interleave(num_generations, 0)
        completion_ids, completion_mask = rollout.completion_ids, rollout.completion_mask
        loss_mask = completion_mask * (~rollout.truncated).unsqueeze(1) if self.mask_truncated_completions else completion_mask

        # old-policy log-probs matter only when the policy moves before these completions are used up, that is unless
        # the round's steps all fall in one accumulation window (TRL: gradient_accumulation_steps % generate_every)
        accumulate = self.trainer.accumulate_grad_batches
        old_logps = None
        if accumulate % (steps * batch["num_iterations"]):
            old_logps = rollout.logps
            if old_logps is None:
                old_logps = self._logps(self.network, prompt_ids, prompt_mask, completion_ids, completion_mask)[0]
        ref_logps = None
        if self.beta != 0.0:
            with self.reference_model() as ref:  # the frozen copy, or the policy with its adapters disabled (PEFT)
                ref_logps = self._logps(ref, prompt_ids, prompt_mask, completion_ids, completion_mask)[0]

        # dapo: every token of the round weighs the same; normalize by active tokens per step over all ranks
        num_tokens = self.trainer.strategy.reduce(loss_mask.sum().float(), reduce_op="sum")
        world = self.trainer.world_size
        lengths = completion_mask.sum(1).float()
        # std, min and max are over every rank's completions (gathered), not averages of per-rank values
        all_lengths = gather(lengths).reshape(-1)
        zero_std = (nanstd(rewards.view(-1, num_generations), dim=1) < 1e-6).float()  # as the advantages see it
        self.generation_rounds += 1
        stats = {
            "reward": rewards.nanmean(),
            "reward_std": nanstd(all_rewards.view(1, -1), dim=1).view(()),
            "frac_reward_zero_std": zero_std.mean(),
            "completions/mean_length": lengths.mean(),
            "completions/min_length": all_lengths.min(),
            "completions/max_length": all_lengths.max(),
            "completions/clipped_ratio": rollout.truncated.float().mean(),
            **{f"rewards/{n}/mean": per_func[:, i].nanmean() for i, n in enumerate(self.reward_names)},
        }
        order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(self.global_step)).tolist()
        return {
            "order": order, "steps": steps,
            "prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
            "completion_ids": completion_ids, "completion_mask": completion_mask, "loss_mask": loss_mask,
            "advantages": advantages, "old_logps": old_logps, "ref_logps": ref_logps,
            "num_tokens": float(num_tokens) / (world * steps),
            "stats": self.trainer.strategy.reduce(torch.stack(list(stats.values())), reduce_op="mean"),
            "stat_names": list(stats),
            "log": {"prompts": prompts, "completions": [c if isinstance(c, str) else c[0]["content"] for c in completions],
                    "rewards": rewards.tolist()},
        }

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
        rounds = [apply_to_collection(self.round, torch.Tensor, lambda t: t.cpu())]
        if torch.distributed.is_available() and torch.distributed.is_initialized() and self.trainer.world_size > 1:
            rounds = [None] * self.trainer.world_size
            torch.distributed.all_gather_object(rounds, apply_to_collection(self.round, torch.Tensor, lambda t: t.cpu()))
        checkpoint["lit_align_grpo"] = {"rounds": rounds, "generation_rounds": self.generation_rounds}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        state = checkpoint.get("lit_align_grpo", {})
        self.generation_rounds = state.get("generation_rounds", 0)
        rounds = state.get("rounds", [])
        # another world size: the round is regenerated (the resume is then not exact mid-round)
        world, rank = (self._trainer.world_size, self._trainer.global_rank) if self._trainer is not None else (1, 0)
        self.round = rounds[rank] if len(rounds) == world else None

    def on_train_start(self) -> None:
        if self.round is not None:  # restored from a checkpoint (on the CPU)
            self.round = apply_to_collection(self.round, torch.Tensor, lambda t: t.to(self.device))

    def _logps(self, model, prompt_ids, prompt_mask, completion_ids, completion_mask, with_entropy: bool = False,
               packed: bool = False):
        """Per-token log-probs (and entropy) of completions, padded or packed."""
        fn = packed_completion_logps if packed else completion_token_logps
        return fn(model, prompt_ids, prompt_mask, completion_ids, completion_mask, self.temperature,
                  with_entropy=with_entropy, chunk_size=self.logps_chunk_size)

    # -- what is computed -------------------------------------------------------------------------------------------
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        if batch["round_pos"] == 0 or self.round is None:
            self.round = self.generate_round(batch)
        r = self.round
        size = len(r["order"]) // r["steps"]
        k = batch["round_pos"] % r["steps"]
        rows = torch.tensor(r["order"][k * size : (k + 1) * size], device=self.device)
        # this step's rows, without the columns that are padding in all of them (the round is as wide as its longest
        # prompt and completion; a step's rows usually need less, and pad columns cost as much as real ones)
        start = int(r["prompt_mask"][rows].any(0).int().argmax())
        width = int(r["completion_mask"][rows].sum(1).max())
        columns = {"prompt_ids": slice(start, None), "prompt_mask": slice(start, None)}  # the rest: completions

        def take(key: str) -> torch.Tensor | None:
            if r[key] is None:
                return None
            return r[key][rows] if key == "advantages" else r[key][rows][:, columns.get(key, slice(width))]

        mask = take("loss_mask")
        logps, entropy = self._logps(self.network, take("prompt_ids"), take("prompt_mask"), take("completion_ids"),
                                     take("completion_mask"), with_entropy=True, packed=self.padding_free)
        token_losses, info = grpo_token_losses(logps, take("old_logps"), take("advantages"), self.epsilon,
                                               self.epsilon_high, take("ref_logps"), self.beta)
        loss = aggregate_grpo_loss(token_losses, mask, self.loss_type, self.max_completion_length, r["num_tokens"])
        prompt_rows = batch.get("rows")  # dataset index of each prompt; completion i of the round is of prompt i // G
        group = batch["num_generations"]
        dataset_rows = None if prompt_rows is None else [prompt_rows[i // group] for i in rows.tolist()]
        loss = self.guard_loss(loss, (token_losses * mask).sum(1), batch_idx, dataset_rows)
        if loss is None:  # skipped (on_nonfinite_loss: skip)
            return None

        denominator = mask.sum().clamp(min=1)
        masked_mean = lambda x: (x * mask).sum() / denominator  # noqa: E731
        step_stats = {
            "loss": loss.detach(),
            "entropy": masked_mean(entropy),
            "clip_ratio/low_mean": masked_mean(info["low_clipped"]),
            "clip_ratio/high_mean": masked_mean(info["high_clipped"]),
            "clip_ratio/region_mean": masked_mean(info["low_clipped"] + info["high_clipped"]),
        }
        if "kl" in info:
            step_stats["kl"] = masked_mean(info["kl"])
        values = self.trainer.strategy.reduce(torch.stack(list(step_stats.values())), reduce_op="mean")
        for name, value in zip([*step_stats, *r["stat_names"]], [*values, *r["stats"]]):
            self.log(f"train/{name}", value, prog_bar=name in ("loss", "reward"))
        self.log("train/generation_rounds", float(self.generation_rounds))
        return loss

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        """Held-out reward: one greedy completion per prompt."""
        per_func = self.sample(self.greedy, batch, 1)[3]
        rewards = (per_func * self.reward_weights).nansum(1)
        self.val_metrics["reward"].update(rewards)
        self.log("val/reward", self.val_metrics["reward"], prog_bar=True)
        for i, name in enumerate(self.reward_names):
            metric = self.val_metrics[f"rewards_{name}_mean"]
            values = per_func[:, i]
            if not values.isnan().all():
                metric.update(values[~values.isnan()])
                self.log(f"val/rewards/{name}/mean", metric)

    test_step = validation_step
