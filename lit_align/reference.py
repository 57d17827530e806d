"""The reference a recipe compares its policy with: one interface, one class per variant, and its whole lifecycle.

``module.reference`` is one of:

- ``FrozenReference``: a frozen model held in memory: ``ref_model``, or a copy of the initial policy (TRL's default).
  Eval mode, no gradients, wrapped as its own FSDP unit (``shard_unit``, which ``lit_align.strategies.DecoderLayers``
  wraps). TR-DPO's ``RefModelSync`` callback (here, beside what it mixes; ``lit_align.callbacks`` re-exports it)
  decides when the policy is mixed into it (``mix_in``); once mixed it is saved with the checkpoint (``save_mixed`` /
  ``load_mixed``).
- ``AdapterReference``: under LoRA, the policy itself with its adapters switched off: no second copy.
- ``Teacher``: a distillation teacher (``module.teachers``, beside any reference): a ``FrozenReference`` of its own
  files, loaded with its own ``from_pretrained`` arguments, its identity under its own checkpoint entry (one per
  teacher where there are several).
- ``PrecomputedReference``: no model while training: one no-grad pass before training gives every row its
  reference log-probs (``annotate``), cached on disk. The module starts it from its ``setup`` (Lightning sets the
  DataModule up first) and hands the function to the data (``PreferenceDataModule.add_reference_logps``): the data
  never reads the model.

A recipe asks for its reference in one call, ``build_reference(...)``: the variant its settings name and, with
``sync_ref_model``, the ``RefModelSync`` that goes with it, the settings checked against each other there once.

Every variant answers ``reference.logps(batch, compute)``, where ``compute(network)`` is the function the policy's
values come from: the same layout, the same kernel, so the reference's numbers mean what the policy's do. A batch that
carries ``ref_chosen_logps`` / ``ref_rejected_logps`` (precomputed, or the data's own) is answered from them.

What every variant owns (``Reference``): it is never part of a checkpoint (its ``state_dict`` hooks drop its keys, and
a checkpoint without them loads strictly), and its ``identity``, the digest of the files it is read from, is recorded
in each checkpoint and checked on resume (``on_save_checkpoint`` / ``check_resume``).

The precompute cache is ``$LIT_ALIGN_CACHE/ref_logps/<key>.pt`` (``[rows, 2]`` float32), with the SHA-256 of its bytes
in ``<key>.sha256``: a file that does not match it is recomputed, with a warning, and a cache that cannot be written
(``write_cache``) is a warning too: the run goes on with the values it computed. The key hashes everything the
numbers depend on: the rows' token ids in order (a content hash, not ``datasets``' ``_fingerprint``, which turns random
when a map function cannot be hashed, so it covers the tokenizer, chat template and prompt handling), ``max_length``
(the batch truncates), the reference's files (``config.json`` and weights, by content; a hub model's from its local
snapshot), its ``dtype`` and attention implementation, the trainer's precision and the sequence layout. A later run
with the same key loads the file and runs no reference at all. Under DDP every rank computes its share of the rows
(``rank::world_size``), the shares are all-gathered, and rank 0 writes the file; whether the cache holds the key is
rank 0's decision, broadcast to the others.
"""

from __future__ import annotations

import copy
import errno
import hashlib
import json
import math
import os
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Callable

import lightning as L
import numpy as np
import pyarrow.compute as pc
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader

from lit_align.capabilities import deepspeed_zero3, sharded_strategy
from lit_align.errors import LitAlignError
from lit_align.models import cache_dir, check_loadable, from_pretrained_kwargs, load_model, model_dtype, resolve
from lit_align.pretrained import gguf_path, is_gguf
from lit_align.recompute import disable_checkpointing, lean_mlps, lean_norms

REF_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")
TOKEN_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")
WEIGHT_SUFFIXES = (".safetensors", ".bin")
WRAPPERS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")  # names FSDP leaves out of the keys it reports
IDENTITY_KEY = "lit_align_reference"  # the checkpoint entry holding the reference's identity
MIXED_KEY = "ref_model_state"  # the checkpoint entry holding a TR-DPO-mixed reference's weights


