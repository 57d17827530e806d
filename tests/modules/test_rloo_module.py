"""RLOOModule: it trains through ``lit-align fit`` on the built-in task with TRL's metric names, a step matches TRL's
``RLOOTrainer`` on the same completions, and docs/rloo.md names every RLOOConfig field (its defaults are compared with
TRL's with the other recipes', in ``test_grpo_module.py``).

The TRL side runs ``RLOOTrainer._generate_and_score_completions`` and ``_compute_loss`` on a stand-in ``self`` whose
generation and reward calls hand back what lit_align sampled and scored, and whose log-probs are TRL's own
``_get_per_token_logps_and_entropies`` through its fused LM head on copies of the same initial policy.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import defaultdict
from contextlib import nullcontext
from pathlib import Path
from types import MethodType, SimpleNamespace

import lightning as L
import pytest
import torch
from helpers import fit, read_metrics, write_sort_rows
from lightning.pytorch.loggers import CSVLogger

from lit_align.cli import run
from lit_align.data import PromptDataModule
from lit_align.errors import LitAlignError
from lit_align.hub import recipe_defaults
from lit_align.models import load_model
from lit_align.modules.base import disable_dropout
from lit_align.modules import RLOOModule
from numerics import TINY_TERMS, assert_rounding_close

REPO = Path(__file__).resolve().parents[2]
RLOO_PAGE = REPO / "docs" / "rloo.md"


def test_rloo_trains_through_the_cli_with_trls_metric_names(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["lit-align"])
    cli = run(["fit", "-c", str(REPO / "configs" / "rloo.yaml"), "--model.init_args.model", "builtin:tiny",
               "--data.init_args.batch_size", "8", "--data.init_args.val_batch_size", "8",
               "--trainer.limit_val_batches", "1", "--trainer.max_steps", "4", "--trainer.val_check_interval", "4",
               "--model.init_args.steps_per_generation", "1", "--trainer.callbacks", "[]",
               "--trainer.log_every_n_steps", "1",
               "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", str(tmp_path),
               "--export.enabled", "false", "--model.init_args.learning_rate", "1e-3"])
    before = load_model("builtin:tiny").state_dict()
    after = cli.model.policy.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the policy moved
    assert cli.model.round_shape.num_generations == 4  # model.num_generations in the config
    rows = read_metrics(Path(cli.trainer.log_dir) / "metrics.csv")
    names = {k for r in rows for k in r}
    expected = {"train/loss", "train/reward", "train/reward_std", "train/kl", "train/entropy",
                "train/rewards/sort_accuracy/mean", "train/rewards/sort_accuracy/std", "train/frac_reward_zero_std",
                "train/clip_ratio/low_mean", "train/clip_ratio/high_mean", "train/clip_ratio/region_mean",
                "train/completions/mean_length", "train/completions/clipped_ratio", "val/reward"}
    assert expected <= names
    kl = [r["train/kl"] for r in rows if "train/kl" in r]
    assert kl and any(abs(v) > 1e-4 for v in kl)  # the policy moved away from the reference


def test_unset_num_generations_is_rloos_default_and_grpo_options_are_not_rlooss():
    from test_cli import parse

    from lit_align.errors import LitAlignError
    from lit_align.losses.grpo_loss import GRPOLoss

    module = RLOOModule(model="builtin:tiny", reward_funcs=["helpers.reward_digit_fraction"])
    assert module.round_shape.num_generations == 2  # TRL's RLOO default, not GRPO's 8
    cli = parse("--model.init_args.model", "builtin:tiny", config="rloo.yaml")
    grpo_only = set(GRPOLoss.__dataclass_fields__) - {"beta", "epsilon", "epsilon_high"}
    assert not grpo_only & set(cli.model.hparams)
    for grpo_only in (["--model.init_args.loss_type", "grpo"], ["--model.init_args.entropy_coef", "0.1"]):
        with pytest.raises(LitAlignError, match=f"model.{grpo_only[0].split('.')[-1]} is an option of .*GRPOModule.*, "
                                                "not of RLOOModule"):
            parse("--model.init_args.model", "builtin:tiny", *grpo_only, config="rloo.yaml")


def test_rloo_page_names_every_rloo_config_field():
    import transformers
    import trl

    base = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    own = [f.name for f in dataclasses.fields(trl.RLOOConfig) if f.name not in base]
    section = RLOO_PAGE.read_text()
    missing = [name for name in own if f"| `{name}` |" not in section]
    assert not missing, f"RLOOConfig fields missing from the RLOOConfig table in docs/rloo.md: {missing}"


def test_sync_ref_model_mixes_the_policy_into_the_reference(tmp_path):
    prompts = write_sort_rows(tmp_path / "prompts.jsonl", 16, "prompts")
    module = RLOOModule(model="builtin:tiny", reward_funcs=["helpers.reward_digit_fraction"], max_completion_length=4,
                        learning_rate=1e-3, sync_ref_model=True, ref_model_sync_steps=2, ref_model_mixup_alpha=0.5)
    dm = PromptDataModule(path=prompts, val_split=None, batch_size=4)
    fit(module, dm, max_steps=3)
    assert module.ref_sync.synced_at == [2]
    before = load_model("builtin:tiny").state_dict()
    reference = module.reference.model.state_dict()
    assert any(not torch.equal(before[k], reference[k]) for k in before)  # no longer the initial policy
    with pytest.raises(LitAlignError, match="model.sync_ref_model mixes the policy into the reference model: it needs"):
        RLOOModule(model="builtin:tiny", reward_funcs=["helpers.reward_digit_fraction"], beta=0.0, sync_ref_model=True)
    with pytest.raises(LitAlignError, match=r"model.reward_clip_range \[1.0, -1.0\]: expected \[min, max\]"):
        RLOOModule(model="builtin:tiny", reward_funcs=["helpers.reward_digit_fraction"], reward_clip_range=(1.0, -1.0))


# -- one step against TRL's RLOOTrainer ------------------------------------------------------------------------------
class Capture(L.Callback):
    """The initial policy (before any step), the first round and the first step's loss."""

    def on_train_start(self, trainer, pl_module):
        self.initial = copy.deepcopy(pl_module.policy)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 1:
            self.round, self.loss = pl_module.round, float(outputs["loss"])


