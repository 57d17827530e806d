"""Distillation's teachers: one, or several chosen row by row (``lit_align.modules.distill``).

``model.teacher_model`` is one model source (TRL's), or a mapping ``{teacher_id: source}``: each prompt row then
names its teacher in a column (``teacher_id``, TRL-style; ``model.teacher_id_column``), and that prompt's
completions are compared with that teacher's distributions (and, under ``seq_kd``, sampled by it); the round keeps
each completion's id in its ``teacher_id`` column (``GenerationRound.extra``). ``Teachers`` holds them: a
``ModuleDict`` of ``lit_align.reference.Teacher``, each loaded once with the policy, frozen, checked against the
student's vocabulary, its files' identity under its own checkpoint entry (``lit_align_teacher/<teacher_id>``; one
teacher keeps ``lit_align_teacher``). It answers which teacher each prompt of a batch has (``row_ids``, checked
there, once per round) and which rows each teacher has (``rows_by_teacher``, in the mapping's order).

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

import torch

from lit_align.errors import LitAlignError
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

    def row_ids(self, batch: dict[str, Any]) -> list[str] | None:
        """Each prompt's teacher id (the batch's ``column``), every one checked against the known ids; None with one
        teacher (the column, if the rows have one, is not read)."""
        if not self.per_row:
            return None
        known = sorted(self)
        if self.column not in batch["columns"]:
            raise LitAlignError(f"model.teacher_model is a mapping of teachers ({known}), but the prompt rows have no "
                                f"{self.column!r} column: give each row the id of the teacher it learns from "
                                "(model.teacher_id_column names the column)")
        ids, dataset_rows = batch["columns"][self.column], batch.get("dataset_rows")
        for i, teacher_id in enumerate(ids):
            if not isinstance(teacher_id, str) or teacher_id not in self:
                place = f"dataset row {dataset_rows[i]}" if dataset_rows is not None else f"prompt {i} of the batch"
                raise LitAlignError(f"{place}: field {self.column!r} is {teacher_id!r}, expected one of {known} "
                                    "(the ids of model.teacher_model)")
        return list(ids)

    def rows_by_teacher(self, ids: list[str]) -> dict[str, list[int]]:
        """``{teacher_id: its rows}`` for the teachers ``ids`` (one per row) name, in ``teacher_model``'s order (the
        same whatever the rows' order), rows ascending."""
        return {teacher_id: rows for teacher_id in self if (rows := [r for r, i in enumerate(ids) if i == teacher_id])}