def frozen(model: torch.nn.Module) -> torch.nn.Module:
    """Eval mode, no gradients: how a reference model lives."""
    model.eval()
    model.requires_grad_(False)
    return model


def carried_logps(batch) -> torch.Tensor | None:
    """The reference log-probs ``[2B]`` (chosen; rejected) a batch carries in its ``ref_*_logps`` columns, or None."""
    if REF_COLUMNS[0] not in batch:
        return None
    return torch.cat([batch[REF_COLUMNS[0]], batch[REF_COLUMNS[1]]])


# -- never part of a checkpoint: state-dict hooks every reference registers on itself ---------------------------------
def _drop_own_keys(reference, state_dict, prefix: str, local_metadata) -> None:
    """Saving: the reference's keys leave the state dict (in place: FSDP and DeepSpeed pass their own dict)."""
    for key in [k for k in state_dict if k.startswith(prefix)]:
        del state_dict[key]


def _skip_own_keys(reference, state_dict, prefix: str, *args) -> None:
    """Loading: whatever a checkpoint holds under the reference is not loaded into it (it comes from its own files, or
    a TR-DPO mix from ``save_mixed``'s entry), and its prefix is noted for ``_not_missing``."""
    for key in [k for k in state_dict if k.startswith(prefix)]:
        del state_dict[key]
    reference._load_prefix = prefix


def _not_missing(reference, incompatible_keys) -> None:
    """Loading: the reference's keys, absent from every checkpoint, are not missing (also when FSDP loads its units
    and reports them without its wrappers' names)."""
    prefix = reference.__dict__.pop("_load_prefix", None)
    if prefix is not None:
        incompatible_keys.missing_keys[:] = [k for k in incompatible_keys.missing_keys
                                             if not _unwrapped(k).startswith(_unwrapped(prefix))]


def _unwrapped(key: str) -> str:
    """``key`` without the module names FSDP's and activation checkpointing's wrappers add."""
    for wrapper in WRAPPERS:
        key = key.replace(wrapper, "")
    return key


class Reference(torch.nn.Module):
    """The interface. ``setup(module)`` runs in ``configure_model`` once the policy is loaded; ``logps(batch,
    compute)`` gives the reference's values for a batch. Never in a checkpoint (its state-dict hooks). ``identity``:
    the digest of the files the reference is read from (``source``), which checkpoints record so that a resume refuses
    a reference whose files changed (None: nothing to check, as under LoRA, whose reference is the base weights the
    checkpoint holds)."""

    identity: str | None = None
    source: str | None = None  # the model the identity was read from
    role = "reference"  # what the model is to the recipe, in messages
    identity_key = IDENTITY_KEY  # the checkpoint entry holding its identity

    def __init__(self):
        super().__init__()
        self.register_state_dict_post_hook(_drop_own_keys)
        self.register_load_state_dict_pre_hook(_skip_own_keys)
        self.register_load_state_dict_post_hook(_not_missing)

    def setup(self, module) -> None:
        """Get ready against ``module`` (an ``AlignModule`` whose policy is loaded)."""

    @contextmanager
    def network(self):
        """The reference network, for no-grad forwards."""
        raise NotImplementedError
        yield

    @property
    def shard_unit(self) -> torch.nn.Module | None:
        """The network of its own that FSDP wraps as one unit (``lit_align.strategies.DecoderLayers``); None: none."""
        return None

    def logps(self, batch, compute: Callable[[torch.nn.Module], torch.Tensor]) -> torch.Tensor:
        """The values the batch carries (``ref_*_logps``: precomputed, or the data's own), else ``compute(network)``
        on the reference, without gradient."""
        carried = carried_logps(batch)
        if carried is not None:
            return carried
        with torch.no_grad(), self.network() as network:
            return compute(network)

    # -- identity on resume -------------------------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint[self.identity_key] = self.identity

    def check_resume(self, checkpoint: dict, where: str) -> None:
        """Refuse to resume ``checkpoint`` (``where`` names it) against a reference whose files changed since."""
        saved = checkpoint.get(self.identity_key)
        if self.identity is not None and saved is not None and self.identity != saved:
            raise LitAlignError(f"{where}: the {self.role} model's files ({self.source}) changed since the checkpoint "
                                f"was written (their digest differs), so the resumed run would train against another "
                                f"{self.role}; restore those files or start a new run")

    def read_identity(self, name: str, trainer) -> None:
        """``name``'s files' digest as this reference's ``identity``, read by one rank and broadcast (every rank
        reading a large model's files is slow)."""
        if trainer is None:
            self.identity = model_files_hash(name)
        else:
            self.identity = trainer.strategy.broadcast(model_files_hash(name) if trainer.is_global_zero else None)
        self.source = name


