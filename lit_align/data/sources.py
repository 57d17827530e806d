"""Where rows come from: a built-in task, local files, or a ``datasets`` hub name; one error style for all of them."""

from __future__ import annotations

import codecs
import csv
import json
import math
from pathlib import Path

import datasets
import pyarrow as pa

from lit_align.data.tasks import BUILTIN_TASKS
from lit_align.errors import LitAlignError

BUILTIN_PREFIX = "builtin:"
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
# Text columns a CSV reader must keep as text: pandas would read "0012" as the integer 12.
TEXT_COLUMNS = ("prompt", "chosen", "rejected", "completion", "answer")
SINGLE_FILE_SPLIT = "train"  # what ``datasets`` calls a lone file's rows


class MissingSplit(LitAlignError):
    """The source has no split of that name (a single file has only ``train``); the data module says which of its
    options to set."""


def is_single_file(source: str) -> bool:
    """Whether ``source`` is one local data file (``.json``/``.jsonl``/``.csv``/``.parquet``, or any existing file),
    whose only split is ``train``."""
    if source.startswith(BUILTIN_PREFIX):
        return False
    path = Path(source).expanduser()
    return path.suffix.lower() in FILE_BUILDERS or path.is_file()


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
            raise MissingSplit(f"{source}: no split {split!r} (expected one of {sorted(task.sizes)})") from None

    path = Path(source).expanduser()
    if is_single_file(source):
        return _load_file(path, split)
    if source.startswith((".", "/", "~")) and not path.exists():
        raise LitAlignError(f"{source}: no such file or directory")
    try:
        return datasets.load_dataset(source, config_name, split=split)
    except ValueError as exc:
        kind = MissingSplit if str(exc).startswith("Unknown split") else LitAlignError  # datasets' words for it
        raise kind(f"{source}: {str(exc).splitlines()[0]}") from exc
    except Exception as exc:  # noqa: BLE001 - hub and file errors come in many types
        raise LitAlignError(f"could not load dataset {source!r} (split {split!r}): {str(exc).splitlines()[0]}") from exc


def check_mixture(path: str | None, mixture: list | None, sources: list) -> None:
    """Rows come from ``data.path`` or from a ``data.mixture`` of at least one source (``sources``: its
    ``DataSource`` objects), each with a finite weight > 0 (``interleave_datasets`` draws by them)."""
    if mixture is not None and not sources:
        raise LitAlignError("data.mixture is empty: list its sources ({path, split, weight, ...}), or leave it out "
                            "(null) to read data.path")
    if not sources and path is None:
        raise LitAlignError("data.path is null and there is no data.mixture: expected builtin:<task>, a local file or "
                            "a datasets hub name")
    for i, source in enumerate(sources):
        if not (math.isfinite(source.weight) and source.weight > 0):
            raise LitAlignError(f"data.mixture[{i}] ({source.path}): weight is {source.weight}, expected a finite "
                                "number > 0")
        if not 0 < source.fraction <= 1:
            raise LitAlignError(f"data.mixture[{i}] ({source.path}): fraction is {source.fraction}, expected a share "
                                "in (0, 1]")


def common_features(parts: list[datasets.Dataset]) -> list[datasets.Dataset]:
    """The sources of a mixture cast to one set of features, whatever their order: each column's types unified as
    Arrow promotes them (a column of nulls or of empty lists takes the other sources' type, ints and floats become
    floats); a column whose types do not unify (string prompts in one source, message prompts in another) is kept
    as JSON (``datasets.Json``), each row's value as it was."""
    features = {}
    for name in parts[0].column_names:
        kinds = [part.features[name] for part in parts]
        if all(kind == kinds[0] for kind in kinds):
            features[name] = kinds[0]
            continue
        try:
            schema = pa.unify_schemas([pa.schema([part.features.arrow_schema.field(name)]) for part in parts],
                                      promote_options="permissive")
            features[name] = datasets.Features.from_arrow_schema(schema)[name]
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            features[name] = datasets.Json()
    as_json = [name for name, kind in features.items() if isinstance(kind, datasets.Json)]
    # JSON text written here, not by datasets: it would take a string that parses as JSON ("13") for the number 13
    parts = [part.map(lambda row: {name: json.dumps(row[name]) for name in as_json}) if as_json else part
             for part in parts]
    return [part.cast(datasets.Features(features)) for part in parts]


def _bad_json_line(path: Path) -> str | None:
    """The first line of a JSON Lines file that is not JSON, as ``line N: what`` (pyarrow names a byte position
    within its block); None if every line reads."""
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            try:
                if line.strip():
                    json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as exc:
                return f"line {number}: {exc.msg} (column {exc.colno})"
    return None


def _load_file(path: Path, split: str) -> datasets.Dataset:
    if path.is_dir():
        raise LitAlignError(f"{path}: a directory, not a data file")
    if not path.is_file():
        raise LitAlignError(f"{path}: no such file")
    builder = FILE_BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise LitAlignError(f"{path}: unsupported file type (expected one of {sorted(FILE_BUILDERS)})")
    if split != SINGLE_FILE_SPLIT:
        raise MissingSplit(f"{path}: a single file has one split, {SINGLE_FILE_SPLIT!r}, not {split!r}")
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
        where = _bad_json_line(path) if path.suffix.lower() == ".jsonl" else None
        reason = where or (str(cause).splitlines()[0] if str(cause) else type(cause).__name__)
        raise LitAlignError(f"{path}: could not read as {builder}: {reason}") from exc
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
