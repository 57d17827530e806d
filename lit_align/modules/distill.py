"""On-policy distillation as a LightningModule: an online recipe (``lit_align.modules.online``) with TRL 1.16's
``DistillationTrainer`` semantics, and the ``lmbda`` / ``seq_kd`` rounds of its experimental ``GKDTrainer``.

``DistillationModule`` is a sibling of GRPO and RLOO on ``OnlineModule``: the same rollouts, rounds, data, engines,
tools and checkpoints, but no rewards to train on, no advantages, no old-policy or reference log-probs. Each round's
completions come from the student (a coin with probability ``lmbda``, drawn once per round), else from the teacher
(``seq_kd``) or from the dataset's ``completion`` column; each training step's loss is the generalized
Jensen-Shannon divergence (``lit_align.losses.distill``; ``beta`` 0 forward KL, 1 reverse KL) between the student's
and the teacher's tempered next-token distributions at every completion token, summed, divided by the round's loss
tokens per step on all ranks (``OnlineModule``'s dapo normaliser): the per-token mean over an optimizer step's
tokens that TRL's trainer computes (exactly so with ``steps_per_generation`` equal to the gradient accumulation,
TRL's generation batch).

Where things are computed: the student's final hidden states and LM head at the completion-predicting positions
(``lit_align.logps.layout_outputs``, over ``lit_align.layouts.completions``: packed where ``padding_free``), the
teacher's the same way in each step under ``no_grad``; the divergence is chunked through both heads
(``chunked_generalized_jsd``), so no ``[tokens, V]`` logits of either model are held, and falls back to full logits
(``generalized_jsd``) for a head that is not chunkable. Several teachers (``teacher_model`` a mapping; not in TRL's
trainers, asked for in TRL's issue #6734): each prompt row names its own (``lit_align.teachers``), each teacher runs
on its rows only, and each token's divergence is from its row's teacher. The rounds of the dataset's completions can
read the teacher's top-k log-probs from a cache computed once per dataset instead (``teacher_topk_cache``, not in
TRL's trainers: ``lit_align.teacher_topk``; their loss is ``topk_generalized_jsd``'s, through the student's head a
chunk at a time). Left out, and why: TRL's ``ServerDistillationTrainer`` (a teacher behind a vLLM server).
``docs/distill.md`` lists every ``DistillationConfig`` and ``GKDConfig`` field and what became of it.
"""

from __future__ import annotations

from contextlib import nullcontext
from functools import partial
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence
from torchmetrics import MeanMetric

from lit_align import layouts
from lit_align.capabilities import sharded_strategy
from lit_align.data import PromptDataModule
from lit_align.errors import LitAlignError
from lit_align.generation import Rollout
from lit_align.generation_round import GenerationRound
from lit_align.logps import Projection, chunked_token_logps, layout_outputs, plain_token_stats
from lit_align.losses.distill import (
    chunked_generalized_jsd, chunked_topk_generalized_jsd, generalized_jsd, topk_generalized_jsd,
)
from lit_align.models import load_tokenizer
from lit_align.modules.online import OnlineModule
from lit_align.reference import Reference, Teacher
from lit_align.rollouts import Generation, batch_rows, repeat_each
from lit_align.teacher_topk import TeacherTopK, TopK, round_topk
from lit_align.teachers import TEACHER_ID, Teachers

COIN_SALT = 0x5EED_C014  # the round's coin draws from its own seed, not from the sampling stream's
NOT_DISTILLATION = ("ref_model", "sync_ref_model", "dynamic_sampling")  # OnlineModule options of rewards recipes


