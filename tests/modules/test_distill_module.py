"""DistillationModule: a step's loss is TRL's generalized JSD computed by hand from both models' full logits, every
beta trains the student towards the teacher, a round's completions come from the student, the teacher (``seq_kd``)
or the dataset (``lmbda``, one seeded coin per round); with several teachers each row's divergence (training and
validation) is from its own teacher and ``seq_kd`` samples it from that teacher, ids that name no teacher are one
error line, each teacher's identity is its own checkpoint entry; what can be checked at setup is, before the first
step (rows without completions under ``lmbda < 1``, every row's teacher id, a teacher whose tokenizer numbers its
tokens apart, a file as a teacher); the CLI runs ``configs/distill.yaml`` (with one teacher or a mapping of them) and
refuses a teacher it cannot use in one line, and docs/distill.md names every DistillationConfig and GKDConfig field.

The teachers are built-in tiny models: two drawn from other seeds (close to uniform, as the student, but other
functions), and one edited to put nearly all its mass on EOS at every position (its samples are EOS alone).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from helpers import LoggedSteps, assert_one_line_error, fit, read_metrics, mapped_resident_kib, run_main, trainer
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import FSDPStrategy

from lit_align import host_memory
from lit_align.data import PromptDataModule
from lit_align.errors import LitAlignError
from lit_align.losses.distill import generalized_jsd
from lit_align.models import build_builtin, build_tokenizer, load_model
from lit_align.modules import DistillationModule, GRPOModule
from lit_align.pretrained import save_hf
from numerics import TINY_TERMS, assert_rounding_close

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs" / "distill.yaml")


@pytest.fixture(scope="module")
def teacher(tmp_path_factory, tiny_path) -> str:
    """The built-in tiny architecture with weights from another seed."""
    return str(build_builtin("tiny", tmp_path_factory.mktemp("teacher") / "seed1", seed=1))


@pytest.fixture(scope="module")
def teacher_b(tmp_path_factory, tiny_path) -> str:
    """The built-in tiny architecture with weights from a third seed: a second teacher."""
    return str(build_builtin("tiny", tmp_path_factory.mktemp("teacher_b") / "seed2", seed=2))


@pytest.fixture(scope="module")
def eos_teacher(tmp_path_factory, tiny_path) -> str:
    """A tiny model whose next token is EOS with probability ~1 everywhere: its layers add nothing to the residual
    stream (o_proj, down_proj zero), so the final hidden state is the normed input embedding, of which the norm keeps
    one coordinate, 1 for every token's embedding and 100 for EOS's (the tied head): EOS's logit is 100 times any
    other's, about 1100 against 11."""
    model, tokenizer = load_model("builtin:tiny"), build_tokenizer()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight[:, 0] = 1.0
        model.model.embed_tokens.weight[tokenizer.eos_token_id, 0] = 100.0
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
    path = tmp_path_factory.mktemp("eos_teacher") / "model"
    save_hf(model, tokenizer, path)
    return str(path)


def sort_rows(path: Path, n: int, offset: int = 0) -> str:
    """``n`` sort prompts with their ``answer`` and, as SFT rows have it, the same text as ``completion``."""
    digits = [f"{((i + offset) * 7919) % 100000:05d}"[: 3 + i % 3] for i in range(n)]
    rows = [{"prompt": f"sort {d}:", "answer": "".join(sorted(d)), "completion": "".join(sorted(d))} for d in digits]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> str:
    return sort_rows(tmp_path_factory.mktemp("distill_rows") / "rows.jsonl", 32)


def with_teacher_ids(rows: str, path: Path, ids: list) -> str:
    """``rows`` with a ``teacher_id`` column, row ``i``'s ``ids[i % len(ids)]``, written at ``path``."""
    texts = [json.loads(line) for line in Path(rows).read_text().splitlines()]
    path.write_text("".join(json.dumps({**r, "teacher_id": ids[i % len(ids)]}) + "\n" for i, r in enumerate(texts)))
    return str(path)


@pytest.fixture(scope="module")
def ab_rows(rows, tmp_path_factory) -> str:
    """The rows, their teachers alternating: a, b, a, b, ..."""
    return with_teacher_ids(rows, tmp_path_factory.mktemp("ab_rows") / "rows.jsonl", ["a", "b"])


class Rounds(L.Callback):
    """The initial policy, and per step its round, the step's batch and loss (the outputs)."""

    def __init__(self):
        self.steps: list[dict] = []

    def on_train_start(self, trainer, pl_module):
        self.initial = copy.deepcopy(pl_module.policy)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append({"round": pl_module.round, "step": outputs["step"], "loss": float(outputs["loss"]),
                           "on_policy": float(pl_module.round.stats["on_policy"]),
                           "entropy": float(trainer.callback_metrics["train/entropy"])})


def distill(teacher_model: str, rows: str, max_steps: int = 1, callbacks=(), data: dict | None = None, **settings):
    """A short fit on ``rows`` (4 completions a step, 6 tokens at most); returns the module."""
    module = DistillationModule(model="builtin:tiny", teacher_model=teacher_model,
                                **{"max_completion_length": 6, "learning_rate": 1e-3, **settings})
    fit(module, PromptDataModule(path=rows, val_split=None, **{"batch_size": 4, **(data or {})}),
        max_steps=max_steps, callbacks=callbacks)
    return module


