"""The tool loop: token-in-token-out completions, the tool mask, and every failure path (a tool that raises, an
unknown tool, malformed calls, a tool turn past the budget, the iteration cap, templates that cannot call tools).

The completions come from ``helpers.ScriptedEngine``, an ``Engine`` that "samples" given texts in order, so every
path is exercised by exactly the output that triggers it; a last test runs the loop on the real engines with the tiny model.
"""

from __future__ import annotations

import pytest
import torch

from lit_align.errors import LitAlignError
from lit_align.generation import HFEngine, NativeEngine
from lit_align.generation.tools import (
    RESPONSE_TEMPLATES, ToolLoop, call_tools, check_tool_template, load_tool, response_template, tool_schema,
    tool_turn_ids,
)
from helpers import ScriptedEngine
from lit_align.models import CHAT_TEMPLATE, TOOL_CHAT_TEMPLATE, build_tokenizer, read_chat_template


def add(a: int, b: int) -> int:
    """Add two whole numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def crash(x: int) -> int:
    """Always fails.

    Args:
        x: anything
    """
    raise RuntimeError("the tool broke")


async def slow_add(a: int, b: int) -> int:
    """Add, asynchronously.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def no_docstring(a: int) -> int:
    return a


@pytest.fixture(scope="module")
def tok():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    return tokenizer


def prompt_batch(tok, questions: list[str]):
    rows = [tok.apply_chat_template([{"role": "user", "content": q}], tools=[add], add_generation_prompt=True,
                                    return_dict=False) for q in questions]
    width = max(map(len, rows))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return rows, ids, mask


def run(tok, script, tools=(add,), questions=("add 12 30",), num_samples=2, **loop_kwargs):
    engine = ScriptedEngine(tok, script)
    loop = ToolLoop(list(tools), tok, **{"max_completion_length": 400, **loop_kwargs})
    prompts, ids, mask = prompt_batch(tok, list(questions))
    rollout = loop.generate(engine, None, ids, mask, num_samples, [tok.eos_token_id], tok.pad_token_id)
    return rollout, engine, prompts


def encode(tok, text: str) -> list[int]:
    return tok(text)["input_ids"]


def row(rollout, i: int) -> tuple[list[int], list[int], list[float]]:
    """Row ``i``'s real ids, tool mask and log-probs."""
    real = rollout.completion_mask[i].bool()
    return (rollout.completion_ids[i][real].tolist(), rollout.tool_mask[i][real].tolist(),
            rollout.logps[i][real].tolist())


CALL = '<tool_call>{"name": "add", "arguments": {"a": 12, "b": 30}}</tool_call></s>'


def test_completion_ids_are_the_sampled_ids_and_the_rendered_tool_turns(tok):
    """Token in, token out: row 0 = its two sampled turns with the tool turn's ids between them, exactly as the
    template renders it; the second turn was sampled from prompt + those ids; the mask is 0 on the tool turn only."""
    rollout, engine, prompts = run(tok, [[CALL, "41</s>"], ["42</s>"]])
    tool_turn = encode(tok, "<|tool|>42\n") + [tok.convert_tokens_to_ids("<|assistant|>")]
    first, second = encode(tok, CALL), encode(tok, "42</s>")
    ids, mask, logps = row(rollout, 0)
    assert ids == first + tool_turn + second
    assert mask == [1] * len(first) + [0] * len(tool_turn) + [1] * len(second)
    assert engine.prompts[1] == [prompts[0] + first + tool_turn]  # only the calling row continued
    # the log-probs are the sampled turns' own, 0 on the tool turn
    turn_logps = lambda n: [-(k + 1) / 100 for k in range(n)]  # noqa: E731
    assert logps == pytest.approx(turn_logps(len(first)) + [0.0] * len(tool_turn) + turn_logps(len(second)))
    # row 1 answered without a tool: one turn, nothing masked, padded after
    ids1, mask1, _ = row(rollout, 1)
    assert ids1 == encode(tok, "41</s>") and mask1 == [1] * len(ids1)
    assert rollout.messages[0] == [
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 12, "b": 30}}}]},
        {"role": "tool", "name": "add", "content": "42"},
        {"role": "assistant", "content": "42"}]
    assert rollout.messages[1] == [{"role": "assistant", "content": "41"}]
    assert (rollout.tool_calls, rollout.tool_failures) == (1, 0)
    assert not rollout.truncated.any()
    # the whole exchange is what the template renders for that conversation after the prompt
    rendered = tok.apply_chat_template([{"role": "user", "content": "add 12 30"}] + rollout.messages[0], tools=[add],
                                       return_dict=False)
    assert prompts[0] + ids == rendered