class FrozenReference(Reference):
    """A frozen model in memory: ``name``'s, or (None) a copy of the freshly loaded policy."""

    def __init__(self, name: str | None = None):
        super().__init__()
        self.name = name
        self.model: torch.nn.Module | None = None

    def setup(self, module) -> None:
        if self.model is not None:
            return
        if self.name is not None or deepspeed_zero3(module._trainer):  # ZeRO-3's partitioned policy: no deepcopy
            self.model = frozen(module.load(self.name or module.model_name))
        else:
            model = copy.deepcopy(module.policy)
            if module.hparams.gradient_checkpointing:
                disable_checkpointing(model)
            self.model = frozen(model)
        # what a resume checks: the reference is re-read from its files, which may have been rewritten since
        self.read_identity(self.name or module.model_name, module._trainer)

    def train(self, mode: bool = True):
        return super().train(False)  # a reference stays in eval mode whatever its owner does

    @contextmanager
    def network(self):
        yield self.model

    @property
    def shard_unit(self) -> torch.nn.Module | None:
        return self.model

    # -- TR-DPO (``RefModelSync``, below, decides when) -------------------------------------------------------------
    @torch.no_grad()
    def mix_in(self, policy: torch.nn.Module, alpha: float) -> None:
        """``ref <- alpha * policy + (1 - alpha) * ref``, parameters only (buffers are not mixed, as TRL)."""
        for ref, param in zip(self.model.parameters(), policy.parameters(), strict=True):
            ref.mul_(1.0 - alpha).add_(param, alpha=alpha)

    def save_mixed(self, checkpoint: dict) -> None:
        """Once mixed the reference is no longer its files' model: its weights go into the checkpoint."""
        checkpoint[MIXED_KEY] = self.model.state_dict()

    def load_mixed(self, checkpoint: dict) -> None:
        """The mixed weights ``save_mixed`` wrote, if the checkpoint has them."""
        if MIXED_KEY in checkpoint:
            self.model.load_state_dict(checkpoint[MIXED_KEY])


class Teacher(FrozenReference):
    """Distillation's teacher (``lit_align.modules.distill``): a frozen model of its own, ``name``, loaded as the
    policy is (``model.dtype``, ``attn_implementation``, ``trust_remote_code``) with ``init_kwargs`` as its own
    ``from_pretrained`` arguments (TRL's ``teacher_model_init_kwargs``; the policy's ``model_init_kwargs`` are not
    its). A frozen reference in all else: never in checkpoints, in eval mode without gradients, one FSDP unit, its
    files' identity checked on resume, under its own checkpoint entry: ``lit_align_teacher``, or with several
    teachers ``lit_align_teacher/<teacher_id>`` (``teacher_id``: its key in ``model.teacher_model``, which then
    names it in errors)."""

    role = "teacher"
    identity_key = "lit_align_teacher"

    def __init__(self, name: str, init_kwargs: dict | None = None, teacher_id: str | None = None):
        super().__init__(name)
        self.option = "model.teacher_model" if teacher_id is None else f"model.teacher_model.{teacher_id}"
        kwargs_option = "model.teacher_model_init_kwargs" + ("" if teacher_id is None else f".{teacher_id}")
        from_pretrained_kwargs(init_kwargs, kwargs_option)  # refuse a bad mapping now
        self.init_kwargs = init_kwargs
        if teacher_id is not None:
            self.role, self.identity_key = f"teacher {teacher_id!r}", f"{Teacher.identity_key}/{teacher_id}"

    def check_source(self) -> str:
        """Refuse a teacher that names no model (a path that does not exist, a file that is not a ``.gguf``) in one
        line naming its option; the path it loads from (built-ins built, a ``.gguf`` converted, once)."""
        if Path(self.name).expanduser().is_file() and not is_gguf(self.name):
            raise LitAlignError(f"{self.option} {self.name!r} is a file, not a model: give the directory that holds it "
                                "with its config.json (a Hugging Face model directory), a .gguf file, a hub name, "
                                "pretrained:<name> or builtin:<name>")
        return check_loadable(gguf_path(self.name, self.init_kwargs), self.option)

    def setup(self, module) -> None:
        if self.model is not None:
            return
        hp = module.hparams
        self.check_source()
        self.model = frozen(load_model(self.name, hp.dtype, hp.attn_implementation, hp.trust_remote_code,
                                       self.init_kwargs))
        if not (module._trainer is not None and sharded_strategy(module._trainer)):
            lean_mlps(self.model)  # its forwards without gradient: the same values, fewer temporaries
            lean_norms(self.model)
        self.read_identity(self.name, module._trainer)


