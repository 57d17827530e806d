"""Where an export may go, and how it replaces an older one: lit_align deletes only what it wrote.

Every export carries ``lit_align_export.json``, a manifest of what it wrote (each file's path, size and modification
time). A target may be replaced only when it is an empty directory, or such an export unchanged since: a file added or
edited in it afterwards (``notes.txt``, a retouched ``README.md``) is the user's. Anything else -- a project holding a
``config.json``, a model downloaded from the Hub, a file -- is refused, before training. A target that does not exist
must be creatable: its nearest existing parent is a directory that takes a new directory (probed, then removed).

The export is written into a hidden staging directory beside the target and renamed in; the old export is renamed
aside and only its listed, unchanged files and directories are deleted. A failed write (a full disk) deletes the
staging directory and leaves the target as it was.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import uuid
from collections.abc import Callable
from pathlib import Path

from lightning.pytorch.utilities import rank_zero_warn
from safetensors import SafetensorError

from lit_align.errors import LitAlignError

MANIFEST = "lit_align_export.json"


def listing(folder: Path) -> dict[str, list[int] | None]:
    """Everything under ``folder`` but the manifest: relative path -> ``[size, mtime_ns]`` for a file, None for a
    directory, ``[-1, -1]`` for anything else (a link: lit_align never writes one)."""
    entries = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = Path(root, name)
            info = path.lstat()
            if stat.S_ISDIR(info.st_mode):
                entry = None
            elif stat.S_ISREG(info.st_mode):
                entry = [info.st_size, info.st_mtime_ns]
            else:
                entry = [-1, -1]
            entries[path.relative_to(folder).as_posix()] = entry
    entries.pop(MANIFEST, None)
    return entries


def read_manifest(folder: Path) -> dict[str, list[int] | None] | None:
    """What lit_align wrote into ``folder``, or None when ``folder`` is not a lit_align export."""
    try:
        return json.loads((folder / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_target(target: Path) -> None:
    """Refuse (``LitAlignError``) an export target that writing there would destroy, or that cannot be created."""
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise LitAlignError(f"export path {target} exists and is not a directory; refusing to replace it "
                            "(choose another export.path)")
    if not target.exists():
        return _check_creatable(target)
    entries = listing(target)
    manifest = read_manifest(target)
    if not entries and manifest is None:
        return  # an empty directory
    if manifest is None:
        raise LitAlignError(f"export path {target} holds files lit_align did not write (it is not a lit_align export: "
                            f"no {MANIFEST}); refusing to replace it (choose another export.path, or a new or empty "
                            "directory)")
    foreign = [path for path, entry in entries.items() if path not in manifest or manifest[path] != entry]
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise LitAlignError(f"export path {target} is a lit_align export, but {shown} in it were added or changed "
                            "since it was written; refusing to replace them (move them out, or choose another "
                            "export.path)")


def _check_creatable(target: Path) -> None:
    parent = target.parent
    while not parent.exists() and not parent.is_symlink():
        parent = parent.parent
    if not parent.is_dir():
        raise LitAlignError(f"export path {target} cannot be created: {parent} is not a directory")
    probe = parent / f".lit_align_probe.{uuid.uuid4().hex[:8]}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as exc:
        raise LitAlignError(f"export path {target} cannot be created: {parent} takes no new directory "
                            f"({exc.strerror})") from None


def write_export(target: Path, write: Callable[[Path], None]) -> None:
    """``write(folder)`` the export into a staging directory beside ``target``, list it in the manifest and rename it
    in place of ``target`` (whose old export is then deleted). A disk that fills up is one ``LitAlignError``, the
    staging directory gone and ``target`` as it was."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = _sibling(target, "partial")
    staging.mkdir()
    try:
        write(staging)
        (staging / MANIFEST).write_text(json.dumps({"written_by": "lit_align", "files": listing(staging)}, indent=1))
        _swap_in(staging, target)
    except BaseException as exc:
        shutil.rmtree(staging, ignore_errors=True)  # made above, under a fresh name: all of it is this export's
        if isinstance(exc, (OSError, SafetensorError)):
            raise LitAlignError(f"the export to {target} failed ({_reason(exc)}); nothing was left half-written and "
                                f"{target} is as it was") from exc
        raise


def _swap_in(staging: Path, target: Path) -> None:
    if not target.exists():
        staging.rename(target)
        return
    old = _sibling(target, "old")
    target.rename(old)
    try:
        staging.rename(target)
    except BaseException:
        old.rename(target)
        raise
    _delete_export(old)


def _delete_export(folder: Path) -> None:
    """Delete what the manifest lists and is unchanged, deepest first; keep anything else (and say so)."""
    manifest = read_manifest(folder) or {}
    for rel, entry in sorted(manifest.items(), reverse=True):  # "a/b" sorts after "a": children before parents
        path = folder / rel
        try:
            if entry is None:
                path.rmdir()
            elif [path.lstat().st_size, path.lstat().st_mtime_ns] == entry:
                path.unlink()
        except OSError:
            pass
    try:
        (folder / MANIFEST).unlink(missing_ok=True)
        folder.rmdir()
    except OSError:
        rank_zero_warn(f"lit_align: kept {folder}, the previous export's directory: it holds files lit_align did not "
                       "write")


def _sibling(target: Path, kind: str) -> Path:
    """A fresh hidden name beside ``target``: ``.<name>.<random>.<kind>``."""
    return target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.{kind}")


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError):
        return f"{exc.filename}: {exc.strerror}" if exc.filename else str(exc.strerror or exc)
    return " ".join(str(exc).split())[:300]
