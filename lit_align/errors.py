"""The one exception type users see for their own mistakes (bad data, bad paths, bad settings).

The console script prints it as a single ``error: ...`` line and exits with status 2; anything else is a bug and keeps
its traceback.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml


class LitAlignError(ValueError):
    """A problem with the user's input: the message names the file, row or field and what was expected."""


def one_line(exc: Exception, limit: int = 400) -> str:
    """An exception's message on one line (transformers' messages run over several; the first can end mid-sentence,
    e.g. "... from one of:"), cut at ``limit`` characters."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


WRONG_TYPE = re.compile(r"Expected a <class '([\w.]+)'>\. Got value: (.*)")
KEY = re.compile(r'Parser key "([^"]+)"')


def condensed(message: str, argv: list[str]) -> str:
    """jsonargparse's error ``message`` (nested over union subtypes, one line per attempt) as one line: the option's
    path and what it expected, or the message's lines joined; a config file YAML cannot read is named (``argv``:
    the command line, whose ``-c`` / ``--config`` files are read again to find it)."""
    wrong = WRONG_TYPE.search(message)
    if wrong is not None:
        keys = KEY.findall(message[: wrong.start()])
        path = ".init_args.".join(keys) if "class_path" in message else ".".join(keys)
        return f"{path}: expected {wrong.group(1)}, got {wrong.group(2).strip()!r}"
    noise = ("Does not validate against any of the Union subtypes", "Subtypes:", "Errors:", "Given value",
             "Expected a <class 'NoneType'>")
    lines = [line.strip().lstrip("- ") for line in message.splitlines()]
    text = KEY.sub(r"\1", " ".join(line for line in lines if line and not line.startswith(noise)))
    if "Problems parsing config" in text:
        files = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg in ("-c", "--config")]
        bad = [f for f in files if not _reads_as_yaml(f)]
        text = text.replace('"<unicode string>"', repr(bad[0]) if bad else "the config")
    return text


def _reads_as_yaml(path: str) -> bool:
    try:
        yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return False
    return True
