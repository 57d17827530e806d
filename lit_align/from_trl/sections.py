"""The TRL fields whose value is translated, not only moved: the output directory, precision, epochs, evaluation,
checkpoints, loggers, LoRA, quantization, dataset mixtures and reward names. Each function reads ``work.fields``,
writes ``work.config`` and returns the names it handled; a value with no equivalent is a problem (``work.refuse``),
collected with the others, never raised alone."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LOGGERS = {"tensorboard": ("lightning.pytorch.loggers.TensorBoardLogger", "tensorboard"),
           "wandb": ("lightning.pytorch.loggers.WandbLogger", "wandb"),
           "mlflow": ("lightning.pytorch.loggers.MLFlowLogger", "mlflow"),
           "comet_ml": ("lightning.pytorch.loggers.CometLogger", "comet_ml"),
           "neptune": ("lightning.pytorch.loggers.NeptuneLogger", "neptune")}  # name -> (logger, its package)
TRL_LORA = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.05}  # ModelConfig's lora_r, lora_alpha, lora_dropout
LORA = {"lora_r": "r", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout",
        "lora_target_modules": "target_modules", "lora_target_parameters": "target_parameters",
        "lora_modules_to_save": "modules_to_save", "lora_task_type": "task_type", "use_rslora": "use_rslora",
        "use_dora": "use_dora"}
# TRL's GRPO/RLOO scripts' reward names (their ``reward_funcs_registry``) -> what they build, from ``trl.rewards``
TRL_REWARDS = {
    "accuracy_reward": "trl.rewards.accuracy_reward",
    "reasoning_accuracy_reward": "trl.rewards.reasoning_accuracy_reward",
    "think_format_reward": "trl.rewards.think_format_reward",
    "get_soft_overlong_punishment": {"class_path": "trl.rewards.get_soft_overlong_punishment",
                                     "init_args": {"max_completion_len": 1280, "soft_punish_cache": 256}},
}

# open-r1's GRPO script's reward names (its ``get_reward_funcs``) -> its functions, and the script arguments its
# factories take (with open-r1's defaults); with open-r1 installed where the run happens
OPEN_R1 = {
    "accuracy": "open_r1.rewards.accuracy_reward", "format": "open_r1.rewards.format_reward",
    "reasoning_steps": "open_r1.rewards.reasoning_steps_reward", "length": "open_r1.rewards.len_reward",
    "tag_count": "open_r1.rewards.tag_count_reward",
    "cosine": ("open_r1.rewards.get_cosine_scaled_reward", {
        "min_value_wrong": ("cosine_min_value_wrong", 0.0), "max_value_wrong": ("cosine_max_value_wrong", -0.5),
        "min_value_correct": ("cosine_min_value_correct", 0.5),
        "max_value_correct": ("cosine_max_value_correct", 1.0), "max_len": ("cosine_max_len", 1000)}),
    "repetition_penalty": ("open_r1.rewards.get_repetition_penalty_reward", {
        "ngram_size": ("repetition_n_grams", 3), "max_penalty": ("repetition_max_penalty", -1.0)}),
    "code_format": ("open_r1.rewards.get_code_format_reward", {"language": ("code_language", "python")}),
}
OPEN_R1_CODE = {"code", "binary_code", "ioi_code", "cf_code"}  # sandboxed: partial functions of the script's
OPEN_R1_ARGS = {"cosine_min_value_wrong", "cosine_max_value_wrong", "cosine_min_value_correct",
                "cosine_max_value_correct", "cosine_max_len", "repetition_n_grams", "repetition_max_penalty",
                "code_language", "code_eval_test_batch_size", "parallel_code_exec_per_proc", "e2b_router_url",
                "morph_router_url", "code_provider", "ioi_provider"}


@dataclass
class Work:
    """One translation in progress: the TRL fields, the config being written, what was handled, the notes (fields
    dropped, and why) and the problems (what cannot be translated: all of them are reported together)."""

    command: str
    fields: dict
    config: dict
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    origin: dict[str, str] = field(default_factory=dict)  # an option's dotted place -> the TRL field behind it

    @property
    def model(self) -> dict:
        return self.config["model"]["init_args"]

    @property
    def data(self) -> dict:
        return self.config["data"]["init_args"]

    @property
    def trainer(self) -> dict:
        return self.config["trainer"]

    def refuse(self, name: str, why: str) -> None:
        self.problems.append(f"{name!r} {why}")

    def note(self, name: str, why: str) -> None:
        self.notes.append(f"dropped {name} ({why})")

    def put(self, dotted: str, value: Any, override: bool = True) -> None:
        """``config[a][b]... = value`` for ``dotted`` ``"a.b..."``, under ``init_args`` for the model and the data
        (``override`` false: only where there is no such key yet)."""
        keys = dotted.split(".")
        if keys[0] in ("model", "data"):
            keys.insert(1, "init_args")
        node = self.config
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        if override or keys[-1] not in node:
            node[keys[-1]] = value

    def whole(self, name: str, default: int = 1) -> int:
        """Field ``name`` as a whole number (``default`` if it is not one, the problem noted)."""
        value = self.fields[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not float(value).is_integer():
            self.refuse(name, f"is {value!r}: expected a whole number here (lit_align counts whole epochs and steps)")
            return default
        return int(value)


def run_settings(work: Work) -> set[str]:
    """Where the run writes, how long it runs, its precision and device, progress bar, engine, completion logs."""
    fields, trainer = work.fields, work.trainer
    out = fields.get("output_dir")
    if out is not None:  # TRL's run directory; its final model is an HF directory inside it
        trainer["default_root_dir"] = out
        work.config["export"] = {"path": str(Path(out) / "hf_model")}
    fields["logging_steps"] = work.whole("logging_steps", 10)
    steps = fields.get("max_steps")
    if isinstance(steps, (int, float)) and steps > 0:  # TRL: max_steps overrides num_train_epochs
        trainer["max_epochs"] = -1
    else:
        trainer["max_epochs"] = work.whole("num_train_epochs", 3)
        fields.pop("max_steps", None)  # -1 (TRL's default) or none: no step limit
    bf16, fp16 = fields.get("bf16"), fields.get("fp16")
    if bf16 and fp16:
        work.refuse("bf16", "and 'fp16' are both true: expected at most one")
    elif bf16 or (bf16 is None and not fp16):  # TRL's default (None): bf16 unless fp16
        trainer["precision"] = "bf16-mixed"
    elif fp16:
        trainer["precision"] = "16-mixed"
    if fields.get("use_cpu"):
        trainer["accelerator"] = "cpu"
    if "disable_tqdm" in fields:
        trainer["enable_progress_bar"] = not fields["disable_tqdm"]
    if fields.get("use_vllm"):
        work.model["engine"] = "vllm"
    if fields.get("log_completions"):
        every = {"every_n_steps": fields["logging_steps"]}
        if "num_completions_to_print" in fields:
            every["num_completions_to_print"] = fields["num_completions_to_print"]
        trainer.setdefault("callbacks", []).append(
            {"class_path": "lit_align.callbacks.CompletionsLogger", "init_args": every})
    warmup = fields.get("warmup_steps")
    done = {"output_dir", "num_train_epochs", "bf16", "fp16", "use_cpu", "disable_tqdm", "use_vllm",
            "log_completions", "num_completions_to_print"}
    if isinstance(warmup, float) and 0 < warmup < 1:  # transformers: a warmup_steps below 1 is a ratio
        work.model["warmup_ratio"] = warmup
        done.add("warmup_steps")
    return done


def hub(work: Work) -> set[str]:
    """``push_to_hub``, ``hub_model_id``, ``hub_private_repo``: the export's upload (TRL's default repo: the output
    directory's name); ``hub_strategy`` and ``hub_token`` change nothing trained: noted."""
    fields = work.fields
    if fields.get("push_to_hub"):
        export = work.config.setdefault("export", {})
        repo = fields.get("hub_model_id") or Path(fields.get("output_dir") or "").name or None
        export.update(push_to_hub=True, hub_model_id=repo)
        if fields.get("hub_private_repo") is not None:
            export["hub_private_repo"] = fields["hub_private_repo"]
        if repo is None:
            work.refuse("push_to_hub", "needs 'hub_model_id' (or an 'output_dir' to name the repo after)")
        for name in ("hub_strategy", "hub_token", "hub_revision", "hub_always_push"):
            if fields.get(name) is not None:
                work.note(name, "lit_align uploads the final export once, at the end of the run")
    return {"push_to_hub", "hub_model_id", "hub_private_repo", "hub_strategy", "hub_token", "hub_revision",
            "hub_always_push"}


