"""DPOModule under lightning.Trainer: the step-0 loss, the frozen reference, checkpoints, resume, and learning."""

from __future__ import annotations

import math
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint
from transformers import AutoModelForCausalLM

from lit_align.data import PreferenceDataModule
from lit_align.errors import LitAlignError
from lit_align.modules import DPOModule
from helpers import trainer
from numerics import TINY_TERMS, assert_rounding_close

# what DPO logs, TRL's names (``DPOModule.metrics``)
METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected", "logits/chosen", "logits/rejected", "entropy", "mean_token_accuracy")

REPO = Path(__file__).resolve().parents[2]
LN2_F32 = torch.tensor(math.log(2), dtype=torch.float32).item()


def data(**kw) -> PreferenceDataModule:
    kw = {"path": "builtin:sort", "batch_size": 4, "max_length": 32, "val_split": None, "shuffle": False, **kw}
    return PreferenceDataModule(**kw)


class Record(L.Callback):
    """Per training batch: the global step and the step's loss."""

    def __init__(self):
        self.steps, self.losses = [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.steps.append(trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def original(tiny_path) -> dict[str, torch.Tensor]:
    """The built-in tiny model's weights, as loaded from disk."""
    return params(AutoModelForCausalLM.from_pretrained(tiny_path))


def test_step0_loss_is_ln2_on_a_real_batch(original):
    module = DPOModule(model="builtin:tiny")
    module.configure_model()
    assert same(params(module.policy), original) and same(params(module.reference.model), original)
    dm = data(tokenizer="builtin:tiny", batch_size=8)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape[0] == 16
    module.train()
    out, _ = module.pair_outputs(batch)
    # policy == reference: every log-ratio is exactly 0, so each pair's loss is -logsigmoid(0) = ln 2
    assert out["loss"].tolist() == [LN2_F32] * 8
    assert out["loss"].mean().item() == pytest.approx(math.log(2), abs=1e-7)
    assert out["rewards/chosen"].tolist() == [0.0] * 8 and out["rewards/margins"].tolist() == [0.0] * 8
    assert out["rewards/accuracies"].tolist() == [0.0] * 8  # a tie is not a win
    assert (out["logps/chosen"] < 0).all() and (out["logps/rejected"] < 0).all()
    assert set(out) == set(METRICS) and module.metrics == METRICS
    # the reference stays in eval mode and frozen while the policy trains
    assert module.policy.training and not module.reference.model.training
    assert not any(p.requires_grad for p in module.reference.model.parameters())
    assert all(p.requires_grad for p in module.policy.parameters())


def test_completion_logps_match_a_plain_forward(original):
    """The per-token completion log-probs (with logits_to_keep), and WPO's log sum_v p(v)^2, equal a full forward +
    log_softmax by hand."""
    from test_layouts import completion_logps

    module = DPOModule(model="builtin:tiny")
    module.configure_model()
    dm = data(tokenizer="builtin:tiny")
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    result = completion_logps(module.policy, batch, ("log_sum_sq_probs",))
    assert result.mask.sum(1).tolist() == batch["completion_mask"].sum(1).tolist()
    with torch.no_grad():
        logits = module.policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logprobs = torch.log_softmax(logits[:, :-1].float(), -1)
    expected, expected_sum_sq, got_sum_sq = [], [], []
    for n in range(batch["input_ids"].shape[0]):
        total = 0.0
        for t in range(1, batch["input_ids"].shape[1]):
            if batch["completion_mask"][n, t]:
                total += logprobs[n, t - 1, batch["input_ids"][n, t]].item()
                expected_sum_sq.append(math.log((logprobs[n, t - 1].exp() ** 2).sum().item()))
        expected.append(total)
        got_sum_sq += result.stats["log_sum_sq_probs"][n][result.mask[n]].tolist()
    # logits_to_keep and the gather/logsumexp path against a full log_softmax: the same formula, other kernels
    assert_rounding_close(result.tokens.sum(1), expected, terms=TINY_TERMS)
    assert_rounding_close(got_sum_sq, expected_sum_sq, scale=max(map(abs, expected_sum_sq)) + 10.0, terms=TINY_TERMS)


def test_share_prompt_gives_the_plain_batch_numbers(tmp_path, tiny_path):
    """``share_prompt`` ([prompt, chosen, rejected] rows) and the plain [chosen; rejected] batch: same statistics."""
    from lit_align.capabilities import supports_shared_prompt

    noisy = AutoModelForCausalLM.from_pretrained(tiny_path)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
    noisy.save_pretrained(tmp_path / "ref")
    dm = data(tokenizer="builtin:tiny", batch_size=6)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    outs = {}
    for share in (True, False):
        module = DPOModule(model="builtin:tiny", ref_model=str(tmp_path / "ref"), share_prompt=share)
        module.configure_model()
        assert supports_shared_prompt(module.policy)  # the built-in Llama takes the shared path when asked
        outs[share] = module.pair_outputs(batch)[0]
    # other sequence layouts, the same formulas: every metric within the rounding of the summed log-probs
    scale = max(outs[False]["logps/chosen"].abs().max(), outs[False]["logps/rejected"].abs().max())
    for name in METRICS:
        assert_rounding_close(outs[True][name], outs[False][name], scale=scale, terms=TINY_TERMS, msg=name)
    assert all(abs(x - math.log(2)) > 1e-3 for x in outs[True]["loss"].tolist())  # policy != reference here


@pytest.mark.filterwarnings("ignore:lit_align. resumed with another length")  # resumed with more steps on purpose
def test_training_reference_frozen_checkpoint_and_resume(tmp_path, original):
    # -- 4 steps, checkpoint at step 4 -------------------------------------------------------------------------------
    record = Record()
    ckpt_dir = tmp_path / "ckpt"
    module = DPOModule(model="builtin:tiny", learning_rate=1e-3)
    checkpoint = ModelCheckpoint(dirpath=ckpt_dir, filename="step{step}", every_n_train_steps=4, save_top_k=-1,
                                 auto_insert_metric_name=False)
    t = trainer(tmp_path, 4, [record, checkpoint], enable_checkpointing=True)
    t.fit(module, data())
    assert t.global_step == 4 and record.steps == [0, 1, 2, 3]
    assert record.losses[0] == pytest.approx(math.log(2), abs=1e-6)  # step 0 in a real fit, too
    assert record.losses[-1] < record.losses[0]

    assert same(params(module.reference.model), original), "the reference model changed during training"
    policy_after = params(module.policy)
    changed = [k for k in original if not torch.equal(original[k], policy_after[k])]
    assert len(changed) == len(original), f"policy tensors left unchanged: {set(original) - set(changed)}"

    # -- the checkpoint holds the policy, not the reference -----------------------------------------------------------
    path = ckpt_dir / "step4.ckpt"
    assert path.exists(), list(ckpt_dir.iterdir())
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    keys = list(ckpt["state_dict"])
    assert not [k for k in keys if k.startswith("reference.")]
    assert {f"policy.{k}" for k in original} <= set(keys)
    embed = "model.embed_tokens.weight"
    assert torch.equal(ckpt["state_dict"][f"policy.{embed}"], policy_after[embed])
    assert ckpt["global_step"] == 4

    # -- resume into a fresh module and trainer, up to step 7 ---------------------------------------------------------
    class AtStart(L.Callback):
        def on_train_start(self, trainer, pl_module):
            self.policy = params(pl_module.policy)
            self.ref = params(pl_module.reference.model)

    at_start, record2 = AtStart(), Record()
    resumed = DPOModule(model="builtin:tiny", learning_rate=1e-3)
    t2 = trainer(tmp_path, 7, [at_start, record2])
    t2.fit(resumed, data(), ckpt_path=str(path))
    assert record2.steps == [4, 5, 6] and t2.global_step == 7
    assert same(at_start.policy, policy_after), "resume did not restore the trained policy"
    assert same(at_start.ref, original) and same(params(resumed.reference.model), original), "resume changed the reference"
    assert record2.losses[0] != pytest.approx(math.log(2), abs=1e-3)  # a trained policy, not a fresh one
    assert not same(params(resumed.policy), policy_after)


@pytest.mark.parametrize("options,message", [
    ({"loss_type": "dpo"}, r"model.loss_type 'dpo': expected one or a list of \('sigmoid', 'hinge', 'ipo', "),
    ({"loss_type": ["sigmoid", "kto"]}, r"model.loss_type 'kto': expected one or a list of \('sigmoid', "),
    ({"loss_type": []}, r"model.loss_type \[\]: expected one or a list of"),
    ({"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0]},
     r"model.loss_weights \[1.0\]: expected one weight per loss_type \['sigmoid', 'sft'\]"),
    ({"f_divergence_type": "kl"}, r"model.f_divergence_type 'kl': expected one of \('reverse_kl', "),
    ({"loss_type": ["sigmoid", "bco_pair"], "f_divergence_type": "js_divergence"},
     r"model.f_divergence_type 'js_divergence' with loss_type \['sigmoid', 'bco_pair'\]: expected 'reverse_kl'"),
    ({"loss_type": "robust", "label_smoothing": 0.5}, r"model.label_smoothing 0.5: expected a value in \[0, 0.5\)"),
    ({"loss_type": "exo_pair"}, r"model.label_smoothing 0.0: expected a value in \(0, 1\) for 'exo_pair'"),
    ({"label_smoothing": -0.1}, r"model.label_smoothing -0.1: expected a value in \[0, 1\]"),
    ({"ld_alpha": 1.5}, r"model.ld_alpha 1.5: expected None or a value in \[0, 1\]"),
    ({"loss_type": "aot", "use_weighting": True}, r"model.use_weighting: not available with loss_type 'aot'"),
    ({"discopop_tau": 0.0}, r"model.discopop_tau 0.0: expected a value > 0"),
])
def test_bad_loss_options(options, message):
    with pytest.raises(LitAlignError, match=message):
        DPOModule(**options)


def test_loss_options_reach_the_loss(tmp_path, tiny_path):
    """A list-valued loss_type with weights, through pair_outputs: the weighted sum of the single losses."""
    dm = data(tokenizer="builtin:tiny", batch_size=4)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    noisy = AutoModelForCausalLM.from_pretrained(tiny_path)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(0.01)
    noisy.save_pretrained(tmp_path / "ref")
    losses = {}
    for loss_type, weights in [("sigmoid", None), ("sft", None), (["sigmoid", "sft"], [0.8, 0.2])]:
        module = DPOModule(model="builtin:tiny", ref_model=str(tmp_path / "ref"), loss_type=loss_type,
                           loss_weights=weights)
        module.configure_model()
        with torch.no_grad():
            losses[str(loss_type)] = module.pair_outputs(batch)[0]["loss"]
    torch.testing.assert_close(losses["['sigmoid', 'sft']"], 0.8 * losses["sigmoid"] + 0.2 * losses["sft"])
    assert not torch.allclose(losses["sigmoid"], losses["sft"])


def test_explicit_ref_model(tmp_path, tiny_path, original):
    """ref_model names another checkpoint: the reference is that model, the policy the other one."""
    noisy = AutoModelForCausalLM.from_pretrained(tiny_path)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(0.01)
    noisy.save_pretrained(tmp_path / "ref")
    module = DPOModule(model="builtin:tiny", ref_model=str(tmp_path / "ref"))
    module.configure_model()
    assert same(params(module.policy), original)
    assert same(params(module.reference.model), params(noisy))
    dm = data(tokenizer="builtin:tiny")
    dm.setup("fit")
    out, _ = module.pair_outputs(next(iter(dm.train_dataloader())))
    assert all(abs(x - math.log(2)) > 1e-4 for x in out["loss"].tolist())


def test_learns_the_builtin_task_held_out(tmp_path, capsys):
    """configs/dpo.yaml's settings, 150 steps: held-out reward accuracy well above chance."""
    config = yaml.safe_load((REPO / "configs" / "dpo.yaml").read_text())
    L.seed_everything(config["seed_everything"])
    module = DPOModule(**config["model"]["init_args"])
    dm = PreferenceDataModule(**config["data"]["init_args"])
    tc = config["trainer"]
    t = trainer(tmp_path, tc["max_steps"], val_check_interval=tc["val_check_interval"], num_sanity_val_steps=0,
                accelerator=tc["accelerator"], devices=tc["devices"])
    t.fit(module, dm)
    assert t.global_step == 150
    accuracy = t.callback_metrics["val/rewards/accuracies"].item()
    margin = t.callback_metrics["val/rewards/margins"].item()
    with capsys.disabled():
        print(f"\n[dpo] held-out val/rewards/accuracies after 150 steps: {accuracy:.3f} (margin {margin:.3f})")
    assert accuracy > 0.7
    assert margin > 0
    assert len(dm.val_data) == 200  # held out: the task's 200 test prompts, none of them in the training rows


def test_validate_then_fit_on_one_module(tmp_path):
    """``trainer.validate`` (inference mode) then ``trainer.fit`` on the same module: fit's validation updates the
    metrics again, from fresh states (the step-0 validation gave ln 2; after 2 steps at lr 1e-3 it differs)."""
    module = DPOModule(model="builtin:tiny", learning_rate=1e-3)
    dm = data(val_split="test", val_batch_size=8)
    t = trainer(tmp_path, max_steps=2, limit_val_batches=2, val_check_interval=2)
    before = t.validate(module, dm, verbose=False)[0]["val/loss"]
    t.fit(module, dm)
    assert before == pytest.approx(math.log(2), abs=1e-6)
    assert float(t.callback_metrics["val/loss"]) != pytest.approx(before, abs=1e-4)


def test_grad_norm_and_learning_rate_are_logged(tmp_path, tiny_path):
    """TRL's ``grad_norm`` (before clipping) and ``learning_rate``, at every optimizer step."""
    from lightning.pytorch.loggers import CSVLogger

    from helpers import fit, read_metrics

    module = DPOModule(model="builtin:tiny", learning_rate=1e-3, lr_scheduler_type="constant")
    fit(module, data(), tmp_path, max_steps=3, logger=CSVLogger(tmp_path, name="m"), gradient_clip_val=1e-6)
    rows = [r for r in read_metrics(tmp_path / "m" / "version_0" / "metrics.csv") if "train/grad_norm" in r]
    assert [int(r["step"]) for r in rows] == [0, 1, 2]
    assert [r["train/learning_rate"] for r in rows] == [float(torch.tensor(1e-3))] * 3  # logged as fp32
    assert all(r["train/grad_norm"] > 1e-3 for r in rows)  # the norm before clipping to 1e-6


def test_optimizers_by_trl_name_or_the_lightningcli_way(tmp_path, tiny_path):
    from lightning.pytorch.loggers import CSVLogger

    import sys

    from helpers import fit, read_metrics

    module = DPOModule(model="builtin:tiny", optim="sgd", learning_rate=0.05)
    trainer = fit(module, data(), tmp_path)
    (optimizer,) = trainer.optimizers
    assert type(optimizer) is torch.optim.SGD and optimizer.defaults["lr"] == 0.05

    # the LightningCLI way: any optimizer as class_path/init_args
    from lit_align.cli import run

    argv, sys.argv = sys.argv, ["lit-align"]
    try:
        cli = run(["fit", "-c", str(REPO / "configs" / "dpo.yaml"), "--trainer.max_steps", "1",
                   "--trainer.val_check_interval", "1.0", "--data.init_args.val_split", "null",
                   "--trainer.logger", "false", "--trainer.enable_checkpointing", "false", "--export.enabled", "false",
                   "--model.init_args.learning_rate", "0.05",
                   "--model.init_args.optimizer", "{class_path: torch.optim.SGD, init_args: {momentum: 0.9}}",
                   "--trainer.default_root_dir", str(tmp_path)])
    finally:
        sys.argv = argv
    (optimizer,) = cli.trainer.optimizers
    assert type(optimizer) is torch.optim.SGD and optimizer.defaults["momentum"] == 0.9
    assert optimizer.defaults["lr"] == 0.05  # model.learning_rate (tests/test_optimizers.py: the rules)

    # lr_scheduler_kwargs reach the schedule: two cosine cycles restart at the half
    lrs = {}
    for cycles in (1, 2):
        module = DPOModule(model="builtin:tiny", learning_rate=1e-3, lr_scheduler_type="cosine_with_restarts",
                           lr_scheduler_kwargs={"num_cycles": cycles})
        root = tmp_path / f"cycles{cycles}"
        fit(module, data(), root, max_steps=8, logger=CSVLogger(root, name="m"))
        lrs[cycles] = {int(r["step"]): r["train/learning_rate"]
                       for r in read_metrics(root / "m" / "version_0" / "metrics.csv") if "train/learning_rate" in r}
    assert lrs[2][4] == lrs[2][0] > lrs[1][4]

    with pytest.raises(LitAlignError, match=r"model.optim 'adamw_9bit' is not an optimizer name: expected one of"):
        DPOModule(optim="adamw_9bit")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        module = DPOModule(model="builtin:tiny", optim="adamw_8bit")
        with pytest.raises(LitAlignError, match=r"model.optim 'adamw_8bit' needs bitsandbytes: pip install"):
            fit(module, data(), tmp_path / "bnb")
