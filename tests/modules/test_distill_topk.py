"""DistillationModule's teacher top-k cache (``teacher_topk_cache``, ``lit_align.teacher_topk``): a round of the
dataset's completions trains against the teacher's cached top-k (TRL's top-k divergence with its tail entry, by hand
from both models' full logits; at k = V the live teacher's loss), computed once before training with no teacher
forward in those rounds afterwards, read back by the next run, under a key that follows the rows, the teacher, k and
the temperature; a cache file that does not verify is reported and computed again, one that cannot be written is
one warning and the run goes on; settings that cannot use it are one error line each.

The models and rows are ``test_distill_module``'s: the built-in tiny student, a teacher from another seed.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import run_main
from test_distill_module import (  # noqa: F401 (fixtures)
    CONFIG, PlainHead, Rounds, cli_args, distill, full_logits, rows, sort_rows, teacher, teacher_b,
)

from lit_align.errors import LitAlignError
from lit_align.losses.distill import topk_generalized_jsd
from lit_align.models import build_tokenizer
from lit_align.modules import DistillationModule
from lit_align.reference import write_cache
from numerics import TINY_TERMS, assert_rounding_close

VOCAB = len(build_tokenizer())


@pytest.fixture
def topk_cache(lit_align_cache):
    """The session cache's ``teacher_topk`` directory, emptied (other tests may have cached these rows)."""
    path = lit_align_cache / "teacher_topk"
    shutil.rmtree(path, ignore_errors=True)
    return path


class TeacherForwards(L.Callback):
    """Counts the teacher's forwards from the start of training (the cache's pass, if any, ran before): its decoder's,
    which the distillation's outputs call without the LM head."""

    def __init__(self):
        self.count = 0

    def on_fit_start(self, trainer, pl_module):
        pl_module.teacher.model.get_decoder().register_forward_pre_hook(self.counted)

    def counted(self, *args) -> None:
        self.count += 1


def cached_run(teacher_model: str, rows: str, max_steps: int = 1, callbacks=(), **settings):
    """``distill`` with every round on the dataset's completions (``lmbda`` 0) unless ``settings`` say otherwise;
    returns the module."""
    L.seed_everything(0, verbose=False)
    return distill(teacher_model, rows, max_steps=max_steps, callbacks=callbacks, **{"lmbda": 0.0, **settings})


# -- the values ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("beta,temperature,k,head", [
    (1.0, 1.0, 8, "chunked"), (0.5, 0.8, 20, "chunked"), (0.0, 1.3, VOCAB, "chunked"), (0.5, 0.8, 20, "plain"),
])
def test_a_cached_rounds_loss_is_the_topk_divergence_from_the_teachers_full_logits(beta, temperature, k, head, teacher,
                                                                                    rows, topk_cache):
    """The step's loss is ``topk_generalized_jsd`` of the student's logits against the top-k of the teacher's
    tempered log-softmax, both from plain padded forwards of the round's sequences (the cache's values are the
    teacher's, at the right tokens, cut as the round cuts its completions); through the student's head a chunk at a
    time, or from its full logits where the head is not chunkable (``PlainHead``)."""
    record = Rounds()
    module = cached_run(teacher, rows, callbacks=[record, *([PlainHead()] if head == "plain" else [])], beta=beta,
                        temperature=temperature, teacher_topk_cache=k, max_completion_length=4)
    (first,) = record.steps
    step, round = first["step"], first["round"]
    assert round.teacher_topk_ids.shape == (*round.completion_ids.shape, k)
    assert bool(round.stats["completions/clipped_ratio"] > 0)  # some completions cut: their top-k cut with them
    student, teacher_logits = full_logits(record.initial, step), full_logits(module.teacher.model, step)
    top = F.log_softmax(teacher_logits / temperature, -1).topk(k)
    assert torch.equal(step.teacher_topk_ids[step.loss_mask.bool()], top.indices[step.loss_mask.bool()])
    expected = topk_generalized_jsd(student, top.values, top.indices, step.loss_mask, beta, temperature)
    logps = torch.cat([student, teacher_logits]).div(temperature).log_softmax(-1)
    assert_rounding_close(first["loss"], expected, scale=logps.abs().max(), terms=TINY_TERMS, msg="loss")
    assert expected > 1e-3


