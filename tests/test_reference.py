"""DPO reference strategies: frozen copy, precomputed log-probs (cached), LoRA (adapters off), TR-DPO sync.

Each strategy must give the frozen copy's step-0 loss on the same batch; every strategy answers through
``Reference.logps`` and stays out of checkpoints by itself; the precompute pass starts from the module (after the
data's ``setup``) and must be skipped when its cache holds the key; LoRA must leave the base weights bitwise
unchanged; the sync must move the reference exactly on its schedule, by exactly ``alpha * policy + (1 - alpha) * ref``.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from transformers import AutoModelForCausalLM

from lit_align.data import PreferenceDataModule
from lit_align.data.tasks import SortTask
from lit_align.errors import LitAlignError
from lit_align.modules import DPOModule
from lit_align import reference as reference_module
from lit_align.reference import (AdapterReference, FrozenReference, PrecomputedReference, RefModelSync,
                                 build_reference)
from test_layouts import completion_logps
from helpers import fit, trainer
from numerics import TINY_TERMS, assert_rounding_close

REPO = Path(__file__).resolve().parents[1]
LORA = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}


@pytest.fixture(scope="module")
def rows_path(tmp_path_factory) -> str:
    """48 training pairs of the built-in sort task in a JSONL file, and a 16-pair validation file beside it."""
    folder = tmp_path_factory.mktemp("rows")
    task = SortTask(num_train=48, num_test=16)
    task.preference_rows("train").to_json(folder / "train.jsonl")
    task.preference_rows("test").to_json(folder / "val.jsonl")
    return str(folder / "train.jsonl")


@pytest.fixture(scope="module")
def noisy_ref(tiny_path, tmp_path_factory) -> str:
    """The tiny model with noise added: a reference that differs from the policy (the loss is not ln 2)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_path)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    path = tmp_path_factory.mktemp("noisy") / "ref"
    model.save_pretrained(path)
    return str(path)


def data(rows_path, **kw) -> PreferenceDataModule:
    kw = {"path": rows_path, "batch_size": 4, "max_length": 32, "val_split": None, "shuffle": False, **kw}
    return PreferenceDataModule(**kw)


class Record(L.Callback):
    """Per training batch: the step's per-pair losses, whether the batch carried reference log-probs."""

    def __init__(self):
        self.losses, self.carried = [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.carried.append("ref_chosen_logps" in batch)
        if batch_idx == 0:
            with torch.no_grad():
                self.step0 = pl_module.pair_outputs(batch)[0]["loss"]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())


# -- every strategy: the frozen copy's step-0 loss -------------------------------------------------------------------
@pytest.mark.parametrize("ref, loss", [("initial", {}), ("noisy", {}), ("noisy", {"ld_alpha": 0.5})])
def test_every_strategy_gives_the_frozen_step0_loss(tmp_path, rows_path, noisy_ref, ref, loss):
    """Also with LD-DPO weighting, which the precompute pass must apply to the reference as training does."""
    ref_model = noisy_ref if ref == "noisy" else None
    strategies = {
        "frozen": {},
        "precomputed": {"precompute_ref_log_probs": True, "precompute_ref_batch_size": 16},
        "sync": {"sync_ref_model": True, "ref_model_sync_steps": 1},
    }
    if ref_model is None:  # under LoRA the reference is the base model, i.e. the initial policy
        strategies["lora"] = {"peft_config": LORA}
    losses = {}
    for name, options in strategies.items():
        record = Record()
        fit(DPOModule(model="builtin:tiny", ref_model=ref_model, **options, **loss), data(rows_path), tmp_path / name,
            callbacks=[record])
        losses[name] = record.step0
        assert record.carried == [name == "precomputed"]
    frozen = losses["frozen"]
    if ref_model is None:
        assert frozen.tolist() == [torch.tensor(math.log(2)).item()] * 4  # policy == reference: the same computation
    else:
        assert all(abs(x - math.log(2)) > 1e-3 for x in frozen.tolist())
    for name, loss in losses.items():
        # the precompute pass batches 16 pairs, not 4: other padding, so equal up to the rounding of the log-probs
        # (summed over ~10 tokens of ~3 nats) that enter beta * margin
        assert_rounding_close(loss, frozen, scale=0.1 * 30 + 1.0, terms=TINY_TERMS, msg=name)