def _trl_round_and_loss(policy, ref, round, num_generations: int, beta: float, normalize: bool):
    trl = pytest.importorskip("trl")
    from trl.trainer.utils import add_fused_lm_head

    for model in (policy, ref):
        add_fused_lm_head(model, temperature=1.0, outputs=("log_probs", "entropy"))
        disable_dropout(model)
    policy.train()  # TRL's training mode (dropout off, as lit_align's)
    n = len(round.completion_ids)
    prompts = [ids[m.bool()].tolist() for ids, m in zip(round.prompt_ids, round.prompt_mask)]
    completions = [ids[m.bool()].tolist() for ids, m in zip(round.completion_ids, round.completion_mask)]
    per_func = torch.tensor(list(round.reward_funcs.values())).T
    metrics = {"train": defaultdict(list)}
    fake = SimpleNamespace(
        accelerator=SimpleNamespace(device="cpu", process_index=0, reduce=lambda t, reduction="sum": t,
                                    gather=lambda t: t, autocast=nullcontext, is_main_process=True),
        model=policy, _generate=lambda _: (prompts, completions, ["x"] * n),
        _tokenizer=SimpleNamespace(pad_token_id=0), pad_to_multiple_of=None, mask_truncated_completions=False,
        eos_token_ids=[2], args=SimpleNamespace(per_device_train_batch_size=n, gradient_checkpointing_kwargs=None),
        beta=beta, ref_model=ref, num_generations=num_generations, _calculate_rewards=lambda *a: per_func.clone(),
        reward_weights=torch.ones(per_func.shape[1]), reward_clip_range=None, normalize_advantages=normalize,
        reward_func_names=list(round.reward_funcs), _metrics=metrics, aux_loss_enabled=False,
        _logs={"prompt": [], "completion": [], "rewards": defaultdict(list), "advantages": [],
               "extra": defaultdict(list), "images": []},
        _pending_extra_logs={}, _pending_metrics={}, log_multimodal=False, epsilon_low=0.2, epsilon_high=0.2,
    )
    fake._get_per_token_logps_and_entropies = MethodType(trl.RLOOTrainer._get_per_token_logps_and_entropies, fake)
    with torch.no_grad():
        out = trl.RLOOTrainer._generate_and_score_completions(fake, [{"prompt": "p"}] * n)
        loss = trl.RLOOTrainer._compute_loss(fake, policy, out)
    return out, float(loss), {k: v[-1] for k, v in metrics["train"].items()}


@pytest.mark.parametrize("normalize", [False, True])
def test_a_step_matches_trl_rloo_trainer(tmp_path, normalize):
    """The same prompts, completions and rewards give TRL's advantages, KL and loss (its log-probs from its own
    forward of the same weights: rule 3, the network's reductions in another order)."""
    prompts = write_sort_rows(tmp_path / "prompts.jsonl", 16, "prompts")
    torch.manual_seed(0)
    reference = load_model("builtin:tiny")
    with torch.no_grad():  # a reference that differs from the policy: the KL penalty moves the advantages
        for p in reference.parameters():
            p.add_(0.02 * torch.randn_like(p))
    reference.save_pretrained(tmp_path / "ref")
    module = RLOOModule(model="builtin:tiny", reward_funcs=["helpers.reward_digit_fraction"], num_generations=4,
                        max_completion_length=6, beta=0.5, normalize_advantages=normalize, learning_rate=1e-3,
                        ref_model=str(tmp_path / "ref"))
    dm = PromptDataModule(path=prompts, val_split=None, batch_size=16)
    capture = Capture()
    fit(module, dm, max_steps=1, callbacks=[capture], logger=CSVLogger(tmp_path))
    round = capture.round
    initial = capture.initial
    out, trl_loss, trl_metrics = _trl_round_and_loss(copy.deepcopy(initial), reference.eval(), round, 4, 0.5,
                                                     normalize)
    assert torch.equal(out["completion_mask"].bool(), round.completion_mask.bool())
    kl = float(((round.old_logps - round.ref_logps) * round.loss_mask).sum() / round.loss_mask.sum())
    assert_rounding_close(kl, trl_metrics["kl"], scale=float(round.ref_logps.abs().max()), terms=TINY_TERMS, msg="kl")
    assert abs(kl) > 1e-3  # the penalty is exercised
    # of the penalized rewards, as TRL's: groups that scored alike differ in their KL
    raw = torch.tensor(round.rewards).view(-1, 4).std(1).lt(1e-8).float().mean()
    assert float(round.stats["frac_reward_zero_std"]) == trl_metrics["frac_reward_zero_std"] < float(raw)
    assert_rounding_close(round.advantages, out["advantages"], scale=float(out["advantages"].abs().max()) + 1,
                          terms=TINY_TERMS, msg="advantages")
    assert round.advantages.abs().max() > 0.1
    assert_rounding_close(capture.loss, trl_loss, scale=float(out["advantages"].abs().max()) + 1, terms=TINY_TERMS,
                          msg="loss")