class AdapterReference(Reference):
    """Under LoRA: the policy with its adapters disabled (the base model), no second copy."""

    def setup(self, module) -> None:
        self.__dict__["_module"] = module  # not a submodule: the policy belongs to its module, not to this

    @contextmanager
    def network(self):
        module = self.__dict__["_module"]
        with module.policy.disable_adapter():
            yield module.network


class PrecomputedReference(Reference):
    """No reference while training: every row carries its ``ref_chosen_logps`` / ``ref_rejected_logps``.

    Args:
        name: the reference model to run once (None: the policy's initial weights, i.e. ``model``).
        batch_size: pairs per batch in the pass (None: the data's batch sizes).
    """

    def __init__(self, name: str | None = None, batch_size: int | None = None):
        super().__init__()
        self.name, self.batch_size = name, batch_size
        self.computed: list[str] = []  # the splits this process ran the reference over (the others: from the cache)

    @contextmanager
    def network(self):
        raise LitAlignError("precompute_ref_log_probs: a batch came without ref_chosen_logps (rows set up after "
                            "the precompute pass?)")
        yield

    def annotate(self, module, rows, split: str, collate, batch_size: int, max_length: int | None):
        """``rows`` with the reference's log-prob columns: from the cache, or from one pass of the reference.

        ``module`` (a ``DPOModule``, which hands this to its data from ``setup``) supplies how to load the reference
        (``load``) and what to compute with it (``pair_logps``, the function the policy's log-probs come from in
        training); the rest (``collate``, the batch size, ``max_length``) is the data's.
        """
        if REF_COLUMNS[0] in rows.column_names:  # the data's own (or an earlier pass's)
            return rows
        trainer, strategy = module.trainer, module.trainer.strategy
        name = self.name or module.model_name
        if self.source != name:  # the files are read once, not once per split; a resume checks them as a frozen one's
            self.read_identity(name, trainer)
        hp = module.hparams
        path = cache_path(cache_key(rows, reference=self.identity, dtype=model_dtype(hp.dtype, hp.model_init_kwargs),
                                    attn_implementation=hp.attn_implementation, precision=str(trainer.precision),
                                    max_length=max_length, **module.reference_settings()))
        # rank 0 checks the file against the digest written beside it; every rank then reads it
        verified = verified_cache(path, of_shape((len(rows), 2))) if trainer.is_global_zero else None
        if strategy.broadcast(verified, src=0):
            values = torch.load(path, map_location="cpu", weights_only=True)
            rank_zero_info(f"lit_align: reference log-probs for {split} ({len(rows)} rows) read from {path}")
            return attach(rows, values)
        batch_size = self.batch_size or batch_size
        rank_zero_info(f"lit_align: computing reference log-probs for {split} ({len(rows)} rows, "
                       f"batch size {batch_size})")
        device = strategy.root_device
        model = frozen(module.load(name)).to(device)

        def pair_logps(batch):
            with trainer.precision_plugin.train_step_context():  # autocast as in training_step
                return module.pair_logps(model, batch).chunk(2)

        values = compute_ref_logps(rows, collate, batch_size, pair_logps, device, strategy)
        self.computed.append(split)  # the reference is freed when this returns
        if strategy.global_rank == 0:
            write_cache(path, values)
        return attach(rows, values)


