"""Pure-Python wheels that travel with the working tree to a machine that cannot reach a package index (a GPU
machine lent for a benchmark): downloaded here once, used there only where that machine lacks a package or has one
too old for what needs it.

    python bench/gpu_vs_trl.py --vendor     # here, with pip access: fills bench/wheels (untracked; do not commit it)

``download`` takes the distributions a bench's child processes import (measured: a child imports them and lists
them), with what they require, and keeps the pure-Python ones (installed from a ``*-none-any`` wheel) at this
environment's versions; left out: what torch requires (any machine that runs the bench has it), lit_align (the
working tree carries it) and ``kernels`` (compiled; the bench runs with Hub kernels off, as an offline machine
must). It writes ``VENDORED.json`` beside them: the wheels, the lit_align commit and a hash of its sources at that
moment (a copy of the tree without ``.git`` still names its commit while its sources are unchanged).

``use`` (at the start of the bench, before any child starts) chooses the wheels (``needed``: from lit_align's
requirements and the pinned ones, a wheel where what is installed does not satisfy), unpacks them into a folder
under the temporary directory and puts it first on ``sys.path`` and ``PYTHONPATH``, so the children import them;
the rest of the machine's packages stay. A wheel is a zip archive laid out as ``site-packages`` is, so unpacking
installs it, without pip or network.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as metadata
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEELS = Path(__file__).resolve().parent / "wheels"
NEVER = {"lit-align", "kernels"}  # the working tree carries the one; the other is compiled, and the bench runs
# with Hub kernels off (an offline machine cannot fetch them)


def normalized(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def pure(dist: metadata.Distribution) -> bool:
    """Whether ``dist`` was installed from a pure-Python wheel (its ``WHEEL`` tags end in ``-none-any``)."""
    wheel = dist.read_text("WHEEL") or ""
    tags = [line.split(":", 1)[1].strip() for line in wheel.splitlines() if line.startswith("Tag:")]
    return bool(tags) and all(tag.endswith("-none-any") for tag in tags)


def closure(names, stop: set[str] = frozenset()) -> set[str]:
    """``names`` and what they require here, directly or not (normalized; extras left out; not through ``stop``)."""
    from packaging.requirements import Requirement

    found, todo = set(), list(names)
    while todo:
        name = normalized(todo.pop())
        if name in found or name in stop:
            continue
        found.add(name)
        try:
            needs = [Requirement(r) for r in metadata.requires(name) or []]
        except metadata.PackageNotFoundError:
            continue
        todo += [r.name for r in needs if r.marker is None or r.marker.evaluate({"extra": ""})]
    return found


def source_hash() -> str:
    """sha256 (12 hex digits) of lit_align's ``*.py`` files, path and contents, in path order."""
    digest = hashlib.sha256()
    for path in sorted((ROOT / "lit_align").rglob("*.py")):
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def git_commit() -> str | None:
    """The checkout's commit, ``+changes`` when lit_align/ differs from it; None without git or a ``.git``."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--", "lit_align"], cwd=ROOT, capture_output=True,
                                 text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return commit + ("+changes" if changed else "")


def lit_align_version() -> str:
    """``<commit> (source <hash>)``: the git commit where there is a checkout, else the one ``VENDORED.json``
    recorded if the source is unchanged since, else the source hash alone."""
    digest, commit = source_hash(), git_commit()
    if commit is None:
        try:
            recorded = json.loads((WHEELS / "VENDORED.json").read_text())
        except (OSError, ValueError):
            recorded = {}
        commit = (f"{recorded['lit_align_commit']} (recorded at --vendor)" if recorded.get("source") == digest
                  else "unknown (no git checkout here)")
    return f"{commit}, source {digest}"


def download(imported: list[str], python_version: str) -> list[Path]:
    """``pip download`` the pure-Python wheels of the distributions ``imported`` (by the bench's children here) and
    what they require, at this environment's versions, for ``python_version`` into ``WHEELS``; write
    ``VENDORED.json``; return the wheel files."""
    skip = NEVER | closure(["torch"])
    wanted = {}
    for name in sorted(closure(imported, stop=skip) - skip):
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:  # a requirement not installed here: not needed by what ran here
            continue
        if pure(dist):
            wanted[name] = dist.version
    WHEELS.mkdir(exist_ok=True)
    for old in WHEELS.glob("*.whl"):
        old.unlink()
    cmd = [sys.executable, "-m", "pip", "download", "-qq", "--no-deps", "--only-binary=:all:",
           "--python-version", python_version, "-d", str(WHEELS), *(f"{n}=={v}" for n, v in wanted.items())]
    if subprocess.run(cmd).returncode != 0:
        raise SystemExit(f"error: pip download failed for {len(wanted)} wheels into {WHEELS}")
    wheels = sorted(WHEELS.glob("*.whl"))
    (WHEELS / "VENDORED.json").write_text(json.dumps(
        {"python": python_version, "wheels": [w.name for w in wheels], "lit_align_commit": git_commit() or "unknown",
         "source": source_hash()}, indent=1) + "\n")
    return wheels


def wheel_name(path: Path) -> tuple[str, str]:
    """``(distribution, version)`` from a wheel's file name (``name-version-...-none-any.whl``)."""
    name, version = path.name.split("-")[:2]
    return name, version


def wheel_requirements(wheel: Path, extras=()) -> list:
    """A wheel's ``Requires-Dist`` (``packaging`` Requirements) that apply here, with ``extras``."""
    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as archive:
        meta = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        lines = archive.read(meta).decode().splitlines()
    needs = [Requirement(line.split(":", 1)[1].strip()) for line in lines if line.startswith("Requires-Dist:")]
    return [r for r in needs if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in ("", *extras))]


def installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def needed(wheels: list[Path], roots: list[str]) -> list[tuple[Path, str]]:
    """The wheels to use, each with the version this interpreter has (``none``): from the requirements ``roots``
    down through the requirements of each wheel chosen, a wheel where what is installed does not satisfy a
    requirement (absent, or too old) and the wheel does. What is installed and satisfies stays in use: a package
    tied to a compiled one (pydantic to pydantic-core) is not replaced without need."""
    from packaging.requirements import Requirement

    by_name = {normalized(wheel_name(w)[0]): w for w in wheels}
    chosen: dict[str, tuple[Path, str]] = {}
    todo = [Requirement(r) for r in roots]
    while todo:
        requirement = todo.pop()
        name = normalized(requirement.name)
        wheel, have = by_name.get(name), installed(name)
        if wheel is None or name in chosen or (have and requirement.specifier.contains(have, prereleases=True)):
            continue
        if requirement.specifier.contains(wheel_name(wheel)[1], prereleases=True):
            chosen[name] = (wheel, have or "none")
            todo += wheel_requirements(wheel, requirement.extras)
    return sorted(chosen.values())


def project_requirements() -> list[str]:
    """lit_align's own requirements (``pyproject.toml``): a machine's older transformers is replaced by the wheel."""
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]


def use(pinned: list[str], wheels_dir: Path = WHEELS) -> list[str]:
    """Unpack the wheels of ``wheels_dir`` this interpreter needs (``needed`` for lit_align's requirements and the
    ``pinned`` distributions at their wheels' versions) and put them first on ``sys.path`` and ``PYTHONPATH``;
    return one note per wheel used (``trl 1.16.0 (here: none)``)."""
    wheels = sorted(wheels_dir.glob("*.whl"))
    if not wheels:
        return []
    if importlib.util.find_spec("packaging") is None:  # the machine has none: the wheel's, read in place (a wheel
        sys.path.insert(0, str(next(w for w in wheels if wheel_name(w)[0] == "packaging")))  # imports as a zip)
    versions = {normalized(wheel_name(w)[0]): wheel_name(w)[1] for w in wheels}
    roots = project_requirements() + [f"{n}=={versions[normalized(n)]}" for n in pinned if normalized(n) in versions]
    chosen = needed(wheels, roots)
    if not chosen:
        return []
    key = hashlib.sha256("".join(sorted(p.name for p, _ in chosen)).encode()).hexdigest()[:12]
    site = Path(tempfile.gettempdir()) / f"lit_align_wheels_{key}"
    if not (site / ".complete").exists():
        site.mkdir(exist_ok=True)
        for path, _ in chosen:
            with zipfile.ZipFile(path) as wheel:
                wheel.extractall(site)
        (site / ".complete").touch()
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    return [f"{wheel_name(p)[0]} {wheel_name(p)[1]} (here: {have})" for p, have in chosen]
