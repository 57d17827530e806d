"""Environments (TRL's ``environment_factory``): a fresh instance per rollout, reset with its row (its text appended
to the prompt), its methods as the rollout's tools, its ``get_reward`` as a reward; one per row by name; a reset that
raises is one error naming the row. GRPOModule with an environment that owns the reward and no reward_funcs."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from helpers import BrokenEnvironment, CounterEnvironment, ScriptedEngine, fit, metric_at, read_metrics

from lit_align.errors import LitAlignError
from lit_align.generation.environments import Environments
from lit_align.generation.tools import ToolLoop
from lit_align.models import TOOL_CHAT_TEMPLATE, build_tokenizer


@pytest.fixture(scope="module")
def tok():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    return tokenizer


def batch(tok, answers: list[str], environment: list[str] | None = None, rows: list[int] | None = None) -> dict:
    columns = {"answer": answers, **({"environment": environment} if environment else {})}
    return {"prompts": [[{"role": "user", "content": f"count to {a}"}] for a in answers], "columns": columns,
            "prompt_ids": torch.zeros(len(answers), 1, dtype=torch.long), "dataset_rows": rows}


def increment(by: int) -> str:
    return f'<tool_call>{{"name": "increment", "arguments": {{"by": {by}}}}}</tool_call></s>'


def test_each_rollout_has_its_own_environment_its_tools_and_its_reward(tok):
    environments = Environments("helpers.CounterEnvironment")
    [reward] = environments.reward_functions()
    assert reward.__name__ == "CounterEnvironment"
    loop = ToolLoop([], tok, max_completion_length=200)
    engine = ScriptedEngine(tok, [[increment(3), increment(2), "ok</s>", increment(1)], ["done</s>"] * 3])
    rollout = environments.rollout(loop, engine, None, batch(tok, ["3", "2"]), 2, [tok.eos_token_id],
                                   tok.pad_token_id)
    # the reset's text ends the user turn; the environment's methods are the tools the prompt shows
    prompt = tok.decode(rollout.prompt_ids[0][rollout.prompt_mask[0].bool()])
    assert prompt == "<|system|>tools: increment(by)\n<|user|>count to 3 (reach 3)\n<|assistant|>"
    assert engine.prompts[0][2] == rollout.prompt_ids[2][rollout.prompt_mask[2].bool()].tolist()
    # four instances, each moved by its own rollout's calls only
    assert len({id(e) for e in rollout.environments}) == 4
    assert [e.count for e in rollout.environments] == [3, 2, 0, 1]
    assert reward(environments=rollout.environments) == [1.0, 0.0, 0.0, 0.0]
    assert rollout.messages[0][1] == {"role": "tool", "name": "increment", "content": "3"}
    assert (rollout.tool_calls, rollout.tool_failures) == (3, 0)


def test_environments_by_name_and_a_reset_that_raises(tok):
    environments = Environments({"counter": "helpers.CounterEnvironment", "broken": "helpers.BrokenEnvironment"})
    assert [f.__name__ for f in environments.reward_functions()] == ["CounterEnvironment"]  # only it has one
    loop = ToolLoop([], tok, max_completion_length=200)
    engine = ScriptedEngine(tok, [["1</s>"] * 2])
    rollout = environments.rollout(loop, engine, None, batch(tok, ["1"], ["counter"]), 2, [tok.eos_token_id],
                                   tok.pad_token_id)
    assert all(type(e) is CounterEnvironment for e in rollout.environments)
    with pytest.raises(LitAlignError, match=r"^dataset row 7: BrokenEnvironment.reset raised ValueError: no such "
                                            r"level \(model.environment_factory\)$"):
        environments.rollout(loop, engine, None, batch(tok, ["1", "2"], ["counter", "broken"], rows=[3, 7]), 1,
                             [tok.eos_token_id], tok.pad_token_id)
    with pytest.raises(LitAlignError, match=r"prompt 0 of the batch: field 'environment' is 'chess', expected one of"):
        environments.rollout(loop, engine, None, batch(tok, ["1"], ["chess"]), 1, [tok.eos_token_id],
                             tok.pad_token_id)
    with pytest.raises(LitAlignError, match=r"model.environment_factory: Counter has no reset method"):
        Environments({"class_path": "collections.Counter"})



class CounterFrom(CounterEnvironment):
    """A ``CounterEnvironment`` built with ``init_args`` (``{class_path: test_environments.CounterFrom, ...}``)."""

    def __init__(self, start: int):
        self.start = start


def test_a_class_path_with_init_args_makes_a_new_environment_per_call():
    environments = Environments({"class_path": "test_environments.CounterFrom", "init_args": {"start": 5}})
    first, second = environments.factories[None](), environments.factories[None]()
    assert type(first) is CounterFrom and first.start == second.start == 5 and first is not second
    with pytest.raises(LitAlignError, match=r"^model.environment_factory: 'lit_align.rewards.math': expected a class "
                                            r"path$"):
        Environments("lit_align.rewards.math")

class Unreachable(CounterEnvironment):
    """An environment whose making fails (a service it connects to is down)."""

    def __init__(self):
        raise ConnectionError("sandbox at localhost:8000 refused the connection")


@pytest.mark.parametrize("spec,message", [
    ("no_such_package.Env", "model.environment_factory: 'no_such_package.Env': cannot import it (No module named "
                            "'no_such_package')"),
    ("helpers.NoSuchEnvironment", "model.environment_factory: 'helpers.NoSuchEnvironment': cannot import it (module "
                                  "'helpers' has no attribute 'NoSuchEnvironment')"),
    ("test_environments.Unreachable", "model.environment_factory: making an environment with Unreachable raised "
                                      "ConnectionError: sandbox at localhost:8000 refused the connection"),
    ({"class_path": "helpers.CounterEnvironment", "init_args": {"level": 3}},
     "model.environment_factory: making an environment with CounterEnvironment raised TypeError: "
     "CounterEnvironment() takes no arguments"),
    ("lit_align.rewards.RewardState", "model.environment_factory: making an environment with RewardState raised "
                                      "TypeError: RewardState.__init__() missing 3 required positional arguments: "
                                      "'global_step', 'max_steps', and 'epoch'"),
])
def test_a_factory_that_cannot_be_imported_or_made_is_one_error(spec, message):
    with pytest.raises(LitAlignError) as info:
        Environments(spec)
    assert str(info.value) == message


def test_grpo_with_an_environment_that_owns_the_reward(tmp_path, write_jsonl, tiny_path):
    """No reward_funcs: the environment's get_reward is the reward (rewards/CounterEnvironment/mean), the prompts are
    rendered after each reset, and the tool calls count."""
    from lightning.pytorch.loggers import CSVLogger

    from lit_align.data import PromptDataModule
    from lit_align.modules.grpo import GRPOModule

    class Force(L.Callback):
        def on_fit_start(self, trainer, pl_module):
            first_turns = [increment(3), "no</s>", increment(1), increment(2)]
            pl_module.rollouts.engine = ScriptedEngine(pl_module.tokenizer, [first_turns], then=pl_module.rollouts.engine)

    path = write_jsonl([{"prompt": [{"role": "user", "content": f"count to {a}"}], "answer": str(a)} for a in (3, 2)])
    torch.manual_seed(0)
    module = GRPOModule(model="builtin:tiny", chat_template="builtin:tools",
                        environment_factory="helpers.CounterEnvironment", num_generations=2, max_completion_length=120,
                        learning_rate=0.0)
    assert module.rollouts.reward_names == ["CounterEnvironment"]
    run = fit(module, PromptDataModule(path=path, val_split=None, batch_size=4, shuffle=False,
                                       chat_template="builtin:tools"), callbacks=[Force()],
              logger=CSVLogger(tmp_path, name="env"))
    metrics = read_metrics(tmp_path / "env" / "version_0" / "metrics.csv")
    assert module.round.rewards == [1.0, 0.0, 0.0, 1.0]
    assert metric_at(metrics, "train/rewards/CounterEnvironment/mean", 0) == 0.5
    assert metric_at(metrics, "train/tools/call_frequency", 0) == 0.75
    prompt = module.tokenizer.decode(module.round.prompt_ids[2][module.round.prompt_mask[2].bool()])
    assert prompt.endswith("<|user|>count to 2 (reach 2)\n<|assistant|>")
    assert run.global_step == 1
