"""Shared fixtures: an offline, throwaway environment for the whole session.

- ``$LIT_ALIGN_CACHE`` points at a session tmp dir, so ``builtin:tiny`` is built once per session (not in ~/.cache)
  and every subprocess a test starts reuses that build.
- One OpenMP thread per process unless ``OMP_NUM_THREADS`` says otherwise (see ``pytest_configure``).
- A test that writes into the repository (``STRAY``: a run directory, a resolved ``config.yaml``) fails the session.
- The Hugging Face hub is switched off (tests never download anything) and ``datasets`` caches into a tmp dir; both
  are read when ``datasets`` / ``huggingface_hub`` are imported, so they are set in ``pytest_configure``, before any
  test module imports lit_align.

Layout: ``tests/`` mirrors ``lit_align/``: ``lit_align/X/Y.py``'s tests are in ``tests/X/test_Y*.py`` (some names
carry a suffix: ``losses/test_dpo_losses.py``, ``modules/test_base_module.py``, ``data/test_prompts_data.py``,
``generation/test_native_engine.py``, ``generation/test_base_sampling.py``, ...). Not mirrored by name: the
``__init__`` re-exports and ``__main__`` (run by tests/test_cli.py's subprocesses) and ``pipeline.py``
(tests/e2e/test_pipeline.py). ``tests/e2e/`` runs ``lit-align fit`` end to end across modules.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "fixtures"

_HF_TMP: str | None = None


def pytest_configure(config):
    global _HF_TMP
    _HF_TMP = tempfile.mkdtemp(prefix="lit_align_tests_hf_")
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ["HF_DATASETS_CACHE"] = os.path.join(_HF_TMP, "datasets")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # One intra-op thread per process (set before torch is imported; subprocesses inherit it). The models are tiny,
    # and on a small shared machine two spinning OpenMP threads per process run several times slower, not faster.
    # Export OMP_NUM_THREADS to override.
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_unconfigure(config):
    if _HF_TMP:
        shutil.rmtree(_HF_TMP, ignore_errors=True)


# What a run writes where it starts when not told otherwise: a logger's runs (the shipped configs' ``save_dir: runs``,
# Lightning's ``lightning_logs``), a resolved ``config.yaml``, checkpoints. Tests write under their ``tmp_path``; one
# that writes here instead (a CLI run without ``--trainer.logger false`` or a ``save_dir``) fails the session, and
# under pytest-xdist two of them at once would race for the same version directory.
STRAY = ("runs", "lightning_logs", "config.yaml", "checkpoints")
_stray_before: set[Path] = set()


def stray_paths() -> set[Path]:
    found = {REPO / name for name in STRAY if (REPO / name).exists()}
    for path in list(found):
        found.update(path.rglob("*"))  # nothing below a file
    return found


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):  # the controlling process (or a run without xdist) checks
        _stray_before.update(stray_paths())


def pytest_sessionfinish(session, exitstatus):
    if hasattr(session.config, "workerinput"):
        return
    new = sorted(stray_paths() - _stray_before)
    if new:
        shown = ", ".join(str(path.relative_to(REPO)) for path in new[:5]) + (" ..." if len(new) > 5 else "")
        print(f"\ntests wrote into the repository, not under their tmp_path: {shown}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# The user's cache, read before the session's own replaces it: where `make pretrained` put the real models.
USER_CACHE = Path(os.environ.get("LIT_ALIGN_CACHE", Path.home() / ".cache" / "lit_align"))


@pytest.fixture
def user_cache(monkeypatch) -> Path:
    """``$LIT_ALIGN_CACHE`` set to the user's cache for one test: the slow tests of the real pretrained models."""
    monkeypatch.setenv("LIT_ALIGN_CACHE", str(USER_CACHE))
    return USER_CACHE


@pytest.fixture(scope="session", autouse=True)
def lit_align_cache(tmp_path_factory) -> Path:
    """``$LIT_ALIGN_CACHE`` for the session (subprocesses inherit it)."""
    path = tmp_path_factory.mktemp("lit_align_cache")
    old = os.environ.get("LIT_ALIGN_CACHE")
    os.environ["LIT_ALIGN_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("LIT_ALIGN_CACHE", None)
    else:
        os.environ["LIT_ALIGN_CACHE"] = old


@pytest.fixture(scope="session")
def tiny_path(lit_align_cache) -> str:
    """The built-in tiny model's directory (built on first use)."""
    from lit_align.models import resolve

    path = resolve("builtin:tiny")
    assert Path(path).is_relative_to(lit_align_cache)
    return path


@pytest.fixture(scope="session")
def tokenizer(tiny_path):
    from lit_align.models import load_tokenizer

    return load_tokenizer("builtin:tiny")


@pytest.fixture(scope="module")
def eos_heavy_model(tiny_path, tokenizer):
    """The tiny model with an lm_head bias towards EOS: some completions end early, others run to the cap."""
    import torch  # not at the top: OMP_NUM_THREADS must be set (pytest_configure) before torch loads

    from lit_align.models import load_model

    model = load_model("builtin:tiny")
    head = model.lm_head
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.zero_()
        biased.bias[tokenizer.eos_token_id] = 2.0
    model.lm_head = biased
    return model.train()


@pytest.fixture
def write_jsonl(tmp_path):
    """``write_jsonl(rows, name="rows.jsonl") -> path``: one JSON object per line, in ``tmp_path``."""

    def write(rows, name: str = "rows.jsonl") -> str:
        path = tmp_path / name
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        return str(path)

    return write

