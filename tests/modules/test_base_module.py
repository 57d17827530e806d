"""lit_align.modules.base: what every module shares. Its settings' checks, TRL's ``disable_dropout``, and the
numeric guard: a non-finite loss stops the run naming the step and the offending rows (batch positions and
dataset rows), before any update; with ``on_nonfinite_loss: skip`` the batch is skipped, warned about and counted.
Either way the weights stay finite. Gradient clipping as TRL's ``max_grad_norm`` under bf16 and fp16 mixed precision
with the fused AdamW: the step gets the unscaled gradients clipped to the global norm; ``train/grad_norm`` is the norm
before clipping."""

from __future__ import annotations

import math
import re
from pathlib import Path

import lightning as L
import pytest
import torch
from datasets import Dataset
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import MixedPrecision

from helpers import fit, read_metrics, trainer
from lit_align.data import PreferenceDataModule, PromptDataModule
from lit_align.errors import LitAlignError
from lit_align.modules import AlignModule, DPOModule, GRPOModule, SFTModule


@pytest.fixture(scope="module")
def nan_pairs(tmp_path_factory) -> str:
    """12 pairs with precomputed reference log-probs; dataset row 6's is NaN (step 1, batch row 2 at batch_size 4)."""
    rows = [{"prompt": f"sort {i}{i + 1}:", "chosen": f" {i}{i + 1}", "rejected": f" {i + 1}{i}",
             "ref_chosen_logps": -5.0, "ref_rejected_logps": math.nan if i == 7 else -5.0} for i in range(1, 13)]
    path = tmp_path_factory.mktemp("nan_pairs") / "pairs.parquet"
    Dataset.from_list(rows).to_parquet(str(path))
    return str(path)


def fit_dpo(root, path, **model_kw):
    module = DPOModule(model="builtin:tiny", learning_rate=1e-3, **model_kw)
    dm = PreferenceDataModule(path=path, val_split=None, batch_size=4, shuffle=False, max_length=32)
    run = trainer(root, max_steps=3, logger=CSVLogger(root, name="guard"))
    try:
        run.fit(module, dm)
    finally:
        finite = all(torch.isfinite(p).all() for p in module.policy.parameters())
    return run, module, finite


def test_nonfinite_loss_stops_with_step_and_rows(tmp_path, nan_pairs, tiny_path):
    with pytest.raises(LitAlignError) as info:
        fit_dpo(tmp_path, nan_pairs)
    assert str(info.value) == (
        "non-finite training loss (nan) at step 1, batch 1, rows [2] (dataset rows [6]); nothing was updated "
        "(set model.on_nonfinite_loss: skip to skip such batches)")


def test_nonfinite_loss_skip_counts_and_keeps_weights_finite(tmp_path, nan_pairs, tiny_path):
    with pytest.warns(UserWarning, match=r"non-finite loss at step 1, batch 1, rows \[2\] \(dataset rows \[6\]\): "
                                          r"batch skipped \(1 so far\)"), \
            pytest.warns(UserWarning, match="`training_step` returned `None`"):  # Lightning's, on the skipped batch
        trainer, module, finite = fit_dpo(tmp_path, nan_pairs, on_nonfinite_loss="skip")
    assert finite and trainer.global_step == 3 and module.skipped_batches == 1
    metrics = read_metrics(tmp_path / "guard" / "version_0" / "metrics.csv")
    skipped = {int(r["step"]): r["train/skipped_batches"] for r in metrics if "train/skipped_batches" in r}
    assert skipped == {0: 0.0, 1: 1.0, 2: 1.0}
    assert all(math.isfinite(r["train/loss"]) for r in metrics if "train/loss" in r)


def test_bad_option():
    with pytest.raises(LitAlignError, match="model.on_nonfinite_loss 'ignore': expected 'error' or 'skip'"):
        DPOModule(on_nonfinite_loss="ignore")


@pytest.mark.parametrize("settings, message", [
    ({"learning_rate": -1.0}, "model.learning_rate must be >= 0, got -1.0"),
    ({"warmup_ratio": 1.5}, "model.warmup_ratio must be in [0, 1], got 1.5"),
    ({"logps_chunk_size": 0}, "model.logps_chunk_size must be a positive number of positions or null, got 0"),
])
def test_out_of_range_settings_are_refused_when_the_module_is_built(settings, message):
    with pytest.raises(LitAlignError) as info:
        DPOModule(**settings)
    assert str(info.value) == message


