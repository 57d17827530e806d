"""lit_align.hub: the export's model card, and the upload to the Hugging Face Hub (a local stand-in for the Hub)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers import assert_one_line_error, run_main

from lit_align.data import CompletionDataModule, PreferenceDataModule
from lit_align.hub import is_hub_id, model_card, non_default_settings, recipe_defaults
from lit_align.modules import DPOModule, SFTModule

DPO = str(Path(__file__).resolve().parents[1] / "configs" / "dpo.yaml")


def test_the_card_cites_hub_names_lists_the_recipes_settings_and_metrics_and_how_to_reproduce():
    module = DPOModule(model="HuggingFaceTB/SmolLM2-135M", beta=0.25)
    data = PreferenceDataModule(mixture=[{"path": "trl-lib/ultrafeedback_binarized"}, {"path": "builtin:sort"}])
    card = model_card(module, data, {"val/acc": 0.5, "train/loss": 0.693147}, "me/dpo",
                      command="lit-align fit -c x.yaml", has_config=True)
    assert card.startswith("---\nbase_model: HuggingFaceTB/SmolLM2-135M\nlibrary_name: transformers\ntags:\n"
                           "- lit_align\n- dpo\ndatasets:\n- trl-lib/ultrafeedback_binarized\n---\n\n# me/dpo\n\n"
                           "DPO of `HuggingFaceTB/SmolLM2-135M` with lit_align (`lit_align.modules.dpo.DPOModule`).\n")
    assert ("| setting | value |\n|---|---|\n| `learning_rate` | `1e-06` |\n| `beta` | `0.25` |\n"
            "| `loss_type` | `sigmoid` |\n") in card
    assert "## Data\n\n`trl-lib/ultrafeedback_binarized`, `builtin:sort`\n" in card
    assert "| `train/loss` | 0.6931 |\n| `val/acc` | 0.5 |\n" in card  # sorted, 4 significant digits
    assert ("    lit-align fit -c lit_align_config.yaml\n\n`lit_align_config.yaml` (in this directory) is the run's "
            "resolved config; the run was started as `lit-align fit -c x.yaml`.") in card


def test_a_python_run_on_local_data_has_no_hub_metadata_and_says_how_it_was_trained(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "a", "completion": "b"}\n')
    card = model_card(SFTModule(learning_rate=1e-4), CompletionDataModule(str(rows)), {}, "tiny")
    assert card.startswith("---\nlibrary_name: transformers\ntags:\n- lit_align\n- sft\n---\n\n# tiny\n")
    assert "| setting | value |\n|---|---|\n| `learning_rate` | `0.0001` |\n\n" in card
    assert f"## Data\n\n`{rows}`\n" in card and "datasets:" not in card
    assert "| (none logged) | |" in card
    assert "Trained from Python (no `lit-align` config); the settings above are those that differ" in card


def test_settings_are_those_that_differ_from_the_class_defaults_plus_the_recipes_key_ones():
    assert recipe_defaults(SFTModule)["learning_rate"] == 2e-5  # the subclass's default over AlignModule's 1e-6
    assert recipe_defaults(SFTModule)["dtype"] == "float32"  # a base-class default
    assert non_default_settings(SFTModule(learning_rate=2e-5, dtype="bfloat16")) == {
        "dtype": "bfloat16", "learning_rate": 2e-5}
    assert non_default_settings(DPOModule()) == {"learning_rate": 1e-6, "beta": 0.1, "loss_type": "sigmoid"}


def test_only_org_slash_name_that_is_not_a_local_path_is_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "model").mkdir()
    assert is_hub_id("Qwen/Qwen2.5-0.5B")
    for name in ("local/model", "builtin:tiny", "gpt2", "a/b/c", "./x/y", "/x/y", "~/x", None, ""):
        assert not is_hub_id(name), name


class HubStandIn:
    """``huggingface_hub.HfApi``'s create_repo / upload_folder, recording what they were given: a local stand-in for
    the Hub (the files land in ``root/<repo_id>``)."""

    def __init__(self, root, fail: bool = False):
        self.root, self.fail, self.created = root, fail, []

    def create_repo(self, api, repo_id, private=None, repo_type=None, exist_ok=False, **_):
        from huggingface_hub import RepoUrl

        self.created.append((repo_id, private, repo_type, exist_ok))
        return RepoUrl(f"https://huggingface.co/{repo_id}")

    def upload_folder(self, api, repo_id, folder_path, commit_message=None, repo_type=None, ignore_patterns=None, **_):
        if self.fail:
            raise OSError("connection refused")
        shutil.copytree(folder_path, self.root / repo_id, ignore=shutil.ignore_patterns(*ignore_patterns or []))
        self.message = commit_message


def push_run(tmp_path, capfd, *extra):
    return run_main(["fit", "-c", DPO, "--trainer.max_steps", "1", "--data.init_args.val_split", "null",
                     "--trainer.enable_progress_bar", "false", "--trainer.logger", "false",
                     "--trainer.enable_checkpointing", "false", "--trainer.default_root_dir", str(tmp_path),
                     "--export.path", str(tmp_path / "model"), *extra], capfd)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    from huggingface_hub import HfApi

    stand_in = HubStandIn(tmp_path / "hub")
    monkeypatch.setattr(HfApi, "create_repo", lambda api, *a, **k: stand_in.create_repo(api, *a, **k))
    monkeypatch.setattr(HfApi, "upload_folder", lambda api, *a, **k: stand_in.upload_folder(api, *a, **k))
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    return stand_in


def test_push_to_hub_uploads_the_export_with_its_card(tmp_path, capfd, hub):
    code, _, err = push_run(tmp_path, capfd, "--export.push_to_hub", "true", "--export.hub_model_id", "me/tiny-dpo",
                            "--export.hub_private_repo", "true")
    assert code == 0, err
    assert hub.created == [("me/tiny-dpo", True, "model", True)]
    pushed = tmp_path / "hub" / "me" / "tiny-dpo"
    local = sorted(p.name for p in (tmp_path / "model").iterdir())
    assert sorted(p.name for p in pushed.iterdir()) == [n for n in local if n != "lit_align_export.json"]
    assert "\n# me/tiny-dpo\n" in (pushed / "README.md").read_text()  # titled by its repo
    assert hub.message == "lit_align: DPOModule after 1 steps"


def test_push_to_hub_mistakes_are_one_line_and_a_failed_upload_keeps_the_export(tmp_path, capfd, hub, monkeypatch):
    code, _, err = push_run(tmp_path, capfd, "--export.push_to_hub", "true")
    assert_one_line_error(code, err, "export.push_to_hub needs export.hub_model_id")

    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))  # no stored token either
    code, _, err = push_run(tmp_path, capfd, "--export.push_to_hub", "true", "--export.hub_model_id", "me/x")
    assert_one_line_error(code, err, "needs a Hugging Face token")
    assert not (tmp_path / "model").exists()  # refused before training

    monkeypatch.setenv("HF_TOKEN", "hf_test")
    hub.fail = True
    code, _, err = push_run(tmp_path, capfd, "--export.push_to_hub", "true", "--export.hub_model_id", "me/x")
    assert_one_line_error(code, err, "export.push_to_hub to 'me/x' failed (connection refused)",
                          f"the model is saved at {tmp_path / 'model'}")
    assert (tmp_path / "model" / "config.json").exists() and (tmp_path / "model" / "README.md").exists()