def test_at_k_equal_to_the_vocabulary_the_cached_run_is_the_live_run(teacher, rows, topk_cache):
    """k = V: every step's loss equals the run without the cache (the teacher forward in each step). Below V the
    top-k divergence with its tail entry is a coarse-graining of the full one (each top-k id its own bin, the rest
    one bin): at the first step (the same student) it is below the live loss and rises with k, to within 25% of it
    at k = 64 of the 104 tokens (the tiny teacher is far from peaked: its tail holds most of its mass)."""
    def losses(max_steps: int = 1, **settings):
        record = Rounds()
        cached_run(teacher, rows, max_steps=max_steps, callbacks=[record], **settings)
        return [s["loss"] for s in record.steps]

    live = losses(3)
    assert_rounding_close(losses(3, teacher_topk_cache=VOCAB), live, terms=TINY_TERMS, msg="k = V")
    first = [losses(teacher_topk_cache=k)[0] for k in (8, 32, 64)]
    assert first == sorted(first) and first[-1] < live[0] < first[-1] / 0.75, (first, live[0])


# -- computed once, read back -------------------------------------------------------------------------------------
def test_the_second_run_reads_the_cache_and_no_round_of_the_datasets_completions_runs_the_teacher(teacher, rows,
                                                                                                 topk_cache):
    """The first run computes the rows' top-k once (before training) and writes the file with its digest; its
    dataset rounds run no teacher forward. The second run computes nothing and trains on the same numbers. Without
    the cache every step runs the teacher; with lmbda 0.5 only the on-policy rounds do."""
    def run(max_steps: int = 3, **settings):
        record, forwards = Rounds(), TeacherForwards()
        module = cached_run(teacher, rows, max_steps=max_steps, callbacks=[record, forwards], **settings)
        computed = module.teacher_topk.computed if module.teacher_topk is not None else None
        return [s["loss"] for s in record.steps], forwards.count, computed, record

    first, forwards, computed, _ = run(teacher_topk_cache=16)
    assert (forwards, computed) == (0, ["train"])
    (cached,) = topk_cache.glob("*.pt")
    assert cached.with_suffix(".sha256").exists()
    second, forwards, computed, _ = run(teacher_topk_cache=16)
    assert (forwards, computed) == (0, [])
    assert second == first
    _, forwards, _, _ = run()
    assert forwards == 3  # the live teacher: one forward per step
    _, forwards, computed, record = run(max_steps=8, lmbda=0.5, teacher_topk_cache=16)
    on_policy = sum(s["on_policy"] for s in record.steps)
    assert computed == [] and 0 < on_policy < 8 and forwards == on_policy


def test_the_key_follows_the_rows_the_teacher_k_and_the_temperature(teacher, teacher_b, rows, topk_cache, tmp_path):
    """Each change makes a new cache file (a new pass); the first settings again read their own."""
    def run(teacher_model=teacher, rows_path=rows, **settings):
        module = cached_run(teacher_model, rows_path, **{"teacher_topk_cache": 8, **settings})
        return module.teacher_topk.computed

    assert run() == ["train"]
    other_rows = sort_rows(tmp_path / "other.jsonl", 32, offset=500)
    for changed in ({"teacher_model": teacher_b}, {"teacher_topk_cache": 9}, {"temperature": 0.7},
                    {"rows_path": other_rows}):
        assert run(**changed) == ["train"], changed
    assert len(list(topk_cache.glob("*.pt"))) == 5
    assert run() == []


@pytest.mark.parametrize("damage", ["edited", "truncated", "no digest", "other rows"])
def test_a_cache_file_that_does_not_verify_is_computed_again(teacher, rows, topk_cache, damage):
    """A cached file changed after it was written, cut short, without its digest, or (its digest rewritten) holding
    other rows' values: the run warns naming the file and what is wrong, runs the teacher again and trains on the
    true values (its loss is the first run's); the rewritten file is read back by the next run."""
    def run():
        record = Rounds()
        module = cached_run(teacher, rows, callbacks=[record], teacher_topk_cache=8)
        return record.steps[0]["loss"], module.teacher_topk.computed

    first, computed = run()
    (cached,) = topk_cache.glob("*.pt")
    values = torch.load(cached, weights_only=True)
    if damage == "edited":
        values["logps"][:, 0] -= 1.0
        torch.save(values, cached)
    elif damage == "truncated":
        cached.write_bytes(cached.read_bytes()[:100])
    elif damage == "no digest":
        cached.with_suffix(".sha256").unlink()
    else:
        values["lengths"][0] += 1
        values = {**values, **{name: torch.cat([v[:1], v]) for name, v in values.items() if name != "lengths"}}
        write_cache(cached, values)
    problem = {"edited": "its content does not match its digest", "truncated": "its content does not match",
               "no digest": "its content does not match", "other rows": "its rows' completion lengths are not"}
    with pytest.warns(UserWarning, match=f"teacher top-k log-prob cache {cached}: {problem[damage]}.*computing the "
                                         "log-probs again"):
        second, computed = run()
    assert computed == ["train"] and second == first
    assert run()[1] == []