def choose_reference(ref_model: str | None, lora: bool, precompute: bool = False,
                     precompute_batch_size: int | None = None) -> Reference:
    """The variant a recipe's settings ask for (TRL's rules: ``ref_model`` and LoRA exclude each other)."""
    if ref_model is not None and lora:
        raise LitAlignError("model.ref_model: with peft_config the reference is the policy with its adapters "
                            "disabled; leave ref_model null")
    if precompute_batch_size is not None and precompute_batch_size < 1:
        raise LitAlignError(f"model.precompute_ref_batch_size must be >= 1 or null, got {precompute_batch_size}")
    if precompute:
        return PrecomputedReference(ref_model, precompute_batch_size)
    return AdapterReference() if lora else FrozenReference(ref_model)


def build_reference(ref_model: str | None, lora: bool, *, enabled: bool = True, precompute: bool = False,
                    precompute_batch_size: int | None = None, sync_ref_model: bool = False,
                    ref_model_mixup_alpha: float = 0.6, ref_model_sync_steps: int = 512,
                    ) -> tuple[Reference | None, RefModelSync | None]:
    """A recipe's reference and, with ``sync_ref_model`` (TR-DPO), the ``RefModelSync`` callback that mixes the
    policy into it: the settings checked against each other once, here, for every recipe.

    ``enabled=False``: the recipe runs without a reference (GRPO's ``beta: 0``): ``(None, None)``. The module keeps
    the pair as ``module.reference`` / ``module.ref_sync``; ``AlignModule.configure_callbacks`` adds the callback.
    """
    if sync_ref_model:
        refuse_sync_without_model(enabled, lora, precompute)
    if not enabled:
        return None, None
    reference = choose_reference(ref_model, lora, precompute, precompute_batch_size)
    sync = RefModelSync(ref_model_sync_steps, ref_model_mixup_alpha) if sync_ref_model else None
    return reference, sync


def refuse_sync_without_model(enabled: bool, lora: bool, precompute: bool) -> None:
    """TR-DPO mixes the policy into a reference model of its own, held in memory: refuse the settings that leave
    none (TRL refuses them too)."""
    if not enabled:
        raise LitAlignError("model.sync_ref_model mixes the policy into the reference model: it needs model.beta != 0 "
                            "(beta 0 loads no reference)")
    if precompute:
        raise LitAlignError("model.sync_ref_model needs a reference model in memory: it cannot be combined with "
                            "model.precompute_ref_log_probs (the reference runs once before training, then is freed)")
    if lora:
        raise LitAlignError("model.sync_ref_model needs a reference model in memory: it cannot be combined with "
                            "model.peft_config (the reference is then the policy without its adapters, and "
                            "model.sync_ref_model mixes the policy into a reference of its own)")


