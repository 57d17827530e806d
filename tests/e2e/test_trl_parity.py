"""lit_align's DPO against TRL's DPOTrainer: same tokens, same loss and metrics, same first optimizer steps.

Both sides get the same policy, a reference that differs from it (the policy's weights plus seeded noise), and the same
preference rows in TRL's standard string format. TRL's numbers come from its own dataset preparation, collator,
``compute_loss`` and training loop; lit_align's from ``PreferenceDataModule``, ``DPOModule`` and ``lightning.Trainer``.

Precision: TRL's ``DPOConfig`` defaults to ``bf16=True`` (autocast, even on CPU); lit_align trains in fp32 unless
``trainer.precision`` says otherwise. The comparison is fp32 on both sides, so TRL gets ``bf16=False``.

Tolerance (``tests/numerics.py``, rule 3): both sides compute the same formulas with the same model in another order
(TRL's chunked LM head, lit_align's shared-prompt rows), so they differ by fp32 rounding of the network's reductions
(the longest: the MLP's intermediate size) at the magnitude of what enters each metric (``metric_scales``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

trl = pytest.importorskip("trl")

import lightning as L  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from lit_align.data.preference import PreferenceDataModule, collate_pairs  # noqa: E402
from lit_align.data.tasks import SortTask  # noqa: E402
from lit_align.modules.dpo import DPOModule  # noqa: E402
from lit_align.capabilities import supports_shared_prompt  # noqa: E402
from lit_align.layouts import shared_prompt_pairs  # noqa: E402
from numerics import assert_rounding_close, rounding_tol  # noqa: E402

pytestmark = pytest.mark.numerics  # run again under other CPU kernels by `make test-numerics`

METRICS = DPOModule.metrics  # what DPO logs, TRL's names

BETA = 0.1
PAIRS = 8  # pairs per batch
STEPS = 3
LR = 1e-3
MAX_LENGTH = 64
# TRL's defaults that lit_align (a LightningModule) does not decide: they are set to match on both sides.
MAX_GRAD_NORM = 1.0  # TRL (transformers.Trainer) clips at 1.0 by default; Lightning only when told to


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_path):
    """Policy dir, a perturbed reference dir, and ``STEPS * PAIRS`` preference rows written as JSONL."""
    root = tmp_path_factory.mktemp("trl_parity")
    policy_dir = tiny_path
    ref = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for param in ref.parameters():
            param.add_(0.02 * torch.randn(param.shape, generator=generator))
    ref_dir = root / "ref"
    ref.save_pretrained(ref_dir)
    AutoTokenizer.from_pretrained(policy_dir).save_pretrained(ref_dir)
    rows = SortTask().preference_rows("train").select(range(STEPS * PAIRS))
    rows_path = root / "rows.jsonl"
    rows.to_json(rows_path)
    return {"root": root, "policy": policy_dir, "ref": str(ref_dir), "rows": rows, "rows_path": str(rows_path)}


def trl_trainer(setup, out: Path, **config) -> trl.DPOTrainer:
    """TRL's DPOTrainer over the rows, fp32, CPU, the batches in dataset order."""
    args = trl.DPOConfig(
        output_dir=str(out),
        beta=BETA,
        max_length=MAX_LENGTH,
        per_device_train_batch_size=PAIRS,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        optim="adamw_torch_fused",  # lit_align's default, and transformers' on torch >= 2.8
        max_grad_norm=MAX_GRAD_NORM,
        train_sampling_strategy="sequential",  # no shuffling: batch k is rows [k * PAIRS, (k + 1) * PAIRS)
        bf16=False,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
        **config,
    )
    ref = AutoModelForCausalLM.from_pretrained(setup["ref"], dtype=torch.float32)  # TRL takes the reference as a model
    return trl.DPOTrainer(
        model=setup["policy"],  # loaded by TRL itself
        ref_model=ref,
        args=args,
        train_dataset=setup["rows"],
        processing_class=AutoTokenizer.from_pretrained(setup["policy"]),
    )


def lit_data(setup) -> PreferenceDataModule:
    """The rows in file order, like TRL's sequential engine."""
    data = PreferenceDataModule(path=setup["rows_path"], tokenizer=setup["policy"], batch_size=PAIRS,
                                max_length=MAX_LENGTH, val_split=None, shuffle=False)
    data.setup("fit")
    return data


def lit_module(setup, share_prompt: bool = True, **options) -> DPOModule:
    module = DPOModule(model=setup["policy"], ref_model=setup["ref"], beta=BETA, learning_rate=LR,
                       lr_scheduler_type="constant", weight_decay=0.0, warmup_steps=0, share_prompt=share_prompt,
                       **options)
    module.configure_model()
    return module


