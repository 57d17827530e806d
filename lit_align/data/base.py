"""What every lit_align DataModule shares: where the rows come from, which tokenizer, how batches are loaded."""

from __future__ import annotations

import inspect
import itertools
from dataclasses import asdict, dataclass
from collections.abc import Iterator
from typing import Any

import datasets
import lightning as L
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, DistributedSampler

from lit_align.data.rows import check_chat_template, check_template_kwargs
from lit_align.data.sources import (
    SINGLE_FILE_SPLIT, MissingSplit, check_mixture, common_features, is_single_file, load_rows,
)
from lit_align.errors import LitAlignError
from lit_align.models import load_tokenizer


class ResumableLoader(DataLoader):
    """A training DataLoader that Lightning can resume mid-epoch.

    Lightning stores a loader's ``state_dict()`` in each checkpoint when it has one and hands it back through
    ``load_state_dict`` before iterating again; a plain DataLoader would restart the interrupted epoch from its first
    batch (Lightning only warns). The state is the epoch and how many batches of it were trained on (the trainer's
    own count, so prefetched batches do not count); on resume the sampler skips those rows without loading them.
    The sampler must replay the same order: a ``DistributedSampler`` (seeded per epoch) or a subclass of it. That
    the batches are the checkpoint run's is ``AlignDataModule.load_state_dict``'s check.
    """

    def __init__(self, *args, trainer: L.Trainer | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.trainer = trainer
        self._resume: dict[str, int] | None = None

    def state_dict(self) -> dict:
        if self.trainer is None:
            return {"epoch": 0, "batches": 0}
        done = self.trainer.fit_loop.epoch_loop.batch_progress.current.processed
        if done >= self.trainer.num_training_batches:  # the epoch is over (``limit_train_batches`` counts too)
            return {"epoch": self.trainer.current_epoch + 1, "batches": 0}
        return {"epoch": self.trainer.current_epoch, "batches": done}

    def load_state_dict(self, state: dict) -> None:
        self._resume = dict(state)

    def __iter__(self) -> Iterator:
        if self._resume is not None:
            epoch, batches = self._resume["epoch"], self._resume["batches"]
            self._resume = None
            if batches >= len(self):  # saved at the end of an epoch: the next one starts from its beginning
                epoch, batches = epoch + 1, 0
            self.sampler.set_epoch(epoch)  # Lightning sets it only after this first iteration has begun
            self.sampler.skip = batches * self.batch_size
        return super().__iter__()


class SkippingSampler(DistributedSampler):
    """``DistributedSampler`` whose next iteration can start ``skip`` items in (set by ``ResumableLoader``).
    Subclasses that yield something else override ``_items``."""

    skip = 0

    def __iter__(self) -> Iterator:
        skip, self.skip = self.skip, 0
        return itertools.islice(self._items(), skip, None)

    def _items(self) -> Iterator:
        return super().__iter__()


MIXTURE_STRATEGIES = ("concatenate", "interleave")
HELD_OUT = "held-out"  # ``AlignDataModule.validation``: the validation rows are ``val_fraction`` of the training rows
# what to set for validation rows (or for none), where a source has no such split
VAL_OPTIONS = ("for validation set data.val_fraction (a held-out fraction of the training rows, e.g. 0.1) or "
               "data.val_path (a separate file); for none, data.val_split: null")

# Data settings a resume may change: how rows are loaded or validated, not which rows train in which batches.
RESUME_MAY_CHANGE = ("num_workers", "num_proc", "val_split", "val_path", "val_batch_size")
SETTING_ATTRIBUTES = {"tokenizer": "tokenizer_name"}  # settings kept under another attribute name


def first_difference(name: str, now: Any, saved: Any) -> tuple[str, Any, Any] | None:
    """Where two setting values first differ, as ``(name, value, saved value)``, descending into lists of the same
    length and mappings of the same keys (``data.mixture[1].weight``); None where they agree."""
    if isinstance(now, dict) and isinstance(saved, dict) and now.keys() == saved.keys():
        parts = [(f"{name}.{key}", now[key], saved[key]) for key in now]
    elif isinstance(now, list) and isinstance(saved, list) and len(now) == len(saved):
        parts = [(f"{name}[{i}]", a, b) for i, (a, b) in enumerate(zip(now, saved))]
    else:
        return None if now == saved else (name, now, saved)
    return next(filter(None, (first_difference(*part) for part in parts)), None)


@dataclass
class DataSource:
    """One source of a ``data.mixture``.

    Args:
        path: ``builtin:<task>``, a local file, or a ``datasets`` hub name.
        split: its split.
        config_name: its configuration (hub datasets with several).
        rename_columns: its columns renamed to the names lit_align reads, e.g. ``{question: prompt}``.
        weight: its share when the mixture is interleaved.
        fraction: keep this share of the source's rows, the first after a shuffle seeded by ``data.seed`` (as
            alignment-handbook's and open-r1's mixture weights keep them); 1: every row.
        columns: keep only these columns of the source (TRL's ``DatasetConfig.columns``), e.g. ``[chosen,
            rejected]`` to read pairs whose conversations hold their prompt; None: every column.
    """

    path: str
    split: str = "train"
    config_name: str | None = None
    rename_columns: dict[str, str] | None = None
    weight: float = 1.0
    fraction: float = 1.0
    columns: list[str] | None = None


class AlignDataModule(L.LightningDataModule):
    """Base class: loads train/validation rows, tokenizes them once, serves them in batches.

    Each subclass declares its own ``max_length``: its default, what it cuts and which end it keeps
    (``lit_align.data.rows`` has the table).

    Args:
        path: ``builtin:<task>``, a local ``.json``/``.jsonl``/``.csv``/``.parquet`` file, or a ``datasets`` hub name.
        config_name: the hub dataset's configuration, if it has several.
        train_split: split to train on.
        val_split: split to validate on; None for no validation. A single file has one split, ``train``: with
            another ``val_split`` (the shipped configs' ``test``), ``fit`` trains on every row of it without
            validation (as TRL with its defaults), ``validate`` reads it whole; one line says so.
        val_path: read validation rows from this source instead of ``path`` (its split ``val_split``, or all of it
            for a single file).
        val_fraction: hold out this fraction of the train split for validation instead (seeded; overrides
            ``val_split``); a whole number from 1 up holds out that many rows (``datasets``' ``test_size``, TRL's
            ``test_split_size``).
        tokenizer: tokenizer to use; None: the model's (the module hands it over: ``connect``).
        batch_size: rows per device per step.
        val_batch_size: rows per device per validation step (default: ``batch_size``).
        num_workers: DataLoader worker processes.
        seed: seed of the held-out split and of the training order.
        rename_columns: rename source columns to the names lit_align reads, e.g. ``{question: prompt}``.
        shuffle: shuffle the training rows each epoch (off: file order, e.g. to compare runs row for row).
        chat_template: render conversations with this chat template instead of the tokenizer's: a Jinja file or the
            template itself (TRL's ``chat_template_path``). With ``lit-align`` it follows ``model.chat_template``,
            so the exported tokenizer carries it too.
        chat_template_kwargs: more arguments for the chat template, e.g. ``{enable_thinking: false}``; a row's
            ``tools`` column is passed along too.
        mixture: train on several sources instead of ``path``: a list of ``{path, split, config_name,
            rename_columns, weight}`` (``DataSource``). Each is checked and tokenized on its own (errors name it),
            then they are combined by ``mixture_strategy``. Validation rows come from ``val_path`` or
            ``val_fraction`` (held out of the mixture).
        mixture_strategy: ``concatenate`` (every row of every source, in order; the loader shuffles) or
            ``interleave`` (sources drawn by ``weight``, seeded by ``seed``, until the first runs out:
            ``datasets.interleave_datasets``). Either way the rows are a fixed dataset, so a resume mid-epoch is
            exact.
    """

    kind = ""  # which rows a built-in task must produce: "preference", "prompt" or "completion"
    eos_token: str | None = None  # the tokenizer's EOS replaced (CompletionDataModule's option, SFT's eos_token)

    def __init__(
        self,
        path: str = "builtin:sort",
        config_name: str | None = None,
        train_split: str = "train",
        val_split: str | None = "test",
        val_path: str | None = None,
        val_fraction: float = 0.0,
        tokenizer: str | None = None,
        batch_size: int = 8,
        val_batch_size: int | None = None,
        num_workers: int = 0,
        seed: int = 0,
        shuffle: bool = True,
        rename_columns: dict[str, str] | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: dict | None = None,
        mixture: list[DataSource] | None = None,
        mixture_strategy: str = "concatenate",
    ):
        super().__init__()
        if batch_size < 1:
            raise LitAlignError(f"data.batch_size must be >= 1, got {batch_size}")
        if val_batch_size is not None and val_batch_size < 1:
            raise LitAlignError(f"data.val_batch_size must be >= 1 or null, got {val_batch_size}")
        if num_workers < 0:
            raise LitAlignError(f"data.num_workers must be >= 0, got {num_workers}")
        if not (0.0 <= val_fraction < 1.0 or float(val_fraction).is_integer()):
            raise LitAlignError(f"data.val_fraction must be in [0, 1) or a whole number of rows, got {val_fraction}")
        val_fraction = int(val_fraction) if val_fraction >= 1 else val_fraction  # a count of rows
        self.path, self.config_name = path, config_name
        self.train_split, self.val_split, self.val_path, self.val_fraction = train_split, val_split, val_path, val_fraction
        self.tokenizer_name = tokenizer
        self.batch_size, self.val_batch_size = batch_size, val_batch_size or batch_size
        self.num_workers, self.seed, self.shuffle = num_workers, seed, shuffle
        self.rename_columns = rename_columns or {}
        self.chat_template, self.chat_template_kwargs = chat_template, check_template_kwargs(chat_template_kwargs)
        self.mixture = [s if isinstance(s, DataSource) else DataSource(**s) for s in mixture or []]
        if mixture_strategy not in MIXTURE_STRATEGIES:
            raise LitAlignError(f"data.mixture_strategy {mixture_strategy!r}: expected one of {MIXTURE_STRATEGIES}")
        check_mixture(path, mixture, self.mixture)
        self.mixture_strategy = mixture_strategy
        self.tokenizer = None
        self.model_tokenizer: str | None = None  # the model's, handed over by ``connect``
        self.train_data = self.val_data = None
        self._told_no_val_split = False

    def connect(self, tokenizer: str | None = None) -> None:
        """What the data follows from the model, handed over by the module's ``setup`` (settings flow one way, model
        -> data, in this one call; the data never reads the module): the model's tokenizer, used unless
        ``data.tokenizer`` names one."""
        self.model_tokenizer = tokenizer

    # -- hooks for subclasses -----------------------------------------------------------------------------------------
    def process(self, rows, source: str):
        """Validate and tokenize raw rows; return a dataset of token ids. ``source`` names the rows in errors."""
        raise NotImplementedError

    def collate(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        raise NotImplementedError

    # -- Lightning hooks -------------------------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        validation = self.validation(stage)
        if validation is None and self.trainer is not None:
            self.trainer.limit_val_batches = 0  # no validation set: Lightning skips its loop (not an empty one)
        need_train = stage == "fit" and self.train_data is None
        need_val = self.val_data is None and validation is not None
        if not (need_train or need_val):
            return
        if self.tokenizer is None:
            name = self.tokenizer_name or self.model_tokenizer
            if name is None and self.trainer is not None:
                return  # Lightning sets the data up before the module, whose setup connects and calls this again
            if name is None:
                raise LitAlignError("data.tokenizer is not set and the model does not name one")
            self.tokenizer = load_tokenizer(name, chat_template=self.chat_template, eos_token=self.eos_token)
            check_chat_template(self.tokenizer, self.chat_template)
        if self.mixture:
            self._setup_mixture(need_train, need_val)
            return
        train_rows = val_rows = val_source = None
        if need_train or validation == HELD_OUT:
            train_rows = self._load(self.path, self.train_split, option="data.train_split")
        if validation == HELD_OUT:
            parts = train_rows.train_test_split(test_size=self.val_fraction, seed=self.seed)
            train_rows, val_rows, val_source = parts["train"], parts["test"], f"{self.path} (held-out)"
        elif need_val:
            val_source, split = validation
            val_rows = self._load(val_source, split, option="data.val_split")
        if need_train:
            self.train_data = self.process(train_rows, self.path)
            rank_zero_info(f"lit_align: {len(self.train_data)} training rows from {self.path}")
        if need_val and val_rows is not None:
            self.val_data = self.process(val_rows, val_source)

    def validation(self, stage: str) -> tuple[str, str] | str | None:
        """Where the validation rows come from: ``HELD_OUT`` (``val_fraction`` of the training rows), a ``(source,
        split)``, or None (no validation: Lightning's loop is switched off).

        A single file has one split, ``train``. As ``val_path`` it is read whole. As ``path``, with a ``val_split``
        it cannot have (the shipped configs' ``test``), there is no validation in ``fit``, as TRL trains on such a
        file with its defaults (no evaluation), and ``validate`` reads the whole file; one line says so."""
        if self.val_fraction > 0:
            return HELD_OUT
        if self.val_split is None:
            return None
        if self.val_path is not None:
            return self.val_path, SINGLE_FILE_SPLIT if is_single_file(self.val_path) else self.val_split
        if self.mixture:
            return None
        if not is_single_file(self.path) or self.val_split == SINGLE_FILE_SPLIT:
            return self.path, self.val_split
        fitting = stage == TrainerFn.FITTING
        if not self._told_no_val_split:
            self._told_no_val_split = True
            what = "no validation" if fitting else f"validating on every row of {self.path}"
            rank_zero_info(f"lit_align: {what}: {self.path} is a single file, whose one split is "
                           f"{SINGLE_FILE_SPLIT!r} (data.val_split is {self.val_split!r}); {VAL_OPTIONS}")
        return None if fitting else (self.path, SINGLE_FILE_SPLIT)

    def _setup_mixture(self, need_train: bool, need_val: bool) -> None:
        parts = []
        for i, source in enumerate(self.mixture):
            rows = self._load(source.path, source.split, f"data.mixture[{i}].split", source.config_name,
                              source.rename_columns or {})
            if source.columns is not None:
                missing = sorted(set(source.columns) - set(rows.column_names))
                if missing:
                    raise LitAlignError(f"data.mixture[{i}] ({source.path}): no column(s) {missing} to keep (it has "
                                        f"{rows.column_names})")
                rows = rows.select_columns(source.columns)
            if source.fraction < 1:
                rows = rows.shuffle(seed=self.seed).select(range(int(len(rows) * source.fraction)))
            parts.append(self.process(rows, f"{source.path} ({source.split})"))
        columns = [sorted(part.column_names) for part in parts]
        if any(c != columns[0] for c in columns):
            described = ", ".join(f"{s.path}: {c}" for s, c in zip(self.mixture, columns))
            raise LitAlignError(f"data.mixture: the sources' rows have different columns ({described}); make them "
                                "alike with each source's rename_columns")
        parts = common_features(parts)  # one set of column types, whatever the sources' order
        if self.mixture_strategy == "concatenate":
            rows = datasets.concatenate_datasets(parts)
        else:
            weights = [s.weight for s in self.mixture]
            rows = datasets.interleave_datasets(parts, probabilities=[w / sum(weights) for w in weights],
                                                seed=self.seed, stopping_strategy="first_exhausted")
        if self.val_fraction > 0:
            split = rows.train_test_split(test_size=self.val_fraction, seed=self.seed)
            rows, self.val_data = split["train"], split["test"] if need_val else None
        elif need_val and self.val_path is not None and self.val_split is not None:
            self.val_data = self.process(self._load(*self.validation("fit"), option="data.val_split"), self.val_path)
        if need_train:
            self.train_data = rows
            sizes = ", ".join(f"{s.path} {len(p)}" for s, p in zip(self.mixture, parts))
            rank_zero_info(f"lit_align: {len(rows)} training rows from a mixture ({self.mixture_strategy}: {sizes})")

    def _load(self, source: str, split: str, option: str, config_name: str | None = None,
              rename_columns: dict[str, str] | None = None):
        """``split`` of ``source``, renamed; a split it does not have is one line naming ``option``, the setting."""
        rename = self.rename_columns if rename_columns is None else rename_columns
        try:
            rows = load_rows(source, split, self.kind, config_name if config_name is not None else self.config_name)
        except MissingSplit as exc:
            fix = VAL_OPTIONS if option == "data.val_split" else f"set {option} to a split it has"
            raise LitAlignError(f"{exc} ({option} is {split!r}); {fix}") from None
        missing = sorted(set(rename) - set(rows.column_names))
        if missing:
            raise LitAlignError(f"{source}: data.rename_columns names columns it does not have: {missing} "
                                f"(columns: {rows.column_names})")
        return rows.rename_columns(rename) if rename else rows

    # -- a resume continues the checkpoint run's batches ----------------------------------------------------------------
    def settings(self) -> dict[str, Any]:
        """Every constructor setting of this class and its bases, by its ``data.`` name, as plain values."""
        names = [name for cls in type(self).__mro__ if issubclass(cls, AlignDataModule)
                 for name, p in inspect.signature(cls.__init__).parameters.items()
                 if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        values = {name: getattr(self, SETTING_ATTRIBUTES.get(name, name), None) for name in dict.fromkeys(names)}
        values["mixture"] = [asdict(source) for source in self.mixture]
        return values

    def state_dict(self) -> dict[str, Any]:
        """What Lightning saves of the DataModule in each checkpoint: its settings."""
        return {"settings": self.settings()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A resume goes on from the loader's position counted in the checkpoint run's batches: a setting that makes
        other batches (their order, rows, cut or size) would retrain, skip or change rows, so it is refused."""
        if self.trainer is None or self.trainer.state.fn != TrainerFn.FITTING:
            return
        saved, ckpt = state.get("settings", {}), self.trainer.ckpt_path
        for name, value in self.settings().items():
            if name in RESUME_MAY_CHANGE or name not in saved:
                continue
            differs = first_difference(f"data.{name}", value, saved[name])
            if differs is not None:
                where, now, then = differs
                raise LitAlignError(
                    f"--ckpt_path {ckpt}: {where} is {now!r} in this run but {then!r} in the checkpoint; a resume goes "
                    "on from that run's position in its batches, so only these data settings may change: "
                    f"{', '.join(RESUME_MAY_CHANGE)} (keep {where}, or start a new run from the checkpoint's exported "
                    "model)")

    def train_dataloader(self) -> DataLoader:
        trainer = self.trainer
        world, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        # seeded per epoch (not the global RNG), so a resumed run replays the same order (same as Lightning's own
        # DistributedSampler under DDP, but honouring ``shuffle: false`` there too)
        sampler = SkippingSampler(self.train_data, num_replicas=world, rank=rank, shuffle=self.shuffle, seed=self.seed)
        return ResumableLoader(self.train_data, batch_size=self.batch_size, sampler=sampler, collate_fn=self.collate,
                               num_workers=self.num_workers, drop_last=False, trainer=trainer)

    def val_dataloader(self) -> DataLoader | list:
        if self.val_data is None:
            return []
        return DataLoader(
            self.val_data, batch_size=self.val_batch_size, shuffle=False, collate_fn=self.collate,
            num_workers=self.num_workers,
        )

    test_dataloader = val_dataloader