def full_logits(model, step) -> torch.Tensor:
    """``[n, C, V]``: ``model``'s logits at the positions that predict each completion token, from one plain padded
    forward of ``[prompt; completion]``."""
    ids = torch.cat([step.prompt_ids, step.completion_ids], 1)
    attention = torch.cat([step.prompt_mask, step.completion_mask], 1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention,
                       position_ids=(attention.cumsum(1) - 1).clamp(min=0)).logits
    start = step.prompt_ids.shape[1]
    return logits[:, start - 1 : -1]


# -- the loss ---------------------------------------------------------------------------------------------------------
class PlainHead(L.Callback):
    """Soft-capping declared on the student's config: its head is no longer chunkable (``chunkable_head``), so the
    module takes the full-logits path; Llama ignores the setting, so the values must not change."""

    def on_fit_start(self, trainer, pl_module):
        pl_module.network.config.final_logit_softcapping = 30.0


@pytest.mark.parametrize("beta,temperature,padding_free,head", [
    (0.5, 0.8, None, "chunked"),  # packed rows (padding_free's CPU default), the chunked divergence
    (1.0, 1.0, False, "chunked"),  # padded rows, TRL's defaults
    (0.0, 1.3, None, "plain"),  # full logits and generalized_jsd
])
def test_a_steps_loss_is_the_generalized_jsd_of_both_models_full_logits(beta, temperature, padding_free, head,
                                                                       teacher, rows):
    """One step's loss (the round's only step) equals TRL's ``generalized_jsd_loss`` with labels: the per-token
    mean over the completion tokens of the divergence between both models' tempered distributions."""
    record = Rounds()
    module = distill(teacher, rows, callbacks=[record, *([PlainHead()] if head == "plain" else [])], beta=beta,
                     temperature=temperature, padding_free=padding_free)
    (first,) = record.steps
    step = first["step"]
    student = full_logits(record.initial, step)
    teacher_logits = full_logits(module.teacher.model, step)
    assert step.loss_mask.sum() > 4 and torch.equal(step.loss_mask, step.completion_mask)
    expected = generalized_jsd(student, teacher_logits, step.loss_mask, beta=beta, temperature=temperature)
    logps = torch.cat([student, teacher_logits]).div(temperature).log_softmax(-1)
    assert_rounding_close(first["loss"], expected, scale=logps.abs().max(), terms=TINY_TERMS, msg="loss")
    assert expected > 1e-3  # the two models differ: the comparison is not of zeros
    # train/entropy: the student's tempered entropy, per loss token (the chunked path makes it with the divergence)
    student_logps = student.div(temperature).log_softmax(-1)
    entropy = -(student_logps.exp() * student_logps).sum(-1)
    mask = step.loss_mask.bool()
    assert_rounding_close(first["entropy"], entropy[mask].mean(), scale=logps.abs().max(), terms=TINY_TERMS,
                          msg="entropy")


def held_out_divergence(student, teacher, rows: str, beta: float) -> float:
    """The per-token divergence over held-out prompts followed by their answers (and EOS): fixed sequences neither
    model sampled."""
    tokenizer = build_tokenizer()
    texts = [json.loads(line) for line in Path(rows).read_text().splitlines()]
    total, tokens = 0.0, 0
    for row in texts:
        prompt = tokenizer(row["prompt"])["input_ids"]
        completion = tokenizer(row["answer"])["input_ids"] + [tokenizer.eos_token_id]
        step = SimpleNamespace(prompt_ids=torch.tensor([prompt]), prompt_mask=torch.ones(1, len(prompt)).long(),
                               completion_ids=torch.tensor([completion]),
                               completion_mask=torch.ones(1, len(completion)).long())
        value = generalized_jsd(full_logits(student, step), full_logits(teacher, step), beta=beta, reduction="sum")
        total, tokens = total + float(value), tokens + len(completion)
    return total / tokens


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_every_beta_brings_the_student_closer_to_the_teacher(beta, teacher, rows, tmp_path):
    """20 on-policy steps: the divergence on held-out sequences (prompts the run never saw, with their answers)
    falls for the forward KL, the JSD and the reverse KL alike."""
    held_out = sort_rows(tmp_path / "held_out.jsonl", 16, offset=1000)
    record = Rounds()
    module = distill(teacher, rows, max_steps=20, callbacks=[record], beta=beta, learning_rate=3e-3)
    before = held_out_divergence(record.initial, module.teacher.model, held_out, beta)
    after = held_out_divergence(module.policy, module.teacher.model, held_out, beta)
    assert after < 0.5 * before, (before, after)
    losses = [s["loss"] for s in record.steps]
    assert sum(losses[-5:]) < 0.7 * sum(losses[:5])