def test_tool_turn_ids_are_what_follows_the_calling_turn(tok):
    assert tok.decode(tool_turn_ids(tok, [{"role": "tool", "name": "add", "content": "7"},
                                          {"role": "tool", "name": "add", "content": "8"}])) == \
        "<|tool|>7\n<|tool|>8\n<|assistant|>"


def test_a_tool_that_raises_and_an_unknown_tool_give_error_turns(tok):
    calls = ('<tool_call>{"name": "crash", "arguments": {"x": 1}}</tool_call>'
             '<tool_call>{"name": "nope", "arguments": {}}</tool_call></s>')
    rollout, _, _ = run(tok, [[calls, "1</s>"], ["done</s>"]], tools=(add, crash))
    tool_turns = [m for m in rollout.messages[0] if m["role"] == "tool"]
    assert tool_turns == [{"role": "tool", "name": "crash", "content": "{'error': 'the tool broke'}"},
                          {"role": "tool", "name": "nope", "content": "{'error': 'Tool nope not found.'}"}]
    assert (rollout.tool_calls, rollout.tool_failures) == (2, 2)
    assert rollout.messages[0][-1] == {"role": "assistant", "content": "done"}


def test_malformed_calls(tok):
    """Arguments that are not an object, or that the function does not take: an error turn (a failure). A call that
    is not JSON (or names no function) is no call at all: the turn is its text, as TRL parses it."""
    bad_arguments = '<tool_call>{"name": "add", "arguments": "12, 30"}</tool_call></s>'
    wrong_keyword = '<tool_call>{"name": "add", "arguments": {"a": 1, "c": 2}}</tool_call></s>'
    rollout, engine, _ = run(tok, [[bad_arguments, wrong_keyword], ["x</s>", "y</s>"]])
    errors = [rollout.messages[i][1]["content"] for i in range(2)]
    assert "arguments must be an object, got '12, 30'" in errors[0]
    assert "unexpected keyword argument 'c'" in errors[1]
    assert (rollout.tool_calls, rollout.tool_failures) == (2, 2)

    not_json = '<tool_call>{"name": "add", "arguments": {"a": 1</tool_call></s>'
    no_name = '<tool_call>{"function": "add"}</tool_call></s>'
    rollout, engine, _ = run(tok, [[not_json, no_name]])
    assert len(engine.prompts) == 1  # nothing to run: no second turn
    assert rollout.messages[0] == [{"role": "assistant", "content": tok.decode(encode(tok, not_json),
                                                                               skip_special_tokens=True)}]
    assert rollout.messages[1][0]["content"] == '<tool_call>{"function": "add"}</tool_call>'
    assert (rollout.tool_calls, rollout.tool_failures) == (0, 0)
    assert rollout.tool_mask.sum() == rollout.completion_mask.sum()


def test_async_tools_run(tok):
    rollout, _, _ = run(tok, [['<tool_call>{"name": "slow_add", "arguments": {"a": 2, "b": 3}}</tool_call></s>',
                               "1</s>"], ["5</s>"]], tools=(slow_add,))
    assert rollout.messages[0][1] == {"role": "tool", "name": "slow_add", "content": "5"}
    assert rollout.tool_failures == 0