# -- settings --------------------------------------------------------------------------------------------------------
def test_a_cache_that_cannot_be_written_is_one_warning_and_the_run_goes_on(teacher, rows, topk_cache):
    """A file where the cache's directory should be: after the pass, one warning naming the file and why (not the
    file system's "File exists"), and the run trains on the values it computed; nothing is left behind."""
    topk_cache.write_text("not a directory")
    try:
        with pytest.warns(UserWarning) as warned:
            module = cached_run(teacher, rows, max_steps=2, teacher_topk_cache=8)
    finally:
        topk_cache.unlink()
    (line,) = [str(w.message) for w in warned if "cache" in str(w.message)]
    assert line.startswith(f"lit_align: cannot write the teacher top-k log-prob cache {topk_cache}/")
    assert line.endswith(f": {topk_cache} is a file, not a directory; the run goes on with the values it computed, "
                         "the next run computes them again (LIT_ALIGN_CACHE sets where caches go)")
    assert module.teacher_topk.computed == ["train"] and module.global_step == 2
    assert module.round.teacher_topk_ids is not None  # the rounds trained on the computed values


def test_settings_that_cannot_use_the_cache_are_one_error_line(teacher, teacher_b, rows, topk_cache):
    refused = {
        "model.teacher_topk_cache caches the teacher on the dataset's completions, which only the rounds that are not "
        "on-policy train on": [{"lmbda": 1.0}, {"lmbda": 0.5, "seq_kd": True}],
        "model.teacher_topk_cache must be a number of log-probs per token >= 1 or null, got 0":
            [{"lmbda": 0.5, "teacher_topk_cache": 0}],
        "model.teacher_topk_cache: not supported with several teachers":
            [{"lmbda": 0.5, "teacher_model": {"a": teacher, "b": teacher_b}}],
    }
    for message, cases in refused.items():
        for settings in cases:
            with pytest.raises(LitAlignError, match=message):
                DistillationModule(model="builtin:tiny", **{"teacher_model": teacher, "teacher_topk_cache": 4,
                                                            **settings})
    with pytest.raises(LitAlignError) as error:
        cached_run(teacher, rows, teacher_topk_cache=VOCAB + 1)
    assert str(error.value) == (f"model.teacher_topk_cache is {VOCAB + 1}, more than the teacher's vocabulary "
                                f"({VOCAB} tokens); at most {VOCAB} (which keeps the whole distribution)")



# -- through the CLI, and under DDP --------------------------------------------------------------------------------
def test_configs_distill_yaml_takes_the_option(teacher, rows, topk_cache, tmp_path, capfd):
    code, _, err = run_main(cli_args(tmp_path, teacher, "--model.init_args.lmbda", "0.0", "--model.init_args.seq_kd",
                                     "false", "--model.init_args.teacher_topk_cache", "16", "--data.init_args.path",
                                     rows, "--data.init_args.val_split", "null"), capfd)
    assert code == 0, err
    assert len(list(topk_cache.glob("*.pt"))) == 1


def dense(values: dict) -> torch.Tensor:
    """A k = V cache's log-probs ``[tokens, V]`` by id (its top-k order may differ where log-probs tie to rounding)."""
    return torch.zeros(values["logps"].shape).scatter(1, values["ids"].long(), values["logps"])


@pytest.mark.slow  # two processes (~30 s): run by .ci/run (make test-slow), not by make test
def test_the_cache_under_ddp_matches_one_process(teacher, rows, topk_cache, tiny_path, tmp_path):
    """Two CPU ranks (the real CLI in a subprocess) each run the teacher over their share of the rows; the file rank
    0 writes holds what one process computes, row by row in dataset order."""
    args = [sys.executable, "-m", "lit_align", "fit", "-c", CONFIG,
            "--model.init_args.teacher_model", teacher, "--model.init_args.lmbda", "0.0", "--model.init_args.seq_kd",
            "false", "--model.init_args.teacher_topk_cache", str(VOCAB), "--data.init_args.path", rows,
            "--data.init_args.val_split", "null", "--data.init_args.batch_size", "2", "--trainer.max_steps", "1",
            "--trainer.strategy", "ddp", "--trainer.devices", "2", "--trainer.accelerator", "cpu",
            "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
            "--trainer.enable_checkpointing", "false", "--export.enabled", "false"]
    proc = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    (cached,) = topk_cache.glob("*.pt")
    ddp = torch.load(cached, weights_only=True)
    cached.unlink()
    module = cached_run(teacher, rows, teacher_topk_cache=VOCAB)  # the same key: computed again, in one process
    assert module.teacher_topk.computed == ["train"]
    single = torch.load(cached, weights_only=True)
    assert torch.equal(ddp["lengths"], single["lengths"]) and len(ddp["lengths"]) == 32
    assert_rounding_close(dense(ddp), dense(single), terms=TINY_TERMS)
