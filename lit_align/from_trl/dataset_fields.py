"""TRL's dataset mixtures and the recipe repositories' dataset arguments, as lit_align's data settings."""

from __future__ import annotations

from typing import Any

from lit_align.from_trl.sections import Work


def mixture(work: Work) -> set[str]:
    """TRL's dataset mixture (``datasets``, ``streaming``, ``test_split_size``: its ``DatasetMixtureConfig``; a
    ``dataset_mixture: {datasets, seed, test_split_size}`` mapping as recipe repositories write it) as
    ``data.mixture``: every row of every source, in order (``concatenate``); a recipe's ``weight`` below 1 keeps
    that share of its source (``fraction``). TRL's own ``fraction`` (normalized shares, capped by the sources'
    sizes) has no equivalent: refused."""
    fields = work.fields
    given = fields.get("dataset_mixture")
    spec = dict(given) if isinstance(given, dict) else {}
    if given is not None and not isinstance(given, dict):
        work.refuse("dataset_mixture", f"is {given!r}: expected a mapping with 'datasets'")
    spec.setdefault("datasets", fields.get("datasets") or [])
    for name in ("streaming", "test_split_size"):
        if fields.get(name) is not None:
            spec.setdefault(name, fields[name])
    handled = {"datasets", "dataset_mixture", "streaming", "test_split_size"}
    if not spec["datasets"]:
        return handled
    if spec.get("streaming"):
        work.refuse("streaming", "is true: lit_align reads a dataset whole (it tokenizes the rows once)")
    sources = [s for s in (_source(work, i, d) for i, d in enumerate(spec["datasets"])) if s is not None]
    work.data["mixture"], work.data["path"] = sources, None
    if fields.get("dataset_name"):
        work.note("dataset_name", "TRL reads the dataset mixture instead")
    test = spec.get("test_split_size")
    if test is not None and work.fields.get("eval_strategy", "no") != "no":
        if isinstance(test, (int, float)) and not isinstance(test, bool) and (0 < test < 1 or (
                test >= 1 and float(test).is_integer())):
            work.data["val_fraction"] = test  # a fraction, or a count of rows (datasets' test_size)
        else:
            work.refuse("test_split_size", f"is {test!r}: expected a fraction in (0, 1) or a whole number of rows")
    if "seed" in spec and spec["seed"] != fields.get("seed"):
        work.note("dataset_mixture.seed", "lit_align's mixture is the rows in order; data.seed orders training")
    return handled


def _source(work: Work, i: int, given: Any) -> dict | None:
    """One mixture source as a ``DataSource`` mapping (TRL's ``path``/``name``, a recipe's ``id``/``config``)."""
    where = f"datasets[{i}]"
    if not isinstance(given, dict) or not (given.get("path") or given.get("id")):
        work.refuse(where, f"is {given!r}: expected a mapping with 'path' (or 'id')")
        return None
    share, weight = given.get("fraction"), given.get("weight")
    if share is not None and share != 1:  # TRL's: shares of the mixture, normalized and capped by the sources' sizes
        work.refuse(f"{where}.fraction", f"is {share}: TRL's normalized shares have no lit_align equivalent (a "
                    "recipe's 'weight', the share of a source kept, has: data.mixture[].fraction)")
    if weight is not None and not 0 < weight <= 1:
        work.refuse(f"{where}.weight", f"is {weight}: expected the share of the source kept, in (0, 1]")
    if given.get("data_dir") or given.get("data_files"):
        work.refuse(where, "sets 'data_dir'/'data_files': give the file itself as 'path'")
    source = {"path": given.get("path") or given["id"], "split": given.get("split", "train")}
    if given.get("name") or given.get("config"):
        source["config_name"] = given.get("name") or given["config"]
    if weight is not None and weight != 1:  # the first rows of a seeded shuffle, as the recipes' scripts keep them
        source["fraction"] = weight
    if given.get("columns"):  # which columns decide a row's format (chosen/rejected alone: the prompt inside them)
        source["columns"] = list(given["columns"])
    return source


def older_datasets(work: Work) -> set[str]:
    """The recipe repositories' older dataset arguments: alignment-handbook's ``dataset_mixer`` (``{name:
    fraction}``) with ``dataset_splits`` (the ``train`` ones train, the ``test`` ones validate), open-r1's
    ``dataset_prompt_column`` (renamed ``prompt``); ``dataset_configs``, which its script never read, noted. One
    whole source is ``data.path``; several, a mixture."""
    fields, data = work.fields, work.data
    if fields.get("dataset_configs") is not None:  # the old handbook's, beside dataset_mixer; open-r1 never read it
        work.note("dataset_configs", "the recipe's script read dataset_config; set data.config_name for another "
                  "configuration")
    column = fields.get("dataset_prompt_column")
    if column not in (None, "prompt"):  # open-r1: the column its prompts come from
        data["rename_columns"] = {**(data.get("rename_columns") or {}), column: "prompt"}
    mixer = fields.get("dataset_mixer")
    if mixer is None:
        return {"dataset_configs", "dataset_splits", "dataset_prompt_column"}
    splits = fields.get("dataset_splits") or ["train", "test"]
    train = [s for s in splits if "train" in s] or ["train"]
    test = [s for s in splits if "test" in s]
    if not isinstance(mixer, dict) or any(share != 1 for share in mixer.values()):
        work.refuse("dataset_mixer", f"is {mixer!r}: expected {{dataset: 1.0, ...}} (keeping a share of a source has "
                    "no lit_align equivalent)")
    elif len(mixer) == 1 and len(train) == 1:
        data["path"], data["train_split"] = next(iter(mixer)), train[0]
        if fields.get("eval_strategy", "no") != "no" and test:
            data["val_split"] = test[0]
    else:
        data["mixture"], data["path"] = [{"path": p, "split": s} for p in mixer for s in train], None
        if fields.get("eval_strategy", "no") != "no" and test:  # what is evaluated, not what is trained
            data["val_path"], data["val_split"] = next(iter(mixer)), test[0]
            work.notes.append(f"dataset_splits {test[0]!r} of several sources: validation on the first one's "
                              f"({data['val_path']}) only; data.val_path names one source")
    return {"dataset_mixer", "dataset_splits", "dataset_configs", "dataset_prompt_column"}
