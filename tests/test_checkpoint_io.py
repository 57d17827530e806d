"""lit_align.checkpoint_io: ``AtomicCheckpointIO`` writes beside the target and renames; a refused write is one error.

Through ``lit-align fit`` (a full disk mid-run, ``kill -9`` mid-write, SIGTERM): tests/e2e/test_crash_safety.py.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from helpers import FillsUp
from lightning.pytorch.plugins.io import TorchCheckpointIO

from lit_align.checkpoint_io import AtomicCheckpointIO
from lit_align.errors import LitAlignError


def test_lightning_stages_local_checkpoints_in_the_system_temp_dir(tmp_path, monkeypatch):
    """The gap AtomicCheckpointIO closes: TorchCheckpointIO writes to tempfile.mkstemp() and moves the file into the
    checkpoint directory (``shutil.move``: a copy into the final name across filesystems)."""
    system_tmp, target = tmp_path / "system_tmp", tmp_path / "ckpt" / "a.ckpt"
    system_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(system_tmp))
    moves = []
    real_move = shutil.move
    monkeypatch.setattr(shutil, "move", lambda src, dst, *a, **k: moves.append((src, dst)) or real_move(src, dst, *a, **k))
    TorchCheckpointIO().save_checkpoint({"x": 1}, target)
    assert [(Path(src).parent, Path(dst)) for src, dst in moves] == [(system_tmp, target)]

    moves.clear()
    AtomicCheckpointIO().save_checkpoint({"x": 2}, target)
    assert moves == [] and not list(system_tmp.iterdir())
    assert torch.load(target, weights_only=True) == {"x": 2}
    assert [p.name for p in target.parent.iterdir()] == ["a.ckpt"]


def test_atomic_checkpoints_get_the_usual_file_mode(tmp_path):
    """Not mkstemp's owner-only 0600: a checkpoint is readable as any file this process writes."""
    mask = os.umask(0o022)
    try:
        AtomicCheckpointIO().save_checkpoint({"state": torch.zeros(2)}, tmp_path / "a.ckpt")
        (tmp_path / "plain").write_text("x")
    finally:
        os.umask(mask)
    assert (tmp_path / "a.ckpt").stat().st_mode & 0o777 == (tmp_path / "plain").stat().st_mode & 0o777 == 0o644


def test_a_full_disk_is_one_error_naming_the_checkpoint_and_the_previous_one_stays(tmp_path, monkeypatch):
    """torch's writer turns the ENOSPC into a RuntimeError raised while handling it: the cause is still found."""
    target = tmp_path / "ckpt" / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"global_step": 1, "w": torch.arange(4.0)}, target)
    real_save = torch.save
    monkeypatch.setattr(torch, "save", lambda obj, f, *a, **k: real_save(obj, FillsUp(f, 64), *a, **k))
    with pytest.raises(LitAlignError) as info:
        io.save_checkpoint({"global_step": 2, "w": torch.zeros(4096)}, target)
    assert str(info.value) == (f"checkpoint {target} could not be written (No space left on device); the previous "
                               "checkpoint there, if any, is whole")
    monkeypatch.setattr(torch, "save", real_save)
    assert [p.name for p in target.parent.iterdir()] == ["last.ckpt"]  # the temp file is gone
    saved = torch.load(target, weights_only=True)
    assert saved["global_step"] == 1 and saved["w"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_failure_that_is_not_the_file_systems_keeps_its_type_and_leaves_no_temp_file(tmp_path, monkeypatch):
    """A bug (here: an object torch cannot pickle) is not the user's mistake: it is raised as it was."""
    with pytest.raises(AttributeError):
        AtomicCheckpointIO().save_checkpoint({"fn": lambda: 0}, tmp_path / "a.ckpt")
    assert list(tmp_path.iterdir()) == []


def test_remote_paths_keep_lightnings_own_writer():
    """``memory://`` (an fsspec file system): no local temp file, Lightning's save, the checkpoint readable back."""
    import fsspec

    AtomicCheckpointIO().save_checkpoint({"x": torch.ones(3)}, "memory://lit_align_test/a.ckpt")
    with fsspec.open("memory://lit_align_test/a.ckpt", "rb") as f:
        assert torch.load(f, weights_only=True)["x"].tolist() == [1.0, 1.0, 1.0]
    assert fsspec.filesystem("memory").ls("/lit_align_test", detail=False) == ["/lit_align_test/a.ckpt"]