def check_distillation(teacher_model: str | dict | None, beta: float, lmbda: float, seq_kd: bool,
                       teacher_topk_cache: int | None, options: dict) -> None:
    """Refuse distillation settings that cannot work, each in one line naming the option."""
    if not teacher_model:
        raise LitAlignError("model.teacher_model is required: the model whose next-token distributions the student "
                            "learns (a hub name, a directory, a .gguf file, pretrained:<name> or builtin:<name>)")
    for name, value in (("beta", beta), ("lmbda", lmbda)):
        if not 0.0 <= value <= 1.0:
            raise LitAlignError(f"model.{name} must be in [0, 1], got {value}")
    for name in NOT_DISTILLATION:
        if options.get(name):
            raise LitAlignError(f"model.{name}: distillation has no reference and no advantages (it compares the "
                                "student with model.teacher_model); leave it unset")
    if seq_kd and options.get("engine") == "vllm":
        raise LitAlignError("model.seq_kd samples rounds from the teacher, but engine vllm holds the student's "
                            "weights: use engine auto, hf or native")
    if seq_kd and options.get("rollout_func"):
        raise LitAlignError("model.seq_kd samples rounds from the teacher, but model.rollout_func makes completions "
                            "itself: drop one of them")
    if teacher_topk_cache is not None and (lmbda == 1.0 or seq_kd):
        raise LitAlignError("model.teacher_topk_cache caches the teacher on the dataset's completions, which only "
                            "the rounds that are not on-policy train on, and only without model.seq_kd; set "
                            "model.lmbda < 1 and model.seq_kd: false, or drop model.teacher_topk_cache")
    if teacher_topk_cache is not None and isinstance(teacher_model, dict):
        raise LitAlignError("model.teacher_topk_cache: not supported with several teachers (model.teacher_model a "
                            "mapping); use one teacher, or drop model.teacher_topk_cache")


def check_vocabularies(student, teacher, student_name: str, teacher_name: str,
                       option: str = "model.teacher_model") -> None:
    """TRL's check: the two models score one vocabulary (the divergence compares their distributions entry by
    entry). ``option``: the setting that named the teacher."""
    sizes = [model.config.get_text_config().vocab_size for model in (student, teacher)]
    if sizes[0] != sizes[1]:
        raise LitAlignError(f"{option} {teacher_name!r} has vocab_size {sizes[1]} but the student "
                            f"{student_name!r} has {sizes[0]}: distillation compares the teacher's full next-token "
                            "distribution with the student's, entry by entry; use a teacher with the student's "
                            "vocabulary")


def check_completions(rows, source: str) -> None:
    """The rounds that train on the dataset's completions (``lmbda < 1`` without ``seq_kd``) need every training
    row's: refused before training, not at the first such round."""
    if "completion_ids" not in rows.column_names:
        raise LitAlignError(f"model.lmbda < 1: the rounds that are not on-policy (a share 1 - lmbda) train on the "
                            f"dataset's completions, but the rows of {source} have no 'completion' column; give each "
                            "row its 'completion' (as SFT rows have), or set model.seq_kd: true (the teacher samples "
                            "them) or model.lmbda: 1.0 (every round on-policy)")


