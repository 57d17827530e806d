"""The README and docs/ cannot rot silently: every relative link resolves (the file, and the heading an ``#anchor``
names, with GitHub's heading slugs), every shipped config is named on some page, and every repository path a page
names (``bench/x.py``, ``tests/e2e/test_y.py``, ``lit_align/z.py``, in prose or in a command) exists. The README stays
a page a newcomer reads in ten minutes, linking every page of docs/."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
CONFIGS = sorted(p.relative_to(REPO / "configs") for p in (REPO / "configs").rglob("*.yaml"))

FENCE = re.compile(r"^```.*?^```", re.M | re.S)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\n]+)`")
PATH = re.compile(r"(?<![\w/.-])((?:lit_align|tests|bench|configs|docs)/[\w./{},*<>-]*)")  # a repository path, anywhere


def prose(page: Path) -> str:
    """The page without its fenced code blocks (a ``[x](y)`` in code is not a link)."""
    return FENCE.sub("", page.read_text())


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (``-`` and ``_`` kept), spaces to ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor on a page; a repeated heading gets ``-1``, ``-2``, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} (.+)$", prose(page), re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def expand(name: str) -> list[str]:
    """``configs/{sft,grpo}_tools.yaml`` -> both names (one brace group, as the pages write them)."""
    m = re.search(r"\{([^{}]*)\}", name)
    if not m:
        return [name]
    return [n for part in m.group(1).split(",") for n in expand(name[:m.start()] + part + name[m.end():])]


def is_pattern(name: str) -> bool:
    """``configs/<recipe>.yaml``, ``lit_align/X/Y.py``, ``tests/X/test_Y*.py``: a pattern the text explains, no path."""
    return "<" in name or "*" in name or any(re.fullmatch(r"[A-Z]", Path(part).stem) for part in name.split("/"))


def test_the_docs_pages_exist():
    assert len(PAGES) > 1, "docs/ has no pages"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in LINK.findall(prose(page)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file.relative_to(REPO) if file.is_relative_to(REPO) else file}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading with anchor #{anchor} in {file.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}: broken links:\n" + "\n".join(broken)


def test_every_shipped_config_is_named_on_some_page():
    named = set()
    for page in PAGES:
        text = page.read_text()
        named |= {name.removeprefix("configs/") for path in PATH.findall(text) for name in expand(path)}
        named |= {name for code in CODE.findall(text) for word in code.split() for name in expand(word)}
    missing = [str(c) for c in CONFIGS if str(c) not in named and c.name not in named]
    assert not missing, f"configs no page names (README.md or docs/*.md): {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_repository_path_a_page_names_exists(page):
    missing = []
    for path in PATH.findall(page.read_text()):
        for name in expand(path.rstrip(",.;:")):
            if not is_pattern(name) and not (REPO / name).exists():
                missing.append(name)
    assert not missing, f"{page.relative_to(REPO)} names paths that do not exist: {sorted(set(missing))}"


def test_the_readme_is_short_and_links_every_docs_page():
    readme = REPO / "README.md"
    assert len(readme.read_text().splitlines()) <= 300, "README.md is past 300 lines: move the detail to docs/"
    linked = {(readme.parent / t.partition("#")[0]).resolve() for t in LINK.findall(prose(readme))}
    unlinked = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


def test_every_make_target_the_pages_and_ci_name_exists():
    targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M))
    named = {(page.name, target) for page in [*PAGES, REPO / ".ci" / "run"]
             for target in re.findall(r"(?:^ *|`)make ([\w-]+)", page.read_text(), re.M)}
    quick_start = {("README.md", "demo"), ("README.md", "test")}
    assert quick_start <= named, "the README's quick start lost its commands"
    missing = sorted((page, target) for page, target in named if target not in targets)
    assert not missing, f"make targets the Makefile does not have: {missing}"