# -- where a round's completions come from -----------------------------------------------------------------------------
def test_lmbda_zero_trains_on_the_datasets_completions_cut_to_max_completion_length(teacher, rows):
    """Each row's ``completion`` tokenized as SFT's (characters, then EOS), cut to max_completion_length (a cut one
    counts as clipped), is the round's completion of its prompt; the loss reads all of its tokens."""
    record = Rounds()
    module = distill(teacher, rows, max_steps=2, callbacks=[record], lmbda=0.0, max_completion_length=5)
    tokenizer = module.tokenizer
    texts = [json.loads(line)["completion"] for line in Path(rows).read_text().splitlines()]
    for seen in record.steps:
        round = seen["round"]
        assert seen["on_policy"] == 0.0
        expected = [tokenizer(texts[i])["input_ids"] + [tokenizer.eos_token_id] for i in round.dataset_rows]
        got = [ids[mask.bool()].tolist() for ids, mask in zip(round.completion_ids, round.completion_mask)]
        assert got == [ids[:5] for ids in expected]
        assert torch.equal(round.loss_mask, round.completion_mask)
        clipped = sum(len(ids) > 5 for ids in expected) / len(expected)
        assert float(round.stats["completions/clipped_ratio"]) == clipped
    assert 0 < clipped < 1  # rows of both kinds
    assert round.completions == [texts[i] for i in round.dataset_rows]  # the text the reward functions see


class Steps(L.Callback):
    """Counts the training steps that began."""

    def __init__(self):
        self.started = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.started += 1


def test_lmbda_below_one_without_a_completion_column_is_one_error_before_the_first_step(teacher, tmp_path):
    """Known at setup: refused before any step, naming the file, whichever round would have met it first (here,
    with lmbda 0.9, the first rounds are likely on-policy: the error would have come steps in)."""
    from helpers import write_sort_rows

    prompts = write_sort_rows(tmp_path / "prompts.jsonl", 8, "prompts")  # prompt and answer only
    steps = Steps()
    with pytest.raises(LitAlignError) as error:
        distill(teacher, prompts, max_steps=16, callbacks=[steps], lmbda=0.9)
    assert steps.started == 0
    assert str(error.value) == (
        f"model.lmbda < 1: the rounds that are not on-policy (a share 1 - lmbda) train on the dataset's completions, "
        f"but the rows of {prompts} have no 'completion' column; give each row its 'completion' (as SFT rows have), "
        "or set model.seq_kd: true (the teacher samples them) or model.lmbda: 1.0 (every round on-policy)")
    distill(teacher, prompts, lmbda=0.9, seq_kd=True)  # the teacher samples those rounds: no completions needed


def test_seq_kd_samples_the_rounds_from_the_teacher(eos_teacher, rows):
    """With the EOS teacher, a teacher-sampled round is EOS alone for every prompt; the random student's own samples
    (lmbda 1) run to the cap instead."""
    record = Rounds()
    logged = LoggedSteps()
    module = distill(eos_teacher, rows, max_steps=2, callbacks=[record, logged], lmbda=0.0, seq_kd=True)
    eos = module.tokenizer.eos_token_id
    for seen in record.steps:
        round = seen["round"]
        assert round.completion_mask.sum(1).tolist() == [1] * len(round.completion_ids)
        assert (round.completion_ids[:, 0] == eos).all()
    assert [s["train/teacher_sampled"] for s in logged.steps] == [1.0, 1.0]
    assert [s["train/on_policy"] for s in logged.steps] == [0.0, 0.0]
    record = Rounds()
    L.seed_everything(0, verbose=False)
    distill(eos_teacher, rows, max_steps=1, callbacks=[record], lmbda=1.0, seq_kd=True)
    assert (record.steps[0]["round"].completion_mask.sum(1) > 1).any()


def test_lmbda_half_draws_one_seeded_coin_per_round(teacher, rows):
    """lmbda 0.5: rounds of both kinds, each on-policy round the student's samples and each other one the dataset's
    completions; a second run with the same seed draws the same coins. One round feeds two steps."""
    def coins():
        L.seed_everything(0, verbose=False)
        record = Rounds()
        distill(teacher, rows, max_steps=16, callbacks=[record], lmbda=0.5, steps_per_generation=2,
                data={"batch_size": 2})
        return record

    first, second = coins(), coins()
    drawn = [s["on_policy"] for s in first.steps]
    assert drawn == [s["on_policy"] for s in second.steps]
    assert drawn[::2] == drawn[1::2]  # once per round, not per step
    assert 0 < sum(drawn) < len(drawn)
    texts = [json.loads(line)["completion"] for line in Path(rows).read_text().splitlines()]
    for seen in first.steps[::2]:
        round = seen["round"]
        assert (round.completions == [texts[i] for i in round.dataset_rows]) == (seen["on_policy"] == 0.0)