BASE_MAY_CHANGE = ("logps_chunk_size", "gradient_checkpointing", "mmap_activations", "release_frozen_weights",
                   "on_nonfinite_loss", "export_merged")


class LooserDPO(DPOModule):
    resume_may_change = ("beta",)


def test_each_class_declares_what_a_resume_may_change_and_a_module_allows_the_union():
    assert AlignModule.may_change_on_resume() == BASE_MAY_CHANGE == SFTModule.may_change_on_resume()
    assert DPOModule.may_change_on_resume() == BASE_MAY_CHANGE + ("precompute_ref_batch_size",)
    assert LooserDPO.may_change_on_resume() == BASE_MAY_CHANGE + ("precompute_ref_batch_size", "beta")


def test_a_resume_refuses_another_setting_naming_what_this_module_may_change():
    module = DPOModule(precompute_ref_batch_size=8, logps_chunk_size=16)
    saved = {"hyper_parameters": {**module.hparams, "precompute_ref_batch_size": 4, "logps_chunk_size": None}}
    module.check_resume(saved)  # DPO's own option and the base's may change
    with pytest.raises(LitAlignError) as info:
        module.check_resume({"hyper_parameters": {**saved["hyper_parameters"], "beta": 0.5}})
    assert str(info.value) == (
        "the checkpoint: model.beta is 0.1 in this run but 0.5 in the checkpoint; a resume continues that run, so only "
        "these model settings may change: logps_chunk_size, gradient_checkpointing, mmap_activations, "
        "release_frozen_weights, on_nonfinite_loss, export_merged, precompute_ref_batch_size (and trainer settings "
        "such as max_steps or logging)")
    LooserDPO().check_resume({"hyper_parameters": {**LooserDPO().hparams, "beta": 0.5}})  # declared: allowed


def test_disable_dropout_zeroes_every_dropout_module():
    """TRL's ``disable_dropout``: nested ones too (log-probs must repeat)."""
    from lit_align.modules.base import disable_dropout

    network = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.3), torch.nn.Sequential(torch.nn.Dropout()))
    disable_dropout(network)
    assert [m.p for m in network.modules() if isinstance(m, torch.nn.Dropout)] == [0.0, 0.0]


class PoisonOneAdvantage(L.Callback):
    """Before the round's second step, a NaN advantage for the completion at position 1 of that step's rows."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        r = pl_module.round
        if batch["round_pos"] == 1:
            self.row = r.order[len(r.order) // r.steps + 1]
            self.dataset_row = r.dataset_rows[self.row]
            r.advantages[self.row] = math.nan


def test_grpo_names_the_completions_prompts_dataset_rows(tmp_path, tiny_path, write_jsonl):
    """A NaN in one completion's token losses (step row 1): the error names it and its prompt's dataset row."""
    path = write_jsonl([{"prompt": f"sort {i}{i + 3}:", "answer": "x"} for i in range(8)])
    module = GRPOModule(model="builtin:tiny", reward_funcs=["helpers.reward_digit_fraction"],
                        max_completion_length=4, num_generations=2, steps_per_generation=2)
    dm = PromptDataModule(path=path, val_split=None, batch_size=4,
                          shuffle=False)
    poison = PoisonOneAdvantage()
    with pytest.raises(LitAlignError, match=r"at step 1, batch 1, rows \[1\] \(dataset rows \[\d\]\)") as error:
        fit(module, dm, max_steps=2, callbacks=[poison])
    assert f"(dataset rows [{poison.dataset_row}])" in str(error.value)
    assert poison.dataset_row == poison.row // 2  # completion i of the round is of prompt i // G (no shuffle)
    assert all(torch.isfinite(p).all() for p in module.policy.parameters())


class NanGradient(L.Callback):
    """From step ``step`` on, the LM head's gradient is NaN (the loss stays finite)."""

    def __init__(self, step: int):
        self.step = step

    def on_train_start(self, trainer, pl_module):
        weight = pl_module.policy.lm_head.weight
        weight.register_hook(lambda g: g * math.nan if trainer.global_step >= self.step else g)


def fit_sort(module, callbacks, max_steps=3):
    dm = PreferenceDataModule(path="builtin:sort", val_split=None, batch_size=4, shuffle=False, max_length=32)
    return fit(module, dm, max_steps=max_steps, callbacks=callbacks)


