"""What travels with an export: its model card (``README.md``), the run's config, and the upload to the Hugging Face
Hub (``huggingface_hub``, as TRL's ``push_to_hub``). ``HFExport`` calls these; the CLI tells it the command and the
resolved config."""

from __future__ import annotations

import inspect
from pathlib import Path

from lit_align.errors import LitAlignError
from lit_align.export_dir import MANIFEST

CONFIG_NAME = "lit_align_config.yaml"  # the run's resolved config, beside the weights


def is_hub_id(name: str | None) -> bool:
    """``org/name`` that is not a local path: what a card's metadata may cite as a model or dataset."""
    return (bool(name) and name.count("/") == 1 and not name.startswith((".", "/", "~"))
            and not Path(name).expanduser().exists())


def recipe_defaults(cls: type) -> dict:
    """Every ``__init__`` default of a module class, its bases' included: the options a config may leave out."""
    defaults = {}
    for klass in reversed(cls.__mro__):
        init = klass.__dict__.get("__init__")
        if init is not None:
            defaults.update({k: p.default for k, p in inspect.signature(init).parameters.items()
                             if p.default is not inspect.Parameter.empty})
    return defaults


def non_default_settings(module) -> dict:
    """The module's hyper-parameters that differ from its class's defaults, plus the ones that define a recipe."""
    defaults = recipe_defaults(type(module))
    always = ("learning_rate", "loss_type", "beta")
    return {k: v for k, v in module.hparams.items()
            if k != "model" and not k.startswith("_") and (k in always or k not in defaults or defaults[k] != v)}


def data_sources(datamodule) -> list[str]:
    mixture = getattr(datamodule, "mixture", None)
    if mixture:
        return [source.path for source in mixture]
    path = getattr(datamodule, "path", None)
    return [path] if path else []


def model_card(module, datamodule, metrics: dict[str, float], title: str, command: str | None = None,
               has_config: bool = False) -> str:
    """The export's ``README.md``: base model, recipe and its key settings, data, final metrics, how to reproduce."""
    recipe = type(module).__name__.removesuffix("Module")
    base = module.model_name
    sources = data_sources(datamodule)
    meta = ["---"]
    if is_hub_id(base):
        meta.append(f"base_model: {base}")
    meta += ["library_name: transformers", "tags:", "- lit_align", f"- {recipe.lower()}"]
    hub_data = [s for s in sources if is_hub_id(s)]
    if hub_data:
        meta += ["datasets:", *(f"- {s}" for s in hub_data)]
    meta.append("---")

    auto = getattr(module, "export_class", "AutoModelForCausalLM")
    settings = "\n".join(f"| `{k}` | `{v}` |" for k, v in non_default_settings(module).items())
    results = "\n".join(f"| `{k}` | {v:.4g} |" for k, v in sorted(metrics.items())) or "| (none logged) | |"
    data = ", ".join(f"`{s}`" for s in sources) or "(rows given in Python)"
    if has_config:
        how = (f"    lit-align fit -c {CONFIG_NAME}\n\n`{CONFIG_NAME}` (in this directory) is the run's resolved config"
               + (f"; the run was started as `{command}`." if command else "."))
    else:
        how = "Trained from Python (no `lit-align` config); the settings above are those that differ from the defaults."
    return "\n".join([
        *meta, "", f"# {title}", "",
        f"{recipe} of `{base}` with lit_align (`{type(module).__module__}.{type(module).__name__}`).", "",
        "## Recipe", "", "| setting | value |", "|---|---|", settings, "",
        "## Data", "", data, "",
        "## Final metrics", "", "| metric | value |", "|---|---|", results, "",
        "## Reproduce", "", how, "",
        "## Use", "", "```python", f"from transformers import {auto}, AutoTokenizer", "",
        f'model = {auto}.from_pretrained("<this directory or repo>")',
        'tokenizer = AutoTokenizer.from_pretrained("<this directory or repo>")', "```", "",
    ])


def check_hub_token() -> None:
    """Refuse ``push_to_hub`` before training when no token is configured (the upload would fail at the end)."""
    from huggingface_hub import get_token

    if get_token() is None:
        raise LitAlignError("export.push_to_hub needs a Hugging Face token: run `hf auth login` or set HF_TOKEN")


def push_to_hub(folder: Path, repo_id: str, private: bool | None, message: str) -> str:
    """Upload ``folder`` to the model repo ``repo_id`` (created if needed); returns the repo's URL. The folder stays
    as it is: a failed upload loses nothing. The export's manifest stays local: it describes these files on this
    disk."""
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        url = api.create_repo(repo_id, private=private, repo_type="model", exist_ok=True)
        api.upload_folder(repo_id=url.repo_id, folder_path=str(folder), commit_message=message, repo_type="model",
                          ignore_patterns=[MANIFEST])
    except Exception as exc:  # network, permissions, names: the user needs one line and the local export
        raise LitAlignError(f"export.push_to_hub to {repo_id!r} failed ({' '.join(str(exc).split())[:300]}); "
                            f"the model is saved at {folder}") from exc
    return str(url)
