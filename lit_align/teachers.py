"""Distillation's teachers: one, or several chosen row by row (``lit_align.modules.distill``).

``model.teacher_model`` is one model source (TRL's), or a mapping ``{teacher_id: source}``: each prompt row then
names its teacher in a column (``teacher_id``, TRL-style; ``model.teacher_id_column``), and that prompt's
completions are compared with that teacher's distributions (and, under ``seq_kd``, sampled by it); the round keeps
each completion's id in its ``teacher_id`` column (``GenerationRound.extra``). ``Teachers`` holds them: a
``ModuleDict`` of ``lit_align.reference.Teacher``, each loaded once with the policy, frozen, checked against the
student's vocabulary and tokenizer (``check_token_ids``), its files' identity under its own checkpoint entry
(``lit_align_teacher/<teacher_id>``; one teacher keeps ``lit_align_teacher``). It answers which teacher each prompt
of a batch has (``row_ids``, checked there, once per round, and for the whole dataset before training:
``check_rows``) and which rows each teacher has (``rows_by_teacher``, in the mapping's order).

With a mapping, ``teacher_model_init_kwargs`` is keyed by teacher id too, ``{teacher_id: {from_pretrained
arguments}}`` (an id left out gets none): teachers differ (a revision, a quantization of one of them), and one
mapping meant for all could not be told apart from one keyed by ids. Left out, and why: sharing one loaded model
between two ids of the same source (name it once), a default teacher for rows without an id (an unlabelled row
is more likely a data mistake than a wish), and sharded teachers (FSDP, DeepSpeed ZeRO-3: each teacher runs on its
own rows, and which teachers a step needs differs between ranks, while a sharded forward needs every rank; refused
by ``DistillationModule``).
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import torch
from lightning.pytorch.utilities import rank_zero_warn

from lit_align.errors import LitAlignError
from lit_align.models import load_tokenizer
from lit_align.reference import Teacher

SINGLE = "teacher"  # the one teacher's key when ``teacher_model`` is one source
TEACHER_ID = "teacher_id"  # the column naming a row's teacher: the prompt rows' (by default) and the round's


def check_teacher_ids(teacher_model: dict, init_kwargs: dict | None) -> None:
    """Refuse a mapping of teachers whose ids cannot name a checkpoint entry and a metric, a source that is not one
    model's, and ``teacher_model_init_kwargs`` that are not keyed by those ids."""
    for teacher_id, source in teacher_model.items():
        if not isinstance(teacher_id, str) or not teacher_id or "." in teacher_id or "/" in teacher_id:
            raise LitAlignError(f"model.teacher_model: teacher id {teacher_id!r} must be a non-empty string without "
                                "'.' or '/' (it names the teacher's checkpoint entry and its train/teacher/<id>/loss)")
        if not isinstance(source, str):
            raise LitAlignError(f"model.teacher_model.{teacher_id}: expected one model source (a hub name, a "
                                f"directory, a .gguf file, pretrained:<name> or builtin:<name>), got {source!r}")
    unknown = sorted(map(str, set(init_kwargs or {}) - set(teacher_model)))
    if unknown:
        raise LitAlignError(f"model.teacher_model_init_kwargs: with a mapping of teachers its keys are teacher ids "
                            f"({sorted(teacher_model)}), got {unknown}; give each teacher its own from_pretrained "
                            f"arguments, e.g. {{{next(iter(teacher_model))}: {{revision: main}}}}")


def token_table(tokenizer) -> list[str | None]:
    """Each id's token, id by id (special and added tokens included); None for an id without one."""
    vocab = tokenizer.get_vocab()
    table: list[str | None] = [None] * (max(vocab.values(), default=-1) + 1)
    for token, i in vocab.items():
        table[i] = token
    return table


def check_token_ids(student_tokenizer, teacher: Teacher, student_name: str, trust_remote_code: bool = False) -> None:
    """Refuse a teacher whose tokenizer numbers its tokens apart from the student's: the divergence compares the two
    next-token distributions id by id, and two vocabularies of one size (all TRL compares) can hold other tokens at
    an id. The id -> token tables are compared whole, special tokens included (which of them each calls its EOS may
    differ: an instruct teacher ends turns with its chat template's token); the line names the first ids that
    differ. A teacher without a tokenizer to compare (model files alone) is one warning."""
    path = teacher.check_source()
    try:
        theirs = token_table(load_tokenizer(path, trust_remote_code))
    except LitAlignError as error:
        rank_zero_warn(f"lit_align: {teacher.option} {teacher.name!r}: its token ids cannot be compared with the "
                       f"student's ({error}); they are taken to be the student's (model.teacher_tokenizer_check: "
                       "false skips the comparison)")
        return
    mine = token_table(student_tokenizer)
    if theirs == mine:
        return
    width = max(len(mine), len(theirs))
    token = lambda table, i: table[i] if i < len(table) else None  # noqa: E731
    differ = [i for i in range(width) if token(mine, i) != token(theirs, i)]
    first = ", ".join(f"id {i} is {token(theirs, i)!r} / {token(mine, i)!r}" for i in differ[:3])
    raise LitAlignError(f"{teacher.option} {teacher.name!r} numbers its tokens apart from the student "
                        f"{student_name!r}: {len(differ)} of {width} ids differ ({first}, teacher's / student's "
                        "token); distillation compares the two distributions id by id, so the student would learn "
                        "from shuffled tokens: use a teacher with the student's tokenizer, or set "
                        "model.teacher_tokenizer_check: false if these ids mean the same tokens to both models")


