"""Where rows come from: a built-in task, local files, or a ``datasets`` hub name; one error style for all of them."""

from __future__ import annotations

import codecs
import csv
import json
from pathlib import Path

import datasets

from lit_align.data.tasks import BUILTIN_TASKS
from lit_align.errors import LitAlignError

BUILTIN_PREFIX = "builtin:"
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
# Text columns a CSV reader must keep as text: pandas would read "0012" as the integer 12.
TEXT_COLUMNS = ("prompt", "chosen", "rejected", "completion", "answer")


def load_rows(source: str, split: str, kind: str, config_name: str | None = None) -> datasets.Dataset:
    """Load one split of ``source`` as a ``datasets.Dataset``.

    Args:
        source: ``builtin:<task>``, a local ``.json``/``.jsonl``/``.csv``/``.parquet`` file (its only split is
            ``train``), or anything ``datasets.load_dataset`` takes (a hub name, a local dataset directory).
        split: the split to read.
        kind: which rows a built-in task should produce: ``preference``, ``prompt`` or ``completion``.
        config_name: the dataset configuration (hub datasets with several).
    """
    if source.startswith(BUILTIN_PREFIX):
        name = source[len(BUILTIN_PREFIX) :]
        if name not in BUILTIN_TASKS:
            raise LitAlignError(f"unknown built-in task {source!r}: expected one of {[BUILTIN_PREFIX + n for n in BUILTIN_TASKS]}")
        task = BUILTIN_TASKS[name]()
        try:
            return getattr(task, f"{kind}_rows")(split)
        except KeyError:
            raise LitAlignError(f"{source}: no split {split!r} (expected one of {sorted(task.sizes)})") from None

    path = Path(source).expanduser()
    if path.suffix.lower() in FILE_BUILDERS or path.is_file():
        return _load_file(path, split)
    if source.startswith((".", "/", "~")) and not path.exists():
        raise LitAlignError(f"{source}: no such file or directory")
    try:
        return datasets.load_dataset(source, config_name, split=split)
    except ValueError as exc:
        raise LitAlignError(f"{source}: {str(exc).splitlines()[0]}") from exc
    except Exception as exc:  # noqa: BLE001 - hub and file errors come in many types
        raise LitAlignError(f"could not load dataset {source!r} (split {split!r}): {str(exc).splitlines()[0]}") from exc


def _load_file(path: Path, split: str) -> datasets.Dataset:
    if path.is_dir():
        raise LitAlignError(f"{path}: a directory, not a data file")
    if not path.is_file():
        raise LitAlignError(f"{path}: no such file")
    builder = FILE_BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise LitAlignError(f"{path}: unsupported file type (expected one of {sorted(FILE_BUILDERS)})")
    if split != "train":
        raise LitAlignError(f"{path}: a single file only has the split 'train', not {split!r} (use a separate file)")
    size = path.stat().st_size
    if size == 0 or (size < 4096 and not path.read_bytes().strip()):
        raise LitAlignError(f"{path}: the file is empty")
    if builder in ("json", "csv"):
        _check_utf8(path)  # pyarrow keeps invalid bytes and fails only when a row is read, with a traceback
    kwargs = {}
    if builder == "csv":
        kwargs["converters"] = {c: str for c in _csv_header(path) if c in TEXT_COLUMNS}
    try:
        rows = datasets.load_dataset(builder, data_files=str(path), split="train", **kwargs)
    except Exception as exc:  # noqa: BLE001 - pyarrow/json errors: keep the first line, name the file
        cause = exc.__cause__ or exc
        raise LitAlignError(f"{path}: could not read as {builder}: {str(cause).splitlines()[0] if str(cause) else type(cause).__name__}") from exc
    if len(rows) == 0:
        raise LitAlignError(f"{path}: no rows")
    if builder == "json":
        mixed = [c for c, feature in rows.features.items() if isinstance(feature, datasets.Json)]
        if mixed:  # datasets re-reads such a column as JSON text, which turns the string "13" into the number 13
            _raise_on_mixed_types(path, mixed)
    return rows


def _check_utf8(path: Path, chunk_size: int = 1 << 24) -> None:
    """Raise naming the line of the first byte that is not UTF-8 (read in chunks: files can be large)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    line = 1
    with path.open("rb") as f:
        while chunk := f.read(chunk_size):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as exc:
                start = max(exc.start - len(exc.object) + len(chunk), 0)  # the decoder may hold a partial character
                line += chunk[:start].count(b"\n")
                raise LitAlignError(f"{path} line {line}: not valid UTF-8 (byte {chunk[start]:#04x}); "
                                    "save the file as UTF-8") from None
            line += chunk.count(b"\n")
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise LitAlignError(f"{path} line {line}: not valid UTF-8 (the file ends inside a character)") from None


def _csv_header(path: Path) -> list[str]:
    try:
        with path.open(newline="", encoding="utf-8") as f:
            return next(csv.reader(f), [])
    except (OSError, UnicodeDecodeError, csv.Error):
        return []  # the CSV reader reports it


def _raise_on_mixed_types(path: Path, columns: list[str]) -> None:
    """Name the first row whose value in one of ``columns`` has another JSON type than the column's first value."""
    try:
        text = path.read_text(encoding="utf-8")
        if text.lstrip().startswith("["):
            rows = json.loads(text)
        else:
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    except (OSError, ValueError):
        return
    names = {int: "number", float: "number", str: "string", list: "list", dict: "object", bool: "boolean"}
    for column in columns:
        first = None
        for i, row in enumerate(rows):
            value = row.get(column) if isinstance(row, dict) else None
            if value is None:
                continue
            kind = names.get(type(value), type(value).__name__)
            if first is None:
                first = (i, kind)
            elif kind != first[1]:
                raise LitAlignError(
                    f"{path} row {i}: field {column!r} is a {kind}, but row {first[0]}'s is a {first[1]} "
                    "(a column must have one type)"
                )
