"""Rollouts: a round's prompts in, its completions, masks and rewards out. What every online recipe samples with.

``Rollouts`` holds what makes and scores completions: the sampling settings, the engine (and its greedy twin for
validation), the reward functions with their weights, and the tools / ``environment_factory`` / ``rollout_func`` a
rollout may run instead of a plain sample. ``generate(module, batch, num_samples)`` turns a batch of prompts into a
``Generation``: per completion its prompt and completion ids and masks, the tool mask, the sampling log-probs (when the
engine has them) and every reward function's value; ``stats`` gives TRL's rollout metrics of one, and
``generate_groups`` is DAPO's dynamic sampling over several batches; ``completion_token_logps`` the per-token
log-probs of completions, which the recipes and the asynchronous producer both take. It knows nothing of
advantages, old or reference log-probs or losses: those are the recipe's (``lit_align.modules.online``), so GRPO,
RLOO, distillation and the recipes to come share it, and an asynchronous producer can run it elsewhere.

``module`` is the LightningModule whose policy samples: it gives the policy, its tokenizer and device, the trainer's
state for reward functions (TRL's ``trainer_state``), the strategy that gathers metrics over ranks, and is what a
``rollout_func`` receives (TRL passes its trainer).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from functools import partial
from typing import Any

import torch

from lit_align import layouts
from lit_align.errors import LitAlignError
from lit_align.generation import SamplingConfig, VLLMOptions, make_engine
from lit_align.generation.environments import Environments
from lit_align.generation.rollout_func import rollout_from_output
from lit_align.generation.tools import ToolLoop, load_tool, tool_schema, turns_text
from lit_align.imports import callable_name
from lit_align.logps import layout_logps
from lit_align.losses.grpo import nanstd
from lit_align.rewards import RewardModel, RewardState, load_reward, score_all


# a group whose rewards' std is below this scored all its completions alike: identical fp32 rewards have a std of
# float noise (0.7 eight times: 6.4e-8), which must not count as a spread (dynamic sampling keeps groups by it)
ZERO_STD = 1e-6


def completion_token_logps(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature: float = 1.0,
                           with_entropy: bool = False, chunk_size: int | None = None, padding_free: bool | None = False,
                           entropy_grad: bool = False):
    """Per-token log-probs ``[N, C]`` of completions after left-padded prompts, logits divided by ``temperature``
    (and, ``with_entropy``, the tempered distribution's entropy, without gradient unless ``entropy_grad``); 0 at
    padding. Laid out by ``lit_align.layouts.completions``."""
    layout = layouts.completions(prompt_ids, prompt_mask, completion_ids, completion_mask, padding_free, model)
    out = layout_logps(model, layout, ("entropy",) if with_entropy else (), chunk_size, temperature, entropy_grad)
    return out.tokens, out.stats.get("entropy")


def repeat_each(values: list, times: int) -> list:
    """Each value ``times`` times in a row (a prompt's completions are consecutive rows)."""
    return [v for v in values for _ in range(times)]


def load_rewards(specs: list[str | dict] | None, weights: list[float] | None,
                 owned: list | None = None, required: bool = True) -> tuple[list, list[str], list[float]]:
    """``(reward functions, their names, their weights)`` from ``model.reward_funcs`` / ``model.reward_weights``, and
    the rewards environments own (``owned``: weight 1, after them, as TRL). ``required``: none at all is an error (a
    recipe that trains on rewards); else none is an empty list (distillation: rewards only watch the task)."""
    owned = owned or []
    if not specs and (owned or not required):
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


@dataclass
class Generation:
    """One batch's rollouts: ``N = prompts * num_samples`` rows, each prompt's samples consecutive."""

    prompt_ids: torch.Tensor  # [N, P] left-padded: each completion's prompt (its own, after an environment's reset)
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor  # [N, C] right-padded
    completion_mask: torch.Tensor  # 1 on every completion token, tool turns included
    sampled_mask: torch.Tensor  # 1 on the tokens the policy sampled: completion_mask without tool turns
    truncated: torch.Tensor  # [N] bool: no EOS within max_completion_length
    logps: torch.Tensor | None  # [N, C] the engine's sampling log-probs, or None
    tool_mask: torch.Tensor | None  # [N, C] with tools: 0 on tool turns' tokens
    per_func: torch.Tensor  # [N, F] each reward function's value (NaN where it returned None)
    rewards: torch.Tensor  # [N] the weighted sum (NaN where every function returned None)
    prompts: list  # per row: the prompt, and the completion (text, or the assistant's turns)
    completions: list
    dataset_rows: list[int] | None = None  # per row: the dataset index of its prompt
    columns: dict[str, list] = field(default_factory=dict)  # per row: what reward functions logged (log_extra)
    metrics: dict[str, list[float]] = field(default_factory=dict)  # what reward functions logged (log_metric)
    tool_calls: int = 0  # tool calls in these rollouts, and how many of them failed
    tool_failures: int = 0
    weights_version: int | None = None  # the policy's step that sampled them, when not the current one here (async)

    @property
    def completion_texts(self) -> list[str]:
        return [c if isinstance(c, str) else turns_text(c) for c in self.completions]

    def select(self, rows: list[int]) -> Generation:
        """These rows, in this order (tool counts and logged metrics stay the whole batch's)."""
        index = torch.tensor(rows, dtype=torch.long, device=self.rewards.device)

        def take(value):
            if isinstance(value, torch.Tensor):
                return value[index]
            if isinstance(value, list):
                return [value[i] for i in rows]
            if isinstance(value, dict) and value is self.columns:
                return {k: take(v) for k, v in value.items()}
            return value

        return Generation(**{f.name: take(getattr(self, f.name)) for f in fields(self)})

    def to(self, device: torch.device | str) -> Generation:
        """These rollouts with their tensors on ``device``."""
        return Generation(**{f.name: (value.to(device) if isinstance(value := getattr(self, f.name), torch.Tensor)
                                      else value) for f in fields(self)})

    @staticmethod
    def concat(parts: list[Generation]) -> Generation:
        """Several batches' rollouts as one: prompts left-padded and completions right-padded to the widest."""
        def pad(values: list, left: bool):
            width = max(v.shape[1] for v in values)
            return torch.cat([torch.nn.functional.pad(v, (width - v.shape[1], 0) if left else (0, width - v.shape[1]))
                              for v in values])

        def join(name: str):
            values = [getattr(p, name) for p in parts]
            if values[0] is None or name == "weights_version":
                return values[0]
            if name in ("prompt_ids", "prompt_mask"):
                return pad(values, left=True)
            if isinstance(values[0], torch.Tensor):
                return pad(values, left=False) if values[0].dim() == 2 and name != "per_func" else torch.cat(values)
            if isinstance(values[0], list):
                return [v for value in values for v in value]
            if isinstance(values[0], int):
                return sum(values)
            # a table column holds a value per row: only the columns every part logged; metrics: all of them
            names = set.intersection(*map(set, values)) if name == "columns" else {k for v in values for k in v}
            return {k: [x for value in values for x in value.get(k, [])] for k in sorted(names)}

        return Generation(**{f.name: join(f.name) for f in fields(Generation)})


def batch_rows(batch: dict[str, Any], rows: list[int]) -> dict[str, Any]:
    """Prompts ``rows`` of a collated batch of prompts (``PromptDataModule.collate``), in that order, without the
    columns that are left padding in all of them."""
    def part(value):
        if isinstance(value, torch.Tensor):
            return value[torch.tensor(rows, dtype=torch.long, device=value.device)]
        if isinstance(value, list):
            return [value[i] for i in rows]
        if isinstance(value, dict):
            return {k: part(v) for k, v in value.items()}
        return value

    part_batch = {k: part(v) for k, v in batch.items()}
    start = int(part_batch["prompt_mask"].any(0).int().argmax())  # the columns left padding in every prompt go
    return {**part_batch, "prompt_ids": part_batch["prompt_ids"][:, start:],
            "prompt_mask": part_batch["prompt_mask"][:, start:]}


class Rollouts:
    """The rollout component of the online recipes (documented on ``lit_align.modules.online.OnlineModule``, whose
    options build it)."""

    def __init__(self, reward_funcs: list | None, reward_weights: list[float] | None, sampling: SamplingConfig,
                 engine: str = "auto", vllm: VLLMOptions | None = None, weights_version=None,
                 tools: list | None = None, max_tool_calling_iterations: int | None = None,
                 environment_factory: str | dict | None = None, rollout_func: str | None = None,
                 rewards_required: bool = True):
        if max_tool_calling_iterations is not None and max_tool_calling_iterations < 0:
            raise LitAlignError(f"model.max_tool_calling_iterations must be >= 0 or null, got "
                                f"{max_tool_calling_iterations}")
        self.sampling, self.engine_name = sampling, engine
        self.environments = None if environment_factory is None else Environments(environment_factory)
        owned = [] if self.environments is None else self.environments.reward_functions()
        self.reward_funcs, self.reward_names, weights = load_rewards(reward_funcs, reward_weights, owned,
                                                                   rewards_required)
        self.reward_weights = torch.tensor(weights, dtype=torch.float32)
        settings = {} if vllm is None else {**vllm.engine_settings(), "weights_version": weights_version}
        greedy = {**sampling.__dict__, "temperature": 0.0}
        self.engine = make_engine(engine, **sampling.__dict__, **settings)
        self.greedy_engine = make_engine(engine, **greedy, **settings)
        self.tools = [load_tool(spec) for spec in tools or []]
        self.tool_schemas = [tool_schema(tool) for tool in self.tools]  # the data renders its prompts with them
        self.max_tool_calling_iterations = max_tool_calling_iterations
        self.tool_loop: ToolLoop | None = None  # built with the tokenizer (setup)
        self.rollout_func = None if rollout_func is None else load_tool(rollout_func, "model.rollout_func")
        self.rollout_func_name = rollout_func

    @property
    def uses_tools(self) -> bool:
        return bool(self.tools) or self.environments is not None

    def setup(self, tokenizer, network, dtype: str, trust_remote_code: bool, model_init_kwargs: dict | None) -> None:
        """Once the policy is loaded: reward models load with its settings (TRL: ``model_init_kwargs``), and the tool
        loop refuses a chat template that cannot call tools now, before training."""
        for fn in self.reward_funcs:
            if isinstance(fn, RewardModel):
                fn.load(dtype, trust_remote_code, model_init_kwargs)
        if self.uses_tools and self.tool_loop is None:
            self.tool_loop = ToolLoop(self.tools, tokenizer, self.sampling.max_new_tokens,
                                      self.max_tool_calling_iterations,
                                      getattr(network.config, "max_position_embeddings", None))

    # -- sampling and scoring ------------------------------------------------------------------------------------------
    def sample(self, module, batch: dict[str, Any], num_samples: int, greedy: bool = False, model=None):
        """``num_samples`` completions per prompt: the engine's ``Rollout``, the prompts (repeated) and the
        completions (text, or an assistant message for conversational prompts). ``model``: who samples (None: the
        module's policy; distillation's teacher under ``seq_kd``)."""
        tok, engine = module.tokenizer, self.greedy_engine if greedy else self.engine
        model = module.policy if model is None else model
        eos_pad = {"eos_token_ids": [tok.eos_token_id], "pad_token_id": tok.pad_token_id}
        if self.rollout_func is not None:  # the user's rollouts (TRL's rollout_func), in training and validation
            output = self.rollout_func(repeat_each(batch["prompts"], num_samples), module)
            rollout = rollout_from_output(output, self.rollout_func_name, len(batch["prompts"]) * num_samples,
                                          device=module.device, vocab_size=len(tok), **eos_pad)
        elif self.environments is not None:  # a fresh environment per rollout, its prompt rendered after its reset
            rollout = self.environments.rollout(self.tool_loop, engine, model, batch, num_samples, **eos_pad)
        else:
            generate = engine.generate if self.tool_loop is None else partial(self.tool_loop.generate, engine)
            rollout = generate(model, batch["prompt_ids"], batch["prompt_mask"], num_samples, **eos_pad)
        prompts = repeat_each(batch["prompts"], num_samples)
        if getattr(rollout, "messages", None) is not None:  # the turns: assistant (with tool_calls), tool, ...
            return rollout, prompts, rollout.messages
        texts = tok.batch_decode(rollout.completion_ids, skip_special_tokens=True)
        completions = [[{"role": "assistant", "content": t}] if isinstance(p, list) else t
                       for p, t in zip(prompts, texts)]
        return rollout, prompts, completions

    def score(self, module, batch: dict[str, Any], rollout, prompts: list, completions: list, num_samples: int,
              metrics: dict[str, list], columns: dict[str, list]) -> torch.Tensor:
        """``[N, F]`` rewards, one column per reward function (NaN where a function returned None); what the
        functions log goes into ``metrics`` (``log_metric``) and ``columns`` (``log_extra``)."""
        if not self.reward_funcs:  # a recipe that needs none (distillation): nothing to score
            return torch.zeros(len(prompts), 0, device=module.device)
        data_columns = {k: repeat_each(v, num_samples) for k, v in batch["columns"].items()}
        ids = [row[mask.bool()].tolist() for row, mask in zip(rollout.completion_ids, rollout.completion_mask)]
        trainer = module._trainer
        state = RewardState(module.global_step, getattr(trainer, "max_steps", -1), getattr(trainer, "current_epoch", 0))
        extra = {"trainer_state": state,
                 "log_metric": lambda name, value: metrics.setdefault(name, []).append(float(value)),
                 "log_extra": lambda column, values: columns.setdefault(column, []).extend(values)}
        if getattr(rollout, "environments", None) is not None:  # TRL: every reward function sees them
            extra["environments"] = rollout.environments
        extra.update(getattr(rollout, "extra", None) or {})  # a rollout_func's own columns
        for fn in self.reward_funcs:
            if isinstance(fn, RewardModel):
                fn.to(module.device)
        per_func = score_all(self.reward_funcs, prompts, completions, ids, data_columns, extra)
        return torch.tensor(per_func, dtype=torch.float32, device=module.device).T.reshape(len(prompts), -1)

    def total(self, per_func: torch.Tensor) -> torch.Tensor:
        """``[N]`` the weighted sum of the reward functions' values (NaN where all returned None)."""
        weighted = per_func * self.reward_weights.to(per_func.device)
        return torch.where(per_func.isnan().all(1), torch.nan, weighted.nansum(1))

    @torch.no_grad()
    def generate(self, module, batch: dict[str, Any], num_samples: int, seed: int | None = None,
                 greedy: bool = False, model=None) -> Generation:
        """The batch's prompts sampled ``num_samples`` times each (``sample``: ``greedy``, by ``model``) and scored.
        ``seed``: sample from an RNG seeded with it, not from the global stream (which it leaves as it was)."""
        devices = [module.device] if module.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            rollout, prompts, completions = self.sample(module, batch, num_samples, greedy, model)
        return self.scored(module, batch, rollout, prompts, completions, num_samples)

    def scored(self, module, batch: dict[str, Any], rollout, prompts: list, completions: list,
               num_samples: int) -> Generation:
        """A rollout of the batch's prompts, ``num_samples`` rows each, scored by the reward functions, as a
        ``Generation``: what ``generate`` samples, or completions made elsewhere (distillation's dataset ones)."""
        metrics, columns = {}, {}
        per_func = self.score(module, batch, rollout, prompts, completions, num_samples, metrics, columns)
        prompt_ids = batch["prompt_ids"].repeat_interleave(num_samples, 0)
        prompt_mask = batch["prompt_mask"].repeat_interleave(num_samples, 0)
        if getattr(rollout, "prompt_ids", None) is not None:  # each rollout's own prompt (environments)
            prompt_ids, prompt_mask = rollout.prompt_ids, rollout.prompt_mask
        tool_mask = getattr(rollout, "tool_mask", None)  # 0 on tool turns: not the policy's tokens
        mask, rows = rollout.completion_mask, batch.get("dataset_rows")
        return Generation(
            prompt_ids, prompt_mask, rollout.completion_ids, mask, mask if tool_mask is None else mask * tool_mask,
            rollout.truncated, rollout.logps, tool_mask, per_func, self.total(per_func), prompts, completions,
            dataset_rows=None if rows is None else repeat_each(rows, num_samples),
            columns={k: v for k, v in columns.items() if len(v) == len(prompts)}, metrics=metrics,
            tool_calls=getattr(rollout, "tool_calls", 0), tool_failures=getattr(rollout, "tool_failures", 0))

    def generate_groups(self, module, batch: dict[str, Any], num_samples: int, groups: int, seed: int,
                        ) -> tuple[Generation, Generation]:
        """DAPO's dynamic sampling: ``groups`` groups of ``num_samples`` completions whose rewards are not all equal
        (a group whose completions all scored alike has zero advantage: it teaches nothing). ``batch`` holds several
        batches of ``groups`` prompts; they are sampled one after the other until every rank holds ``groups`` such
        groups (all ranks sample alike: the decision is all-reduced), or ``batch`` is used up: the step is then
        filled with the first groups left out. ``(the groups trained on, everything sampled)``."""
        parts, kept = [], []
        prompts = len(batch["prompts"])
        for start in range(0, prompts, groups):
            rows = list(range(start, min(start + groups, prompts)))
            seed_k = (seed + 104_729 * len(parts)) % 2**63
            part = self.generate(module, batch_rows(batch, rows), num_samples, seed=seed_k)
            spread = nanstd(part.rewards.view(-1, num_samples), dim=1).view(-1) >= ZERO_STD
            kept += [len(parts) * groups + g for g in spread.nonzero().flatten().tolist()]
            parts.append(part)
            missing = torch.tensor(float(max(groups - len(kept), 0)), device=module.device)
            if module.trainer.strategy.reduce(missing, reduce_op="max") == 0:
                break
        everything = Generation.concat(parts) if len(parts) > 1 else parts[0]
        chosen = kept[:groups]
        chosen += [g for g in range(len(parts) * groups) if g not in set(kept)][: groups - len(chosen)]
        rows = [g * num_samples + j for g in chosen for j in range(num_samples)]
        return everything.select(rows), everything

    def stats(self, trainer, generation: Generation, group: int) -> dict[str, torch.Tensor]:
        """TRL's rollout metrics, averaged over ranks; std, min and max are over every rank's completions
        (gathered), not averages of per-rank values. Lengths count the sampled tokens only (tool turns are not)."""
        rewards, per_func, strategy = generation.rewards, generation.per_func, trainer.strategy
        device = rewards.device
        lengths = generation.sampled_mask.sum(1).float()
        all_lengths = strategy.all_gather(lengths).reshape(-1)
        truncated = strategy.all_gather(generation.truncated.float()).reshape(-1).bool()
        terminated = all_lengths[~truncated] if not truncated.all() else torch.zeros(1, device=device)  # TRL's 0
        stats = {}
        if self.reward_funcs:  # none: a recipe that trains without rewards (distillation) logs none
            all_rewards = strategy.all_gather(rewards).reshape(1, -1)
            all_per_func = strategy.all_gather(per_func).reshape(-1, per_func.shape[-1]).t()
            stats |= {"reward": rewards.nanmean(), "reward_std": nanstd(all_rewards, dim=1).view(()),
                      "frac_reward_zero_std": (nanstd(rewards.view(-1, group), dim=1) < ZERO_STD).float().mean(),
                      **{f"rewards/{n}/std": nanstd(all_per_func[i : i + 1], dim=1).view(())
                         for i, n in enumerate(self.reward_names)}}
        stats |= {
            "completions/mean_length": lengths.mean(),
            "completions/min_length": all_lengths.min(),
            "completions/max_length": all_lengths.max(),
            "completions/clipped_ratio": generation.truncated.float().mean(),
            "completions/mean_terminated_length": terminated.mean(),
            "completions/min_terminated_length": terminated.min(),
            "completions/max_terminated_length": terminated.max(),
            **{f"rewards/{n}/mean": per_func[:, i].nanmean() for i, n in enumerate(self.reward_names)},
            **{name: torch.tensor(sum(v) / len(v), device=device) for name, v in generation.metrics.items()},
        }
        if self.tool_loop is not None:  # TRL's: calls per completion, and the failed share of the calls (all ranks)
            calls, failures = strategy.reduce(torch.tensor([generation.tool_calls, generation.tool_failures],
                                                           dtype=torch.float32, device=device), reduce_op="sum")
            stats["tools/call_frequency"] = calls / (len(lengths) * trainer.world_size)
            stats["tools/failure_frequency"] = failures / calls if calls > 0 else torch.zeros((), device=device)
        values = strategy.reduce(torch.stack(list(stats.values())), reduce_op="mean")
        return dict(zip(stats, values))
