"""Checkpoints that survive a crash mid-write: temp file in the target directory, fsync, atomic rename.

Lightning's ``TorchCheckpointIO`` serializes to memory, then writes through an fsspec transaction. For a local path
that transaction writes to ``tempfile.mkstemp()`` -- the system temp directory, not the checkpoint's -- and commits
with ``shutil.move``. When ``/tmp`` is another filesystem (a tmpfs, a container's overlay, a small root disk), the
move is a *copy into the final name*: a ``kill -9`` or a full disk during that copy leaves a truncated ``.ckpt``
where the previous one stood (and a whole checkpoint's worth of ``/tmp`` and RAM is spent). Nothing is fsynced, so a
power loss can leave a renamed but empty file.

``AtomicCheckpointIO`` writes straight to ``<dir>/.<name>.<random>.tmp`` (same filesystem), fsyncs it, ``os.replace``s
it onto the final name and fsyncs the directory: at every instant the final path holds either the previous
checkpoint or the complete new one. A write the file system refuses (a full disk: torch's writer then raises a
``RuntimeError`` whose context is the ``OSError``) removes the temp file and is one ``LitAlignError`` naming the
checkpoint. Remote paths (``s3://``, ...) keep Lightning's own handling. ``lit-align`` installs it whenever the
strategy would use the plain ``TorchCheckpointIO``.
"""

from __future__ import annotations

import os
import tempfile
from contextlib import suppress
from pathlib import Path
from typing import Any

import torch
from fsspec.utils import get_protocol
from lightning.pytorch.plugins.io import TorchCheckpointIO

from lit_align.errors import LitAlignError


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local saves are atomic and durable (see the module docstring)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None or get_protocol(str(path)) != "file":
            return super().save_checkpoint(checkpoint, path, storage_options)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes it owner-only; a checkpoint gets the usual mode
            with os.fdopen(fd, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException as exc:
            with suppress(OSError):
                os.unlink(tmp)
            refused = _os_error(exc)
            if refused is None:
                raise
            raise LitAlignError(f"checkpoint {path} could not be written ({refused.strerror or refused}); the previous "
                                "checkpoint there, if any, is whole") from exc
        _fsync_dir(path.parent)


def _os_error(exc: BaseException | None) -> OSError | None:
    """The ``OSError`` behind a failed write: ``exc`` itself, or what it was raised from or while handling (torch's
    writer turns a failed ``write`` into a ``RuntimeError`` raised during the ``OSError``)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_dir(directory: Path) -> None:
    """Make the rename itself durable (POSIX; a no-op where directories cannot be opened)."""
    with suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
