"""GRPOModule with tools: the tool turns are out of the loss, the entropy, the KL and the lengths; the tools/* metrics;
a round with tool turns resumes exactly mid-round; the data renders the tools into the prompts; refusals.

The tiny model calls no tool by itself: its first turn is forced (``helpers.ScriptedEngine``), the turns after the
tools' results are sampled by the module's own engine.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from helpers import ScriptedEngine, fit, metric_at, read_metrics
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lit_align.data import PromptDataModule
from lit_align.data.tasks import ModSumTask
from lit_align.errors import LitAlignError
from lit_align.modules.grpo import GRPOModule
from lit_align.modules.online import completion_token_logps

CALL = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call></s>'
UNKNOWN = '<tool_call>{"name": "nope", "arguments": {}}</tool_call></s>'
# two prompts x two completions: (add, a direct answer), (an unknown tool, add): 3 calls, 1 failure
FIRST_TURNS = [CALL, "5</s>", UNKNOWN, CALL]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tool_prompts") / "prompts.jsonl"
    ModSumTask(num_train=8, num_test=2).prompt_rows("train").to_json(path)
    return str(path)


class ForceFirstTurn(L.Callback):
    """Puts a ``ScriptedEngine`` before the module's engine: the first round's first turns are ``FIRST_TURNS``."""

    def on_fit_start(self, trainer, pl_module) -> None:
        pl_module.rollouts.engine = ScriptedEngine(pl_module.tokenizer, [FIRST_TURNS], then=pl_module.rollouts.engine)


class KeepSteps(L.Callback):
    def __init__(self):
        self.losses, self.steps = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))
        self.steps.append(outputs["step"])


def fit_tools(root: Path, prompts: str, max_steps: int = 1, model: dict | None = None, spg: int = 1,
              callbacks=(), **trainer_kwargs):
    torch.manual_seed(0)
    module = GRPOModule(model="builtin:tiny", chat_template="builtin:tools", tools=["helpers.add"],
                        reward_funcs=["helpers.reward_digit_fraction"], num_generations=2, steps_per_generation=spg,
                        max_completion_length=128, **{"learning_rate": 0.0, **(model or {})})
    data = PromptDataModule(path=prompts, val_split=None, batch_size=4 // spg, chat_template="builtin:tools", shuffle=False)
    keep = KeepSteps()
    run = fit(module, data, max_steps=max_steps, callbacks=[ForceFirstTurn(), keep, *callbacks],
              logger=CSVLogger(root, name="tools"), **trainer_kwargs)
    return SimpleNamespace(module=module, data=data, keep=keep, metrics=read_metrics(Path(run.log_dir) / "metrics.csv"))


@pytest.fixture(scope="module")
def run(tmp_path_factory, prompts_file, tiny_path):
    """One step, learning rate 0 (the policy after the run is the one that computed the step), beta > 0."""
    return fit_tools(tmp_path_factory.mktemp("tools_run"), prompts_file, model={"beta": 0.04})


def test_the_prompts_carry_the_tools_and_the_tool_turns_are_the_templates(run):
    tokenizer, rnd = run.module.tokenizer, run.module.round
    assert tokenizer.decode(rnd.prompt_ids[0][rnd.prompt_mask[0].bool()]).startswith("<|system|>tools: add(a, b)\n")
    for i in (0, 3):  # the rows that called add: their tool turn is exactly the rendered result, masked
        real = rnd.completion_mask[i].bool()
        tool = real & (rnd.tool_mask[i] == 0)
        assert tokenizer.decode(rnd.completion_ids[i][tool]) == "<|tool|>3\n<|assistant|>"
    assert (rnd.tool_mask[1] == rnd.completion_mask[1]).all()  # the direct answer has no tool turn
    assert rnd.completions[0].startswith('add({"a": 1, "b": 2})\n-> 3\n')
    assert rnd.completions[2].startswith("nope({})\n-> {'error': 'Tool nope not found.'}\n")


def test_tool_turns_are_out_of_the_loss_and_the_metrics(run):
    """The logged loss, entropy and mean length against hand computations over the sampled tokens only (float64)."""
    module, rnd, metrics = run.module, run.module.round, run.metrics
    sampled = rnd.completion_mask * rnd.tool_mask
    assert torch.equal(rnd.loss_mask, sampled)
    n = sampled.sum(1).double()
    assert (n < rnd.completion_mask.sum(1)).sum() == 3  # three rows have a tool turn
    # on-policy (ratio 1), dapo: -(sum_i A_i n_i) / sum_i n_i
    expected = -(rnd.advantages.double() * n).sum() / n.sum()
    assert rnd.advantages.abs().sum() > 0
    assert metric_at(metrics, "train/loss", 0) == pytest.approx(float(expected), abs=1e-6)
    assert run.keep.losses[0] == pytest.approx(float(expected), abs=1e-6)
    _, entropy = completion_token_logps(module.policy, rnd.prompt_ids, rnd.prompt_mask, rnd.completion_ids,
                                        rnd.completion_mask, with_entropy=True)
    entropy = entropy.double()  # near uniform (untrained), so the two means are close: compared tightly
    sampled_mean = float((entropy * sampled).sum() / n.sum())
    assert abs(sampled_mean - float((entropy * rnd.completion_mask).sum() / rnd.completion_mask.sum())) > 1e-5
    assert metric_at(metrics, "train/entropy", 0) == pytest.approx(sampled_mean, abs=1e-6)
    assert metric_at(metrics, "train/kl", 0) == pytest.approx(0.0, abs=1e-6)  # the reference is the policy
    assert metric_at(metrics, "train/completions/mean_length", 0) == pytest.approx(float(n.mean()))
    assert metric_at(metrics, "train/tools/call_frequency", 0) == pytest.approx(3 / 4)
    assert metric_at(metrics, "train/tools/failure_frequency", 0) == pytest.approx(1 / 3)


@pytest.mark.filterwarnings("ignore:lit_align. resumed with another length")  # resumed with more steps on purpose
def test_a_round_with_tool_turns_resumes_exactly_mid_round(tmp_path, prompts_file, tiny_path):
    """A round of two steps: stopped after the first and resumed, the second step trains on the checkpointed round
    (its tool mask included) and its loss is the uninterrupted run's."""
    whole = fit_tools(tmp_path / "whole", prompts_file, max_steps=2, spg=2, model={"learning_rate": 1e-3})
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)
    fit_tools(tmp_path / "first", prompts_file, max_steps=1, spg=2, model={"learning_rate": 1e-3},
              callbacks=[checkpoints], enable_checkpointing=True)
    saved = torch.load(tmp_path / "ckpt" / "epoch=0-step=1.ckpt", map_location="cpu", weights_only=False)
    assert torch.equal(saved["lit_align_grpo"]["rounds"][0]["tool_mask"], whole.module.round.tool_mask)
    resumed = fit_tools(tmp_path / "resumed", prompts_file, max_steps=2, spg=2, model={"learning_rate": 1e-3},
                        ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=1.ckpt"))
    assert resumed.module.generation_rounds == 1  # no new round: the checkpoint's
    assert resumed.keep.losses == [pytest.approx(whole.keep.losses[1], abs=1e-6)]
    assert torch.equal(resumed.keep.steps[0].tool_mask, whole.keep.steps[1].tool_mask)


def test_text_prompts_and_templates_without_tool_calls_are_refused(tmp_path, write_jsonl, prompts_file, tiny_path):
    text = write_jsonl([{"prompt": "1+2", "answer": "3"}] * 4)
    module = GRPOModule(model="builtin:tiny", chat_template="builtin:tools", tools=["helpers.add"],
                        reward_funcs=["helpers.reward_digit_fraction"], num_generations=2, max_completion_length=8)
    with pytest.raises(LitAlignError, match=r"row 0: field 'prompt' is text, but model.tools needs conversational"):
        fit(module, PromptDataModule(path=text, val_split=None, batch_size=2,
                                     chat_template="builtin:tools"))
    module = GRPOModule(model="builtin:tiny", tools=["helpers.add"], num_generations=2,
                        reward_funcs=["helpers.reward_digit_fraction"], max_completion_length=8)
    with pytest.raises(LitAlignError, match=r"model.tools: the chat template of .* cannot render a tool-calling "
                                            r"conversation .*builtin:tools"):
        fit(module, PromptDataModule(path=prompts_file, val_split=None, batch_size=2))
    with pytest.raises(LitAlignError, match=r"model.tools: 'lit_align.no_such_tool': cannot import it"):
        GRPOModule(tools=["lit_align.no_such_tool"], reward_funcs=["helpers.reward_digit_fraction"])
    with pytest.raises(LitAlignError, match=r"model.max_tool_calling_iterations must be >= 0"):
        GRPOModule(tools=["helpers.add"], max_tool_calling_iterations=-1,
                   reward_funcs=["helpers.reward_digit_fraction"])


def test_a_rollout_func_makes_the_round(tmp_path, prompts_file, tiny_path):
    """TRL's rollout_func: its ids are the round's, its env_mask is the tool mask (out of the loss and the lengths),
    its other keys reach the reward functions; a malformed return is one error naming it."""
    module = GRPOModule(model="builtin:tiny", chat_template="builtin:tools", rollout_func="helpers.replay_rollout",
                        reward_funcs=["helpers.reward_score"], num_generations=2, max_completion_length=16,
                        learning_rate=0.0)
    data = PromptDataModule(path=prompts_file, val_split=None, batch_size=4, shuffle=False,
                            chat_template="builtin:tools")
    fit(module, data, logger=CSVLogger(tmp_path, name="rf"))
    rnd, tok = module.round, module.tokenizer
    assert tok.decode(rnd.completion_ids[1][rnd.completion_mask[1].bool()]) == "1|env|ok</s>"
    assert tok.decode(rnd.completion_ids[1][rnd.loss_mask[1].bool()]) == "1ok</s>"
    assert tok.decode(rnd.prompt_ids[0][rnd.prompt_mask[0].bool()]).startswith("<|user|>")  # rendered by it
    assert rnd.rewards == [0.0, 1.0, 2.0, 3.0]
    metrics = read_metrics(tmp_path / "rf" / "version_0" / "metrics.csv")
    assert metric_at(metrics, "train/completions/mean_length", 0) == 4.0  # "1", "ok", "</s>"
    with pytest.raises(LitAlignError, match=r"model.rollout_func 'helpers.bad_rollout' returned list; expected a "
                                            r"dict with keys \['prompt_ids', 'completion_ids', 'logprobs'\]"):
        fit(GRPOModule(model="builtin:tiny", rollout_func="helpers.bad_rollout", num_generations=2,
                       reward_funcs=["helpers.reward_digit_fraction"], max_completion_length=8),
            PromptDataModule(path=prompts_file, val_split=None, batch_size=4))

    with pytest.raises(LitAlignError, match=r"^model.rollout_func 'helpers.out_of_vocab_rollout': "
                                            r"completion_ids\[0\]\[0\] is 104, expected a token id "
                                            r"\(an int >= 0, < 104: the tokenizer's\)$"):
        fit(GRPOModule(model="builtin:tiny", rollout_func="helpers.out_of_vocab_rollout", num_generations=2,
                       reward_funcs=["helpers.reward_digit_fraction"], max_completion_length=8),
            PromptDataModule(path=prompts_file, val_split=None, batch_size=4))


def test_rloo_trains_on_the_same_tool_rollouts(tmp_path, prompts_file):
    """The rollouts are ``OnlineModule``'s, so RLOO runs tools too (beyond RLOOConfig): its round keeps the tool mask
    and its loss leaves the tool turns out."""
    from lit_align.modules import RLOOModule

    torch.manual_seed(0)
    module = RLOOModule(model="builtin:tiny", chat_template="builtin:tools", tools=["helpers.add"], beta=0.0,
                        reward_funcs=["helpers.reward_digit_fraction"], num_generations=2, max_completion_length=128,
                        learning_rate=0.0)
    data = PromptDataModule(path=prompts_file, val_split=None, batch_size=4, chat_template="builtin:tools",
                            shuffle=False)
    keep = KeepSteps()
    fit(module, data, max_steps=1, callbacks=[ForceFirstTurn(), keep])
    rnd = module.round
    assert (rnd.tool_mask == 0).any() and torch.equal(rnd.loss_mask, rnd.completion_mask * rnd.tool_mask)
    assert rnd.advantages.abs().sum() > 0
    # on-policy, one ratio per completion over its sampled tokens: each completion's loss is -A, their mean the loss
    assert keep.losses[0] == pytest.approx(float(-rnd.advantages.mean()), abs=1e-6)