def test_a_tool_turn_past_the_budget_is_rolled_back_and_the_last_turn_cut(tok):
    first = encode(tok, CALL)
    tool_turn = 12  # "<|tool|>42\n" and the assistant header
    # one token short of room for the tool turn: it is rolled back, the row ends as sampled (the call still counts)
    rollout, engine, _ = run(tok, [[CALL, "1</s>"]], max_completion_length=len(first) + tool_turn - 1)
    assert len(engine.prompts) == 1
    ids, mask, _ = row(rollout, 0)
    assert ids == first and mask == [1] * len(first)
    assert rollout.messages[0] == rollout.messages[0][:1] and rollout.tool_calls == 1
    # room for the tool turn and 2 more tokens: the second turn is cut to 2 and the row counts as truncated
    rollout, engine, _ = run(tok, [[CALL, "1</s>"], ["12345</s>"]], max_completion_length=len(first) + tool_turn + 2)
    ids, mask, _ = row(rollout, 0)
    assert ids == first + ids[len(first):len(first) + tool_turn] + encode(tok, "12")
    assert rollout.truncated.tolist() == [True, False]
    assert rollout.messages[0][-1] == {"role": "assistant", "content": "12"}


def test_max_tool_calling_iterations_caps_the_rounds(tok):
    script = [[CALL, "0</s>"], [CALL], [CALL], [CALL]]
    rollout, engine, _ = run(tok, script, max_tool_calling_iterations=2)
    assert len(engine.prompts) == 3  # the first turn and two rounds after tools
    assert rollout.tool_calls == 2
    assert [m["role"] for m in rollout.messages[0]] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert "tool_calls" in rollout.messages[0][-1]  # its last call was never run
    rollout, engine, _ = run(tok, [[CALL, "0</s>"]], max_tool_calling_iterations=0)
    assert len(engine.prompts) == 1 and rollout.tool_calls == 0


def returning(value):
    """A tool named ``add`` that returns ``value``."""
    def add(a: int, b: int):
        """Add two whole numbers.

        Args:
            a: the first number
            b: the second number
        """
        return value

    return add


@pytest.mark.parametrize("value,content", [([1, 2], "[1, 2]"), ({"sum": 42}, "{'sum': 42}"), (None, "None"),
                                           ([], "[]"), (["4", "2"], "['4', '2']")])
def test_a_result_that_is_not_a_string_is_its_text(tok, value, content):
    """TRL's rule: content blocks (``[{"type": ...}]``) pass as they are, anything else as ``str(result)`` (a list of
    numbers once reached the template as a list: a TypeError in the middle of a round)."""
    rollout, _, _ = run(tok, [[CALL, "0</s>"], ["42</s>"]], tools=(returning(value),))
    assert rollout.messages[0][1] == {"role": "tool", "name": "add", "content": content}
    assert rollout.tool_failures == 0


def test_content_blocks_the_template_cannot_render_are_one_error_naming_the_tool(tok):
    with pytest.raises(LitAlignError, match=r"^model.tools: the chat template cannot render the result of tool 'add' "
                                            r"\(TypeError: .*\); a tool returns a string"):
        run(tok, [[CALL, "0</s>"], ["42</s>"]], tools=(returning([{"type": "text", "text": "42"}]),))


def test_a_result_of_megabytes_ends_the_row_as_it_was(tok):
    """A tool turn past ``max_completion_length`` is rolled back, however long: the row keeps what it sampled."""
    for tool in (returning("9" * 1_000_000), crash_with("x" * 1_000_000)):
        rollout, engine, _ = run(tok, [[CALL, "0</s>"]], tools=(tool,), max_completion_length=100)
        assert len(engine.prompts) == 1  # no second turn
        assert row(rollout, 0)[0] == encode(tok, CALL) and rollout.tool_calls == 1


def test_a_model_that_calls_tools_forever_stops_at_the_completion_budget(tok):
    """``max_tool_calling_iterations: null`` (TRL's: until no call): each round adds tokens, so
    ``max_completion_length`` ends the loop."""
    rollout, engine, _ = run(tok, [[CALL, "0</s>"]] + [[CALL]] * 100, max_completion_length=300,
                             max_tool_calling_iterations=None)
    assert 2 < len(engine.prompts) < 10 and rollout.completion_mask[0].sum() == 300
    assert rollout.truncated.tolist() == [True, False]  # its last turn was cut to the budget


def crash_with(message: str):
    """A tool named ``add`` that raises with ``message``."""
    def add(a: int, b: int):
        """Add two whole numbers.

        Args:
            a: the first number
            b: the second number
        """
        raise ValueError(message)

    return add