# -- settings ----------------------------------------------------------------------------------------------------------
def test_reward_funcs_are_optional_here_only_and_the_distillation_settings_are_checked(teacher):
    module = DistillationModule(model="builtin:tiny", teacher_model=teacher)
    assert module.rollouts.reward_funcs == [] and module.round_shape.num_generations == 1
    assert module.hparams.beta == 1.0 and module.reference is None  # the divergence's beta, no reference loaded
    with pytest.raises(LitAlignError, match="model.reward_funcs: none given; GRPO scores completions only with"):
        GRPOModule(model="builtin:tiny")
    with pytest.raises(LitAlignError, match=r"model.num_generations must be >= 2 \(group statistics need a group\)"):
        GRPOModule(model="builtin:tiny", reward_funcs=["helpers.reward_digit_fraction"], num_generations=1)
    refused = {"teacher_model": None, "beta": 1.5, "lmbda": -0.1, "ref_model": "builtin:tiny", "sync_ref_model": True,
               "dynamic_sampling": True, "num_generations": 0, "teacher_model_init_kwargs": {"trust_remote_code": True}}
    messages = {"teacher_model": "model.teacher_model is required", "beta": r"model.beta must be in \[0, 1\], got 1.5",
                "lmbda": r"model.lmbda must be in \[0, 1\], got -0.1", "ref_model": "model.ref_model: distillation has "
                "no reference", "sync_ref_model": "model.sync_ref_model: distillation", "dynamic_sampling":
                "model.dynamic_sampling: distillation", "num_generations": "model.num_generations must be >= 1, got 0",
                "teacher_model_init_kwargs": r"model.teacher_model_init_kwargs: \['trust_remote_code'\] have their "
                r"own options"}
    for name, value in refused.items():
        with pytest.raises(LitAlignError, match=messages[name]):
            DistillationModule(model="builtin:tiny", **{"teacher_model": teacher, name: value})
    with pytest.raises(LitAlignError, match="model.seq_kd samples rounds from the teacher, but engine vllm"):
        DistillationModule(model="builtin:tiny", teacher_model=teacher, seq_kd=True, engine="vllm")
    # val/pass@k's threshold (OnlineModule's, every online recipe's): not finite is refused, below 0 warned of
    with pytest.raises(LitAlignError, match=r"^model.pass_threshold must be a finite summed reward .*, got nan$"):
        DistillationModule(model="builtin:tiny", teacher_model=teacher, pass_threshold=float("nan"))
    with pytest.warns(UserWarning, match=r"^lit_align: model.pass_threshold is -0.5: a completion whose summed "
                                         r"reward is 0 \(a failure, for accuracy rewards\) counts as solved"):
        DistillationModule(model="builtin:tiny", teacher_model=teacher, num_generations_eval=4, pass_threshold=-0.5)
    DistillationModule(model="builtin:tiny", teacher_model=teacher, pass_threshold=-0.5)  # unread: no pass@k
    # TRL's place for the teacher's dtype (lit_align.models.model_dtype): taken, no longer refused
    module = DistillationModule(model="builtin:tiny", teacher_model=teacher,
                                teacher_model_init_kwargs={"dtype": "bfloat16"})
    assert module.teacher.init_kwargs == {"dtype": "bfloat16"}


class TeacherResident(L.Callback):
    """The teacher's file pages resident (KiB) after each backward, when its forward is long done, and each step's
    loss."""

    def __init__(self):
        self.after_backward, self.losses = [], []

    def on_after_backward(self, trainer, pl_module):
        self.after_backward.append(mapped_resident_kib(pl_module.teacher.model))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


@pytest.mark.skipif(not host_memory.mapped_forward(False), reason="glibc and Linux's /proc")
def test_the_teachers_file_pages_leave_the_resident_set_after_its_forward(teacher, rows):
    """By default (release_frozen_weights, with or without mmap_activations) the teacher's weights, read from its
    mapped files, are out of the resident set from the end of its forward until its next one (the page cache keeps
    them); release_frozen_weights false keeps them, None follows mmap_activations; the steps' losses are the same."""
    weights = (Path(teacher) / "model.safetensors").resolve()
    runs = {"default": {}, "unmapped": {"mmap_activations": False}, "kept": {"release_frozen_weights": False},
            "none": {"release_frozen_weights": None, "mmap_activations": False},
            "none+mmap": {"release_frozen_weights": None}}
    seen = {}
    for name, settings in runs.items():
        seen[name] = TeacherResident()
        torch.manual_seed(0)
        distill(teacher, rows, max_steps=2, callbacks=[seen[name]], **settings)
    kept = 0.9 * weights.stat().st_size / 1024
    assert seen["default"].after_backward == seen["unmapped"].after_backward == seen["none+mmap"].after_backward == [0, 0]
    assert min(seen["kept"].after_backward) > kept and min(seen["none"].after_backward) > kept
    assert all(seen[name].losses == seen["default"].losses for name in runs) and len(seen["default"].losses) == 2


def test_the_teacher_is_frozen_out_of_checkpoints_and_its_files_are_checked_on_resume(teacher, rows):
    module = distill(teacher, rows, lmbda=1.0)
    assert not module.teacher.model.training
    assert not any(p.requires_grad for p in module.teacher.model.parameters())
    # its forwards without gradient through the lean layers (the same values, fewer temporaries)
    assert {type(m.forward).__name__ for m in module.teacher.model.model.layers.modules()
            if type(m).__name__ in ("LlamaMLP", "LlamaRMSNorm")} == {"partial"}
    assert not any(key.startswith("teacher.") for key in module.state_dict())
    checkpoint = {}
    module.on_save_checkpoint(checkpoint)
    assert checkpoint["lit_align_teacher"] == module.teacher.identity and module.teacher.identity is not None
    checkpoint = {**checkpoint, "hyper_parameters": dict(module.hparams), "lit_align_teacher": "0" * 64}
    with pytest.raises(LitAlignError, match=rf"the teacher model's files \({teacher}\) changed since the checkpoint"):
        module.check_resume(checkpoint)