def lit_metrics(module: DPOModule, batch) -> dict[str, float]:
    """The batch's metrics as ``training_step`` logs them (pair means; ``logits/*`` weighted by completion tokens),
    and ``logps_scale``: the largest summed log-prob of a completion."""
    out, weights = module.pair_outputs(batch)
    result = {}
    for name in METRICS:
        values, w = out[name].detach().float(), weights.get(name)
        result[name] = (values.mean() if w is None else (values * w).sum() / w.sum()).item()
    result["logps_scale"] = max(out["logps/chosen"].abs().max().item(), out["logps/rejected"].abs().max().item())
    return result


def trl_metrics(trainer: trl.DPOTrainer, batch) -> dict[str, float]:
    """One call of TRL's own ``compute_loss`` on ``batch``: the loss and what it appended to ``_metrics['train']``."""
    trainer.model.train()
    trainer._metrics["train"].clear()
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, trainer._prepare_inputs(batch))
    logged = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    return {"loss": loss.item(), **{name: logged[name] for name in METRICS if name != "loss"}}


def metric_scales(lit: dict[str, float], beta: float = BETA) -> dict[str, float]:
    """The magnitude of what enters each metric: summed log-probs (``S``) for ``logps/*``; ``beta * S`` for the rewards
    and the loss (plus the loss's own size: sppo/ipo square theirs); the value itself for per-token averages; 1 for
    the fractions, which then agree exactly unless a pair sits on a tie."""
    s = lit["logps_scale"]
    scales = {name: beta * s + abs(lit[name]) for name in ("loss", "rewards/chosen", "rewards/rejected",
                                                           "rewards/margins")}
    scales |= {name: s for name in ("logps/chosen", "logps/rejected")}
    scales |= {name: max(abs(lit[name]), 1.0) for name in ("logits/chosen", "logits/rejected", "entropy")}
    return scales | {"rewards/accuracies": 1.0, "mean_token_accuracy": 1.0}


def assert_close(lit: dict[str, float], ref: dict[str, float], what: str, terms: int) -> None:
    scales = metric_scales(lit)
    bad = {}
    for name in METRICS:
        try:
            assert_rounding_close(lit[name], ref[name], scale=scales[name], terms=terms, msg=f"{what} {name}")
        except AssertionError as error:
            bad[name] = (lit[name], ref[name], str(error))
    assert not bad, f"{what}: lit_align vs TRL differ by more than fp32 rounding: {bad}"


def longest_reduction(model) -> int:
    """The longest reduction inside the network's forward: the MLP's, the head's or the vocabulary's."""
    config = model.config
    return max(config.intermediate_size, config.hidden_size, config.vocab_size)


def test_tokenization_identical(setup, tmp_path):
    trainer = trl_trainer(setup, tmp_path / "trl")
    data = lit_data(setup)
    assert len(trainer.train_dataset) == len(data.train_data) == STEPS * PAIRS
    for i in range(STEPS * PAIRS):
        theirs, ours = trainer.train_dataset[i], data.train_data[i]
        for key in ("prompt_ids", "chosen_ids", "rejected_ids"):
            assert ours[key] == theirs[key], f"row {i} {key}"
    rows = list(range(PAIRS))
    theirs = trainer.data_collator([trainer.train_dataset[i] for i in rows])
    ours = data.collate([data.train_data[i] for i in rows])
    for key in ("input_ids", "attention_mask", "completion_mask"):
        assert torch.equal(ours[key], theirs[key]), key


