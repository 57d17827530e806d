"""TRL's command line as TRL's parser reads it: ``--name value``, ``--name=value``, ``--name-with-dashes``, ``--name
a b c`` for a list field, a bare ``--flag`` (true), ``--no_flag`` (false, for the flags whose default is true); each
value typed by its field's kind in TRL's table (``trl_fields``), or by its text for a field TRL does not have."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

import yaml

from lit_align.errors import LitAlignError
from lit_align.from_trl.translate import COMMANDS, translate
from lit_align.from_trl.trl_fields import fields as trl_fields

TRUE, FALSE = ("yes", "true", "t", "y", "1"), ("no", "false", "f", "n", "0")  # TRL's string_to_bool
LIST_ALSO = {"report_to"}  # a str field in TRL 1.16, a list in the transformers its recipes were written for


def by_kind(text: str, kind: str | tuple | None, name: str) -> Any:
    """``text`` from the command line as TRL types field ``name`` of ``kind`` (None: a field TRL does not have,
    typed by its text: a bool, a number, None, a YAML list or mapping, else the string)."""
    low = text.lower()
    if kind in ("bool", "bool!"):
        if low not in TRUE + FALSE:
            raise LitAlignError(f"--{name} {text}: expected one of yes/no, true/false, t/f, y/n, 1/0")
        return low in TRUE
    if kind in ("int", "float", "list:int", "list:float"):
        if low in ("none", "null"):
            return None
        number = int if kind.endswith("int") else float
        try:
            return number(text)
        except ValueError:
            raise LitAlignError(f"--{name} {text}: expected {'an integer' if number is int else 'a number'}") from None
    if kind == "str" and text[:1] == "{":  # TrainingArguments' dict fields come as JSON text (model_init_kwargs)
        return _by_text(text)
    if kind is not None:
        return text  # str, choice, list:str: TRL keeps the text (a choice is checked with the file's values)
    return _by_text(text)


def _by_text(text: str) -> Any:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if text in ("None", "null"):
        return None
    for number in (int, float):
        try:
            return number(text)
        except ValueError:
            pass
    if text[:1] in "[{":
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError:
            pass
    return text


def command_line_fields(tokens: list[str], command: str) -> dict:
    """The fields ``trl <command>`` reads from ``tokens`` (what follows ``--config FILE`` on its command line)."""
    known = trl_fields(command)
    given: dict[str, list[str]] = {}
    name = None
    for token in tokens:
        if token.startswith("--"):
            name, has_value, value = token[2:].partition("=")
            name = name.replace("-", "_")
            given[name] = [value] if has_value else []
        elif name is None:
            raise LitAlignError(f"command line: {token!r} follows no --field (TRL's fields are --name value)")
        else:
            given[name].append(token)
    typed = {}
    for name, values in given.items():
        negated = name.startswith("no_") and known.get(name[3:]) == "bool!"
        field = name[3:] if negated else name
        kind = known.get(field)
        listed = isinstance(kind, str) and kind.startswith("list:") or field in LIST_ALSO
        if negated or (not values and kind in ("bool", "bool!", None)):
            if values:
                raise LitAlignError(f"--{name} takes no value, got {' '.join(values)!r}")
            typed[field] = not negated
        elif not values:
            raise LitAlignError(f"--{name}: expected a value")
        elif listed or (kind is None and len(values) > 1):
            typed[field] = [by_kind(v, kind and kind.replace("list:", ""), name) for v in values]
        elif len(values) > 1:
            raise LitAlignError(f"--{name} {' '.join(values)}: expected one value (TRL's field {field!r} is not a "
                                "list)")
        else:
            typed[field] = by_kind(values[0], kind, name)
    return typed


def read_file(path: str) -> Any:
    """A TRL config file's fields (YAML, as TRL reads it); a file that is missing or not YAML is one error."""
    try:
        return yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise LitAlignError(f"{path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise LitAlignError(f"{path}: not YAML ({' '.join(str(exc).split())})") from None


def main(argv: list[str]) -> None:
    """``lit-align from-trl COMMAND [--config FILE] [--field value ...] [-o OUT]``: TRL's command line, the fields
    given after the file overriding it (as in TRL); the config on standard output, or written to ``OUT``; what was
    dropped, one ``note:`` line each on standard error (and as comments at the top of the config)."""
    parser = argparse.ArgumentParser(
        prog="lit-align from-trl", usage="lit-align from-trl COMMAND [--config FILE] [--field value ...] [-o OUT]",
        description="Translate a TRL run (`trl COMMAND --config FILE --field value ...`) into a lit_align config for "
                    "`lit-align fit -c`; settings that change nothing trained are dropped with a note, the fields "
                    "without a lit_align equivalent refused. docs/trl_configs.md has the table.")
    parser.add_argument("command", choices=sorted(COMMANDS), help="the trl command")
    parser.add_argument("--config", help="the TRL config file (YAML), as `trl COMMAND --config FILE` reads it")
    parser.add_argument("-o", "--output", help="write the lit_align config here (default: standard output)")
    args, rest = parser.parse_known_args(argv)
    source = args.config or "the command line"
    notes: list[str] = []
    try:
        fields = {} if args.config is None else read_file(args.config)
        given = command_line_fields(rest, args.command)
        if isinstance(fields, dict):
            fields = {**fields, **given}
            if given and args.config is not None:
                source = f"{args.config} with the command line"
        config = translate(args.command, fields, source, notes)
        text = "".join([f"# lit-align from-trl {shlex.join(argv)}\n",
                        *(f"# {note}\n" for note in notes),
                        yaml.safe_dump(config, sort_keys=False, default_flow_style=False)])
        if args.output is not None and args.config is not None and (
                Path(args.output).resolve() == Path(args.config).resolve()):
            raise LitAlignError(f"-o {args.output} is the TRL config itself: write the translation to another file")
        if args.output is not None:
            try:
                Path(args.output).write_text(text)
            except OSError as exc:
                raise LitAlignError(f"{args.output}: {exc.strerror or exc}") from None
    except LitAlignError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    if args.output is None:
        sys.stdout.write(text)
    else:
        print(f"wrote {args.output}: lit-align fit -c {args.output}", file=sys.stderr)