# -- several teachers -------------------------------------------------------------------------------------------------
def mixed_divergence(student, teachers: dict, ids: list[str], sequences, mask: torch.Tensor, beta: float,
                     temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``[n, C]``: each row's per-token divergence from its own teacher (``teachers[ids[row]]``), from full logits;
    and the largest |log-prob| involved (the comparison's scale)."""
    student_logits = full_logits(student, sequences)
    own = {teacher_id: full_logits(model, sequences) for teacher_id, model in teachers.items()}
    teacher_logits = torch.stack([own[teacher_id][row] for row, teacher_id in enumerate(ids)])
    per_token = generalized_jsd(student_logits, teacher_logits, mask, beta=beta, temperature=temperature,
                                reduction="none")
    logps = torch.cat([student_logits, *own.values()]).div(temperature).log_softmax(-1)
    return per_token, logps.abs().max()


def test_with_several_teachers_each_rows_divergence_is_from_its_own_teacher(teacher, teacher_b, ab_rows, monkeypatch):
    """Rows alternate teachers a and b: a step's loss is the per-token divergence of each row from its own teacher's
    full logits, summed over the step's tokens and divided by their number; ``train/teacher/<id>/loss`` is each
    teacher's rows' mean. Teacher a alone would give another loss. Each teacher is loaded once for the run."""
    import lit_align.reference

    loads, load = [], lit_align.reference.load_model

    def counted(name, *args, **kwargs):
        loads.append(name)
        return load(name, *args, **kwargs)

    monkeypatch.setattr(lit_align.reference, "load_model", counted)
    record, logged = Rounds(), LoggedSteps()
    module = distill({"a": teacher, "b": teacher_b}, ab_rows, max_steps=2, callbacks=[record, logged], beta=0.5,
                     temperature=0.8)
    assert loads == [teacher, teacher_b]  # two steps, two rounds: each teacher loaded once
    step = record.steps[0]["step"]  # the first step's student is the initial policy
    ids, mask = step.extra["teacher_id"], step.loss_mask
    assert sorted(set(ids)) == ["a", "b"] and torch.equal(mask, step.completion_mask)
    teachers = {teacher_id: t.model for teacher_id, t in module.teachers.items()}
    per_token, scale = mixed_divergence(record.initial, teachers, ids, step, mask, beta=0.5, temperature=0.8)
    assert_rounding_close(record.steps[0]["loss"], per_token.sum() / mask.sum(), scale=scale, terms=TINY_TERMS,
                          msg="loss")
    for teacher_id in ("a", "b"):
        rows = [r for r, t in enumerate(ids) if t == teacher_id]
        assert_rounding_close(logged.steps[0][f"train/teacher/{teacher_id}/loss"],
                              per_token[rows].sum() / mask[rows].sum(), scale=scale, terms=TINY_TERMS, msg=teacher_id)
    alone = float(generalized_jsd(full_logits(record.initial, step), full_logits(teachers["a"], step), mask,
                                  beta=0.5, temperature=0.8))
    assert abs(alone - record.steps[0]["loss"]) > 0.05 * alone  # the mix is not teacher a's divergence


def test_with_several_teachers_val_loss_is_each_rows_divergence_from_its_own_teacher(teacher, teacher_b, ab_rows):
    """``val/loss`` over held-out prompts of both teachers: the student's greedy completions, each row's per-token
    divergence from its own teacher, over all their tokens."""
    module = DistillationModule(model="builtin:tiny", teacher_model={"a": teacher, "b": teacher_b},
                                max_completion_length=6)
    data = PromptDataModule(path=ab_rows, val_path=ab_rows, val_split="train", batch_size=4, val_batch_size=8)
    (metrics,) = trainer(limit_val_batches=1).validate(module, data, verbose=False)
    batch = next(iter(data.val_dataloader()))
    gen = module.val_generation(batch)  # greedy: the completions validation scored
    ids = batch["columns"]["teacher_id"]
    assert sorted(set(ids)) == ["a", "b"]
    teachers = {teacher_id: t.model for teacher_id, t in module.teachers.items()}
    per_token, scale = mixed_divergence(module.policy, teachers, ids, gen, gen.sampled_mask, beta=1.0, temperature=1.0)
    expected = per_token.sum() / gen.sampled_mask.sum()
    assert_rounding_close(metrics["val/loss"], expected, scale=scale, terms=TINY_TERMS, msg="val/loss")
    assert expected > 1e-3


def test_seq_kd_with_several_teachers_samples_each_prompt_from_its_own_teacher(eos_teacher, teacher, rows, tmp_path):
    """Rows alternate the EOS teacher and a random one: in a teacher-sampled round every completion of an ``eos``
    row is EOS alone and the other rows' are not all so; each row keeps its prompt and its teacher id (the groups'
    samples are put back in the batch's order)."""
    mixed = with_teacher_ids(rows, tmp_path / "rows.jsonl", ["eos", "random"])
    record = Rounds()
    distill({"eos": eos_teacher, "random": teacher}, mixed, max_steps=2, callbacks=[record], lmbda=0.0, seq_kd=True)
    texts = [json.loads(line) for line in Path(mixed).read_text().splitlines()]
    for seen in record.steps:
        round = seen["round"]
        assert round.extra["teacher_id"] == [texts[i]["teacher_id"] for i in round.dataset_rows]
        assert round.prompts == [texts[i]["prompt"] for i in round.dataset_rows]
        lengths = round.completion_mask.sum(1).tolist()
        eos_rows = [r for r, t in enumerate(round.extra["teacher_id"]) if t == "eos"]
        assert 0 < len(eos_rows) < len(lengths)
        assert [lengths[r] for r in eos_rows] == [1] * len(eos_rows)
        assert all(round.completion_ids[r, 0] == record.initial.config.eos_token_id for r in eos_rows)
        assert any(lengths[r] > 1 for r in range(len(lengths)) if r not in eos_rows)


def test_teacher_ids_that_name_no_teacher_are_one_error_line(teacher, teacher_b, rows, tmp_path):
    """A row whose id is no teacher's names the dataset row, the id and the known ids; rows without the column,
    a bad id in the mapping, init kwargs not keyed by teacher id and a sharded strategy are one line each too."""
    teachers = {"a": teacher, "b": teacher_b}
    bad = with_teacher_ids(rows, tmp_path / "bad.jsonl", ["a", "b", "c", "a"])  # rows 2, 6, ... name 'c'
    with pytest.raises(LitAlignError) as error:
        distill(teachers, bad, data={"shuffle": False})
    assert str(error.value) == (f"{bad} row 2: field 'teacher_id' is 'c', expected one of ['a', 'b'] (the ids of "
                                "model.teacher_model)")
    with pytest.raises(LitAlignError) as error:
        distill(teachers, rows)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"model.teacher_model is a mapping of teachers (['a', 'b']), but the rows of {rows} "
                              "have no 'teacher_id' column: give each row the id of the teacher it learns from")
    refused = {
        "teacher id 'x.y' must be a non-empty string without '.' or '/'": {"teacher_model": {"x.y": teacher}},
        r"model.teacher_model_init_kwargs: with a mapping of teachers its keys are teacher ids \(\['a', 'b'\]\), "
        r"got \['revision'\]": {"teacher_model": teachers, "teacher_model_init_kwargs": {"revision": "main"}},
        r"model.teacher_model_init_kwargs.b: \['attn_implementation'\] have their own options":
            {"teacher_model": teachers, "teacher_model_init_kwargs": {"b": {"attn_implementation": "eager"}}},
        "model.teacher_model is required": {"teacher_model": {}},
    }
    for message, settings in refused.items():
        with pytest.raises(LitAlignError, match=message):
            DistillationModule(model="builtin:tiny", **settings)
    sharded = DistillationModule(model="builtin:tiny", teacher_model=teachers)
    sharded._trainer = SimpleNamespace(strategy=FSDPStrategy())
    with pytest.raises(LitAlignError, match="model.teacher_model: several teachers are not supported under FSDP"):
        sharded.configure_model()


def test_every_rows_teacher_id_is_checked_before_the_first_step(teacher, teacher_b, rows, tmp_path):
    """A bad id in the last row (a large dataset's, hours in) or in a validation row: refused at setup, naming the
    file and row, before any step; an integer id (YAML's ``1: ...`` keys are strings) says ids are strings."""
    teachers = {"1": teacher, "2": teacher_b}
    n = len(Path(rows).read_text().splitlines())
    last_bad = with_teacher_ids(rows, tmp_path / "last_bad.jsonl", ["1"] * (n - 1) + ["3"])
    steps = Steps()
    with pytest.raises(LitAlignError) as error:
        distill(teachers, last_bad, max_steps=4, callbacks=[steps])
    assert steps.started == 0
    assert str(error.value) == (f"{last_bad} row {n - 1}: field 'teacher_id' is '3', expected one of ['1', '2'] "
                                "(the ids of model.teacher_model)")
    good = with_teacher_ids(rows, tmp_path / "good.jsonl", ["1", "2"])
    numbers = with_teacher_ids(rows, tmp_path / "numbers.jsonl", [1, 2])
    module = DistillationModule(model="builtin:tiny", teacher_model=teachers, max_completion_length=6)
    with pytest.raises(LitAlignError) as error:
        fit(module, PromptDataModule(path=good, val_path=numbers, val_split="train", batch_size=4), callbacks=[steps])
    assert steps.started == 0
    assert str(error.value) == (f"{numbers} row 0: field 'teacher_id' is the number 1, but teacher ids are strings "
                                "(the keys of model.teacher_model: ['1', '2']): write '1'")


def shuffled_tokenizer_teacher(path: Path, swap: tuple[int, int] | None = (40, 41)) -> str:
    """The tiny model with the built-in tokenizer's ids ``swap``-ped (same size, other tokens at two ids), or with
    no tokenizer files (``swap`` None)."""
    from lit_align.models import CHARACTERS, SPECIAL_TOKENS
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    tokens = SPECIAL_TOKENS + CHARACTERS
    model, tokenizer = load_model("builtin:tiny"), build_tokenizer()
    if swap is not None:
        a, b = swap
        tokens[a], tokens[b] = tokens[b], tokens[a]
        backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[], unk_token="<unk>"))
        backend.add_special_tokens(SPECIAL_TOKENS)
        backend.decoder = decoders.Fuse()
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>",
                                            eos_token="</s>", unk_token="<unk>")
    save_hf(model, tokenizer, path)
    if swap is None:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
            (path / name).unlink(missing_ok=True)
    return str(path)