def lora(work: Work) -> set[str]:
    """``use_peft`` and the ``lora_*`` fields as ``model.peft_config``, with ``ModelConfig``'s defaults (not peft's:
    r 8, alpha 8, no dropout); without ``use_peft`` TRL reads none of them. A one-item ``lora_target_modules`` is
    its item (``all-linear``), as ``ModelConfig`` makes it."""
    if work.fields.get("use_peft"):
        config = {**TRL_LORA, **{LORA[k]: work.fields[k] for k in LORA if k in work.fields}}
        modules = config.get("target_modules")
        if isinstance(modules, list) and len(modules) == 1:
            config["target_modules"] = modules[0]
        work.model["peft_config"] = config
    return {"use_peft", *LORA}


def quantization(work: Work) -> set[str]:
    """``load_in_4bit`` / ``load_in_8bit``: the student loaded through bitsandbytes (``model_init_kwargs``'
    ``quantization_config``, lit_align's QLoRA), with the arguments TRL's ``get_quantization_config`` gives it."""
    fields = work.fields
    if fields.get("load_in_4bit") and fields.get("load_in_8bit"):
        work.refuse("load_in_4bit", "and 'load_in_8bit' are both true: expected at most one")
    elif fields.get("load_in_4bit"):
        quantized = {"load_in_4bit": True, "bnb_4bit_compute_dtype": fields.get("dtype") or "float32",
                     "bnb_4bit_quant_type": fields.get("bnb_4bit_quant_type", "nf4"),
                     "bnb_4bit_use_double_quant": bool(fields.get("use_bnb_nested_quant", False))}
        if fields.get("bnb_4bit_quant_storage") is not None:
            quantized["bnb_4bit_quant_storage"] = fields["bnb_4bit_quant_storage"]
        work.put("model.model_init_kwargs.quantization_config", quantized)
    elif fields.get("load_in_8bit"):
        work.put("model.model_init_kwargs.quantization_config", {"load_in_8bit": True})
    return {"load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type", "bnb_4bit_quant_storage", "use_bnb_nested_quant"}