def test_templates_that_cannot_call_tools_are_refused(tok):
    plain = build_tokenizer()  # the built-in models' own template ignores tool calls
    assert plain.chat_template == CHAT_TEMPLATE
    with pytest.raises(LitAlignError, match=r"cannot render a tool-calling conversation .* drops the tool, key, "
                                            r"value; set model.chat_template .*builtin:tools"):
        check_tool_template(plain, "builtin:tiny")
    # SmolLM2-Instruct's ChatML template (as shipped) drops tool calls too
    plain.chat_template = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
                           " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
                           "{{ '<|im_start|>assistant\n' }}{% endif %}")
    with pytest.raises(LitAlignError, match="drops the tool, key, value;"):
        check_tool_template(plain, "smollm2")
    assert check_tool_template(tok, "builtin:tiny") == RESPONSE_TEMPLATES["builtin"]
    assert read_chat_template("builtin:tools") == TOOL_CHAT_TEMPLATE


def test_a_qwen_style_template_parses_with_the_chatml_response_template(tok):
    """A ChatML template with Qwen's ``<tool_call>`` JSON gets the ChatML response template: the same calls parse."""
    qwen = build_tokenizer()
    qwen.chat_template = "{# <tool_call> #}{% for m in messages %}<|im_start|>{{ m.role }}\n{% endfor %}"
    assert response_template(qwen) == RESPONSE_TEMPLATES["chatml"]
    text = ('<think>\nsum</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": "2"}}\n</tool_call>'
            "<|im_end|>")
    parsed = qwen.parse_response(text, RESPONSE_TEMPLATES["chatml"], prefix="<|im_start|>assistant\n",
                                 tools=[tool_schema(add)])
    assert parsed["tool_calls"] == [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]
    assert parsed["reasoning_content"] == "sum"


def test_tools_are_loaded_and_described():
    from lit_align.rewards import sort_exact

    assert load_tool("lit_align.rewards.sort_exact") is sort_exact
    with pytest.raises(LitAlignError, match=r"model.tools: 'collections.Counter' is not callable"):
        load_tool({"class_path": "collections.Counter"})
    with pytest.raises(LitAlignError, match=r"model.tools: 'no.such.fn': cannot import it"):
        load_tool("no.such.fn")
    with pytest.raises(LitAlignError, match=r"model.tools: tool 'no_docstring': .*Google-style docstring"):
        tool_schema(no_docstring)
    schema = tool_schema(add)
    assert schema["function"]["name"] == "add" and set(schema["function"]["parameters"]["properties"]) == {"a", "b"}
    results, failures = call_tools([{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}},
                                    {"type": "code", "code": "1"}], {"add": add})
    assert results == [("add", 3), ("unknown", {"error": "Unsupported tool call type: code"})] and failures == 1


def vllm_engine(**kwargs):
    from lit_align.generation import VLLMEngine

    return VLLMEngine(**kwargs)


@pytest.mark.parametrize("engine_class", [HFEngine, NativeEngine, pytest.param(vllm_engine, marks=pytest.mark.vllm)])
def test_the_loop_runs_on_the_real_engines(tiny_path, engine_class):
    """On the tiny model (which calls no tool by itself), with a tool call forced into the first turn by a scripted
    first call: every row that called a tool continues through the real engine from the exact ids, and the sampled
    log-probs of that turn are the engine's."""
    from lit_align.models import load_model, load_tokenizer

    tokenizer = load_tokenizer("builtin:tiny", chat_template="builtin:tools")
    model = load_model("builtin:tiny")
    engine = ScriptedEngine(tokenizer, [[CALL, "7</s>"]], then=engine_class(max_new_tokens=5))
    loop = ToolLoop([add], tokenizer, max_completion_length=120)
    _, ids, mask = prompt_batch(tokenizer, ["add 12 30"])
    torch.manual_seed(0)
    rollout = loop.generate(engine, model, ids, mask, 2, [tokenizer.eos_token_id], tokenizer.pad_token_id)
    first = encode(tokenizer, CALL)
    ids0, mask0, logps0 = row(rollout, 0)
    tool_turn = encode(tokenizer, "<|tool|>42\n") + [tokenizer.convert_tokens_to_ids("<|assistant|>")]
    assert ids0[: len(first) + len(tool_turn)] == first + tool_turn
    sampled = len(ids0) - len(first) - len(tool_turn)
    assert 1 <= sampled <= 5 and mask0[len(first) + len(tool_turn):] == [1] * sampled
    assert all(v < 0 for v in logps0[-sampled:])  # the engine's log-probs, not zeros