def test_a_teacher_whose_tokenizer_numbers_its_tokens_apart_is_one_error_line_naming_the_first_ids(
        teacher, rows, ab_rows, tmp_path):
    """Same vocabulary size, two ids swapped: refused in one line naming them (TRL's size check passes it), before
    any teacher loads; ``teacher_tokenizer_check: false`` trains with it; a teacher without tokenizer files cannot be
    compared: one warning, and it trains."""
    swapped = shuffled_tokenizer_teacher(tmp_path / "swapped")
    token = build_tokenizer().convert_ids_to_tokens
    steps = Steps()
    with pytest.raises(LitAlignError) as error:
        distill(swapped, rows, callbacks=[steps])
    assert steps.started == 0
    assert str(error.value) == (
        f"model.teacher_model '{swapped}' numbers its tokens apart from the student 'builtin:tiny': 2 of "
        f"{len(build_tokenizer())} ids differ (id 40 is {token(41)!r} / {token(40)!r}, id 41 is {token(40)!r} / "
        f"{token(41)!r}, teacher's / student's token); distillation compares the two distributions id by id, so the "
        "student would learn from shuffled tokens: use a teacher with the student's tokenizer, or set "
        "model.teacher_tokenizer_check: false if these ids mean the same tokens to both models")
    with pytest.raises(LitAlignError, match=r"^model.teacher_model.b '.*' numbers its tokens apart"):
        distill({"a": teacher, "b": swapped}, ab_rows)
    assert distill(swapped, rows, callbacks=[steps], teacher_tokenizer_check=False).global_step == 1
    bare = shuffled_tokenizer_teacher(tmp_path / "bare", swap=None)
    with pytest.warns(UserWarning, match=rf"^lit_align: model.teacher_model '{bare}': its token ids cannot be compared "
                                         r"with the student's \(could not load tokenizer"):
        assert distill(bare, rows).global_step == 1