def evaluation(work: Work) -> set[str]:
    """``eval_strategy`` / ``eval_steps``: TRL evaluates every ``eval_steps`` optimizer steps (``steps``), each
    epoch, or never (``no``, its default); Lightning's ``val_check_interval`` counts batches, optimizer steps
    times ``accumulate_grad_batches``."""
    fields, trainer = work.fields, work.trainer
    strategy = fields.get("eval_strategy", "no")
    trainer["num_sanity_val_steps"] = 0  # TRL evaluates before training only with eval_on_start
    if strategy == "no":  # nor is the test split read
        trainer["limit_val_batches"] = 0
        work.put("data.val_split", None)
    elif strategy == "steps":
        steps = fields.get("eval_steps")
        steps = fields["logging_steps"] if steps is None else steps  # TRL: None is logging_steps
        if isinstance(steps, float) and not steps.is_integer():  # a ratio of the run's steps, unknown here
            work.notes.append(f"eval_steps {steps} (a ratio of the run's steps): evaluated each epoch instead; set "
                              "trainer.val_check_interval to evaluate more often")
            trainer["check_val_every_n_epoch"] = 1
        else:
            trainer["val_check_interval"] = int(steps) * int(fields.get("gradient_accumulation_steps", 1))
            trainer["check_val_every_n_epoch"] = None
    elif strategy == "epoch":
        trainer["check_val_every_n_epoch"] = 1
    else:
        work.refuse("eval_strategy", f"is {strategy!r}: expected 'no', 'steps' or 'epoch'")
    return {"eval_strategy", "eval_steps"} | ({"dataset_test_split"} if strategy == "no" else set())


