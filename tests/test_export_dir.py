"""lit_align.export_dir: an export replaces only a lit_align export unchanged since, and a failed write changes
nothing. Directly, and through ``lit-align fit`` (configs/dpo.yaml, one step) where a user meets it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import assert_one_line_error, run_main

from lit_align.errors import LitAlignError
from lit_align.export_dir import MANIFEST, check_target, write_export

DPO = str(Path(__file__).resolve().parents[1] / "configs" / "dpo.yaml")


def write_files(files: dict[str, str]):
    """A ``write(folder)`` for ``write_export`` that writes ``files`` (relative path -> text)."""

    def write(folder: Path) -> None:
        for rel, text in files.items():
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            (folder / rel).write_text(text)

    return write


def test_the_manifest_lists_every_file_and_directory_written_and_a_rewrite_replaces_them(tmp_path):
    target = tmp_path / "model"
    write_export(target, write_files({"config.json": "{}", "sub/w.bin": "1234"}))
    manifest = json.loads((target / MANIFEST).read_text())
    assert manifest["written_by"] == "lit_align"
    assert sorted(manifest["files"]) == ["config.json", "sub", "sub/w.bin"]
    assert manifest["files"]["sub"] is None and manifest["files"]["sub/w.bin"][0] == 4  # size in bytes

    check_target(target)  # its own export, unchanged: may be replaced
    write_export(target, write_files({"config.json": "{\"v\": 2}"}))
    assert sorted(p.name for p in target.iterdir()) == ["config.json", MANIFEST]  # sub/ was the old export's
    assert (target / "config.json").read_text() == '{"v": 2}'
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no staging or old directory left beside it


def test_a_failing_write_leaves_the_target_as_it_was_and_a_bug_keeps_its_type(tmp_path):
    target = tmp_path / "model"
    write_export(target, write_files({"config.json": "{}"}))
    before = {p.name: p.read_bytes() for p in target.iterdir()}

    def full_disk(folder: Path) -> None:
        (folder / "half.bin").write_text("12")
        raise OSError(28, "No space left on device", str(folder / "half.bin"))

    with pytest.raises(LitAlignError, match=r"the export to .*model failed \(.*half.bin: No space left on device\); "
                                            "nothing was left half-written"):
        write_export(target, full_disk)
    with pytest.raises(ZeroDivisionError):
        write_export(target, lambda folder: 1 / 0)
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_a_link_as_target_is_refused(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(LitAlignError, match="exists and is not a directory; refusing to replace it"):
        check_target(tmp_path / "link")


def export_run(tmp_path, capfd, target, *extra):
    """configs/dpo.yaml for one step (or ``extra``'s) exporting to ``target``; its training batches are recorded under
    ``tmp_path / "seen"`` at the end of training, so a refusal before training leaves no such directory."""
    return run_main(["fit", "-c", DPO, "--trainer.max_steps", "1", "--data.init_args.val_split", "null",
                     "--trainer.enable_progress_bar", "false", "--trainer.logger", "false",
                     "--trainer.enable_checkpointing", "false", "--trainer.default_root_dir", str(tmp_path),
                     "--export.path", str(target), "--trainer.callbacks+=helpers.RecordBatches",
                     f"--trainer.callbacks.out_dir={tmp_path / 'seen'}", *extra], capfd)


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder``, by relative path, with its bytes."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def user_project(root: Path, tiny_path: str) -> Path:
    """A directory holding a ``config.json`` that is not a model (``mkdir -p proj/src; echo '{"app":1}' > ...``)."""
    (root / "src").mkdir(parents=True)
    (root / "config.json").write_text('{"app":1}\n')
    (root / "src" / "main.py").write_text("keep\n")
    return root


def downloaded_model(root: Path, tiny_path: str) -> Path:
    """A Hugging Face model directory lit_align did not write (the user's downloaded model)."""
    shutil.copytree(tiny_path, root)
    return root


def notes_dir(root: Path, tiny_path: str) -> Path:
    root.mkdir()
    (root / "notes.txt").write_text("keep me")
    return root


@pytest.mark.parametrize("make", [user_project, downloaded_model, notes_dir])
def test_export_never_replaces_a_directory_lit_align_did_not_write(tmp_path, capfd, tiny_path, make):
    target = make(tmp_path / "target", tiny_path)
    before = snapshot(target)
    code, _, err = export_run(tmp_path, capfd, target)
    assert_one_line_error(code, err, f"export path {target} holds files lit_align did not write",
                          "choose another export.path")
    assert snapshot(target) == before  # byte for byte, src/main.py included
    assert not (tmp_path / "seen").exists()  # refused before training, not after it


def test_a_lit_align_export_is_replaced_but_not_once_the_user_added_to_it(tmp_path, capfd):
    target = tmp_path / "model"
    code, _, err = export_run(tmp_path, capfd, target)
    assert code == 0, err
    assert (target / "lit_align_export.json").exists()
    first = snapshot(target)

    code, _, err = export_run(tmp_path, capfd, target, "--trainer.max_steps", "2")  # replaced by the newer export
    assert code == 0, err
    second = snapshot(target)
    assert second.keys() == first.keys() and second["model.safetensors"] != first["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "model", "seen"]  # no staging, no old one

    (target / "notes.txt").write_text("mine")  # the user's file inside the export: refused, nothing deleted
    shutil.rmtree(tmp_path / "seen")
    code, _, err = export_run(tmp_path, capfd, target)
    assert_one_line_error(code, err, f"export path {target} is a lit_align export, but notes.txt in it were added "
                                     "or changed since it was written")
    assert snapshot(target) == {**second, "notes.txt": b"mine"}
    assert not (tmp_path / "seen").exists()

    (target / "notes.txt").unlink()
    (target / "README.md").write_text("my edited card")  # one of its own files, edited: the user's now
    code, _, err = export_run(tmp_path, capfd, target)
    assert_one_line_error(code, err, "but README.md in it were added or changed")


def test_an_export_path_that_cannot_be_created_is_refused_before_training_and_an_empty_one_is_taken(tmp_path, capfd):
    blocker = tmp_path / "a_file"
    blocker.write_text("mine")
    for target, needle in [(blocker / "model", f"cannot be created: {blocker} is not a directory"),
                           (Path("/proc/lit_align_test/model"), "cannot be created: /proc takes no new directory"),
                           (blocker, "exists and is not a directory")]:
        code, _, err = export_run(tmp_path, capfd, target)
        assert_one_line_error(code, err, f"export path {target} ", needle)
        assert not (tmp_path / "seen").exists()
    assert blocker.read_text() == "mine"

    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = export_run(tmp_path, capfd, empty)
    assert code == 0, err
    assert (empty / "config.json").exists() and (empty / "lit_align_export.json").exists()


def test_a_full_disk_during_the_export_leaves_the_previous_export_whole(tmp_path, capfd, monkeypatch):
    """safetensors fails as on a full disk, half the weights written: one line, no staging directory left, and the
    previous export exactly as it was."""
    import transformers.modeling_utils
    from safetensors import SafetensorError
    from safetensors.torch import save as to_bytes

    target = tmp_path / "model"
    code, _, err = export_run(tmp_path, capfd, target)
    assert code == 0, err
    before = snapshot(target)

    def disk_fills_up(tensors, filename, metadata=None):
        data = to_bytes(tensors, metadata=metadata)
        Path(filename).write_bytes(data[: len(data) // 2])
        raise SafetensorError('Error while serializing: I/O error: No space left on device (os error 28)')

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", disk_fills_up)
    code, _, err = export_run(tmp_path, capfd, target, "--trainer.max_steps", "2")
    assert_one_line_error(code, err, f"the export to {target} failed (Error while serializing: I/O error: No space "
                                     f"left on device (os error 28)); nothing was left half-written and {target} is "
                                     "as it was")
    assert snapshot(target) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "model", "seen"]
