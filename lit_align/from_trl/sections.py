"""The TRL fields whose value is translated, not only moved: the output directory, precision, epochs, evaluation,
checkpoints, loggers, LoRA, quantization, the hub (here), datasets (``dataset_fields``) and reward names
(``reward_names``). Each function reads ``work.fields`` (a ``Work``), writes ``work.config`` and returns the names it
handled; a value with no equivalent is a problem (``work.refuse``), collected with the others, never raised alone."""

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