class Teachers(torch.nn.ModuleDict):
    """The run's teachers by id (one: under ``SINGLE``), and which one each prompt row learns from.

    Args:
        teacher_model: one model source, or a mapping ``{teacher_id: source}`` (rows then choose by ``column``).
        init_kwargs: ``from_pretrained`` arguments: for the one teacher, or keyed by teacher id.
        column: the prompt rows' column naming their teacher (read only with a mapping).
    """

    def __init__(self, teacher_model: str | dict[str, str], init_kwargs: dict | None = None,
                 column: str = TEACHER_ID):
        if isinstance(teacher_model, dict):
            check_teacher_ids(teacher_model, init_kwargs)
            kwargs = init_kwargs or {}
            teachers = {i: Teacher(source, kwargs.get(i), i) for i, source in teacher_model.items()}
        else:
            teachers = {SINGLE: Teacher(teacher_model, init_kwargs)}
        super().__init__(teachers)
        self.column = column if isinstance(teacher_model, dict) else None  # None: the one teacher for every row

    @property
    def per_row(self) -> bool:
        """Whether each row chooses its teacher (``teacher_model`` a mapping)."""
        return self.column is not None

    @property
    def single(self) -> Teacher:
        """The teacher of a one-teacher run."""
        if self.per_row:
            raise LitAlignError(f"model.teacher_model names teachers {sorted(self)}: pick one by its id")
        return self[SINGLE]

    def check_tokenizers(self, student_tokenizer, student_name: str, trust_remote_code: bool = False) -> None:
        """Each teacher's tokenizer against the student's (``check_token_ids``)."""
        for teacher in self.values():
            check_token_ids(student_tokenizer, teacher, student_name, trust_remote_code)

    def check_rows(self, rows, source: str) -> None:
        """Every row of ``rows`` (a dataset, from ``source``) names a teacher, checked before training: a bad id near
        the end of a large dataset would otherwise surface hours in (``row_ids`` checks each batch again)."""
        if not self.per_row:
            return
        if self.column not in rows.column_names:
            raise LitAlignError(self.no_column(f"the rows of {source}"))
        ids = rows.with_format("arrow")[self.column]  # (Arrow: a million rows in milliseconds)
        if pa.types.is_string(ids.type) or pa.types.is_large_string(ids.type):
            named = pc.fill_null(pc.is_in(ids, value_set=pa.array(list(self), ids.type)), False)
            first = pc.index(named, False).as_py()  # the first row that names no teacher, -1: none
        else:
            first = 0  # numbers, say: not ids
        if first >= 0:
            raise LitAlignError(self.unknown_id(ids[first].as_py(), f"{source} row {first}"))

    def row_ids(self, batch: dict[str, Any]) -> list[str] | None:
        """Each prompt's teacher id (the batch's ``column``), every one checked against the known ids; None with one
        teacher (the column, if the rows have one, is not read)."""
        if not self.per_row:
            return None
        if self.column not in batch["columns"]:
            raise LitAlignError(self.no_column("the prompt rows"))
        ids, dataset_rows = batch["columns"][self.column], batch.get("dataset_rows")
        for i, teacher_id in enumerate(ids):
            if not isinstance(teacher_id, str) or teacher_id not in self:
                place = f"dataset row {dataset_rows[i]}" if dataset_rows is not None else f"prompt {i} of the batch"
                raise LitAlignError(self.unknown_id(teacher_id, place))
        return list(ids)

    def no_column(self, rows: str) -> str:
        return (f"model.teacher_model is a mapping of teachers ({sorted(self)}), but {rows} have no {self.column!r} "
                "column: give each row the id of the teacher it learns from (model.teacher_id_column names the "
                "column)")

    def unknown_id(self, teacher_id: Any, place: str) -> str:
        """The line for a row (``place``) whose ``teacher_id`` names no teacher; a number says ids are strings."""
        known = sorted(self)
        if isinstance(teacher_id, (int, float)) and not isinstance(teacher_id, bool):
            fix = f": write {str(teacher_id)!r}" if str(teacher_id) in self else ""
            return (f"{place}: field {self.column!r} is the number {teacher_id}, but teacher ids are strings (the "
                    f"keys of model.teacher_model: {known}){fix}")
        return (f"{place}: field {self.column!r} is {teacher_id!r}, expected one of {known} (the ids of "
                "model.teacher_model)")

    def rows_by_teacher(self, ids: list[str]) -> dict[str, list[int]]:
        """``{teacher_id: its rows}`` for the teachers ``ids`` (one per row) name, in ``teacher_model``'s order (the
        same whatever the rows' order), rows ascending."""
        return {teacher_id: rows for teacher_id in self if (rows := [r for r, i in enumerate(ids) if i == teacher_id])}