# -- TR-DPO: when the policy is mixed into a frozen reference -------------------------------------------------------
class RefModelSync(L.Callback):
    """TR-DPO: every ``ref_model_sync_steps`` optimizer steps, ``ref <- alpha * policy + (1 - alpha) * ref``.

    TRL's ``sync_ref_model`` (https://huggingface.co/papers/2404.09656): the sync follows the optimizer step whose
    count is a multiple of ``ref_model_sync_steps`` (steps N, 2N, ...; once per step under gradient accumulation).
    Parameters only, like TRL; buffers are not mixed. Once it has synced, the reference is no longer the initial
    model, so it is saved in checkpoints and restored on resume (``FrozenReference.save_mixed`` / ``load_mixed``:
    the mixing is the reference's, when it happens is this callback's). Needs a reference held in memory: not with
    ``precompute_ref_log_probs`` or ``peft_config`` (TRL refuses both too). Under DDP every rank mixes its own copy;
    the policies are identical across ranks, so the references stay so.

    Args:
        ref_model_sync_steps: cadence in optimizer steps (TRL's default 512).
        ref_model_mixup_alpha: weight of the policy in the mix (TRL's default 0.6).
    """

    def __init__(self, ref_model_sync_steps: int = 512, ref_model_mixup_alpha: float = 0.6):
        if ref_model_sync_steps < 1:
            raise LitAlignError(f"ref_model_sync_steps must be >= 1, got {ref_model_sync_steps}")
        if not 0.0 <= ref_model_mixup_alpha <= 1.0:
            raise LitAlignError(f"ref_model_mixup_alpha must be in [0, 1], got {ref_model_mixup_alpha}")
        self.every, self.alpha = ref_model_sync_steps, ref_model_mixup_alpha
        self._last_step: int | None = None
        self.synced_at: list[int] = []  # optimizer steps after which this run synced

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not isinstance(getattr(pl_module, "reference", None), FrozenReference):
            raise LitAlignError("RefModelSync (sync_ref_model) needs a reference model held in memory; it cannot be "
                                "combined with precompute_ref_log_probs or peft_config")
        if sharded_strategy(trainer):
            raise LitAlignError("RefModelSync (sync_ref_model) mixes whole parameters: not under FSDP or DeepSpeed "
                                "ZeRO-3, whose parameters are shards outside a forward (use ddp or ZeRO-1/2)")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last_step = trainer.global_step  # a run resumed right after a sync must not sync again

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == 0 or step % self.every or self._last_step == step:
            return
        self._last_step = step
        pl_module.reference.mix_in(pl_module.network, self.alpha)
        self.synced_at.append(step)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        if trainer.global_step >= self.every:  # synced at least once: the reference is not the initial model
            pl_module.reference.save_mixed(checkpoint)

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        pl_module.reference.load_mixed(checkpoint)


# -- the precompute cache ---------------------------------------------------------------------------------------------
def rows_fingerprint(dataset, columns: tuple[str, ...] = TOKEN_COLUMNS) -> str:
    """SHA-256 of the token ids of every row (its ``columns``), in dataset order (lengths included, so rows cannot run
    together)."""
    table = dataset.with_format("arrow")[:]
    h = hashlib.sha256()
    for name in columns:
        column = table.column(name).combine_chunks()
        h.update(name.encode())
        h.update(np.asarray(pc.list_value_length(column), dtype=np.int64).tobytes())
        h.update(np.asarray(column.flatten(), dtype=np.int64).tobytes())
    return h.hexdigest()


