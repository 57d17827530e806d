"""The three-stage pipelines chain real `lit-align fit` runs: quick versions here, the full ones under `slow`."""

from pathlib import Path

import pytest
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from lit_align import pipeline


def test_quick_pipeline_chains_stages_and_reports(tmp_path, capsys):
    pipeline.main(["--quick", "--root", str(tmp_path)])
    out = capsys.readouterr().out
    table = [line.split() for line in out.splitlines() if line.split()[:1] in (["sft"], ["dpo"], ["grpo"])]
    assert [row[0] for row in table] == ["sft", "dpo", "grpo"]
    for row in table:
        assert 0.0 <= float(row[1]) <= 1.0 and 0.0 <= float(row[2]) <= 1.0
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    # each stage started from the previous export: its saved config names it
    assert f"model: {tmp_path}/sft/hf_model" in (tmp_path / "dpo" / "run" / "config.yaml").read_text()
    assert f"model: {tmp_path}/dpo/hf_model" in (tmp_path / "grpo" / "run" / "config.yaml").read_text()
    AutoModelForCausalLM.from_pretrained(tmp_path / "grpo" / "hf_model")


@pytest.mark.slow
def test_full_pipeline_meets_its_targets(tmp_path, capsys):
    pipeline.main(["--root", str(tmp_path)])
    out = capsys.readouterr().out
    print(out)
    rows = {line.split()[0]: [float(x) for x in line.split()[1:4]]
            for line in out.splitlines() if line.split()[:1] in (["sft"], ["dpo"], ["grpo"])}
    assert rows["sft"][0] > 0.1, "SFT should solve some held-out prompts"
    assert rows["dpo"][0] > rows["sft"][0] + 0.03, "DPO (RPO) should add held-out exact match"
    assert rows["grpo"][0] > rows["dpo"][0] + 0.03, "GRPO should add held-out exact match"
    dpo_accuracy = float(out.split("DPO held-out preference (reward) accuracy:")[1].split()[0])
    assert dpo_accuracy >= 0.85
    assert Path(tmp_path / "curves.png").exists()


def test_quick_learned_reward_job_scores_grpo_with_the_reward_model_it_trained(tmp_path, capsys):
    """SFT -> reward model -> GRPO through `lit-align fit`: the reward model starts from the SFT export and GRPO
    from the SFT export too, scored by the reward model's export; the table measures the policies only."""
    pipeline.main(["--recipe", "learned-reward", "--quick", "--root", str(tmp_path)])
    out = capsys.readouterr().out
    table = [line.split() for line in out.splitlines()
             if line.split()[:1] in (["sft"], ["reward"], ["grpo"]) and ":" not in line]
    assert [row[0] for row in table] == ["sft", "grpo"]
    accuracy = float(out.split("reward model held-out pair accuracy:")[1].split()[0])
    assert 0.0 <= accuracy <= 1.0
    assert f"model: {tmp_path}/sft/hf_model" in (tmp_path / "reward" / "run" / "config.yaml").read_text()
    grpo = (tmp_path / "grpo" / "run" / "config.yaml").read_text()
    assert f"model: {tmp_path}/sft/hf_model" in grpo and f"- {tmp_path}/reward/hf_model" in grpo
    assert "train/rewards/hf_model/mean" in {name for name in pipeline.read_metrics(tmp_path / "grpo" / "run")}
    AutoModelForSequenceClassification.from_pretrained(tmp_path / "reward" / "hf_model")


def test_quick_words_job_runs_on_another_model_family_given_a_chat_template(tmp_path, capsys):
    """`make demo-real`'s chain (`--recipe smollm2-words`) from a tiny random Gemma 3 (sliding-window layers, no chat
    template): without `--chat-template` the base eval stops with one line naming model.chat_template; with
    `--chat-template builtin:gemma` every stage and eval runs (engine auto samples with hf) and each export carries
    the template and the sliding layers."""
    from tiny_gemma import LAYER_TYPES, build_tiny_gemma3

    from lit_align.models import GEMMA_CHAT_TEMPLATE

    model = str(build_tiny_gemma3(tmp_path / "gemma3"))
    with pytest.raises(SystemExit) as stop:
        pipeline.main(["--recipe", "smollm2-words", "--quick", "--root", str(tmp_path / "bare"), "--model", model])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "has no chat template: set model.chat_template" in err.splitlines()[-1]
    pipeline.main(["--recipe", "smollm2-words", "--quick", "--root", str(tmp_path), "--model", model,
                   "--chat-template", "builtin:gemma"])
    out = capsys.readouterr().out
    table = [line.split() for line in out.splitlines() if line.split()[:1] in (["base"], ["sft"], ["dpo"], ["grpo"])]
    assert [row[0] for row in table] == ["base", "sft", "dpo", "grpo"]
    assert all(0.0 <= float(x) <= 1.0 for row in table for x in row[1:4])
    for stage in ("sft", "dpo", "grpo"):
        assert "chat_template: builtin:gemma" in (tmp_path / stage / "run" / "config.yaml").read_text()
        export = tmp_path / stage / "hf_model"
        assert AutoTokenizer.from_pretrained(export).chat_template == GEMMA_CHAT_TEMPLATE
        assert AutoConfig.from_pretrained(export).layer_types == LAYER_TYPES
    assert f"model: {tmp_path}/dpo/hf_model" in (tmp_path / "grpo" / "run" / "config.yaml").read_text()