# The loss options, each as TRL's DPOConfig and DPOModule spell it. The ones that read per-token log-probs (ld_alpha,
# WPO, sft) also run on the plain [chosen; rejected] batch, whose token layout differs from the shared-prompt rows'.
LOSS_CASES = {
    "sigmoid": {},
    **{name: {"loss_type": name} for name in (
        "hinge", "ipo", "nca_pair", "bco_pair", "sppo_hard", "apo_zero", "apo_down", "discopop",
        "sft", "sigmoid_norm")},
    "exo_pair": {"loss_type": "exo_pair", "label_smoothing": 1e-3},
    "robust": {"loss_type": "robust", "label_smoothing": 0.1},
    "aot": {"loss_type": "aot", "label_smoothing": 0.1},
    "aot_unpaired": {"loss_type": "aot_unpaired", "label_smoothing": 0.2},
    "discopop-tau": {"loss_type": "discopop", "discopop_tau": 0.5},
    "forward_kl": {"f_divergence_type": "forward_kl"},
    "js_divergence-ipo": {"loss_type": "ipo", "f_divergence_type": "js_divergence"},
    "alpha_divergence": {"f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": 0.3},
    "mpo-list": {"loss_type": ["sigmoid", "bco_pair", "sft"], "loss_weights": [0.8, 0.2, 1.0]},
    "ld_alpha": {"ld_alpha": 0.5},
    "wpo": {"use_weighting": True},
    "wpo-hinge": {"loss_type": "hinge", "use_weighting": True},
}
PER_TOKEN_CASES = ("sigmoid", "sft", "mpo-list", "ld_alpha", "wpo")
# TRL 1.16 multiplies the loss by the WPO weights in place: hinge's relu output, which relu's backward needs, so TRL's
# own backward fails there (and `sft` with WPO fails in its forward, on the expanded scalar; not compared).
TRL_BACKWARD_FAILS = ("wpo-hinge",)


@pytest.mark.parametrize("case,layout", [(case, "shared-prompt") for case in LOSS_CASES]
                         + [(case, "plain-batch") for case in PER_TOKEN_CASES]
                         + [(case, "padding-free") for case in PER_TOKEN_CASES] + [("sigmoid", "plain-padding-free")])
def test_loss_and_metrics_match_trl(setup, tmp_path, case, layout):
    """One batch: TRL's loss and metrics, and the gradients, from lit_align's shared-prompt rows, plain batch, and
    either packed without padding (``padding_free``), for each loss option."""
    share_prompt = layout in ("shared-prompt", "padding-free")
    options = LOSS_CASES[case] | ({"padding_free": True} if "padding-free" in layout else {})
    trainer = trl_trainer(setup, tmp_path / "trl", **options)
    data = lit_data(setup)
    rows = list(range(PAIRS))
    trl_batch = trainer.data_collator([trainer.train_dataset[i] for i in rows])
    lit_batch = data.collate([data.train_data[i] for i in rows])
    for key in ("input_ids", "attention_mask", "completion_mask"):
        assert torch.equal(lit_batch[key], trl_batch[key]), key
    module = lit_module(setup, share_prompt, **options)
    # same attention kernels on both sides (TRL loads the policy with transformers' default)
    assert trainer.model.config._attn_implementation == module.policy.config._attn_implementation == "sdpa"
    assert (shared_prompt_pairs(lit_batch) is not None) and supports_shared_prompt(module.policy)

    theirs = trl_metrics(trainer, trl_batch)
    with torch.no_grad():
        ours = lit_metrics(module, lit_batch)
    terms = longest_reduction(module.policy)
    assert_close(ours, theirs, f"one batch, {case}", terms)
    # the reference differs from the policy, so the rewards are not trivially zero
    assert abs(theirs["rewards/margins"]) > 1e-4 and abs(theirs["rewards/chosen"]) > 1e-4
    if LOSS_CASES[case]:  # and the option did change the numbers (it reached both sides), by far more than the tolerance
        with torch.no_grad():
            default = lit_metrics(lit_module(setup, share_prompt, padding_free="padding-free" in layout), lit_batch)
        scales = metric_scales(ours)
        assert any(abs(default[name] - ours[name]) > 10 * rounding_tol(scales[name], terms)
                   for name in ("loss", "logps/chosen"))
    if case in TRL_BACKWARD_FAILS:
        return

    # the gradients of the loss: the same up to fp32 rounding of what each weight's gradient sums (every position's
    # products over the hidden size), relative to the tensor's largest entry
    trainer.model.zero_grad()
    trainer.compute_loss(trainer.model, trainer._prepare_inputs(trl_batch)).backward()
    module.policy.zero_grad()
    module.pair_outputs(lit_batch)[0]["loss"].mean().backward()
    theirs = dict(trainer.model.named_parameters())
    positions = int(lit_batch["attention_mask"].sum())
    for name, param in module.policy.named_parameters():
        assert theirs[name].grad.abs().max() > 0, name
        assert_rounding_close(param.grad, theirs[name].grad, terms=positions * terms, msg=f"{name} gradient")


