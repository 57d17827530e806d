"""lit_align.callbacks: when things happen. TR-DPO's reference sync (on schedule, exactly, across resumes) and the
completions logger (cadence, rows, the logger's table); HFExport and SigtermCheckpoint run in tests/e2e and
tests/test_cli.py, where a whole run is needed."""

from __future__ import annotations

import csv
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import FSDPStrategy

from helpers import fit
from lit_align.callbacks import CompletionsLogger, RefModelSync
from lit_align.data import PreferenceDataModule
from lit_align.errors import LitAlignError
from lit_align.modules import DPOModule
from test_generation_round import make_round


def sort_pairs() -> PreferenceDataModule:
    return PreferenceDataModule(path="builtin:sort", batch_size=4, max_length=32, val_split=None, shuffle=False)


# -- TR-DPO sync -------------------------------------------------------------------------------------------------------
class Snapshots(L.Callback):
    """The reference's and the policy's parameters at the start of every training batch."""

    def __init__(self):
        self.ref, self.policy, self.steps = [], [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.steps.append(trainer.global_step)
        self.ref.append([p.detach().clone() for p in pl_module.reference.model.parameters()])
        self.policy.append([p.detach().clone() for p in pl_module.policy.parameters()])


def test_sync_moves_the_reference_exactly_on_schedule(tmp_path, tiny_path):
    alpha, every = 0.25, 2
    snaps = Snapshots()
    module = DPOModule(model="builtin:tiny", learning_rate=1e-2, sync_ref_model=True, ref_model_sync_steps=every,
                       ref_model_mixup_alpha=alpha)
    # two batches per optimizer step: the sync must still happen once per step
    trainer = fit(module, sort_pairs(), tmp_path, max_steps=5, callbacks=[snaps], accumulate_grad_batches=2)
    sync = next(cb for cb in trainer.callbacks if isinstance(cb, RefModelSync))
    assert sync.synced_at == [2, 4]
    final_ref = [p.detach().clone() for p in module.reference.model.parameters()]
    final_policy = [p.detach().clone() for p in module.policy.parameters()]
    snaps.ref.append(final_ref)
    snaps.policy.append(final_policy)
    snaps.steps.append(5)
    for i in range(1, len(snaps.steps)):
        before, after = snaps.ref[i - 1], snaps.ref[i]
        synced = snaps.steps[i] != snaps.steps[i - 1] and snaps.steps[i] % every == 0
        if not synced:
            assert all(torch.equal(a, b) for a, b in zip(before, after)), f"reference moved at batch {i}"
            continue
        # the policy right after the optimizer step is the one seen at the next batch's start
        expected = [r.mul(1 - alpha).add(p, alpha=alpha) for r, p in zip(before, snaps.policy[i])]
        assert all(torch.equal(a, e) for a, e in zip(after, expected)), f"wrong mix at step {snaps.steps[i]}"
        assert not all(torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.filterwarnings("ignore:lit_align. resumed with another length")  # resumed with more steps on purpose
def test_sync_reference_survives_resume(tmp_path, tiny_path):
    module = DPOModule(model="builtin:tiny", learning_rate=1e-2, sync_ref_model=True, ref_model_sync_steps=2)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="last", every_n_train_steps=3)
    fit(module, sort_pairs(), tmp_path, max_steps=3, callbacks=[checkpoint], enable_checkpointing=True)
    synced_ref = [p.detach().clone() for p in module.reference.model.parameters()]

    class AtStart(L.Callback):
        def on_train_start(self, trainer, pl_module):
            self.ref = [p.detach().clone() for p in pl_module.reference.model.parameters()]

    at_start = AtStart()
    resumed = DPOModule(model="builtin:tiny", learning_rate=1e-2, sync_ref_model=True, ref_model_sync_steps=2)
    fit(resumed, sort_pairs(), tmp_path, max_steps=4, callbacks=[at_start],
        ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert all(torch.equal(a, b) for a, b in zip(at_start.ref, synced_ref)), "resume lost the synced reference"


def test_sync_does_not_repeat_on_resume_and_refuses_sharded_strategies():
    """A run resumed at a sync step (its first micro-batches still at that global step) does not mix again; FSDP and
    ZeRO-3, whose parameters are shards outside a forward, are refused with a clear error."""
    from types import SimpleNamespace


    module = DPOModule(model="builtin:tiny")
    module.configure_model()
    sync = RefModelSync(ref_model_sync_steps=2, ref_model_mixup_alpha=0.5)
    before = {k: v.clone() for k, v in module.reference.model.state_dict().items()}
    resumed = SimpleNamespace(global_step=2)
    sync.on_train_start(resumed, module)
    sync.on_train_batch_end(resumed, module, None, None, 0)
    assert sync.synced_at == [] and all(torch.equal(v, before[k]) for k, v in module.reference.model.state_dict().items())
    with pytest.raises(LitAlignError, match="not under FSDP or DeepSpeed ZeRO-3"):
        sync.on_fit_start(SimpleNamespace(strategy=FSDPStrategy()), module)


# -- CompletionsLogger ------------------------------------------------------------------------------------------------
class TableLogger:
    """A logger with ``log_table`` (as WandbLogger has): what CompletionsLogger sends it."""

    def __init__(self):
        self.tables = []

    def log_table(self, key, columns, data):
        self.tables.append((key, columns, data))


def test_completions_logger_writes_the_latest_round_at_its_cadence(tmp_path, capsys):
    logger = CompletionsLogger(every_n_steps=2, max_rows=3, num_completions_to_print=0)
    table = TableLogger()
    trainer = SimpleNamespace(is_global_zero=True, global_step=0, logger=None, default_root_dir=tmp_path,
                              loggers=[table])  # no version directory: the run's directory is default_root_dir
    module = SimpleNamespace(round=make_round())
    for step in (0, 1, 2, 2, 3, 4):  # step 2 twice: two micro-batches of one optimizer step
        trainer.global_step = step
        logger.on_train_batch_end(trainer, module, None, None, 0)
    with open(tmp_path / "completions.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "prompt", "completion", "reward", "advantage"]
    assert [r[0] for r in rows[1:]] == ["2"] * 3 + ["4"] * 3  # steps 2 and 4 once each, max_rows 3
    assert rows[1:4] == [["2", "a", "x", "1.0", "1.0"], ["2", "a", "y", "0.0", "-1.0"], ["2", "b", "z", "0.5", "0.5"]]
    assert [key for key, _, _ in table.tables] == ["completions", "completions"]
    assert table.tables[0][2] == [[2, "a", "x", 1.0, 1.0], [2, "a", "y", 0.0, -1.0], [2, "b", "z", 0.5, 0.5]]
    logger.on_train_batch_end(SimpleNamespace(**{**trainer.__dict__, "is_global_zero": False, "global_step": 6}),
                              module, None, None, 0)
    assert len(table.tables) == 2  # only rank 0 writes
    assert capsys.readouterr().out == ""  # num_completions_to_print 0: nothing on the console


def test_completions_go_to_the_console_and_to_tensorboard_with_each_rewards_column(tmp_path, capsys):
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = TensorBoardLogger(tmp_path, name="grpo", version="run")
    trainer = SimpleNamespace(is_global_zero=True, global_step=5, logger=tb, loggers=[tb], log_dir=tb.log_dir)
    latest = make_round()
    latest.prompts = [[{"role": "user", "content": "sort 31"}]] * 4  # conversational prompts
    latest.reward_funcs = {"exact": [1.0, 0.0, 0.0, 0.0], "format": [0.0, 0.0, 0.5, 0.0]}
    latest.extra = {"judge": ["ok", "no", "ok", "no"]}
    CompletionsLogger(every_n_steps=5, max_rows=2, num_completions_to_print=1).on_train_batch_end(
        trainer, SimpleNamespace(round=latest), None, None, 0)
    tb.finalize("success")

    printed = capsys.readouterr().out
    assert "Step 5" in printed and "user: sort 31" in printed and "judge" in printed
    assert "exact" in printed and "format" in printed and printed.count("user: sort 31") == 1  # one row printed
    events = EventAccumulator(tb.log_dir)
    events.Reload()
    (text,) = events.Tensors("completions/text_summary")
    markdown = text.tensor_proto.string_val[0].decode()
    assert text.step == 5
    assert markdown.splitlines()[0] == "| step | prompt | completion | reward | exact | format | advantage | judge |"
    assert markdown.splitlines()[2:] == ["| 5 | user: sort 31 | x | 1.000 | 1.000 | 0.000 | 1.000 | ok |",
                                         "| 5 | user: sort 31 | y | 0.000 | 0.000 | 0.000 | -1.000 | no |"]


class SharedDirLogger(L.pytorch.loggers.Logger):
    """A logger whose ``save_dir`` every run shares (as W&B's ``.``): what HFExport and CompletionsLogger must not
    write into."""

    name, version, save_dir = "project", "run-abc", "."

    def log_metrics(self, metrics, step=None):
        pass

    def log_hyperparams(self, params, *args, **kwargs):
        pass


def test_the_export_lands_in_the_runs_own_directory_under_any_logger(tmp_path, monkeypatch):
    from lit_align.callbacks import HFExport

    monkeypatch.chdir(tmp_path)  # the shared save_dir "." is here
    export = HFExport()
    fit(DPOModule(model="builtin:tiny"), sort_pairs(), tmp_path / "root", callbacks=[export],
        logger=SharedDirLogger())
    assert export.exported_to == tmp_path / "root" / "project" / "run-abc" / "hf_model"
    assert (export.exported_to / "config.json").exists() and not (tmp_path / "hf_model").exists()
