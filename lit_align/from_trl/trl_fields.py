"""TRL's command-line fields, read from TRL's own parsers once and kept in ``trl_fields.json`` (TRL is not a
runtime dependency of lit_align): for each ``trl`` command, every field its parser takes and what kind of value it
is. ``from-trl`` uses them to tell a TRL field it cannot translate from a mistyped one, a field of another command,
TRL's ``--no_<flag>`` switches, list fields and choices.

A field's kind is one word: ``bool`` (``bool!`` where TRL also takes ``--no_<name>``: its default is true),
``int``, ``float``, ``str``, ``list:<int|float|str>`` (TRL's ``nargs="+"``) or ``["choice", <the allowed
values>]``. ``python -m lit_align.from_trl.trl_fields`` writes the file again from the installed TRL; tests/from_trl
checks it matches.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

FILE = Path(__file__).with_name("trl_fields.json")
COMMANDS = ("sft", "dpo", "kto", "reward", "grpo", "rloo", "distillation")


def read_installed() -> dict:
    """The table from the installed TRL's parsers (``trl.scripts.<command>.make_parser``)."""
    import importlib

    import trl

    per_command = {}
    for command in COMMANDS:
        parser = importlib.import_module(f"trl.scripts.{command}").make_parser()
        fields = {}
        for action in parser._actions:
            name = action.option_strings[0][2:] if action.option_strings else ""
            if not name or name == "help" or name.startswith("no_"):
                continue
            fields[action.dest] = _kind(action, f"--no_{action.dest}" in parser._option_string_actions)
        per_command[command] = fields
    common = {k: v for k, v in per_command["sft"].items() if all(per_command[c].get(k) == v for c in COMMANDS)}
    return {"trl_version": trl.__version__, "common": common,
            "commands": {c: {k: v for k, v in f.items() if k not in common} for c, f in per_command.items()}}


def _kind(action, negatable: bool) -> str | list:
    if action.choices:
        return ["choice", *[str(c) for c in action.choices]]
    name = getattr(action.type, "__name__", "")
    scalar = name if name in ("int", "float") else "str"
    if action.nargs in ("+", "*"):
        return f"list:{scalar}"
    if name == "string_to_bool":
        return "bool!" if negatable else "bool"
    return scalar


@cache
def fields(command: str) -> dict[str, str | tuple]:
    """Every field ``trl <command>`` takes -> its kind (``trl_fields.json``)."""
    table = json.loads(FILE.read_text())
    merged = {**table["common"], **table["commands"][command]}
    return {k: tuple(v) if isinstance(v, list) else v for k, v in merged.items()}


def version() -> str:
    """The TRL version the table was read from."""
    return json.loads(FILE.read_text())["trl_version"]


def commands_with(name: str) -> list[str]:
    """The ``trl`` commands that take field ``name``."""
    return [c for c in COMMANDS if name in fields(c)]


if __name__ == "__main__":
    FILE.write_text(json.dumps(read_installed(), indent=0, sort_keys=True) + "\n")
    print(f"wrote {FILE}")