class DistillationModule(OnlineModule):
    """On-policy distillation with TRL 1.16's ``DistillationConfig`` names and defaults, and ``GKDConfig``'s
    ``lmbda`` and ``seq_kd``. The sampling, engine, tools and round options are ``OnlineModule``'s; ``temperature``
    is the sampling temperature and the loss's (both models' logits are divided by it), as in TRL.

    Args:
        teacher_model: the teacher (required): anything ``model`` takes (a hub name, a directory, a ``.gguf`` file,
            ``pretrained:<name>``, ``builtin:<name>``), with the student's vocabulary. Loaded with the student's
            ``dtype``, ``attn_implementation`` and ``trust_remote_code``, frozen, never in checkpoints; a resume
            refuses a teacher whose files changed. Or several: a mapping ``{teacher_id: source}``, each prompt row
            naming its teacher in its ``teacher_id_column`` (``lit_align.teachers``).
        teacher_model_init_kwargs: more ``from_pretrained`` arguments for the teacher (TRL's); the student's
            ``model_init_kwargs`` are not its. ``dtype`` and ``attn_implementation`` are the model's options. With
            a mapping of teachers, keyed by teacher id: ``{teacher_id: {arguments}}``.
        teacher_id_column: with a mapping of teachers, the prompt rows' column naming each row's teacher.
        teacher_tokenizer_check: refuse a teacher whose tokenizer maps an id to another token than the student's
            (the whole id -> token table is compared, special tokens included; TRL compares the vocabulary sizes
            only, which two tokenizers that number their tokens apart share). false: trust that the ids mean the
            same tokens to both models (a teacher whose tokenizer files name its tokens otherwise, say).
        beta: the divergence: 0 the forward KL(teacher || student), 1 the reverse KL(student || teacher) (TRL's
            default), in between the generalized JSD with the mixture ``(1 - beta) p_student + beta p_teacher``.
            Not ``OnlineModule``'s KL-to-reference coefficient: distillation has no reference.
        lmbda: the probability that a round's completions are the student's own samples (GKD's; 1.0, the default,
            is TRL's ``DistillationTrainer``: always on-policy). Drawn once per generation round, the same on every
            rank, from a seed a resume reproduces. Otherwise the round trains on the teacher's samples
            (``seq_kd``) or on the dataset's ``completion`` column (tokenized as SFT's, EOS appended, cut to
            ``max_completion_length``).
        seq_kd: the rounds that are not on-policy sample their completions from the teacher, with the student's
            engine and sampling settings (GKD's sequence-level KD).
        teacher_topk_cache: k: the rounds of the dataset's completions compare the student with the teacher's top-k
            log-probs at each of their tokens (``topk_generalized_jsd``, the rest of each distribution in one tail
            entry; k = the vocabulary's size is the full divergence), computed once per dataset before training
            and cached on disk under ``$LIT_ALIGN_CACHE/teacher_topk`` (``lit_align.teacher_topk``): no teacher
            forward in those rounds. Needs ``lmbda < 1`` without ``seq_kd``, and one teacher. None: the teacher
            runs in every round.
        num_generations: completions per prompt (TRL's ``DistillationTrainer``: 1).
        disable_dropout: zero the student's dropout (TRL's ``DistillationConfig`` default: off).
        mmap_activations: ``AlignModule``'s, here on by default (CPU under glibc; nothing elsewhere): a step's
            forward maps its large tensors instead of growing glibc's heap (``lit_align.host_memory``). With the lean
            layers of no checkpointing (``lit_align.recompute``: ``lean_mlps``, ``lean_norms``) and the teacher's
            weights released (below), peak RSS on SmolLM2-135M 3.8-3.9 GB against TRL's 7.3-7.4
            (``docs/distill.md``); off: 0.3-0.7 GB more, and the round at most 8% shorter (page faults, by machine).
            The same values.
        release_frozen_weights: ``AlignModule``'s, here on by default, with or without ``mmap_activations`` (CPU,
            Linux): the teacher's weights mapped from its files leave the resident set once its forward is done
            (``host_memory.release_mapped``; ~0.4 GB of the peak on SmolLM2-135M). The same values.
        reward_funcs: optional here: with them, rounds and validation are scored and logged (``train/reward``,
            ``val/reward``) to watch the task; they never enter the loss.
    """

    rewards_required = False
    grouped = False
    resume_may_change = ("teacher_tokenizer_check",)  # a check before training, not what is computed

    def __init__(self, model: str = "builtin:tiny", teacher_model: str | dict[str, str] | None = None,
                 teacher_model_init_kwargs: dict | None = None, teacher_id_column: str = TEACHER_ID,
                 teacher_tokenizer_check: bool = True, beta: float = 1.0, lmbda: float = 1.0, seq_kd: bool = False,
                 teacher_topk_cache: int | None = None, num_generations: int = 1, disable_dropout: bool = False,
                 mmap_activations: bool = True, release_frozen_weights: bool | None = True, **kwargs):
        check_distillation(teacher_model, beta, lmbda, seq_kd, teacher_topk_cache, kwargs)
        super().__init__(model=model, num_generations=num_generations, beta=0.0, disable_dropout=disable_dropout,
                         mmap_activations=mmap_activations, release_frozen_weights=release_frozen_weights, **kwargs)
        self.beta, self.lmbda, self.seq_kd = beta, lmbda, seq_kd
        self.teachers = Teachers(teacher_model, teacher_model_init_kwargs, teacher_id_column)
        self.teacher_tokenizer_check = teacher_tokenizer_check
        self.teacher_topk = None if teacher_topk_cache is None else TeacherTopK(teacher_topk_cache)

    @property
    def teacher(self) -> Teacher:
        """The teacher of a one-teacher run (``teachers`` holds every teacher by id)."""
        return self.teachers.single

    def validation_metrics(self) -> torch.nn.ModuleDict:
        """``OnlineModule``'s, and ``val/loss``: the held-out divergence."""
        metrics = super().validation_metrics()
        metrics["loss"] = MeanMetric()
        return metrics

    def data_settings(self) -> dict:
        """The data tokenizes the rows' ``completion`` column when some rounds train on it."""
        return {**super().data_settings(), "dataset_completions": self.dataset_completions}

    def setup(self, stage: str) -> None:
        """Before anything trains: the teachers' tokenizers against the student's (``Teachers.check_tokenizers``)
        and the rows (``check_completions``, ``Teachers.check_rows``: a round that meets a bad row could come hours
        in); then with ``teacher_topk_cache`` the training rows get their completions' teacher top-k (Lightning sets
        the DataModule up first; ``AlignModule.setup`` connects it), handed model -> data."""
        super().setup(stage)
        remote = self.hparams.trust_remote_code
        if self.teacher_tokenizer_check:  # (before any teacher loads: the tokenizers are all it needs)
            student = self.tokenizer or load_tokenizer(self.model_name, remote)
            self.teachers.check_tokenizers(student, self.model_name, remote)
        datamodule = self.trainer.datamodule
        if not isinstance(datamodule, PromptDataModule):
            return
        train, source = datamodule.train_data if stage == "fit" else None, datamodule.path or "data.mixture"
        if train is not None and self.dataset_completions:
            check_completions(train, source)
        for rows, where in ((train, source), (datamodule.val_data, datamodule.val_path or "validation")):
            if rows is not None:
                self.teachers.check_rows(rows, where)
        if self.teacher_topk is not None and stage == "fit":
            datamodule.add_teacher_topk(partial(self.teacher_topk.annotate, self))

    @property
    def dataset_completions(self) -> bool:
        """Whether some rounds train on the dataset's ``completion`` column."""
        return self.lmbda < 1 and not self.seq_kd

    def frozen_models(self) -> list[Reference]:
        return [*super().frozen_models(), *self.teachers.values()]

    def configure_model(self) -> None:
        if self.teachers.per_row and self._trainer is not None and sharded_strategy(self._trainer):
            raise LitAlignError("model.teacher_model: several teachers are not supported under FSDP or DeepSpeed "
                                "ZeRO-3 (each teacher runs on its own rows, so the ranks would run different teachers, "
                                "while a sharded forward needs every rank); use ddp or ZeRO-1/2")
        super().configure_model()  # the teachers are loaded with the policy (``frozen_models``)
        for teacher in self.teachers.values():
            check_vocabularies(self.network, teacher.model, self.model_name, teacher.name, teacher.option)

    # -- the round: whose completions, and nothing else to compute --------------------------------------------------
    def round_source(self, ahead: int = 0) -> str:
        """Where this round's (or the one ``ahead`` rounds later) completions come from: the student with
        probability ``lmbda``, else the teacher (``seq_kd``) or the dataset. One draw per round from a generator
        seeded by the run's seed and the round's number (both in checkpoints: a resume draws what the uninterrupted
        run drew), rank 0's on every rank."""
        seed = (self.generation_seed + 1_000_003 * (self.generation_rounds + ahead) + COIN_SALT) % 2**63
        draw = float(torch.rand((), generator=torch.Generator().manual_seed(seed)))
        if self.trainer.strategy.broadcast(draw) < self.lmbda:
            return "student"
        return "teacher" if self.seq_kd else "dataset"

    def policy_samples(self, ahead: int) -> bool:
        """With ``async_rollouts`` the producer samples the student's rounds only."""
        return self.round_source(ahead) == "student"

    @torch.no_grad()
    def make_round(self, batch: dict[str, Any]) -> GenerationRound:
        """The round's completions from its source (``round_source``), scored by the reward functions if any, with
        TRL's rollout metrics, ``on_policy`` (1: the student's samples), under ``seq_kd`` ``teacher_sampled``, and
        ``num_tokens`` (prompt and completion tokens trained on so far, all ranks). With several teachers each row's
        teacher id goes into the round (its ``extra``: checkpointed with it, shown by ``CompletionsLogger``). A round of
        the dataset's completions under ``teacher_topk_cache`` carries their cached teacher top-k."""
        source, num = self.round_source(), self.round_shape.num_generations
        ids = self.teachers.row_ids(batch)  # checked before anything is sampled
        if source == "dataset":
            gen = self.dataset_generation(batch)
        elif source == "teacher":
            gen = self.teacher_generation(batch, ids, num)
        else:
            gen = self.sample_round(batch)
        if ids is not None:
            gen.columns[TEACHER_ID] = repeat_each(ids, num)
        round = self.assemble_round(batch, gen, gen)
        if source == "dataset" and self.teacher_topk is not None:
            round.teacher_topk_ids, round.teacher_topk_logps = round_topk(batch, num, self.max_completion_length,
                                                                          self.teacher_topk.k, self.device)
        round.stats["on_policy"] = torch.tensor(float(source == "student"), device=self.device)
        if self.seq_kd:
            round.stats["teacher_sampled"] = torch.tensor(float(source == "teacher"), device=self.device)
        return round

    def teacher_generation(self, batch: dict[str, Any], ids: list[str] | None, num: int) -> Generation:
        """``seq_kd``'s round: the teacher's samples. With several teachers (``ids``: each prompt's) each prompt's
        completions come from its own: the prompts grouped by teacher, each group sampled from its own seed, the
        rows put back in the batch's order."""
        seed = self.round_seed()
        if ids is None:
            return self.rollouts.generate(self, batch, num, seed=seed, model=self.teacher.model)
        parts, order, place = [], [], {teacher_id: k for k, teacher_id in enumerate(self.teachers)}
        for teacher_id, prompts in self.teachers.rows_by_teacher(ids).items():
            part_seed, model = (seed + 104_729 * place[teacher_id]) % 2**63, self.teachers[teacher_id].model
            parts.append(self.rollouts.generate(self, batch_rows(batch, prompts), num, seed=part_seed, model=model))
            order += prompts
        gen = Generation.concat(parts) if len(parts) > 1 else parts[0]
        position = {prompt: i for i, prompt in enumerate(order)}
        return gen.select([position[p] * num + j for p in range(len(ids)) for j in range(num)])

    def dataset_generation(self, batch: dict[str, Any]) -> Generation:
        """The round of the dataset's completions (the data's ``completion_ids``), each prompt's ``num_generations``
        times, cut to ``max_completion_length`` (a cut one counts as truncated)."""
        if "completion_ids" not in batch:
            raise LitAlignError("model.lmbda < 1: this round trains on the dataset's completions (its coin came up "
                                "off-policy and model.seq_kd is false), but the prompt rows have no 'completion' "
                                "column; give each row its 'completion' (as SFT rows have), or set model.seq_kd: true "
                                "(the teacher samples them) or model.lmbda: 1.0 (every round on-policy)")
        num, limit, pad = self.round_shape.num_generations, self.max_completion_length, self.tokenizer.pad_token_id
        rows = repeat_each(batch["completion_ids"], num)
        ids = [torch.tensor(row[:limit], dtype=torch.long) for row in rows]
        rollout = Rollout(pad_sequence(ids, batch_first=True, padding_value=pad).to(self.device),
                          pad_sequence([torch.ones_like(i) for i in ids], batch_first=True).to(self.device),
                          torch.tensor([len(row) > limit for row in rows], device=self.device))
        completions = repeat_each(batch["columns"]["completion"], num)
        return self.rollouts.scored(self, batch, rollout, repeat_each(batch["prompts"], num), completions, num)

    def old_logps(self, generation: Generation, sequences: tuple) -> tuple[None, None, dict]:
        """None: the divergence reads no sampling-time log-probs."""
        return None, None, {}

    def advantages(self, generation: Generation, old_logps, ref_logps, loss_mask) -> torch.Tensor:
        """Zeros: distillation has none (the round keeps the field)."""
        return torch.zeros(len(generation.rewards), device=self.device)

    # -- what is computed ----------------------------------------------------------------------------------------------
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Any] | None:
        step = self.next_step(batch)
        sequences = (step.prompt_ids, step.prompt_mask, step.completion_ids, step.completion_mask)
        teacher_ids = step.extra[TEACHER_ID] if self.teachers.per_row else None
        cached = None if step.teacher_topk_ids is None else TopK(step.teacher_topk_ids, step.teacher_topk_logps)
        divergence, entropy = self.divergence(sequences, step.loss_mask, teacher_ids, with_entropy=True,
                                              cached=cached)
        # the sum over the step's loss tokens, divided by the round's loss tokens per step on every rank (dapo's)
        loss = divergence.sum() / max(self.round.num_tokens, 1.0)
        loss = self.guard_loss(loss, divergence.sum(1), batch_idx, step.dataset_rows)
        if loss is None:  # skipped (on_nonfinite_loss: skip)
            return None
        self.log_step(loss, entropy, {}, step.loss_mask)
        if teacher_ids is not None:
            self.log_teacher_losses(divergence, step.loss_mask, teacher_ids)
        return {"loss": loss, "step": step}  # callbacks see the step's batch (outputs)

    def divergence(self, sequences: tuple, loss_mask: torch.Tensor, teacher_ids: list[str] | None = None,
                   with_entropy: bool = False, cached: TopK | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[n, C]``: the per-token divergence of the completions ``sequences`` (prompt ids and mask, completion ids
        and mask) at every loss token, 0 elsewhere (the student's gradient with it), each row's from its teacher
        (``teacher_ids``; None: the one teacher), or from the teacher's ``cached`` top-k ``[n, C, k]`` (no teacher
        forward); with ``with_entropy`` the student's tempered entropy there too (no gradient). The teachers run
        first: their forwards' temporaries come and go before the student's activations are held for backward."""
        scored = sequences[3].bool()  # the completion tokens: the outputs come in their order
        trained = loss_mask.bool()[scored]
        if cached is not None:
            teachers = [(None, TopK(cached.ids[scored], cached.logps[scored]))]
        else:
            teachers = self.teacher_outputs(sequences, teacher_ids)
        student = self.outputs(self.network, sequences)
        entropy = None
        if len(teachers) == 1 and teachers[0][0] is None:
            per_token, entropy = self.token_divergence(student, teachers[0][1], trained, with_entropy)
        else:  # each teacher's tokens: the student's outputs there (indexing keeps their gradient), back in order
            values = torch.cat([self.token_divergence(tokens_of(student, tokens), teacher, trained[tokens])[0]
                                for tokens, teacher in teachers])
            places = torch.cat([tokens for tokens, _ in teachers])
            per_token = values.new_zeros(len(trained)).index_put((places,), values)
        values = on_grid(per_token, scored)
        if not with_entropy:
            return values, None
        if entropy is None:  # a path that does not make it on the way: the student's head once more
            entropy = student_entropy(student, sequences[2][scored], self.temperature) * trained
        return values, on_grid(entropy, scored)

    @torch.no_grad()
    def teacher_outputs(self, sequences: tuple, teacher_ids: list[str] | None) -> list[tuple]:
        """``[(tokens, outputs)]``: the teachers' outputs at the scored tokens (``outputs``), each teacher's at its
        own rows' tokens ``tokens`` (their places in the scored tokens' order; None: the one teacher, at all of
        them). With several teachers each runs on its own rows only."""
        if teacher_ids is None:
            parts = [(None, self.outputs(self.teacher.model, sequences))]
            # its files' pages out of the student's forward (its head's come back for the divergence)
            self.release_mapped(self.teacher.model)
            return parts
        token_rows = sequences[3].bool().nonzero()[:, 0]  # each scored token's row, in the outputs' order
        parts = []
        for teacher_id, rows in self.teachers.rows_by_teacher(teacher_ids).items():
            rows = torch.tensor(rows, device=token_rows.device)
            tokens = torch.isin(token_rows, rows).nonzero()[:, 0]  # rows ascending: the teacher's outputs' order
            model = self.teachers[teacher_id].model
            parts.append((tokens, self.outputs(model, tuple(s[rows] for s in sequences))))
            self.release_mapped(model)
        return parts

    def outputs(self, network, sequences: tuple) -> Projection | torch.Tensor:
        """``network``'s hidden states and head (or logits) at the completion tokens, laid out as the student's
        log-probs are (``padding_free``)."""
        return layout_outputs(network, layouts.completions(*sequences, self.padding_free, network))

    def token_divergence(self, student: Projection | torch.Tensor, teacher: Projection | torch.Tensor | TopK,
                         mask: torch.Tensor, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[S]`` per-token divergence at the ``mask`` tokens (0 elsewhere) from the teacher's outputs or its
        top-k (``TopK``, ``[S, k]``): chunked through the student's head, or from full logits where its head is not
        chunkable; with ``with_entropy``, the student's tempered entropy there too where the chunked full divergence
        makes it on the way (else None)."""
        settings = {"mask": mask, "beta": self.beta, "temperature": self.temperature, "reduction": "none"}
        if isinstance(teacher, TopK):
            plain, chunked = topk_generalized_jsd, chunked_topk_generalized_jsd
            teacher_args = (teacher.logps, teacher.ids)
        else:
            plain, chunked, teacher_args = generalized_jsd, chunked_generalized_jsd, (teacher,)
        if not isinstance(student, Projection):
            teacher_args = [t.logits() if isinstance(t, Projection) else t for t in teacher_args]
            return plain(student, *teacher_args, **settings), None
        fp32 = getattr(self.network.get_output_embeddings(), "fp32_matmul", False)  # cast_lm_head_to_fp32
        with torch.autocast(self.device.type, enabled=False) if fp32 else nullcontext():
            if chunked is chunked_generalized_jsd and with_entropy:
                return chunked(student, *teacher_args, **settings, with_entropy=True)
            return chunked(student, *teacher_args, **settings), None

    def log_teacher_losses(self, divergence: torch.Tensor, loss_mask: torch.Tensor, teacher_ids: list[str]) -> None:
        """``train/teacher/<id>/loss``: each teacher's mean per-token divergence over its rows' loss tokens in the
        step, all ranks; a teacher with no rows in the step logs nothing then."""
        names, rows = list(self.teachers), self.teachers.rows_by_teacher(teacher_ids)
        sums = torch.zeros(len(names), 2, device=divergence.device)  # every teacher: the same shape on every rank
        for i, teacher_id in enumerate(names):
            mine = rows.get(teacher_id, [])
            sums[i] = torch.stack([divergence.detach()[mine].sum(), loss_mask[mine].sum().float()])
        sums = self.trainer.strategy.reduce(sums, reduce_op="sum")
        self.log_mean({f"teacher/{teacher_id}/loss": total / tokens
                       for teacher_id, (total, tokens) in zip(names, sums) if tokens > 0})

    # -- held-out divergence (and reward) -----------------------------------------------------------------------------
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        """``val/loss``: the divergence over the held-out prompts' completions (one greedy each, or
        ``num_generations_eval`` sampled), per token, each row's from its teacher; with reward functions
        ``OnlineModule``'s ``val/reward``."""
        ids = self.teachers.row_ids(batch)
        gen = self.val_generation(batch)
        if self.rollouts.reward_funcs:
            self.log_val_rewards(gen)
        sequences = (gen.prompt_ids, gen.prompt_mask, gen.completion_ids, gen.completion_mask)
        teacher_ids = None if ids is None else repeat_each(ids, self.num_generations_eval or 1)
        divergence, _ = self.divergence(sequences, gen.sampled_mask, teacher_ids)
        tokens = gen.sampled_mask.sum()
        self.val_metrics["loss"].update(divergence.sum() / tokens.clamp(min=1), weight=tokens)
        self.log("val/loss", self.val_metrics["loss"], prog_bar=True)

    test_step = validation_step


def tokens_of(outputs: Projection | torch.Tensor, tokens: torch.Tensor) -> Projection | torch.Tensor:
    """``layout_outputs``' outputs ``[S, ...]`` at the positions ``tokens`` (differentiable)."""
    if isinstance(outputs, Projection):
        return outputs._replace(hidden=outputs.hidden[tokens])
    return outputs[tokens]


def on_grid(values: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """``[S]`` values of the ``scored`` positions (row by row) on their ``[n, C]`` grid, 0 elsewhere (differentiable
    in ``values``)."""
    return torch.zeros(scored.shape, dtype=values.dtype, device=values.device).masked_scatter(scored, values)


@torch.no_grad()
def student_entropy(student: Projection | torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    """``[S]`` the entropy of the student's tempered next-token distribution at each position (TRL's ``entropy``
    metric), through its head chunk by chunk, or from its logits."""
    if isinstance(student, Projection):
        return chunked_token_logps(student.hidden.detach(), student.weight.detach(), labels, student.bias,
                                   scale=student.scale / temperature, stats=("entropy",))[1]["entropy"]
    return plain_token_stats(student.detach() / temperature, ("entropy",))["entropy"]