class Record(L.Callback):
    """What ``training_step`` logged at each step (the metrics of that step's batch, before its update)."""

    def __init__(self):
        self.steps: list[dict[str, float]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        assert pl_module.policy.training and not pl_module.reference.model.training

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = {name: trainer.callback_metrics[f"train/{name}"].item() for name in (*METRICS, "num_tokens")}
        step["logps_scale"] = max(abs(step["logps/chosen"]), abs(step["logps/rejected"]))  # of the means: logged
        self.steps.append(step)


def test_training_steps_match_trl(setup, tmp_path):
    """``STEPS`` AdamW steps on the same batches in the same order: every step's loss and metrics (TRL's log history
    against what ``training_step`` logged), and the loss and metrics of both trained policies on the first batch,
    agree to fp32 rounding (the one-batch test's tolerance).

    Why that holds after steps: both sides run the same forward kernels on the same fp32 inputs, and the gradients
    agree to rounding (``test_loss_and_metrics_match_trl``); they are not bit-identical because TRL's chunked LM-head
    backward and lit_align's autograd through gather/logsumexp round differently. After 3 steps that leaves the
    metrics ~1e-7..1e-6 apart (observed), inside the tolerance.

    The weights are compared more loosely, and why: AdamW's update ``lr * m / (sqrt(v) + eps)`` is ~``lr * sign(g)``
    for any ``|g| >> eps``, so a weight whose gradient nearly cancels (``|g| ~ 1e-9``, comparable to its rounding
    difference) can move by a visibly different fraction of ``lr`` on each side (observed: at most ~2% of ``lr``).
    That is Adam amplifying fp32 rounding, not a semantic difference; the difference over all weights, relative to
    how far training moved them, is ~2e-5 (observed), bounded here by 1e-3.
    """
    trainer = trl_trainer(setup, tmp_path / "trl", max_steps=STEPS)
    trainer.train()
    trl_steps = [entry for entry in trainer.state.log_history if "rewards/margins" in entry and "loss" in entry]
    assert len(trl_steps) == STEPS
    assert all(entry["grad_norm"] < MAX_GRAD_NORM for entry in trl_steps)  # clipping does not decide the result

    module, data, record = lit_module(setup), lit_data(setup), Record()
    lit_trainer = L.Trainer(
        max_steps=STEPS, accelerator="cpu", devices=1, precision="32-true", logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        gradient_clip_val=MAX_GRAD_NORM, gradient_clip_algorithm="norm", num_sanity_val_steps=0,
        log_every_n_steps=1, callbacks=[record],  # TRL's logging_steps: each step's own values
    )
    lit_trainer.fit(module, datamodule=data)
    assert len(record.steps) == STEPS
    terms = longest_reduction(module.policy)

    for step, (ours, theirs) in enumerate(zip(record.steps, trl_steps), start=1):
        assert_close(ours, theirs, f"step {step}", terms)
        assert ours["num_tokens"] == theirs["num_tokens"] > 0, step  # attended tokens so far, counted alike

    # both trained policies on the first batch: the loss moved, and moved the same way
    theirs = trl_metrics(trainer, trainer.data_collator([trainer.train_dataset[i] for i in range(PAIRS)]))
    module.train()
    with torch.no_grad():
        ours = lit_metrics(module, data.collate([data.train_data[i] for i in range(PAIRS)]))
    assert_close(ours, theirs, f"first batch after {STEPS} steps", terms)
    assert abs(theirs["loss"] - trl_steps[0]["loss"]) > 1e-2

    initial = dict(AutoModelForCausalLM.from_pretrained(setup["policy"], dtype=torch.float32).named_parameters())
    trained = dict(trainer.model.named_parameters())
    ours = dict(module.policy.named_parameters())
    diff = torch.stack([(ours[n] - trained[n]).norm() for n in trained]).norm()
    moved = torch.stack([(trained[n] - initial[n]).norm() for n in trained]).norm()
    worst = max((ours[n] - trained[n]).abs().max().item() for n in trained)
    assert diff / moved < 1e-3, f"trained weights: |lit - trl| / |trl - initial| = {diff / moved:.2e}"
    assert worst < 0.1 * LR, f"a trained weight differs by {worst:.2e} (lr {LR})"


# -- the shared-prompt rows compute what the plain [chosen; rejected] batch computes, on every listed architecture ----


def test_shared_prompt_falls_back_on_other_batches(setup):
    """A batch the shared-prompt layout refuses (``test_layouts``) runs as the plain batch."""
    from test_layouts import random_pairs

    rows = random_pairs(1)
    batch = collate_pairs(rows, pad_token_id=0, max_length=None)
    other = dict(batch, input_ids=batch["input_ids"].clone())
    other["input_ids"][len(rows), 0] += 1  # rejected_1's prompt differs from chosen_1's: no shared-prompt layout
    module = lit_module(setup)
    out, _ = module.pair_outputs(other)  # the plain batch runs instead
    assert torch.isfinite(out["loss"]).all()