def test_lora_reference_is_the_base_model_even_when_the_adapters_are_not_zero(rows_path):
    """With adapters that change the output, the reference (adapters disabled) is still exactly the base model."""
    module = DPOModule(model="builtin:tiny", peft_config={**LORA, "init_lora_weights": False})
    module.configure_model()
    base = DPOModule(model="builtin:tiny")
    base.configure_model()
    dm = data(rows_path, tokenizer="builtin:tiny")
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    with torch.no_grad(), module.reference.network() as ref:
        adapters_off = completion_logps(ref, batch)[0]
    with torch.no_grad():
        assert torch.equal(adapters_off, completion_logps(base.policy, batch)[0])
        assert not torch.allclose(completion_logps(module.network, batch)[0], adapters_off, atol=1e-3)
    assert not isinstance(module.reference, FrozenReference)  # no second copy
    assert not list(module.reference.parameters())


# -- the interface every strategy shares --------------------------------------------------------------------------
def test_every_strategy_answers_through_logps_carried_columns_first(rows_path):
    """A batch carrying ``ref_*_logps`` (precomputed, or the data's own) is answered from them by every strategy;
    without them a model in memory computes, and a precomputed reference says what is wrong."""
    dm = data(rows_path, tokenizer="builtin:tiny")
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))  # 4 pairs, no reference columns
    carried = {**batch, "ref_chosen_logps": torch.tensor([-1.0, -2.0, -3.0, -4.0]),
               "ref_rejected_logps": torch.tensor([-5.0, -6.0, -7.0, -8.0])}
    for options in ({}, {"peft_config": LORA}, {"precompute_ref_log_probs": True}):
        module = DPOModule(model="builtin:tiny", **options)
        module.configure_model()
        got = module.reference.logps(carried, lambda net: module.pair_logps(net, carried))
        assert got.tolist() == [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0, -8.0], options
    with pytest.raises(LitAlignError, match="precompute_ref_log_probs: a batch came without ref_chosen_logps"):
        module.reference.logps(batch, lambda net: module.pair_logps(net, batch))
    frozen = DPOModule(model="builtin:tiny")
    frozen.configure_model()
    computed = frozen.reference.logps(batch, lambda net: frozen.pair_logps(net, batch))
    assert torch.equal(computed, frozen.pair_logps(frozen.policy, batch).detach())  # the initial policy's values


def test_a_reference_keeps_itself_out_of_any_state_dict(noisy_ref):
    """The reference's own hooks, whatever module holds it: saved without its keys, loaded strictly without them, and
    reference keys a state dict does hold are not loaded into it (the reference is re-read from its files)."""
    owner = torch.nn.Module()
    owner.head = torch.nn.Linear(2, 2)
    owner.reference = FrozenReference(noisy_ref)
    owner.reference.model = AutoModelForCausalLM.from_pretrained(noisy_ref)
    before = {k: v.clone() for k, v in owner.reference.model.state_dict().items()}
    state = owner.state_dict()
    assert sorted(state) == ["head.bias", "head.weight"]
    foreign = {f"reference.model.{k}": torch.zeros_like(v) for k, v in before.items()}
    assert owner.load_state_dict({**state, **foreign}, strict=True).missing_keys == []
    assert owner.load_state_dict(state, strict=True).missing_keys == []
    assert all(torch.equal(v, before[k]) for k, v in owner.reference.model.state_dict().items())
    with pytest.raises(RuntimeError, match='Missing key.*"head.bias"'):  # the owner's own keys are still required
        owner.load_state_dict({"head.weight": state["head.weight"]}, strict=True)


# -- precomputed: the pass starts from the module; the cache --------------------------------------------------------
class RowsSeen(L.Callback):
    """Whether the training rows carry reference log-probs: after the data's ``setup`` (callbacks set up next) and
    after the module's (at fit start)."""

    def setup(self, trainer, pl_module, stage):
        rows = trainer.datamodule.train_data  # None while the data waits for the model's tokenizer (``connect``)
        self.after_data = rows is not None and "ref_chosen_logps" in rows.column_names

    def on_fit_start(self, trainer, pl_module):
        self.after_module = "ref_chosen_logps" in trainer.datamodule.train_data.column_names


def test_precompute_pass_starts_from_the_module_after_the_data_setup(tmp_path, rows_path):
    """Model -> data: the DataModule's ``setup`` only tokenizes; the module's ``setup`` hands it the reference's
    log-probs (``add_reference_logps``)."""
    seen = RowsSeen()
    module = DPOModule(model="builtin:tiny", precompute_ref_log_probs=True)
    fit(module, data(rows_path), tmp_path, callbacks=[seen])
    assert (seen.after_data, seen.after_module) == (False, True)
    assert module.reference.identity == reference_module.model_files_hash("builtin:tiny")  # what a resume checks