def model_files_hash(name: str) -> str:
    """SHA-256 of a model's ``config.json`` and weight files: a local directory's, or a hub model's local snapshot."""
    path = Path(resolve(name)).expanduser()
    if not path.is_dir():
        from transformers.utils import cached_file

        config = cached_file(name, "config.json")
        if config is None:
            raise LitAlignError(f"cannot find the files of model {name!r} to fingerprint the reference")
        path = Path(config).parent
    files = sorted(p for p in path.iterdir() if p.name == "config.json" or p.name.endswith(WEIGHT_SUFFIXES))
    h = hashlib.sha256()
    for file in files:
        h.update(file.name.encode())
        with file.open("rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()


def cache_key(dataset, columns: tuple[str, ...] = TOKEN_COLUMNS, **settings) -> str:
    """The cache key of values computed over ``dataset``'s token ``columns`` under ``settings`` (plain JSON values):
    the reference log-probs of preference rows, by default."""
    blob = json.dumps({"rows": rows_fingerprint(dataset, columns), **settings}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def cache_path(key: str, kind: str = "ref_logps") -> Path:
    """``$LIT_ALIGN_CACHE/<kind>/<key>.pt``: ``ref_logps`` here, ``teacher_topk`` for distillation's teacher."""
    return cache_dir() / kind / f"{key}.pt"


def write_cache(path: Path, values, what: str = "reference log-prob") -> bool:
    """``values`` at ``path`` and the SHA-256 of the file's bytes at ``path.sha256``, each written atomically (the
    digest last: a file without its digest is never trusted). A cache that cannot be written (a file where its
    directory should be, no permission, a full disk) is one warning naming the ``what`` cache and why: the run goes
    on with the values it computed, nothing half-written is left, and the next run computes them again. Whether the
    cache was written."""
    written = False
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        for target, write in ((path, lambda f: torch.save(values, f)),
                              (path.with_suffix(".sha256"), lambda f: f.write(_sha256(path).encode()))):
            partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
            try:
                with open(partial, "wb") as f:
                    write(f)
                os.replace(partial, target)  # atomic: a reader sees the whole file or none
                written = True
            finally:
                partial.unlink(missing_ok=True)
    except (OSError, RuntimeError) as error:
        cause = error if isinstance(error, OSError) else error.__context__  # torch's writer wraps the OSError
        if not isinstance(cause, OSError):
            raise
        if written:  # the values without their digest: never trusted, so not kept
            with suppress(OSError):
                path.unlink(missing_ok=True)
        rank_zero_warn(f"lit_align: cannot write the {what} cache {path}: {unwritable(path, cause)}; the run goes on "
                       "with the values it computed, the next run computes them again (LIT_ALIGN_CACHE sets where "
                       "caches go)")
        return False
    return True


def unwritable(path: Path, error: OSError) -> str:
    """Why ``path`` could not be written, in words: a file where one of its directories should be, else the file
    system's reason."""
    if error.errno in (errno.EEXIST, errno.ENOTDIR):
        blocking = next((p for p in path.parents if p.is_file()), None)
        if blocking is not None:
            return f"{blocking} is a file, not a directory"
    return error.strerror or str(error)


def verified_cache(path: Path, check: Callable[[object], str | None], what: str = "reference log-prob") -> bool:
    """Whether ``path`` holds values whose bytes match the digest written beside them and which ``check`` accepts
    (it answers what is wrong with them, or None); a file that does not verify (changed, cut short, of another
    shape, without its digest) is reported, naming the ``what`` cache, and recomputed."""
    if not path.exists():
        return False
    digest = path.with_suffix(".sha256")
    problem = None
    if not digest.exists() or digest.read_text().strip() != _sha256(path):
        problem = "its content does not match its digest"
    else:
        try:
            problem = check(torch.load(path, map_location="cpu", weights_only=True))
        except Exception as exc:  # noqa: BLE001 - whatever torch.load raises on a damaged file
            problem = f"it cannot be read ({type(exc).__name__})"
    if problem is not None:
        rank_zero_warn(f"lit_align: {what} cache {path}: {problem}; computing the log-probs again")
    return problem is None


def of_shape(shape: tuple[int, ...]) -> Callable[[torch.Tensor], str | None]:
    """``verified_cache``'s check of a tensor of ``shape``."""
    return lambda values: None if tuple(values.shape) == shape else f"it holds {tuple(values.shape)}, expected {shape}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def compute_ref_logps(dataset, collate, batch_size: int, pair_logps: Callable, device: torch.device,
                      strategy) -> torch.Tensor:
    """``[rows, 2]`` reference log-probs (chosen, rejected), this rank's rows computed, all ranks' gathered."""
    rank, world = strategy.global_rank, strategy.world_size
    shard = dataset.select(range(rank, len(dataset), world)) if world > 1 else dataset
    loader = DataLoader(shard, batch_size=batch_size, shuffle=False, collate_fn=collate)
    values = []
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items() if k not in REF_COLUMNS}
        with torch.no_grad():
            chosen, rejected = pair_logps(batch)
        values.append(torch.stack([chosen, rejected], 1).float())
    values = torch.cat(values) if values else torch.zeros(0, 2, device=device)
    if world == 1:
        return values.cpu()
    per_rank = math.ceil(len(dataset) / world)
    padded = torch.zeros(per_rank, 2, device=device)
    padded[: len(values)] = values
    gathered = strategy.all_gather(padded)  # [world, per_rank, 2]; row r + world * k is gathered[r, k]
    return gathered.permute(1, 0, 2).reshape(-1, 2)[: len(dataset)].cpu()


def attach(dataset, values: torch.Tensor):
    """``dataset`` with the ``ref_chosen_logps`` / ``ref_rejected_logps`` columns added."""
    for i, name in enumerate(REF_COLUMNS):
        dataset = dataset.add_column(name, values[:, i].tolist())
    return dataset