def checkpoints(work: Work) -> set[str]:
    """``save_strategy`` / ``save_steps`` / ``save_total_limit`` as a ``ModelCheckpoint``; left out, Lightning's
    default checkpoint (the last one)."""
    fields = work.fields
    strategy = fields.get("save_strategy")
    if strategy is None and "save_steps" not in fields and "save_total_limit" not in fields:
        return {"save_strategy"}
    strategy = strategy or "steps"
    if strategy == "no":
        work.trainer["enable_checkpointing"] = False
    elif strategy in ("steps", "epoch"):
        steps = fields.get("save_steps", 500)
        if strategy == "steps" and isinstance(steps, float) and 0 < steps < 1:  # a ratio of the run's steps
            work.notes.append(f"save_steps {steps} (a ratio of the run's steps): a checkpoint each epoch instead; "
                              "set every_n_train_steps on the ModelCheckpoint to save more often")
            strategy = "epoch"
        every = ({"every_n_train_steps": work.whole("save_steps", 500) if "save_steps" in fields else 500}
                 if strategy == "steps" else {"every_n_epochs": 1})
        limit = fields.get("save_total_limit")
        every["save_top_k"] = -1 if limit is None else int(limit)
        if limit is not None:
            every.update(monitor="step", mode="max")
        work.trainer.setdefault("callbacks", []).append(
            {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": every})
    else:
        work.refuse("save_strategy", f"is {strategy!r}: expected 'no', 'steps' or 'epoch' ('best' has no "
                    "equivalent here)")
    return {"save_strategy", "save_steps", "save_total_limit"}


def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def loggers(work: Work) -> set[str]:
    """``report_to`` as Lightning loggers (``none``: no logger; ``all``: every installed one), named ``run_name``.
    An integration whose package is not installed here, or that Lightning has no logger for, is TensorBoard
    instead, with a note: where metrics go changes nothing trained. Left out (TRL's default ``none``, its metrics on
    the console only), lit_align's default logger: it costs nothing and keeps them."""
    fields = work.fields
    if "report_to" not in fields:
        return {"report_to"}
    names = fields["report_to"]
    names = [n for n in ([names] if isinstance(names, str) else names or []) if n != "none"]
    if "all" in names:
        names = [n for n, (_, package) in LOGGERS.items() if installed(package)] or ["tensorboard"]
    chosen = []
    for name in names:
        if name not in LOGGERS or not installed(LOGGERS[name][1]):
            why = "not installed here" if name in LOGGERS else "Lightning has no logger for it"
            work.notes.append(f"report_to {name}: {why}, so TensorBoard instead (trainer.logger takes any "
                              "Lightning logger)")
            name = "tensorboard"
        if name not in chosen:
            chosen.append(name)
    built = []
    for name in chosen:
        args = {"save_dir": fields.get("output_dir") or "runs"} if name == "tensorboard" else {}
        if fields.get("run_name") is not None:
            args["name" if name != "mlflow" else "run_name"] = fields["run_name"]
        built.append({"class_path": LOGGERS[name][0], "init_args": args} if args else {"class_path": LOGGERS[name][0]})
    work.trainer["logger"] = False if not built else built[0] if len(built) == 1 else built
    return {"report_to", "run_name"}


def rewards(work: Work) -> set[str]:
    """``reward_model_name_or_path`` and ``reward_funcs``: TRL's scripts put the reward model first, then each name
    from their registry (``trl.rewards``' functions: TRL installed, pip install trl) or a dotted import path; the
    names open-r1's recipes use are open-r1's functions (``OPEN_R1``: open-r1 installed where the run happens)."""
    fields = work.fields
    names = fields.get("reward_funcs") or []
    names = [names] if isinstance(names, str) else list(names)
    funcs = [fields["reward_model_name_or_path"]] if fields.get("reward_model_name_or_path") else []
    for name in names:
        if name in TRL_REWARDS:
            funcs.append(TRL_REWARDS[name])
        elif isinstance(name, str) and "." in name:
            funcs.append(name)
        elif name in OPEN_R1:
            funcs.append(_open_r1(work, name))
        elif name in OPEN_R1_CODE:
            work.refuse("reward_funcs", f"names open-r1's {name!r}, a sandboxed code reward its script builds with "
                        "partial arguments: name a function of yours that calls it (my_pkg.rewards.code)")
        else:
            work.refuse("reward_funcs", f"names {name!r}: expected one of TRL's {sorted(TRL_REWARDS)}, open-r1's "
                        f"{sorted(OPEN_R1)} or a dotted import path (my_lib.rewards.my_reward)")
    if funcs:
        work.model["reward_funcs"] = funcs
    unused = sorted(OPEN_R1_ARGS & set(fields) - {a for n in names if isinstance(OPEN_R1.get(n), tuple)
                                                  for a, _ in OPEN_R1[n][1].values()})
    if unused:
        work.notes.append(f"dropped {', '.join(unused)} (open-r1's settings of reward functions this run does not "
                          "use)")
    return {"reward_funcs", "reward_model_name_or_path", *OPEN_R1_ARGS}


def _open_r1(work: Work, name: str) -> str | dict:
    """open-r1's reward ``name`` as its function, a factory built with the file's script arguments."""
    spec = OPEN_R1[name]
    if isinstance(spec, str):
        return spec
    factory, arguments = spec
    return {"class_path": factory, "init_args": {arg: work.fields.get(field, default)
                                                 for arg, (field, default) in arguments.items()}}


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
    if given.get("columns"):
        work.note(f"{where}.columns", "lit_align reads only the columns its row format needs")
    source = {"path": given.get("path") or given["id"], "split": given.get("split", "train")}
    if given.get("name") or given.get("config"):
        source["config_name"] = given.get("name") or given["config"]
    if weight is not None and weight != 1:  # the first rows of a seeded shuffle, as the recipes' scripts keep them
        source["fraction"] = weight
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