def test_nonfinite_gradients_stop_before_the_update(tiny_path):
    module = DPOModule(model="builtin:tiny", learning_rate=1e-3)
    # the tiny model ties its LM head to the embeddings: the parameter's name is the embeddings'
    with pytest.raises(LitAlignError, match=r"^non-finite gradients at step 1 \(policy\.model\.embed_tokens\.weight\); "):
        fit_sort(module, [NanGradient(step=1)])
    assert all(torch.isfinite(p).all() for p in module.policy.parameters())


def test_nonfinite_gradients_skip(tiny_path):
    module = DPOModule(model="builtin:tiny", learning_rate=1e-3, on_nonfinite_loss="skip")
    with pytest.warns(UserWarning, match="non-finite gradients") as record:
        trainer = fit_sort(module, [NanGradient(step=1)])
    skips = [str(w.message) for w in record if "non-finite gradients" in str(w.message)]
    assert [s.split(": ")[1].split(" (")[0] for s in skips] == ["non-finite gradients at step 1",
                                                                 "non-finite gradients at step 2"]
    assert skips[-1].endswith("update skipped (2 so far)")
    assert trainer.global_step == 3 and module.skipped_batches == 2
    assert all(torch.isfinite(p).all() for p in module.policy.parameters())


def test_gradients_are_freed_right_after_the_optimizer_step(tmp_path):
    """They exist when the optimizer steps and are gone before the next batch's forward (Lightning alone would zero
    them only after that forward, beside its activations); under accumulation they survive the window's batches."""
    class Grads(L.Callback):
        def __init__(self):
            self.at_step, self.at_batch_end = [], []

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.at_step.append(sum(p.grad is not None for p in pl_module.policy.parameters()))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.at_batch_end.append(sum(p.grad is not None for p in pl_module.policy.parameters()))

    grads = Grads()
    module = DPOModule(model="builtin:tiny", learning_rate=1e-3)
    data = PreferenceDataModule(path="builtin:sort", batch_size=4, max_length=32, val_split=None, shuffle=False)
    fit(module, data, max_steps=2, callbacks=[grads], accumulate_grad_batches=2)
    trained = sum(1 for _ in module.policy.parameters())
    assert grads.at_step == [trained, trained]
    assert grads.at_batch_end == [trained, 0, trained, 0]  # kept inside the window, freed at its end