def test_precompute_reuses_its_cache(tmp_path, rows_path, lit_align_cache):
    shutil.rmtree(lit_align_cache / "ref_logps", ignore_errors=True)  # other tests may have cached these rows
    passes = []  # the splits each run ran the reference over (PrecomputedReference.computed)
    val = rows_path.replace("train.jsonl", "val.jsonl")

    def run(name, model_init_kwargs=None, **kw):
        record = Record()
        module = DPOModule(model="builtin:tiny", precompute_ref_log_probs=True, learning_rate=1e-3,
                           model_init_kwargs=model_init_kwargs)
        dm = data(rows_path, val_split="train", val_path=val, **kw)
        fit(module, dm, tmp_path / name, max_steps=3, callbacks=[record])
        assert isinstance(module.reference, PrecomputedReference)  # no reference resident while training
        assert not list(module.reference.parameters())
        passes.extend(module.reference.computed)
        return record, dm

    first, dm = run("first")
    assert len(passes) == 2  # train and validation rows
    assert first.carried == [True] * 3
    assert "ref_chosen_logps" in dm.val_data.column_names
    assert len(list((lit_align_cache / "ref_logps").glob("*.pt"))) == 2

    second, _ = run("second")
    assert len(passes) == 2, "the second run ran the reference again"
    assert second.losses == first.losses

    run("longer", max_length=24)  # another max_length truncates differently: another key, another pass
    assert len(passes) == 4
    run("bf16", model_init_kwargs={"dtype": "bfloat16"})  # the reference loads in another dtype: another key
    assert len(passes) == 6


@pytest.mark.parametrize("damage", ["edited", "truncated", "no digest"])
def test_a_cache_file_that_does_not_verify_is_computed_again(tmp_path, rows_path, lit_align_cache, damage):
    """A cached file changed after it was written (5 added to column 0), cut short, or without its digest: the run
    warns, runs the reference again and trains on the true values (its losses are the first run's)."""
    shutil.rmtree(lit_align_cache / "ref_logps", ignore_errors=True)

    def run(name):
        record = Record()
        module = DPOModule(model="builtin:tiny", precompute_ref_log_probs=True, learning_rate=1e-3)
        fit(module, data(rows_path), tmp_path / name, max_steps=2, callbacks=[record])
        return record, module.reference.computed

    first, computed = run("first")
    assert computed == ["train"]
    (cached,) = (lit_align_cache / "ref_logps").glob("*.pt")
    if damage == "edited":
        values = torch.load(cached, weights_only=True)
        values[:, 0] += 5
        torch.save(values, cached)
    elif damage == "truncated":
        cached.write_bytes(cached.read_bytes()[:100])
    else:
        cached.with_suffix(".sha256").unlink()
    with pytest.warns(UserWarning, match=f"reference log-prob cache {cached}: .*computing the log-probs again"):
        second, computed = run("second")
    assert computed == ["train"]
    assert second.losses == first.losses
    _, computed = run("third")  # rewritten with its digest: read back
    assert computed == []


def test_a_full_disk_during_the_cache_write_is_one_warning_and_the_run_goes_on(tmp_path, rows_path, lit_align_cache,
                                                                               monkeypatch):
    """The disk fills up after 64 bytes of the cache file: one warning naming the cache and the reason, the run
    trains on the values computed, and no partial file (nor a file without its digest) is left."""
    from helpers import FillsUp

    shutil.rmtree(lit_align_cache / "ref_logps", ignore_errors=True)
    real_save = torch.save
    monkeypatch.setattr(torch, "save", lambda obj, f, *args, **kwargs: real_save(obj, FillsUp(f, 64), *args, **kwargs))
    record = Record()
    module = DPOModule(model="builtin:tiny", precompute_ref_log_probs=True, learning_rate=1e-3)
    with pytest.warns(UserWarning, match=r"^lit_align: cannot write the reference log-prob cache .*\.pt: No space "
                                         r"left on device; the run goes on with the values it computed"):
        fit(module, data(rows_path), tmp_path, max_steps=2, callbacks=[record])
    assert module.reference.computed == ["train"] and record.carried == [True, True]
    assert list((lit_align_cache / "ref_logps").iterdir()) == []


def test_precompute_key_follows_the_rows_and_the_reference(rows_path, tiny_path, noisy_ref):
    dm = data(rows_path, tokenizer="builtin:tiny")
    dm.setup("fit")
    rows = dm.train_data
    key = reference_module.cache_key(rows, reference=reference_module.model_files_hash("builtin:tiny"))
    assert key == reference_module.cache_key(rows, reference=reference_module.model_files_hash(tiny_path))
    assert key != reference_module.cache_key(rows, reference=reference_module.model_files_hash(noisy_ref))
    assert key != reference_module.cache_key(rows.select(range(1, len(rows))),
                                             reference=reference_module.model_files_hash("builtin:tiny"))