def test_without_matplotlib_the_curves_are_skipped_with_one_line(tmp_path, capsys, monkeypatch):
    """The core install has no matplotlib: the main job still runs; it says how to get the curves."""
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # what `import matplotlib` meets when absent
    assert pipeline.plot(tmp_path) is None
    assert "curves not drawn: matplotlib is not installed (pip install 'lit_align[plots]')" in capsys.readouterr().out
    assert not (tmp_path / "curves.png").exists()


SMOLLM2 = "pretrained:smollm2-135m-instruct"  # `make test-slow` fetches it first (`make pretrained`)


def quick_job(recipe: str, root, capsys) -> tuple[str, list[list[str]]]:
    """``recipe``'s chain in quick mode under ``root``: what it printed, and its table's rows, one per stage."""
    pipeline.main(["--recipe", recipe, "--quick", "--root", str(root)])
    out = capsys.readouterr().out
    table = [line.split() for line in out.splitlines() if line.split()[:1] in (["base"], ["sft"], ["dpo"], ["grpo"])]
    assert [row[0] for row in table] == ["base", "sft", "dpo", "grpo"]
    return out, table


@pytest.mark.slow
def test_quick_smollm2_job_chains_stages_from_the_pretrained_model(tmp_path, capsys, user_cache):
    """`make demo-real-arith`'s job in quick mode: base row first, each stage from the previous export, figures in
    [0, 1]."""
    out, table = quick_job("smollm2", tmp_path, capsys)
    for row in table:
        assert all(0.0 <= float(x) <= 1.0 for x in row[1:4])
    assert f"model: {SMOLLM2}" in (tmp_path / "sft" / "run" / "config.yaml").read_text()
    assert f"model: {tmp_path}/sft/hf_model" in (tmp_path / "dpo" / "run" / "config.yaml").read_text()
    assert f"model: {tmp_path}/dpo/hf_model" in (tmp_path / "grpo" / "run" / "config.yaml").read_text()
    assert "DPO held-out preference (reward) accuracy:" in out
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    AutoModelForCausalLM.from_pretrained(tmp_path / "grpo" / "hf_model")


@pytest.mark.slow
def test_quick_smollm2_words_job_runs_every_stage_and_eval_on_the_word_problems(tmp_path, capsys, user_cache):
    """`--recipe smollm2-words`: the smollm2 chain with builtin:arith-words given to every stage and every eval."""
    quick_job("smollm2-words", tmp_path, capsys)
    for run in ("sft", "dpo", "grpo", "eval-base", "eval-sft", "eval-dpo", "eval-grpo"):
        assert "path: builtin:arith-words" in (tmp_path / run / "run" / "config.yaml").read_text()
    assert f"model: {tmp_path}/dpo/hf_model" in (tmp_path / "grpo" / "run" / "config.yaml").read_text()


def test_quick_agent_job_chains_sft_and_grpo_with_the_calculator_environment(tmp_path, capsys):
    """`make demo-agent`'s chain (`--recipe smollm2-agent`) from the built-in tiny model (its tool template): the
    base eval, SFT on the calculator demonstrations, GRPO with a CalculatorEnvironment per rollout, each measured
    greedily with the tool offered; the table has accuracy, calls per completion and the valid-call rate."""
    import math

    pipeline.main(["--recipe", "smollm2-agent", "--quick", "--root", str(tmp_path), "--model", "builtin:tiny",
                   "--chat-template", "builtin:tools"])
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("stage "))
    assert header.split()[1:] == ["accuracy", "calls", "valid", "calls", "minutes"]
    table = [line.split() for line in out.splitlines() if line.split()[:1] in (["base"], ["sft"], ["grpo"])]
    assert [row[0] for row in table] == ["base", "sft", "grpo"]
    for row in table:
        accuracy, calls, valid, minutes = map(float, row[1:5])
        assert 0.0 <= accuracy <= 1.0 and 0.0 <= calls <= 2.0 and minutes >= 0.0
        assert math.isnan(valid) or 0.0 <= valid <= 1.0  # NaN: no completion called
    assert f"model: {tmp_path}/sft/hf_model" in (tmp_path / "grpo" / "run" / "config.yaml").read_text()
    grpo = pipeline.read_metrics(tmp_path / "grpo" / "run")
    assert {"train/tools/call_frequency", "train/rewards/last_number_match/mean"} <= set(grpo)
    AutoModelForCausalLM.from_pretrained(tmp_path / "grpo" / "hf_model")