class PoisonPolicy(L.Callback):
    """Before batch 1, NaN in the policy's final norm: every row of that step's loss is NaN."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 1:
            pl_module.policy.model.norm.weight.data.fill_(math.nan)


def recipe_run(recipe: str, write_jsonl):
    """``(module, data)`` of a short run of ``recipe`` on 12 rows, batches of 4 in file order."""
    from lit_align.data import UnpairedPreferenceDataModule
    from lit_align.modules import CPOModule, KTOModule, ORPOModule, RLOOModule

    digits = [f"{i}{i + 3}" for i in range(12)]
    if recipe == "rloo":
        path = write_jsonl([{"prompt": f"sort {d}:", "answer": d} for d in digits])
        return (RLOOModule(model="builtin:tiny", reward_funcs=["helpers.reward_digit_fraction"],
                           max_completion_length=4, num_generations=2, steps_per_generation=2),
                PromptDataModule(path=path, val_split=None, batch_size=4, shuffle=False))
    if recipe == "kto":
        path = write_jsonl([{"prompt": f"sort {d}:", "completion": f" {d}", "label": i % 2 == 0}
                            for i, d in enumerate(digits)])
        return KTOModule(model="builtin:tiny"), UnpairedPreferenceDataModule(path=path, val_split=None, batch_size=4,
                                                                            shuffle=False, max_length=32)
    path = write_jsonl([{"prompt": f"sort {d}:", "chosen": f" {d}", "rejected": f" {d[::-1]}0"} for d in digits])
    module = {"cpo": CPOModule, "orpo": ORPOModule}[recipe](model="builtin:tiny")
    return module, PreferenceDataModule(path=path, val_split=None, batch_size=4, shuffle=False, max_length=32)


@pytest.mark.parametrize("recipe", ["kto", "cpo", "orpo", "rloo"])
def test_every_recipe_names_the_dataset_rows_of_a_nonfinite_loss(tmp_path, write_jsonl, recipe):
    """The recipes added last pass their batch's dataset rows to the guard too (DPO, GRPO, SFT and the reward model:
    tested above and in their own files)."""
    module, data = recipe_run(recipe, write_jsonl)
    with pytest.raises(LitAlignError) as error:
        fit(module, data, tmp_path, max_steps=2, callbacks=[PoisonPolicy()])
    # batch 1 holds the file's rows 4-7 (RLOO: its 4 completions, 2 each of 2 prompts of the round's 4)
    rows = r"\[\d+, \d+, \d+, \d+\]" if recipe == "rloo" else r"\[4, 5, 6, 7\]"
    assert re.fullmatch(rf"non-finite training loss \(nan\) at step 1, batch 1, rows \[0, 1, 2, 3\] \(dataset rows "
                        rf"{rows}\); nothing was updated \(set model.on_nonfinite_loss: skip to skip such batches\)",
                        str(error.value)), str(error.value)


class _Counting(L.LightningModule):
    """Logs its micro-batch's number (0, 1, ...) through ``AlignModule.log_mean``, but nothing at micro-batches 4 to 7
    (a whole logging window: skipped batches), and a ``rare`` value only at micro-batches 0 and 9."""

    log_mean, start_log_window = AlignModule.log_mean, AlignModule.start_log_window

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.log_window, self.seen = (-1, {}), 0

    def on_train_batch_start(self, batch, batch_idx):
        self.start_log_window()

    def training_step(self, batch, batch_idx):
        metrics = {} if 4 <= self.seen <= 7 else {"value": float(self.seen)}
        if self.seen in (0, 9):
            metrics["rare"] = 100.0 + self.seen
        self.log_mean(metrics)
        self.seen += 1
        return (self.weight * batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.ones(64, 1), batch_size=1)


def test_a_logged_metric_is_its_mean_over_the_logging_window_as_trl_logs_it(tmp_path):
    """12 micro-batches, 2 a step, written every 2 steps (after steps 1, 3, 5): each written value is the mean over
    its window's 4 micro-batches (TRL's ``logging_steps``), not the last one's; a name with no value in a window,
    even a window with no value at all, is not written for it (Lightning alone would write its last value again)."""
    run = trainer(tmp_path, max_steps=6, accumulate_grad_batches=2, log_every_n_steps=2,
                  logger=CSVLogger(tmp_path, name="window"))
    run.fit(_Counting())
    rows = read_metrics(tmp_path / "window" / "version_0" / "metrics.csv")
    written = {int(row["step"]): (row.get("train/value"), row.get("train/rare")) for row in rows}
    assert written.get(3, (None, None)) == (None, None)  # micro-batches 4..7 logged nothing
    assert written[1] == (1.5, 100.0) and written[5] == (9.5, 109.0)  # the means of 0..3 and 8..11


# -- gradient clipping (TRL's max_grad_norm) under mixed precision with the fused AdamW ---------------------------------
class GradientsSeen(L.Callback):
    """The gradients at two moments of each optimizer step: as the callbacks' ``on_before_optimizer_step`` sees them
    (before clipping; divided by the GradScaler's scale, which a fused optimizer's gradients still carry there) and as
    the optimizer's ``step`` used them (a step post-hook: Lightning runs the closure, hence the backward, inside
    ``step``, so a pre-hook would come before the gradients). Each: (global norm, max absolute value); ``before``
    with the scale."""

    def __init__(self):
        self.before, self.stepped = [], []
        self.start: list[torch.Tensor] = []

    def on_train_start(self, trainer, pl_module):
        self.start = [p.detach().clone() for p in pl_module.policy.parameters()]
        trainer.optimizers[0].register_step_post_hook(lambda optimizer, args, kwargs: self.stepped.append(
            self.norm_and_max(optimizer)))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        scaler = trainer.precision_plugin.scaler if isinstance(trainer.precision_plugin, MixedPrecision) else None
        scale = 1.0 if scaler is None else float(scaler.get_scale())
        norm, largest = self.norm_and_max(optimizer)
        self.before.append((norm / scale, largest / scale, scale))

    @staticmethod
    def norm_and_max(optimizer) -> tuple[float, float]:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        return (float(torch.nn.utils.get_total_norm(grads)), max(float(g.abs().max()) for g in grads))


def mixed_precision(precision: str) -> MixedPrecision:
    """Lightning's plugin on CPU: ``Trainer(precision="16-mixed")`` on CPU falls back to bf16-mixed, but the plugin
    itself runs fp16 autocast and torch's GradScaler on CPU, which is what a GPU's fp16 run does."""
    return MixedPrecision(precision, "cpu")


def fit_clipped(root, precision: str, clip: float, algorithm: str = "norm", max_steps: int = 3, **model_kw):
    seen = GradientsSeen()
    module = DPOModule(model="builtin:tiny", learning_rate=1e-3, **model_kw)  # optim: adamw_torch_fused (TRL's)
    data = PreferenceDataModule(path="builtin:sort", val_split=None, batch_size=4, shuffle=False, max_length=32)
    run = fit(module, data, root, max_steps=max_steps, callbacks=[seen], plugins=[mixed_precision(precision)],
              gradient_clip_val=clip, gradient_clip_algorithm=algorithm, logger=CSVLogger(root, name="clip"))
    assert run.global_step == max_steps
    assert any(not torch.equal(p, q) for p, q in zip(module.policy.parameters(), seen.start))  # the steps updated
    return module, seen, read_metrics(Path(root) / "clip" / "version_0" / "metrics.csv")


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_clipping_the_global_norm_under_mixed_precision_with_the_fused_adamw(tmp_path, tiny_path, precision):
    """HF Trainer's order: unscale, clip the norm over all parameters to max_grad_norm, step. Lightning alone refuses
    (fused AdamW unscales inside its step); under fp16 the gradients must be unscaled before they are clipped, so the
    step sees the clipped true gradients, not clipped scaled ones (which would be 1/scale of the clip value)."""
    module, seen, metrics = fit_clipped(tmp_path, precision, clip=0.01)
    assert isinstance(module.trainer.optimizers[0], torch.optim.AdamW)
    assert module.trainer.optimizers[0].defaults["fused"] is True
    steps = [(b, s) for b, s in zip(seen.before, seen.stepped) if math.isfinite(b[0])]  # fp16: an overflow is skipped
    assert len(seen.stepped) == 3 and len(steps) >= 2
    for (norm, _, _), (clipped, _) in steps:
        assert norm > 0.1  # far above the clip value: the clipping acted
        assert clipped == pytest.approx(0.01, rel=1e-4)  # clip_grad_norm_: max_norm / (norm + 1e-6) times norm
    # TRL's grad_norm: the norm before clipping, of the true (unscaled) gradients
    logged = [r["train/grad_norm"] for r in metrics if "train/grad_norm" in r]
    assert len(logged) == 3
    for value, (norm, _, _) in zip(logged, seen.before):
        if math.isfinite(norm):
            assert value == pytest.approx(norm, rel=1e-4)


def test_clipping_by_value_under_bf16_mixed_with_the_fused_adamw(tmp_path, tiny_path):
    _, seen, _ = fit_clipped(tmp_path, "bf16-mixed", clip=1e-4, algorithm="value", max_steps=2)
    for (_, largest, _), (_, clipped_largest) in zip(seen.before, seen.stepped):
        assert largest > 1e-3 and clipped_largest == pytest.approx(1e-4)


def test_fp16_skipped_batch_under_clipping_keeps_the_scaler_consistent(tmp_path, nan_pairs, tiny_path):
    """A batch whose backward is skipped (on_nonfinite_loss: skip) leaves the GradScaler as it was: no unscale then,
    or the next step's unscale_ would be refused ("unscale_() has already been called")."""
    module = DPOModule(model="builtin:tiny", learning_rate=1e-3, on_nonfinite_loss="skip")
    data = PreferenceDataModule(path=nan_pairs, val_split=None, batch_size=4, shuffle=False, max_length=32)
    with pytest.warns(UserWarning, match="non-finite loss at step 1"):
        run = fit(module, data, tmp_path, max_steps=3, plugins=[mixed_precision("16-mixed")], gradient_clip_val=1.0)
    assert run.global_step == 3 and module.skipped_batches == 1
    assert all(torch.isfinite(p).all() for p in module.policy.parameters())


def test_a_one_item_all_linear_list_is_peft_all_linear():
    """TRL's documented ``--lora_target_modules all-linear`` is a one-item list; PEFT reads only the string as every
    linear layer (a list names a module called 'all-linear', which no model has)."""
    from lit_align.modules.base import lora_config

    config = lora_config({"r": 4, "target_modules": ["all-linear"]})
    assert config.target_modules == "all-linear"
    from lit_align.modules import SFTModule

    module = SFTModule(peft_config={"r": 4, "target_modules": ["all-linear"]})
    module.configure_model()
    wrapped = {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in module.policy.named_parameters() if "lora_A" in n}
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} <= wrapped