# -- parity with TRL 1.16's _tool_call_loop, on the same sampled ids --------------------------------------------------
def echo(text: str) -> str:
    """Say it back.

    Args:
        text: what to say
    """
    return text


LONG = "x" * 100
PARITY_TURNS = [  # per generate call, one text per row it is given
    [CALL, "41</s>", '<tool_call>{"name": "nope", "arguments": {}}</tool_call></s>',
     '<tool_call>{"name": "echo", "arguments": {"text": "' + LONG + '"}}</tool_call></s>'],
    ["42</s>", CALL],  # rows 0 and 2 continue (row 3's result overflows: rolled back); row 2's turn is cut
]
PARITY_BUDGET = 160


def trl_tool_loop(tok, prompt_rows: list[list[int]], questions: list[str]):
    """TRL's ``GRPOTrainer._tool_call_loop`` on a stand-in ``self``, its generations replayed from ``PARITY_TURNS``
    (the first turn parsed by TRL's own ``parse_response``, as its ``_generate`` does)."""
    trl = pytest.importorskip("trl")
    from types import SimpleNamespace

    from trl.chat_template_utils import parse_response

    tok.response_template = RESPONSE_TEMPLATES["builtin"]  # TRL reads it off the tokenizer
    turns = [list(t) for t in PARITY_TURNS]

    def replay(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        ids = [encode(tok, text) for text in turns.pop(0)]
        return ids, [[-(k + 1) / 100 for k in range(len(r))] for r in ids]

    tools = [add, echo]
    fake = SimpleNamespace(
        _sync_tool_dicts=[{t.__name__: t for t in tools}] * 4, _async_tool_dicts=[{}] * 4,
        max_tool_calling_iterations=10**9, use_vllm=False, vllm_mode="colocate", _is_vlm=False, tools=tools,
        model=SimpleNamespace(config=SimpleNamespace(max_position_embeddings=512)),
        max_completion_length=PARITY_BUDGET, environment_factories=None, _tokenizer=tok, processing_class=tok,
        chat_template=None, chat_template_kwargs={}, _generate_single_turn=replay)
    fake._get_tool_suffix_ids = lambda messages: trl.GRPOTrainer._get_tool_suffix_ids(fake, messages)
    prompts = [[{"role": "user", "content": q}] for q in questions for _ in range(2)]
    prompt_ids = [p for p in prompt_rows for _ in range(2)]
    completion_ids, logprobs = replay(None, None, None, 2)
    completions = [[parse_response(tok, ids, prefix=prompt_ids[i], tools=tools)]
                   for i, ids in enumerate(completion_ids)]
    out = trl.GRPOTrainer._tool_call_loop(fake, prompts, prompt_ids, completion_ids, completions, logprobs, None, {})
    tool_mask, completions, completion_ids, logprobs, calls, failures, _ = out
    return SimpleNamespace(tool_mask=tool_mask, completions=completions, completion_ids=completion_ids,
                           logprobs=logprobs, calls=calls, failures=failures)


def test_the_loop_matches_trls_tool_call_loop(tok):
    """The same sampled ids through both loops: the same completion ids, tool mask, log-probs, turns and counts, with
    a tool result, a direct answer, an unknown tool, a result rolled back past the budget and a turn cut to it."""
    import copy

    questions = ["add 12 30", "say x"]
    rollout, engine, prompts = run(tok, PARITY_TURNS, tools=(add, echo), questions=questions,
                                   max_completion_length=PARITY_BUDGET)
    theirs = trl_tool_loop(copy.deepcopy(tok), prompts, questions)
    ours = [row(rollout, i) for i in range(4)]
    assert [ids for ids, _, _ in ours] == theirs.completion_ids
    assert [mask for _, mask, _ in ours] == theirs.tool_mask
    for (_, _, logps), trl_logps in zip(ours, theirs.logprobs):
        assert logps == pytest.approx(trl_logps, abs=1e-7)  # float32 here, Python floats there
    assert (rollout.tool_calls, rollout.tool_failures) == (theirs.calls, theirs.failures) == (3, 1)
    assert rollout.messages == theirs.completions
    # what each row went through: a tool turn; none; an error turn then a turn cut at the budget; a result rolled back
    assert [m["role"] for m in rollout.messages[0]] == ["assistant", "tool", "assistant"]
    assert [m["role"] for m in rollout.messages[2]] == ["assistant", "tool", "assistant"]
    assert len(ours[2][0]) == PARITY_BUDGET and rollout.truncated.tolist() == [False, False, True, False]
    assert ours[3][0] == encode(tok, PARITY_TURNS[0][3]) and rollout.messages[3][1:] == []


def test_the_loss_over_a_tool_rollout_matches_trls(tok):
    """TRL's ``_compute_loss`` with its ``tool_mask`` and lit_align's loss with ``loss_mask = completion_mask *
    tool_mask`` (what ``GRPOModule.make_round`` builds) on the parity rollout, float64: loss, entropy and KL
    metrics; and TRL's mean length (the sum of its tool mask) is lit_align's ``completions/mean_length``."""
    import copy
    from collections import defaultdict
    from types import SimpleNamespace

    from lit_align.losses.grpo import aggregate_grpo_loss, grpo_token_losses

    trl = pytest.importorskip("trl")
    questions = ["add 12 30", "say x"]
    rollout, _, prompts = run(tok, PARITY_TURNS, tools=(add, echo), questions=questions,
                              max_completion_length=PARITY_BUDGET)
    mask, tool_mask = rollout.completion_mask.double(), rollout.tool_mask.double()
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(mask.shape, generator=g, dtype=torch.float64) * 3
    logps = old + 0.3 * torch.randn(mask.shape, generator=g, dtype=torch.float64)
    ref = old + 0.2 * torch.randn(mask.shape, generator=g, dtype=torch.float64)
    entropy = torch.rand(mask.shape, generator=g, dtype=torch.float64)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    loss_mask = mask * tool_mask
    metrics = {"train": defaultdict(list)}
    fake = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, entropy, None), aux_loss_enabled=False,
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token", beta=0.04,
        loss_type="dapo", epsilon_low=0.2, epsilon_high=0.28, use_vllm=False, vllm_importance_sampling_correction=False,
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        max_completion_length=PARITY_BUDGET, _entropy_bonus_enabled=False,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        accelerator=SimpleNamespace(num_processes=1, reduce=lambda t, reduction="sum": t, gather=lambda t: t),
        _metrics=metrics)
    inputs = {"prompt_ids": torch.zeros(4, 1, dtype=torch.long), "prompt_mask": torch.ones(4, 1),
              "completion_ids": rollout.completion_ids, "completion_mask": mask, "tool_mask": tool_mask,
              "advantages": advantages, "old_per_token_logps": old, "ref_per_token_logps": ref,
              "num_items_in_batch": loss_mask.sum()}  # TRL: the loss mask's tokens, tool mask applied
    trl_loss = trl.GRPOTrainer._compute_loss(fake, None, inputs)
    token_losses, info = grpo_token_losses(logps, old, advantages, 0.2, 0.28, ref, 0.04)
    ours = aggregate_grpo_loss(token_losses, loss_mask, "dapo", PARITY_BUDGET, float(loss_mask.sum()))
    assert float(ours) == pytest.approx(float(trl_loss), abs=1e-12)
    masked_mean = lambda x: float((x * loss_mask).sum() / loss_mask.sum())  # noqa: E731 (GRPOModule's)
    assert masked_mean(entropy) == pytest.approx(metrics["train"]["entropy"][-1], abs=1e-12)
    assert masked_mean(info["kl"]) == pytest.approx(metrics["train"]["kl"][-1], abs=1e-12)
    assert abs(masked_mean(entropy) - float((entropy * mask).sum() / mask.sum())) > 1e-3  # the tool mask matters
    theirs = trl_tool_loop(copy.deepcopy(tok), prompts, questions)  # TRL's completion lengths: its tool mask's sums
    assert loss_mask.sum(1).tolist() == [sum(m) for m in theirs.tool_mask]