def test_a_file_as_a_teacher_is_one_error_line():
    module = DistillationModule(model="builtin:tiny", teacher_model=str(REPO / "README.md"))
    with pytest.raises(LitAlignError) as error:
        module.configure_model()
    assert str(error.value) == (f"model.teacher_model '{REPO / 'README.md'}' is a file, not a model: give the "
                                "directory that holds it with its config.json (a Hugging Face model directory), a "
                                ".gguf file, a hub name, pretrained:<name> or builtin:<name>")


def test_each_of_several_teachers_is_checked_against_the_students_vocabulary(teacher, tmp_path):
    tokenizer = build_tokenizer()
    wide = load_model("builtin:tiny")
    wide.resize_token_embeddings(len(tokenizer) + 16)
    save_hf(wide, tokenizer, tmp_path / "wide")
    module = DistillationModule(model="builtin:tiny", teacher_model={"a": teacher, "wide": str(tmp_path / "wide")})
    with pytest.raises(LitAlignError) as error:
        module.configure_model()
    assert str(error.value).startswith(f"model.teacher_model.wide '{tmp_path / 'wide'}' has vocab_size "
                                       f"{len(tokenizer) + 16} but the student 'builtin:tiny' has {len(tokenizer)}")


def test_each_teacher_has_its_own_checkpoint_entry_and_a_changed_one_refuses_the_resume(teacher, ab_rows, tmp_path):
    """Two teachers: ``lit_align_teacher/a`` and ``/b`` (no single-teacher entry), none of their weights in the
    state dict. Once b's files change, a resume of that checkpoint is refused naming teacher b and its files."""
    b = tmp_path / "b"
    shutil.copytree(teacher, b)
    teachers = {"a": teacher, "b": str(b)}
    module = distill(teachers, ab_rows)
    checkpoint = {"hyper_parameters": dict(module.hparams)}
    module.on_save_checkpoint(checkpoint)
    entries = sorted(k for k in checkpoint if k.startswith("lit_align_teacher"))
    assert entries == ["lit_align_teacher/a", "lit_align_teacher/b"]
    assert [checkpoint[k] for k in entries] == [module.teachers["a"].identity, module.teachers["b"].identity]
    assert not any(key.startswith("teachers.") for key in module.state_dict())
    module.check_resume(checkpoint)  # the same files: resumes
    changed = load_model(str(b))
    with torch.no_grad():
        changed.model.norm.weight.add_(0.01)
    save_hf(changed, build_tokenizer(), b)
    resumed = DistillationModule(model="builtin:tiny", teacher_model=teachers)
    resumed.configure_model()  # the teachers' files read again
    with pytest.raises(LitAlignError) as error:
        resumed.check_resume(checkpoint)
    assert str(error.value).startswith(f"the checkpoint: the teacher 'b' model's files ({b}) changed since the "
                                       "checkpoint was written")


