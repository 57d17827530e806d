"""The one loader of what a config names by Python path (rewards, tools, environment factories, rollout functions):
what it resolves, what it builds, and the one-line error for each way a spec can be wrong."""

from __future__ import annotations

import collections

import pytest

from lit_align.errors import LitAlignError
from lit_align.imports import callable_name, import_object, load_callable
from lit_align.rewards import sort_exact

LABEL = "model.tools: {!r}"


class Scale:
    """A parametrised callable (``{class_path: test_imports.Scale, init_args: {factor: ...}}``)."""

    def __init__(self, factor: float):
        self.factor = factor

    def __call__(self, value: float) -> float:
        return self.factor * value


def test_import_object_resolves_a_dotted_path():
    assert import_object("lit_align.rewards.sort_exact") is sort_exact
    assert import_object("collections.OrderedDict") is collections.OrderedDict
    assert import_object("sort_exact") is None  # no dot: no module to look in
    with pytest.raises(ImportError):
        import_object("no_such_package_xyz.fn")
    with pytest.raises(AttributeError):
        import_object("lit_align.rewards.no_such_fn")


def test_load_callable_builds_a_class_path_with_its_init_args():
    assert load_callable("lit_align.rewards.sort_exact", LABEL, "a function") is sort_exact
    built = load_callable({"class_path": "test_imports.Scale", "init_args": {"factor": 3}}, LABEL, "a function")
    assert type(built).__name__ == "Scale" and built(2) == 6
    assert callable_name(built) == "Scale"  # an instance is named by its class
    assert callable_name(sort_exact) == "sort_exact"


@pytest.mark.parametrize("spec,message", [
    ("no.such.fn", r"^model.tools: 'no.such.fn': cannot import it \(No module named 'no'\)$"),
    ("lit_align.rewards.nope", r"^model.tools: 'lit_align.rewards.nope': cannot import it \(module "),
    ("sort_exact", r"^model.tools: 'sort_exact': expected a function$"),
    ("lit_align.rewards.math", r"^model.tools: 'lit_align.rewards.math': expected a function$"),
    ({"class_path": "lit_align.rewards.math"}, r"^model.tools: 'lit_align.rewards.math': expected a function$"),
    ({"class_path": "collections.Counter"},
     r"^model.tools: 'collections.Counter' is not callable \(expected a function, or a class with __call__\)$"),
    ({"class_path": "test_imports.Scale"}, r"^model.tools: 'test_imports.Scale': .*missing 1 required .*'factor'$"),
    ({"init_args": {}}, r"^model.tools: \{'init_args': \{\}\}: expected a function, or \{class_path, init_args\}$"),
    (5, r"^model.tools: 5: expected a function, or \{class_path, init_args\}$"),
])
def test_load_callable_refuses_each_mistake_in_one_line(spec, message):
    with pytest.raises(LitAlignError, match=message):
        load_callable(spec, LABEL, "a function")