# -- LoRA -------------------------------------------------------------------------------------------------------------
def test_lora_trains_adapters_only_and_exports_them(tmp_path, rows_path, tiny_path):
    original = AutoModelForCausalLM.from_pretrained(tiny_path).state_dict()
    module = DPOModule(model="builtin:tiny", peft_config=LORA, learning_rate=1e-2, export_merged=True)
    record = Record()
    fit(module, data(rows_path), tmp_path, max_steps=4, callbacks=[record])
    assert record.losses[-1] < record.losses[0]
    state = module.network.state_dict()
    lora = {k: v for k, v in state.items() if "lora_" in k}
    base = {k.replace(".base_layer", ""): v for k, v in state.items() if "lora_" not in k}
    assert base.keys() == original.keys()
    assert all(torch.equal(base[k], original[k]) for k in original), "LoRA changed a base weight"
    assert any(v.abs().sum() > 0 for k, v in lora.items() if "lora_B" in k), "the adapters did not train"
    trained = {id(p) for group in module.trainer.optimizers[0].param_groups for p in group["params"]}
    assert trained == {id(p) for n, p in module.policy.named_parameters() if "lora_" in n}

    # export_merged: the merged model at the top (plain transformers loads it), the adapter in adapter/
    out = module.export(tmp_path / "export")
    assert (out / "config.json").exists() and (out / "adapter" / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        logits = module.policy(input_ids=ids).logits  # the merged weights W + BA round once: rule 3
        assert_rounding_close(merged(input_ids=ids).logits, logits, terms=TINY_TERMS)
    module.hparams.export_merged = False  # default: the adapter only, as TRL's save_model writes it
    adapter_only = module.export(tmp_path / "adapter_only")
    assert (adapter_only / "adapter_model.safetensors").exists() and not (adapter_only / "config.json").exists()


def test_peft_config_errors():
    with pytest.raises(LitAlignError, match=r"model.peft_config: .*rank"):
        DPOModule(peft_config={"rank": 4})
    with pytest.raises(LitAlignError, match="model.ref_model: with peft_config"):
        DPOModule(peft_config=LORA, ref_model="builtin:tiny")
    with pytest.raises(LitAlignError, match="model.sync_ref_model needs a reference model in memory"):
        DPOModule(sync_ref_model=True, precompute_ref_log_probs=True)


def test_build_reference_gives_the_variant_and_the_sync_a_recipe_asks_for():
    """One call per recipe: the variant its settings name, the TR-DPO callback with its own settings, none of either
    where the recipe runs without a reference; and the module adds that callback itself."""
    reference, sync = build_reference(None, False, sync_ref_model=True, ref_model_mixup_alpha=0.25,
                                      ref_model_sync_steps=3)
    assert isinstance(reference, FrozenReference) and reference.name is None
    assert isinstance(sync, RefModelSync) and (sync.every, sync.alpha) == (3, 0.25)
    reference, sync = build_reference("builtin:tiny", False, precompute=True, precompute_batch_size=5)
    assert isinstance(reference, PrecomputedReference) and (reference.name, reference.batch_size) == ("builtin:tiny", 5)
    assert sync is None
    assert isinstance(build_reference(None, True)[0], AdapterReference)
    assert build_reference("builtin:tiny", True, enabled=False) == (None, None)  # off: its settings are not read
    module = DPOModule(sync_ref_model=True, ref_model_sync_steps=7)
    assert module.configure_callbacks() == [module.ref_sync] and module.ref_sync.every == 7
    assert DPOModule().configure_callbacks() == []


@pytest.mark.parametrize("settings, message", [
    ({"enabled": False}, "model.sync_ref_model mixes the policy into the reference model: it needs model.beta != 0 "
                         "(beta 0 loads no reference)"),
    ({"precompute": True}, "model.sync_ref_model needs a reference model in memory: it cannot be combined with "
                           "model.precompute_ref_log_probs (the reference runs once before training, then is freed)"),
    ({"lora": True}, "model.sync_ref_model needs a reference model in memory: it cannot be combined with "
                     "model.peft_config (the reference is then the policy without its adapters, and "
                     "model.sync_ref_model mixes the policy into a reference of its own)"),
])
def test_build_reference_refuses_a_sync_without_a_reference_model_in_memory(settings, message):
    with pytest.raises(LitAlignError) as info:
        build_reference(None, **{"lora": False, **settings}, sync_ref_model=True)
    assert str(info.value) == message


# -- DDP: each rank computes its share, rank 0 writes the cache ------------------------------------------------------
@pytest.mark.slow  # two processes (~20-45 s): run by .ci/run (make test-slow), not by make test
def test_precompute_under_ddp_matches_one_process(tmp_path, rows_path, lit_align_cache, tiny_path):
    """Two CPU ranks (the real CLI in a subprocess) fill the cache with the numbers one process computes.

    ``tiny_path``: the built-in model is built before the ranks start (they would race to build it)."""
    shutil.rmtree(lit_align_cache / "ref_logps", ignore_errors=True)
    args = [
        sys.executable, "-m", "lit_align", "fit", "-c", str(REPO / "configs" / "dpo.yaml"),
        "--model.init_args.precompute_ref_log_probs", "true", "--model.init_args.precompute_ref_batch_size", "5",
        "--data.init_args.path", rows_path, "--data.init_args.val_split", "null", "--data.init_args.max_length", "32",
        "--data.init_args.batch_size", "2", "--trainer.max_steps", "1", "--trainer.strategy", "ddp",
        "--trainer.devices", "2", "--trainer.accelerator", "cpu", "--trainer.logger", "false",
        "--trainer.val_check_interval", "1.0",
        "--trainer.enable_progress_bar", "false", "--trainer.enable_checkpointing", "false",
        "--export.enabled", "false",
    ]
    proc = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    (ddp_file,) = (lit_align_cache / "ref_logps").glob("*.pt")
    ddp_values = torch.load(ddp_file, weights_only=True)

    dm = data(rows_path, tokenizer="builtin:tiny", batch_size=2)
    dm.setup("fit")
    module = DPOModule(model="builtin:tiny")
    module.configure_model()
    single = reference_module.compute_ref_logps(
        dm.train_data, dm.collate, 16, lambda batch: completion_logps(module.reference.model, batch).tokens.sum(1).chunk(2),
        torch.device("cpu"), trainer().strategy)
    assert ddp_values.shape == (48, 2)
    assert_rounding_close(ddp_values, single, terms=TINY_TERMS)  # other batches: other padding, other orders


def test_cli_lora_run_exports_the_adapter_and_can_export_again(tmp_path, rows_path, tiny_path):
    """``--model.init_args.peft_config`` from the command line; the export holds the adapter, and a second run may
    replace it (HFExport replaces only its own exports, which its manifest lists)."""
    from lit_align.cli import main

    export = tmp_path / "hf_model"
    args = [
        "fit", "-c", str(REPO / "configs" / "dpo.yaml"), "--model.init_args.peft_config", "{r: 4, lora_alpha: 8}",
        "--data.init_args.path", rows_path, "--data.init_args.val_split", "null", "--trainer.max_steps", "2",
        "--trainer.val_check_interval", "1.0", "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
        "--trainer.enable_checkpointing", "false", "--trainer.default_root_dir", str(tmp_path),
        "--export.path", str(export),
    ]
    for _ in range(2):
        main(args)
        assert (export / "adapter_config.json").exists() and (export / "adapter_model.safetensors").exists()
        assert not (export / "config.json").exists()


@pytest.mark.filterwarnings("ignore:lit_align. resumed with another length")  # resumed with more steps on purpose
def test_lora_checkpoint_resumes_the_adapters(tmp_path, rows_path):
    module = DPOModule(model="builtin:tiny", peft_config=LORA, learning_rate=1e-2)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="last", every_n_train_steps=2)
    fit(module, data(rows_path), tmp_path, max_steps=2, callbacks=[checkpoint], enable_checkpointing=True)
    trained = {k: v.detach().clone() for k, v in module.policy.state_dict().items()}

    class AtStart(L.Callback):
        def on_train_start(self, trainer, pl_module):
            self.state = {k: v.detach().clone() for k, v in pl_module.policy.state_dict().items()}

    at_start = AtStart()
    resumed = DPOModule(model="builtin:tiny", peft_config=LORA, learning_rate=1e-2)
    fit(resumed, data(rows_path), tmp_path, max_steps=3, callbacks=[at_start],
        ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert at_start.state.keys() == trained.keys()
    assert all(torch.equal(at_start.state[k], trained[k]) for k in trained), "resume did not restore the adapters"


def test_lora_is_refused_under_sharded_strategies():
    from types import SimpleNamespace

    from lightning.pytorch.strategies import FSDPStrategy

    with pytest.raises(LitAlignError, match="LoRA is not supported under FSDP"):
        lora = DPOModule(model="builtin:tiny", peft_config=LORA)
        lora._trainer = SimpleNamespace(strategy=FSDPStrategy())
        lora.configure_model()