def test_a_single_teachers_checkpoint_entries_are_unchanged(teacher, rows):
    """One teacher: the checkpoint's lit_align entries are the ones they were before several teachers existed."""
    checkpoint = {}
    distill(teacher, rows).on_save_checkpoint(checkpoint)
    assert sorted(checkpoint) == ["lit_align_grpo", "lit_align_num_tokens", "lit_align_recipe",
                                  "lit_align_skipped_batches", "lit_align_teacher", "lit_align_total_steps"]


# -- through the CLI ---------------------------------------------------------------------------------------------------
def cli_args(root: Path, teacher_model: str, *extra: str) -> list[str]:
    return ["fit", "-c", CONFIG, "--model.init_args.teacher_model", teacher_model, "--data.init_args.batch_size", "4",
            "--data.init_args.val_batch_size", "8", "--trainer.limit_val_batches", "1", "--trainer.max_steps", "2",
            "--trainer.val_check_interval", "2", "--trainer.log_every_n_steps", "1",
            "--trainer.enable_progress_bar", "false", "--trainer.logger", "lightning.pytorch.loggers.CSVLogger",
            "--trainer.logger.save_dir", str(root), "--export.path", str(root / "hf_model"), *extra]


def test_configs_distill_yaml_trains_and_exports_through_the_cli(teacher, tmp_path, capfd):
    code, _, err = run_main(cli_args(tmp_path, teacher, "--model.init_args.lmbda", "0.5"), capfd)
    assert code == 0, err
    (run,) = tmp_path.glob("*/version_*")
    logged = {name for row in read_metrics(run / "metrics.csv") for name in row}
    expected = {"train/loss", "train/entropy", "train/num_tokens", "train/on_policy", "train/teacher_sampled",
                "train/completions/mean_length", "train/completions/clipped_ratio", "train/reward",
                "train/rewards/sort_accuracy/mean", "val/loss", "val/reward"}
    assert expected <= logged, expected - logged
    exported = load_model(str(tmp_path / "hf_model")).state_dict()
    start = load_model("builtin:tiny").state_dict()
    assert any(not torch.equal(exported[k], start[k]) for k in start)


def test_a_mapping_of_teachers_trains_and_validates_through_the_cli(teacher, teacher_b, ab_rows, tmp_path, capfd):
    """``teacher_model`` as a mapping on the command line (a YAML dict in a config): every round, the teacher's
    samples too (``seq_kd``), and validation run; each teacher's loss is logged beside ``train/loss``."""
    teachers = json.dumps({"a": teacher, "b": teacher_b})
    code, _, err = run_main(cli_args(tmp_path, teachers, "--model.init_args.lmbda", "0.5", "--data.init_args.path",
                                     ab_rows, "--data.init_args.val_path", ab_rows, "--data.init_args.val_split",
                                     "train", "--trainer.max_steps", "4", "--trainer.val_check_interval", "4"), capfd)
    assert code == 0, err
    (run,) = tmp_path.glob("*/version_*")
    metrics = read_metrics(run / "metrics.csv")
    logged = {name for row in metrics for name in row}
    expected = {"train/loss", "train/teacher/a/loss", "train/teacher/b/loss", "train/teacher_sampled", "val/loss"}
    assert expected <= logged, expected - logged
    assert {row["train/teacher_sampled"] for row in metrics if "train/teacher_sampled" in row} == {0.0, 1.0}


def test_a_teacher_the_student_cannot_learn_from_is_one_error_line(tmp_path, capfd):
    tokenizer = build_tokenizer()
    other = load_model("builtin:tiny")
    other.resize_token_embeddings(len(tokenizer) + 16)
    save_hf(other, tokenizer, tmp_path / "wide")
    code, _, err = run_main(cli_args(tmp_path, str(tmp_path / "wide")), capfd)
    assert_one_line_error(code, err, f"model.teacher_model '{tmp_path / 'wide'}' has vocab_size {len(tokenizer) + 16}",
                          f"the student 'builtin:tiny' has {len(tokenizer)}")
    code, _, err = run_main(cli_args(tmp_path, str(tmp_path / "missing")), capfd)
    assert_one_line_error(code, err, f"model.teacher_model '{tmp_path / 'missing'}': no such directory")
    code, _, err = run_main(cli_args(tmp_path, str(tmp_path / "wide"), "--model.init_args.lmbdaa", "0.5"), capfd)
    assert_one_line_error(code, err, "model.lmbdaa: DistillationModule has no such option")


# -- the docs ---------------------------------------------------------------------------------------------------------
def test_distill_page_names_every_distillation_and_gkd_config_field():
    import transformers
    import trl
    from trl.experimental.gkd import GKDConfig

    base = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    sft = {f.name for f in dataclasses.fields(trl.SFTConfig)}
    own = [f.name for f in dataclasses.fields(trl.DistillationConfig) if f.name not in base]
    own += [f.name for f in dataclasses.fields(GKDConfig) if f.name not in sft and f.name not in own]
    page = (REPO / "docs" / "distill.md").read_text()
    missing = [name for name in own if f"| `{name}` |" not in page]
    assert not missing, f"fields missing from the tables in docs/distill.md: {missing}"
